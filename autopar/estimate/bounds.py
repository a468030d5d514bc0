"""Lower bounds on a config's step time, which the search prunes with: the closed-form
pipeline's (`step_lower_bound`, from the per-layer work of `unit_work`), the simulated
schedule's (`exact_step_lower_bound`) and the data-parallel traffic and optimizer step's
(`data_parallel_floor`). Each costs less than the estimate it bounds (`autopar.estimate.core`),
so a search skips the configs whose bound cannot beat the best found.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.estimate.cache import _rank_groups
from autopar.estimate.core import (EstimateOptions, EvalCache, ModelCosts, _checked,
                                   _data_parallel, _optimizer_s, _prepared,
                                   _unit_times, split_structure)
from autopar.estimate.data_parallel import GatherUnit, dp_comm
from autopar.estimate.layout import rank_work_extremes, simulated_lower_bound
from autopar.errors import InvalidConfigError

# relative margin for comparing a bound with the number it bounds: a bound summed in another
# order than the estimate or the simulation may differ from a tight case in its last bits
BOUND_MARGIN = 1e-9

__all__ = ["BOUND_MARGIN", "DataParallelFloor", "data_parallel_floor",
           "exact_step_lower_bound", "step_lower_bound", "unit_work"]


def step_lower_bound(costs: ModelCosts, cluster: Cluster, config: ParallelConfig, *,
                     global_batch_size: int, dtype: str, options: EstimateOptions,
                     cache: EvalCache) -> float:
    """A bound the closed-form estimate never goes below: the schedule's closed form on the
    Megatron split's per-rank work (W_r, forward + backward of one micro-batch), without p2p,
    exposed data-parallel traffic or the optimizer: (m + (p-1)/v)·max W_r interleaved,
    m·max W_r + (p-1)·max(0, max_r (F + B - W)_r) for ZB-H1, sum W_r + (m-1)·max W_r for
    GPipe/1F1B (Alpa's bound with stage = rank), m·W for p = 1. The search computes the same
    numbers for all configs at once (`autopar.search.space`); this is the one-config form.
    Raises InvalidConfigError when the config's split cannot be made."""
    work, tail = unit_work(costs, cache, config, dtype, options)
    split = split_structure(costs, cache, config.pp, config.virtual_stages)
    if isinstance(split, str):
        raise InvalidConfigError(split)
    busiest, total = (float(x[0, 0]) for x in rank_work_extremes([split], work[None]))
    m, p = global_batch_size // (config.dp * config.micro_batch_size), config.pp
    if config.pp_schedule == "interleaved-1f1b":
        return (m + (p - 1) / config.virtual_stages) * busiest
    if p == 1:
        return m * busiest
    if config.pp_schedule == "zero-bubble":
        longest = float(rank_work_extremes([split], tail[None])[0][0, 0])
        return m * busiest + (p - 1) * max(longest, 0.0)
    return total + (m - 1) * busiest


def unit_work(costs: ModelCosts, cache: EvalCache, config: ParallelConfig, dtype: str,
              options: EstimateOptions, comm: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Per layer of each unit (unit order), one micro-batch on one rank of `config`'s (tp,
    cp, ep) group: forward + backward seconds, and forward + backward less the weight-grad
    part (what ZB-H1's last stage still runs after its last weight-grad pass can move).
    Memoised: the arrays are shared, not to be written. Without `comm`, communication is
    left out: a bound in any mesh order."""
    by_name = _unit_times(costs, cache, config, dtype, options, comm)
    found = cache.work.get(id(by_name))  # the times live as long as the cache: ids hold
    if found is None:
        times = [by_name[u.name] for u in cache.units[config.micro_batch_size]]
        work = np.array([t.forward + t.backward for t in times])
        found = cache.work[id(by_name)] = (work, work - np.array([t.compute_wgrad
                                                                   for t in times]))
    return found


def exact_step_lower_bound(costs: ModelCosts, cluster: Cluster, config: ParallelConfig, *,
                           global_batch_size: int, dtype: str = "bf16",
                           options: EstimateOptions = EstimateOptions(),
                           cache: EvalCache | None = None,
                           stage_boundaries: tuple[tuple[int, int], ...] | None = None) -> float:
    """A bound `evaluate(..., exact=True).step_time_s` never goes below (up to the rounding of
    sums taken in another order): the simulated schedule replaced by
    `layout.simulated_lower_bound`, plus the same data-parallel, optimizer and partial-gradient
    terms. Costs no simulation, so the search ranks simulation candidates by it and skips
    those that cannot beat a simulated one. `stage_boundaries` as in `evaluate`."""
    m = _checked(costs, cluster, config, global_batch_size)
    cache = cache or EvalCache(cluster)
    prep = _prepared(costs, cache, config, dtype, options, stage_boundaries)
    dp_exposed, _, optimizer, tp_sync, _ = _data_parallel(cluster, cache, prep, config, m,
                                                          dtype, options)
    return simulated_lower_bound(config, m, prep.lay, prep.p2p) + dp_exposed + optimizer \
        + tp_sync


@dataclass(frozen=True)
class DataParallelFloor:
    """Lower bounds on the two terms `evaluate` adds to the pipeline's time: the exposed
    data-parallel traffic (`dp_comm`) and the optimizer step. `traffic` is T below: the
    traffic of the rank with the most parameters; `hidden` whether compute may hide it;
    `per_micro_batch` whether it recurs every micro-batch (ZeRO-3) or once a step."""

    traffic: float
    hidden: bool
    per_micro_batch: bool
    optimizer: float

    def exposed_and_optimizer(self, work: float, m: int) -> float:
        """A bound below exposed traffic + optimizer, given `work`, an upper bound on the
        heaviest rank's forward + backward seconds of one micro-batch, and m micro-batches."""
        exposed = max(0.0, self.traffic - work) if self.hidden else self.traffic
        return (m * exposed if self.per_micro_batch else exposed) + self.optimizer


def data_parallel_floor(costs: ModelCosts, cache: EvalCache, config: ParallelConfig,
                        dtype: str, options: EstimateOptions) -> DataParallelFloor:
    """What a config pays beyond its pipeline at least (`DataParallelFloor`), from its split's
    parameters per rank, without building its layout.

    `dp_comm` costs the rank with the most parameters, h: d_h dense and e_h expert
    parameters on one GPU. Of the ranks' (d_r, e_r), h has the largest d + e = M, so d_h >=
    max(min_r d_r, M - max_r e_r) and e_h >= max(min_r e_r, M - max_r d_r) (d_h = M without
    experts). Every candidate collective time is affine in the bytes with a non-negative
    intercept (`costmodels.collectives`), so the fastest is increasing, concave and so
    subadditive: the collectives of those bounds are at most h's, and one collective of a
    rank's bytes is at most its per-unit ones. Hence T, per group (dense over the dp group,
    experts over theirs):

    - ZeRO 0: one all-reduce of the gradients a step; ZeRO 1-2: a reduce-scatter and an
      all-gather a step. Overlapped (`overlap_dp_comm`), max(0, R - b) + max(0, G - f) >=
      R + G - (f + b): the exposed time is at least T less a micro-batch's work; not
      overlapped it is T.
    - ZeRO-3 with prefetched gathers: 2·G + S a micro-batch, and max(0, G - f) + max(0, G + S
      - b) >= 2·G + S - (f + b) likewise, m times. Synchronous gathers: T = 0 (not bounded).

    The optimizer step runs over d_h / (dp·cp) + e_h / expert_dp parameters under ZeRO >= 1,
    d_h + e_h otherwise (`core._optimizer_s`; d_h, e_h no more than the heaviest rank's).
    A model without experts takes the average rank's parameters for M and d_h instead (no
    larger: the heaviest rank holds at least the average), which needs no split, so the
    floor is the same for every virtual-stage count of a pp."""
    if any(u.expert_params for u in costs.units):
        split = split_structure(costs, cache, config.pp, config.virtual_stages)
        if isinstance(split, str):
            raise InvalidConfigError(split)
        dense = split.rank_counts @ np.array([u.dense_on_tp_rank(config.tp)
                                              for u in costs.units], float)
        expert = split.rank_counts @ np.array([u.expert_params for u in costs.units], float) \
            / (config.expert_tp * config.ep)
        most = float((dense + expert).max())
        d = max(float(dense.min()), most - float(expert.max()), 0.0)
        e = max(float(expert.min()), most - float(dense.max()), 0.0)
    else:  # the heaviest rank holds at least the average: one floor for every virtual split
        e = 0.0
        d = most = sum(u.dense_on_tp_rank(config.tp) * u.count for u in costs.units) / config.pp
    optimizer = _optimizer_s(cache.hardware.device, d, e, config, dtype)
    zero3 = config.zero_stage == 3
    traffic = 0.0
    if not zero3 or options.zero3_gather == "prefetch":
        # `dp_comm`'s total traffic for a rank holding (d, e), as one ZeRO-3 unit and one
        # micro-batch (its total does not depend on the compute sums)
        whole = [GatherUnit(unit=costs.units[0], layers=1.0, dense=d, expert=e)]
        traffic = dp_comm(cache, config, _rank_groups(cache, config), d, e, _NO_COMPUTE, 1,
                           dtype, options, whole)[1]
    return DataParallelFloor(traffic=traffic, hidden=zero3 or options.overlap_dp_comm,
                             per_micro_batch=zero3, optimizer=optimizer)


_NO_COMPUTE = {"compute_fwd": 0.0, "compute_bwd": 0.0, "recompute": 0.0}
