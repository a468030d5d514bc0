"""Tensor and sequence parallelism from a plan's per-parameter placements, with DTensor, on the
user's unchanged model code.

The plan says, per parameter and per mesh axis, "R" (replicated) or "S(dim)" (sharded on that
tensor dimension).  On the ``tp`` axis every parameter becomes a DTensor with that placement
(``Shard(dim)`` or ``Replicate()``), whatever module holds it (``nn.Linear``, Hugging Face's
``Conv1D``, a stacked expert weight, a hand-written norm): no style is chosen by module class
or name.  The activations are DTensors too, from the first op that touches a parameter to the
model's output, so the model's own forward runs as written with global shapes: a view
``.view(b, s, n_heads, head_dim)`` of a column-parallel projection comes out sharded on the
heads, RoPE slicing, ``repeat_interleave``/``expand`` of k/v heads and ``stack`` follow the
placements, and any layout DTensor cannot keep sharded (a fused projection split where its
shards do not align with the split, kv heads fewer than tp) is redistributed by DTensor itself,
so the numbers stay those of the reference.  Plain tensors the model makes (RoPE tables,
masks, positions) join as replicated under ``implicit_replication``, which the step runs in.

What the hooks add, per module that directly holds a tp-sharded parameter:

* after it: a partial-sum output (row-parallel GEMM, vocab-parallel embedding) is reduced:
  all-reduced to replicated, or, under sequence parallel, reduce-scattered on the sequence dim
  (dim 1 of ``[batch, seq, ...]``), as the estimate costs it.  The result passes a
  ``to_local``/``from_local`` pair, whose backward turns any incoming gradient layout into that
  placement (DTensor cannot redistribute a partial gradient into a vocab-masked one).

Row-parallel GEMMs whose partial outputs are summed before one reduction (a parallel
attention and MLP, the plan's ``summed_row_weights``) are not reduced after them: DTensor adds
their partial sums, and the sum is reduced where it meets the stream (reduce-scattered to its
sequence shard under sequence parallel, by a redistribute of its own,
`local_attention.LocalAttention`) or as it leaves the block.

Under sequence parallel, each sub-layer (a child of a block that holds tp-sharded parameters:
attention, MLP, MoE) all-gathers its sequence-sharded input on entry (Megatron's ``g``), so its
GEMMs read the full sequence rather than DTensor gathering a weight, and token routing sees
whole sequences; the norms between sub-layers run on the sequence shard, and their partial-sum
weight gradients are all-reduced once a step in one buffer (``settle_gradients``). Without
it, a sub-layer's replicated input has its gradient all-reduced as it leaves the sub-layer
(Megatron's ``f``), so the ops before it -- a norm, its weight -- see whole gradients. Sub-layers
of a block that read one tensor (both branches of a parallel block after one norm) share its
gather, and the one reduction of their summed gradients.

Scaled-dot-product attention has no DTensor strategy on CPU: the step runs under
`autopar.runtime.local_attention.LocalAttention`, which runs it on the local heads.

Output-channel parallel convolutions (``nn.Conv1d/2d/3d`` sharded on dim 0 over tp) keep a
module of their own (``ChannelParallelConv{1,2,3}d``: each rank convolves the full input with its channels
and the output is all-gathered on the channel dim, so batch norms see full activations).

Parameters tied to each other (an LM head that reuses the token embedding) are distributed once
and tied again.  Sub-modules that shard their own parameters over tp (expert-parallel MoE
layers, ``handles_own_tensor_parallel``) run on plain local tensors: their inputs are gathered
to replicated local tensors and their outputs rejoin as replicated DTensors.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_map

from autopar.ir import SEQUENCE_DIM
from autopar.runtime.expert_gather import split_rows_over_tp
from autopar.runtime.pipeline import tied_parameters
from autopar.runtime.structure import block_names, block_slots
from autopar.runtime.tp_moe import install_local_moe, local_moe_sublayers

if TYPE_CHECKING:
    from autopar.plan.plan import Plan

__all__ = ["TensorParallel", "apply_tensor_parallel", "on_sequence_view", "settle_gradients",
           "stage_boundaries", "tp_dims"]

log = logging.getLogger(__name__)

_SHARD = re.compile(r"^S\((-?\d+)\)$")
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _aliases(module: nn.Module) -> dict[str, str]:
    """{FQN: first FQN of the same parameter} for tied parameters (the plan keys the first)."""
    return {name: group[0] for group in tied_parameters(module) for name in group[1:]}


def _tp_dim(placements: dict[str, dict[str, str]], fqn: str) -> int | None:
    """The tensor dim the plan shards parameter ``fqn`` on over the tp axis, or None."""
    spec = placements.get(fqn, {}).get("tp", "R")
    if spec in ("R", "P"):
        return None
    m = _SHARD.match(spec)
    if not m:
        raise ValueError(f"placement {spec!r} of {fqn} on the tp axis is not 'R', 'P' or 'S(d)'")
    return int(m.group(1))


def _own_prefixes(module: nn.Module) -> list[str]:
    """Layers that shard their own parameters on tp (expert-parallel MoE layers)."""
    return [name for name, mod in module.named_modules()
            if getattr(mod, "handles_own_tensor_parallel", False)]


def _under(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def tp_dims(module: nn.Module, placements: dict[str, dict[str, str]]) -> dict[str, int]:
    """``{parameter FQN: dim}`` of every parameter of ``module`` the plan shards on tp (a tied
    parameter under each of its names, with the placement of its first name), leaving out the
    sub-modules that shard their own (``handles_own_tensor_parallel``)."""
    aliases, own = _aliases(module), _own_prefixes(module)
    out = {}
    for fqn, p in module.named_parameters(remove_duplicate=False):
        if _under(fqn.rpartition(".")[0], own):
            continue
        dim = _tp_dim(placements, aliases.get(fqn, fqn))
        if dim is not None:
            out[fqn] = dim % p.dim()
    return out


def _check_conv(name: str, mod: nn.Module, dim: int, tp: int) -> None:
    """ValueError (naming the module) for conv layouts this runtime cannot run."""
    if type(mod) not in _CONVS:
        raise ValueError(f"{name}: tensor parallel runs plain nn.Conv1d/2d/3d, this is a "
                         f"{type(mod).__name__} with its own class; plan this model with tp=1 "
                         f"(constraints={{'tp': 1}}) or use a plain convolution")
    if dim != 0:
        raise ValueError(f"{name}: the plan shards this convolution's weight on dim {dim} "
                         f"(input channels) over tp; this runtime runs only output-channel "
                         f"parallel convolutions (S(0) on tp); plan this model with tp=1 "
                         f"(constraints={{'tp': 1}})")
    if mod.groups != 1:
        raise ValueError(f"{name}: a grouped convolution (groups={mod.groups}) cannot be split "
                         f"on its output channels by this runtime (each group reads its own "
                         f"input channels); only groups=1 convolutions run tensor-parallel: "
                         f"plan this model with tp=1 (constraints={{'tp': 1}})")
    if mod.out_channels % tp:
        raise ValueError(f"{name}: the plan shards its {mod.out_channels} output channels "
                         f"over tp={tp}, which does not divide them; this runtime splits "
                         f"channels evenly: plan with a tp that divides every sharded "
                         f"convolution's channels (or tp=1)")


class _ChannelParallelConv:
    """Forward of an output-channel parallel convolution whose weight (and bias) are DTensors
    ``Shard(0)`` on the tp mesh: this rank convolves the replicated input with its channels, and
    the output is all-gathered on the channel dim (dim 1), so the next layer sees the full
    activation.  Backward: the output gradient is cut to this rank's channels (no traffic) and
    the input gradient, a partial sum over the local channels, is all-reduced over tp."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = self.weight.device_mesh
        x = x.redistribute(mesh, (Replicate(),)) if isinstance(x, DTensor) else \
            _replicated(x, mesh)
        # the local input gradient covers only this rank's channels: Partial, summed in backward
        x = x.to_local(grad_placements=(Partial(),))
        bias = None if self.bias is None else self.bias.to_local()
        out = self._conv_forward(x, self.weight.to_local(), bias)
        out = DTensor.from_local(out, mesh, (Shard(1),), run_check=False)
        return out.redistribute(mesh, (Replicate(),))


class ChannelParallelConv1d(_ChannelParallelConv, nn.Conv1d):
    """``nn.Conv1d`` run output-channel parallel (see ``_ChannelParallelConv``)."""


class ChannelParallelConv2d(_ChannelParallelConv, nn.Conv2d):
    """``nn.Conv2d`` run output-channel parallel (see ``_ChannelParallelConv``)."""


class ChannelParallelConv3d(_ChannelParallelConv, nn.Conv3d):
    """``nn.Conv3d`` run output-channel parallel (see ``_ChannelParallelConv``)."""


_CHANNEL_PARALLEL = {nn.Conv1d: ChannelParallelConv1d, nn.Conv2d: ChannelParallelConv2d,
                   nn.Conv3d: ChannelParallelConv3d}


def tp_axis(t: DTensor) -> int:
    """The dim of ``t``'s mesh that is tp: the one named "tp" (activations under context
    parallel of a model's own forward lie on a (cp, tp) mesh, `sharded_sequence`), else the
    last."""
    names = t.device_mesh.mesh_dim_names or ()
    return names.index("tp") if "tp" in names else t.device_mesh.ndim - 1


def tp_placement(t: DTensor) -> Any:
    """``t``'s placement on the tp dim of its mesh."""
    return t.placements[tp_axis(t)]


def with_tp(t: DTensor, placement: Any) -> tuple:
    """``t``'s placements with the one on the tp dim replaced by ``placement``."""
    out = list(t.placements)
    out[tp_axis(t)] = placement
    return tuple(out)


def _replicated(t: Any, mesh: Any) -> Any:
    """A plain floating tensor as a replicated DTensor on ``mesh``; anything else as it is."""
    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.is_floating_point():
        return DTensor.from_local(t, mesh, (Replicate(),), run_check=False)
    return t


def _settle(t: Any, target: Any) -> Any:
    """A DTensor output reduced to placement ``target`` on tp if it is a partial sum, behind a
    ``to_local`` / ``from_local`` pair whose backward hands any gradient layout on as
    ``target``."""
    if not isinstance(t, DTensor) or not any(p.is_partial() for p in t.placements):
        return t
    placements = with_tp(t, target)
    t = t.redistribute(t.device_mesh, placements)
    return DTensor.from_local(t.to_local(), t.device_mesh, placements, run_check=False)


def _token_shard(t: DTensor) -> bool:
    """Whether ``t`` (``[batch, seq, ...]`` or ``[seq, batch, ...]``) is sharded on one of its
    token dims (the sequence, dim 0 of a sequence-first block's stream), not its features."""
    p = tp_placement(t)
    return type(p) is Shard and p.dim in (0, SEQUENCE_DIM) and p.dim < t.dim() - 1


def _gather_sequence(t: Any) -> Any:
    """``t`` gathered over tp if it is the stream's sequence shard: ``[batch, seq, ...]``
    sharded on the sequence (``[seq, batch, ...]`` of a sequence-first block on dim 0), or its
    tokens flattened to ``[batch * seq, ...]`` (OPT's MLP), sharded on them."""
    if not isinstance(t, DTensor):
        return t
    p = tp_placement(t)
    if t.dim() > SEQUENCE_DIM + 1 and _token_shard(t) or t.dim() == 2 and p == Shard(0):
        whole = t.redistribute(t.device_mesh, with_tp(t, Replicate()))
        # the shard it was gathered from: a residual add inside the sub-layer reads that
        # instead (BERT's post-norm output; `local_attention._shard_of`)
        whole.gathered_from = t
        return whole
    if t.dim() == 2 and isinstance(p, _StridedShard) and p.dim == 0 and t.device_mesh.ndim == 1:
        return on_sequence_view(t, p.split_factor, Replicate())
    return t


def on_sequence_view(t: DTensor, batch: int, target: Any) -> DTensor:
    """``t`` (on a 1-D tp mesh), its batch and sequence flattened (``[batch * seq, ...]``, the
    stream's sequence shard as ``_StridedShard(0, batch)``), redistributed to placement
    ``target`` on the sequence of its ``[batch, seq, ...]`` view: gathered, its gradient
    reduce-scattered back, or a partial sum reduce-scattered into it (DTensor would all-reduce
    into the strided layout)."""
    split = t.view(batch, t.shape[0] // batch, *t.shape[1:])
    return split.redistribute(t.device_mesh, (target,)).view(t.shape)


def _reduce_gradient(t: Any) -> Any:
    """A DTensor input replicated over tp behind a ``to_local`` / ``from_local`` pair: its
    gradient, partial sums from the sub-layer's column-parallel GEMMs, is all-reduced there."""
    if isinstance(t, DTensor) and t.requires_grad and tp_placement(t) == Replicate():
        return DTensor.from_local(t.to_local(), t.device_mesh, t.placements, run_check=False)
    return t


def _to_local_replicated(t: Any) -> Any:
    if isinstance(t, DTensor):
        return t.redistribute(t.device_mesh, (Replicate(),) * t.device_mesh.ndim).to_local()
    return t


@dataclass
class TensorParallel:
    """What ``apply_tensor_parallel`` did to a module: the tp mesh, whether sequence parallel is
    on, and the parameter dims it sharded."""

    mesh: Any
    sequence_parallel: bool
    sharded: dict[str, int] = field(default_factory=dict)


def _distribute(module: nn.Module, mesh: Any, dims: dict[str, int], own: list[str],
                chunks: dict[str, int], fsdp_follows: bool, local_moe: list[str]
                ) -> None:
    """Every parameter of ``module`` (outside ``own`` subtrees) becomes a DTensor on ``mesh``,
    sharded on the plan's dim or replicated; tied parameters stay one object.  A fused
    projection's weight and bias (``chunks``: k head-major chunks of output features) are
    sharded within each chunk (``_StridedShard(0, k)``), so a rank holds whole heads of each;
    when FSDP2 shards the parameters next (``fsdp_follows``) the 1-D bias, which it
    cannot shard again, stays replicated on tp (and a rank slices its heads in forward)."""
    done: dict[int, nn.Parameter] = {}
    for fqn, p in list(module.named_parameters(remove_duplicate=False)):
        owner_name, _, pname = fqn.rpartition(".")
        if _under(owner_name, own):
            continue
        owner = module.get_submodule(owner_name)
        new = done.get(id(p))
        if new is None:
            placement = _placement(fqn, p, dims, chunks, mesh.size(), fsdp_follows)
            if isinstance(p, DTensor):  # a fused expert weight's rows on the ep mesh
                if not _under(owner_name, local_moe):
                    raise ValueError(
                        f"{fqn}: fused expert weights split over ep and tp run only in an MoE "
                        f"sub-layer that runs on its local tp shards, and this one does not "
                        f"(its output is not the sum of its tp ranks' outputs: see the warning "
                        f"above); plan with ep=1 or tp=1")
                value = split_rows_over_tp(p, mesh, placement)
            else:
                value = distribute_tensor(p.detach(), mesh, placement)
            new = nn.Parameter(value, requires_grad=p.requires_grad)
            done[id(p)] = new
        owner.register_parameter(pname, new)


def _placement(fqn: str, p: torch.Tensor, dims: dict[str, int], chunks: dict[str, int],
               size: int, fsdp_follows: bool) -> tuple:
    """The tp placement of parameter ``fqn`` (see `_distribute`). A dim tp does not divide
    (GPT-2's vocabulary of 50,257 tokens) is sharded unevenly, as DTensor shards (the last
    ranks hold a row fewer), unless FSDP2 shards the parameter again (``fsdp_follows``:
    DTensor cannot gather such a two-level uneven layout)."""
    dim = dims.get(fqn)
    if dim is not None and p.shape[dim] % size and fsdp_follows:
        raise ValueError(f"{fqn} {tuple(p.shape)}: the plan shards dim {dim} over tp={size}, "
                         f"which does not divide it, and FSDP shards it again over dp; "
                         f"re-plan with a tp that divides it, zero_stage=0, or tp=1")
    k = chunks.get(fqn, 1) if dim is not None else 1
    if k > 1 and p.dim() == 1 and fsdp_follows:
        return (Replicate(),)
    if k > 1 and p.shape[dim] % (k * size) == 0:
        return (_StridedShard(dim, split_factor=k),)
    return (Replicate(),) if dim is None else (Shard(dim),)


def apply_tensor_parallel(module: nn.Module, plan: Plan, tp_mesh: Any, *,
                          exact_moe: set[type] = frozenset()) -> TensorParallel:
    """Shard ``module`` (the whole model or one pipeline stage; FQNs as in the plan) over
    ``tp_mesh`` as the plan's placements say; see the module docstring.  Sub-layers holding
    an MoE layer of the ``exact_moe`` classes (`tp_moe.exact_moe_classes`) run on local
    shards with one reduction (`tp_moe`).  Raises ValueError for layouts this runtime cannot
    run, before any collective."""
    tp = tp_mesh.size()
    dims = tp_dims(module, plan.placements)
    own = _own_prefixes(module)
    convs = {}
    for fqn, dim in dims.items():
        name = fqn.rpartition(".")[0]
        mod = module.get_submodule(name)
        if isinstance(mod, nn.modules.conv._ConvNd):
            _check_conv(name, mod, dim, tp)
            convs[name] = mod
    cfg = plan.config
    sp = bool(cfg.sequence_parallel)
    fsdp_follows = cfg.zero_stage >= 1 and cfg.dp * cfg.cp > 1
    chunks = plan.model.fused_projections or {}
    holders = {fqn.rpartition(".")[0] for fqn in dims} - set(convs)
    entries = _sublayer_entries(module, holders)
    local_moe = local_moe_sublayers(module, entries, own, exact_moe)
    _distribute(module, tp_mesh, dims, own, chunks, fsdp_follows=fsdp_follows,
                local_moe=local_moe)
    for mod in convs.values():
        mod.__class__ = _CHANNEL_PARALLEL[type(mod)]
    for name, mod in module.named_modules():
        if isinstance(mod, nn.modules.conv._ConvNd) and name not in convs \
                and not _under(name, own):  # replicated: DTensor's backward wants a DTensor
            mod.register_forward_pre_hook(lambda _m, args: tree_map(
                lambda t: _replicated(t, tp_mesh), args))
    seq = Shard(SEQUENCE_DIM) if sp else Replicate()
    enter = _gather_sequence if sp else _reduce_gradient
    shared = _SharedEntries(enter, first_only=sp)
    layers = block_names(module)
    in_block = lambda name: [b for b in layers if name.startswith(b + ".")]  # noqa: E731
    for name in sorted(entries):
        module.get_submodule(name).register_forward_pre_hook(
            shared.enter if in_block(name) else lambda _m, args, kwargs: (
                tree_map(enter, args), tree_map(enter, kwargs)), with_kwargs=True)
    for name in local_moe:
        install_local_moe(module.get_submodule(name), tp_mesh, sp, SEQUENCE_DIM)
    stream = {"placement": seq}  # the block's stream as it entered (sequence-first: dim 0)

    def enter_block(_m, args, kwargs):
        first = next((t for t in (*args, *kwargs.values()) if isinstance(t, DTensor)), None)
        stream["placement"] = tp_placement(first) if first is not None and sp and \
            first.dim() > SEQUENCE_DIM + 1 and _token_shard(first) else seq

    def settle(flat_stays: bool):
        """A forward hook reducing partial outputs (under sequence parallel in a block, to the
        block's stream shard); with ``flat_stays`` one on flattened tokens stays partial (a
        block's GEMM under sequence parallel: the add of the stream's flattened shard
        reduce-scatters it, `LocalAttention`)."""
        def reduce(t: Any) -> Any:
            if not isinstance(t, DTensor) or flat_stays and t.dim() <= SEQUENCE_DIM + 1:
                return t
            target = stream["placement"] if flat_stays else seq
            return _settle(t, target if t.dim() > SEQUENCE_DIM + 1 else Replicate())
        return lambda _m, _args, out: tree_map(reduce, out)

    summed = {fqn.rpartition(".")[0] for fqn in plan.model.summed_row_weights or ()}
    for name in sorted(holders - summed):
        module.get_submodule(name).register_forward_hook(settle(sp and bool(in_block(name))))
    summing = {b for name in holders & summed for b in in_block(name)}
    for name in layers:
        block = module.get_submodule(name)
        block.register_forward_pre_hook(enter_block, with_kwargs=True)
        block.register_forward_pre_hook(shared.clear)
        block.register_forward_hook(shared.clear)
        if name in summing:
            block.register_forward_hook(settle(False))  # a sum of partial outputs leaving it
    for name in own:
        _local_island(module.get_submodule(name), tp_mesh)
    if not dims:
        log.info("tp=%d: no parameter of this module is sharded on tp", tp)
    log.info("tensor parallel over %d ranks%s: %d parameters sharded (%s%s)", tp,
             " with sequence parallel" if sp else "", len(dims),
             ", ".join(f"{k}=S({v})" for k, v in sorted(dims.items())[:6]),
             ", ..." if len(dims) > 6 else "")
    return TensorParallel(mesh=tp_mesh, sequence_parallel=sp, sharded=dims)


class _SharedEntries:
    """The pre-hook of a block's sub-layers: each tensor entering them (``enter``: its
    sequence gathered, or the boundary where its gradient is reduced) is entered once per
    block, so that sub-layers reading one tensor (a parallel attention and MLP after one
    norm) share the gather and the one reduction of their summed input gradients. With
    ``first_only`` (the sequence gathered) only a sub-layer's first tensor argument, its
    input, is entered: another (BLOOM's residual, added to the output inside the sub-layer)
    stays a sequence shard. Blocks clear it on entry and exit."""

    def __init__(self, enter, *, first_only: bool):
        self._enter = enter
        self._first_only = first_only
        self._done: dict[int, tuple[Any, Any]] = {}

    def _once(self, t: Any) -> Any:
        if not isinstance(t, DTensor):
            return t
        if id(t) not in self._done:  # the tensor is held: its id is not reused meanwhile
            self._done[id(t)] = (t, self._enter(t))
        return self._done[id(t)][1]

    def enter(self, _m, args, kwargs):
        if not self._first_only:
            return tree_map(self._once, args), tree_map(self._once, kwargs)
        first = next((t for t in [*args, *kwargs.values()] if isinstance(t, DTensor)), None)
        pick = lambda t: self._once(t) if t is first else t  # noqa: E731
        return tuple(pick(t) for t in args), {k: pick(t) for k, t in kwargs.items()}

    def clear(self, *_hook_args) -> None:
        self._done.clear()


def _sublayer_entries(module: nn.Module, holders: set[str]) -> set[str]:
    """Where sequence parallel gathers the sequence: in each block, the children that hold
    (at any depth) a tp-sharded parameter (attention, MLP, MoE: the sub-layers, while the norms
    between them stay sequence-sharded); outside the blocks, the holders themselves (the LM
    head), but not one whose parameters a holder inside it holds too (BERT's head holds the
    bias its decoder uses: the transform before the decoder stays on the shard)."""
    prefix = {id(m): n for n, m in module.named_modules()}
    entries, inside = set(), set()
    for container, key in block_slots(module):
        block = container.get_submodule(key)
        name = prefix[id(block)]
        inside |= {h for h in holders if h == name or h.startswith(name + ".")}
        for child, _ in block.named_children():
            path = f"{name}.{child}"
            if any(h == path or h.startswith(path + ".") for h in holders):
                entries.add(path)
        if name in holders:
            entries.add(name)
    return entries | {h for h in holders - inside if not _lent(module, h, holders)}


def _lent(module: nn.Module, holder: str, holders: set[str]) -> bool:
    """Whether every parameter ``holder`` holds directly is the same object as one a holder
    inside it holds (a tied alias the inner module runs)."""
    own = list(module.get_submodule(holder).parameters(recurse=False))
    inner = {id(p) for h in holders if h.startswith(holder + ".")
             for p in module.get_submodule(h).parameters(recurse=False)}
    return bool(own) and all(id(p) in inner for p in own)


def _local_island(mod: nn.Module, mesh: Any) -> None:
    """Run ``mod`` (which shards its own parameters over tp) on plain local tensors: DTensor
    inputs are gathered to replicated local tensors, tensor outputs rejoin as replicated
    DTensors.  Their gradients cross the same boundary as replicated tensors."""

    mod.register_forward_pre_hook(
        lambda _m, args, kwargs: (tree_map(_to_local_replicated, args),
                                  tree_map(_to_local_replicated, kwargs)), with_kwargs=True)
    mod.register_forward_hook(lambda _m, _args, out: tree_map(
        lambda t: _replicated(t, mesh), out))


def stage_boundaries(module: nn.Module, mesh: Any, sequence_parallel: bool, *,
                     first: bool, last: bool) -> None:
    """Pipeline stages send plain tensors: a stage's DTensor outputs leave as their local
    shards (the sequence shard under sequence parallel, the full tensor otherwise), and a
    later stage's floating-point inputs rejoin with that placement.  ``mesh``: the
    activations' mesh, tp, or (cp, tp) under context parallel of a model's own forward, whose
    cp dim shards the sequence."""
    shard_on = {"cp", "tp"} if sequence_parallel else {"cp"}
    stream = tuple(Shard(SEQUENCE_DIM) if n in shard_on else Replicate()
                   for n in mesh.mesh_dim_names)

    def placements(t: torch.Tensor) -> tuple:
        return stream if t.dim() > SEQUENCE_DIM + 1 else (Replicate(),) * mesh.ndim

    def leave(t: Any) -> Any:
        if not isinstance(t, DTensor):
            return t
        return t.redistribute(mesh, placements(t)).to_local()

    def join(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.is_floating_point():
            return DTensor.from_local(t, mesh, placements(t), run_check=False)
        return t

    if not first:
        module.register_forward_pre_hook(
            lambda _m, args, kwargs: (tree_map(join, args), tree_map(join, kwargs)),
            with_kwargs=True)
    if not last:
        module.register_forward_hook(lambda _m, _args, out: tree_map(leave, out))


def settle_gradients(params: Iterator[nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements (a replicated parameter used on
    sharded activations gets a partial-sum gradient; the optimizer and the data-parallel
    reduction want it whole). Partial sums of replicated parameters on one mesh are
    all-reduced together, in one flat buffer per dtype, as Megatron-LM reduces the
    sequence-parallel norms' gradients."""
    pending: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        g = p.grad
        if not isinstance(g, DTensor) or not isinstance(p, DTensor) or \
                g.placements == p.placements:
            continue
        if p.placements == (Replicate(),) and len(g.placements) == 1 and \
                g.placements[0].is_partial("sum"):
            pending.setdefault((g.device_mesh, g.dtype), []).append(p)
        else:
            p.grad = g.redistribute(p.device_mesh, p.placements)
    for (mesh, _), group in pending.items():
        local = [p.grad.to_local() for p in group]
        flat = torch.cat([t.reshape(-1) for t in local])
        dist.all_reduce(flat, group=mesh.get_group())
        for p, t, part in zip(group, local, flat.split([t.numel() for t in local])):
            p.grad = DTensor.from_local(part.view_as(t), mesh, (Replicate(),), run_check=False)
