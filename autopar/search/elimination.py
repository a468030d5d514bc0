r"""Exact solution of the intra-op sharding problem by min-sum variable elimination.

This module owns a second exact solver of the program in :mod:`autopar.search.intra_op`
(same variables, same objective, same hard constraints, no memory budget). A block's problem
is a sum of small cost tables ("factors"), each over a few nodes:

    node        f_v(s_v)                   = W · cost_v(s_v) + s_v           (s_v: strategy index)
    tensor      f_T(s_u, s_{v1}, ...)      = W · Σ_{d demanded} c(class_u(T), d)
                                             (producer u and every consumer of T)
    parameter   f_w(s_{v1}, s_{v2}, ...)   = 0 if every user places w alike, else ∞
    boundary    f_b(s_in, s_out)           = 0 if s_in = s_out, else ∞   (periodic blocks)

with W = 1 + Σ_v (|S_v| - 1) and c, cost_v, "demanded" as in the ILP's docstring (the reshard
of a tensor is charged once per distinct demand, however many consumers ask). The sum of all
factors is the ILP's objective (``BlockProblem.evaluate`` times W plus the index tie-break).
Eliminating a node v replaces the factors that mention it by

    g(rest) = min_{s_v} Σ_{factors f ∋ v} f(s_v, rest)

and remembers the minimising s_v for each assignment of the rest; after the last node the
minimum is the optimum, and a backward pass over the remembered choices recovers an optimal
assignment. The cost is exponential only in the induced width of the elimination order (the
largest table built): nodes are eliminated greedily, the one whose new table is smallest
first (ties: the earlier node in problem order), and the solver gives up -- returning None,
so the caller uses CP-SAT -- if a table would exceed `max_table_entries`. Transformer blocks
are nearly chains (residual branches and shared inputs add a few nodes to a table), so their
tables stay small and the exact optimum costs milliseconds instead of CP-SAT's ~0.1 s.

Ties: the objective already prefers the smaller sum of strategy indices (as the ILP's does);
plans equal in cost and index sum are broken by `numpy.argmin`, the smallest index of each
node given the nodes eliminated after it. Values are float64 sums of integers below 2^53, so
they are exact; a problem whose objective could exceed that returns None.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from autopar.sharding.placement import reshard_collective
from autopar.sharding.problem import BLOCK_INPUT, BLOCK_OUTPUT, BlockProblem, TensorUse

__all__ = ["solve_by_elimination", "MAX_TABLE_ENTRIES"]

MAX_TABLE_ENTRIES = 1 << 18  # a table larger than this hands the problem to CP-SAT
_EXACT_LIMIT = 2.0 ** 53  # float64 adds integers exactly below this


@dataclass(frozen=True)
class _Factor:
    scope: tuple[int, ...]  # node indices, ascending
    table: np.ndarray  # one axis per scope node, in scope order


def solve_by_elimination(problem: BlockProblem, *,
                         max_table_entries: int = MAX_TABLE_ENTRIES) -> dict[str, int] | None:
    """An optimal strategy index per node of `problem` (the ILP's optimum, tie-break
    included), or None when the problem is too wide for `max_table_entries` or its objective
    too large for exact float64 sums. Raises nothing for infeasible problems: returns None
    then too (CP-SAT reports which constraint family binds)."""
    nodes = problem.nodes
    sizes = [len(problem.strategies[v]) for v in nodes]
    weight = 1 + sum(n - 1 for n in sizes)
    index = {v: i for i, v in enumerate(nodes)}
    factors = _node_factors(problem, weight, sizes)
    factors += [_tensor_factor(problem, t, index, weight) for t in problem.tensors]
    factors += _param_factors(problem, index)
    if problem.periodic:
        n = sizes[index[BLOCK_INPUT]]
        assert n == sizes[index[BLOCK_OUTPUT]], "the boundary nodes share their strategies"
        table = np.where(np.eye(n, dtype=bool), 0.0, np.inf)
        a, b = index[BLOCK_INPUT], index[BLOCK_OUTPUT]
        factors.append(_Factor((a, b), table) if a < b else _Factor((b, a), table.T.copy()))
    largest = sum(float(np.max(f.table[np.isfinite(f.table)], initial=0.0)) for f in factors)
    if largest >= _EXACT_LIMIT:
        return None
    order = _elimination_order(factors, sizes, max_table_entries)
    if order is None:
        return None
    choices: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    live = list(factors)
    for v in order:
        touching = [f for f in live if v in f.scope]
        live = [f for f in live if v not in f.scope]
        joint = _combine(touching, sizes)
        axis = joint.scope.index(v)
        rest = joint.scope[:axis] + joint.scope[axis + 1:]
        choices.append((v, rest, np.argmin(joint.table, axis=axis)))
        live.append(_Factor(rest, np.min(joint.table, axis=axis)))
    total = sum(float(f.table) for f in live)  # every factor is a scalar now
    if not math.isfinite(total):
        return None
    chosen: dict[int, int] = {}
    for v, rest, argmin in reversed(choices):
        chosen[v] = int(argmin[tuple(chosen[u] for u in rest)])
    return {v: chosen[i] for i, v in enumerate(nodes)}


def _node_factors(problem: BlockProblem, weight: int, sizes: list[int]) -> list[_Factor]:
    return [_Factor((i,), np.array([weight * (problem.compute_units[v][s]
                                              + problem.comm_units[v][s]) + s
                                    for s in range(sizes[i])], dtype=np.float64))
            for i, v in enumerate(problem.nodes)]


def _tensor_factor(problem: BlockProblem, t: TensorUse, index: dict[str, int],
                   weight: int) -> _Factor:
    """Reshard cost of T over its producer and consumer nodes: each distinct forward demand q
    (and, with a gradient, each distinct gradient g handed back) paid once, as `reshards`:

        Σ_q [some consumer demands q] · c(p → q)  +  Σ_g [some consumer hands back g] · c(g → w)

    as array arithmetic, one axis per node (a node reading T twice is one axis)."""
    users = sorted({index[v] for v, _ in t.consumers} | {index[t.producer]})
    sizes = [len(problem.strategies[problem.nodes[u]]) for u in users]
    units: dict[tuple[str, str], int] = {}

    def cost(src: str, dst: str) -> int:
        if (src, dst) not in units:
            c = reshard_collective(src, dst, t.nbytes, problem.axis_size)
            units[src, dst] = problem.collective_units(c) if c else 0
        return units[src, dst]

    def along(u: int, values: list) -> np.ndarray:  # a vector on node u's axis
        shape = [1] * len(users)
        shape[users.index(u)] = len(values)
        return np.array(values).reshape(shape)

    out = [(problem.out_placement(t, s), problem.out_grad_placement(t, s))
           for s in range(len(problem.strategies[t.producer]))]
    producer = index[t.producer]
    asked: dict[tuple[str, str], np.ndarray] = {}  # (direction, placement) -> anyone asks
    for v, i in t.consumers:
        strategies = problem.strategies[v]
        directions = [("fwd", [st.inputs[i] for st in strategies])]
        if t.requires_grad:
            directions.append(("bwd", [st.input_grads[i] for st in strategies]))
        for direction, placements in directions:
            for q in sorted(set(placements)):
                mask = along(index[v], [x == q for x in placements])
                key = (direction, q)
                asked[key] = mask if key not in asked else asked[key] | mask
    table = np.zeros(sizes, dtype=np.float64)
    for (direction, q), mask in sorted(asked.items()):
        paid = [cost(p, q) if direction == "fwd" else cost(q, want) for p, want in out]
        if any(paid):
            table = table + np.where(mask, along(producer, paid), 0)
    return _Factor(tuple(users), table * weight)


def _param_factors(problem: BlockProblem, index: dict[str, int]) -> list[_Factor]:
    """One hard factor per parameter used by several nodes: its placements must agree."""
    users: dict[str, list] = {}
    for use in problem.params:
        users.setdefault(use.fqn, []).append(use)
    out = []
    for _, uses in sorted(users.items()):
        if len(uses) < 2:
            continue
        scope = sorted({index[u.node] for u in uses})
        at = {u: k for k, u in enumerate(scope)}
        sizes = [len(problem.strategies[problem.nodes[u]]) for u in scope]
        table = np.empty(sizes, dtype=np.float64)
        for combo in itertools.product(*(range(n) for n in sizes)):
            placed = {problem.param_placement(u, combo[at[index[u.node]]]) for u in uses}
            table[combo] = 0.0 if len(placed) == 1 else np.inf
        out.append(_Factor(tuple(scope), table))
    return out


def _elimination_order(factors: list[_Factor], sizes: list[int],
                       max_entries: int) -> list[int] | None:
    """Greedy order on the interaction graph (nodes sharing a factor are neighbours): next
    the node whose joint table ({node} and its neighbours) has the fewest entries, ties to
    the lower node index; eliminating it joins its neighbours. None if a table would exceed
    `max_entries`."""
    neighbours: list[set[int]] = [set() for _ in sizes]
    for f in factors:
        for u in f.scope:
            neighbours[u].update(f.scope)
    for u, near in enumerate(neighbours):
        near.discard(u)

    def entries(u: int) -> int:
        return sizes[u] * math.prod(sizes[w] for w in neighbours[u])

    score = {u: entries(u) for u in range(len(sizes))}
    order = []
    while score:
        v = min(score, key=lambda u: (score[u], u))
        if score.pop(v) > max_entries:
            return None
        near = neighbours[v]
        for u in near:
            neighbours[u].discard(v)
            neighbours[u].update(near - {u})
        for u in near:
            score[u] = entries(u)
        order.append(v)
    return order


def _combine(factors: list[_Factor], sizes: list[int]) -> _Factor:
    """The sum of `factors` as one table over the union of their scopes (ascending)."""
    scope = tuple(sorted(set().union(*(f.scope for f in factors))))
    shape = [sizes[u] for u in scope]
    total = np.zeros(shape, dtype=np.float64)
    for f in factors:
        view = [sizes[u] if u in f.scope else 1 for u in scope]
        total = total + f.table.reshape(view)
    return _Factor(scope, total)
