"""The data-parallel traffic of one rank's step: gradient reduction and ZeRO parameter gathers
over its data-parallel replicas (`dp_comm`), with DeepSpeed-2021 ZeRO-3's per-tensor gathers
and parameter reuse (`_sync_gather_uses`). Used by `autopar.estimate.core` and
`autopar.estimate.bounds`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from autopar.config import ParallelConfig
from autopar.estimate.groups import RankGroups
from autopar.estimate.units import Unit
from costmodels.collectives import ZERO3_PERSISTENCE_THRESHOLD, ZERO3_SYNC_GATHER_BYTES_PER_S
from costmodels.memory import DTYPE_BYTES, weight_bytes

if TYPE_CHECKING:
    from autopar.estimate.core import EstimateOptions, EvalCache

__all__ = ["GatherUnit", "dp_bytes", "dp_comm"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GatherUnit:
    """A ZeRO-3 unit on the rank: its layers there and the parameters of one layer on this
    rank (dense, expert)."""

    unit: Unit
    layers: float
    dense: float
    expert: float


def _param_tensors(unit: Unit, config: ParallelConfig) -> tuple[tuple[float, bool], ...]:
    """Per parameterised op of one copy of `unit`, in execution order, its parameter elements
    on this rank and whether they are expert weights (a Linear's weight and bias count as one
    tensor: the bias is 1/h of it)."""
    per_elem = unit.param_bytes / max(1, unit.dense_params + unit.expert_params)
    if per_elem <= 0:
        return ()
    return tuple((op.param_bytes / per_elem / (config.expert_tp * config.ep if op.expert
                                               else config.tp),
                  op.expert) for op in unit.ops if op.param_bytes > 0)


def _sync_gather_uses(gather_units: Sequence["GatherUnit"], config: ParallelConfig,
                     max_reuse_distance: float) -> list[tuple[float, bool]]:
    """The parameter gathers of one micro-batch under DeepSpeed-2021 ZeRO-3 (one all-gather
    per tensor, ``zero3_gather="sync"``): (elements on this rank, expert) for every use of a
    tensor that has to gather it.

    The rank's uses in order: the forward over its units and layers; then the backward in
    reverse, where full recompute re-runs each block's forward just before that block's
    backward. DeepSpeed's coordinator records this trace and, when a module's use ends,
    keeps its parameters if the module's next use comes after fewer than `max_reuse_distance`
    parameter elements of the uses in between (every parameter counts, persistent ones too;
    its stage-3 `PrefetchCoordinator.get_reuse_distance_in_numel`, 2021); a kept tensor
    is not gathered again. Tensors of at most ZERO3_PERSISTENCE_THRESHOLD elements stay
    whole on every rank and are never gathered."""
    full = config.recompute in ("full", "per_op")
    tensors = [list(enumerate(_param_tensors(here.unit, config))) for here in gather_units]
    trace: list[tuple[tuple[int, int, int], float, bool]] = []

    def run(k: int, copy: int, ops) -> None:
        trace.extend(((k, copy, t), n, e) for t, (n, e) in ops)

    for k, here in enumerate(gather_units):
        for copy in range(int(here.layers)):
            run(k, copy, tensors[k])
    for k in reversed(range(len(gather_units))):
        for copy in reversed(range(int(gather_units[k].layers))):
            if full and gather_units[k].unit.is_block:
                run(k, copy, tensors[k])  # the recompute, just before the block's backward
            run(k, copy, reversed(tensors[k]))
    uses: list[tuple[float, bool]] = []
    last_end: dict[tuple[int, int, int], float] = {}  # elements seen up to a key's last use
    seen = 0.0
    for key, numel, expert in trace:
        prior = last_end.get(key)
        if numel > ZERO3_PERSISTENCE_THRESHOLD and (
                prior is None or seen - prior >= max_reuse_distance):
            uses.append((numel, expert))
        seen += numel
        last_end[key] = seen
    return uses


def dp_comm(cluster: EvalCache, cfg: ParallelConfig, groups: RankGroups, dense: float,
             expert: float, sums: dict[str, float], m: int, dtype: str,
             options: EstimateOptions, gather_units: list[GatherUnit]
             ) -> tuple[float, float]:
    """(exposed, total) seconds of data-parallel communication per step on one rank.

    ZeRO-3 reduce-scatters once per FSDP unit (a block layer, or the glue before and after)
    on the rank, so each collective pays its own latency, which grows with the group size.
    Its gathers are per unit too, prefetched: one per unit for the forward and one for the
    backward (the recompute runs on the backward's), hidden under compute where it lasts
    longer, the first one exposed. With ``zero3_gather="sync"`` every parameter tensor is
    gathered on its own, for the forward, the recompute (full) and the backward unless it was
    kept since its last use (`_sync_gather_uses`), with the stream waiting: nothing hides
    them.

    ZeRO-1 and -2 gather the parameters and reduce-scatter the gradients once a step, the
    gradients under the last micro-batch's backward; with ``regather_per_microbatch`` (FSDP2,
    which reshards after every backward) and no pipeline, each micro-batch's forward gathers
    them again, per unit, the first exposed, and ZeRO-2 reduce-scatters every micro-batch's
    gradients. A pipeline schedule (torch.distributed.pipelining) keeps FSDP2's parameters
    gathered and its gradients unreduced from one micro-batch's backward to the next
    (`PipelineStage` sets reshard_after_backward and requires_gradient_sync False until its
    reduce_grad): once a step."""
    if len(groups.dp) == 1:
        return 0.0, 0.0
    param_b, grad_b = dp_bytes(dtype, options)
    expert_group = groups.edp

    def both(kind: str, nbytes_per_param: float, dense: float = dense,
             expert: float = expert) -> float:
        """`kind` over `dense` parameters in the dp group and `expert` ones in theirs."""
        t = cluster.collective_time(kind, dense * nbytes_per_param, groups.dp)
        if expert and len(expert_group) > 1:
            t += cluster.collective_time(kind, expert * nbytes_per_param, expert_group)
        return t

    def per_unit(gathers: bool) -> tuple[float, float, float]:
        """(gathers, the largest one, reduce-scatters) of one pass over the rank's units,
        one collective per unit layer."""
        gather = scatter = first = 0.0
        for here in gather_units:
            scatter += here.layers * both("reduce_scatter", grad_b, here.dense, here.expert)
            if gathers:
                g = both("all_gather", param_b, here.dense, here.expert)
                gather, first = gather + here.layers * g, max(first, g)
        return gather, first, scatter

    fwd = sums["compute_fwd"]
    bwd = sums["compute_bwd"] + sums["recompute"]
    if cfg.zero_stage == 3:
        sync = options.zero3_gather == "sync"
        gather, first, scatter = per_unit(gathers=not sync)
        if sync:  # one gather per parameter tensor and use, the stream waiting for it
            times: dict[tuple[float, bool], float] = {}  # tensors of a size recur per layer

            def one(n: float, is_expert: bool) -> float:
                t = times.get((n, is_expert))
                if t is None:
                    t = times[n, is_expert] = cluster.collective_time(
                        "all_gather", n * param_b, expert_group if is_expert else groups.dp) \
                        + n * param_b / ZERO3_SYNC_GATHER_BYTES_PER_S
                return t

            gather = sum(one(n, is_expert) for n, is_expert in _sync_gather_uses(
                gather_units, cfg, options.zero3_max_reuse_distance))
            return m * (gather + max(0.0, scatter - bwd)), m * (gather + scatter)
        exposed_mb = max(0.0, gather - fwd) + max(0.0, gather + scatter - bwd) + first
        return m * exposed_mb, m * (2 * gather + scatter)
    if cfg.zero_stage in (1, 2) and options.regather_per_microbatch and cfg.pp == 1:
        gather, first, scatter = per_unit(gathers=True)
        scatters = m if cfg.zero_stage == 2 else 1
        total = m * gather + scatters * scatter
        if not options.overlap_dp_comm:
            return total, total
        return m * (max(0.0, gather - fwd) + first) + scatters * max(0.0, scatter - bwd), total
    if cfg.zero_stage == 0:
        reduce, gather = both("all_reduce", grad_b), 0.0
    else:
        reduce, gather = both("reduce_scatter", grad_b), both("all_gather", param_b)
    if not options.overlap_dp_comm:
        return reduce + gather, reduce + gather
    return max(0.0, reduce - bwd) + max(0.0, gather - fwd), reduce + gather


def dp_bytes(dtype: str, options: EstimateOptions) -> tuple[int, int]:
    """Bytes per parameter that data parallelism gathers and per gradient it reduces."""
    param_b = weight_bytes(dtype)
    grad_b = DTYPE_BYTES[options.grad_reduce_dtype] if dtype != "fp32" else 4
    return param_b, grad_b
