r"""The intra-operator sharding ILP: one strategy per op of a block on the tensor-parallel axis.

Inputs (tables from :func:`autopar.sharding.problem.build_problem`): nodes ``v`` with
strategies ``s ∈ S_v`` (rules in :mod:`autopar.sharding.rules`, plus pseudo nodes for the
block boundary and outside tensors); tensors ``T`` with a producer ``u_T`` and consumer inputs
``(v, i)``; integer costs in nanoseconds.

Variables
    x[v,s] ∈ {0,1}          node v runs strategy s
    y[e,a,c] ∈ {0,1}        on consumer edge e = (T → input i of v): the producer of T is in
                            class a = (p, w) -- output placement p, wanted gradient placement w
                            -- and the consumer in class c = (q, g) -- demanded input placement
                            q, gradient placement g it hands back
    need[T,a,d] ∈ {0,1}     T's producer is in class a and some consumer demands d, where d is
                            ("fwd", q) or ("bwd", g); only where the reshard cost is non-zero

Shorthand
    z[T,a]   = Σ_{s ∈ S_u : class_s(T) = a} x[u_T,s]                (producer class)
    k[e,c]   = Σ_{t ∈ S_v : class_t(v,i) = c} x[v,t]                (consumer class)
    c(a, ("fwd", q)) = time(reshard p → q)      c(a, ("bwd", g)) = time(reshard g → w)
    w = grad(p) (grad(R)=R, grad(S(d))=S(d), grad(P)=R) except for "R~P" strategies (w = P)
    cost_v(s) = compute_fwd+bwd(v, s) / work_divisor(s) + internal collectives(v, s)
                + [param replicated and work split] · (all_reduce(B) - all_reduce(empty))
                  · gradient bytes / B / microbatches   (one coalesced all-reduce a step
                  of all such gradients, B = gradient_buffer_bytes, default the gradient's)
                + parameter elements held · step_s_per_param   (the step's reduction
                  and optimizer step on them, per micro-batch)

Objective
    min  W · ( Σ_v Σ_s cost_v(s) · x[v,s]  +  Σ_T Σ_{a,d} c(a,d) · need[T,a,d] )
         + Σ_v Σ_s index(s) · x[v,s]

    The second term (W = 1 + its largest value) only breaks ties between equal-cost
    plans: the one with the smaller sum of strategy indices wins (replicate is index 0).

Constraint families (one method each; names are what an infeasible problem reports)
    one_strategy_per_node   Σ_s x[v,s] = 1                                          ∀ v
    resharding              Σ_c y[e,a,c] = z[T,a]   ∀ e, a;   Σ_a y[e,a,c] = k[e,c]   ∀ e, c
                            need[T,a,d] ≥ Σ_{c ∋ d} y[e,a,c]                        ∀ T, e, a, d
                            (the marginal "edge" linearisation, tight on chains; need
                            charges a reshard once per tensor however many consumers ask)
    param_consistency       Σ_{s : place_s(w) = r} x[v1,s] = Σ_{s : place_s(w) = r} x[v2,s]
                                                    ∀ parameters w used by nodes v1, v2; ∀ r
    boundary_periodicity    x[<block-input>, p] = x[<block-output>, p]              ∀ p
                            (the next copy of the block starts where this one ends)
    memory_budget           Σ_v Σ_s mem_v(s) · x[v,s] ≤ budget                      (optional)

``need`` is only bounded below; minimisation makes it exact, so the objective of an integral
solution equals :meth:`BlockProblem.evaluate` (the brute-force oracle's). CP-SAT runs with
``linearization_level=2`` so all of this sits in its LP (without it the Llama block does not
close its gap in 30 s; with it, it is proven optimal in ~0.1 s), and without probing
(``cp_model_probing_level=0``: on transformer blocks it costs more time than it saves).
When CP-SAT finds no solution, :func:`solve_block` re-solves with each optional family
dropped in turn and raises :class:`~autopar.errors.ShardingInfeasibleError` naming the first
one whose removal makes the problem feasible (for ``memory_budget`` with the smallest
footprint found by minimising memory instead).

Solvers: without a memory budget the program is solved first by min-sum variable
elimination (:mod:`autopar.search.elimination`): the same objective, tie-break and hard
families as tables over a few nodes each, exact, and ~15x faster than CP-SAT on transformer
blocks (Llama-3 8B/70B/405B blocks at tp 2/4/8, micro-batch 1/2: 6-8 ms against 0.1-0.2 s,
the same assignment in all 18 cases; measured 2026-11 on this project's CPU machine). It hands
the problem to CP-SAT when a table would grow too large (a wide block) or the problem is
infeasible. With a memory budget, Lagrangian relaxation over elimination comes first
(objective + λ · memory for a few λ; a fitting optimum that meets the relaxation's bound is
proven optimal) and CP-SAT solves what it does not prove. ``method`` pins one solver.

Scope: the tensor-parallel axis only. Rules are per axis and :func:`autopar.sharding.expand_nd`
forms N-D strategies; a second (sequence) axis would add its own x variables per N-D strategy
and the same families. Costs are per micro-batch, forward plus backward, for one copy of the
block on one rank (under context parallelism, its share of the sequence: ``sequence_shards``);
a replicated parameter's partial gradient is charged its share of the step's one all-reduce of
such gradients, per micro-batch (``microbatches``). Determinism: one worker, a fixed seed, a
deterministic tie-break; when the time limit is hit the best plan so far is returned with a
warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Mapping, MutableMapping, Sequence

from autopar.errors import ShardingInfeasibleError
from autopar.ir import Graph
from autopar.search.elimination import solve_by_elimination
from autopar.sharding.placement import PARTIAL, REPLICATE, is_shard, reshard_collective
from autopar.sharding.problem import (BLOCK_INPUT, BLOCK_OUTPUT, UNITS_PER_S, BlockProblem,
                                      BlockSetting, build_problem, pin_params)
from autopar.sharding.strategy import Collective

__all__ = ["BlockSetting", "BlockSharding", "solve_block", "solve_problem", "FAMILIES",
           "METHODS"]

logger = logging.getLogger(__name__)

FAMILIES = ("one_strategy_per_node", "resharding", "param_consistency",
            "boundary_periodicity", "memory_budget")
_OPTIONAL = ("param_consistency", "boundary_periodicity", "memory_budget")
METHODS = ("auto", "elimination", "lagrangian", "cp-sat")
_SEED = 0


@dataclass(frozen=True, kw_only=True)
class BlockSharding:
    """The solved sharding of one block on the tensor-parallel axis (per micro-batch).

    Collectives are ``(kind, nbytes)`` in ``Cluster.collective_time``'s convention, in
    execution order of the tensors that cause them; time them on the real tp group.
    """

    tp: int
    node_strategies: Mapping[str, str]
    param_placements: Mapping[str, str]
    output_placements: Mapping[str, tuple[str, ...]]
    boundary_placement: str | None
    compute_s: float
    comm_s: float
    state_s: float  # the held parameters' share of the step's reduction and optimizer step
    memory_bytes: float
    forward_collectives: tuple[tuple[str, float], ...]
    backward_collectives: tuple[tuple[str, float], ...]
    # the partial gradients of replicated parameters, all-reduced together once a step
    gradient_collectives: tuple[tuple[str, float], ...]
    optimal: bool

    @property
    def objective_s(self) -> float:
        return self.compute_s + self.comm_s + self.state_s


class _IntraOpModel:
    """The CP-SAT model of one :class:`BlockProblem`; one method per constraint family."""

    def __init__(self, problem: BlockProblem, *, memory_budget_bytes: float | None,
                 skip: Sequence[str] = ()):
        self.p = problem
        self.budget = memory_budget_bytes
        self.skip = set(skip)
        from ortools.sat.python import cp_model  # imported here: `import autopar` needs no ortools

        self.m = cp_model.CpModel()
        new_bool = self.m.new_bool_var
        self.x = {v: [new_bool(f"x[{v},{s}]") for s in range(len(problem.strategies[v]))]
                  for v in problem.nodes}
        self.cost_terms: list[tuple[int, cp_model.IntVar]] = [
            (units, var) for v in problem.nodes
            for units, var in zip(problem.node_units(v), self.x[v]) if units]
        for family in FAMILIES:
            if family not in self.skip:
                getattr(self, f"_{family}")()

    def _one_strategy_per_node(self) -> None:
        for v in self.p.nodes:
            self.m.add_exactly_one(self.x[v])

    def _resharding(self) -> None:
        p, m = self.p, self.m
        new_bool, add, total = m.new_bool_var, m.add, _linear_sum()
        for k, t in enumerate(p.tensors):
            produced: dict[tuple[str, str], list] = {}
            for s, var in enumerate(self.x[t.producer]):
                key = (p.out_placement(t, s), p.out_grad_placement(t, s))
                produced.setdefault(key, []).append(var)
            need: dict[tuple[str, tuple[str, str]], list] = {}
            for e, (v, i) in enumerate(t.consumers):
                classes: dict[tuple[str, str], list] = {}
                for s, st in enumerate(p.strategies[v]):
                    g = st.input_grads[i] if t.requires_grad else ""
                    classes.setdefault((st.inputs[i], g), []).append(self.x[v][s])
                y = {(src, c): new_bool(f"y[{k},{e},{src},{c}]")
                     for src in sorted(produced) for c in sorted(classes)}
                for src, zs in produced.items():
                    add(total([y[src, c] for c in classes]) == total(zs))
                for c, ws in classes.items():
                    add(total([y[src, c] for src in produced]) == total(ws))
                for (src, (q, g)), var in y.items():
                    demands = [("fwd", q)] + ([("bwd", g)] if t.requires_grad else [])
                    for d in demands:
                        need.setdefault((src, d), []).append((e, var))
            for (src, d), pairs in sorted(need.items()):
                units = self._reshard_units(t, src, d)
                if units == 0:
                    continue
                n_var = new_bool(f"need[{k},{src},{d}]")
                by_edge: dict[int, list] = {}
                for e, var in pairs:
                    by_edge.setdefault(e, []).append(var)
                for vars_ in by_edge.values():
                    add(n_var >= total(vars_))
                self.cost_terms.append((units, n_var))

    def _reshard_units(self, tensor, src: tuple[str, str], demand: tuple[str, str]) -> int:
        direction, placement = demand
        if direction == "fwd":
            c = reshard_collective(src[0], placement, tensor.nbytes, self.p.axis_size)
        else:
            c = reshard_collective(placement, src[1], tensor.nbytes, self.p.axis_size)
        return self.p.collective_units(c) if c else 0

    def _param_consistency(self) -> None:
        users: dict[str, list] = {}
        for use in self.p.params:
            users.setdefault(use.fqn, []).append(use)
        for fqn, uses in sorted(users.items()):
            if len(uses) < 2:
                continue
            exprs = []
            for use in uses:
                by: dict[str, list] = {}
                for s, var in enumerate(self.x[use.node]):
                    by.setdefault(self.p.param_placement(use, s), []).append(var)
                exprs.append(by)
            placements = sorted({r for by in exprs for r in by})
            for by in exprs[1:]:
                for r in placements:
                    self.m.Add(sum(exprs[0].get(r, [])) == sum(by.get(r, [])))

    def _boundary_periodicity(self) -> None:
        if not self.p.periodic:
            return
        for a, b in zip(self.x[BLOCK_INPUT], self.x[BLOCK_OUTPUT], strict=True):
            self.m.Add(a == b)

    def _memory_budget(self) -> None:
        if self.budget is None:
            return
        terms = [(math.ceil(self.p.memory_bytes[v][s]), var)
                 for v in self.p.nodes for s, var in enumerate(self.x[v])]
        self.m.Add(sum(c * var for c, var in terms if c) <= int(self.budget))

    def minimise(self, objective: str) -> None:
        if objective == "memory":
            self.m.Minimize(sum(math.ceil(self.p.memory_bytes[v][s]) * var
                                for v in self.p.nodes for s, var in enumerate(self.x[v])))
            return
        ties = [(s, var) for v in self.p.nodes for s, var in enumerate(self.x[v]) if s]
        weight = 1 + sum(len(xs) - 1 for xs in self.x.values())
        self.m.Minimize(sum(weight * c * var for c, var in self.cost_terms)
                        + sum(s * var for s, var in ties))
        for v in self.p.nodes:  # start from all-replicated, always feasible but for memory
            for s, var in enumerate(self.x[v]):
                self.m.AddHint(var, s == 0)

    def solve(self, *, time_limit_s: float, num_workers: int) -> tuple[int, dict[str, int] | None]:
        from ortools.sat.python import cp_model

        solver = cp_model.CpSolver()
        solver.parameters.random_seed = _SEED
        solver.parameters.num_workers = num_workers
        solver.parameters.max_time_in_seconds = time_limit_s
        solver.parameters.linearization_level = 2  # every linear constraint in the LP
        # no probing: on these models it costs more than it prunes (Llama-3-70B block, tp 2/4/8:
        # 0.12-0.13 s -> 0.08-0.10 s to proven optimality, same solution)
        solver.parameters.cp_model_probing_level = 0
        status = solver.Solve(self.m)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return status, None
        choice = {v: next(s for s, var in enumerate(xs) if solver.Value(var))
                  for v, xs in self.x.items()}
        return status, choice


def _linear_sum():
    """`LinearExpr.sum`: builds a sum in one call (the builtin `sum` makes a node per term)."""
    from ortools.sat.python import cp_model

    return cp_model.LinearExpr.sum


def solve_problem(problem: BlockProblem, *, memory_budget_bytes: float | None = None,
                  time_limit_s: float = 10.0, num_workers: int = 1, method: str = "auto"
                  ) -> tuple[dict[str, int], bool]:
    """Optimal (or best-in-time) strategy index per node, and whether it is proven optimal.

    `method`: "auto" eliminates variables when there is no memory budget, and under one
    takes a Lagrangian optimum found by elimination when it is proven (`_within_budget`),
    and falls back to CP-SAT otherwise (see the module docstring); "lagrangian" takes the
    best Lagrangian assignment under a budget, proven or not (CP-SAT only when it finds
    none); "elimination" insists on elimination (ValueError if the problem is too wide or
    has a budget); "cp-sat" uses CP-SAT only."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if method != "cp-sat" and memory_budget_bytes is None:
        choice = solve_by_elimination(problem)
        if choice is not None:
            return choice, True
    if method in ("auto", "lagrangian") and memory_budget_bytes is not None:
        choice, optimal = _within_budget(problem, memory_budget_bytes)
        if choice is not None and (optimal or method == "lagrangian"):
            return choice, optimal
    if method == "elimination":
        raise ValueError("variable elimination needs no memory budget, a feasible problem "
                         "and a block whose tables stay small; use method='cp-sat' or 'auto'")
    from ortools.sat.python import cp_model

    model = _IntraOpModel(problem, memory_budget_bytes=memory_budget_bytes)
    model.minimise("time")
    status, choice = model.solve(time_limit_s=time_limit_s, num_workers=num_workers)
    if choice is None:
        _diagnose(problem, memory_budget_bytes, time_limit_s, num_workers, status)
    optimal = status == cp_model.OPTIMAL
    if not optimal:
        logger.warning("intra-op ILP hit its %.1f s time limit; using the best plan found "
                       "(objective %.6f s, not proven optimal)", time_limit_s,
                       problem.evaluate(choice) / UNITS_PER_S)
    return choice, optimal


def _within_budget(problem: BlockProblem, budget: float, steps: int = 3
                   ) -> tuple[dict[str, int] | None, bool]:
    """The best assignment within a memory budget that Lagrangian relaxation finds, and
    whether it is proven optimal: variable elimination minimises objective + λ · memory
    for a few λ (from the ratio of the unbounded optimum's objective to its memory, doubled
    until the memory fits, then bisected ``steps`` times); each λ's optimum bounds the
    budgeted optimum from below (its penalised objective less λ · budget), and a fitting
    assignment whose objective meets the best bound (to a unit per node, the rounding of
    λ · memory) is optimal. ``(None, False)`` when nothing fitting was found (or elimination
    does not apply)."""
    def solve(lam: float):
        if lam == 0.0:
            penalised = problem
        else:
            extra = {v: tuple(u + round(lam * m) for u, m in zip(problem.state_units[v],
                                                                   problem.memory_bytes[v]))
                     for v in problem.nodes}
            penalised = dataclasses.replace(problem, state_units=extra)
        choice = solve_by_elimination(penalised)
        if choice is None:
            return None, None
        return choice, penalised.evaluate(choice) - lam * budget

    best, best_cost, bound = None, None, -math.inf
    slack = len(problem.nodes)  # λ · memory is rounded to whole units per node
    lam, low, high, doublings, halvings = 0.0, 0.0, None, 0, 0
    while doublings <= 64 and halvings <= steps:
        choice, lower = solve(lam)
        if choice is None:
            return None, False
        bound = max(bound, lower)
        memory = problem.memory(choice)
        if memory <= budget:
            cost = problem.evaluate(choice)
            if best is None or cost < best_cost:
                best, best_cost = choice, cost
            if best_cost <= bound + slack:
                return best, True
            high = lam
        else:
            low = lam
        if high is None:
            lam = 2 * lam if lam else problem.evaluate(choice) / max(memory, 1.0)
            doublings += 1
        else:
            lam, halvings = (low + high) / 2, halvings + 1
    return best, False


def _diagnose(problem: BlockProblem, budget: float | None, time_limit_s: float,
              num_workers: int, status: int) -> None:
    """Find the constraint family that makes the problem infeasible and raise naming it."""
    from ortools.sat.python import cp_model

    if status == cp_model.UNKNOWN:
        raise ShardingInfeasibleError(
            f"time_limit: CP-SAT found no plan in {time_limit_s} s; raise time_limit_s",
            family="time_limit")
    for family in _OPTIONAL:
        relaxed = _IntraOpModel(problem, memory_budget_bytes=budget, skip=[family])
        if family == "memory_budget":
            relaxed.minimise("memory")
            st, choice = relaxed.solve(time_limit_s=time_limit_s, num_workers=num_workers)
            if choice is not None:
                smallest = problem.memory(choice)
                raise ShardingInfeasibleError(
                    f"memory_budget: the smallest footprint of this block on tp="
                    f"{problem.axis_size} is {smallest / 1e9:.3f} GB > budget "
                    f"{budget / 1e9:.3f} GB; raise the budget or the tp degree",
                    family=family, smallest_bytes=smallest)
            continue
        relaxed.minimise("time")
        if relaxed.solve(time_limit_s=time_limit_s, num_workers=num_workers)[1] is not None:
            raise ShardingInfeasibleError(f"{family}: no plan satisfies this constraint "
                                          f"family", family=family)
    raise ShardingInfeasibleError("the intra-op ILP is infeasible for a reason no single "
                                  "constraint family explains", family="unknown")


def _signature(graph: Graph, names: Sequence[str]) -> str:
    """Structure of a block independent of its layer's names (shapes, kinds, wiring)."""
    index = {n: i for i, n in enumerate(names)}
    params: dict[str, int] = {}
    rows = []
    for name in names:
        node = graph.node(name)
        srcs = []
        for src in node.input_sources:
            if src in index:
                srcs.append(index[src])
            elif src.startswith("param:"):
                srcs.append(f"param{params.setdefault(src, len(params))}")
            else:
                srcs.append(src.split(":")[0] if ":" in src else "external")
        rows.append([node.kind.value, node.target, [list(t.shape) for t in node.inputs],
                     [t.dtype for t in node.inputs], [list(t.shape) for t in node.outputs],
                     srcs, node.flops_fwd, node.flops_bwd, node.saved_bytes])
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def solve_block(graph: Graph, node_names: Sequence[str], setting: BlockSetting, *,
                memory_budget_bytes: float | None = None,
                pinned_params: Mapping[str, str] | None = None, method: str = "auto",
                cache: MutableMapping | None = None, time_limit_s: float = 10.0,
                num_workers: int = 1) -> BlockSharding:
    """Choose a tensor-parallel sharding for every node of a block (see the module docstring)
    in ``setting`` (:class:`BlockSetting`: the tp group, the precision, and the prices of
    parameter state, the block boundary, context parallel and the step's partial-gradient
    all-reduce, as :func:`~autopar.sharding.problem.build_problem` takes them).
    ``memory_budget_bytes`` bounds the block's memory by the ILP's model.
    ``cache`` is a caller-owned dict keyed by (block signature, tp, micro-batch shape, ...);
    a hit returns the stored result (whose node names are those of the block first solved),
    and a block's other solves (pinned, within a budget) reuse its problem tables.
    ``method`` picks the solver (:func:`solve_problem`). ``pinned_params`` ({param FQN: placement};
    an unlisted parameter replicated) fixes the parameter layout, and the ILP chooses the rest: the
    best execution of that layout (:func:`~autopar.sharding.problem.pin_params`;
    ShardingInfeasibleError if a node cannot place its parameters so).
    """
    tp, boundary = setting.tp, setting.boundary
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
    if boundary not in ("periodic", "replicated") and not is_shard(boundary):
        raise ValueError(f"boundary must be 'periodic', 'replicated' or a shard 'S(d)', got "
                         f"{boundary!r}")
    names = list(node_names)
    known = {m.name for m in graph.nodes}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"node_names must be non-empty names of graph nodes; unknown: "
                         f"{unknown[:5]}")
    key = problem_key = None
    if cache is not None:
        key_setting = (tp, (graph.batch_size, graph.seq_len), setting.dtype,
                       setting.cluster.fingerprint(), tuple(setting.ranks or range(tp)),
                       setting.bytes_per_param, setting.step_s_per_param, boundary,
                       setting.sequence_shards, setting.microbatches,
                       setting.gradient_buffer_bytes)
        key = (_signature(graph, names),) + key_setting + (memory_budget_bytes, method, tuple(
            sorted(pinned_params.items())) if pinned_params is not None else None)
        if key in cache:
            return cache[key]
        # this block's, for its other solves
        problem_key = ("problem", tuple(names)) + key_setting
    start = time.perf_counter()
    problem = cache.get(problem_key) if cache is not None else None
    if problem is None:
        problem = build_problem(graph, names, setting)
        if cache is not None:
            cache[problem_key] = problem
    if pinned_params is not None:
        problem = pin_params(problem, pinned_params)
    choice, optimal = solve_problem(problem, memory_budget_bytes=memory_budget_bytes,
                                    time_limit_s=time_limit_s, num_workers=num_workers,
                                    method=method)
    result = _result(problem, graph, choice, optimal)
    logger.debug("intra-op ILP: %d nodes, tp=%d, %.3f s, objective %.6f s", len(names), tp,
                 time.perf_counter() - start, result.objective_s)
    if cache is not None:
        cache[key] = result
    return result


def _internal_collectives(problem: BlockProblem, graph: Graph, name: str, s: int
                         ) -> tuple[list[Collective], list[Collective], list[Collective]]:
    """Forward and backward collectives a node's strategy runs itself, and the all-reduces of
    the partial gradients of replicated parameters it leaves (reduced once a step)."""
    st = problem.strategies[name][s]
    fwd, bwd, grads = list(st.fwd_collectives), list(st.bwd_collectives), []
    for use in problem.params:
        if use.node != name:
            continue
        spec = next(p for p in graph.node(name).params if p.fqn == use.fqn)
        if (spec.requires_grad and st.inputs[use.input_index] == REPLICATE
                and st.input_grads[use.input_index] == PARTIAL):
            grads.append(("all_reduce", float(use.numel * problem.grad_bytes_per_elem)))
    return fwd, bwd, grads


def _result(problem: BlockProblem, graph: Graph, choice: Mapping[str, int],
            optimal: bool) -> BlockSharding:
    real = [v for v in problem.nodes if not v.startswith("<")]
    fwd, bwd = [], []
    comm_units = 0
    grads = []
    for v in real:
        f, b, g = _internal_collectives(problem, graph, v, choice[v])
        fwd += f
        bwd += b
        grads += g
        comm_units += problem.comm_units[v][choice[v]]
    for t in problem.tensors:
        f, b = problem.reshards(t, choice)
        fwd += f
        bwd += b
        comm_units += sum(problem.collective_units(c) for c in f + b)
    compute_units = sum(problem.compute_units[v][choice[v]] for v in real)
    state_units = sum(problem.state_units[v][choice[v]] for v in real)
    params = {u.fqn: problem.param_placement(u, choice[u.node]) for u in problem.params}
    boundary = (problem.strategies[BLOCK_INPUT][choice[BLOCK_INPUT]].outputs[0]
                if BLOCK_INPUT in problem.strategies else None)
    assert problem.feasible(choice)  # the sums above are `evaluate`'s, term by term
    return BlockSharding(
        tp=problem.axis_size,
        node_strategies={v: problem.strategies[v][choice[v]].name for v in real},
        param_placements=dict(sorted(params.items())),
        output_placements={v: problem.strategies[v][choice[v]].outputs for v in real},
        boundary_placement=boundary, compute_s=compute_units / UNITS_PER_S,
        comm_s=comm_units / UNITS_PER_S, state_s=state_units / UNITS_PER_S,
        memory_bytes=problem.memory(choice),
        forward_collectives=tuple(fwd), backward_collectives=tuple(bwd),
        gradient_collectives=tuple(grads), optimal=optimal)
