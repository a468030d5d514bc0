"""Lower bounds over a config table in one mesh order, which prune and order the outer search.

The column forms of the one-config bounds (`autopar.estimate.bounds`) that
`autopar.search.outer` visits its configs by. They are column arithmetic on the table
(`autopar.search.space`): the memory bound of model states alone and the step-time bound over
every row, the first pipeline rank's memory over the rows the visit reaches
(`_Bounds.cannot_fit`, asked as it goes). The step-time bound is `step_lower_bound`: the
schedule's closed form on the work of each pipeline rank alone, no communication outside it.
Per-unit work is formed once per (micro-batch, tp, cp, ep, SP, recompute) -- outside the
default mesh order also per layout of the tp, cp and ep groups on the nodes -- and per-rank
work once per pipeline split of that. Without communication the step bound holds in every mesh
order. A config whose first pipeline rank alone exceeds memory (`space.first_rank_memory`)
cannot fit; that bound sums in another order than the estimate and is compared with a margin
(`BOUND_MARGIN`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from autopar.config import DEFAULT_MESH_ORDER, ParallelConfig
from autopar.estimate.bounds import BOUND_MARGIN, step_lower_bound, unit_work
from autopar.estimate.core import EvalCache, ModelCosts, order_key, split_structure
from autopar.estimate.layout import Structure, rank_work_extremes
from autopar.estimate.memory import activation_bytes, keeps_fp8_copies, keeps_weight_copies
from autopar.errors import InvalidConfigError
from autopar.search.context import SearchContext
from autopar.search.space import (TIME_KEY_COLUMNS, ConfigTable, first_rank_memory, key_groups,
                                  states_lower_bounds, step_lower_bounds)

__all__: list[str] = []  # the search's internals: outer imports them by name


@dataclass(frozen=True)
class _Bounds:
    """The table after the two memory bounds and with the step-time bound: `rows` (table
    rows) that model states alone do not rule out, their step bounds and busiest pipeline
    rank's work per micro-batch, which of them cannot fit by the first rank's memory; the
    count pruned by states and the one with the least states (for the error when nothing
    fits); rejections found computing the bounds."""

    rows: np.ndarray
    step: np.ndarray
    work: np.ndarray
    cannot_fit: Callable[[np.ndarray], np.ndarray]
    pruned: int
    smallest: tuple[float, ParallelConfig] | None
    errors: tuple[str, ...]


def _bounds(ctx: SearchContext, table: ConfigTable) -> _Bounds:
    costs, cluster, options, dtype = ctx.costs, ctx.cluster, ctx.options, ctx.dtype
    usable = cluster.hardware.device.memory_bytes
    states = states_lower_bounds(
        table, dense_params=sum(u.dense_params * u.count for u in costs.units),
        expert_params=sum(u.expert_params * u.count for u in costs.units), dtype=dtype,
        fp32_params=options.fp32_params)
    over = states > usable
    smallest = None
    if over.any():  # the first config (in enumeration order) with the least states
        i = int(np.flatnonzero(over)[np.argmin(states[over])])
        smallest = (float(states[i]), table.config(i))
    rows = np.flatnonzero(~over)
    step, failed, work = _step_bounds(ctx, table, rows)
    errors = []
    for i in rows[failed]:
        cfg = table.config(int(i))
        try:
            step_lower_bound(costs, cluster, cfg, global_batch_size=ctx.global_batch_size,
                             dtype=dtype, options=options, cache=ctx.cache)
        except InvalidConfigError as exc:
            errors.append(f"{cfg.short()}: {exc}")
    rows, step, work = rows[~failed], step[~failed], work[~failed]
    first_rank = functools.partial(
        first_rank_memory, table, units=ctx.cache.units,
        structure_of=functools.partial(_split, costs, ctx.cache),
        activations_of=lambda unit, cfg, flash: activation_bytes(
            unit, cfg, flash, options.loss_kernel,
            weight_copies=keeps_weight_copies(cfg, dtype, options.fp32_params),
            fp8=keeps_fp8_copies(dtype, options.fp32_params, options.fp8_recipe)),
        dtype=dtype, global_batch_size=ctx.global_batch_size, options=options, memo={})

    def cannot_fit(at: np.ndarray) -> np.ndarray:
        # a small margin covers the bound summing in another order than the estimate
        return first_rank(rows[at]) * (1 - BOUND_MARGIN) > usable

    return _Bounds(rows=rows, step=step, work=work, cannot_fit=cannot_fit,
                   pruned=int(over.sum()), smallest=smallest, errors=tuple(errors))


def _step_bounds(ctx: SearchContext, table: ConfigTable, rows: np.ndarray, *, comm: bool = True
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`step_lower_bound` of each of `rows`, a mask of the rows whose unit times or
    pipeline split could not be made (NaN bound), and each row's busiest pipeline rank's
    forward + backward seconds of one micro-batch. Per-unit work is computed once per
    (micro-batch, tp, cp, ep, SP, recompute), for the first row with that key; per-rank work
    once per (pipeline split, that key). Without `comm` the work leaves communication out
    (`unit_work`): bounds that hold in every mesh order. `ctx.cache` memoises the work."""
    if not len(rows):
        return np.zeros(0), np.zeros(0, dtype=bool), np.zeros(0)
    costs, cache = ctx.costs, ctx.cache
    if table.mesh_order == DEFAULT_MESH_ORDER or not comm:
        first, inverse = key_groups(table, rows, TIME_KEY_COLUMNS)
    else:  # there the tp, cp and ep groups can differ for the same degrees
        first, inverse = key_groups(_with_layouts(table, rows, cache), rows,
                                    TIME_KEY_COLUMNS + ("layouts",))
    work = np.full((len(first), len(costs.units)), np.nan)
    tail = work.copy()
    for k in np.argsort(first, kind="stable"):
        try:
            work[k], tail[k] = unit_work(costs, cache, table.config(int(rows[first[k]])),
                                         ctx.dtype, ctx.options, comm)
        except InvalidConfigError:
            pass
    s_first, s_index = key_groups(table, rows, ("pp", "virtual_stages"))
    busiest, total, longest = (np.full((len(s_first), len(first)), np.nan) for _ in range(3))
    pp, v = table.columns["pp"][rows], table.columns["virtual_stages"][rows]
    splits = {k: _split(costs, cache, int(pp[i]), int(v[i])) for k, i in enumerate(s_first)}
    made = [k for k, split in splits.items() if split is not None]
    if made:  # every split at once
        made_splits = [splits[k] for k in made]
        busiest[made], total[made] = rank_work_extremes(made_splits, work)
        longest[made] = rank_work_extremes(made_splits, tail)[0]
    at = (s_index, inverse)
    row_busiest = busiest[at]
    return step_lower_bounds(table, rows, row_busiest, total[at], longest[at],
                             global_batch_size=ctx.global_batch_size), np.isnan(row_busiest), \
        row_busiest


def _with_layouts(table: ConfigTable, rows: np.ndarray, cache: EvalCache) -> ConfigTable:
    """`table` with a column "layouts" that tells apart, at `rows` (not empty), the configs
    whose tp, cp and ep groups lie differently on the nodes (`order_key`): what per-unit
    times depend on besides `TIME_KEY_COLUMNS` outside the default mesh order."""
    first, index = key_groups(table, rows, ("dp", "tp", "pp", "cp", "ep", "etp"))
    classes: dict[tuple, int] = {}
    ids = np.array([classes.setdefault(order_key(cache, table.config(int(rows[i]))),
                                       len(classes)) for i in first])
    column = np.zeros(len(table), dtype=np.int64)
    column[rows] = ids[index]
    return replace(table, columns={**table.columns, "layouts": column})


def _split(costs: ModelCosts, cache: EvalCache, pp: int, v: int) -> Structure | None:
    """The Megatron split of the layers on pp x v chunks; None if it cannot be made (more
    chunks than layers: `evaluate` refuses such a config)."""
    split = split_structure(costs, cache, pp, v)
    return None if isinstance(split, str) else split
