"""Stage DP: the dynamic programs that cut a sequence of layers into contiguous stages.

The kernel under `autopar.search.inter_op`, whose module docstring has the model and its
notation (tau(i, j), mem_s(i, j), the per-stage budgets M_s). It is a pure kernel on numbers:
no torch, no graph, no cluster. `_Ranges` holds the range sums of every layer range [i, j),
`_Band` those of the short ones, and `_Band.cut` is the one DP that the cuts below (and
inter_op's pass 2) run.

Alpa reaches the least bottleneck by enumerating candidate bounds t_max and solving a DP per
bound; here one DP finds the bound:

    D_0(0) = 0,   D_0(j > 0) = inf
    D_s(j) = min over i < j with mem_s(i, j) <= M_s of  max(D_{s-1}(i), tau(i, j))
    tau* = D_S(L)

Among the cuts with every tau <= tau* a second DP picks the most even one (least sum tau^2):

    E_s(j) = min over i < j, tau(i, j) <= tau*, mem_s(i, j) <= M_s of  E_{s-1}(i) + tau(i, j)^2

and backtracks with ties to the smallest i: later stages (which hold fewer micro-batches under
1F1B) take the extra layers. Each DP runs over a band: the stages [i, j) no longer than the
longest run of layers with tau <= a bound, S numpy passes over (L + 1) x W tables, O(L W S)
time. The second DP's bound is tau*; the first's is an incumbent's bottleneck when one is
given (else there is no band: W = L), and if its least bottleneck exceeds that bound it runs
again without one. A stage outside the band has tau above the bound, so neither DP could
pick it where it counts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

__all__: list[str] = []  # the stage search's internals: inter_op imports them by name


class _Ranges:
    """Range sums tau, state bytes and activation bytes for every (i, j), i < j: as prefix
    sums, as matrices of (L+1) x (L+1) with inf where i >= j (no stage; built when first
    used), and as bands (`band`). `cap`, when finite, is a bottleneck the caller already has
    (an incumbent's): the least-bottleneck DP first looks only at stages with tau <= cap."""

    def __init__(self, compute: np.ndarray, act: np.ndarray, state: np.ndarray):
        self.num_layers = compute.size
        self.size = compute.size + 1
        self.prefix = {name: np.concatenate(([0.0], np.cumsum(values)))
                       for name, values in (("tau", compute), ("act", act), ("state", state))}
        self.cap = math.inf
        self._bands: dict[int, _Band] = {}
        self.solved: dict[tuple, list[tuple[int, int]] | None] = {}  # `_solve`'s memo

    @functools.cached_property
    def valid(self) -> np.ndarray:
        return np.triu(np.ones((self.size, self.size), dtype=bool), k=1)

    def _matrix(self, name: str) -> np.ndarray:
        prefix = self.prefix[name]
        return np.where(self.valid, prefix[None, :] - prefix[:, None], np.inf)

    @functools.cached_property
    def tau(self) -> np.ndarray:
        return self._matrix("tau")

    @functools.cached_property
    def act(self) -> np.ndarray:
        return self._matrix("act")

    @functools.cached_property
    def state(self) -> np.ndarray:
        return self._matrix("state")

    def tau_of(self, i: int, j: int) -> float:
        """tau(i, j), the same number as `tau[i, j]`."""
        prefix = self.prefix["tau"]
        return float(prefix[j] - prefix[i])

    def band(self, bound: float) -> "_Band":
        """The stages [i, j) with j - i at most the longest run of layers with tau <= bound
        (all of them for an infinite bound)."""
        prefix = self.prefix["tau"]
        if math.isfinite(bound):
            # a little wider than tau <= bound: the sum below need not round as the difference
            reach = np.searchsorted(prefix, prefix + bound * (1 + 1e-9), side="right") - 1
            width = max(1, int((reach - np.arange(self.size)).max()))
        else:
            width = self.num_layers
        if width not in self._bands:
            self._bands[width] = _Band(self, width)
        return self._bands[width]


class _Band:
    """Stages [i, j) with 0 < j - i <= width as (L+1) x width matrices indexed by the end j
    and c = i - (j - width), i.e. starts in ascending order (inf where i < 0). The DPs below
    over the band equal those over the full matrices whenever every stage they may pick lies
    in it: the entries are the same subtractions of the same prefix sums."""

    def __init__(self, ranges: _Ranges, width: int):
        self.size, self.width = ranges.size, width
        ends = np.arange(ranges.size)[:, None]
        starts = ends - width + np.arange(width)[None, :]
        inside = starts >= 0
        self.starts = np.where(inside, starts, 0)
        self.rows = np.arange(ranges.size)
        sums = {}
        for name, prefix in ranges.prefix.items():
            sums[name] = np.where(inside, prefix[ends] - prefix[self.starts], np.inf)
        self.tau, self.act, self.state = sums["tau"], sums["act"], sums["state"]
        self._held: dict[int, np.ndarray] = {}
        self._most: dict[int, float] = {}

    def held(self, inflight: int) -> np.ndarray:
        """Bytes each stage holds with `inflight` micro-batches in flight (computed once per
        count: the DPs of one search ask for the same few counts many times)."""
        if inflight not in self._held:
            self._held[inflight] = self.state + inflight * self.act
        return self._held[inflight]

    def allowed(self, matrix: np.ndarray, inflight: int, budget: float) -> np.ndarray:
        """`matrix` where the stage fits `budget` with `inflight` micro-batches, inf elsewhere."""
        if budget >= self.most_held(inflight):
            return matrix
        return np.where(self.held(inflight) <= budget, matrix, np.inf)

    def most_held(self, inflight: int) -> float:
        """The most bytes a stage of the band holds with `inflight` micro-batches in flight
        (once per count): a budget at least that rules nothing out."""
        if inflight not in self._most:
            held = self.held(inflight)
            self._most[inflight] = float(held[np.isfinite(held)].max(initial=-math.inf))
        return self._most[inflight]

    def cut(self, num: int, cost_of: Callable[[int], np.ndarray], minimax: bool
            ) -> tuple[list[tuple[int, int]] | None, float]:
        """The cut into `num` stages least in max_s (minimax) or sum_s of cost(s, i_s, i_{s+1})
        and that least value (None, inf if every cut costs inf). cost_of(s) gives stage s's
        costs over the band, inf where stage s may not be [i, j). Backtracking takes the
        smallest start among equal values, so later stages take the extra layers."""
        best = np.full(self.size, np.inf)
        best[0] = 0.0
        picks = []
        for s in range(num):
            cand = best[self.starts]
            cost = cost_of(s)
            cand = np.maximum(cand, cost) if minimax else cand + cost
            pick = cand.argmin(axis=1)
            best = cand[self.rows, pick]  # faster than min(axis=1) on these small arrays
            picks.append(pick)
        value = float(best[-1])
        if not math.isfinite(value):
            return None, value
        cut, end = [], self.size - 1
        for pick in reversed(picks):
            start = end - self.width + int(pick[end])
            cut.append((start, end))
            end = start
        return cut[::-1], value


def _fastest(ranges: _Ranges, inflight: tuple[int, ...], budgets: list[float]
             ) -> list[tuple[int, int]] | None:
    """Step 1: a cut of least bottleneck tau with stage s within budgets[s]. With a finite
    `ranges.cap` the band of stages up to it is searched first: a least bottleneck <= cap
    uses only stages of tau <= cap, all in the band, so it is the answer; otherwise the
    whole matrix is."""
    for bound in ((ranges.cap, math.inf) if math.isfinite(ranges.cap) else (math.inf,)):
        band = ranges.band(bound)
        cut, value = band.cut(
            len(inflight), lambda s: band.allowed(band.tau, inflight[s], budgets[s]),
            minimax=True)
        if value <= bound:
            return cut
    return None


def _solve(ranges: _Ranges, inflight: tuple[int, ...], budgets: list[float]
           ) -> list[tuple[int, int]] | None:
    """Step 1 (least bottleneck tau*) then step 2 (least sum tau^2 with every tau <= tau*);
    memoised on `ranges` per (in-flight counts, budgets): pass 2 asks for some splits again."""
    key = (inflight, tuple(budgets))
    if key not in ranges.solved:
        ranges.solved[key] = _solve_once(ranges, inflight, budgets)
    cut = ranges.solved[key]
    return None if cut is None else list(cut)


def _solve_once(ranges: _Ranges, inflight: tuple[int, ...], budgets: list[float]
                ) -> list[tuple[int, int]] | None:
    fastest = _fastest(ranges, inflight, budgets)
    if fastest is None:
        return None
    bound = _bottleneck(ranges, fastest)
    band = ranges.band(bound)  # every stage of tau <= tau*
    square = np.where(band.tau <= bound, band.tau * band.tau, np.inf)
    even, _ = band.cut(len(inflight), lambda s: band.allowed(square, inflight[s], budgets[s]),
                       minimax=False)
    assert even is not None, "the bottleneck bound admits the fastest cut"
    return even


def _least_memory_cut(ranges: _Ranges, inflight: tuple[int, ...], extra: list[float],
                      bound: float = math.inf) -> list[tuple[int, int]] | None:
    """The cut least in max over stages of (what stage s holds + extra[s]), every tau <= bound."""
    band = ranges.band(bound)
    slow = np.where(band.tau <= bound, 0.0, np.inf)
    cut, _ = band.cut(len(inflight), lambda s: band.held(inflight[s]) + (slow + extra[s]),
                      minimax=True)
    return cut


def _bottleneck(ranges: _Ranges, cut: list[tuple[int, int]]) -> float:
    return max(ranges.tau_of(i, j) for i, j in cut)
