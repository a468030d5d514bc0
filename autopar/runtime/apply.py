"""Apply a plan to a model inside one rank: mesh, tensor/sequence parallel, pipeline stages,
activation recompute and data parallel (ZeRO), on PyTorch's distributed engine.

Order, per rank: build this rank's pipeline stage modules (or keep the whole model), shard them
over ``tp`` (DTensor), wrap blocks for recompute, shard or replicate them over ``dp``
(FSDP2 / DDP), then wrap them in ``PipelineStage`` and the plan's schedule.

Data parallel and the ZeRO stages: ``autopar.runtime.data_parallel``.  Context parallel
(``autopar.runtime.context_parallel``): each rank trains on its zigzag chunks of every sequence,
with ring attention over ``cp``; gradients are averaged over dp × cp.  Expert parallel
(``autopar.runtime.expert_parallel``, ep > 1): right after the stage modules are built, each
MoE layer keeps its ep rank's experts (tp-sharded by the layer itself) and exchanges tokens by
all-to-all; expert gradients are reduced over their replicas before the dense wrapper, which
leaves them alone (``ignored_params``).

Precision (`precision`): a bf16 plan's forward passes run under bf16 autocast, its weights,
gradients and optimizer states in fp32 (the 16 bytes a parameter the plan counts); a plan
without a pipeline runs the rank's slice in the plan's micro-batches, accumulating gradients.

Loss parallel: with the default loss (``lm_loss``) and a tp-sharded LM head, the head keeps its
logits sharded on the vocabulary and the cross entropy runs under DTensor's ``loss_parallel``
(forward and backward), so no rank ever holds the full ``[tokens, vocab]`` logits and tp
exchanges per-token statistics instead of logits, as the estimate assumes.  A custom
``loss_fn`` gets gathered logits.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from autopar.models.common import recompute_attention_core, sequence_shard
from autopar.runtime.context_parallel import (
    ContextParallel,
    check_context_parallel,
    data_parallel_mesh,
)
from autopar.runtime.data_parallel import apply_data_parallel as _apply_data_parallel
from autopar.runtime.data_parallel import sync_gradients
from autopar.runtime.expert_parallel import (
    apply_expert_parallel,
    check_expert_parallel,
    expert_groups,
    shard_expert_params,
    sync_expert_gradients,
)
from autopar.runtime.pipeline import (
    build_stage_modules,
    make_pipeline_stages,
    make_schedule,
    stage_ids_for_rank,
)
from autopar.runtime.tensor_parallel import apply_tensor_parallel, vocab_sharded_head

__all__ = ["RuntimeModel", "apply_plan", "check_world_size", "init_distributed", "lm_loss",
           "precision", "shutdown"]

log = logging.getLogger(__name__)

# A plan's precision as this runtime trains it: bf16 (and fp8, whose GEMMs it does not have)
# under bf16 autocast, with fp32 weights, gradients and optimizer states (16 bytes a parameter,
# as the plan counts them); fp32 as it is. fp16 would need loss scaling: it trains in fp32.
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.bfloat16}


def precision(plan: Any, device: torch.device | str = "cpu"):
    """The context to run a forward pass of `plan` in: bf16 autocast for a bf16 (or fp8)
    plan, nothing otherwise. The backward pass runs in the dtypes its forward chose."""
    dtype = AUTOCAST_DTYPES.get(plan.training["dtype"])
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over all positions."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def check_world_size(plan: Any, world_size: int) -> None:
    """ValueError unless the launch has exactly the plan's number of ranks (no collectives)."""
    want = int(plan.cluster["world_size"])
    if world_size != want:
        raise ValueError(f"this plan needs {want} processes (mesh {dict(zip(plan.mesh['axes'], plan.mesh['sizes']))}, "
                         f"cluster {plan.cluster['profile']}), but {world_size} were launched: run "
                         f"torchrun --nproc_per_node={want} ..., or re-plan for {world_size} ranks")


def init_distributed(timeout_s: float = 60.0) -> tuple[int, int, torch.device]:
    """Initialise the default process group from torchrun's environment (gloo on CPU, nccl on
    GPU) with a short timeout, so a failure on one rank does not hang the others for 30 min.
    Returns (rank, world size, this rank's device)."""
    import os

    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def shutdown() -> None:
    """Wait for every rank, then tear the process groups down. The barrier makes sure no rank
    destroys its groups while a peer still has collectives in flight on them (with gloo that
    race can abort a process at exit after training finished)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _blocks(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """(container, key) of every block in the module's block lists (ModuleList / ModuleDict)."""
    found = []
    for child in module.children():
        if isinstance(child, nn.ModuleList):
            found += [(child, i) for i in range(len(child))]
        elif isinstance(child, nn.ModuleDict):
            found += [(child, k) for k, _ in child.items()]
    return found


def _apply_recompute(module: nn.Module, policy: str) -> None:
    if policy == "none":
        return
    if policy == "selective":  # RuntimeModel.train_step: recompute_attention_core
        log.info("recompute='selective': the attention core of unfused (math) attention in "
                 "models built on autopar.models.common.attention is re-run in backward; fused "
                 "attention keeps no score tensors, so it runs as it is")
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    for container, key in _blocks(module):
        container[key] = checkpoint_wrapper(container[key])


@dataclass
class RuntimeModel:
    """This rank's share of the model and how to run one training step on it."""

    modules: list[nn.Module]
    mesh: Any
    dp_rank: int
    dp_size: int
    tp_rank: int
    stage_ids: list[int]
    num_stages: int
    n_microbatches: int
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    schedule: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    context_parallel: ContextParallel | None = None  # cp > 1: this rank's place in the cp ring
    loss_parallel: bool = False  # the head's logits stay vocab-sharded; loss under loss_parallel
    selective_recompute: bool = False  # recompute="selective": re-run the attention core
    zero_stage: int = 0
    forward_context: Callable[[], Any] = contextlib.nullcontext  # `precision`

    def parameters(self):
        seen = set()
        for m in self.modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        """Forward and backward on this rank's data-parallel slice of the global batch (and,
        under context parallel, its zigzag chunks of each sequence); returns the global mean loss
        (the same number on every rank)."""
        if inputs.shape[0] % self.dp_size:
            raise ValueError(f"global batch {inputs.shape[0]} is not divisible by dp={self.dp_size}")
        b = inputs.shape[0] // self.dp_size
        x = inputs[self.dp_rank * b:(self.dp_rank + 1) * b]
        y = labels[self.dp_rank * b:(self.dp_rank + 1) * b]
        cp = self.context_parallel
        if cp is not None:
            x, y = cp.split(x), cp.split(y)
        vocab_parallel = loss_parallel() if self.loss_parallel else contextlib.nullcontext()
        # ring attention and global positions, forward and backward
        with sequence_shard(cp), recompute_attention_core(self.selective_recompute), \
                vocab_parallel:
            if self.schedule is None:
                local = self._accumulate(x, y)
            else:
                args = (x,) if 0 in self.stage_ids else ()
                losses: list[torch.Tensor] = []
                kwargs = {"target": y, "losses": losses} if self.is_last else {}
                with self.forward_context():  # the schedule runs forward and backward passes
                    self.schedule.step(*args, **kwargs)
                local = (torch.stack([_local(v.detach()) for v in losses]).mean()
                         if self.is_last else torch.zeros(()))
        sync_gradients(self.modules)
        sync_expert_gradients(self.modules)  # ep > 1, ZeRO-0: (Σ over replicas) / (dp·cp)
        # one rank per (dp, cp) pair counts: each holds the mean over the same number of tokens
        counts = self.is_last and self.tp_rank == 0
        n_counted = self.dp_size * (cp.size if cp is not None else 1)
        total = (local.float() / n_counted) if counts else torch.zeros((), dtype=torch.float32)
        total = total.to(self.device)
        dist.all_reduce(total)
        if cp is not None:
            cp.verify(self.device)  # once: the model's attention really went through the ring
        return float(total)

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's slice without a pipeline: `n_microbatches`
        micro-batches of the plan's size, one after another, each loss scaled by 1/n so that
        the gradients sum to those of the slice's mean loss; returns that mean. Gradients are
        reduced once, after the last micro-batch (DDP's no_sync before it, FSDP2's
        set_requires_gradient_sync(False) under ZeRO-1, which keeps them whole until then),
        except under ZeRO-2 and -3, whose FSDP2 reduce-scatters each micro-batch's to keep
        them sharded."""
        model, n = self.modules[0], self.n_microbatches
        if len(x) % n:
            raise ValueError(f"this rank's {len(x)} sequences do not split into the plan's {n} "
                             f"micro-batches: train on the plan's global batch")
        losses = []
        for k, (xs, ys) in enumerate(zip(x.chunk(n), y.chunk(n))):
            with _gradient_sync(model, k == n - 1 or self.zero_stage >= 2):
                with self.forward_context():
                    loss = self.loss_fn(model(xs), ys)
                (loss / n if n > 1 else loss).backward()
            losses.append(_local(loss.detach()))
        return losses[0] if n == 1 else torch.stack(losses).mean()


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, sync: bool):
    """Whether the data-parallel wrapper of `model` reduces the gradients of this backward:
    DDP's no_sync, FSDP2's set_requires_gradient_sync; the manual all-reduce runs after the
    step's backward anyway (`sync_gradients`)."""
    if sync:
        yield
    elif hasattr(model, "no_sync"):  # DistributedDataParallel
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def _local(t: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under loss parallel it is a replicated DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def apply_plan(model: nn.Module, plan: Any, *, device: torch.device | str = "cpu",
               loss_fn: Callable | None = None) -> RuntimeModel:
    """Shard ``model`` (the full model with its weights, identical on every rank) as ``plan``
    says.  Needs an initialised default process group of the plan's world size."""
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(device)
    meta = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:
        raise ValueError(f"the model is on the meta device ({meta[0]} and {len(meta) - 1} more "
                         f"tensors have no data), so there are no weights to train: build it "
                         f"with weights (e.g. autopar.models.build(..., device='cpu')), or call "
                         f"model.to_empty(device='cpu') and initialise it first")
    cfg = plan.config
    if cfg.cp > 1:
        check_context_parallel(plan)
    if cfg.ep > 1:
        check_expert_parallel(model, plan)
    check_world_size(plan, dist.get_world_size())
    axes, sizes = list(plan.mesh["axes"]), [int(s) for s in plan.mesh["sizes"]]
    mesh = init_device_mesh(device.type, tuple(sizes), mesh_dim_names=tuple(axes))
    deg = dict(zip(axes, sizes))
    pp, tp, dp = deg.get("pp", 1), deg.get("tp", 1), deg.get("dp", 1)
    cp = deg.get("cp", 1)
    default_loss = loss_fn is None or loss_fn is lm_loss  # generated scripts pass lm_loss
    loss_fn = loss_fn or lm_loss
    gbs = int(plan.training["global_batch_size"])
    n_micro = gbs // (dp * cfg.micro_batch_size)
    if pp > 1:
        ids = stage_ids_for_rank(mesh["pp"].get_local_rank(), pp, len(plan.stages))
        modules = build_stage_modules(model, plan.stages, ids)
    else:
        ids, modules = [0], [model]
    modules = [m.to(device) for m in modules]
    ep_groups, expert_params = None, []
    if cfg.ep > 1:  # before tp: the expert-parallel layers shard their own experts on tp
        ep_groups = expert_groups(mesh, plan)
        expert_params = apply_expert_parallel(modules, plan, ep_groups)
    vocab_parallel = False
    if tp > 1:
        for m in modules:
            styles = apply_tensor_parallel(m, plan, mesh["tp"], loss_parallel=default_loss)
            vocab_parallel |= vocab_sharded_head(styles)
        if vocab_parallel:
            log.info("the loss runs on vocab-sharded logits (DTensor loss_parallel)")
    for m in modules:
        _apply_recompute(m, cfg.recompute)
    if ep_groups is not None:  # experts: reduced over their replicas, before the dense wrapper
        for m in modules:
            shard_expert_params(m, plan, ep_groups)
    if dp * cp > 1:  # cp ranks hold the same parameters too: average gradients over dp × cp
        dp_mesh = data_parallel_mesh(mesh)
        modules = [_apply_data_parallel(m, plan, dp_mesh, pure_dp=(pp == 1 and tp == 1),
                                        ignored_params=set(expert_params) or None)
                   for m in modules]
    rt = RuntimeModel(modules=modules, mesh=mesh,
                      dp_rank=mesh["dp"].get_local_rank() if dp > 1 else 0, dp_size=dp,
                      tp_rank=mesh["tp"].get_local_rank() if tp > 1 else 0, stage_ids=ids,
                      num_stages=len(plan.stages) if pp > 1 else 1, n_microbatches=n_micro,
                      loss_fn=loss_fn, device=device, loss_parallel=vocab_parallel,
                      selective_recompute=cfg.recompute == "selective",
                      zero_stage=cfg.zero_stage if dp * cp > 1 else 0,
                      forward_context=lambda: precision(plan, device))
    if plan.training["dtype"] == "fp16":
        log.warning("fp16 plan: trains in fp32 (fp16 needs loss scaling, which this runtime "
                    "does not do); plan with dtype='bf16' to train in 16-bit")
    if cp > 1:
        rt.context_parallel = ContextParallel(group=mesh["cp"].get_group(),
                                              rank=mesh["cp"].get_local_rank(), size=cp)
    if pp > 1:
        stages = make_pipeline_stages(modules, ids, len(plan.stages), device,
                                      mesh["pp"].get_group())
        rt.schedule = make_schedule(plan, stages, n_micro, loss_fn)
        rt.extra["stages"] = stages
    log.info("rank %d: mesh %s, stages %s, %d micro-batches", dist.get_rank(), deg, ids, n_micro)
    return rt
