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
so the caller uses CP-SAT -- if a table would exceed `max_table_entries` or span more than
`_MAX_SCOPE` nodes (a tensor a long unrolled loop reads at every step). Transformer blocks
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
from typing import Callable, Mapping, NamedTuple

import numpy as np

from autopar.sharding.placement import reshard_collective
from autopar.sharding.problem import BLOCK_INPUT, BLOCK_OUTPUT, BlockProblem, TensorUse

__all__ = ["solve_by_elimination", "MAX_TABLE_ENTRIES"]

MAX_TABLE_ENTRIES = 1 << 18  # a table larger than this hands the problem to CP-SAT
_EXACT_LIMIT = 2.0 ** 53  # float64 adds integers exactly below this
_MAX_SCOPE = 32  # nodes of one table at most (numpy arrays have at most 64 dims)


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
    for t in problem.tensors:  # a tensor many nodes read (a scan's state) is one wide table
        scope = {t.producer} | {v for v, _ in t.consumers}
        if len(scope) > _MAX_SCOPE or math.prod(sizes[index[v]] for v in scope) \
                > max_table_entries:
            return None
    reshards = _reshards(problem, weight)
    soft = _node_factors(problem, weight, sizes)
    soft += [_tensor_factor(problem, t, index, reshards) for t in problem.tensors]
    # the hard factors hold only 0 and ∞: the soft ones bound the objective
    if sum(_maxima([f.table for f in soft])) >= _EXACT_LIMIT:
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
    return _eliminate(factors, sizes, order, nodes)


def _eliminate(factors: list[_Factor], sizes: list[int], order: list[int],
               nodes: tuple[str, ...]) -> dict[str, int] | None:
    """Bucket elimination along `order`, then the backward pass (None if infeasible).

    A factor waits in the bucket of its scope node eliminated first, so the bucket of v holds
    exactly the live factors that mention v when v's turn comes. Factors over v alone (its
    node factor, messages from eliminated neighbours) are summed into one vector, ``unary[v]``,
    as they arrive, and added to v's joint table once. The sums are of integers below 2^53
    (or ∞), so grouping them so gives the very same tables as summing factor by factor."""
    position = [0] * len(nodes)
    for k, v in enumerate(order):
        position[v] = k
    unary: list[np.ndarray | None] = [None] * len(nodes)
    buckets: list[list[_Factor]] = [[] for _ in nodes]

    def add(f: _Factor) -> None:
        if len(f.scope) == 1:
            (u,) = f.scope
            unary[u] = f.table if unary[u] is None else unary[u] + f.table
        else:
            buckets[order[min(map(position.__getitem__, f.scope))]].append(f)

    for f in factors:
        add(f)
    choices: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    total = 0.0
    for v in order:  # every node has a node factor, so unary[v] is set
        rest, argmin, reduced = _step(v, buckets[v], unary[v], sizes)
        choices.append((v, rest, argmin))
        if rest:
            add(_Factor(rest, reduced))
        else:
            total += float(reduced)
    if not math.isfinite(total):
        return None
    chosen: dict[int, int] = {}
    for v, rest, argmin in reversed(choices):
        chosen[v] = int(argmin[tuple(chosen[u] for u in rest)])
    return {v: chosen[i] for i, v in enumerate(nodes)}


def _step(v: int, bucket: list[_Factor], unary: np.ndarray, sizes: list[int]
          ) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """Eliminate v: the rest of the joint scope (ascending), the minimising s_v per
    assignment of the rest, and the minimum (the message over the rest). `bucket` holds the
    factors over v and others, `unary` the sum of those over v alone. A chain link (two
    factors over v and one other node each) takes `_link`, the rest `_joint`: the same
    tables either way."""
    if len(bucket) == 2 and len(bucket[0].scope) == len(bucket[1].scope) == 2:
        found = _link(v, bucket[0], bucket[1], unary)
        if found is not None:
            return found
    return _joint(v, bucket, unary, sizes)


def _link(v: int, first: _Factor, second: _Factor, unary: np.ndarray
          ) -> tuple[tuple[int, ...], np.ndarray, np.ndarray] | None:
    """`_joint` for min_v A[l, v] + unary[v] + B[v, r] over two nodes l != r (None if the
    two factors share both nodes): one broadcast sum, no reshaping."""
    (a, b), (c, d) = first.scope, second.scope
    left, right = (a if b == v else b), (c if d == v else d)
    if left == right:
        return None
    before = first.table.T if b == v else first.table  # [v, left]
    after = second.table.T if d == v else second.table  # [v, right]
    joint = (before + unary[:, None])[:, :, None] + after[:, None, :]
    argmin, reduced = joint.argmin(axis=0), joint.min(axis=0)
    if left < right:
        return (left, right), argmin, reduced
    return (right, left), argmin.T, reduced.T


def _joint(v: int, bucket: list[_Factor], unary: np.ndarray, sizes: list[int]
           ) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """`_step` on the sum of all of `bucket` and `unary` as one table, v's axis first (numpy
    reduces over a leading axis several times faster than over an inner one of a few
    entries; the values are the same in any axis order, so are argmin and min)."""
    rest = sorted({u for f in bucket for u in f.scope} - {v})
    joint = unary.reshape([-1] + [1] * len(rest))
    for f in bucket:
        table = f.table
        k = f.scope.index(v)
        if k:  # v's axis first; the others stay ascending
            table = table.transpose(k, *range(k), *range(k + 1, len(f.scope)))
        joint = joint + table.reshape([-1] + [sizes[u] if u in f.scope else 1 for u in rest])
    return tuple(rest), joint.argmin(axis=0), joint.min(axis=0)


def _maxima(tables: list[np.ndarray]) -> list[float]:
    """``[float(t.max()) for t in tables]``, in two numpy calls."""
    if not tables:
        return []
    flat = [t.ravel() for t in tables]
    starts = np.cumsum([0] + [len(f) for f in flat[:-1]])
    return np.maximum.reduceat(np.concatenate(flat), starts).tolist()


def _node_factors(problem: BlockProblem, weight: int, sizes: list[int]) -> list[_Factor]:
    values = np.array([weight * units + s for v in problem.nodes
                       for s, units in enumerate(problem.node_units(v))], dtype=np.float64)
    ends = itertools.accumulate(sizes)
    return [_Factor((i,), values[end - n:end]) for i, (n, end) in enumerate(zip(sizes, ends))]


@dataclass(frozen=True)
class _Reshards:
    """Reshard costs as arrays over the (placement, gradient placement) classes the
    problem's strategies use, and the class of every connected node input and output.

    An input's class (q, g) is "takes the tensor placed q, hands its gradient back placed g";
    an output's class (p, w) is "places the tensor p, wants its gradient as w" (w from
    ``grad_outputs``). ``taken[v, i]`` and ``made[v, j]`` list the class of input i and output
    j of node v, one per strategy (for the inputs and outputs that tensors connect).
    ``pair_prices(nbytes, grad)[x, y]`` is what output class x = (p, w) pays when one
    consumer input in class y = (q, g) reads the tensor: W · c(p → q) (+ W · c(g → w) with a
    gradient).

    Several consumers pay each distinct demand once. A demand is column k ("take it placed
    placement k") or, when the tensor has a gradient, column K + k ("hand its gradient back
    placed k"), over the K placements; input class y asks row ``asks(grad)[y]`` (a one at q,
    and at K + g) and output class x pays row ``prices(nbytes, grad)[x]``: W · c(p → q) at
    column q (and W · c(g → w) at column K + g)."""

    taken: Mapping[tuple[str, int], list[int]]
    made: Mapping[tuple[str, int], list[int]]
    asks: Callable[[bool], np.ndarray]
    prices: Callable[[float, bool], np.ndarray]
    pair_prices: Callable[[float, bool], np.ndarray]


def _reshards(problem: BlockProblem, weight: int) -> _Reshards:
    classes: dict[tuple[str, str], int] = {}
    columns: dict[tuple[int, bool, int], list[int]] = {}  # nodes alike share one tuple

    def column(v: str, output: bool, k: int) -> list[int]:
        sts = problem.strategies[v]
        key = (id(sts), output, k)
        if key not in columns:
            columns[key] = [classes.setdefault((st.outputs[k], st.grad_outputs[k]) if output
                                               else (st.inputs[k], st.input_grads[k]),
                                               len(classes)) for st in sts]
        return columns[key]

    made = {(t.producer, t.output): column(t.producer, True, t.output)
            for t in problem.tensors}
    taken = {(v, i): column(v, False, i) for t in problem.tensors for v, i in t.consumers}
    placements = sorted({p for pair in classes for p in pair})
    code = {p: k for k, p in enumerate(placements)}
    first = np.array([code[a] for a, _ in classes], dtype=np.intp)
    second = np.array([code[b] for _, b in classes], dtype=np.intp)
    n = problem.axis_size
    # the reshards that are not free, by the collective each runs on one byte: pairs that
    # agree there run the same collective at every size (the kind fixes how it scales)
    moves: dict[tuple[str, float], list[int]] = {}
    for a, src in enumerate(placements):
        for b, dst in enumerate(placements):
            unit = reshard_collective(src, dst, 1.0, n)
            if unit:
                moves.setdefault(unit, []).append(a * len(placements) + b)

    @functools.cache  # the tensors of a block share a few sizes
    def units(nbytes: float) -> np.ndarray:
        """W · c(src → dst) at [src, dst] over the K placements."""
        table = np.zeros(len(placements) ** 2, dtype=np.float64)
        for pairs in moves.values():
            src, dst = divmod(pairs[0], len(placements))
            c = reshard_collective(placements[src], placements[dst], nbytes, n)
            table[pairs] = weight * problem.collective_units(c)
        return table.reshape(len(placements), len(placements))

    @functools.cache
    def asks(grad: bool) -> np.ndarray:
        eye = np.eye(len(placements))
        return np.concatenate((eye[first], eye[second]), axis=1) if grad else eye[first]

    @functools.cache
    def prices(nbytes: float, grad: bool) -> np.ndarray:
        table = units(nbytes)
        return (np.concatenate((table[first], table.T[second]), axis=1) if grad
                else table[first])

    @functools.cache
    def pair_prices(nbytes: float, grad: bool) -> np.ndarray:
        table = units(nbytes)
        pay = table[np.ix_(first, first)]
        return pay + table[np.ix_(second, second)].T if grad else pay

    return _Reshards(taken=taken, made=made, asks=asks, prices=prices, pair_prices=pair_prices)


def _tensor_factor(problem: BlockProblem, t: TensorUse, index: dict[str, int],
                   reshards: _Reshards) -> _Factor:
    """Reshard cost of T over its producer u and consumer nodes: each distinct forward demand
    q (and, with a gradient, each distinct gradient g handed back) paid once, as `reshards`:

        Σ_q [some consumer demands q] · c(p → q)  +  Σ_g [some consumer hands back g] · c(g → w)
        = Σ_d price[s_u, d] · max_v asks_v[s_v, d]       (demand columns d as in `_Reshards`)

    as array arithmetic: the max over one axis per consumer node (a node reading T twice is
    one axis), then a product with the price rows. With one consumer input the max is that
    input's one row, and the table is a lookup of `reshards.pair_prices`."""
    produced = reshards.made[t.producer, t.output]
    producer = index[t.producer]
    if len(t.consumers) == 1:
        (v, i), = t.consumers
        consumer = index[v]
        assert producer != consumer, "a node never reads its own output"
        table = reshards.pair_prices(t.nbytes, t.requires_grad).take(produced, axis=0).take(
            reshards.taken[v, i], axis=1)
        if producer < consumer:
            return _Factor((producer, consumer), table)
        return _Factor((consumer, producer), table.T)
    consumers = sorted({index[v] for v, _ in t.consumers})
    assert producer not in consumers, "a node never reads its own output"
    asks = reshards.asks(t.requires_grad)

    def along(v: str, rows: np.ndarray) -> np.ndarray:  # one row per strategy of v
        shape = [1] * len(consumers) + [rows.shape[1]]
        shape[consumers.index(index[v])] = len(rows)
        return rows.reshape(shape)

    asked = functools.reduce(np.maximum, [along(v, asks.take(reshards.taken[v, i], axis=0))
                                          for v, i in t.consumers])
    price = reshards.prices(t.nbytes, t.requires_grad).take(produced, axis=0)
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
    `max_entries`. A node's entry count is kept as a product, updated as its neighbours
    change (divided by the size of the one eliminated, times those of the ones it gains)."""
    neighbours: list[set[int]] = [set() for _ in sizes]
    for f in factors:
        if len(f.scope) > 1:
            for u in f.scope:
                neighbours[u].update(f.scope)
    for u, near in enumerate(neighbours):
        near.discard(u)
    score = [sizes[u] * math.prod(map(sizes.__getitem__, near))
             for u, near in enumerate(neighbours)]
    # (entries, node); an entry whose count is no longer the node's is skipped, and a node's
    # current count always has an entry
    heap = [(n, u) for u, n in enumerate(score)]
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
            mine = neighbours[u]
            mine.discard(v)
            gained = near - mine
            gained.discard(u)
            mine |= gained
            entries = score[u] // sizes[v] * math.prod(map(sizes.__getitem__, gained))
            if entries != score[u]:
                score[u] = entries
                heapq.heappush(heap, (entries, u))
        order.append(v)
    return order
