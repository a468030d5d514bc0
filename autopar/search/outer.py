"""Outer enumeration of the 5-D space, ranked by predicted step time.

Every config with dp·tp·pp·cp = world size is considered, with ep dividing dp·cp (and the
expert count), ZeRO 0-3, sequence parallelism on/off, recompute none/selective/full,
micro-batch sizes, pipeline schedules and virtual stages. Tensor parallelism stays inside a
node (the mesh order is pp, dp, cp, tp with tp innermost; rank r lives on node r // g).

Cost: the model is traced once; per-unit times are cached per (micro-batch, tp, cp, ep, SP,
recompute) and collective times per (kind, bytes, group), so a config costs a few sums. Each
config is first checked against a memory lower bound (model states alone); the rest are
visited in order of a step-time lower bound (`step_lower_bound`: all work spread evenly over
the pipeline ranks) and ranked with the closed-form pipeline estimate, stopping once the bound
exceeds the `top_k_exact`-th best fitting time -- no config skipped then could have entered
the top k, so the result is the same as evaluating all. The top k are re-estimated with the
simulated schedule and the winner is the fastest of those that fits. Ties (equal step time to 1e-12 s)
go to the simpler config: the fields compared in the order (pp, tp, cp, ep, dp, zero_stage,
recompute, micro_batch_size, pp_schedule, virtual_stages, sequence_parallel), smaller first
-- so DDP beats ZeRO when they cost the same, and the same input always gives the same plan.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields
from typing import Any, Iterator

import pandas as pd

from autopar.cluster import Cluster
from autopar.config import PP_SCHEDULES, ParallelConfig, divisors
from autopar.errors import NoPlanFitsError
from autopar.estimate.core import (Estimate, EstimateOptions, EvalCache, ModelCosts, evaluate,
                                   step_lower_bound)
from costmodels.memory import (COMM_BUFFER_BYTES, CUDA_CONTEXT_BYTES, state_bytes_per_param)

log = logging.getLogger(__name__)

__all__ = ["SearchSettings", "SearchResult", "search", "enumerate_configs", "CONFIG_FIELDS"]

CONFIG_FIELDS = tuple(f.name for f in fields(ParallelConfig))
_TIE_ORDER = ("pp", "tp", "cp", "ep", "dp", "zero_stage", "recompute", "micro_batch_size",
              "pp_schedule", "virtual_stages", "sequence_parallel")
_RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2}


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSettings:
    top_k_exact: int = 16  # candidates re-estimated with the simulated schedule
    max_micro_batch_size: int = 32
    max_virtual_stages: int = 8
    max_cp: int = 16
    progress: bool = True  # a progress bar once a search has run for a second


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    best: Estimate
    candidates: pd.DataFrame
    num_considered: int
    num_pruned_by_memory: int
    num_pruned_by_bound: int
    seconds: float


def _tie_key(cfg: ParallelConfig) -> tuple:
    return tuple(_RECOMPUTE_ORDER[cfg.recompute] if f == "recompute" else
                 PP_SCHEDULES.index(cfg.pp_schedule) if f == "pp_schedule" else
                 getattr(cfg, f) for f in _TIE_ORDER)


def _rank_key(est: Estimate) -> tuple:
    return (round(est.step_time_s, 12), _tie_key(est.config))


def _allowed(name: str, values: list, constraints: dict[str, Any]) -> list:
    if name in constraints:
        return [v for v in values if v == constraints[name]]
    return values


def enumerate_configs(costs: ModelCosts, cluster: Cluster, *, global_batch_size: int,
                      constraints: dict[str, Any], options: EstimateOptions,
                      settings: SearchSettings) -> Iterator[ParallelConfig]:
    """Every candidate config, in a fixed order (validity is checked by `evaluate`)."""
    world, g = cluster.world_size, cluster.gpus_per_node
    heads = costs.num_heads
    body_layers = max(u.count for u in costs.units)
    tps = [t for t in divisors(world) if t <= g and (heads is None or heads % t == 0)]
    for tp in _allowed("tp", tps, constraints):
        cps = [c for c in divisors(world // tp) if c <= settings.max_cp
               and (c == 1 or (heads is not None and costs.seq_len and costs.seq_len % (2 * c) == 0))]
        for cp in _allowed("cp", cps, constraints):
            pps = [p for p in divisors(world // (tp * cp)) if p <= costs.num_layers]
            for pp in _allowed("pp", pps, constraints):
                dp = world // (tp * cp * pp)
                if "dp" in constraints and constraints["dp"] != dp:
                    continue
                if global_batch_size % dp:
                    continue
                eps = [e for e in divisors(dp * cp)
                       if costs.num_experts and costs.num_experts % e == 0] or [1]
                for ep in _allowed("ep", eps, constraints):
                    yield from _inner(costs, global_batch_size, constraints, options, settings,
                                      tp=tp, cp=cp, pp=pp, dp=dp, ep=ep,
                                      body_layers=body_layers)


def _inner(costs, gbs, constraints, options, settings, *, tp, cp, pp, dp, ep, body_layers
           ) -> Iterator[ParallelConfig]:
    zeros = [0, 1, 2, 3] if dp * cp > 1 else [0]
    sps = [False, True] if tp > 1 else [False]
    recomputes = ["none", "selective", "full"] if options.attention_kernel == "math" \
        else ["none", "full"]  # with a fused kernel selective recompute equals none
    mbss = [b for b in divisors(gbs // dp) if b <= settings.max_micro_batch_size]
    if pp == 1:
        schedules = [("1f1b", 1)]
    else:
        per_stage = body_layers // pp
        vs = [v for v in range(2, settings.max_virtual_stages + 1)
              if per_stage >= v and body_layers % (pp * v) == 0]
        schedules = [("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1)] + \
            [("interleaved-1f1b", v) for v in vs]
    for mbs in _allowed("micro_batch_size", mbss, constraints):
        m = gbs // (dp * mbs)
        for rc in _allowed("recompute", recomputes, constraints):
            for sp in _allowed("sequence_parallel", sps, constraints):
                for schedule, v in schedules:
                    if "pp_schedule" in constraints and constraints["pp_schedule"] != schedule:
                        continue
                    if "virtual_stages" in constraints and constraints["virtual_stages"] != v:
                        continue
                    if schedule == "interleaved-1f1b" and m % pp:
                        continue
                    for zero in _allowed("zero_stage", zeros, constraints):
                        yield ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero_stage=zero,
                                             micro_batch_size=mbs, pp_schedule=schedule,
                                             virtual_stages=v, sequence_parallel=sp,
                                             recompute=rc)


def _states_lower_bound(costs: ModelCosts, cfg: ParallelConfig, dtype: str) -> float:
    """Bytes no placement can avoid: model states of an even share of the parameters."""
    dense = sum(u.dense_params * u.count for u in costs.units) / (cfg.tp * cfg.pp)
    expert = sum(u.expert_params * u.count for u in costs.units) / (cfg.tp * cfg.pp * cfg.ep)
    shards = cfg.dp * cfg.cp
    return (dense * state_bytes_per_param(dtype, cfg.zero_stage, shards)
            + expert * state_bytes_per_param(dtype, cfg.zero_stage, max(1, shards // cfg.ep))
            + COMM_BUFFER_BYTES + CUDA_CONTEXT_BYTES)


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
           settings: SearchSettings = SearchSettings()) -> SearchResult:
    constraints = dict(constraints or {})
    unknown = sorted(set(constraints) - set(CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"unknown constraint(s) {unknown}; constraints pin ParallelConfig "
                         f"fields: {', '.join(CONFIG_FIELDS)}")
    start = time.perf_counter()
    cache = EvalCache(cluster)
    usable = cluster.hardware.device.memory_bytes
    configs = list(enumerate_configs(costs, cluster, global_batch_size=global_batch_size,
                                     constraints=constraints, options=options,
                                     settings=settings))
    progress = _Progress(settings.progress)
    fast: list[Estimate] = []
    pruned, smallest, errors = 0, None, []
    ordered = []
    for cfg in configs:
        bound = _states_lower_bound(costs, cfg, dtype)
        if bound > usable:
            pruned += 1
            if smallest is None or bound < smallest[0]:
                smallest = (bound, cfg)
            continue
        try:
            ordered.append((step_lower_bound(costs, cluster, cfg,
                                             global_batch_size=global_batch_size, dtype=dtype,
                                             options=options, cache=cache), _tie_key(cfg), cfg))
        except ValueError as exc:
            errors.append(f"{cfg.short()}: {exc}")
    ordered.sort(key=lambda t: (t[0], t[1]))
    best_times: list[float] = []  # the k fastest fitting closed-form times, ascending
    skipped = 0
    for i, (bound, _, cfg) in enumerate(ordered):
        if i % 256 == 0:
            progress.tick(i, len(ordered))
        if len(best_times) == settings.top_k_exact and bound > best_times[-1]:
            skipped = len(ordered) - i
            break
        try:
            est = evaluate(costs, cluster, cfg, global_batch_size=global_batch_size,
                           dtype=dtype, options=options, cache=cache, exact=False)
        except ValueError as exc:  # e.g. a head/expert divisibility the enumeration let by
            errors.append(f"{cfg.short()}: {exc}")
            continue
        fast.append(est)
        if est.fits:
            best_times = sorted(best_times + [est.step_time_s])[:settings.top_k_exact]
    progress.close()
    if not configs or (not fast and errors and not pruned):
        detail = f" (first rejection: {errors[0]})" if errors else ""
        raise ValueError(f"no configuration satisfies the constraints {constraints} on "
                         f"{cluster.world_size} GPUs{detail}")
    fitting = sorted((e for e in fast if e.fits), key=_rank_key)
    if not fitting:
        raise _no_fit(costs, cluster, fast, smallest, usable, global_batch_size, dtype, options,
                      cache)
    exact = []
    for est in fitting[:settings.top_k_exact]:
        exact.append(evaluate(costs, cluster, est.config, global_batch_size=global_batch_size,
                              dtype=dtype, options=options, cache=cache, exact=True))
    best = min((e for e in exact if e.fits), key=_rank_key, default=None)
    if best is None:  # the simulated schedule holds more in flight than the closed form
        best = min(exact, key=lambda e: e.peak_memory_bytes)
        log.warning("the %d best configs exceed memory once simulated; returning %s",
                    len(exact), best.config.short())
    exact_cfgs = {e.config for e in exact}
    rows = [_row(e, False) for e in fast if e.config not in exact_cfgs] + \
        [_row(e, True) for e in exact]
    table = pd.DataFrame(rows).sort_values(
        ["fits", "step_time_s"], ascending=[False, True], kind="mergesort").reset_index(drop=True)
    seconds = time.perf_counter() - start
    log.info("searched %d configs (%d pruned by memory, %d by the step-time bound) in %.2f s",
             len(configs), pruned, skipped, seconds)
    return SearchResult(best=best, candidates=table, num_considered=len(configs),
                        num_pruned_by_memory=pruned, num_pruned_by_bound=skipped,
                        seconds=seconds)


def _no_fit(costs, cluster, fast, smallest, usable, gbs, dtype, options, cache) -> NoPlanFitsError:
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
