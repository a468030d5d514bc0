"""MoE sub-layers under tensor parallel: one row-parallel unit on this rank's shards.

A block's sub-layer that holds an MoE layer (``autopar.trace.moe.moe_experts``: a list of
alike experts with a router or a top-k, or fused ``[E, ...]`` expert weights), written any
way, runs its own forward on plain local tensors: its input whole (gathered from the sequence
shard under sequence parallel), each parameter this rank's shard of the plan's placement
(every expert's column GEMMs give this rank's features, its row GEMM a partial sum), so the
combine -- a weighted sum over the experts -- leaves the sub-layer's output a partial sum over
tp, reduced once: all-reduced, or reduce-scattered on the sequence under sequence parallel.
One reduction per MoE layer each way, as the estimate charges it (Megatron-Core's MoE with
its experts split over tp), where DTensor would reduce every expert's rows on its own.  The
input's gradient, a partial sum, is reduced on the way back by the sub-layer's entry; a
replicated parameter inside (the router) gets a partial gradient, all-reduced once a step
with the stream's (``tensor_parallel.settle_gradients``).

This is exact when the sub-layer's output is the sum over the tp ranks of its local outputs:
``partial_sum_error`` runs it on random inputs of the shapes a probe forward gave it, with
whole parameters and with each rank's shards, before any collective and before expert
parallel changes the layer (whose all-gather dispatch then runs inside the sub-layer, on the
local tensors); a sub-layer that fails
(a bias added after a row-parallel GEMM, a shared expert whose output is gathered, a
nonlinearity after the combine) keeps DTensor's execution, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from autopar.trace.moe import moe_experts

if TYPE_CHECKING:
    from autopar.plan.plan import Plan

__all__ = ["exact_moe_classes", "install_local_moe", "local_moe_sublayers", "local_shard",
           "moe_sublayers", "partial_sum_error", "verified_classes"]

log = logging.getLogger(__name__)

_TOLERANCE = 1e-4  # relative, fp32: the sum over ranks reorders the row GEMM's additions


def moe_sublayers(module: nn.Module, entries: set[str]) -> list[str]:
    """The sub-layer entries (FQNs in ``module``) that hold an MoE layer."""
    return sorted(name for name in entries
                  if any(moe_experts(m) is not None
                         for m in module.get_submodule(name).modules()))


def exact_moe_classes(model: nn.Module, plan: Plan, example: Callable[[], torch.Tensor]
                      ) -> set[type]:
    """The classes of the whole ``model``'s MoE sub-layers (its weights unsharded, before
    expert parallel changes them) that run exactly on local shards: on the inputs the first
    of each class got in one forward of ``example()``, its output is the sum of its tp ranks'
    outputs on their shards of the plan's placements (`partial_sum_error`). A class that is
    not keeps DTensor's execution, with a warning."""
    from autopar.runtime.expert_gather import _capture_inputs
    from autopar.runtime.tensor_parallel import _placement, _sublayer_entries, tp_dims

    tp = plan.config.tp
    dims = tp_dims(model, plan.placements)
    names = moe_sublayers(model, _sublayer_entries(model, {f.rpartition(".")[0] for f in dims}))
    if not names:
        return set()
    chunks = plan.model.fused_projections or {}
    fsdp_follows = plan.config.zero_stage >= 1 and plan.config.dp * plan.config.cp > 1
    inputs = _capture_inputs(model, names, example())

    def error(name: str, sub: nn.Module) -> float:
        placements = [_placement(f"{name}.{fqn}" if name else fqn, m._parameters[n], dims,
                                 chunks, tp, fsdp_follows)[0]
                      for fqn, m, n in _param_slots(sub)]
        return partial_sum_error(sub, inputs[name], placements, tp)

    return verified_classes(model, [n for n in names if n in inputs], error, _TOLERANCE,
                            "its output is not the sum of its tp ranks' outputs on their "
                            "shards (relative error %.1e), so it runs with DTensor, which "
                            "reduces each expert's rows apart: more collectives than the plan "
                            "costs")


def verified_classes(model: nn.Module, names: list[str],
                     error: Callable[[str, nn.Module], float], tolerance: float,
                     otherwise: str) -> set[type]:
    """The classes of the sub-layers ``names`` of ``model`` whose first sub-layer's
    ``error(name, sub)`` is within ``tolerance`` (inf where its forward raises a
    RuntimeError); each other class is logged with ``otherwise`` (a format of the error)."""
    verdict: dict[type, bool] = {}
    for name in names:
        sub = model.get_submodule(name)
        if type(sub) in verdict:
            continue
        try:
            err = error(name, sub)
        except RuntimeError as exc:  # its forward cannot run so
            log.debug("%s: %s", name, exc)
            err = float("inf")
        verdict[type(sub)] = err <= tolerance
        if not verdict[type(sub)]:
            log.warning("%s (%s): " + otherwise, name, type(sub).__name__, err)
    return {cls for cls, exact in verdict.items() if exact}


def local_moe_sublayers(module: nn.Module, entries: set[str], own: list[str],
                        exact: set[type]) -> list[str]:
    """The MoE sub-layers among ``entries`` (FQNs in ``module``) that run on local shards:
    those of the ``exact`` classes (`exact_moe_classes`) outside ``own`` (layers sharding
    their own experts)."""
    # by class: expert parallel may have replaced the other ranks' experts already
    names = [name for name in sorted(entries) if type(module.get_submodule(name)) in exact
             and not any(o == name or o.startswith(name + ".") for o in own)]
    if names:
        log.info("tensor parallel: %d MoE sub-layers run on local shards with one reduction "
                 "each (%s%s)", len(names), names[0], ", ..." if len(names) > 1 else "")
    return names


def local_shard(full: torch.Tensor, placement: Any, size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s local part of ``full`` under one tp ``placement``: whole when
    replicated, its even chunk of ``Shard(d)``, or its chunk of each of the k chunks of
    ``_StridedShard(d, k)`` (a fused projection: whole heads of each), as DTensor lays
    them out."""
    if isinstance(placement, _StridedShard):
        d, k = placement.dim, placement.split_factor
        return torch.cat([c.chunk(size, d)[rank] for c in full.chunk(k, d)], dim=d)
    if isinstance(placement, Shard):
        return full.chunk(size, placement.dim)[rank]
    return full


def _param_slots(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(FQN under ``module``, holder, name) of every parameter under ``module``."""
    return [(".".join(x for x in (prefix, n) if x), m, n)
            for prefix, m in module.named_modules() for n, p in m._parameters.items()
            if p is not None]


def _local(p: Any) -> Any:
    """A DTensor parameter as its local shard (a replicated one's gradient here is this
    rank's partial sum); anything else as it is."""
    if not isinstance(p, DTensor):
        return p
    return p.to_local(grad_placements=tuple(Partial() if isinstance(pl, Replicate) else pl
                                            for pl in p.placements))


class _LocalWeights(TorchFunctionMode):
    """Within a sub-layer's local forward: a parameter that arrives as a DTensor (FSDP puts its
    unsharded parameters back in place when a module inside it runs) is used as its local
    shard (`_local`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = tree_map(_local_parameter, (args, kwargs or {}))
        return func(*args, **kwargs)


def _local_parameter(t: Any) -> Any:
    return _local(t) if isinstance(t, nn.Parameter) else t


class _LocalParams:
    """Within this context the parameter in each of ``slots`` (`_param_slots`) is
    ``values[i]`` instead."""

    def __init__(self, slots: list[tuple[str, nn.Module, str]], values: list[torch.Tensor]):
        self.slots, self.values, self.saved = slots, values, []

    def __enter__(self):
        for (_, m, n), v in zip(self.slots, self.values):
            self.saved.append(m._parameters[n])
            m._parameters[n] = v
        return self

    def __exit__(self, *exc):
        for (_, m, n), p in zip(self.slots, self.saved):
            m._parameters[n] = p
        self.saved = []


@torch.no_grad()
def partial_sum_error(sublayer: nn.Module, inputs: tuple, placements: list[Any], size: int
                      ) -> float:
    """The largest difference, relative to the output's largest value, between
    ``sublayer``'s output on random ``inputs`` (args, kwargs of a real call; expert indices
    kept below the expert count) with its whole parameters and the sum over ``size`` ranks of
    its outputs with each rank's shards (``placements``: one tp placement per parameter, in
    `_param_slots` order)."""
    from autopar.runtime.expert_gather import sum_of_parts_errors

    experts = max(found[2] for m in sublayer.modules() if (found := moe_experts(m)))
    slots = _param_slots(sublayer)
    full = [m._parameters[n] for _, m, n in slots]
    parts = (_LocalParams(slots, [local_shard(p, pl, size, rank)
                                  for p, pl in zip(full, placements)]) for rank in range(size))
    return max((error for _, error in sum_of_parts_errors(sublayer, inputs, experts, parts)),
               default=0.0)


def install_local_moe(sublayer: nn.Module, mesh: Any, sequence_parallel: bool,
                      sequence_dim: int) -> None:
    """Run ``sublayer`` (its parameters DTensors on the tp ``mesh``) on local shards with
    one reduction of its output (see the module docstring), inside its forward: after its
    hooks (the entry's gather of the sequence shard), and with its parameters restored
    however the forward ends (a recompute that stops early)."""
    from autopar.runtime.tensor_parallel import _settle, with_tp

    forward = sublayer.forward
    # the first DTensor input's layout: on a (cp, tp) mesh (context parallel of the model's own
    # forward) its cp shard, this rank's tokens, stays split, and outputs shaped like it
    # rejoin so
    entered: list[DTensor] = []

    def local_input(t: Any) -> Any:
        if not isinstance(t, DTensor):
            return t
        entered.append(t)
        # (a redistribute of a replicated input would all-reduce its gradient here)
        whole = with_tp(t, Replicate())
        whole = t if t.placements == whole else t.redistribute(t.device_mesh, whole)
        # this rank's share of the input gradient is a partial sum, reduced by the entry
        return whole.to_local(grad_placements=with_tp(whole, Partial())) if whole.requires_grad \
            else whole.to_local()

    def reduce(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or isinstance(t, DTensor) or \
                not t.is_floating_point():
            return t
        target = Shard(sequence_dim) if sequence_parallel and t.dim() > sequence_dim + 1 \
            else Replicate()
        x = entered[0] if entered else None
        if x is not None and x.device_mesh.ndim > 1 and t.dim() == x.dim():
            partial = DTensor.from_local(t, x.device_mesh, with_tp(x, Partial()),
                                         run_check=False)
        else:
            partial = DTensor.from_local(t, mesh, (Partial(),), run_check=False)
        return _settle(partial, target)

    slots = _param_slots(sublayer)

    def local_forward(*args, **kwargs):
        local = [_local(m._parameters[n]) for _, m, n in slots]  # as FSDP put them in place
        entered.clear()
        args, kwargs = tree_map(local_input, args), tree_map(local_input, kwargs)
        with _LocalParams(slots, local), _LocalWeights():
            out = forward(*args, **kwargs)
        return tree_map(reduce, out)

    sublayer.forward = local_forward
