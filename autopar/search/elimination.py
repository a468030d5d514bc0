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

import bisect
import functools
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from autopar.sharding.placement import REPLICATE, reshard_collective
from autopar.sharding.problem import BLOCK_INPUT, BLOCK_OUTPUT, BlockProblem, TensorUse

__all__ = ["solve_by_elimination", "MAX_TABLE_ENTRIES"]

MAX_TABLE_ENTRIES = 1 << 18  # a table larger than this hands the problem to CP-SAT
_EXACT_LIMIT = 2.0 ** 53  # float64 adds integers exactly below this


class _Factor(NamedTuple):
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
    reshards = _reshards(problem, weight)
    soft = _node_factors(problem, weight, sizes)
    soft += [_tensor_factor(problem, t, index, reshards) for t in problem.tensors]
    # the hard factors hold only 0 and ∞: the soft ones bound the objective
    if sum(float(f.table.max()) for f in soft) >= _EXACT_LIMIT:
        return None
    factors = soft + _param_factors(problem, index)
    if problem.periodic:
        n = sizes[index[BLOCK_INPUT]]
        assert n == sizes[index[BLOCK_OUTPUT]], "the boundary nodes share their strategies"
        table = np.where(np.eye(n, dtype=bool), 0.0, np.inf)
        a, b = index[BLOCK_INPUT], index[BLOCK_OUTPUT]
        factors.append(_Factor((a, b), table) if a < b else _Factor((b, a), table.T.copy()))
    order = _elimination_order(factors, sizes, max_table_entries)
    if order is None:
        return None
    # bucket elimination: a factor waits in the bucket of its scope node eliminated first,
    # so the bucket of v holds exactly the live factors that mention v when v's turn comes
    position = {v: k for k, v in enumerate(order)}
    buckets: list[list[_Factor]] = [[] for _ in order]
    for f in factors:
        buckets[min(position[u] for u in f.scope)].append(f)
    choices: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    total = 0.0
    for v, bucket in zip(order, buckets):
        joint = _combine(bucket, sizes)
        axis = joint.scope.index(v)
        rest = joint.scope[:axis] + joint.scope[axis + 1:]
        choices.append((v, rest, joint.table.argmin(axis=axis)))
        reduced = joint.table.min(axis=axis)
        if rest:
            buckets[min(position[u] for u in rest)].append(_Factor(rest, reduced))
        else:
            total += float(reduced)
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


@dataclass(frozen=True)
class _Reshards:
    """Reshard costs as arrays over pairs of the problem's K placements (sorted; the pair
    (a, b) is row ``row[a, b]`` = a·K + b).

    A demand on a tensor is column q ("take it placed q") or, when the tensor has a gradient,
    column K + g ("hand its gradient back placed g"). A consumer strategy taking q and handing
    back g asks row ``asks[grad][row[q, g]]``: a one at q (and at K + g); a producer strategy
    placing the tensor p and wanting its gradient as w pays row
    ``prices(nbytes, grad)[row[p, w]]``: W · c(p → q) at column q (and W · c(g → w) at
    column K + g)."""

    row: dict[tuple[str, str], int]
    asks: dict[bool, np.ndarray]
    prices: Callable[[float, bool], np.ndarray]


def _reshards(problem: BlockProblem, weight: int) -> _Reshards:
    # every placement a strategy names (grad_outputs are output_grads, or the outputs with
    # P -> R)
    placements = sorted({REPLICATE}.union(*(
        (*st.inputs, *st.outputs, *st.input_grads, *st.output_grads)
        for sts in problem.strategies.values() for st in sts)))
    k = len(placements)

    def by_pair(table: np.ndarray, grad: bool) -> np.ndarray:
        """Row (a, b): row a of the K x K `table`, then (with a gradient) its column b."""
        first = np.repeat(table, k, axis=0)
        return np.concatenate((first, np.tile(table.T, (k, 1))), axis=1) if grad else first

    @functools.cache  # the tensors of a block share a few sizes
    def prices(nbytes: float, grad: bool) -> np.ndarray:
        units = np.array([[weight * _units(problem, src, dst, nbytes) for dst in placements]
                          for src in placements], dtype=np.float64)
        return by_pair(units, grad)

    eye = np.eye(k)
    return _Reshards(row={pair: i for i, pair in enumerate(itertools.product(placements,
                                                                             repeat=2))},
                     asks={grad: by_pair(eye, grad) for grad in (False, True)}, prices=prices)


def _units(problem: BlockProblem, src: str, dst: str, nbytes: float) -> int:
    """Units of resharding `nbytes` from `src` to `dst` (0 when it is free)."""
    c = reshard_collective(src, dst, nbytes, problem.axis_size)
    return problem.collective_units(c) if c else 0


def _tensor_factor(problem: BlockProblem, t: TensorUse, index: dict[str, int],
                   reshards: _Reshards) -> _Factor:
    """Reshard cost of T over its producer u and consumer nodes: each distinct forward demand
    q (and, with a gradient, each distinct gradient g handed back) paid once, as `reshards`:

        Σ_q [some consumer demands q] · c(p → q)  +  Σ_g [some consumer hands back g] · c(g → w)
        = Σ_d price[s_u, d] · max_v asks_v[s_v, d]       (demand columns d as in `_Reshards`)

    as array arithmetic: the max over one axis per consumer node (a node reading T twice is
    one axis), then a product with the price rows."""
    consumers = sorted({index[v] for v, _ in t.consumers})
    producer = index[t.producer]
    assert producer not in consumers, "a node never reads its own output"
    row, asks = reshards.row, reshards.asks[t.requires_grad]

    def along(v: str, rows: np.ndarray) -> np.ndarray:  # one row per strategy of v
        shape = [1] * len(consumers) + [rows.shape[1]]
        shape[consumers.index(index[v])] = len(rows)
        return rows.reshape(shape)

    asked = functools.reduce(np.maximum, [
        along(v, asks.take([row[st.inputs[i], st.input_grads[i]]
                            for st in problem.strategies[v]], axis=0))
        for v, i in t.consumers])
    price = reshards.prices(t.nbytes, t.requires_grad).take(
        [row[st.outputs[t.output], st.grad_outputs[t.output]]
         for st in problem.strategies[t.producer]], axis=0)
    table = asked @ price.T  # consumer axes, then the producer's
    axes = list(range(len(consumers)))
    axes.insert(bisect.bisect(consumers, producer), len(consumers))
    return _Factor(tuple(sorted([*consumers, producer])), table.transpose(axes))


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

    score = [entries(u) for u in range(len(sizes))]
    heap = [(n, u) for u, n in enumerate(score)]  # (entries, node), stale ones skipped
    heapq.heapify(heap)
    eliminated = [False] * len(sizes)
    order = []
    while heap:
        n, v = heapq.heappop(heap)
        if eliminated[v] or n != score[v]:
            continue
        if n > max_entries:
            return None
        eliminated[v] = True
        near = neighbours[v]
        for u in near:
            neighbours[u].discard(v)
            neighbours[u].update(near - {u})
        for u in near:
            score[u] = entries(u)
            heapq.heappush(heap, (score[u], u))
        order.append(v)
    return order


def _combine(factors: list[_Factor], sizes: list[int]) -> _Factor:
    """The sum of `factors` as one table over the union of their scopes (ascending)."""
    scope = tuple(sorted(set().union(*(f.scope for f in factors))))
    return _Factor(scope, functools.reduce(np.add, [
        f.table.reshape([sizes[u] if u in f.scope else 1 for u in scope]) for f in factors]))
