"""The tensor-parallel layout of a plan: the intra-op ILP of each unique block at the winning
configuration, priced in full.

The ILP (:func:`autopar.search.intra_op.solve_block`) sees, beside one block's compute and tp
communication per micro-batch, what each parameter placement costs the rank for the whole
step under the plan's data parallelism (`layout_price`): the training state of every element
it holds (weights, gradients and optimizer states under the ZeRO stage, over the dp x cp
replicas) and each element's share of the step's exposed gradient reduction and optimizer
step, per micro-batch. The rank's free memory bounds what a layout may hold beyond the one
the estimate costs (`block_budget`): within it the ILP takes the best layout Lagrangian
relaxation finds (proven optimal where the relaxation's bound meets it). A replicated weight
is then chosen only where its saved communication pays for its memory and per-step work, and
where it fits.

The layouts a plan may take are those the estimate costs and the runtime runs as the ILP
prices them: Megatron-LM's (column-parallel GEMMs into each sub-layer, row-parallel into the
residual add, found from the dataflow) and, under sequence parallel for autopar's runtime,
Megatron-LM's with some sub-layers without attention or routing (an MLP) replicated: each
tp rank runs them on its shard of the sequence with whole weights, with no activation traffic,
its weight gradients all-reduced once a step (`Unit.replicated`). The ILP prices each of
those (`solve_block` with the parameters pinned) and the plan takes the cheapest within the
block's budget whose collectives are the estimate's; compile then estimates the whole plan
in it and keeps it where it fits and is faster. Where the ILP's own optimum is another
layout still (attention on the sequence shard, replicated weights with the hidden state
gathered), it is recorded per block as advice with both objectives.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import pandas as pd

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.errors import ShardingInfeasibleError
from autopar.estimate.core import Estimate, evaluate
from autopar.estimate.groups import slowest_groups
from autopar.estimate.timing import tp_collectives
from autopar.estimate.tp_comm import partial_gradient_bytes, primitive_collectives
from autopar.estimate.units import units_from_graph
from autopar.ir import SEQUENCE_DIM, Graph
from autopar.ir.residual import residual_structure, sublayers
from autopar.plan import megatron_tp_placements
from autopar.plan.placements import replicated_kv
from autopar.search.context import SearchContext
from autopar.search.intra_op import BlockSetting, BlockSharding, solve_block
from costmodels.memory import ALLOCATOR_RESERVE_FRACTION, state_bytes_per_param

__all__ = ["LaidOut", "TpLayout", "block_budget", "choose_layout", "layout_price",
           "tp_layout"]

log = logging.getLogger(__name__)


class TpLayout(NamedTuple):
    """What `tp_layout` chose: ``{param FQN: placement on tp}`` (block parameters at their
    representative), the ILP's report per block, and the sub-layers it replicates per block
    (`ModelCosts.with_tp_layout`)."""

    placements: dict[str, str]
    report: dict[str, Any]
    replicated: dict[str, frozenset[int]]


def layout_price(estimate: Estimate, dtype: str, fp32_params: bool = False
                 ) -> tuple[float, float]:
    """``(bytes_per_param, step_s_per_param)`` of the estimated plan: a rank's training state
    per parameter element it holds, and the seconds per micro-batch each element costs the
    step beyond the pipeline (the exposed data-parallel traffic and the optimizer step of the
    rank holding the most parameters, over its parameters and the micro-batches)."""
    cfg = estimate.config
    state = state_bytes_per_param(dtype, cfg.zero_stage, cfg.dp * cfg.cp, fp32_params)
    params = max((mem["_params"] for mem in estimate.memory_by_stage), default=0.0)
    if params <= 0:
        return state, 0.0
    per_step = estimate.breakdown.get("dp_comm", 0.0) + estimate.breakdown.get("optimizer", 0.0)
    return state, per_step / params / estimate.num_microbatches


def block_budget(estimate: Estimate, layer_fqns: tuple[str, ...], estimated_bytes: float
                 ) -> float | None:
    """The most one layer of a block may hold under the ILP's memory model: what it holds in
    the estimated layout (``estimated_bytes``) plus the rank's free memory (usable less the
    estimate's peak, less the allocator's reserve) shared by the block's layers on the pipeline
    rank holding the most of them; None when the estimate has no per-rank memory."""
    if not estimate.memory_by_stage:
        return None
    free = (estimate.usable_memory_bytes - estimate.peak_memory_bytes) \
        / (1 + ALLOCATOR_RESERVE_FRACTION)
    return estimated_bytes + max(0.0, free) / max(1, _layers_on_rank(estimate, layer_fqns))


def _layers_on_rank(estimate: Estimate, layer_fqns: tuple[str, ...]) -> int:
    """How many of the layers ``layer_fqns`` the pipeline rank holding the most of them
    holds."""
    layers = set(layer_fqns)
    per_rank = [0] * estimate.config.pp
    for chunk, names in enumerate(estimate.stage_layers):
        per_rank[chunk % estimate.config.pp] += sum(name in layers for name in names)
    return max(per_rank)


def _gradient_buffer(unit, layers: int, others: float) -> float | None:
    """Bytes of the step's one all-reduce of partial gradients that a block's join when all
    its replicable sub-layers are replicated (`Unit.replicated`; the usual layout taken: an
    MLP): the stream's gradients of the block's ``layers`` on the rank and ``others`` beside
    them. Every layout of the block is priced at this buffer's rate (in Megatron's, only
    the norms' few bytes join it), so that its solves share one problem."""
    if unit is None:
        return None
    every = frozenset(i for i, sub in enumerate(unit.sublayers) if sub.replicable)
    return partial_gradient_bytes(unit.replicated(every), True) * layers + others


def tp_layout(graph: Graph, cluster: Cluster, estimate: Estimate, dtype: str, *,
              fp32_params: bool = False, replicate: bool = True) -> TpLayout:
    """The plan's tensor-parallel layout for ``graph`` traced at the plan's micro-batch (see
    the module docstring): per block, Megatron's layout or, with ``replicate`` (a runtime
    that runs them: autopar's) under sequence parallel, Megatron's with some sub-layers
    replicated on the sequence shard, whichever the ILP prices lowest within the block's
    memory budget, and the ILP's report per block: the plan's tp and cp; for the layout
    taken, whether its solve is proven optimal, its compute, communication and
    parameter-state seconds per micro-batch, its memory by the ILP's model, its forward and
    backward collectives and the partial parameter gradients it all-reduces once a step, and
    ``replicated_sublayers`` (indices) where it replicates some, ``replicated_kv`` the K/V
    projections' parameters Megatron's layout replicates where tp exceeds their heads
    (`megatron_tp_placements`); ``matches_estimate_layout``
    whether the ILP's unconstrained optimum is that layout, and ``memory_budget_bytes`` the
    bound it was solved within when its unbounded optimum held more. Where it is not,
    ``ilp_placements`` holds the ILP's layout, ``ilp_objective_s`` and ``ilp_memory_bytes``
    its price."""
    cfg = estimate.config
    megatron = megatron_tp_placements(graph, cfg.tp)
    if cfg.tp == 1:
        return TpLayout(megatron, {}, {})
    kv = replicated_kv(graph, cfg.tp)
    if kv:
        log.info("tp=%d exceeds the %d key/value heads: their projections (%s, ...) are "
                 "replicated on every tp rank, each reading the kv heads its query heads use",
                 cfg.tp, min(kv.values()), next(iter(kv)))
    bytes_per_param, step_s_per_param = layout_price(estimate, dtype, fp32_params)
    tp_map = dict(megatron)
    report: dict[str, Any] = {}
    replicated: dict[str, frozenset[int]] = {}
    units = {u.name: u for u in units_from_graph(graph)} \
        if replicate and cfg.sequence_parallel else {}
    # blocks alike in structure (an encoder's and a decoder's stack) solve once, and a
    # block's solves share its problem
    cache: dict = {}
    setting = BlockSetting(tp=cfg.tp, cluster=cluster, dtype=dtype,
                           ranks=slowest_groups(cfg, cluster).tp,  # the tp group costed
                           sequence_shards=cfg.cp, microbatches=estimate.num_microbatches,
                           bytes_per_param=bytes_per_param,
                           # the hidden state between blocks as the runtime places it
                           boundary=f"S({SEQUENCE_DIM})" if cfg.sequence_parallel
                           else "replicated",
                           step_s_per_param=step_s_per_param)
    stream = {name: partial_gradient_bytes(u, True) * u.count for name, u in units.items()}
    for block in graph.blocks:
        unit = units.get(block.representative)
        layers = _layers_on_rank(estimate, block.layer_fqns)
        # the other layers' stream gradients on a rank, their average over the pipeline
        others = (sum(stream.values()) - stream.get(block.representative, 0.0)) / cfg.pp
        solve = functools.partial(solve_block, graph, block.node_names, dataclasses.replace(
            setting, gradient_buffer_bytes=_gradient_buffer(unit, layers, others)), cache=cache)
        sol = solve()
        kept = budget = bound = None
        if not _same(sol.param_placements, megatron):
            try:  # the ILP's best execution of Megatron's layout
                kept = solve(pinned_params=megatron)
            except ShardingInfeasibleError:  # a node cannot place its parameters so
                kept = None
            budget = block_budget(estimate, block.layer_fqns, kept.memory_bytes) \
                if kept is not None else None
            if budget is not None and sol.memory_bytes > budget:
                # the best layout Lagrangian relaxation finds within the budget, optimal
                # where it proves it (exact solving is ~0.2 s a block: too slow for compile)
                sol = solve(memory_budget_bytes=budget, method="lagrangian")
                bound = budget
        megatron_best = _same(sol.param_placements, megatron)
        runs, subset = (sol if megatron_best or kept is None else kept), frozenset()
        if unit is not None and kept is not None and not megatron_best:
            runs, subset = _replicating(graph, block, unit, megatron, cfg, budget,
                                        (kept, subset), solve)
        same = megatron_best or bool(subset) and \
            dict(runs.param_placements) == dict(sol.param_placements)
        report[block.representative] = entry = {
            "tp": cfg.tp, "cp": cfg.cp, "optimal": runs.optimal, "compute_s": runs.compute_s,
            "comm_s": runs.comm_s, "state_s": runs.state_s, "memory_bytes": runs.memory_bytes,
            "forward_collectives": [list(c) for c in runs.forward_collectives],
            "backward_collectives": [list(c) for c in runs.backward_collectives],
            "gradient_collectives": [list(c) for c in runs.gradient_collectives],
            "matches_estimate_layout": same,
            **({"replicated_sublayers": sorted(subset)} if subset else {}),
            **({"replicated_kv": kv_params} if (kv_params := sorted(
                f for f in kv if f.startswith(block.representative + "."))) else {}),
            **({"memory_budget_bytes": bound} if bound is not None else {}),
        }
        if subset:
            replicated[block.representative] = subset
        if subset or megatron_best:
            tp_map.update(runs.param_placements)
        if same:
            continue
        entry.update(ilp_placements=dict(sorted(sol.param_placements.items())),
                     ilp_objective_s=sol.objective_s, ilp_memory_bytes=sol.memory_bytes)
        log.info("the intra-op ILP's best tensor-parallel layout for %s at tp=%d is one the "
                 "runtime does not run as the ILP does%s; the plan takes the best it runs "
                 "(%s; the ILP's is in plan.intra_op[...]['ilp_placements'])",
                 block.representative, cfg.tp,
                 f" ({1e3 * (runs.objective_s - sol.objective_s):.3g} ms per layer and "
                 f"micro-batch faster by the ILP's model)",
                 "Megatron-LM's" if not subset else
                 f"Megatron-LM's with sub-layers {sorted(subset)} replicated")
    return TpLayout(tp_map, report, replicated)


_MAX_REPLICABLE = 4  # sub-layers per block whose replication is tried (2^4 layouts)


def _replicating(graph: Graph, block, unit, megatron: dict[str, str], cfg, budget,
                 incumbent, solve: Callable[..., BlockSharding]):
    """The cheapest of Megatron's layout (``incumbent``: its solve and the empty set) and
    Megatron's with each non-empty set of the block's replicable sub-layers replicated, by
    the ILP's price of its best execution (``solve``: `solve_block` of the block in its
    setting), within ``budget``; a layout counts only where the ILP's collectives for it are
    the estimate's (`tp_collectives` of `Unit.replicated`), so that the price is the one the
    estimate charges and the runtime pays."""
    names = set(block.node_names)
    nodes = [n for n in graph.nodes if n.name in names]
    runs = sublayers(nodes, residual_structure(nodes))
    choices = [i for i, sub in enumerate(unit.sublayers) if sub.replicable][:_MAX_REPLICABLE]
    best, best_subset = incumbent
    for k in range(1, len(choices) + 1):
        for subset in itertools.combinations(choices, k):
            pins = dict(megatron)
            pins.update({p.fqn: "R" for i in subset for n in runs[i] for p in n.params})
            try:
                alt = solve(pinned_params=pins)
            except ShardingInfeasibleError:
                continue
            if alt.objective_s >= best.objective_s or \
                    (budget is not None and alt.memory_bytes > budget):
                continue
            fwd, bwd = tp_collectives(unit.replicated(frozenset(subset)), cfg)
            if primitive_collectives(alt.forward_collectives + alt.backward_collectives) \
                    != primitive_collectives(fwd + bwd):
                log.debug("%s: the ILP executes sub-layers %s replicated with other "
                          "collectives than the estimate's; not taken (%s against %s)",
                          block.representative, subset,
                          alt.forward_collectives + alt.backward_collectives, fwd + bwd)
                continue
            best, best_subset = alt, frozenset(subset)
    return best, best_subset


def _same(placements, megatron: dict[str, str]) -> bool:
    return all(megatron.get(fqn, "R") == p for fqn, p in placements.items())


class LaidOut(NamedTuple):
    """A plan's estimate in the layout chosen, the layout and the ILP's report
    (`tp_layout`); ``winner`` whether the config is the search's winner (on its stages)."""

    estimate: Estimate
    placements: dict[str, str]
    report: dict[str, Any]
    winner: bool


_RIVALS = 8  # simulated runners-up whose layouts are priced at most


def choose_layout(ctx: SearchContext, winner: Estimate, candidates: pd.DataFrame, *,
                  replicate: bool) -> LaidOut:
    """The plan's config and layout: the search's ``winner`` in the layout `tp_layout`
    chooses (with sub-layers replicated where the ILP prices that lower and the whole
    estimate in it, on the winner's stages, is faster and fits), or, with ``replicate``, a
    simulated runner-up of the search (``candidates``) with sequence parallel whose step in
    its own best layout is faster still. A runner-up is priced only where its step less its
    whole tensor-parallel communication -- a bound on what any layout saves -- is below the
    best so far, so that most searches price the winner alone."""
    best = _laid_out(ctx, winner, replicate, on_its_stages=True)
    if not replicate or candidates is None or candidates.empty:
        return best
    for cfg in _rivals(candidates, winner.config):
        if cfg.step_bound >= best.estimate.step_time_s:
            break  # rows come by bound: none after it can win
        est = evaluate(ctx.costs, ctx.cluster, cfg.config,
                       global_batch_size=ctx.global_batch_size, dtype=ctx.dtype,
                       options=ctx.options)
        laid = _laid_out(ctx, est, replicate, on_its_stages=False)
        if laid.estimate.step_time_s < best.estimate.step_time_s:
            log.info("in the intra-op ILP's layout %s steps in %.4g s, ahead of the search's "
                     "winner %s (%.4g s)", est.config.short(), laid.estimate.step_time_s,
                     winner.config.short(), best.estimate.step_time_s)
            best = laid
    return best


class _Rival(NamedTuple):
    step_bound: float
    config: ParallelConfig


def _rivals(candidates: pd.DataFrame, winner: ParallelConfig) -> list[_Rival]:
    """The simulated, fitting candidates with tp and sequence parallel other than the
    winner, by their step less their tp communication, the first `_RIVALS`."""
    table = candidates
    if not {"exact", "fits", "sequence_parallel", "tp", "step_time_s"} <= set(table):
        return []
    keep = table["exact"].astype(bool) & table["fits"].astype(bool) \
        & table["sequence_parallel"].astype(bool) & (table["tp"] > 1)
    rows = []
    for _, row in table[keep].iterrows():
        cfg = ParallelConfig.from_record(row)
        if cfg != winner:
            rows.append(_Rival(float(row["step_time_s"]) - float(row.get("t_tp_comm", 0.0)),
                               cfg))
    return sorted(rows, key=lambda r: r.step_bound)[:_RIVALS]


def _laid_out(ctx: SearchContext, est: Estimate, replicate: bool, *, on_its_stages: bool
              ) -> LaidOut:
    """``est``'s config in the layout `tp_layout` chooses for it; where that replicates
    sub-layers, the whole estimate again in it (on ``est``'s stages), kept if it fits and
    is faster, Megatron-LM's layout otherwise."""
    cfg = est.config
    graph = ctx.graph_at(cfg.micro_batch_size) if cfg.tp > 1 else ctx.graph_at(0)
    args = (graph, ctx.cluster, est, ctx.dtype)
    fp32 = ctx.options.fp32_params
    layout = tp_layout(*args, fp32_params=fp32, replicate=replicate)
    if not layout.replicated:
        return LaidOut(est, layout.placements, layout.report, on_its_stages)
    ends = list(itertools.accumulate(len(layers) for layers in est.stage_layers))
    relaid = evaluate(ctx.costs.with_tp_layout(layout.replicated), ctx.cluster, cfg,
                      global_batch_size=ctx.global_batch_size, dtype=ctx.dtype,
                      options=ctx.options, stage_boundaries=tuple(zip([0] + ends[:-1], ends)))
    if relaid.fits and relaid.step_time_s < est.step_time_s:
        log.info("the intra-op ILP's layout of %s runs %s replicated on the sequence shard: "
                 "%.4g s per step against %.4g s in Megatron-LM's", cfg.short(),
                 _replicated_text(layout.report), relaid.step_time_s, est.step_time_s)
        return LaidOut(relaid, layout.placements, layout.report, on_its_stages)
    log.info("the intra-op ILP's layout of %s with %s replicated is %s by the whole "
             "estimate; it keeps Megatron-LM's", cfg.short(), _replicated_text(layout.report),
             "slower" if relaid.fits else "over the memory")
    layout = tp_layout(*args, fp32_params=fp32, replicate=False)
    return LaidOut(est, layout.placements, layout.report, on_its_stages)


def _replicated_text(report: dict[str, Any]) -> str:
    return ", ".join(f"{block}'s sub-layers {entry['replicated_sublayers']}"
                     for block, entry in sorted(report.items())
                     if entry.get("replicated_sublayers"))
