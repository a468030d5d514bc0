"""Layers on pipeline stages and the closed forms the search ranks with.

`structure` places layers on the pp x virtual-stage chunks (Megatron's even split, or given
boundaries); it depends only on the unit counts, so one split serves every micro-batch size,
degree and policy. `layout` multiplies it by the per-layer times and bytes of one (micro-batch,
degrees, SP, recompute) into per-chunk and per-rank sums. The closed forms -- the pipeline
bound, the analytic in-flight micro-batches and the peak memory -- are what
`evaluate(exact=False)` returns; the exact path simulates the schedule instead.

Arithmetic here is part of the search's results (plans are byte-identical for the same
inputs), so any change to how a sum is formed changes plans at the last bit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from autopar.config import ParallelConfig
from autopar.estimate.memory import activation_bytes
from autopar.estimate.stages import (Boundaries, check_boundaries, layer_sequence,
                                     megatron_boundaries, unit_order)
from autopar.estimate.timing import UnitTimes
from autopar.estimate.units import Unit
from autopar.errors import InvalidConfigError
from costmodels.memory import reserved_bytes, state_bytes_per_param

if TYPE_CHECKING:
    from autopar.estimate.core import ModelCosts

__all__ = ["TIME_ATTRS", "Layout", "Structure", "UnitVectors", "structure", "unit_vectors",
           "layout", "pipeline_bound", "simulated_lower_bound", "analytic_inflight",
           "fast_peak_memory", "rank_work_extremes", "step_layers"]

TIME_ATTRS = ("compute_fwd", "compute_bwd", "recompute", "tp_fwd", "tp_bwd", "cp_fwd",
              "cp_bwd", "ep_fwd", "ep_bwd")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Layers on stages with everything per chunk and per rank that ZeRO stage and schedule
    don't change. Arrays are indexed by chunk (model order) or by pipeline rank; the list
    views (`fwd`, `dense`, ...) are what the simulator and `stage_memory` take, built on first
    use since the closed-form path does not need them."""

    chunk_fwd: np.ndarray  # seconds per micro-batch
    chunk_bwd: np.ndarray
    chunk_wgrad: np.ndarray
    chunk_kept: np.ndarray  # activation bytes per micro-batch
    chunk_working: np.ndarray
    rank_sums: dict[str, np.ndarray]  # UnitTimes attribute -> seconds per micro-batch per rank
    stage_layers: tuple[tuple[str, ...], ...]
    rank_work: np.ndarray  # forward + backward seconds per micro-batch
    rank_kept: np.ndarray  # activation bytes per micro-batch, all chunks of the rank
    rank_counts: np.ndarray  # [rank, unit] layers
    rank_working: np.ndarray
    rank_dense: np.ndarray  # parameters per rank on one GPU
    rank_expert: np.ndarray
    rank_max_param_bytes: np.ndarray  # largest unit per rank (ZeRO-3 gather unit)
    rank_bytes_per_param: np.ndarray
    stage_sum: float
    stage_max: float
    zb_tail: float  # max over stages of F + B - W
    # the per-stage times as the Estimate reports them (built once per layout, not per config)
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    wgrad_s: tuple[float, ...]

    def attr_sums(self, rank: int) -> dict[str, float]:
        """Per micro-batch seconds of each UnitTimes attribute on pipeline rank `rank` (built
        on demand: a search reads two ranks of a layout, a layout can have 128)."""
        return {a: float(self.rank_sums[a][rank]) for a in TIME_ATTRS}

    @functools.cached_property
    def fwd(self) -> list[float]:
        return list(self.chunk_fwd)

    @functools.cached_property
    def bwd(self) -> list[float]:
        return list(self.chunk_bwd)

    @functools.cached_property
    def wgrad(self) -> list[float]:
        return list(self.chunk_wgrad)

    @functools.cached_property
    def kept(self) -> list[float]:
        return list(self.chunk_kept)

    @functools.cached_property
    def working(self) -> list[float]:
        return list(self.chunk_working)

    @functools.cached_property
    def dense(self) -> list[float]:
        return list(self.rank_dense)

    @functools.cached_property
    def expert(self) -> list[float]:
        return list(self.rank_expert)

    @functools.cached_property
    def max_param_bytes(self) -> list[float]:
        return list(self.rank_max_param_bytes)

    @functools.cached_property
    def bytes_per_param(self) -> list[float]:
        return list(self.rank_bytes_per_param)


@dataclass(frozen=True, kw_only=True)
class Structure:
    """Which layers of which unit each chunk holds, for one (pp, virtual stages) split."""

    counts: np.ndarray  # [chunk, unit] layers
    rank_counts: np.ndarray  # [rank, unit] layers
    cuts: np.ndarray  # int64 [chunk, (start, end)]: half-open ranges over `fqns`
    fqns: tuple[str, ...]  # every layer in model order
    # derived once per split: which units a chunk / rank holds
    in_chunk: np.ndarray
    in_rank: np.ndarray

    @functools.cached_property
    def stage_layers(self) -> tuple[tuple[str, ...], ...]:
        """Module paths per chunk (built when a layout of the split is)."""
        return tuple(self.fqns[i:j] for i, j in self.cuts.tolist())

    @functools.cached_property
    def distinct_rank_counts(self) -> np.ndarray:
        """The distinct rows of `rank_counts`: a deep pipeline's middle ranks hold the same
        layers, so a maximum over ranks needs only these few."""
        rows = dict.fromkeys(map(tuple, self.rank_counts.tolist()))
        return np.array(list(rows), dtype=np.float64).reshape(len(rows), -1)

    @functools.cached_property
    def unit_layers(self) -> np.ndarray:
        """Layers per unit over all ranks."""
        return self.rank_counts.sum(axis=0)


def structure(units: tuple[Unit, ...], pp: int, v: int,
              boundaries: Boundaries | None = None) -> Structure:
    """Layers per unit on each of the pp x v chunks; the same for every micro-batch size
    (scaling a unit changes its costs, not its layers), so callers key it by the split only."""
    fqns = tuple(fqn for _, fqn in layer_sequence(units))
    if boundaries is None:
        cuts = megatron_boundaries(units, pp * v)
    else:
        check_boundaries(len(fqns), boundaries)
        if len(boundaries) != pp * v:
            raise InvalidConfigError(
                f"{len(boundaries)} stage boundaries for pp x virtual stages = "
                f"{pp} x {v} chunks")
        cuts = np.array(boundaries, dtype=np.int64)
    # chunk [a, b) holds, of each unit, its layers at positions a..b-1 of the model's order
    prefix = np.zeros((len(fqns) + 1, len(units)))
    prefix[np.arange(1, len(fqns) + 1), unit_order(units)] = 1.0
    prefix = np.cumsum(prefix, axis=0)
    counts = prefix[cuts[:, 1]] - prefix[cuts[:, 0]]
    rank_counts = counts.reshape(v, pp, len(units)).sum(axis=0)  # chunk c on rank c mod pp
    return Structure(counts=counts, rank_counts=rank_counts, cuts=cuts, fqns=fqns,
                     in_chunk=counts > 0, in_rank=rank_counts > 0)


@dataclass(frozen=True, kw_only=True)
class UnitVectors:
    """Per-unit values of one (micro-batch, tp, cp, ep, SP, recompute) as vectors in unit
    order: what `layout` multiplies with a structure's layer counts. Built once per key and
    shared by every pipeline split of it."""

    times: dict[str, np.ndarray]  # TIME_ATTRS and forward, backward, compute_wgrad
    work: np.ndarray  # forward + backward
    kept: np.ndarray  # activation bytes kept per layer per micro-batch
    working: np.ndarray  # one layer's working set while it runs
    dense: np.ndarray  # parameters per layer, unsharded
    tp_replicated: np.ndarray  # the part of `dense` whole on every tp rank (`tp_whole_params`)
    expert: np.ndarray
    param_bytes: np.ndarray
    bytes_per_param: np.ndarray


def unit_vectors(units: tuple[Unit, ...], times: dict[str, UnitTimes], cfg: ParallelConfig,
                 flash: bool, loss_kernel: str = "eager", *,
                 weight_copies: bool = False, fp8: bool = False) -> UnitVectors:
    t = [times[u.name] for u in units]
    per_unit = {a: np.array([getattr(x, a) for x in t])
                for a in TIME_ATTRS + ("forward", "backward", "compute_wgrad")}
    acts = [activation_bytes(u, cfg, flash, loss_kernel, weight_copies=weight_copies, fp8=fp8)
            for u in units]
    pbytes = np.array([u.param_bytes for u in units], float)
    return UnitVectors(
        times=per_unit, work=per_unit["forward"] + per_unit["backward"],
        kept=np.array([k for k, _ in acts]), working=np.array([w for _, w in acts]),
        dense=np.array([u.dense_params for u in units], float),
        tp_replicated=np.array([u.tp_whole_params(cfg.tp) for u in units], float),
        expert=np.array([u.expert_params for u in units], float), param_bytes=pbytes,
        bytes_per_param=pbytes / np.maximum(1, [u.dense_params + u.expert_params
                                                for u in units]))


def layout(vec: UnitVectors, cfg: ParallelConfig, st: Structure) -> Layout:
    """Per-chunk and per-rank sums as (layers per unit) x (per-layer value per unit)."""
    per_unit = vec.times
    fwd, bwd, wgrad = (st.counts @ per_unit[a] for a in ("forward", "backward", "compute_wgrad"))
    stage = fwd + bwd
    return Layout(
        chunk_fwd=fwd, chunk_bwd=bwd, chunk_wgrad=wgrad, chunk_kept=st.counts @ vec.kept,
        chunk_working=np.where(st.in_chunk, vec.working, 0.0).max(axis=1),
        rank_sums={a: st.rank_counts @ per_unit[a] for a in TIME_ATTRS},
        stage_layers=st.stage_layers,
        rank_work=st.rank_counts @ vec.work,
        rank_kept=st.rank_counts @ vec.kept,
        rank_counts=st.rank_counts,
        rank_working=np.where(st.in_rank, vec.working, 0.0).max(axis=1),
        rank_dense=st.rank_counts @ vec.dense / cfg.tp if not vec.tp_replicated.any() else
        st.rank_counts @ ((vec.dense - vec.tp_replicated) / cfg.tp + vec.tp_replicated),
        rank_expert=st.rank_counts @ vec.expert / (cfg.expert_tp * cfg.ep),
        rank_max_param_bytes=np.where(st.in_rank, vec.param_bytes, 0).max(axis=1) / cfg.tp,
        rank_bytes_per_param=np.where(st.in_rank, vec.bytes_per_param, 0).max(axis=1),
        stage_sum=float(stage.sum()), stage_max=float(stage.max()),
        zb_tail=float((fwd + bwd - wgrad).max()),
        fwd_s=tuple(fwd.tolist()), bwd_s=tuple(bwd.tolist()), wgrad_s=tuple(wgrad.tolist()))


def rank_work_extremes(splits: Sequence[Structure], work: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Busiest rank's and all ranks' work per micro-batch, [split, K] each, for S splits and K
    sets of per-unit work at once: `work` is [K, unit] seconds. Sums run unit by unit, then
    rank by rank, so a set's numbers do not depend on the others beside it (the search's
    columns equal the one-config bound to the bit); ranks holding the same layers are summed
    once, the distinct ranks of all splits in one array. The total is summed over units of
    the layer counts, which are integers and so exact."""
    kinds = [split.distinct_rank_counts for split in splits]
    starts = np.cumsum([0] + [len(k) for k in kinds[:-1]])
    rows = np.concatenate(kinds)  # [rank kind of some split, unit]
    layers = np.stack([split.unit_layers for split in splits])  # [split, unit]
    per_rank = np.zeros((rows.shape[0], work.shape[0]))
    total = np.zeros((len(splits), work.shape[0]))
    for u in range(rows.shape[1]):
        column = work[None, :, u]
        per_rank += rows[:, u, None] * column
        total += layers[:, u, None] * column
    return np.maximum.reduceat(per_rank, starts, axis=0), total


def pipeline_bound(cfg: ParallelConfig, m: int, lay: Layout, p2p: float
                   ) -> tuple[float, np.ndarray]:
    """Closed-form step time of the schedule and busy time per rank (the search's ranking).

    GPipe/1F1B: sum of one micro-batch through every stage plus (m-1) times the slowest
    stage (Alpa's bound); interleaved: (m + (p-1)/v) times the busiest rank's per-micro-batch
    work; ZB-H1: m times the busiest rank plus (p-1) x (F + B - W) of the slowest stage. Each
    adds 2(p-1) p2p hops for the fill and drain.
    """
    p, v = cfg.pp, cfg.virtual_stages
    busy = m * lay.rank_work
    if p == 1:
        return float(busy[0]), busy
    fill = 2 * (p - 1) * p2p
    if cfg.pp_schedule == "interleaved-1f1b":
        return (m + (p - 1) / v) * float(lay.rank_work.max()) + fill, busy
    if cfg.pp_schedule == "zero-bubble":
        return m * float(lay.rank_work.max()) + (p - 1) * max(lay.zb_tail, 0.0) + fill, busy
    return lay.stage_sum + (m - 1) * lay.stage_max + fill, busy


def simulated_lower_bound(cfg: ParallelConfig, m: int, lay: Layout, p2p: float) -> float:
    """A bound the simulated schedule (`costmodels.pipeline.simulate_pipeline` on this layout)
    never goes below, for any of its schedules:

        max over ranks r of  fill_r + m * work_r + drain_r

    Every op of rank r belongs to a chunk s >= r, so it waits for micro-batch k's forward
    through chunks 0..r-1 and r hops (fill_r = sum_{s<r} F_s + r * p2p); the rank then runs
    m * work_r seconds of ops one after another; its last op is a backward of some chunk
    s >= r, after which the backward still crosses chunks r-1..0 and r hops (drain_r =
    sum_{s<r} B_s + r * p2p).

    Zero-bubble (v = 1) splits the backward into the input grad I and the weight grad W, and
    a rank may end on a W that nothing waits for. There the bound follows the last
    micro-batch's input grad: in the simulator's order rank r runs every F, every I and its
    first max(0, m-1-r) W's by the end of I_r(m-1); that input grad then crosses ranks
    r-1..s (I and a hop each), and rank s still owes min(s+1, m) W's after its I_s(m-1):

        max over s <= r of  fill_r + m (F_r + I_r) + max(0, m-1-r) W_r
                            + sum_{s<=q<r} (I_q + p2p) + min(s+1, m) W_s

    (s = r gives fill_r + m * work_r). Summed in another order than the simulator, a bound
    can differ from a tight case in its last bits: callers compare it with a margin."""
    p = cfg.pp
    busy = m * lay.rank_work
    if p == 1:
        return float(busy[0])
    ranks = np.arange(p)
    fill = np.concatenate(([0.0], np.cumsum(lay.chunk_fwd[:p - 1]))) + ranks * p2p
    if cfg.pp_schedule != "zero-bubble":
        drain = np.concatenate(([0.0], np.cumsum(lay.chunk_bwd[:p - 1]))) + ranks * p2p
        return float((fill + busy + drain).max())
    wgrad = lay.chunk_wgrad
    igrad = lay.chunk_bwd - wgrad
    last_i = fill + m * (lay.chunk_fwd + igrad) + np.maximum(0, m - 1 - ranks) * wgrad
    chain = np.concatenate(([0.0], np.cumsum(igrad[:p - 1] + p2p)))  # sum_{q<r} (I_q + p2p)
    owed = np.maximum.accumulate(np.minimum(ranks + 1, m) * wgrad - chain)  # best s <= r
    return float((last_i + chain + owed).max())


def analytic_inflight(cfg: ParallelConfig, m: int, lay: Layout) -> np.ndarray:
    """Closed-form peak activation bytes per rank: GPipe all m micro-batches; 1F1B and ZB-H1
    min(p - rank, m); interleaved Megatron's warm-up of min(2(p-1-rank) + (v-1)p, mv) chunk
    micro-batches plus one (all mv when m == p), at the rank's average chunk size."""
    p, v = cfg.pp, cfg.virtual_stages
    ranks = np.arange(p)
    if cfg.pp_schedule == "gpipe":
        return m * lay.rank_kept
    if cfg.pp_schedule == "interleaved-1f1b" and v > 1:
        held = np.full(p, m * v, dtype=float) if m == p else \
            np.minimum(2 * (p - 1 - ranks) + (v - 1) * p + 1, m * v)
        return held * lay.rank_kept / v  # v chunks per rank
    return np.minimum(p - ranks, m) * lay.rank_kept


def fast_peak_memory(cfg: ParallelConfig, dtype: str, lay: Layout, inflight: np.ndarray,
                     zero3_cap: int | None, fp32_params: bool = False) -> float:
    """Largest per-rank total of `stage_memory`'s categories, as vector arithmetic."""
    shards = cfg.dp * cfg.cp
    states = lay.rank_dense * state_bytes_per_param(dtype, cfg.zero_stage, shards,
                                                    fp32_params) + \
        lay.rank_expert * state_bytes_per_param(dtype, cfg.zero_stage, cfg.expert_dp,
                                                fp32_params)
    gathered = 0.0
    if cfg.zero_stage == 3:
        gathered = 2 * lay.rank_max_param_bytes
        if zero3_cap is not None:
            gathered = np.minimum(gathered, zero3_cap * lay.rank_bytes_per_param)
    live = states + inflight + lay.rank_working + gathered
    return reserved_bytes(float(live.max()))


def step_layers(costs: "ModelCosts", config: ParallelConfig, global_batch_size: int,
                 boundaries: Boundaries | None) -> tuple[int, list[Unit], list[list[int]]]:
    """(micro-batches a step, the units at the micro-batch, each pipeline rank's layers of
    each unit with the stages cut at `boundaries` or evenly by layers)."""
    m, rest = divmod(global_batch_size, config.dp * config.micro_batch_size)
    if rest or not m:
        raise ValueError(f"global batch {global_batch_size} is not a multiple of dp x "
                         f"micro-batch = {config.dp * config.micro_batch_size}")
    units = list(costs.units_for(config.micro_batch_size))
    counts = structure(units, config.pp, config.virtual_stages, boundaries).rank_counts
    return m, units, [[int(n) for n in rank] for rank in counts]


def recomputed_layers(units: Sequence[Unit], config: ParallelConfig,
                      boundaries: Boundaries | None, pipeline_rank: int) -> list[int]:
    """Per unit, the layers of pipeline rank `pipeline_rank` whose forward full recompute runs
    again: the k-th, 2k-th, ... block of the rank's chunks in order (`recompute_every` k, as
    the runtime and torchtitan count); none under any other policy."""
    out = [0] * len(units)
    if config.recompute != "full":
        return out
    order = unit_order(tuple(units))
    cuts = structure(tuple(units), config.pp, config.virtual_stages, boundaries).cuts
    blocks = [order[i] for a, b in cuts[pipeline_rank::config.pp] for i in range(a, b)
              if units[order[i]].is_block]
    for i in blocks[config.recompute_every - 1::config.recompute_every]:
        out[i] += 1
    return out

