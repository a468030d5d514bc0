"""Tensor-parallel traffic beyond one layer's (`timing.tp_collectives`): the collectives that
make gradients whole -- the all-reduces of the partial gradients a layout leaves on
replicated parameters (sequence parallelism on the stream's, an MoE sub-layer reduced once on
its router's) and, under FSDP2, the gathers of fused biases' chunks -- and every tensor-parallel
collective of a step as a list, and every context-parallel transfer -- what a runtime's
recorded collectives are checked against."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from autopar.config import ParallelConfig
from autopar.estimate.data_parallel import dp_bytes, zero_passes
from autopar.estimate.groups import RankGroups
from autopar.estimate.layout import Layout, recomputed_layers, step_layers
from autopar.estimate.options import EstimateOptions
from autopar.estimate.stages import Boundaries
from autopar.estimate.timing import cp_collectives, ep_collectives, tp_collectives
from autopar.estimate.units import Unit

if TYPE_CHECKING:
    from autopar.estimate.core import ModelCosts

__all__ = ["cp_step_collectives", "gradient_collectives", "partial_gradient_bytes",
           "partial_gradient_sync", "partial_gradients", "primitive_collectives",
           "tp_step_collectives"]


def partial_gradients(unit: Unit, sequence_parallel: bool) -> tuple[int, ...]:
    """Elements of each of one layer's parameters whose gradients are partial sums over tp:
    under sequence parallel those on the sequence-sharded stream (`Unit.stream_params`), an
    MoE sub-layer's router's (`Unit.router_params`) and those of ops on the heads tp splits
    (`Unit.head_params`)."""
    return unit.router_params + unit.head_params \
        + (unit.stream_params if sequence_parallel else ())


def partial_gradient_bytes(unit: Unit, sequence_parallel: bool) -> float:
    """Bytes of one layer's `partial_gradients`, in the parameters' traced dtype."""
    return sum(partial_gradients(unit, sequence_parallel)) * unit.param_bytes \
        / max(1, unit.dense_params + unit.expert_params)


def gradient_collectives(units: Sequence[Unit], layers: Sequence[float], config: ParallelConfig,
                         options: EstimateOptions, m: int, dtype: str
                         ) -> list[tuple[str, float]]:
    """The collectives over tp, as ``(kind, nbytes)``, that make whole the gradients of a
    pipeline rank holding `layers` of each of `units`, in one step of `m` micro-batches.

    The all-reduce of the `partial_gradients`: all of them in one buffer once a step, as
    Megatron-LM reduces them and the runtime does without FSDP. Under FSDP2
    (`EstimateOptions.fsdp2`, ZeRO >= 1 over more than one data-parallel rank) FSDP2
    redistributes every DTensor gradient to its parameter's placement on its own before it
    reduces it, in each of its reduce-scatter passes (`zero_passes`), in the gathered
    parameters' dtype, or in the reduce dtype once it accumulated over micro-batches: each
    partial gradient's all-reduce, and the all-gather of a fused projection's bias gradient
    from each rank's chunks (tp splits the bias by chunk, and it is whole on every tp rank
    under FSDP2: `Unit.split_fused_biases`)."""
    if config.tp == 1:
        return []
    sp = config.sequence_parallel
    if not (options.fsdp2 and config.zero_stage and config.dp * config.cp > 1):
        nbytes = sum(partial_gradient_bytes(u, sp) * n for u, n in zip(units, layers))
        return [("all_reduce", nbytes)] if nbytes else []
    passes = zero_passes(config, options, m).scatters
    param_b, grad_b = dp_bytes(dtype, options)
    per_elem = param_b if passes == m else grad_b
    return [collective for unit, n in zip(units, layers) for collective in
            ([("all_reduce", k * per_elem) for k in partial_gradients(unit, sp)]
             + [("all_gather", k * per_elem) for k in unit.split_fused_biases(config.tp)])
            * (int(n) * passes)]


def partial_gradient_sync(cache, units: Sequence[Unit], lay: Layout, config: ParallelConfig,
                          groups: RankGroups, options: EstimateOptions, m: int,
                          dtype: str) -> float:
    """Seconds a step (`cache`: an EvalCache or a Cluster) of the `gradient_collectives`
    (each rank saw its shard of the sequence, reduced an MoE sub-layer's output once, or
    sliced its chunks of a fused bias), on the pipeline rank that spends the most on them."""
    if config.tp == 1:
        return 0.0
    return max(sum(cache.collective_time(kind, n, groups.tp) for kind, n in
                   gradient_collectives(units, counts, config, options, m, dtype))
               for counts in lay.rank_counts)


def tp_step_collectives(costs: "ModelCosts", config: ParallelConfig, *, global_batch_size: int,
                        options: EstimateOptions = EstimateOptions(), dtype: str = "bf16",
                        pipeline_rank: int = 0, boundaries: Boundaries | None = None
                        ) -> list[tuple[str, float]]:
    """Every tensor-parallel collective the estimate charges for one step of pipeline rank
    `pipeline_rank`'s layers (the stages cut at `boundaries`, or evenly by layers) on one tp
    group, as ``(kind, nbytes)``: each layer's `tp_collectives` forward and backward, per
    micro-batch, the forward's again in the layers full recompute re-runs
    (`recomputed_layers`), and the `gradient_collectives`. What a runtime's recorded
    collectives are checked against."""
    if config.tp == 1:
        return []
    m, units, counts = step_layers(costs, config, global_batch_size, boundaries)
    layers = counts[pipeline_rank]
    again = recomputed_layers(units, config, boundaries, pipeline_rank)
    out: list[tuple[str, float]] = []
    for unit, n, r in zip(units, layers, again):
        fwd, bwd = tp_collectives(unit, config)
        out += (fwd + bwd) * (n * m) + _recomputed(unit, fwd, config, options) * (r * m)
    return out + gradient_collectives(units, layers, config, options, m, dtype)


def _recomputed(unit: Unit, fwd: list, config: ParallelConfig, options: EstimateOptions
                ) -> list:
    """The tp collectives full recompute issues again in one layer of ``unit``: its
    forward's, less, where recompute stops early, the reductions of the GEMMs after the last
    tensor backward needs (`OpCost.tail`: a block's last row-parallel GEMM), as
    `timing.unit_times` charges them."""
    if not options.recompute_early_stop:
        return fwd
    reduce = "reduce_scatter" if config.sequence_parallel else "all_reduce"
    tail = min(sum(op.kind == "gemm" and op.tail for op in unit.ops), unit.tp_reductions[0])
    out = list(fwd)
    for _ in range(tail):
        last = max((i for i, (kind, n) in enumerate(out)
                    if kind == reduce and n == unit.act_bytes / config.cp), default=None)
        if last is not None:
            out.pop(last)
    return out


def cp_step_collectives(costs: "ModelCosts", config: ParallelConfig, *, global_batch_size: int,
                        options: EstimateOptions = EstimateOptions(), dtype: str = "bf16",
                        pipeline_rank: int = 0, boundaries: Boundaries | None = None
                        ) -> list[tuple[str, float]]:
    """Every context-parallel transfer the estimate charges a rank for one step of pipeline
    rank `pipeline_rank`'s layers, as ``(kind, nbytes)``: each layer's `cp_collectives`
    forward and backward per micro-batch, the forward's again in the layers full recompute
    re-runs (`recomputed_layers`)."""
    if config.cp == 1:
        return []
    return _per_layer(costs, config, global_batch_size, pipeline_rank, boundaries,
                      lambda unit: cp_collectives(unit, config, options, dtype))


def ep_step_collectives(costs: "ModelCosts", config: ParallelConfig, *, global_batch_size: int,
                        pipeline_rank: int = 0, boundaries: Boundaries | None = None
                        ) -> list[tuple[str, float]]:
    """Every expert-parallel collective the estimate charges a rank for one step of pipeline
    rank `pipeline_rank`'s layers, as ``(kind, nbytes)``: each MoE layer's `ep_collectives`
    forward and backward per micro-batch, the forward's again in the layers full recompute
    re-runs."""
    if config.ep == 1:
        return []
    return _per_layer(costs, config, global_batch_size, pipeline_rank, boundaries,
                      lambda unit: ep_collectives(unit, config))


def _per_layer(costs: "ModelCosts", config: ParallelConfig, global_batch_size: int,
               pipeline_rank: int, boundaries: Boundaries | None, collectives
               ) -> list[tuple[str, float]]:
    """``collectives(unit)``'s (forward, backward) lists of each layer of pipeline rank
    `pipeline_rank` per micro-batch of a step, the forward's again where full recompute
    re-runs the layer."""
    m, units, counts = step_layers(costs, config, global_batch_size, boundaries)
    again = recomputed_layers(units, config, boundaries, pipeline_rank)
    out: list[tuple[str, float]] = []
    for unit, n, r in zip(units, counts[pipeline_rank], again):
        fwd, bwd = collectives(unit)
        out += (fwd + bwd) * (n * m) + fwd * (r * m)
    return out


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
