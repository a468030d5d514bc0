"""Apply a plan to a model inside one rank: mesh, tensor/sequence parallel, pipeline stages,
activation recompute and data parallel (ZeRO), on PyTorch's distributed engine.

Order, per rank: build this rank's pipeline stage modules (or keep the whole model), shard them
over ``tp`` (DTensor), wrap blocks for recompute, shard or replicate them over ``dp``
(FSDP2 / DDP), then wrap them in ``PipelineStage`` and the plan's schedule.

Data parallel and the ZeRO stages: ``autopar.runtime.data_parallel``.  Context parallel
(``autopar.runtime.context_parallel``): each rank trains on its share of every sequence, with
ring attention over ``cp``: its zigzag chunks for models whose attention and positions go
through autopar's hook (``plan.model.cp_layout == "zigzag"``), one contiguous chunk held as
sequence-sharded DTensors through the model's own forward otherwise (``"contiguous"``,
``autopar.runtime.sharded_sequence``, on a (cp, tp) mesh under tensor parallel);
gradients are averaged over dp × cp.  Expert parallel
(``autopar.runtime.expert_parallel``, ep > 1): right after the stage modules are built, each
MoE layer keeps its ep rank's experts (tp-sharded by the layer itself) and exchanges tokens by
all-to-all (autopar's own MoE layers) or runs on all-gathered tokens (any other,
``autopar.runtime.expert_gather``); expert gradients are reduced over their replicas before
the dense wrapper, which leaves them alone (``ignored_params``).

Precision (`precision`): a bf16 plan's forward passes run under bf16 autocast, its weights,
gradients and optimizer states in fp32 (the 16 bytes a parameter the plan counts); a plan
without a pipeline runs the rank's slice in the plan's micro-batches, accumulating gradients.

Loss parallel: under tensor parallel the model's output stays a DTensor; logits sharded on their
last dim (a vocab-parallel head) go to the default loss (``lm_loss``) as they are, under DTensor's
``loss_parallel`` (forward and backward), so no rank ever holds the full ``[tokens, vocab]``
logits and tp exchanges per-token statistics instead of logits, as the estimate assumes.  Any
other layout, and any custom ``loss_fn``, gets plain gathered logits.  Models may return a
tensor, a mapping or ``ModelOutput`` with ``logits``, or a tuple (``model_logits``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import loss_parallel

from autopar.config import PER_OP_ALTERNATED, PER_OP_SAVED
from autopar.models.common import recompute_attention_core, sequence_shard
from autopar.runtime.context_parallel import (
    ContextParallel,
    check_context_parallel,
    data_parallel_mesh,
)
from autopar.runtime.cp_moe import install_token_local, token_local_classes
from autopar.runtime.data_parallel import apply_data_parallel as _apply_data_parallel
from autopar.runtime.data_parallel import sync_gradients
from autopar.runtime.expert_gather import apply_gathered_experts, expert_holders
from autopar.runtime.fp8 import Float8Gemms, float8_gemms
from autopar.runtime.tp_moe import exact_moe_classes
from autopar.runtime.expert_parallel import (
    apply_expert_parallel,
    check_expert_parallel,
    expert_groups,
    find_moe_modules,
    shard_expert_params,
    sync_expert_gradients,
)
from autopar.runtime.pipeline import (
    build_stage_modules,
    install_stage_io,
    make_pipeline_stages,
    make_schedule,
    set_stage_tokens,
    stage_ids_for_rank,
)
from autopar.runtime.local_attention import LocalAttention
from autopar.runtime.sharded_sequence import RingAttentionMode, ShardedSequence
from autopar.runtime.structure import block_slots
from autopar.runtime.tensor_parallel import (
    apply_tensor_parallel,
    settle_gradients,
    stage_boundaries,
)

if TYPE_CHECKING:
    from autopar.plan.plan import Plan

__all__ = ["RuntimeModel", "apply_plan", "check_world_size", "init_distributed", "lm_loss",
           "model_logits", "precision", "shutdown"]

log = logging.getLogger(__name__)

# A plan's precision as this runtime trains it: bf16 and fp8 under bf16 autocast (fp8 with
# the GEMMs of its fp8 weights in fp8: `autopar.runtime.fp8`), with fp32 weights, gradients and
# optimizer states (16 bytes a parameter, as the plan counts them); fp32 as it is. fp16 would
# need loss scaling: it trains in fp32.
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.bfloat16}


def precision(plan: Plan, device: torch.device | str = "cpu", model: nn.Module | None = None):
    """The context to run a forward pass of `plan` in: bf16 autocast for a bf16 or fp8 plan
    (an fp8 plan also runs its fp8 weights' GEMMs in fp8, through hooks on `model`'s modules,
    which it needs), nothing otherwise. The backward pass runs in the dtypes its forward
    chose."""
    dtype = AUTOCAST_DTYPES.get(plan.training.dtype)
    if dtype is None:
        return contextlib.nullcontext()
    autocast = torch.autocast(torch.device(device).type, dtype=dtype)
    if plan.training.dtype != "fp8":
        return autocast
    if model is None:
        raise ValueError("an fp8 plan runs the GEMMs of its fp8 weights in fp8 through hooks "
                         "on the model's modules: pass the model, precision(plan, device, "
                         "model)")
    stack = contextlib.ExitStack()
    stack.enter_context(autocast)
    stack.enter_context(float8_gemms(model, plan))
    return stack


def model_logits(output: Any) -> torch.Tensor:
    """The logits in a model's output: the output itself when it is a tensor, the ``logits``
    entry of a mapping (a Hugging Face ``ModelOutput``, a dict), the first element of a tuple
    or list (nanoGPT's ``(logits, loss)``), or a ``.logits`` attribute."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        return output.logits
    raise TypeError(f"cannot find the logits in the model's output, a {type(output).__name__}: "
                    f"return a tensor, a mapping or ModelOutput with 'logits', or a tuple whose "
                    f"first element is the logits; or pass a loss function that takes the output")


def lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over all positions (of the logits in ``output``, see
    `model_logits`)."""
    logits = model_logits(output)
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def check_world_size(plan: Plan, world_size: int) -> None:
    """ValueError unless the launch has exactly the plan's number of ranks (no collectives)."""
    want = int(plan.cluster.world_size)
    if world_size != want:
        mesh = dict(zip(plan.mesh.axes, plan.mesh.sizes))
        raise ValueError(f"this plan needs {want} processes (mesh {mesh}, "
                         f"cluster {plan.cluster.profile}), but {world_size} were launched: run "
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


def _apply_recompute(modules: list[nn.Module], policy: str, every: int = 1) -> None:
    """Wrap the blocks of this rank's `modules` (its pipeline stages, in order) for `policy`;
    under "full" with `every` k, the k-th, 2k-th, ... block of the rank (torchtitan's count)."""
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

    context_fn = per_op_contexts if policy == "per_op" else _recompute_contexts
    slots = [slot for module in modules for slot in block_slots(module)]
    for count, (container, key) in enumerate(slots, start=1):
        if count % every == 0:
            setattr(container, key, checkpoint_wrapper(container.get_submodule(key),
                                                       context_fn=context_fn))


def _recompute_contexts(forward: Any = None, recompute: Any = None) -> tuple[Any, Any]:
    """The forward and recompute contexts of one checkpointed block: the recompute, which runs
    inside backward, re-enters the torch-function modes the forward ran under (the tensor-
    parallel attention mode, `LocalAttention`), so it runs the ops the forward ran. The
    recompute context may be entered more than once (a zero-bubble schedule's input- and
    weight-gradient passes each recompute the block)."""
    from torch.overrides import _get_current_function_mode_stack

    return forward or contextlib.nullcontext(), _Reentered(
        tuple(_get_current_function_mode_stack()), recompute)


class _Reentered:
    """Enters ``modes`` and then ``inner`` (if any) each time it is entered."""

    def __init__(self, modes: tuple, inner: Any):
        self._modes, self._inner, self._stacks = modes, inner, []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        for mode in self._modes:
            stack.enter_context(mode)
        if self._inner is not None:
            stack.enter_context(self._inner)
        self._stacks.append(stack)

    def __exit__(self, *exc: Any) -> bool:
        return self._stacks.pop().__exit__(*exc)


# ops that selective checkpointing must run as they come, never count or cache: FSDP2's
# unshard of a module inside a checkpointed block (experts reduced over their own replicas)
# issues them in forward and, prefetched differently, in the recompute
_SIDE_EFFECT_OPS = (("profiler", "_record_function_enter_new"),
                    ("profiler", "_record_function_exit"), ("fsdp", "all_gather_copy_in"),
                    ("fsdp", "split_with_sizes_copy"), ("fsdp", "chunk_cat"),
                    ("c10d", "_allgather_base_"), ("c10d", "_reduce_scatter_base_"),
                    ("c10d", "allreduce_"), ("c10d", "allgather_"), ("c10d", "reduce_scatter_"),
                    ("c10d", "broadcast_"))


@functools.cache
def _ignore_side_effect_ops() -> None:
    """Add `_SIDE_EFFECT_OPS` (those this torch has) to ``SAC_IGNORED_OPS``, once."""
    import torch.distributed.fsdp  # noqa: F401  (registers the fsdp ops)
    from torch.utils.checkpoint import SAC_IGNORED_OPS

    for namespace, name in _SIDE_EFFECT_OPS:
        packet = getattr(getattr(torch.ops, namespace), name, None)
        for overload in packet.overloads() if packet is not None else ():
            SAC_IGNORED_OPS.add(getattr(packet, overload))


def per_op_contexts() -> tuple[Any, Any]:
    """`_recompute_contexts` under recompute="per_op": the outputs of the ops in
    `PER_OP_SAVED` are kept, but every second `PER_OP_ALTERNATED` matmul's, counted in forward
    order from the block's start; everything else is re-run in backward (collectives and the
    profiler's marks run as they come: `_SIDE_EFFECT_OPS`)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    _ignore_side_effect_ops()

    matmuls = {False: 0, True: 0}  # forward, recompute (torch versions that ask again)

    def policy(ctx, func, *args, **kwargs):
        name = str(func)
        if name in PER_OP_ALTERNATED:
            matmuls[ctx.is_recompute] += 1
            if matmuls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return (CheckpointPolicy.MUST_SAVE if name in PER_OP_SAVED
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return _recompute_contexts(*create_selective_checkpoint_contexts(policy))


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
    context_parallel: ContextParallel | None = None  # cp > 1 through autopar's attention hook
    sequence: ShardedSequence | None = None  # cp > 1 through the model's own forward
    loss_parallel: bool = False  # the last step's loss ran on vocab-sharded logits
    tensor_parallel: bool = False  # DTensor activations: implicit replication, local attention
    default_loss: bool = True  # loss_fn is lm_loss: vocab-sharded logits may stay sharded
    selective_recompute: bool = False  # recompute="selective": re-run the attention core
    zero_stage: int = 0
    forward_context: Callable[[], Any] = contextlib.nullcontext  # `precision`
    fp8: Float8Gemms | None = None  # an fp8 plan's GEMMs (`autopar.runtime.fp8`)

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
        cp = self.context_parallel or self.sequence
        if cp is not None:
            x, y = cp.split(x), cp.split(y)
        # ring attention and global positions, forward and backward
        with sequence_shard(self.context_parallel), \
                recompute_attention_core(self.selective_recompute), \
                self._dtensor_context():
            if self.schedule is None:
                local = self._accumulate(x, y)
            else:
                set_stage_tokens(self.modules, self.sequence.join(x) if self.sequence else x,
                                 self.n_microbatches)
                args = (x,) if 0 in self.stage_ids else ()
                losses: list[torch.Tensor] = []
                kwargs = {"target": y, "losses": losses} if self.is_last else {}
                # the schedule calls self.loss (set as its loss_fn by apply_plan)
                with self.forward_context():  # the schedule runs forward and backward passes
                    self.schedule.step(*args, **kwargs)
                local = (torch.stack([_local(v.detach()) for v in losses]).mean()
                         if self.is_last else torch.zeros(()))
        if self.tensor_parallel:
            settle_gradients(self.parameters())
        sync_gradients(self.modules)
        sync_expert_gradients(self.modules)  # ep > 1, ZeRO-0: (Σ over replicas) / (dp·cp)
        # one rank per (dp, cp) pair counts: each holds the mean over the same number of tokens
        counts = self.is_last and self.tp_rank == 0
        n_counted = self.dp_size * (cp.size if cp is not None else 1)
        total = (local.float() / n_counted) if counts else torch.zeros((), dtype=torch.float32)
        total = total.to(self.device)
        dist.all_reduce(total)
        if self.context_parallel is not None:
            # once: the model's attention really went through the ring
            self.context_parallel.verify(self.device)
        if self.fp8 is not None:  # the GEMMs costed in fp8 really ran in fp8
            self.fp8.check()
        return float(total)

    def _dtensor_context(self):
        """Under tensor parallel or context parallel of the model's own forward: plain tensors
        the model makes join DTensors as replicated, attention runs on local heads (and as
        ring attention over cp: `RingAttentionMode`), and vocab-sharded logits take the
        parallel loss."""
        if self.sequence is None and not self.tensor_parallel:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(implicit_replication())
        stack.enter_context(LocalAttention() if self.sequence is None
                            else RingAttentionMode(self.sequence.mesh))
        if self.tensor_parallel and self.default_loss:
            stack.enter_context(loss_parallel())
        return stack

    def loss(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        """``loss_fn`` on the model's output: DTensor logits stay vocab-sharded for the default
        loss (under ``loss_parallel``) and are gathered to plain tensors otherwise."""
        logits = model_logits(output)
        if self.sequence is not None:  # this rank's chunk of the sequence, as its labels
            logits = self.sequence.local(logits)
        if isinstance(logits, DTensor):
            vocab = (Shard(logits.dim() - 1),)
            if self.default_loss and logits.placements == vocab:
                self.loss_parallel = True
                return self.loss_fn(logits, labels)
            logits = logits.redistribute(logits.device_mesh, (Replicate(),)).to_local()
        self.loss_parallel = False
        return self.loss_fn(logits, labels)

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
                    loss = self.loss(model(xs), ys)
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


def _example_microbatch(plan: Plan, cp: int) -> torch.Tensor:
    """One micro-batch of zeros of the plan's input: token ids of its sequence (this rank's
    share under context parallel), or the one input tensor it was planned with, for the probe
    forwards of pipeline stages and MoE layers."""
    seq, spec = plan.training.seq_len, plan.training.input
    mb = plan.config.micro_batch_size
    if seq:
        return torch.zeros(mb, int(seq) // cp, dtype=torch.long)
    if spec:
        return torch.zeros(mb, *spec["shape"], dtype=getattr(torch, spec["dtype"]))
    raise ValueError("this plan records no input shape (it is not a token model and was not "
                     "planned with one example tensor), so pipeline and expert parallel cannot "
                     "probe the model; re-plan with autopar.compile(..., example_inputs=tensor) "
                     "or with pp=1 and ep=1")


def _activation_mesh(mesh: Any, names: list[str]) -> Any:
    """The mesh of activations under context parallel of the model's own forward: cp, or
    (cp, tp) in that order whatever the device mesh's (with tp outside cp, DTensor's reduction
    of a vocab-parallel embedding's masked partial sum fails on sequence-sharded token ids),
    on the device mesh's groups."""
    from torch.distributed.device_mesh import DeviceMesh

    sub = mesh[tuple(names)]
    if names != ["tp", "cp"]:
        return sub
    return DeviceMesh.from_group([sub["cp"].get_group(), sub["tp"].get_group()],
                                 sub.device_type, mesh=sub.mesh.transpose(0, 1),
                                 mesh_dim_names=("cp", "tp"))


def apply_plan(model: nn.Module, plan: Plan, *, device: torch.device | str = "cpu",
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
    hf_config = getattr(model, "config", None)
    if getattr(hf_config, "use_cache", False) is True:  # a KV cache is state the recompute
        hf_config.use_cache = False  # would see changed; training keeps none (as the trace)
        log.info("model.config.use_cache set to False: training keeps no KV cache")
    layout = plan.model.cp_layout
    if cfg.folded:
        raise ValueError(f"this plan folds expert parallel over tp (etp=1: experts whole, ep "
                         f"{cfg.ep} over tp x cp x dp), which Megatron-Core and torchtitan run "
                         f"and this runtime does not (it splits experts over tp): run it with "
                         f"one of them (autopar export), or compile for target='autopar'")
    if cfg.cp > 1:
        check_context_parallel(plan)
    if cfg.ep > 1:
        check_expert_parallel(model, plan)
    check_world_size(plan, dist.get_world_size())
    axes, sizes = list(plan.mesh.axes), [int(s) for s in plan.mesh.sizes]
    mesh = init_device_mesh(device.type, tuple(sizes), mesh_dim_names=tuple(axes))
    deg = dict(zip(axes, sizes))
    pp, tp, dp = deg.get("pp", 1), deg.get("tp", 1), deg.get("dp", 1)
    cp = deg.get("cp", 1)
    default_loss = loss_fn is None or loss_fn is lm_loss  # generated scripts pass lm_loss
    loss_fn = loss_fn or lm_loss
    gbs = int(plan.training.global_batch_size)
    n_micro = gbs // (dp * cfg.micro_batch_size)
    # MoE sub-layers that run exactly on local tp shards, checked on the whole model
    exact_moe = exact_moe_classes(model, plan, lambda: _example_microbatch(
        plan, cp if layout == "zigzag" else 1)) if tp > 1 else set()
    # MoE sub-layers that run exactly on each cp rank's own tokens, checked likewise; with tp
    # too, those that run on both run on local shards of this rank's tokens
    token_local = token_local_classes(model, cp, lambda: _example_microbatch(plan, 1)) \
        if cp > 1 and layout == "contiguous" else set()
    if tp > 1 and cp > 1 and layout == "contiguous":
        exact_moe &= token_local
    own_moe = bool(find_moe_modules(model))  # autopar's MoE layers, before ep replaces them
    # before any module is copied or sharded: stage copies keep the hooks
    fp8 = float8_gemms(model, plan) if plan.training.dtype == "fp8" else None
    if pp > 1:
        ids = stage_ids_for_rank(mesh["pp"].get_local_rank(), pp, len(plan.stages))
        # the probe sees the sequence as the model will: a zigzag share, or the whole sequence
        modules = build_stage_modules(model, plan.stages, ids, _example_microbatch(
            plan, cp if layout == "zigzag" else 1))
    else:
        ids, modules = [0], [model]
    modules = [m.to(device) for m in modules]
    ep_groups, expert_params = None, []
    if cfg.ep > 1:  # before tp: the expert-parallel layers shard their own experts on tp
        ep_groups = expert_groups(mesh, plan)
        if own_moe:
            expert_params = apply_expert_parallel(modules, plan, ep_groups)
        else:  # MoE layers written otherwise: all-gather dispatch on the layer's own forward
            example = _example_microbatch(plan, cp if layout == "zigzag" else 1)
            expert_params = apply_gathered_experts(
                modules, model, ep_groups, example.to(next(model.parameters()).device))
    # context parallel of the model's own forward: activations on the cp (and tp) mesh
    sequence = ShardedSequence(_activation_mesh(mesh, [a for a in axes if a in ("cp", "tp")
                                                       and deg[a] > 1])) \
        if cp > 1 and layout == "contiguous" else None
    if tp > 1:
        for m, sid in zip(modules, ids):
            applied = apply_tensor_parallel(m, plan, mesh["tp"], exact_moe=exact_moe)
            if pp > 1:
                stage_boundaries(m, mesh["tp"] if sequence is None else sequence.mesh,
                                 applied.sequence_parallel, first=sid == 0,
                                 last=sid == len(plan.stages) - 1)
        if cfg.ep > 1 and not own_moe:  # tp made the experts' DTensors
            expert_params = [p for m in modules for _, ps in expert_holders(m) for p in ps]
    _apply_recompute(modules, cfg.recompute, cfg.recompute_every)
    for m, sid in zip(modules, ids):
        if pp > 1:
            install_stage_io(m)
        if sequence is not None:
            sequence.install(m, last=pp == 1 or sid == len(plan.stages) - 1)
            if tp == 1:
                install_token_local(m, mesh["cp"], token_local)
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
                      loss_fn=loss_fn, device=device, tensor_parallel=tp > 1,
                      default_loss=default_loss,
                      selective_recompute=cfg.recompute == "selective",
                      zero_stage=cfg.zero_stage if dp * cp > 1 else 0,
                      forward_context=lambda: precision(plan, device, model), fp8=fp8)
    if plan.training.dtype == "fp16":
        log.warning("fp16 plan: trains in fp32 (fp16 needs loss scaling, which this runtime "
                    "does not do); plan with dtype='bf16' to train in 16-bit")
    if sequence is not None:
        rt.sequence = sequence
    elif cp > 1:
        rt.context_parallel = ContextParallel(group=mesh["cp"].get_group(),
                                              rank=mesh["cp"].get_local_rank(), size=cp)
    if pp > 1:
        stages = make_pipeline_stages(modules, ids, len(plan.stages), device,
                                      mesh["pp"].get_group())
        rt.schedule = make_schedule(plan, stages, n_micro, rt.loss)
        rt.extra["stages"] = stages
    log.info("rank %d: mesh %s, stages %s, %d micro-batches", dist.get_rank(), deg, ids, n_micro)
    return rt
