"""Inter-op search: cut a sequence of layers into contiguous pipeline stages (Alpa-style stage DP).

This module owns the choice of layer ranges for the p·v pipeline stages of one configuration.
It is a pure kernel on numbers: no torch, no graph, no cluster.

Inputs, per layer l = 0..L-1 in model order, as seen by one rank: forward f_l and backward b_l
seconds per micro-batch (TP communication and recompute already included), activation bytes
a_l kept per micro-batch in flight, state bytes w_l (parameters, gradients, optimizer states).
Also: p pipeline ranks, v virtual stages per rank, m micro-batches, the schedule, the p2p time
c of one activation (or its gradient) crossing a stage boundary, and a per-rank budget M.

Stages: S = p·v, stage s = layers [i_s, i_{s+1}) with 0 = i_0 < i_1 < ... < i_S = L (non-empty),
stage s on rank s mod p. With tau(i, j) = sum_{l in [i, j)} (f_l + b_l):

    t_s  = tau(i_s, i_{s+1}) + h,          h = 2c if p > 1 else 0
    T    = (1/v) * sum_s t_s + (m*v - 1) * max_s t_s                        (predicted step)
    mem_s = sum_{l in s} w_l + n_s * sum_{l in s} a_l
    for every rank r:  sum_{s = r mod p} mem_s <= M                          (memory)

For v = 1, T is Alpa's pipeline latency sum_s t_s + (m - 1) max_s t_s; for v > 1 it gives
Megatron's interleaved closed form m(f + b) + (p - 1)(f + b)/v on equal stages. h charges
every stage one round trip per micro-batch: in 1F1B's steady state each F/B pair waits for an
activation to arrive and a gradient to come back, and the simulator shows end stages have little
slack for it. n_s, the micro-batches of stage s in flight at the rank's peak: m for GPipe;
min(p - s, m) for 1F1B and zero-bubble; for interleaved 1F1B the largest count of stage s's
micro-batches in flight at once, read off the simulator's op order (order only, not durations).

Exactness. Every cut has sum_s t_s = sum_l (f_l + b_l) + S*h, so T grows with max_s t_s alone
and the optimum is the min-max (bottleneck) cut under memory. `autopar.search.stage_dp` finds
it with one DP (the least bottleneck tau*) and then, among the cuts with every tau <= tau*,
takes the most even one (least sum tau^2) with a second. The result's `simulated_step_time_s`
(simulated with `costmodels.pipeline.simulate_pipeline` when first read) is the number to
believe; T is the formula's.

Interleaved memory (v > 1) sums v non-adjacent stages per rank, which the prefix DP cannot
carry. Pass 1 relaxes it: stage s gets M_s = M minus the least any other chunk of its rank can
hold (one layer each); if its cut fits every rank it is optimal. Otherwise pass 2, a heuristic
(`exact=False`), runs the DP under per-chunk budgets that sum to M on each rank (so its cut
fits), split evenly or in proportion to seed cuts (pass 1's, the least-peak one, and one from a
binary search on the bound with two repairs of the coupling), then polishes the best cut with
chain moves. On the brute-force instances of the tests it usually finds the optimum, but it
can miss a cut that fits a budget with little slack. For v = 1 the answer is always exact.

An incumbent (a cut the caller runs otherwise and knows to fit by its own, exact memory
account, e.g. Megatron's even placement checked by the simulator) joins pass 2's seeds and
candidates, so pass 2 never returns a cut worse by (bottleneck, sum of squares). The per-stage
peaks above are conservative for v > 1 (a rank's chunks do not all peak at once), so the DP
may think the incumbent too large; it is trusted anyway. Pass 1's bottleneck bounds every
fitting cut's (pass 1 only relaxes memory), so an incumbent that reaches it has the least T
and is returned without the search (method "incumbent"; a more even cut of the same T may
exist).

Uniform layers (all f, b, a, w equal) short-circuit to the even split (sizes floor or ceil of
L/S, the longer stages where fewest micro-batches are in flight, later stages first) when it
fits: its bottleneck ceil(L/S)·(f + b) is a lower bound and its sum of squares is least.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autopar.errors import StageMemoryError
from autopar.search.stage_dp import (_bottleneck, _fastest, _least_memory_cut, _Ranges,
                                     _solve)
from costmodels.pipeline import OpKind, PipelineSchedule, parse_schedule, simulate_pipeline

__all__ = ["LayerCosts", "StagePartition", "partition_stages"]

logger = logging.getLogger(__name__)

# Search settings of the interleaved pass 2, not cost constants. Checked 2026-11 on 3000
# derandomized brute-force instances like the unit tests' (L <= 8, p <= 2, v = 2): 8 split
# rounds, 8 or 12 repair rounds or a zero tolerance found no better cut than these.
_SPLIT_ROUNDS = 4       # refinements of the budget split (one DP pair each)
_REPAIR_ROUNDS = 6      # rounds of each coupling repair per bottleneck bound tried
_DESCENT_STEPS = 64     # chain moves of the final polish
_BOUND_TOLERANCE = 0.01  # stop narrowing the seed's bound within 1%; the DP under the split
                         # taken from the seed then finds that split's exact least bottleneck


@dataclass(frozen=True, kw_only=True)
class StagePartition:
    """Layer ranges of the p·v pipeline stages and what they cost; stage s runs on rank s mod p.

    Per-stage tuples are in model order. Times are seconds per micro-batch, memory is bytes.
    """

    schedule: PipelineSchedule
    num_stages: int                  # pipeline ranks p
    virtual_stages: int              # v; len(boundaries) == p * v
    num_microbatches: int
    boundaries: tuple[tuple[int, int], ...]   # (start, end) half-open layer index ranges
    stage_forward_s: tuple[float, ...]
    stage_backward_s: tuple[float, ...]
    stage_time_s: tuple[float, ...]           # forward + backward + p2p round trip
    stage_inflight: tuple[int, ...]           # micro-batches held at the rank's peak
    stage_memory_bytes: tuple[float, ...]     # states + activations x in flight
    rank_memory_bytes: tuple[float, ...]      # per rank: the sum over its chunks
    memory_budget_bytes: float
    bottleneck_s: float                       # max of stage_time_s
    predicted_step_time_s: float              # sum(t)/v + (m·v - 1)·max(t)
    stage_weight_grad_s: tuple[float, ...] | None  # zero-bubble's W part of stage_backward_s
    p2p_s: float                              # one send across a stage boundary
    exact: bool                               # False only for a pass-2 interleaved cut
    method: str                   # "even-split" | "dp" | "dp-split-budget" | "incumbent"

    @functools.cached_property
    def simulated_step_time_s(self) -> float:
        """simulate_pipeline's makespan of the cut: the truth (simulated when first read)."""
        return simulate_pipeline(
            schedule=self.schedule, num_stages=self.num_stages,
            num_microbatches=self.num_microbatches, virtual_stages=self.virtual_stages,
            forward_s=self.stage_forward_s, backward_s=self.stage_backward_s,
            weight_grad_s=self.stage_weight_grad_s, p2p_s=self.p2p_s).step_time_s

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(end - start for start, end in self.boundaries)

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.rank_memory_bytes)


# -- validation -------------------------------------------------------------------------------

def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _per_layer(name: str, values: Sequence[float], num_layers: int | None,
               unit: str) -> np.ndarray:
    try:
        out = np.asarray([float(x) for x in values], dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of numbers ({unit} per layer), "
                         f"got {values!r}") from None
    if out.size == 0:
        raise ValueError(f"{name} is empty; give one entry per layer")
    if num_layers is not None and out.size != num_layers:
        raise ValueError(f"{name} has {out.size} entries; expected {num_layers}, one per layer "
                         f"like forward_s")
    bad = np.flatnonzero(~(np.isfinite(out) & (out >= 0.0)))
    if bad.size:
        raise ValueError(f"{name}[{bad[0]}] = {out[bad[0]]!r}: need finite {unit} >= 0")
    return out


# -- micro-batches in flight per stage ---------------------------------------------------------

@functools.lru_cache(maxsize=128)  # a memo of a pure function of its arguments, nothing else
def _inflight(kind: PipelineSchedule, p: int, m: int, v: int) -> tuple[int, ...]:
    if kind is PipelineSchedule.GPIPE:
        return (m,) * p
    if kind is not PipelineSchedule.INTERLEAVED_1F1B:
        return tuple(min(p - s, m) for s in range(p))
    timeline = simulate_pipeline(schedule=kind, num_stages=p, num_microbatches=m,
                                 virtual_stages=v, forward_s=1.0, backward_s=1.0)
    live = [0] * (p * v)
    peak = [0] * (p * v)
    for rank_ops in timeline.ops:
        for op in rank_ops:
            if op.kind is OpKind.F:
                live[op.stage] += 1
                peak[op.stage] = max(peak[op.stage], live[op.stage])
            elif op.kind is OpKind.B:
                live[op.stage] -= 1
    return tuple(peak)


# -- the search -------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class LayerCosts:
    """What each layer costs one rank, one entry per layer in model order (`partition_stages`
    cuts these into stages)."""

    forward_s: Sequence[float]
    """Forward seconds per micro-batch (TP communication and recompute included)."""
    backward_s: Sequence[float]
    """Backward seconds per micro-batch."""
    activation_bytes: Sequence[float]
    """Activation bytes kept per micro-batch in flight."""
    state_bytes: Sequence[float]
    """Parameter, gradient and optimizer-state bytes."""
    weight_grad_s: Sequence[float] | None = None
    """The weight-grad part of each backward: needed by ``zero-bubble`` only, for the
    simulator's split backward."""


def partition_stages(layers: LayerCosts, *, num_stages: int, num_microbatches: int,
                     schedule: PipelineSchedule | str = "1f1b", virtual_stages: int = 1,
                     p2p_s: float = 0.0, memory_budget_bytes: float = math.inf,
                     incumbent: Sequence[tuple[int, int]] | None = None) -> StagePartition:
    """Cut L layers into num_stages·virtual_stages contiguous stages with the least step time.

    `layers` holds the per-layer costs (`LayerCosts`, one entry per layer in model order).
    `p2p_s` is the time of one send across a stage boundary. `memory_budget_bytes` bounds
    each pipeline rank. `incumbent` is a cut to beat that the caller knows fits (half-open
    layer ranges, e.g. the placement it would otherwise run): the interleaved pass 2 starts
    from it and returns it, without searching, when no cut has a lower bottleneck. See the
    module docstring for the objective and the algorithm (`stage_dp`'s for the DPs).

    Raises ValueError for malformed inputs, num_stages·virtual_stages > L, virtual_stages > 1
    outside ``interleaved-1f1b`` and the simulator's other shape rules, and StageMemoryError
    (a ValueError) when no cut fits the budget, giving the smallest peak reachable and the stage
    that binds.
    """
    kind = parse_schedule(schedule)
    p = _count("num_stages", num_stages)
    m = _count("num_microbatches", num_microbatches)
    v = _count("virtual_stages", virtual_stages)
    fwd = _per_layer("forward_s", layers.forward_s, None, "seconds")
    num_layers = fwd.size
    bwd = _per_layer("backward_s", layers.backward_s, num_layers, "seconds")
    act = _per_layer("activation_bytes", layers.activation_bytes, num_layers, "bytes")
    state = _per_layer("state_bytes", layers.state_bytes, num_layers, "bytes")
    wgrad = None
    if layers.weight_grad_s is not None:
        wgrad = _per_layer("weight_grad_s", layers.weight_grad_s, num_layers, "seconds")
    elif kind is PipelineSchedule.ZERO_BUBBLE:
        raise ValueError("schedule 'zero-bubble' needs weight_grad_s, the weight-grad part of "
                         "each layer's backward, to simulate the split backward")
    hop = float(_per_layer("p2p_s", [p2p_s], 1, "seconds")[0])
    hop = hop if p > 1 else 0.0  # one rank: every stage boundary stays on it
    budget = float(memory_budget_bytes)
    if math.isnan(budget) or budget <= 0.0:
        raise ValueError(f"memory_budget_bytes must be > 0 (math.inf for no limit), "
                         f"got {memory_budget_bytes!r}")
    if v > 1 and kind is not PipelineSchedule.INTERLEAVED_1F1B:
        raise ValueError(f"virtual_stages={v} needs schedule 'interleaved-1f1b'; "
                         f"{kind.value!r} takes virtual_stages=1")
    num = p * v
    if num > num_layers:
        raise ValueError(f"num_stages*virtual_stages = {p}*{v} = {num} pipeline stages for "
                         f"{num_layers} layers: every stage needs at least one layer; lower "
                         f"num_stages or virtual_stages (at most {num_layers} stages in all)")
    inflight = _inflight(kind, p, m, v)  # raises the simulator's ValueError for bad shapes
    if incumbent is not None:
        incumbent = [(int(i), int(j)) for i, j in incumbent]
        if len(incumbent) != num or incumbent[0][0] != 0 or incumbent[-1][1] != num_layers \
                or any(a[1] != b[0] or a[0] >= a[1] for a, b in zip(incumbent, incumbent[1:])):
            raise ValueError(f"incumbent {incumbent} does not cut the {num_layers} layers into "
                             f"{num} contiguous non-empty stages")

    cut, exact, method = None, True, "even-split"
    if _uniform(fwd, bwd, act, state):
        cut = _even_split(num_layers, inflight)
        if max(_rank_memory(cut, inflight, act, state, p)) > budget:
            cut = None
    if cut is None:
        ranges = _Ranges(fwd + bwd, act, state)
        if incumbent is not None:
            ranges.cap = _bottleneck(ranges, incumbent)
        cut, exact, method = _search(ranges, inflight, act, state, p, v, budget, incumbent)
    arrays = LayerCosts(forward_s=fwd, backward_s=bwd, activation_bytes=act, state_bytes=state,
                        weight_grad_s=wgrad)
    return _result(_Checked(kind=kind, p=p, m=m, v=v, inflight=inflight, layers=arrays,
                            hop=hop, budget=budget), cut, exact, method)


def _uniform(*per_layer: np.ndarray) -> bool:
    return all(bool(np.all(x == x[0])) for x in per_layer)


def _even_split(num_layers: int, inflight: tuple[int, ...]) -> list[tuple[int, int]]:
    num = len(inflight)
    base, extra = divmod(num_layers, num)
    longer = set(sorted(range(num), key=lambda s: (inflight[s], -s))[:extra])
    cut, start = [], 0
    for s in range(num):
        end = start + base + (s in longer)
        cut.append((start, end))
        start = end
    return cut


def _search(ranges: _Ranges, inflight: tuple[int, ...], act: np.ndarray, state: np.ndarray,
            p: int, v: int, budget: float, incumbent: list[tuple[int, int]] | None = None
            ) -> tuple[list[tuple[int, int]], bool, str]:
    num = p * v
    if v == 1:
        cut = _solve(ranges, inflight, [budget] * num)
        if cut is None:
            raise _infeasible(ranges, inflight, p, v, budget, [budget] * num)
        return cut, True, "dp"
    # one layer's worth per chunk (once per distinct in-flight count)
    least_of = {n: float(np.min(state + n * act)) for n in set(inflight)}
    least = [least_of[n] for n in inflight]
    relaxed = []
    for s in range(num):
        others = sum(least[o] for o in range(s % p, num, p) if o != s)
        relaxed.append(budget - others)
    cut = _solve(ranges, inflight, relaxed)
    if cut is None:
        raise _infeasible(ranges, inflight, p, v, budget, relaxed)
    if max(_rank_memory(cut, inflight, act, state, p)) <= budget:
        return cut, True, "dp"
    if incumbent is not None and _bottleneck(ranges, incumbent) <= _bottleneck(ranges, cut):
        # pass 1's bottleneck bounds every fitting cut's: none has a lower T than the incumbent
        return incumbent, True, "incumbent"
    frugal = _least_memory_cut(ranges, inflight, [budget - r for r in relaxed])
    best = _split_search(ranges, inflight, act, state, p, budget,
                         [cut, frugal] + ([incumbent] if incumbent is not None else []))
    upper = math.inf if best is None else _bottleneck(ranges, best)
    lean = _lean_search(ranges, inflight, act, state, p, budget, relaxed, upper)
    if lean is not None:
        best = _split_search(ranges, inflight, act, state, p, budget, [lean, best or lean])
    if incumbent is not None and (best is None or _key(ranges, incumbent) < _key(ranges, best)):
        if max(_rank_memory(incumbent, inflight, act, state, p)) > budget:
            return incumbent, False, "incumbent"  # trusted; the chain moves need a fitting start
        best = incumbent
    if best is not None:
        best = _descend(best, inflight, act, state, ranges, p, budget)
    if best is None:
        use = _rank_memory(frugal, inflight, act, state, p)
        rank = int(np.argmax(use))
        floor = _infeasible(ranges, inflight, p, v, budget, relaxed).min_peak_bytes
        raise StageMemoryError(
            f"no interleaved cut of {ranges.num_layers} layers into {p}x{v} stages was found "
            f"within the memory budget of {_gb(budget)} per rank: the leanest cut found "
            f"({[j - i for i, j in frugal]} layers per stage) needs {_gb(use[rank])} on rank "
            f"{rank}, and any cut needs at least {_gb(floor)} (a cut between the two may "
            f"exist); lower virtual_stages, add pipeline stages, recompute activations or "
            f"shard states with ZeRO",
            budget_bytes=budget, min_peak_bytes=floor)
    logger.debug("interleaved cut from a split budget (pass 2), not proven optimal")
    return best, False, "dp-split-budget"


def _key(ranges: _Ranges, cut: list[tuple[int, int]]) -> tuple[float, float]:
    """Pass 2's order of cuts: bottleneck, then sum of squares (the more even)."""
    taus = [ranges.tau_of(i, j) for i, j in cut]
    return max(taus), math.fsum(t * t for t in taus)


def _lean_search(ranges: _Ranges, inflight: tuple[int, ...], act: np.ndarray,
                 state: np.ndarray, p: int, budget: float, relaxed: list[float],
                 upper: float) -> list[tuple[int, int]] | None:
    """Pass 2 seed: a cut that fits every rank, its bottleneck T (< `upper`) binary-searched.

    At a bound T, `settle` iterates the least-peak cut with each stage charged what its rank's
    other chunks held in the previous cut; `weigh` takes the cut least in sum_s lambda_rank
    mem_s, raising lambda where a rank overflows (exact for p = 1). Neither is monotone in T.
    """
    num = len(inflight)

    def settle(bound: float) -> list[tuple[int, int]] | None:
        # charge each stage what the other chunks of its rank held in the last cut
        extra, seen = [budget - r for r in relaxed], set()
        for _ in range(_REPAIR_ROUNDS):
            cut = _least_memory_cut(ranges, inflight, extra, bound)
            if cut is None or tuple(cut) in seen:
                return None
            use = _stage_memory(cut, inflight, act, state)
            if max(math.fsum(use[r::p]) for r in range(p)) <= budget:
                return cut
            seen.add(tuple(cut))
            extra = [math.fsum(use[s % p::p]) - use[s] for s in range(num)]
        return None

    def weigh(bound: float) -> list[tuple[int, int]] | None:
        # least sum_s lambda_rank * mem_s, raising lambda where a rank overflows
        band = ranges.band(bound)
        slow = np.where(band.tau <= bound, 0.0, np.inf)
        weight = [1.0] * p

        def cost(s: int) -> np.ndarray:
            held = band.held(inflight[s]) + slow
            return weight[s % p] * np.where(held <= relaxed[s], held, np.inf)

        for _ in range(_REPAIR_ROUNDS):
            cut, _ = band.cut(num, cost, minimax=False)
            if cut is None:
                return None
            use = _rank_memory(cut, inflight, act, state, p)
            if max(use) <= budget:
                return cut
            weight = [w * max(u / budget, 0.5) ** 2 for w, u in zip(weight, use)]
        return None

    def fitting(bound: float) -> list[tuple[int, int]] | None:
        return settle(bound) or weigh(bound)

    fastest = _fastest(ranges, inflight, relaxed)
    lower = _bottleneck(ranges, fastest) if fastest else math.inf
    bounds = np.unique(ranges.tau[ranges.valid])
    bounds = bounds[(bounds >= lower) & (bounds < upper)]
    if bounds.size == 0:
        return None
    best = fitting(float(bounds[-1]))
    lo, hi = 0, len(bounds) - 1  # fitting(bounds[hi]) found `best`
    while best is not None and lo < hi and bounds[hi] > bounds[lo] * (1 + _BOUND_TOLERANCE):
        mid = (lo + hi) // 2
        found = fitting(float(bounds[mid]))
        if found is None:
            lo = mid + 1
        else:
            best, hi = found, mid
    return best


def _split_search(ranges: _Ranges, inflight: tuple[int, ...], act: np.ndarray,
                  state: np.ndarray, p: int, budget: float, seeds: list[list[tuple[int, int]]]
                  ) -> list[tuple[int, int]] | None:
    """Pass 2: the best cut under per-chunk budgets summing to M per rank, split evenly, in
    proportion to each seed cut's use, then (while it helps) to the best cut's own use."""
    num = len(inflight)
    v = num // p

    def proportional(cut: list[tuple[int, int]]) -> list[float]:
        use = _stage_memory(cut, inflight, act, state)
        rank_use = [math.fsum(use[r::p]) for r in range(p)]
        return [budget * use[s] / rank_use[s % p] if rank_use[s % p] > 0 else budget / v
                for s in range(num)]

    splits = [[budget / v] * num] + [proportional(cut) for cut in seeds]
    best, best_key = None, None
    for _ in range(_SPLIT_ROUNDS):
        improved = False
        for split in splits:
            found = _solve(ranges, inflight, split)
            if found is None:
                continue
            key = _key(ranges, found)
            if best_key is None or key < best_key:
                best, best_key, improved = found, key, True
        if not improved:
            break
        splits = [proportional(best)]
    return best


def _descend(cut: list[tuple[int, int]], inflight: tuple[int, ...], act: np.ndarray,
             state: np.ndarray, ranges: _Ranges, p: int, budget: float
             ) -> list[tuple[int, int]]:
    """Pass 2 polish: a bottleneck stage b hands its first layer back (starts of stages k..b
    move +1) or its last layer on (starts of b+1..l move -1); the chain move that fits every
    rank and lowers (max tau, stages at the max, sum tau^2) most is taken, while one does (ties
    to the lexicographically least edges). All moves of a step are scored at once; the sums run
    in stage order (cumsum), so keys are those of a per-move Python loop to the bit."""
    num = len(cut)
    tau, hold, act_sum = ranges.tau, ranges.state, ranges.act
    held = np.asarray(inflight, dtype=float)
    x = np.arange(num + 1)

    def score(edges: np.ndarray) -> tuple[np.ndarray, ...]:
        """(fits, max tau, stages at the max, sum tau^2) of each row of edges."""
        i, j = edges[:, :-1], edges[:, 1:]
        use = hold[i, j] + held * act_sum[i, j]
        rank = np.cumsum(use.reshape(len(edges), num // p, p), axis=1)[:, -1]
        taus = tau[i, j]
        top = taus.max(axis=1)
        return (rank.max(axis=1) <= budget, top, (taus == top[:, None]).sum(axis=1),
                np.cumsum(taus * taus, axis=1)[:, -1])

    edges = np.array([i for i, _ in cut] + [cut[-1][1]])
    fits, top, count, square = score(edges[None])
    assert fits[0], "pass 2 starts from a cut that fits"
    key = (top[0], count[0], square[0])
    for _ in range(_DESCENT_STEPS):
        taus = tau[edges[:-1], edges[1:]]
        moves = []
        for b in np.flatnonzero((taus == key[0]) & (np.diff(edges) > 1)):
            first = np.arange(1, b + 1)[:, None]
            moves.append(edges + ((x >= first) & (x <= b)))
            last = np.arange(b + 1, num)[:, None]
            moves.append(edges - ((x > b) & (x <= last)))
        if not moves:
            break
        cand = np.concatenate(moves)
        fits, top, count, square = score(cand)
        if not fits.any():
            break
        cand, top, count, square = cand[fits], top[fits], count[fits], square[fits]
        order = np.lexsort(tuple(cand[:, c] for c in range(num, -1, -1)) + (square, count, top))
        best = order[0]
        new_key = (top[best], count[best], square[best])
        if new_key >= key:
            break
        key, edges = new_key, cand[best]
    found = [(int(edges[s]), int(edges[s + 1])) for s in range(num)]
    if max(_rank_memory(found, inflight, act, state, p)) > budget:  # rounding of prefix sums
        return cut
    return found


def _stage_memory(cut: list[tuple[int, int]], inflight: tuple[int, ...], act: np.ndarray,
                  state: np.ndarray) -> list[float]:
    state, act = state.tolist(), act.tolist()  # fsum reads a list faster than an array
    return [math.fsum(state[i:j]) + n * math.fsum(act[i:j]) for (i, j), n in zip(cut, inflight)]


def _rank_memory(cut: list[tuple[int, int]], inflight: tuple[int, ...], act: np.ndarray,
                 state: np.ndarray, p: int) -> list[float]:
    per_stage = _stage_memory(cut, inflight, act, state)
    return [math.fsum(per_stage[r::p]) for r in range(p)]


def _gb(num_bytes: float) -> str:
    scale, unit = next(((x, u) for x, u in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"))
                        if num_bytes >= x), (1.0, "B"))
    return f"{num_bytes / scale:.4g} {unit}"



def _infeasible(ranges: _Ranges, inflight: tuple[int, ...], p: int, v: int, budget: float,
                budgets: list[float]) -> StageMemoryError:
    """The error for a budget no cut meets: the least peak any cut reaches and where it binds
    (stage s also charged budget - budgets[s]: exact for v = 1, a lower bound for v > 1)."""
    num = len(inflight)
    extra = [budget - b for b in budgets]
    cut = _least_memory_cut(ranges, inflight, extra)
    assert cut is not None, "every cut has a finite memory"
    usage = [float(ranges.state[i, j] + n * ranges.act[i, j]) + e
             for (i, j), n, e in zip(cut, inflight, extra)]
    s = int(np.argmax(usage))
    peak = usage[s]
    i, j = cut[s]
    states, acts = float(ranges.state[i, j]), float(ranges.act[i, j])
    where = (f"stage {s} (rank {s % p}), layers [{i}, {j}): states {_gb(states)} + "
             f"activations {_gb(acts)} x {inflight[s]} micro-batches in flight")
    bound = "exactly" if v == 1 else "at least"
    if v > 1:
        where += f" + at least {_gb(extra[s])} for the other chunks of its rank"
    logger.debug("no stage cut fits %s; least peak %s", _gb(budget), _gb(peak))
    return StageMemoryError(
        f"no cut of {ranges.num_layers} layers into {num} pipeline stages fits the memory budget "
        f"of {_gb(budget)} per rank: the smallest peak any cut reaches is {bound} {_gb(peak)}, "
        f"bound by {where}; raise the budget, add pipeline stages, use a schedule with fewer "
        f"micro-batches in flight (1f1b instead of gpipe), recompute activations or shard "
        f"states with ZeRO",
        budget_bytes=budget, min_peak_bytes=peak, stage=s, layers=(i, j))


@dataclass(frozen=True, kw_only=True)
class _Checked:
    """`partition_stages`' inputs once checked, which its result reports on the cut."""

    kind: PipelineSchedule
    p: int  # pipeline ranks
    m: int  # micro-batches
    v: int  # virtual stages per rank
    inflight: tuple[int, ...]  # micro-batches of each stage in flight at its rank's peak
    layers: LayerCosts  # as float64 arrays
    hop: float  # one send across a stage boundary (0 on one rank)
    budget: float  # bytes per rank


def _result(checked: _Checked, cut: list[tuple[int, int]], exact: bool,
            method: str) -> StagePartition:
    kind, p, m, v, inflight = checked.kind, checked.p, checked.m, checked.v, checked.inflight
    layers, hop, budget = checked.layers, checked.hop, checked.budget
    act, state = layers.activation_bytes, layers.state_bytes
    # fsum reads a list faster than an array
    fwd, bwd = layers.forward_s.tolist(), layers.backward_s.tolist()
    stage_f = tuple(math.fsum(fwd[i:j]) for i, j in cut)
    stage_b = tuple(math.fsum(bwd[i:j]) for i, j in cut)
    times = tuple(f + b + 2.0 * hop for f, b in zip(stage_f, stage_b))
    bottleneck = max(times)
    predicted = math.fsum(times) / v + (m * v - 1) * bottleneck
    stage_w = None
    if layers.weight_grad_s is not None:
        wgrad = layers.weight_grad_s.tolist()
        stage_w = tuple(min(math.fsum(wgrad[i:j]), b) for (i, j), b in zip(cut, stage_b))
    logger.debug("%s p=%d v=%d m=%d: %s layers/stage, bottleneck %.6g s, predicted %.6g s "
                 "(%s)", kind.value, p, v, m, [j - i for i, j in cut], bottleneck, predicted,
                 method)
    return StagePartition(
        schedule=kind, num_stages=p, virtual_stages=v, num_microbatches=m,
        boundaries=tuple(cut), stage_forward_s=stage_f, stage_backward_s=stage_b,
        stage_time_s=times, stage_inflight=inflight,
        stage_memory_bytes=tuple(_stage_memory(cut, inflight, act, state)),
        rank_memory_bytes=tuple(_rank_memory(cut, inflight, act, state, p)),
        memory_budget_bytes=budget, bottleneck_s=bottleneck, predicted_step_time_s=predicted,
        stage_weight_grad_s=stage_w, p2p_s=hop, exact=exact, method=method)
