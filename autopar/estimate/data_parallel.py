"""The data-parallel traffic of one rank's step: gradient reduction and ZeRO parameter gathers
over its data-parallel replicas (`dp_comm`), with DeepSpeed-2021 ZeRO-3's per-tensor gathers
and parameter reuse (`_sync_gather_uses`). Used by `autopar.estimate.core` and
`autopar.estimate.bounds`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from autopar.config import ParallelConfig
from autopar.estimate.groups import RankGroups
from autopar.estimate.stages import Boundaries
from autopar.estimate.units import Unit
from costmodels.collectives import ZERO3_PERSISTENCE_THRESHOLD, ZERO3_SYNC_GATHER_BYTES_PER_S
from costmodels.memory import DTYPE_BYTES, weight_bytes

if TYPE_CHECKING:
    from autopar.estimate.core import EstimateOptions, EvalCache, ModelCosts

__all__ = ["GatherUnit", "ZeroPasses", "dp_bytes", "dp_comm", "dp_step_collectives",
           "gather_units", "zero_passes"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GatherUnit:
    """A ZeRO-3 unit on the rank: its layers there and the parameters of one layer on this
    rank (dense, expert)."""

    unit: Unit
    layers: float
    dense: float
    expert: float


def gather_units(units: Sequence[Unit], layers: Sequence[float], config: ParallelConfig
                 ) -> list[GatherUnit]:
    """The `GatherUnit` of each unit a pipeline rank holds `layers` of."""
    return [GatherUnit(unit=u, layers=float(n), dense=u.dense_on_tp_rank(config.tp),
                       expert=u.expert_params / (config.expert_tp * config.ep))
            for u, n in zip(units, layers) if n > 0]


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


Collective = tuple[str, float, bool]  # (kind, bytes, over the expert replicas)


@dataclass(frozen=True, slots=True)
class ZeroPasses:
    """How often one step moves a rank's data-parallel states with ZeRO: all-gathers of its
    parameters in forward and in backward passes, and reduce-scatters of its gradients, each
    pass per FSDP unit (`per_unit`) or as one collective of the rank's whole."""

    per_unit: bool
    forward_gathers: int
    backward_gathers: int
    scatters: int


def zero_passes(config: ParallelConfig, options: EstimateOptions, m: int) -> ZeroPasses:
    """The passes of ZeRO >= 1 with prefetched gathers (see `dp_comm`) over `m`
    micro-batches."""
    if options.fsdp2 and config.pp > 1:
        return ZeroPasses(per_unit=True, forward_gathers=1, backward_gathers=0, scatters=1)
    if config.zero_stage == 3:
        return ZeroPasses(per_unit=True, forward_gathers=m, backward_gathers=m, scatters=m)
    if options.fsdp2:
        return ZeroPasses(per_unit=True, forward_gathers=m, backward_gathers=0,
                          scatters=m if config.zero_stage == 2 else 1)
    return ZeroPasses(per_unit=False, forward_gathers=1, backward_gathers=0, scatters=1)


def _unit_collectives(gather_units: Sequence[GatherUnit], config: ParallelConfig,
                     options: EstimateOptions, dtype: str
                     ) -> list[tuple[float, tuple[Collective, ...], tuple[Collective, ...]]]:
    """Per FSDP unit on the rank, (its layers there, the all-gathers of one layer's parameters,
    the reduce-scatters of one layer's gradients): the dense ones over dp, the experts' over
    their replicas (`ParallelConfig.expert_dp`). Under FSDP2 what is not in a block (the glue
    before and after the blocks) is one unit, the root's, and a fused projection's bias that
    tp splits by chunk is whole on every tp rank (`Unit.split_fused_biases`: FSDP2 cannot
    shard a chunk-strided 1-D tensor again; the runtime replicates it over tp)."""
    param_b, grad_b = dp_bytes(dtype, options)
    tp = config.tp

    def held(u: GatherUnit) -> float:  # dense elements of one layer
        return u.dense + (sum(u.unit.split_fused_biases(tp)) * (1 - 1 / tp) if options.fsdp2
                          else 0.0)

    shapes = [(u.layers, held(u), u.expert) for u in gather_units
              if u.unit.is_block or not options.fsdp2]
    glue = [u for u in gather_units if not u.unit.is_block] if options.fsdp2 else []
    if glue:
        shapes.append((1.0, sum(u.layers * held(u) for u in glue),
                       sum(u.layers * u.expert for u in glue)))
    return [(layers, _states("all_gather", param_b, dense, expert, config),
             _states("reduce_scatter", grad_b, dense, expert, config))
            for layers, dense, expert in shapes]


def _states(kind: str, per_param: float, dense: float, expert: float,
            config: ParallelConfig) -> tuple[Collective, ...]:
    """`kind` over `dense` parameters' states in the dp group and `expert` ones' in theirs,
    each that has some and replicas: one collective of both where the experts are not
    split over ep (their replicas are the dense weights' and FSDP2 shards them in the same
    unit)."""
    if config.ep == 1 and not config.folded:
        dense, expert = dense + expert, 0.0
    return tuple((kind, n * per_param, is_expert) for n, is_expert in
                 ((dense, False), (expert, True))
                 if n > 0 and (config.expert_dp > 1 or not is_expert))


@dataclass(frozen=True, slots=True)
class _Traffic:
    """One rank's data-parallel collectives in one step: every gather pass of `passes` moves
    `gathers` and every reduction pass `scatters`, each as (layers, the collectives of one
    layer) per FSDP unit, or as the rank's whole states (one entry of one layer). With
    `sync`, DeepSpeed-2021 ZeRO-3's gathers, one per tensor use, in one entry for the step's
    micro-batch (`_sync_gather_uses`)."""

    passes: ZeroPasses
    gathers: tuple[tuple[float, tuple[Collective, ...]], ...]
    scatters: tuple[tuple[float, tuple[Collective, ...]], ...]
    sync: bool = False


def _traffic(gather_units: Sequence[GatherUnit], config: ParallelConfig,
             options: EstimateOptions, m: int, dtype: str, dense: float, expert: float
             ) -> _Traffic:
    """`_Traffic` of a rank holding `gather_units`, `dense` and `expert` parameters in all,
    over `m` micro-batches: ZeRO-0's one all-reduce of the gradients, or the passes of
    `zero_passes`."""
    param_b, grad_b = dp_bytes(dtype, options)

    def whole(kind: str, per_param: float) -> tuple[tuple[float, tuple[Collective, ...]], ...]:
        return ((1.0, _states(kind, per_param, dense, expert, config)),)

    if config.zero_stage == 0:
        return _Traffic(ZeroPasses(per_unit=False, forward_gathers=0, backward_gathers=0,
                                   scatters=1), (), whole("all_reduce", grad_b))
    units = _unit_collectives(gather_units, config, options, dtype)
    scatters = tuple((layers, rs) for layers, _, rs in units)
    if config.zero_stage == 3 and options.zero3_gather == "sync":
        uses = _sync_gather_uses(gather_units, config, options.zero3_max_reuse_distance)
        return _Traffic(ZeroPasses(per_unit=True, forward_gathers=m, backward_gathers=0,
                                   scatters=m),
                        ((1.0, tuple(("all_gather", n * param_b, e) for n, e in uses)),),
                        scatters, sync=True)
    p = zero_passes(config, options, m)
    if p.per_unit:
        return _Traffic(p, tuple((layers, g) for layers, g, _ in units), scatters)
    return _Traffic(p, whole("all_gather", param_b), whole("reduce_scatter", grad_b))


def dp_comm(cluster: EvalCache, cfg: ParallelConfig, groups: RankGroups, dense: float,
             expert: float, sums: dict[str, float], m: int, dtype: str,
             options: EstimateOptions, gather_units: list[GatherUnit]
             ) -> tuple[float, float]:
    """(exposed, total) seconds of data-parallel communication per step on one rank.

    ZeRO-0 all-reduces the gradients once a step, under the last micro-batch's backward.
    ZeRO >= 1 moves the rank's states in the passes `zero_passes` counts:

    * ZeRO-3 all-gathers per FSDP unit (`_unit_collectives`: a block layer, or the glue), so
      each collective pays its own latency, which grows with the group size: in every
      micro-batch one pass for the forward and one for the backward (the recompute runs on the
      backward's), and one reduce-scatter pass under the backward;
    * ZeRO-1 and -2 gather the rank's parameters and reduce-scatter its gradients once a step
      (Megatron's distributed optimizer), the gradients under the last micro-batch's backward;
    * under FSDP2 (`EstimateOptions.fsdp2`) ZeRO-1 and -2 go per unit, and without a pipeline
      each micro-batch's forward gathers every unit again and ZeRO-2 reduce-scatters every
      micro-batch's gradients; under a pipeline every ZeRO stage gathers and reduce-scatters
      each unit once a step (torch.distributed.pipelining's stage keeps the parameters
      gathered and the gradients unreduced through its micro-batches).

    Gathers hide under the forward compute and the backward's gathers and reduce-scatters under
    the backward compute, up to their length (`overlap_dp_comm`; ZeRO-3 prefetches always), the
    first unit's gather of each forward pass exposed. With ``zero3_gather="sync"`` every
    parameter tensor is gathered on its own, for the forward, the recompute (full) and the
    backward unless it was kept since its last use (`_sync_gather_uses`), with the stream
    waiting: nothing hides them."""
    if len(groups.dp) == 1:
        return 0.0, 0.0
    fwd = sums["compute_fwd"]
    bwd = sums["compute_bwd"] + sums["recompute"]
    traffic = _traffic(gather_units, cfg, options, m, dtype, dense, expert)

    def time(collectives: Sequence[Collective], sync: bool = False) -> float:
        return sum(cluster.collective_time(kind, n, groups.edp if is_expert else groups.dp)
                   + (n / ZERO3_SYNC_GATHER_BYTES_PER_S if sync else 0.0)
                   for kind, n, is_expert in collectives)

    unit_gathers = [time(g, traffic.sync) for _, g in traffic.gathers]
    gather = sum(layers * t for (layers, _), t in zip(traffic.gathers, unit_gathers))
    scatter = sum(layers * time(rs) for layers, rs in traffic.scatters)
    if traffic.sync:
        return m * (gather + max(0.0, scatter - bwd)), m * (gather + scatter)
    p = traffic.passes
    first = max(unit_gathers, default=0.0) if p.per_unit else 0.0
    total = (p.forward_gathers + p.backward_gathers) * gather + p.scatters * scatter
    if not options.overlap_dp_comm and cfg.zero_stage != 3:
        return total, total
    backward = (gather if p.backward_gathers else 0.0) + scatter
    return (p.forward_gathers * (max(0.0, gather - fwd) + first)
            + max(p.backward_gathers, p.scatters) * max(0.0, backward - bwd)), total


def dp_step_collectives(costs: "ModelCosts", config: ParallelConfig, options: EstimateOptions,
                        *, global_batch_size: int, dtype: str, pipeline_rank: int = 0,
                        boundaries: Boundaries | None = None) -> list[tuple[str, float]]:
    """Every data-parallel collective `dp_comm` charges one rank of pipeline rank
    `pipeline_rank` in one step, as ``(kind, nbytes)``, the experts' with the dense ones
    (the stages cut at `boundaries`, or evenly by layers): what a runtime's recorded
    collectives are checked against."""
    from autopar.estimate.layout import step_layers

    if config.dp * config.cp == 1:
        return []
    m, units, counts = step_layers(costs, config, global_batch_size, boundaries)
    here = gather_units(units, counts[pipeline_rank], config)
    dense, expert = (sum(u.layers * getattr(u, k) for u in here) for k in ("dense", "expert"))
    traffic = _traffic(here, config, options, m, dtype, dense, expert)

    def one(entries) -> list[tuple[str, float]]:
        return [(kind, n) for layers, cs in entries for kind, n, _ in cs * int(layers)]

    p = traffic.passes
    return (p.forward_gathers + p.backward_gathers) * one(traffic.gathers) \
        + p.scatters * one(traffic.scatters)


def dp_bytes(dtype: str, options: EstimateOptions) -> tuple[int, int]:
    """Bytes per parameter that data parallelism gathers and per gradient it reduces."""
    param_b = weight_bytes(dtype)
    grad_b = DTYPE_BYTES[options.grad_reduce_dtype] if dtype != "fp32" else 4
    return param_b, grad_b
