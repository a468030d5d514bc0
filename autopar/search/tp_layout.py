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

Where the ILP's layout is Megatron-LM's (the one the outer search and the estimate cost:
column-parallel GEMMs into each sub-layer, row-parallel into the residual add, from the
dataflow), the plan takes it. Where it is another, the plan keeps Megatron's -- the runtime
places activations by DTensor's propagation from the parameters' placements, which need not
be the ILP's execution of another layout -- so that its predicted time and memory are those
of what the runtime runs, and records the ILP's layout per block as advice with both
objectives.
"""

from __future__ import annotations

import logging
from typing import Any

from autopar.cluster import Cluster
from autopar.estimate.core import Estimate
from autopar.estimate.timing import slowest_groups
from autopar.ir import SEQUENCE_DIM, Graph
from autopar.plan import megatron_tp_placements
from autopar.search.intra_op import solve_block
from costmodels.memory import ALLOCATOR_RESERVE_FRACTION, state_bytes_per_param

__all__ = ["block_budget", "layout_price", "tp_layout"]

log = logging.getLogger(__name__)


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
    cfg = estimate.config
    layers = set(layer_fqns)
    per_rank = [0] * cfg.pp
    for chunk, names in enumerate(estimate.stage_layers):
        per_rank[chunk % cfg.pp] += sum(name in layers for name in names)
    free = (estimate.usable_memory_bytes - estimate.peak_memory_bytes) \
        / (1 + ALLOCATOR_RESERVE_FRACTION)
    return estimated_bytes + max(0.0, free) / max(1, max(per_rank))


def tp_layout(model, graph: Graph, cluster: Cluster, estimate: Estimate, dtype: str, seq_len,
              example_inputs, fp32_params: bool = False
              ) -> tuple[dict[str, str], dict[str, Any]]:
    """Tensor-parallel placement of every parameter, ``{FQN: placement}``, and the ILP's
    report per block (see the module docstring): the plan's tp and cp, and for the layout the
    plan takes, whether its solve is proven optimal, its compute, communication and
    parameter-state seconds per micro-batch, its memory by the ILP's model, its forward and
    backward collectives and the partial parameter gradients it all-reduces once a step;
    ``matches_estimate_layout`` whether the ILP's optimum is that layout, and
    ``memory_budget_bytes`` the bound it was solved within when its unbounded optimum held
    more. Where it is not, ``ilp_placements`` holds the ILP's layout, ``ilp_objective_s``
    and ``ilp_memory_bytes`` its price."""
    megatron = megatron_tp_placements(graph)
    cfg = estimate.config
    if cfg.tp == 1:
        return megatron, {}
    from autopar.trace import trace

    mb_graph = graph
    if example_inputs is None and cfg.micro_batch_size != graph.batch_size:
        mb_graph = trace(model, global_batch_size=cfg.micro_batch_size, seq_len=seq_len,
                         dtype=dtype)
    bytes_per_param, step_s_per_param = layout_price(estimate, dtype, fp32_params)
    tp_map = dict(megatron)
    report: dict[str, Any] = {}
    # blocks alike in structure (an encoder's and a decoder's stack) solve once
    cache: dict | None = {} if len(mb_graph.blocks) > 1 else None
    common = dict(tp=cfg.tp, cluster=cluster, dtype=dtype, cache=cache,
                  ranks=slowest_groups(cfg, cluster).tp,  # the tp group the estimate costs
                  sequence_shards=cfg.cp, microbatches=estimate.num_microbatches,
                  bytes_per_param=bytes_per_param,
                  # the hidden state between blocks as the runtime places it
                  boundary=f"S({SEQUENCE_DIM})" if cfg.sequence_parallel else "replicated",
                  step_s_per_param=step_s_per_param)
    for block in mb_graph.blocks:
        sol = solve_block(mb_graph, block.node_names, **common)
        kept = bound = None
        if not _same(sol.param_placements, megatron):
            try:  # the ILP's best execution of Megatron's layout
                kept = solve_block(mb_graph, block.node_names, pinned_params=megatron, **common)
            except ValueError:  # a node cannot place its parameters as Megatron's layout says
                kept = None
            budget = block_budget(estimate, block.layer_fqns, kept.memory_bytes) \
                if kept is not None else None
            if budget is not None and sol.memory_bytes > budget:
                # the best layout Lagrangian relaxation finds within the budget, optimal
                # where it proves it (exact solving is ~0.2 s a block: too slow for compile)
                sol = solve_block(mb_graph, block.node_names, memory_budget_bytes=budget,
                                  method="lagrangian", **common)
                bound = budget
        same = _same(sol.param_placements, megatron)
        runs = sol if same or kept is None else kept  # the layout the plan takes
        report[block.representative] = entry = {
            "tp": cfg.tp, "cp": cfg.cp, "optimal": runs.optimal, "compute_s": runs.compute_s,
            "comm_s": runs.comm_s, "state_s": runs.state_s, "memory_bytes": runs.memory_bytes,
            "forward_collectives": [list(c) for c in runs.forward_collectives],
            "backward_collectives": [list(c) for c in runs.backward_collectives],
            "gradient_collectives": [list(c) for c in runs.gradient_collectives],
            "matches_estimate_layout": same,
            **({"memory_budget_bytes": bound} if bound is not None else {}),
        }
        if same:
            tp_map.update(sol.param_placements)
            continue
        entry.update(ilp_placements=dict(sorted(sol.param_placements.items())),
                     ilp_objective_s=sol.objective_s, ilp_memory_bytes=sol.memory_bytes)
        log.info("the intra-op ILP prefers another tensor-parallel layout than Megatron's for "
                 "%s at tp=%d%s; the plan keeps Megatron's, which its estimate costs and the "
                 "runtime runs (the ILP's is in plan.intra_op[...]['ilp_placements'])",
                 block.representative, cfg.tp,
                 f" ({1e3 * (kept.objective_s - sol.objective_s):.3g} ms per layer and "
                 f"micro-batch faster by the ILP's model)" if kept is not None else "")
    return tp_map, report


def _same(placements, megatron: dict[str, str]) -> bool:
    return all(megatron.get(fqn, "R") == p for fqn, p in placements.items())
