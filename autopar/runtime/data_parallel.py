"""Data parallelism with the plan's ZeRO stage, over a 1-D mesh of the ranks that hold the same
parameters and train on different data (dp, or dp×cp flattened under context parallel).

Mapping:

* ZeRO-0, plain tensors only (no tensor parallel): ``DistributedDataParallel``, without its
  broadcast of the buffers before every forward (a collective per micro-batch the estimate
  does not charge; buffers are each rank's own under every other mapping too, batch-norm
  statistics included).
* ZeRO-0 otherwise (DTensor parameters under tensor parallel, pipeline stages, parameters left
  to another owner): full replicas, and after backward one bucketed all-reduce per dtype of the
  local gradients, divided by the group size (DDP's numerics, without overlap).
* ZeRO-1, -2 and -3: FSDP2 ``fully_shard`` per block (``structure.blocks``) and at the root
  (what is not in a block), which shards the parameters, gradients and optimizer states.
  Without a pipeline, FSDP2 gathers each unit's parameters again for every micro-batch's forward
  (it reshards after every backward); ZeRO-3 reshards after the forward too
  (``reshard_after_forward=True``) and gathers again for the backward; ZeRO-2 and -3
  reduce-scatter every micro-batch's gradients, ZeRO-1 only the last micro-batch's (FSDP2's
  ``set_requires_gradient_sync(False)`` before it, so its gradients stay whole as ZeRO-1's
  are).  Under a pipeline every stage keeps its parameters gathered and its gradients whole from
  the first micro-batch to its last backward (torch.distributed.pipelining turns FSDP2's
  reshard-after-backward and gradient sync off until then; ZeRO-3 runs
  ``reshard_after_forward=False``, torchtitan's default with a pipeline, since resharding
  after a forward would only gather again for the next backward): one all-gather and one
  reduce-scatter per unit a step, and every stage holds at its peak what ZeRO-1 holds
  (`reshards_after_forward`; the estimate's ``EstimateOptions.fsdp2``).

A bf16 (or fp8) plan's FSDP2 gathers its parameters in bf16 and reduces gradients in fp32
(`fsdp_precision`), the bytes the estimate costs; the shards, gradients and AdamW states stay
fp32. Replicated parameters stay fp32 and autocast casts them per forward.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.runtime.structure import blocks

if TYPE_CHECKING:
    from autopar.plan.plan import Plan

__all__ = ["apply_data_parallel", "fsdp_precision", "reshards_after_forward", "sync_gradients"]

# module → the manual gradient all-reduce that runs after its backward (ZeRO-0 without DDP)
_SYNCS: weakref.WeakKeyDictionary[nn.Module, _GradientAllReduce] = weakref.WeakKeyDictionary()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind a DTensor (a view that in-place ops write through)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class _GradientAllReduce:
    """Averages the local gradients of ``params`` over ``group``: one flat all-reduce per dtype.
    A gradient that is a Partial DTensor on the tp axis (sequence-parallel norm weights) is
    reduced as its local partial sum, which commutes with the later tp reduction."""

    def __init__(self, params: list[nn.Parameter], group: Any, size: int):
        self.params, self.group, self.size = params, group, size

    def __call__(self) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.params:
            if p.grad is None:
                raise RuntimeError("a replicated parameter got no gradient on this rank; every "
                                   "data-parallel replica must use all its parameters")
            g = _local(p.grad)
            by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.size)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def sync_gradients(modules: list[nn.Module]) -> None:
    """Run the manual gradient all-reduce of every module that has one (after backward)."""
    for m in modules:
        sync = _SYNCS.get(m)
        if sync is not None:
            sync()


def _has_dtensor(params: list[nn.Parameter]) -> bool:
    return any(hasattr(p, "_local_tensor") for p in params)


def apply_data_parallel(module: nn.Module, plan: Plan, dp_mesh: Any, *, pure_dp: bool,
                        ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """Replicate or shard ``module`` over ``dp_mesh`` (each of its ranks trains on its own slice
    of the batch; gradients are averaged over it) as the plan's ZeRO stage says.  Returns the
    module to run (DDP wraps it; otherwise it is ``module`` itself).  ``ignored_params`` (e.g.
    experts under expert parallel) are left alone: their owner reduces their gradients.
    ``pure_dp``: no other parallelism touches this module, so DDP may wrap it."""
    zero = plan.config.zero_stage
    ignored = set(ignored_params or ())
    params = [p for p in module.parameters() if p not in ignored]
    if zero == 0:
        if pure_dp and not ignored and not _has_dtensor(params):
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(module, process_group=dp_mesh.get_group(),
                                           broadcast_buffers=False)
        _SYNCS[module] = _GradientAllReduce([p for p in params if p.requires_grad],
                                            dp_mesh.get_group(), dp_mesh.size())
        return module
    from torch.distributed.fsdp import fully_shard

    policy = fsdp_precision(plan)
    reshard = reshards_after_forward(plan)
    placement = _fsdp_placement(dp_mesh.size())
    for block in blocks(module):
        mine = {p for p in block.parameters() if p in ignored}
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard,
                    ignored_params=mine or None, shard_placement_fn=placement,
                    mp_policy=policy)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard,
                ignored_params=ignored or None, shard_placement_fn=placement,
                mp_policy=policy)
    return module


def reshards_after_forward(plan: Plan) -> bool:
    """Whether FSDP2 frees the gathered parameters after each forward: ZeRO-3 without a
    pipeline. Under a pipeline a stage keeps them gathered from its first backward to the end
    of the step (torch.distributed.pipelining), so resharding after a forward would only gather
    them again for the next backward: ZeRO-3 keeps them, as torchtitan's default does (and
    resharding between the zero-bubble schedule's B and W passes gives wrong gradients on
    torch 2.13)."""
    return plan.config.zero_stage == 3 and plan.config.pp == 1


def fsdp_precision(plan: Plan) -> Any:
    """FSDP2's mixed precision for `plan`: parameters gathered in bf16 and gradients reduced
    in fp32 for a bf16 or fp8 plan (torchtitan's policy), none otherwise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if plan.training.dtype in ("bf16", "fp8"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _fsdp_placement(size: int):
    """Where FSDP2 shards each parameter over a dp mesh of `size` ranks: for a 2-D weight
    that tensor parallel placed within chunks (``_StridedShard``, a fused q/k/v projection's
    output features: dim 0 of nn.Linear's ``[out, in]``, dim 1 of GPT-2's ``[in, out]`` Conv1D)
    the other dim, since FSDP cannot split those features again without breaking the heads
    while the input features are free; otherwise dim 0 (the default) when its rank-local size
    splits evenly, else the first dim that does, so that FSDP2 pads nothing (a ``[1, n, d]``
    position table padded on dim 0 would gather `size` times its bytes)."""

    def place(param: nn.Parameter) -> Shard | None:
        if isinstance(param, DTensor) and param.ndim == 2:
            strided = {p.dim for p in param.placements if isinstance(p, _StridedShard)}
            if 0 in strided:
                return Shard(1)
        shape = _local(param).shape
        if not shape or shape[0] % size == 0:
            return None
        even = [d for d, n in enumerate(shape) if n % size == 0]
        return Shard(even[0]) if even else None

    return place
