"""`autopar.estimate`: predicted step time, its breakdown, and memory per rank of one config.

The flow: trace the model for one micro-batch (or take a traced `Graph`), cut it into units,
time every unit on one rank (compute roofline + TP/CP/EP communication on the real rank
groups), place the layers on pipeline stages as Megatron does (blocks split evenly over
pp x virtual stages, the embedding on the first stage, the head on the last) or as
`EstimateOptions.pipeline_balance` names, simulate the
pipeline schedule, then add the data-parallel gradient/parameter communication that the
overlap model leaves exposed and the optimizer step. Memory per stage counts model states by
ZeRO stage, activations times the micro-batches each rank holds in flight (read off the
simulated schedule), ZeRO-3 gathered-layer buffers, communication buffers, the CUDA context and
an allocator reserve.

Overlap assumptions (named, tested): data-parallel gradient reduction overlaps the backward of
the last micro-batch; ZeRO-1/2 parameter all-gathers overlap the next step's first forward;
ZeRO-3 gathers and reduce-scatters overlap each micro-batch's forward and backward except the
first layer's gather; EP communication is not overlapped; CP ring traffic overlaps
attention compute; TP communication is exposed unless the software overlaps it. With
`overlap_tp_comm` (Megatron's TP overlap) TP communication hides behind the unit's GEMMs and
only the excess is exposed.

Two fidelities share this code: `exact=True` simulates the schedule event by event (what
`estimate` returns); `exact=False` uses the closed-form pipeline bound and in-flight counts
(what the search ranks thousands of configs with, before it simulates the best ones). The
bounds on both that the search prunes with are in `autopar.estimate.bounds`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np
import torch.nn as nn

from autopar.cluster import Cluster
from autopar.config import ParallelConfig, check_config
from autopar.estimate.cache import EvalCache, _rank_groups, order_key, placement_key
from autopar.estimate.data_parallel import GatherUnit, dp_comm, gather_units
from autopar.estimate.layout import (Layout, Structure, analytic_inflight, fast_peak_memory,
                                     layout, pipeline_bound, structure, unit_vectors)
from autopar.estimate.memory import (activation_bytes, held_zero_stage, keeps_fp8_copies,
                                     keeps_weight_copies, stage_memory)
from autopar.estimate.options import EstimateOptions
from autopar.estimate.pipeline_comm import boundary_bytes, tied_gradient_sync
from autopar.estimate.stages import body_span, layer_sequence, weight_balanced_boundaries
from autopar.estimate.groups import RankGroups
from autopar.estimate.timing import UnitTimes, unit_compute, unit_times
from autopar.estimate.tp_comm import partial_gradient_sync
from autopar.estimate.units import Unit, units_from_graph
from autopar.errors import InvalidConfigError
from autopar.ir import Graph, Node, OpKind
from autopar.ir.residual import kv_projections
from costmodels.compute import optimizer_time_s
from costmodels.memory import DTYPE_BYTES, state_bytes_per_param
from costmodels.pipeline import PipelineTimeline, simulate_pipeline

log = logging.getLogger(__name__)

__all__ = ["Estimate", "EstimateOptions", "EvalCache", "ModelCosts", "estimate",
           "estimate_graph", "evaluate", "layer_costs", "order_key", "placement_key",
           "split_structure"]


@dataclass(frozen=True, kw_only=True)
class Estimate:
    config: ParallelConfig
    step_time_s: float
    tokens_per_s: float
    mfu: float
    model_tflops_per_gpu: float
    peak_memory_bytes: float
    usable_memory_bytes: float
    breakdown: dict[str, float]  # exposed seconds per category; they sum to step_time_s
    memory_by_stage: tuple[dict[str, float], ...]  # bytes per category per rank (exact only)
    stage_layers: tuple[tuple[str, ...], ...]  # module paths per (virtual) stage
    num_microbatches: int
    # per (virtual) stage, per micro-batch on one rank: what the schedule was simulated with
    stage_forward_s: tuple[float, ...] = ()
    stage_backward_s: tuple[float, ...] = ()
    stage_wgrad_s: tuple[float, ...] = ()
    p2p_s: float = 0.0
    timeline: PipelineTimeline | None = field(default=None, repr=False)  # None: closed form

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.usable_memory_bytes

    @property
    def tensor_memory_bytes(self) -> float:
        """The largest rank's tensors: model states, activations and ZeRO-3 gathered buffers,
        without the context, communication buffers and allocator reserve that
        `peak_memory_bytes` adds -- what an allocator's peak allocated bytes measure."""
        return max((m["states"] + m["activations"] + m["zero3_buffers"]
                    for m in self.memory_by_stage), default=0.0)


@dataclass(frozen=True, kw_only=True)
class ModelCosts:
    """What the estimate needs from one trace; units are for `traced_batch` sequences."""

    units: tuple[Unit, ...]
    traced_batch: int
    seq_len: int | None
    flops_fwd: float
    num_layers: int
    num_heads: int | None
    num_kv_heads: int | None
    num_experts: int | None

    @classmethod
    def from_graph(cls, graph: Graph) -> "ModelCosts":
        units = units_from_graph(graph)
        heads, kv_heads = _attention_heads(graph)
        kv = kv_projections(graph.nodes).values()
        if kv:  # the heads the K/V projections make (before any repeat to the query heads)
            kv_heads = min(made.heads for made in kv)
        return cls(units=units, traced_batch=graph.batch_size, seq_len=graph.seq_len,
                   flops_fwd=float(graph.flops_fwd), num_layers=sum(u.count for u in units),
                   num_heads=heads, num_kv_heads=kv_heads, num_experts=_num_experts(graph))

    def with_cp_layout(self, layout: str) -> "ModelCosts":
        """These costs with context parallel run as ``layout``: "zigzag" (load-balanced) or
        "contiguous" (one chunk per rank: a causal attention's work is the last rank's)."""
        balanced = {"zigzag": True, "contiguous": False}[layout]
        units = tuple(replace(u, ops=tuple(replace(op, cp_balanced=balanced)
                                           if op.kind == "attention" else op for op in u.ops))
                      for u in self.units)
        return replace(self, units=units)

    def with_ep_dispatch(self, dispatch: str) -> "ModelCosts":
        """These costs with expert parallel moving tokens by ``dispatch``: "all_to_all" or
        "all_gather" (each ep rank's tokens gathered, the outputs reduce-scattered)."""
        if dispatch not in ("all_to_all", "all_gather"):
            raise ValueError(f"ep dispatch {dispatch!r} is not 'all_to_all' or 'all_gather'")
        return replace(self, units=tuple(replace(u, ep_dispatch=dispatch) for u in self.units))

    def with_tp_layout(self, replicated: Mapping[str, frozenset[int]]) -> "ModelCosts":
        """These costs with the sub-layers ``replicated`` names ({block name: indices into
        its `Unit.sublayers`}, `autopar.plan.replicated_sublayers`) run replicated over tp
        on the sequence shard (`Unit.replicated`)."""
        if not any(replicated.values()):
            return self
        return replace(self, units=tuple(u.replicated(frozenset(replicated.get(u.name, ())))
                                         for u in self.units))

    @functools.cached_property
    def body_layers(self) -> int:
        """Layers from the first block layer to the last (`autopar.estimate.stages.body_span`):
        the most pipeline chunks autopar's runtime cuts the model into."""
        first, end = body_span(self.units)
        return end - first

    @functools.cached_property
    def per_op_costed(self) -> bool:
        """Whether per-op recompute is costed: the model has blocks, and none of them has an
        MoE layer costed as a whole whose experts' matmuls alternate with the routing
        (`Unit.per_op_routed`, `autopar.estimate.kept.per_op_kept`)."""
        blocks = [u for u in self.units if u.is_block]
        return bool(blocks) and not any(u.per_op_routed for u in blocks)

    def units_for(self, micro_batch_size: int) -> tuple[Unit, ...]:
        factor = micro_batch_size / self.traced_batch
        return tuple(u.scaled(factor) for u in self.units)


def _num_experts(graph: Graph) -> int | None:
    """Experts per MoE layer (the most of any layer), from each layer's traced span -- the
    nodes between its MOE_DISPATCH and MOE_COMBINE: the leading dim of fused ``[E, ...]``
    expert weights, or else the expert outputs the combine reads (one per expert of a list);
    None without MoE layers."""
    most = 0
    span: list[Node] | None = None
    for node in graph.nodes:
        if node.kind is OpKind.MOE_DISPATCH:
            span = []
        elif node.kind is OpKind.MOE_COMBINE and span is not None:
            fused = [p.shape[0] for n in span for p in n.params if len(p.shape) == 3]
            inside = {n.name for n in span}
            most = max(most, fused[0] if fused else
                       sum(src in inside for src in node.input_sources))
            span = None
        elif span is not None:
            span.append(node)
    return most or None


def _attention_heads(graph: Graph) -> tuple[int | None, int | None]:
    for node in graph.nodes:
        if node.kind is OpKind.ATTENTION and node.attention is not None:
            return node.attention.num_heads, node.attention.num_kv_heads
    return None, None


def _checked(costs: ModelCosts, cluster: Cluster, config: ParallelConfig,
             global_batch_size: int) -> int:
    """`check_config` against the model and the cluster: the number of micro-batches."""
    if config.recompute == "per_op" and not costs.per_op_costed:
        raise InvalidConfigError(
            "recompute='per_op' keeps the outputs of every other matmul of each block, and "
            "in a block of this model which ones depends on the routing (an MoE layer with an "
            "odd number of [E, ...] expert weights, run expert by expert); use "
            "recompute='full' or 'none'")
    return check_config(config, world_size=cluster.world_size,
                        global_batch_size=global_batch_size, num_layers=costs.num_layers,
                        num_heads=costs.num_heads, num_kv_heads=costs.num_kv_heads,
                        num_experts=costs.num_experts, seq_len=costs.seq_len)


def evaluate(costs: ModelCosts, cluster: Cluster, config: ParallelConfig, *,
             global_batch_size: int, dtype: str = "bf16",
             options: EstimateOptions = EstimateOptions(), cache: EvalCache | None = None,
             exact: bool = True,
             stage_boundaries: tuple[tuple[int, int], ...] | None = None) -> Estimate:
    """Estimate `config` from model costs; `exact` simulates the schedule, else closed form.
    `stage_boundaries` (layer ranges over the whole model, glue included) replaces the
    placement of layers on stages `options.pipeline_balance` names."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is unknown; allowed: {', '.join(DTYPE_BYTES)}")
    m = _checked(costs, cluster, config, global_batch_size)
    cache = cache or EvalCache(cluster)
    if stage_boundaries is None and config.pp > 1 and options.pipeline_balance == "gemm_weights":
        stage_boundaries = weight_balanced_boundaries(costs.units,
                                                      config.pp * config.virtual_stages)
    prep = _prepared(costs, cache, config, dtype, options, stage_boundaries)
    lay, p2p = prep.lay, prep.p2p
    timeline = None
    if exact:  # the simulation depends on the layout, schedule and m: not on ZeRO
        key = (config.pp_schedule, m)
        if key not in prep.timelines:
            prep.timelines[key] = simulate_pipeline(
                schedule=config.pp_schedule, num_stages=config.pp, num_microbatches=m,
                virtual_stages=config.virtual_stages, forward_s=lay.fwd, backward_s=lay.bwd,
                weight_grad_s=lay.wgrad if config.pp_schedule == "zero-bubble" else None,
                p2p_s=p2p, activation_bytes=lay.kept)
        timeline = prep.timelines[key]
        pipe_s, busy = timeline.step_time_s, list(timeline.busy_s)
        inflight = list(timeline.peak_inflight_bytes)
        busiest = int(np.argmax(busy))
    else:
        key = (config.pp_schedule, m)
        if key not in prep.pipeline:
            pipe_s, busy = pipeline_bound(config, m, lay, p2p)
            prep.pipeline[key] = (pipe_s, int(np.argmax(busy)),
                                  analytic_inflight(config, m, lay))
        pipe_s, busiest, inflight = prep.pipeline[key]

    dp_exposed, dp_total, optimizer, tp_grad_sync, tied = _data_parallel(
        cluster, cache, prep, config, m, dtype, options)
    step = pipe_s + dp_exposed + optimizer + tp_grad_sync + tied
    breakdown = _breakdown(pipe_s, lay.attr_sums(busiest), m)
    breakdown["tp_comm"] += tp_grad_sync
    breakdown.update(pp_comm=float(tied), dp_comm=float(dp_exposed), optimizer=float(optimizer),
                     dp_comm_total=float(dp_total), pp_p2p_per_transfer=float(p2p))
    peak_dense = cluster.hardware.device.peak_flops.get(dtype, 0.0)
    model_flops = 3.0 * costs.flops_fwd * (global_batch_size / costs.traced_batch)
    tokens = global_batch_size * (costs.seq_len or 1)
    zero = held_zero_stage(config, options.fsdp2)  # what the rank holds at its peak
    held = config if zero == config.zero_stage else replace(config, zero_stage=zero)
    if exact:
        memory = stage_memory(held, dtype, lay.dense, lay.expert, lay.max_param_bytes,
                              lay.bytes_per_param, inflight, list(lay.rank_working),
                              options.zero3_max_live_params, options.fp32_params)
        peak = max(sum(v for k, v in mem.items() if not k.startswith("_")) for mem in memory)
    else:  # the search only needs the peak; per-stage categories come with the exact pass
        memory = []
        peak = fast_peak_memory(held, dtype, lay, inflight, options.zero3_max_live_params,
                                options.fp32_params)
    return Estimate(
        config=config, step_time_s=step, tokens_per_s=tokens / step,
        mfu=model_flops / (step * cluster.world_size * peak_dense) if peak_dense else 0.0,
        model_tflops_per_gpu=model_flops / (step * cluster.world_size) / 1e12,
        peak_memory_bytes=peak, usable_memory_bytes=cluster.hardware.device.memory_bytes,
        breakdown=breakdown, memory_by_stage=tuple(memory),
        stage_layers=lay.stage_layers, num_microbatches=m,
        stage_forward_s=lay.fwd_s, stage_backward_s=lay.bwd_s, stage_wgrad_s=lay.wgrad_s,
        p2p_s=float(p2p), timeline=timeline)


def _data_parallel(cluster: Cluster, cache: EvalCache, prep: "_Prepared",
                   config: ParallelConfig, m: int, dtype: str, options: EstimateOptions
                   ) -> tuple[float, float, float, float, float]:
    """(exposed, total) data-parallel seconds and the optimizer step, on the pipeline rank
    with the most parameters, the seconds of the collectives over tp that make gradients
    whole (`partial_gradient_sync`: FSDP2 issues them in its reduce-scatter passes) and of
    the sums of gradients of weights tied across pipeline stages after the drain
    (`tied_gradient_sync`); memoised per (ZeRO stage, micro-batches, options)."""
    dkey = (config.zero_stage, m, options)
    if dkey not in prep.data_parallel:
        dp_exposed, dp_total = dp_comm(cache, config, prep.groups, prep.dense, prep.expert,
                                        prep.heavy_sums, m, dtype, options, prep.units_here)
        prep.data_parallel[dkey] = (dp_exposed, dp_total, _optimizer_s(
            cluster.hardware.device, prep.dense, prep.expert, config, dtype),
            partial_gradient_sync(cache, cache.units[config.micro_batch_size], prep.lay,
                                  config, prep.groups, options, m, dtype),
            tied_gradient_sync(cache, cache.units[config.micro_batch_size], prep.lay, config,
                               prep.groups, options, dtype))
    return prep.data_parallel[dkey]


def _optimizer_s(device, dense: float, expert: float, config: ParallelConfig,
                 dtype: str) -> float:
    """The optimizer step of a rank holding `dense` and `expert` parameters: over its shard
    of each under ZeRO >= 1 (dp*cp ranks hold the same dense ones, `expert_dp` the same
    experts), over all of them otherwise."""
    if config.zero_stage >= 1:
        dense, expert = dense / (config.dp * config.cp), expert / config.expert_dp
    return optimizer_time_s(device, dense + expert, dtype)


@dataclass(frozen=True, kw_only=True)
class _Prepared:
    """What `evaluate` needs of one (micro-batch, degrees, SP, recompute, stage split) that
    the ZeRO stage, the schedule and the global batch leave unchanged: the layout, the rank
    groups, the p2p time and the data-parallel view of the pipeline rank with the most
    parameters. `pipeline` and `data_parallel` memoise the closed-form pipeline terms per
    (schedule, micro-batches) and the DP/optimizer terms per (ZeRO stage, micro-batches,
    options), `timelines` the simulated schedule per (schedule, micro-batches),
    so a search pays for each once."""

    lay: Layout
    groups: RankGroups
    p2p: float
    dense: float
    expert: float
    heavy_sums: dict[str, float]
    units_here: list["GatherUnit"]
    pipeline: dict = field(default_factory=dict)
    data_parallel: dict = field(default_factory=dict)
    timelines: dict = field(default_factory=dict)


def _degrees_key(config: ParallelConfig, dtype: str, options: EstimateOptions) -> tuple:
    return (config.micro_batch_size, config.tp, config.cp, config.ep, config.folded,
            config.sequence_parallel,
            config.recompute, config.recompute_every, options.attention_kernel,
            options.overlap_tp_comm, options.kernels, options.loss_kernel,
            options.recompute_early_stop, dtype, options.fp8_recipe)


def _times_key(cache: EvalCache, config: ParallelConfig, dtype: str,
               options: EstimateOptions) -> tuple:
    return _degrees_key(config, dtype, options) + order_key(cache, config)


def _unit_times(costs: ModelCosts, cache: EvalCache, config: ParallelConfig, dtype: str,
                options: EstimateOptions, comm: bool = True) -> dict[str, UnitTimes]:
    """Per-unit times of `config` (they depend on micro-batch, tp, cp, ep, SP and recompute
    only: `slowest_groups` picks the tp, cp and ep groups by those degrees and the node, not
    by dp or pp; in other mesh orders the layouts of those groups, `order_key`), memoised.
    The units' kernels (`unit_compute`) are memoised without the layouts: every order that
    lays the groups out anew reuses them. Without `comm`, the times leave communication out
    (`unit_times` without groups)."""
    base = _degrees_key(config, dtype, options)
    key = base + (order_key(cache, config) if comm else ("no communication",))
    times = cache.times.get(key)
    if times is None:
        mbs = config.micro_batch_size
        if mbs not in cache.units:
            cache.units[mbs] = costs.units_for(mbs)
        groups = _rank_groups(cache, config) if comm else None
        compute = cache.compute.get(base)
        if compute is None:
            compute = cache.compute[base] = {
                u.name: unit_compute(u, cluster=cache, dtype=dtype, cfg=config,
                                     attention_kernel=options.attention_kernel,
                                     kernels=options.kernels, loss_kernel=options.loss_kernel,
                                     fp8_recipe=options.fp8_recipe)
                for u in cache.units[mbs]}
        times = cache.times[key] = {
            u.name: unit_times(u, cluster=cache, dtype=dtype, cfg=config, groups=groups,
                               options=options, compute=compute[u.name])
            for u in cache.units[mbs]}
    return times


def _prepared(costs: ModelCosts, cache: EvalCache, config: ParallelConfig, dtype: str,
              options: EstimateOptions,
              boundaries: tuple[tuple[int, int], ...] | None) -> _Prepared:
    times = _unit_times(costs, cache, config, dtype, options)
    copies = keeps_weight_copies(config, dtype, options.fp32_params)  # in the activations
    fp8_copies = keeps_fp8_copies(dtype, options.fp32_params, options.fp8_recipe)
    vkey = _times_key(cache, config, dtype, options) + (copies, fp8_copies)
    lkey = vkey + (config.pp, config.virtual_stages, boundaries)
    prep = cache.layouts.get(lkey)
    if prep is not None:
        return prep
    units = cache.units[config.micro_batch_size]
    split = split_structure(costs, cache, config.pp, config.virtual_stages, boundaries)
    if isinstance(split, str):
        raise InvalidConfigError(split)
    if vkey not in cache.vectors:
        cache.vectors[vkey] = unit_vectors(units, times, config,
                                           options.attention_kernel != "math",
                                           options.loss_kernel, weight_copies=copies,
                                           fp8=fp8_copies)
    lay = layout(cache.vectors[vkey], config, split)
    groups = _rank_groups(cache, config)
    p2p = (cache.collective_time("send_recv", boundary_bytes(units, config), groups.pp_hop)
           if groups.pp_hop is not None else 0.0)
    heavy = int(np.argmax(lay.rank_dense + lay.rank_expert))  # the first, as max() took
    units_here = gather_units(units, lay.rank_counts[heavy], config)
    prep = cache.layouts[lkey] = _Prepared(
        lay=lay, groups=groups, p2p=p2p, dense=lay.rank_dense[heavy],
        expert=lay.rank_expert[heavy],
        heavy_sums=lay.attr_sums(heavy), units_here=units_here)
    return prep


def split_structure(costs: ModelCosts, cache: EvalCache, pp: int, v: int,
                    boundaries: tuple[tuple[int, int], ...] | None = None) -> Structure | str:
    """The layers of each unit on the pp x v chunks (unit counts only: one split serves every
    micro-batch size), memoised; the reason as a string when the split cannot be made (e.g.
    more chunks than layers), so that a search asking again pays nothing."""
    key = (pp, v, boundaries)
    if key not in cache.structures:
        try:
            cache.structures[key] = structure(costs.units, pp, v, boundaries)
        except InvalidConfigError as exc:
            cache.structures[key] = str(exc)
    return cache.structures[key]


def layer_costs(costs: ModelCosts, cluster: Cluster, config: ParallelConfig, *, dtype: str,
                options: EstimateOptions, cache: EvalCache | None = None
                ) -> dict[str, list[float]]:
    """Per layer of the whole model (glue included), on one rank of `config`: forward,
    backward and weight-grad seconds per micro-batch, activation bytes kept per micro-batch,
    and model-state bytes -- the inputs of the inter-op stage DP."""
    cache = cache or EvalCache(cluster)
    times = _unit_times(costs, cache, config, dtype, options)
    units = cache.units[config.micro_batch_size]
    flash = options.attention_kernel != "math"
    shards = config.dp * config.cp
    dense_b = state_bytes_per_param(dtype, config.zero_stage, shards, options.fp32_params)
    expert_b = state_bytes_per_param(dtype, config.zero_stage, config.expert_dp,
                                     options.fp32_params)
    out: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "wgrad", "act",
                                                   "states")}
    copies = keeps_weight_copies(config, dtype, options.fp32_params)
    fp8_copies = keeps_fp8_copies(dtype, options.fp32_params, options.fp8_recipe)
    per_unit = {}
    for unit in units:  # every layer of a unit alike
        t = times[unit.name]
        kept = activation_bytes(unit, config, flash, options.loss_kernel,
                                weight_copies=copies,
                                fp8=fp8_copies)[0]
        states = unit.dense_on_tp_rank(config.tp) * dense_b \
            + unit.expert_params / (config.expert_tp * config.ep) * expert_b
        per_unit[unit.name] = (("forward", t.forward), ("backward", t.backward),
                               ("wgrad", t.compute_wgrad), ("act", kept), ("states", states))
    for unit, _ in layer_sequence(units):  # in model order
        for key, value in per_unit[unit.name]:
            out[key].append(value)
    return out


def _breakdown(step: float, sums: dict[str, float], m: int) -> dict[str, float]:
    """Exposed seconds of the busiest pipeline rank; its idle time is the bubble."""
    parts = {
        "compute": m * (sums["compute_fwd"] + sums["compute_bwd"]),
        "recompute": m * sums["recompute"],
        "tp_comm": m * (sums["tp_fwd"] + sums["tp_bwd"]),
        "cp_comm": m * (sums["cp_fwd"] + sums["cp_bwd"]),
        "ep_comm": m * (sums["ep_fwd"] + sums["ep_bwd"]),
    }
    parts["bubble"] = max(0.0, step - sum(parts.values()))
    return parts


def costs_of_layout(graph: Graph, config: ParallelConfig,
                    tp_placements: Mapping[str, str] | None) -> ModelCosts:
    """`ModelCosts` of ``graph`` under the tensor-parallel layout ``tp_placements`` ({param
    FQN: placement on tp}; None: Megatron-LM's at the config's tp,
    `autopar.plan.megatron_tp_placements`)."""
    costs = ModelCosts.from_graph(graph)
    if tp_placements is None or config.tp == 1:
        return costs
    from autopar.plan.placements import replicated_sublayers  # plan imports the estimate

    return costs.with_tp_layout(replicated_sublayers(
        graph, costs.units, tp_placements, sequence_parallel=config.sequence_parallel,
        tp=config.tp))


def estimate_graph(graph: Graph, cluster: Cluster, config: ParallelConfig, *,
                   global_batch_size: int, dtype: str = "bf16",
                   options: EstimateOptions = EstimateOptions(),
                   tp_placements: Mapping[str, str] | None = None) -> Estimate:
    """Estimate from a graph traced for one micro-batch (`graph.batch_size` sequences)."""
    if graph.batch_size != config.micro_batch_size:
        raise ValueError(f"the graph was traced for batch {graph.batch_size} but the config's "
                         f"micro_batch_size is {config.micro_batch_size}")
    return evaluate(costs_of_layout(graph, config, tp_placements), cluster, config,
                    global_batch_size=global_batch_size, dtype=dtype, options=options)


def estimate(model: nn.Module | Graph, cluster: Cluster, config: ParallelConfig, *,
             global_batch_size: int, seq_len: int | None = None, dtype: str = "bf16",
             example_inputs: Any = None,
             options: EstimateOptions = EstimateOptions(),
             software: str | None = None,
             tp_placements: Mapping[str, str] | None = None) -> Estimate:
    """Predict step time, breakdown and memory per rank of `config` for `model` on `cluster`.

    Token models take `global_batch_size` (sequences) and `seq_len`; other models take
    `example_inputs` for one micro-batch. `dtype` is the training precision. `software`
    names the engine's preset (`autopar.SOFTWARE`: "autopar", "megatron", "torchtitan",
    "torchtitan-compile", "deepspeed"), or `options` sets each field. `tp_placements`
    ({param FQN: placement on the tp axis}, a plan's `Plan.tp_placements`) is the
    tensor-parallel layout when it is not Megatron-LM's: whole sub-layers without attention
    replicated on the sequence shard under sequence parallel, as compile's intra-op ILP may
    choose (`autopar.plan.replicated_sublayers`).
    """
    from autopar.estimate.software import software_options

    options = software_options(software, options)
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be an autopar.Cluster, got {type(cluster).__name__}")
    if not isinstance(config, ParallelConfig):
        raise ValueError(f"config must be an autopar.ParallelConfig, got {type(config).__name__}")
    if isinstance(model, Graph):
        graph = model
    else:
        from autopar.trace import trace  # torch-heavy import kept off the costing path

        if example_inputs is None:
            graph = trace(model, global_batch_size=config.micro_batch_size, seq_len=seq_len,
                          dtype=dtype)
        else:
            graph = trace(model, example_inputs=example_inputs, dtype=dtype)
    return estimate_graph(graph, cluster, config, global_batch_size=global_batch_size,
                          dtype=dtype, options=options, tp_placements=tp_placements)
