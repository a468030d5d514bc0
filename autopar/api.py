"""`autopar.compile`: trace once, search the 5-D space, return the best `Plan`."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn

from autopar.cluster import Cluster
from autopar.estimate.bounds import BOUND_MARGIN, exact_step_lower_bound
from autopar.estimate.core import (Estimate, EstimateOptions, EvalCache, ModelCosts, evaluate,
                                   layer_costs)
from autopar.estimate.software import preset_of, software_options
from autopar.errors import NoPlanFitsError, PlanningError, RuntimeLimitError, StageMemoryError
from autopar.search.context import SearchContext
from autopar.search.inter_op import LayerCosts, partition_stages
from costmodels.memory import live_bytes_budget
from autopar.models.common import count_attention_calls
from autopar.plan import (Plan, fp8_weights, fused_projections, param_placements,
                          summed_row_weights)
from autopar.plan.sections import PlanCluster, PlanMesh, PlanModel, PlanTraining
from autopar.runtime.capabilities import RuntimeLimits, runtime_limits
from autopar.search.tp_layout import choose_layout
from autopar.search.outer import SearchResult, SearchSettings, check_constraints, search
from autopar.targets import AUTOPAR, Facts, get_target

__all__ = ["compile"]

log = logging.getLogger(__name__)


def compile(model: nn.Module, cluster: Cluster, *, global_batch_size: int,
            seq_len: int | None = None, example_inputs: Any = None, dtype: str = "bf16",
            constraints: dict[str, Any] | None = None,
            options: EstimateOptions = EstimateOptions(),
            settings: SearchSettings = SearchSettings(),
            software: str | None = None, target: str = "autopar") -> Plan:
    """The fastest plan that fits for `model` on `cluster` at this training shape.

    Token models take `global_batch_size` (sequences) and `seq_len`; other models take
    `example_inputs` for one micro-batch. `constraints` pins any ParallelConfig field, e.g.
    {"tp": 2, "pp": 2} or {"mesh_order": "dp,pp,cp,tp"}; `settings.mesh_orders` searches
    other mesh orders than the default. `target` names the engine that will run the plan
    (`autopar.targets`): "autopar" (its own runtime), "megatron", "torchtitan" or
    "deepspeed"; the search then keeps to what that engine runs, and a pin, precision or
    option outside it is refused with the engine's rule. `software` names the preset the
    plans are costed with (`autopar.SOFTWARE`), or `options` sets each field; with neither,
    the target's own preset. A target other than autopar also costs the best plan for
    autopar's runtime with the same software (`plan.training.unrestricted`: what the
    engine's rules cost). Raises NoPlanFitsError when nothing fits, saying by how much.
    """
    from autopar.trace import trace

    constraints = check_constraints(constraints)  # as the plan records them
    engine = get_target(target)
    if software is None and options == EstimateOptions():
        software = engine.software  # the target's preset unless the caller chose the costs
    options = software_options(software, options)
    if options.pipeline_balance != "layers":
        raise ValueError(f"EstimateOptions.pipeline_balance={options.pipeline_balance!r} says "
                         f"how an engine cuts the stages of a configuration it runs "
                         f"(autopar.estimate); a plan chooses its own cut (plan.stages): "
                         f"compile with pipeline_balance='layers'")
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be an autopar.Cluster, got {type(cluster).__name__}")
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) \
            or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be an integer >= 1, got {global_batch_size!r}")
    clock = _PhaseClock()
    with count_attention_calls() as attention_calls:
        if example_inputs is None:
            if seq_len is None:
                raise ValueError("token models need seq_len (and global_batch_size); other "
                                 "models need example_inputs for one micro-batch")
            graph = trace(model, global_batch_size=1, seq_len=seq_len, dtype=dtype)
        else:
            graph = trace(model, example_inputs=example_inputs, dtype=dtype)
    clock.lap("trace")
    costs = ModelCosts.from_graph(graph)
    input_spec = _input_spec(example_inputs)
    engine.check(constraints, Facts.of(costs, dtype, options))
    ctx = SearchContext(costs=costs, cluster=cluster, global_batch_size=global_batch_size,
                        dtype=dtype, options=options, settings=settings, target=engine)
    runtime = dict(model=model, graph=graph, example_inputs=example_inputs,
                   input_spec=input_spec, attention_calls=attention_calls[0])
    found = _best(ctx, constraints, runtime, clock=clock)
    result, limits = found.result, found.limits
    unrestricted = None
    if engine.restricts:
        unrestricted = _unrestricted(ctx, constraints, runtime)
        clock.lap("unrestricted")
    graphs: dict[int, Any] = {}

    def graph_at(micro_batch_size: int):  # 0: the graph as traced
        if micro_batch_size not in graphs:
            graphs[micro_batch_size] = graph if not micro_batch_size else _micro_batch_graph(
                model, graph, micro_batch_size, seq_len, example_inputs, dtype)
        return graphs[micro_batch_size]

    laid = choose_layout(replace(found.ctx, graph_at=graph_at), found.best, result.candidates,
                         replicate=engine is AUTOPAR and settings.tp_layouts == "ilp")
    best, tp_map, intra_op = laid.estimate, laid.placements, laid.report
    clock.lap("intra_op")
    cfg = best.config
    placements, fingerprint = param_placements(graph, cfg, tp_map), graph.fingerprint()
    clock.lap("plan")
    sizes = {"pp": cfg.pp, "dp": cfg.dp, "cp": cfg.cp, "tp": cfg.tp}
    plan = Plan(
        config=cfg, estimate=best, stages=[list(s) for s in best.stage_layers],
        placements=placements, intra_op=intra_op,
        mesh=PlanMesh(axes=cfg.mesh_order, sizes=tuple(sizes[a] for a in cfg.mesh_order),
                      ep_within="tp*cp*dp" if cfg.folded else "dp*cp", ep=cfg.ep),
        model=PlanModel(model_class=graph.model_class, fingerprint=fingerprint,
                        num_params=graph.num_params, num_layers=costs.num_layers,
                        cp_layout=limits.cp_layout, ep_dispatch=limits.ep_dispatch,
                        fused_projections=fused_projections(graph) or None,
                        summed_row_weights=cfg.tp > 1 and summed_row_weights(
                            graph, cfg.sequence_parallel) or None),
        cluster=PlanCluster(profile=cluster.name, num_nodes=cluster.num_nodes,
                            world_size=cluster.world_size, fingerprint=cluster.fingerprint()),
        training=PlanTraining(
            global_batch_size=global_batch_size, seq_len=graph.seq_len,
            input=input_spec or None, dtype=dtype,
            constraints=dict(sorted(constraints.items())),
            fp8_weights=fp8_weights(graph) if dtype == "fp8" else None,
            memory_headroom=settings.memory_headroom, memory_headroom_kept=found.headroom_kept,
            device_memory_bytes=cluster.hardware.device.memory_bytes,
            software=software or preset_of(options),
            options={k: getattr(options, k) for k in options.__dataclass_fields__},
            target=engine.name, unrestricted=unrestricted),
        candidates=result.candidates,
        search={"num_considered": result.num_considered,
                "num_pruned_by_memory": result.num_pruned_by_memory,
                "num_pruned_by_bound": result.num_pruned_by_bound,
                "num_simulated": result.num_simulated,
                "seconds": result.seconds,
                "phase_seconds": clock.laps,
                "stage_cut": "inter-op DP" if laid.winner and found.best is not result.best
                else "even (Megatron)"})
    plan.origin.update(model=model, cluster=cluster, example_inputs=example_inputs)
    return plan


@dataclass(frozen=True)
class _Found:
    """The best plan's estimate for one target, and how it was found."""

    result: SearchResult  # the outer search's
    best: Estimate  # the search's winner, or its stages re-cut
    # the search's: the model's costs as the target runs it (its context and expert
    # parallel), the cluster planned within (less the memory headroom if it was kept)
    ctx: SearchContext
    headroom_kept: bool
    limits: RuntimeLimits


def _micro_batch_graph(model, graph, micro_batch_size: int, seq_len, example_inputs,
                       dtype: str):
    """``graph`` traced again at ``micro_batch_size`` sequences or samples, for the intra-op
    ILP: a token model's at that many sequences, a model traced from its example inputs with
    each input that carries the traced batch on its first dim resized to it."""
    from torch.utils import _pytree as pytree

    from autopar.trace import trace

    if micro_batch_size == graph.batch_size:
        return graph
    if example_inputs is None:
        return trace(model, global_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype)

    def resized(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == graph.batch_size:
            return torch.empty((micro_batch_size, *t.shape[1:]), dtype=t.dtype, device="meta")
        return t

    return trace(model, example_inputs=pytree.tree_map(resized, example_inputs), dtype=dtype)


def _best(ctx: SearchContext, constraints: dict[str, Any], runtime: dict[str, Any],
          clock: _PhaseClock | None = None) -> _Found:
    """The fastest plan `ctx.target` runs under `constraints`: autopar's runtime keeps to its
    limits for the model (and costs context and expert parallel as it runs them); an engine
    runs its own implementation of the model, within its rules. Plans fill the device less
    the memory headroom, or, where nothing fits there, the whole device. `clock` times the
    search and the stage re-cut."""
    clock = clock or _PhaseClock()
    graph, costs, settings = runtime["graph"], ctx.costs, ctx.settings
    limits = RuntimeLimits()
    if ctx.target.runtime_limits:
        example_inputs = runtime["example_inputs"]
        limits = runtime_limits(runtime["model"], graph, token_model=example_inputs is None,
                                one_input=example_inputs is None
                                or runtime["input_spec"] is not None,
                                attention_hook_calls=runtime["attention_calls"],
                                num_experts=costs.num_experts)
        if limits.cp_layout == "contiguous":
            costs = costs.with_cp_layout("contiguous")
        if limits.ep_dispatch == "all_gather":
            costs = costs.with_ep_dispatch("all_gather")
    regions = _within_limits(constraints, limits)
    planned = ctx.cluster.with_memory_headroom(settings.memory_headroom)
    # the search's memo tables, reused by the stage re-cut
    within = replace(ctx, costs=costs, cluster=planned, cache=EvalCache(planned))
    result, error = _search_regions(within, regions)
    headroom_kept = result is not None or not settings.memory_headroom
    if not headroom_kept and isinstance(error, NoPlanFitsError):
        within = replace(within, cluster=ctx.cluster, cache=EvalCache(ctx.cluster))
        result, error = _search_regions(within, regions)
        if result is not None:
            log.warning("no plan fits within the %g%% memory headroom (SearchSettings."
                        "memory_headroom); returning the best that fits the whole device, "
                        "its peak %.1f%% of device memory", 100 * settings.memory_headroom,
                        100 * result.best.peak_memory_bytes / result.best.usable_memory_bytes)
    if result is None:
        raise error
    clock.lap("search")
    best = result.best
    if ctx.target.uneven_stages:
        best = _rebalance_stages(within, best)
    clock.lap("stage_dp")
    return _Found(result=result, best=best, ctx=within, headroom_kept=headroom_kept,
                  limits=limits)


def _unrestricted(ctx: SearchContext, constraints: dict[str, Any],
                  runtime: dict[str, Any]) -> dict[str, Any]:
    """The best plan for autopar's runtime under the same pins and software: its step time
    and config (`plan.training.unrestricted`), or why there is none."""
    try:
        found = _best(replace(ctx, target=AUTOPAR), constraints, runtime)
    except PlanningError as exc:  # e.g. a pin this runtime cannot run for the model
        return {"step_time_s": None, "reason": str(exc)}
    return {"step_time_s": float(found.best.step_time_s), "config": found.best.config.short()}


def _search_regions(ctx: SearchContext, regions: list[dict[str, Any]]
                    ) -> tuple[Any, Exception | None]:
    """(the fastest search result over the regions, or None; the first region's error)."""
    result, error = None, None
    for region in regions:
        try:
            found = search(ctx.costs, ctx.cluster, global_batch_size=ctx.global_batch_size,
                           dtype=ctx.dtype, constraints=region, options=ctx.options,
                           settings=ctx.settings, cache=ctx.cache, target=ctx.target)
        except PlanningError as exc:  # the other region may hold a plan
            error = error or exc
            continue
        if result is None or found.best.step_time_s < result.best.step_time_s:
            result = found
    return result, error


def _input_spec(example_inputs: Any) -> dict[str, Any] | None:
    """``{"shape": [...], "dtype": ...}`` of one sample of a model's single input tensor (the
    example micro-batch less its batch dim), or None when the model takes token ids or
    several inputs."""
    if isinstance(example_inputs, (tuple, list)) and len(example_inputs) == 1:
        example_inputs = example_inputs[0]
    if not isinstance(example_inputs, torch.Tensor) or example_inputs.dim() < 1:
        return None
    return {"shape": list(example_inputs.shape[1:]),
            "dtype": str(example_inputs.dtype).removeprefix("torch.")}


def _within_limits(constraints: dict[str, Any], limits: RuntimeLimits) -> list[dict[str, Any]]:
    """The search's constraints, one dict per region of the space the runtime can run: the
    user's pins, degree 1 on every axis the runtime cannot run for this model (a pin above 1
    there is refused with the runtime's reason), each field it runs at one value only at that
    value (likewise), for each pair of axis groups the runtime cannot combine, one region per
    group held at 1 (unless a pin decides which), and for each set of alternatives of which
    a plan must hold one, one region per alternative the pins allow."""
    for axis, reason in sorted(limits.axes.items()):
        if constraints.get(axis, 1) != 1:
            raise RuntimeLimitError(f"{axis}={constraints[axis]} cannot run on this model: "
                                    f"{reason}; plan with {axis}=1 (or leave {axis} unpinned)")
    for name, (value, reason) in sorted(limits.fields.items()):
        if constraints.get(name, value) != value:
            raise RuntimeLimitError(f"{name}={constraints[name]!r} cannot run: {reason}; plan "
                                    f"with {name}={value!r} (or leave {name} unpinned)")
    if limits.axes:
        log.info("this runtime cannot run %s for this model (%s): searching them at 1",
                 ", ".join(sorted(limits.axes)), "; ".join(f"{a}: {r}" for a, r in
                                                          sorted(limits.axes.items())))
    regions = [{**constraints, **{axis: 1 for axis in limits.axes},
                **{name: value for name, (value, _) in limits.fields.items()}}]
    for first, second, reason in limits.exclusive:
        pinned = [group for group in (first, second)
                  if any(constraints.get(axis, 1) != 1 for axis in group)]
        if len(pinned) == 2:
            pins = ", ".join(f"{a}={constraints[a]}" for a in sorted(first | second)
                             if constraints.get(a, 1) != 1)
            raise RuntimeLimitError(
                f"{pins} cannot run together on this model: {reason}; pin only one of "
                f"{'/'.join(sorted(first))} and {'/'.join(sorted(second))} above 1")
        keep = [first, second] if not pinned else [pinned[0]]
        regions = [{**r, **{axis: 1 for axis in (second if group is first else first)}}
                   for r in regions for group in keep]
    for alternatives, reason in limits.one_of:
        held = [alt for alt in alternatives
                if all(constraints.get(k, v) == v for k, v in alt.items())]
        if not held:
            pins = ", ".join(f"{k}={constraints[k]}" for k in sorted(
                {k for alt in alternatives for k in alt}) if k in constraints)
            raise RuntimeLimitError(f"{pins} cannot run on this model: {reason}")
        regions = [{**r, **alt} for r in regions for alt in held
                   if all(r.get(k, v) == v for k, v in alt.items())]
    unique = {tuple(sorted(r.items())): r for r in regions}  # pairs may repeat a region
    return list(unique.values())


class _PhaseClock:
    """Wall seconds of each phase of one compile, in order (`Plan.search["phase_seconds"]`):
    trace; search (the model's unit costs and the outer search); stage_dp (the inter-op
    DP's re-cut of the winner's pipeline stages); intra_op (the ILP of each unique block at
    the winner's tp); plan (the parameter placements of every layer and the model's
    fingerprint)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase] = now - self._last
        self._last = now


def _rebalance_stages(ctx: SearchContext, best: Estimate) -> Estimate:
    """Re-cut the winner's pipeline stages with the inter-op DP (non-uniform where layers
    differ), the winner's Megatron placement as its incumbent; keep the cut only if the
    simulated schedule is faster and it still fits. A cut
    whose simulated step is bounded below by the winner's (`exact_step_lower_bound`) is
    dropped without simulating it."""
    cfg = best.config
    if cfg.pp == 1:
        return best
    costs, cluster, cache = ctx.costs, ctx.cluster, ctx.cache
    per_layer = layer_costs(costs, cluster, cfg, dtype=ctx.dtype, options=ctx.options,
                            cache=cache)
    budget = live_bytes_budget(cluster.hardware.device.memory_bytes)
    ends = list(itertools.accumulate(len(layers) for layers in best.stage_layers))
    megatron = tuple(zip([0] + ends[:-1], ends))
    layers = LayerCosts(
        forward_s=per_layer["forward"], backward_s=per_layer["backward"],
        activation_bytes=per_layer["act"], state_bytes=per_layer["states"],
        weight_grad_s=per_layer["wgrad"] if cfg.pp_schedule == "zero-bubble" else None)
    try:
        cut = partition_stages(
            layers, num_stages=cfg.pp, num_microbatches=best.num_microbatches,
            schedule=cfg.pp_schedule, virtual_stages=cfg.virtual_stages,
            p2p_s=best.breakdown["pp_p2p_per_transfer"], memory_budget_bytes=budget,
            incumbent=megatron)
    except StageMemoryError:
        return best
    boundaries = tuple(cut.boundaries)
    if boundaries == megatron:
        return best
    bound = exact_step_lower_bound(costs, cluster, cfg, global_batch_size=ctx.global_batch_size,
                                   dtype=ctx.dtype, options=ctx.options, cache=cache,
                                   stage_boundaries=boundaries)
    if bound * (1 - BOUND_MARGIN) >= best.step_time_s:  # cannot be faster: skip simulating
        return best
    candidate = evaluate(costs, cluster, cfg, global_batch_size=ctx.global_batch_size,
                         dtype=ctx.dtype, options=ctx.options, cache=cache, exact=True,
                         stage_boundaries=boundaries)
    if candidate.fits and candidate.step_time_s < best.step_time_s:
        log.info("inter-op DP re-cut the stages: %.3f s -> %.3f s per step",
                 best.step_time_s, candidate.step_time_s)
        return candidate
    return best
