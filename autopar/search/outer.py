"""Outer enumeration of the 5-D space, ranked by predicted step time.

Every config with dp·tp·pp·cp = world size is considered, with ep dividing dp·cp (and the
expert count), ZeRO 0-3, sequence parallelism on/off, recompute none/selective/per_op/full
(full on every block or on one in k), micro-batch sizes, pipeline schedules and virtual
stages. Tensor parallelism is at most a node; a tp that does not divide the node leaves some
groups straddling two, and the estimate
costs every axis on its slowest group (`autopar.estimate.groups.slowest_groups`). The mesh
order (`ParallelConfig.mesh_order`: how the pp, dp, cp, tp mesh lies on the ranks, rank r on
node r // g) is pp, dp, cp, tp (tp innermost) unless pinned or `SearchSettings.mesh_orders`
asks for more. Then the space is each config once per placement of its ranks -- the layouts
of the groups its estimate costs (`placement_key`), in the first order giving them -- and one
top k is taken over all of it: the orders are visited one after another, the default first,
each visit stopping at the k-th best time found so far in any order, and before a later
order's visit a config whose step bound without communication (a bound in every order)
exceeds that time is dropped. On one node every order places ranks alike: the first alone is
searched.

Cost: the model is traced once; the space is a table of integer columns
(`autopar.search.space`) and the lower bounds below are column arithmetic
(`autopar.search.bounds`), so a config becomes a `ParallelConfig` only when it is evaluated.
Per-unit times are cached per (micro-batch, tp, cp, ep, SP, recompute), layouts per stage split
of those, and collective times per (kind, bytes, group), so an evaluation costs a few sums.
Each config is first checked against a memory lower bound (model states alone); the rest are
visited in order of a step-time lower bound (`step_lower_bound`; when a config's turn comes its
bound is raised by what its data-parallel traffic and optimizer step cost at least,
`data_parallel_floor`, and it goes back in line) and ranked with the closed-form pipeline
estimate, stopping once the bound exceeds the `top_k_exact`-th best fitting time -- no config
skipped then could have entered the top k, so the result is the same as evaluating all. A
visited config whose first pipeline rank alone exceeds memory is passed over: it cannot fit, so
it changes neither the fitting times the stop depends on nor the ranking; it only has no row in
the candidate table (see `SearchSettings.list_unfit_below`). The top k are candidates for the
simulated schedule, visited in order of a bound on their simulated step
(`exact_step_lower_bound`: each rank's work plus the fill before and the drain after it, no
simulation) and simulated until that bound exceeds the best fitting simulated time; the winner
is the fastest simulated one that fits -- the one simulating all k would pick, since a skipped
config is slower than it. The candidate table marks the simulated rows `exact=True`; a top-k
config skipped keeps its closed-form row (`exact=False`). Ties (equal step time to 1e-12 s) go
to the simpler config: the fields compared in the order (pp, tp, cp, ep, dp, zero_stage,
recompute, recompute_every, micro_batch_size, pp_schedule, virtual_stages, sequence_parallel),
smaller first, then the mesh order (the default, then the others as itertools.permutations
lists them) -- so DDP beats ZeRO when they cost the same, and the same input always gives the
same plan.
"""
from __future__ import annotations

import bisect
import heapq
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from costmodels.compute import peak_flops
from autopar.cluster import Cluster
from autopar.config import PP_SCHEDULES, RECOMPUTE_POLICIES, ParallelConfig
from autopar.errors import InvalidConfigError, NoPlanFitsError, PlanningError
from autopar.estimate.bounds import (BOUND_MARGIN, DataParallelFloor, data_parallel_floor,
                                     exact_step_lower_bound)
from autopar.estimate.core import (Estimate, EstimateOptions, EvalCache, ModelCosts, evaluate,
                                   placement_key)
from autopar.search.bounds import _bounds, _Bounds, _step_bounds
from autopar.search.candidates import enumerate_configs, space_table, why_empty
from autopar.search.context import SearchContext
from autopar.search.settings import (CONFIG_FIELDS, ORDER_RANK, SearchSettings,
                                     check_constraints, mesh_orders)
from autopar.search.space import ConfigTable, key_groups
from autopar.targets import AUTOPAR, EngineTarget, Facts

log = logging.getLogger(__name__)

__all__ = ["SearchSettings", "SearchResult", "search", "enumerate_configs", "CONFIG_FIELDS"]

_TIE_ORDER = ("pp", "tp", "cp", "ep", "dp", "zero_stage", "recompute", "recompute_every",
              "micro_batch_size", "pp_schedule", "virtual_stages", "sequence_parallel", "etp")
@dataclass(frozen=True, kw_only=True)
class SearchResult:
    best: Estimate
    candidates: pd.DataFrame
    num_considered: int  # configs (each in up to 24 mesh orders)
    # configs, in each mesh order searched, passed over as unable to fit / by a step bound
    num_pruned_by_memory: int
    num_pruned_by_bound: int
    num_simulated: int  # of the top_k_exact: those not skipped by the simulated-time bound
    seconds: float


def _tie_key(cfg: ParallelConfig) -> tuple:
    return tuple(RECOMPUTE_POLICIES.index(cfg.recompute) if f == "recompute" else
                 PP_SCHEDULES.index(cfg.pp_schedule) if f == "pp_schedule" else
                 getattr(cfg, f) for f in _TIE_ORDER) + (ORDER_RANK[cfg.mesh_order],)


def _rank_key(est: Estimate) -> tuple:
    return (round(est.step_time_s, 12), _tie_key(est.config))


def _row(est: Estimate, exact: bool) -> dict[str, Any]:
    row = {f: getattr(est.config, f) for f in CONFIG_FIELDS}
    row.update(step_time_s=est.step_time_s, exact=exact, peak_memory_gb=est.peak_memory_bytes / 1e9,
               fits=est.fits, mfu=est.mfu, tokens_per_s=est.tokens_per_s,
               **{f"t_{k}": v for k, v in est.breakdown.items()
                  if k not in ("dp_comm_total", "pp_p2p_per_transfer")})
    return row


class _Progress:
    """A transient progress bar that appears only once the search has run for a second."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.start, self.bar, self.task = enabled, time.perf_counter(), None, None

    def tick(self, done: int, total: int | None = None) -> None:
        if not self.enabled or time.perf_counter() - self.start < 1.0:
            return
        if self.bar is None:
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("autopar: searching configs", total=total)
        self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def search(costs: ModelCosts, cluster: Cluster, *, global_batch_size: int, dtype: str,
           constraints: dict[str, Any] | None = None,
           options: EstimateOptions = EstimateOptions(),
           settings: SearchSettings = SearchSettings(),
           cache: EvalCache | None = None, target: EngineTarget = AUTOPAR) -> SearchResult:
    """The fastest fitting config of the space (see the module docstring) that `target` runs
    (`autopar.targets`: its rules mask the rows of the space, in each mesh order). `cache`, an
    `EvalCache` of this model and cluster that the caller keeps, lets the work that follows
    the search (re-cutting the winner's stages, its layer costs) reuse the search's unit
    times and collective times."""
    constraints = check_constraints(constraints)
    # a precision the device cannot compute in rules out every config alike: say so at once
    # rather than as the first of tens of thousands of rejections
    peak_flops(cluster.hardware.device, dtype)
    start = time.perf_counter()
    ctx = SearchContext(costs=costs, cluster=cluster, global_batch_size=global_batch_size,
                        dtype=dtype, options=options, settings=settings, target=target,
                        cache=EvalCache(cluster) if cache is None else cache)
    orders = ([constraints["mesh_order"]] if "mesh_order" in constraints
              else mesh_orders(settings.mesh_orders))
    if cluster.num_nodes == 1:  # every group of n ranks lies alike in one node
        orders = orders[:1]
    # the configs are the same in every order: one table, relabelled per order
    every = space_table(costs, cluster, global_batch_size=global_batch_size,
                   constraints=constraints, options=options, settings=settings, target=target)
    facts = Facts.of(costs, dtype, options)
    if target.restricts and len(every):
        target.check(constraints, facts)
        keep = target.allows(every, facts)
        if not keep.any():
            raise InvalidConfigError(
                f"no configuration satisfies the constraints {constraints} on "
                f"{cluster.world_size} GPUs: {target.why_empty(every, facts)}")
        every = every.rows(keep)
    progress = _Progress(settings.progress)
    best_times: list[float] = []  # the top_k_exact fastest fitting closed-form times so far
    free = None  # each config's step bound without communication: a bound in every order
    placed: dict[tuple, tuple] = {}
    found, dropped = [], 0
    for k, order in enumerate(orders):
        table = replace(every, mesh_order=order)
        if k and len(best_times) == settings.top_k_exact:
            # a config whose bound without communication exceeds the k-th best time cannot
            # enter the top k in any order
            if free is None:
                free, _, _ = _step_bounds(ctx, every, np.arange(len(every)), comm=False)
            table = table.rows(~(free * (1 - BOUND_MARGIN) > best_times[-1]))
            dropped += len(every) - len(table)
        if target.restricts and order != every.mesh_order:  # rules may read the order
            keep = target.allows(table, facts)
            if not k and not keep.any():
                raise InvalidConfigError(
                    f"no configuration satisfies the constraints {constraints} on "
                    f"{cluster.world_size} GPUs in mesh order {','.join(order)}: "
                    f"{target.why_empty(table, facts)}")
            table = table.rows(keep)
        # each config once per placement of its ranks: in the first order giving it
        table = _new_placements(table, orders[:k], ctx.cache, placed)
        if k and not len(table):
            continue
        try:
            found.append(_collect(ctx, table, best_times, constraints=constraints,
                                  progress=progress))
        except PlanningError as exc:
            if not k:  # the first order's space is every config: its error is the search's
                raise
            # a later order's configs are some of those: none of them fits or runs
            log.debug("mesh order %s: %s", ",".join(order), exc)
    progress.close()
    result = _finish(ctx, found, num_considered=len(every))
    result = replace(result, num_pruned_by_bound=result.num_pruned_by_bound + dropped)
    log.info("searched %d configs in %d mesh order(s) (%d pruned by memory, %d by the "
             "step-time bound) in %.2f s", len(every), len(found),
             result.num_pruned_by_memory, result.num_pruned_by_bound,
             time.perf_counter() - start)
    return replace(result, seconds=time.perf_counter() - start)


def _new_placements(table: ConfigTable, earlier: list[tuple[str, ...]], cache: EvalCache,
                    placed: dict[tuple, tuple]) -> ConfigTable:
    """The rows of `table` that no order of `earlier` places alike: whose `placement_key`
    (what the estimate takes from the order) differs in each of them. `placed` memoises the
    keys per (degrees, order)."""
    if not len(table) or not earlier:
        return table
    first, index = key_groups(table, np.arange(len(table)),
                              ("dp", "tp", "pp", "cp", "ep", "etp"))
    new = np.zeros(len(first), dtype=bool)
    for k, i in enumerate(first):
        cfg = table.config(int(i))
        degrees = (cfg.dp, cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.etp)

        def key(order: tuple[str, ...]) -> tuple:
            found = placed.get((degrees, order))
            if found is None:
                found = placed[degrees, order] = placement_key(
                    cache, replace(cfg, mesh_order=order))
            return found

        mine = key(table.mesh_order)
        new[k] = all(key(o) != mine for o in earlier)
    return table.rows(new[index])


@dataclass(frozen=True)
class _Found:
    """What the visit of one mesh order's configs found (`_collect`)."""

    fast: list[Estimate]  # closed-form estimates, fitting or not
    pruned: int  # by memory: model states alone, or the first rank
    smallest: tuple[float, ParallelConfig] | None  # the least model states over memory
    skipped: int  # by the step-time bound


def _collect(ctx: SearchContext, table: ConfigTable, best_times: list[float], *,
             constraints: dict[str, Any], progress: _Progress) -> _Found:
    """The closed-form estimates of the configs of `table` (all in one mesh order) that can
    enter the top `top_k_exact` by time, `best_times` (the fastest fitting times found in
    the orders before, updated) included."""
    b = _bounds(ctx, table)
    visiting = _Visiting(table=table, bounds=b, order=_VisitOrder(b.step, table.tie_order(),
                                                                    b.rows), done={})
    before = list(best_times)
    fast, eval_errors, skipped, unfit = _visit(ctx, visiting, best_times, progress,
                                               check_fit=True)
    if unfit and sum(e.fits for e in fast) < ctx.settings.list_unfit_below:
        best_times[:] = before  # list the near misses too
        fast, eval_errors, skipped, unfit = _visit(ctx, visiting, best_times, progress,
                                                   check_fit=False)
    errors = list(b.errors) + eval_errors
    if not len(table) or (not fast and errors and not b.pruned):
        detail = f" (first rejection: {errors[0]})" if errors else ""
        if not len(table):
            detail = why_empty(ctx.costs, ctx.cluster, global_batch_size=ctx.global_batch_size,
                               constraints=constraints, options=ctx.options,
                               settings=ctx.settings, target=ctx.target)
        raise InvalidConfigError(f"no configuration satisfies the constraints {constraints} "
                                 f"on {ctx.cluster.world_size} GPUs{detail}")
    return _Found(fast=fast, pruned=b.pruned + unfit, smallest=b.smallest, skipped=skipped)


def _finish(ctx: SearchContext, found: list[_Found], *, num_considered: int) -> SearchResult:
    """The search's result from the visits of its mesh orders: the `top_k_exact` fastest
    fitting configs simulated, the fastest of those the winner."""
    fast = [e for f in found for e in f.fast]
    fitting = sorted((e for e in fast if e.fits), key=_rank_key)
    if not fitting:
        smallest = min((f.smallest for f in found if f.smallest is not None),
                       key=lambda s: s[0], default=None)
        raise _no_fit(fast, smallest, ctx.cluster.hardware.device.memory_bytes)
    exact = _simulate_best(ctx.costs, ctx.cluster, fitting[:ctx.settings.top_k_exact],
                           global_batch_size=ctx.global_batch_size, dtype=ctx.dtype,
                           options=ctx.options, cache=ctx.cache)
    best = min((e for e in exact if e.fits), key=_rank_key, default=None)
    if best is None:  # the simulated schedule holds more in flight than the closed form
        best = min(exact, key=lambda e: e.peak_memory_bytes)
        log.warning("the %d best configs exceed memory once simulated; returning %s",
                    len(exact), best.config.short())
    exact_cfgs = {e.config for e in exact}
    records = [_row(e, False) for e in fast if e.config not in exact_cfgs] + \
        [_row(e, True) for e in exact]
    candidates = pd.DataFrame(records).sort_values(
        ["fits", "step_time_s"], ascending=[False, True], kind="mergesort").reset_index(drop=True)
    return SearchResult(best=best, candidates=candidates, num_considered=num_considered,
                        num_pruned_by_memory=sum(f.pruned for f in found),
                        num_pruned_by_bound=sum(f.skipped for f in found),
                        num_simulated=len(exact), seconds=0.0)  # `search` sets the time


def _simulate_best(costs: ModelCosts, cluster: Cluster, top: list[Estimate], *,
                   global_batch_size: int, dtype: str, options: EstimateOptions,
                   cache: EvalCache) -> list[Estimate]:
    """The simulated estimates of those of `top` that could win: visited in order of
    `exact_step_lower_bound` (then the tie key), stopping once the bound, less a margin for
    rounding, exceeds the best fitting simulated time -- a config skipped then is slower once
    simulated than one already simulated, so the winner is the one simulating all of `top`
    would pick. Returned in the order of `top`."""
    bounds = [exact_step_lower_bound(costs, cluster, e.config,
                                     global_batch_size=global_batch_size, dtype=dtype,
                                     options=options, cache=cache) for e in top]
    order = sorted(range(len(top)), key=lambda i: (bounds[i], _tie_key(top[i].config)))
    exact: dict[int, Estimate] = {}
    best: Estimate | None = None
    for i in order:
        if best is not None and \
                round(bounds[i] * (1 - BOUND_MARGIN), 12) > _rank_key(best)[0]:
            break
        est = exact[i] = evaluate(costs, cluster, top[i].config,
                                  global_batch_size=global_batch_size, dtype=dtype,
                                  options=options, cache=cache, exact=True)
        if est.fits and (best is None or _rank_key(est) < _rank_key(best)):
            best = est
    return [exact[i] for i in sorted(exact)]


class _VisitOrder:
    """Positions of the search's rows in the order (step bound, tie key), sorted a prefix at a
    time: a search stops after a few dozen of tens of thousands. A prefix holds every row whose
    bound is at most its last bound, sorted as one lexsort of all rows would (ties on every
    key keep row order), so the prefixes join into that order. The tie columns are the whole
    table's, read at `rows` (position i is table row rows[i]) only for the rows a prefix
    takes."""

    def __init__(self, step: np.ndarray, ties: tuple[np.ndarray, ...], rows: np.ndarray
                 ) -> None:
        self.step, self.ties, self.rows = step, ties, rows  # ties most significant first
        self.sorted = np.zeros(0, dtype=np.int64)
        self.rest = np.arange(len(step))  # rows not yet in `sorted`, ascending

    def __len__(self) -> int:
        return len(self.step)

    def upto(self, n: int) -> np.ndarray:
        """The order's first min(n, len) positions (or more)."""
        while len(self.sorted) < min(n, len(self.step)):
            want = max(n - len(self.sorted), len(self.sorted), 1024)
            rest = self.rest
            if want >= len(rest):
                take, self.rest = rest, rest[:0]
            else:
                kth = np.partition(self.step[rest], want - 1)[want - 1]
                inside = self.step[rest] <= kth
                take, self.rest = rest[inside], rest[~inside]
            # lexsort's last key is the primary one
            at = self.rows[take]
            keys = tuple(col[at] for col in reversed(self.ties)) + (self.step[take],)
            self.sorted = np.concatenate((self.sorted, take[np.lexsort(keys)]))
        return self.sorted


@dataclass(frozen=True)
class _Visiting:
    """One mesh order's configs as `_collect` visits them, once or twice."""

    table: ConfigTable
    bounds: _Bounds  # `_bounds` of the table: the rows visited, their step bounds and work
    order: _VisitOrder  # positions in `bounds.rows` by (step bound, tie key)
    done: dict[int, Estimate | InvalidConfigError]  # evaluations by position, across visits


def _visit(ctx: SearchContext, at: _Visiting, best_times: list[float], progress: _Progress, *,
           check_fit: bool) -> tuple[list[Estimate], list[str], int, int]:
    """Evaluate configs in bound order until the bound exceeds the `top_k_exact`-th best fitting
    time (`best_times`: the fastest fitting closed-form times, ascending, of this visit and of
    the mesh orders searched before it; updated); with `check_fit`, configs that
    `at.bounds.cannot_fit` flags (asked for the next configs in order, in growing batches, as
    the visit reaches them) are passed over without an evaluation (they cannot fit, so they
    never change the fitting times the stop depends on: the stop comes at the same config
    either way). A config's bound is raised, when its turn comes, by what its data-parallel
    traffic and optimizer step cost at least (`data_parallel_floor`, the traffic less its
    work, the busiest rank's forward + backward of a micro-batch, where compute may hide it)
    and the config goes back in line at the raised bound (lazy A*-style): the visit stays in
    bound order, so the stop stays exact. Returns (estimates in visit order, errors, configs
    left after the stop, configs passed over as unable to fit). `at.done` memoises
    evaluations across calls."""
    costs, table, settings = ctx.costs, at.table, ctx.settings
    rows, bounds, work = at.bounds.rows, at.bounds.step, at.bounds.work
    visit_order, done = at.order, at.done
    cannot_fit = at.bounds.cannot_fit if check_fit else None
    fast: list[Estimate] = []
    errors: list[str] = []
    unfit = 0
    # what a floor depends on besides the micro-batch size (the split only with experts)
    by = ("dp", "tp", "cp", "pp", "ep", "etp", "zero_stage") + \
        (("virtual_stages",) if any(u.expert_params for u in costs.units) else ())
    floor_columns = [table.columns[name] for name in ("micro_batch_size",) + by]
    floors: dict[tuple, DataParallelFloor | None] = {}
    deferred: list[tuple[float, int, int]] = []  # (raised bound, place in order, row)
    unfit_flags = np.zeros(len(rows), dtype=bool)
    known, batch = 0, 256  # cannot_fit asked for order[:known]
    total = len(visit_order)
    order = visit_order.upto(batch)
    i = visited = 0
    while i < total or deferred:
        if visited % 256 == 0:
            progress.tick(visited, total)
        visited += 1
        if i == len(order) < total:
            order = visit_order.upto(i + 1)
        if deferred and (i == total or deferred[0][:2] < (bounds[order[i]], i)):
            bound, _, j = heapq.heappop(deferred)
            raised = True
        else:
            j, i, raised = order[i], i + 1, False
            bound = bounds[j]
        if len(best_times) == settings.top_k_exact and bound > best_times[-1]:
            return fast, errors, total - i + len(deferred) + 1, unfit
        if cannot_fit is not None and i > known:  # j is order[i - 1]
            order = visit_order.upto(known + batch)
            ask = order[known:known + batch]
            unfit_flags[ask] = cannot_fit(ask)
            known, batch = known + len(ask), 2 * batch
        if unfit_flags[j]:
            unfit += 1
            continue
        if j not in done:
            row = int(rows[j])
            if not raised:  # read the columns: configs whose floor is high go back in line
                mbs, *key = (int(c[row]) for c in floor_columns)
                key = tuple(key)
                if key not in floors:
                    try:
                        floors[key] = data_parallel_floor(costs, ctx.cache, table.config(row),
                                                          ctx.dtype, ctx.options)
                    except InvalidConfigError:  # the evaluation says why
                        floors[key] = None
                floor = floors[key]
                if floor is not None:
                    m = ctx.global_batch_size // (key[0] * mbs)
                    gap = floor.exposed_and_optimizer(float(work[j]), m) * (1 - BOUND_MARGIN)
                    if gap > 0:
                        heapq.heappush(deferred, (bound + gap, i, j))
                        continue
            cfg = table.config(row)
            try:
                done[j] = evaluate(costs, ctx.cluster, cfg,
                                   global_batch_size=ctx.global_batch_size, dtype=ctx.dtype,
                                   options=ctx.options, cache=ctx.cache, exact=False)
            except InvalidConfigError as exc:  # a divisibility the enumeration let by
                done[j] = InvalidConfigError(f"{cfg.short()}: {exc}")
        est = done[j]
        if isinstance(est, InvalidConfigError):
            errors.append(str(est))
            continue
        fast.append(est)
        if est.fits:
            bisect.insort(best_times, est.step_time_s)
            del best_times[settings.top_k_exact:]
    return fast, errors, 0, unfit


def _no_fit(fast: list[Estimate], smallest: tuple[float, ParallelConfig] | None,
            usable: float) -> NoPlanFitsError:
    """The error when nothing fits `usable` bytes: the least footprint among the estimates
    `fast`, or, with none, the least model states alone (`smallest`)."""
    best = min(fast, key=lambda e: e.peak_memory_bytes, default=None)
    if best is None and smallest is not None:
        peak, cfg = smallest
        how = f"(model states alone) with {cfg.short()}"
    else:
        peak, how = best.peak_memory_bytes, f"with {best.config.short()}"
    return NoPlanFitsError(
        f"no plan fits: the smallest per-GPU footprint is {peak / 1e9:.1f} GB {how}; the device "
        f"has {usable / 1e9:.1f} GB. Try more GPUs (num_nodes), a smaller global batch or "
        f"sequence, or a device with more memory")
