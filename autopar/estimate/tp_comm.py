"""Tensor-parallel traffic beyond one layer's (`timing.tp_collectives`): the all-reduce, once a
step, of the partial gradients a layout leaves on replicated parameters (sequence parallelism
on the stream's, an MoE sub-layer reduced once on its router's), and every tensor-parallel
collective of a step as a list -- what a runtime's recorded collectives are checked
against."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from autopar.config import ParallelConfig
from autopar.estimate.layout import Layout, structure
from autopar.estimate.groups import RankGroups
from autopar.estimate.stages import Boundaries
from autopar.estimate.timing import tp_collectives
from autopar.estimate.units import Unit

if TYPE_CHECKING:
    from autopar.estimate.core import ModelCosts

__all__ = ["partial_gradient_bytes", "partial_gradient_sync", "primitive_collectives",
           "tp_step_collectives"]


def partial_gradient_bytes(unit: Unit, sequence_parallel: bool) -> float:
    """Bytes of one layer's gradients that are partial sums over tp, in the parameters'
    traced dtype: under sequence parallel those on the sequence-sharded stream
    (`Unit.stream_params`), an MoE sub-layer's router's (`Unit.router_params`) and those of
    ops on the heads tp splits (`Unit.head_params`)."""
    params = unit.router_params + unit.head_params \
        + (unit.stream_params if sequence_parallel else 0)
    return params * unit.param_bytes / max(1, unit.dense_params + unit.expert_params)


def partial_gradient_sync(cache, units: tuple[Unit, ...], lay: Layout, config: ParallelConfig,
                          groups: RankGroups) -> float:
    """Seconds a step (`cache`: an EvalCache or a Cluster) of the all-reduce over tp of the
    partial gradients (`partial_gradient_bytes`: each rank saw its shard of the sequence, or
    reduced an MoE sub-layer's output once), coalesced into one buffer as Megatron-LM and the
    runtime do, on the pipeline rank with the most of them."""
    if config.tp == 1:
        return 0.0
    per_layer = np.array([partial_gradient_bytes(u, config.sequence_parallel) for u in units])
    nbytes = float((lay.rank_counts @ per_layer).max())
    return cache.collective_time("all_reduce", nbytes, groups.tp) if nbytes > 0 else 0.0


def tp_step_collectives(costs: "ModelCosts", config: ParallelConfig, *, global_batch_size: int,
                        pipeline_rank: int = 0, boundaries: Boundaries | None = None
                        ) -> list[tuple[str, float]]:
    """Every tensor-parallel collective the estimate charges for one step of pipeline rank
    `pipeline_rank`'s layers (the stages cut at `boundaries`, or evenly by layers) on one tp
    group, as ``(kind, nbytes)``: each layer's `tp_collectives` forward and backward, per
    micro-batch, and the one all-reduce of the partial gradients (`partial_gradient_bytes`).
    What a runtime's recorded collectives are checked against."""
    if config.tp == 1:
        return []
    m, rest = divmod(global_batch_size, config.dp * config.micro_batch_size)
    if rest or not m:
        raise ValueError(f"global batch {global_batch_size} is not a multiple of dp x "
                         f"micro-batch = {config.dp * config.micro_batch_size}")
    out: list[tuple[str, float]] = []
    units = costs.units_for(config.micro_batch_size)
    counts = structure(units, config.pp, config.virtual_stages, boundaries).rank_counts
    layers = [int(n) for n in counts[pipeline_rank]]
    for unit, n in zip(units, layers):
        fwd, bwd = tp_collectives(unit, config)
        out += (fwd + bwd) * (n * m)
    nbytes = sum(partial_gradient_bytes(u, config.sequence_parallel) * n
                 for u, n in zip(units, layers))
    return out + ([("all_reduce", nbytes)] if nbytes else [])


def primitive_collectives(collectives) -> list[tuple[str, int]]:
    """``(kind, nbytes)`` collectives as reduce-scatters and all-gathers, sorted, bytes
    rounded: an all-reduce of a tensor is a reduce-scatter and an all-gather of it, at one
    cost, so that two executions that reduce the same partial sums compare equal (the ILP may
    all-reduce a sequence-parallel sub-layer's sums where the runtime reduce-scatters and
    gathers them)."""
    out = []
    for kind, n in collectives:
        kinds = ("reduce_scatter", "all_gather") if kind == "all_reduce" else (kind,)
        out += [(k, round(n)) for k in kinds]
    return sorted(out)
