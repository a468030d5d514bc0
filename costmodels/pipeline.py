"""Pipeline-parallel schedules by event simulation: step time, bubbles, in-flight micro-batches.

This module owns the time a pipeline schedule takes for given per-stage compute times. Each
schedule is turned into a fixed op list per pipeline rank; the simulator then runs the lists:

    start(op) = max(rank free, end(dependency) + hop),    end(op) = start(op) + duration(op)

Dependencies: F(s, k) after F(s-1, k); B(s, k) after B(s+1, k) (the last stage's B after its
own F); W(s, k) after B(s, k). A hop costs `p2p_s` of that stage boundary when the two stages
live on different ranks and nothing when they share one. Sends are asynchronous: a hop delays
the consumer but does not occupy either rank. Every op starts as early as its rank's order and
its dependency allow, so the result is deterministic and equals an event-driven run.

Schedules (p = `num_stages` pipeline ranks, m micro-batches, v = `virtual_stages`; the model is
cut into p·v stages in model order and stage s runs on rank s mod p):

- ``gpipe``: all forwards in micro-batch order, then all backwards in micro-batch order
  (PyTorch's ScheduleGPipe order). Every rank holds m micro-batches.
- ``1f1b``: PipeDream-flush, Megatron's non-interleaved schedule. Rank i runs min(p-1-i, m)
  warm-up forwards, then pairs (F, B), then the remaining backwards. Rank i holds min(p-i, m).
  m < p is legal (Megatron caps the warm-up at m; PyTorch's Schedule1F1B refuses it): the
  schedule just degenerates, so it is simulated, not refused.
- ``interleaved-1f1b``: Megatron's interleaved schedule (Narayanan et al. 2021) with v model
  chunks per rank, chunk c on rank c mod p. The k-th forward of a rank is chunk
  (k mod pv) div p of micro-batch (k div pv)·p + k mod p; the k-th backward walks the chunks in
  reverse. Warm-up is min(2(p-1-i) + (v-1)p, mv) forwards, or all mv when m == p (Megatron runs
  all forwards first in that case), then (F, B) pairs, then the remaining backwards. Megatron
  requires m % p == 0 and so does this module. `virtual_stages` = 1 is allowed and gives the
  same rule with one chunk.
- ``zero-bubble``: ZB-H1 (Qi et al. 2023). The backward is split into B (input gradient, the
  critical path) and W (weight gradient, `weight_grad_s`; B = backward - W). Rank i runs the
  1F1B warm-up and (F, B) pairs; after the j-th B it runs the W of micro-batch j - i once
  j >= i, and the i W's still owed at the end. Rank i thus holds W back by i micro-batches
  (PyTorch's ZB1P order); in-flight micro-batches are those of 1F1B. On equal stages with
  m >= p the bubble is (p-1)·max(T_F + T_B - T_W, T_F, T_B): the paper's (p-1)(T_F + T_B - T_W)
  while W is the shortest pass (a third of 1F1B's (p-1)(T_F + T_B + T_W) when all three are
  equal), else the lower bound of any schedule holding 1F1B's micro-batches (the last rank's
  forward fill, the first rank's wait for its first B).

In-flight count: the number of (stage, micro-batch) pairs on a rank whose F has started and
whose B has not finished, the driver of activation memory. With v > 1 it counts chunk
micro-batches (a micro-batch on two of a rank's chunks counts twice); W is not counted (it
keeps only the layer inputs it needs, less than B). In-flight bytes, given each stage's
activation bytes per micro-batch, count a pair from its F's start until its last B or W ends
(`PipelineTimeline.peak_inflight_bytes`).

Cost: the event loop touches each op once, with its dependency, hop and duration looked up
beforehand in array passes; per-rank sums (busy time, in-flight counts and bytes) are array
passes too, summed in op order, so they do not depend on how they are computed. The per-op
list (`ops`) is built when first read: a search that only needs the numbers never builds it.

No torch import here.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import operator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, Sequence

import numpy as np

__all__ = ["PipelineSchedule", "OpKind", "PipelineOp", "PipelineTimeline", "simulate_pipeline",
           "gpipe_step_time", "one_f_one_b_step_time", "interleaved_step_time", "parse_schedule"]

logger = logging.getLogger(__name__)


class PipelineSchedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    ZERO_BUBBLE = "zero-bubble"


class OpKind(StrEnum):
    F = "F"  # forward
    B = "B"  # backward (input grad + weight grad; input grad only under zero-bubble)
    W = "W"  # weight grad (zero-bubble only)


class PipelineOp(NamedTuple):
    """One compute op as it ran: on which stage, for which micro-batch, when."""

    kind: OpKind
    stage: int
    microbatch: int
    start_s: float
    end_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineTimeline:
    """The simulated step of one schedule; per-rank tuples are indexed by pipeline rank."""

    schedule: PipelineSchedule
    num_stages: int           # pipeline ranks (p)
    num_microbatches: int
    virtual_stages: int
    step_time_s: float        # makespan: first op starts at 0
    busy_s: tuple[float, ...]
    idle_s: tuple[float, ...]  # step_time_s - busy_s: the rank's bubble
    bubble_fraction: float    # (step_time_s - mean busy) / step_time_s
    peak_inflight_microbatches: tuple[int, ...]
    # per rank, when `activation_bytes` was given: the most activation bytes held at once
    peak_inflight_bytes: tuple[float, ...] = ()
    # per rank (kinds, stages, micro-batches, starts, ends): what `ops` is built from
    runs: tuple[tuple[np.ndarray, ...], ...] = field(default=(), repr=False, compare=False)
    _ops: list = field(default_factory=list, repr=False, compare=False)  # memo of `ops`

    @property
    def ops(self) -> tuple[tuple[PipelineOp, ...], ...]:
        """Per rank, in execution order; built when first read (a search reads only the
        numbers above, the plots and reports read the ops)."""
        if not self._ops:  # tuple.__new__ builds each PipelineOp without argument parsing
            new = functools.partial(tuple.__new__, PipelineOp)
            self._ops.append(tuple(
                tuple(map(new, zip([_KINDS[k] for k in kinds.tolist()], stages.tolist(),
                                   micro.tolist(), begin.tolist(), end.tolist())))
                for kinds, stages, micro, begin, end in self.runs))
        return self._ops[0]

    @property
    def bubble_s(self) -> float:
        """Mean idle time over ranks."""
        return sum(self.idle_s) / len(self.idle_s)


_F, _B, _W = 0, 1, 2
_KINDS = (OpKind.F, OpKind.B, OpKind.W)


# -- validation -------------------------------------------------------------------------------

def _count(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}") from None
    if n < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {n}")
    return n


def _times(name: str, values: Sequence[float] | float, length: int, what: str) -> list[float]:
    if isinstance(values, numbers.Real) and not isinstance(values, bool):
        out = [float(values)] * length
    else:
        try:
            out = [float(x) for x in values]  # type: ignore[union-attr]
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a sequence of {length} numbers ({what}), "
                             f"got {values!r}") from None
        if len(out) != length:
            raise ValueError(f"{name} has {len(out)} entries; expected {length} ({what})")
    bad = [x for x in out if not (math.isfinite(x) and x >= 0.0)]
    if bad:
        raise ValueError(f"{name} must hold finite times >= 0 seconds, got {bad[0]!r}")
    return out


def parse_schedule(schedule: PipelineSchedule | str) -> PipelineSchedule:
    """The schedule enum for a name; ValueError listing the allowed names otherwise."""
    try:
        return PipelineSchedule(str(schedule))
    except ValueError:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; allowed: "
                         f"{', '.join(s.value for s in PipelineSchedule)}") from None


def _check_shape(kind: PipelineSchedule, p: int, m: int, v: int) -> None:
    if v > 1 and kind is not PipelineSchedule.INTERLEAVED_1F1B:
        raise ValueError(f"virtual_stages={v} needs schedule 'interleaved-1f1b'; "
                         f"{kind.value!r} takes virtual_stages=1")
    if kind is PipelineSchedule.INTERLEAVED_1F1B and m % p:
        raise ValueError(f"interleaved-1f1b needs num_microbatches divisible by num_stages "
                         f"(as Megatron-LM); got num_microbatches={m}, num_stages={p}")


# -- op orders --------------------------------------------------------------------------------
# An op is encoded as one int: (kind * num_virtual_stages + stage) * m + microbatch.

def _gpipe_order(p: int, m: int) -> list[list[int]]:
    sm = p * m
    return [[(rank * m + k) for k in range(m)] + [sm + rank * m + k for k in range(m)]
            for rank in range(p)]


def _one_f_one_b_order(p: int, m: int, zero_bubble: bool) -> list[list[int]]:
    sm = p * m
    orders = []
    for rank in range(p):
        f = rank * m           # code of F(rank, 0)
        b = sm + rank * m      # code of B(rank, 0)
        w = 2 * sm + rank * m  # code of W(rank, 0)
        warmup = min(p - 1 - rank, m)
        lag = rank             # zero-bubble: W trails B by `rank` micro-batches
        ops = [f + k for k in range(warmup)]
        for j in range(m):
            if j + warmup < m:
                ops.append(f + j + warmup)
            ops.append(b + j)
            if zero_bubble and j >= lag:
                ops.append(w + j - lag)
        if zero_bubble:
            ops.extend(w + k for k in range(max(0, m - lag), m))
        orders.append(ops)
    return orders


def _interleaved_order(p: int, m: int, v: int) -> list[list[int]]:
    """The k-th forward of rank r is chunk (k mod pv) div p of micro-batch (k div pv)·p + k mod
    p; the k-th backward walks the chunks in reverse (module docstring)."""
    sm = p * v * m
    group = p * v
    total = m * v
    k = np.arange(total, dtype=np.int64)
    chunk = (k % group) // p
    microbatch = (k // group) * p + k % p
    orders = []
    for rank in range(p):
        fwd = (chunk * p + rank) * m + microbatch
        bwd = sm + ((v - 1 - chunk) * p + rank) * m + microbatch
        if m == p:
            warmup = total
        else:
            warmup = min(2 * (p - 1 - rank) + (v - 1) * p, total)
        steady = np.empty(2 * (total - warmup), dtype=np.int64)
        steady[0::2] = fwd[warmup:]
        steady[1::2] = bwd[:total - warmup]
        orders.append(np.concatenate([fwd[:warmup], steady, bwd[total - warmup:]]).tolist())
    return orders


# -- simulation -------------------------------------------------------------------------------

def _run(orders: list[list[int]], num_vstages: int, m: int, dur: list[list[float]],
         hop: list[float]) -> list[list[float]]:
    """Start time of every op of every rank. `hop[s]` is the latency between stages s-1 and s.

    Ends live in one table: F(key) at key, B(key) at sm + key; two more slots hold the end of
    "nothing" (0.0, what an op without a dependency waits on) and a sink for W's end (never
    waited on). Each op is first reduced to (index of the end it waits on, hop added to it,
    its duration, index of its own end), so the event loop only compares and adds. An op
    starts at max(rank free, end of its dependency + hop). A B on the last stage (after its
    own F) and a W (after its own B) wait on nothing: their dependency ran earlier on the same
    rank, so the rank's free time already covers it -- the same start, since a zero hop adds
    nothing. A rank runs its ops from an iterator until one waits on an end not yet known;
    that op is parked and the rank resumes with it once the end is written."""
    sm = num_vstages * m
    last = num_vstages - 1
    nothing, sink = 2 * sm, 2 * sm + 1
    hops = np.array(hop, dtype=np.float64)
    durs = np.array(dur, dtype=np.float64)
    plans = []
    for order in orders:
        kinds, keys = np.divmod(np.array(order, dtype=np.int64), sm)
        stages = keys // m
        is_f, is_b = kinds == _F, kinds == _B
        inner_b = is_b & (stages < last)
        dep = np.where(is_f & (stages > 0), keys - m, np.where(inner_b, sm + keys + m, nothing))
        gap = np.where(is_f & (stages > 0), hops[stages],
                       np.where(inner_b, hops[np.minimum(stages + 1, last)], 0.0))
        own = np.where(is_f, keys, np.where(is_b, sm + keys, sink))
        plans.append(zip(dep.tolist(), gap.tolist(), durs[kinds, stages].tolist(), own.tolist()))
    ends = [-1.0] * (2 * sm + 2)
    ends[nothing] = 0.0
    waiter = [-1] * (2 * sm + 2)  # the rank blocked on an end, at most one per end
    num_ranks = len(orders)
    parked: list[tuple | None] = [None] * num_ranks
    free = [0.0] * num_ranks
    starts: list[list[float]] = [[] for _ in range(num_ranks)]
    ready = list(range(num_ranks - 1, -1, -1))
    while ready:
        rank = ready.pop()
        record = starts[rank].append
        t = free[rank]
        ops = plans[rank]
        op = parked[rank]  # a parked op runs first: the end it waited on is known now
        if op is None:
            op = next(ops, None)
        while op is not None:
            d, g, length, o = op
            e = ends[d]
            if e < 0.0:
                waiter[d] = rank
                break
            e += g
            if e > t:
                t = e
            record(t)
            t += length
            ends[o] = t
            w = waiter[o]
            if w >= 0:
                ready.append(w)
            op = next(ops, None)
        parked[rank] = op
        free[rank] = t
    stuck = [r for r in range(num_ranks) if len(starts[r]) < len(orders[r])]
    if stuck:
        raise RuntimeError(f"internal error: pipeline schedule deadlocked on ranks {stuck}")
    return starts


def simulate_pipeline(*, schedule: PipelineSchedule | str, num_stages: int,
                      num_microbatches: int, virtual_stages: int = 1,
                      forward_s: Sequence[float] | float, backward_s: Sequence[float] | float,
                      weight_grad_s: Sequence[float] | float | None = None,
                      p2p_s: Sequence[float] | float = 0.0,
                      activation_bytes: Sequence[float] | None = None) -> PipelineTimeline:
    """Simulate one training step of `schedule` and return its timeline.

    `num_stages` is the number of pipeline ranks p; the model is cut into p·`virtual_stages`
    stages and every per-stage sequence has that many entries, in model order (stage s runs on
    rank s mod p); a single number stands for equal stages. `forward_s`, `backward_s`: seconds
    per micro-batch of each stage; the backward is the whole of it (input grad + weight
    grad). `weight_grad_s`: the weight-grad part of each stage's backward, needed by
    ``zero-bubble`` (B = backward - W) and ignored by the other schedules. `p2p_s`: send time
    of an activation (forward) or its gradient (backward) over each stage boundary, one number
    for all or p·v - 1 entries; a boundary between two stages on one rank costs nothing.
    `activation_bytes`: bytes one micro-batch keeps on each stage from the start of its F until
    its last B (or W) ends; given, `peak_inflight_bytes` holds each rank's peak of their sum
    (the same sweep as reading it off `ops`, which are built only when read).

    Raises ValueError for an unknown schedule, counts below 1, virtual_stages > 1 outside
    ``interleaved-1f1b``, ``interleaved-1f1b`` with num_microbatches not a multiple of
    num_stages, ``zero-bubble`` without weight_grad_s, sequences of the wrong length, and
    negative or non-finite times (or a weight-grad time above its backward).
    """
    kind = parse_schedule(schedule)
    p = _count("num_stages", num_stages)
    m = _count("num_microbatches", num_microbatches)
    v = _count("virtual_stages", virtual_stages)
    _check_shape(kind, p, m, v)
    n = p * v
    what = f"one per pipeline stage: num_stages*virtual_stages = {p}*{v}"
    f_dur = _times("forward_s", forward_s, n, what)
    b_dur = _times("backward_s", backward_s, n, what)
    w_dur = [0.0] * n
    if weight_grad_s is not None:
        w_dur = _times("weight_grad_s", weight_grad_s, n, what)
        over = [s for s in range(n) if w_dur[s] > b_dur[s]]
        if over:
            s = over[0]
            raise ValueError(f"weight_grad_s[{s}] = {w_dur[s]!r} exceeds backward_s[{s}] = "
                             f"{b_dur[s]!r}; the weight grad is part of the backward")
    elif kind is PipelineSchedule.ZERO_BUBBLE:
        raise ValueError("schedule 'zero-bubble' needs weight_grad_s, the weight-grad part of "
                         "each stage's backward (B = backward - W)")
    p2p = _times("p2p_s", p2p_s, n - 1, f"one per stage boundary: num_stages*virtual_stages - 1"
                 f" = {n - 1}")
    if kind is PipelineSchedule.ZERO_BUBBLE:
        b_dur = [b - w for b, w in zip(b_dur, w_dur)]
    else:
        w_dur = [0.0] * n
    hop = [0.0] + [p2p[s - 1] if p > 1 else 0.0 for s in range(1, n)]

    if kind is PipelineSchedule.GPIPE:
        orders = _gpipe_order(p, m)
    elif kind is PipelineSchedule.INTERLEAVED_1F1B:
        orders = _interleaved_order(p, m, v)
    else:
        orders = _one_f_one_b_order(p, m, kind is PipelineSchedule.ZERO_BUBBLE)
    sizes = None
    if activation_bytes is not None:
        sizes = _times("activation_bytes", activation_bytes, n, what)
    starts = _run(orders, n, m, [f_dur, b_dur, w_dur], hop)
    return _timeline(kind, p, m, v, orders, starts, [f_dur, b_dur, w_dur], sizes)


def _timeline(kind: PipelineSchedule, p: int, m: int, v: int, orders: list[list[int]],
              starts: list[list[float]], dur: list[list[float]],
              sizes: list[float] | None = None) -> PipelineTimeline:
    """Per-rank numbers of a simulated run, as array arithmetic over a [rank, op] table (every
    rank runs the same number of ops: each of its stages' for every micro-batch).

    Sums run along each rank's ops in op order (`np.cumsum` accumulates left to right, as a
    Python loop would), so busy times and in-flight bytes do not depend on how they are
    computed."""
    sm = p * v * m
    table = np.array(dur, dtype=np.float64)  # [kind, stage]
    kinds, keys = np.divmod(np.array(orders, dtype=np.int64), sm)
    stages = keys // m
    lengths = table[kinds, stages]
    start_s = np.array(starts, dtype=np.float64)
    end_s = start_s + lengths
    step = max(0.0, float(end_s[:, -1].max()))  # ops of a rank run in order: its last ends last
    busy = np.cumsum(lengths, axis=1)[:, -1].tolist()
    held = np.cumsum(np.where(kinds == _F, 1, np.where(kinds == _B, -1, 0)), axis=1)
    peak = np.maximum(held.max(axis=1), 0).tolist()
    peak_bytes = () if sizes is None else tuple(
        _peak_bytes(kinds, stages, keys, start_s, end_s, np.array(sizes, dtype=np.float64), sm))
    idle = tuple(step - b for b in busy)
    mean_busy = sum(busy) / p
    fraction = (step - mean_busy) / step if step > 0 else 0.0
    logger.debug("%s p=%d m=%d v=%d: step %.6g s, bubble %.3f", kind.value, p, m, v, step,
                 fraction)
    runs = tuple((kinds[r], stages[r], keys[r] % m, start_s[r], end_s[r]) for r in range(p))
    return PipelineTimeline(schedule=kind, num_stages=p, num_microbatches=m, virtual_stages=v,
                            step_time_s=step, busy_s=tuple(busy), idle_s=idle,
                            bubble_fraction=fraction, peak_inflight_microbatches=tuple(peak),
                            peak_inflight_bytes=peak_bytes, runs=runs)


def _peak_bytes(kinds: np.ndarray, stages: np.ndarray, keys: np.ndarray, start_s: np.ndarray,
                end_s: np.ndarray, sizes: np.ndarray, sm: int) -> list[float]:
    """Peak activation bytes of each rank (rows of the [rank, op] arrays): a (stage,
    micro-batch) holds sizes[stage] from its F's start to the end of its last B or W. A rank's
    events sort by (time, release before acquire, size) and are summed in that order (the
    order fixes the floating-point sum); the rank is the first sort key, so each row sorts
    and sums on its own."""
    p = len(kinds)
    forward = kinds == _F
    last_use = np.zeros(sm)  # a key's stage lives on one rank: one table serves all ranks
    np.maximum.at(last_use, keys[~forward], end_s[~forward])
    size = sizes[stages[forward]].reshape(p, -1)  # every rank runs as many F's
    times = np.concatenate([start_s[forward].reshape(p, -1),
                            last_use[keys[forward]].reshape(p, -1)], axis=1)
    flags = np.concatenate([np.ones_like(size, dtype=np.int64),
                            np.zeros_like(size, dtype=np.int64)], axis=1)
    deltas = np.concatenate([size, -size], axis=1)
    rank = np.repeat(np.arange(p), deltas.shape[1])
    order = np.lexsort((deltas.ravel(), flags.ravel(), times.ravel(), rank))
    live = np.cumsum(deltas.ravel()[order].reshape(p, -1), axis=1)
    return live.max(axis=1, initial=0.0).tolist()


# -- closed forms for uniform stages ----------------------------------------------------------

def _uniform_times(**times: float) -> list[float]:
    return [_times(name, value, 1, "one number for every stage")[0]
            for name, value in times.items()]


def gpipe_step_time(*, num_stages: int, num_microbatches: int, forward_s: float,
                    backward_s: float, p2p_s: float = 0.0) -> float:
    """GPipe on p equal stages: (m + p - 1)(f + b) + 2(p - 1)·p2p.

    The forward wave fills in (p - 1)(f + p2p) and the backward wave drains in
    (p - 1)(b + p2p); in between every rank works without a gap.
    """
    p = _count("num_stages", num_stages)
    m = _count("num_microbatches", num_microbatches)
    f, b, c = _uniform_times(forward_s=forward_s, backward_s=backward_s, p2p_s=p2p_s)
    return (m + p - 1) * (f + b) + 2 * (p - 1) * c


def one_f_one_b_step_time(*, num_stages: int, num_microbatches: int, forward_s: float,
                          backward_s: float) -> float:
    """1F1B on p equal stages without p2p time: (m + p - 1)(f + b), the same as GPipe.

    With p2p time the steady state itself stretches (each F/B pair waits for a round trip), so
    use the simulator.
    """
    p = _count("num_stages", num_stages)
    m = _count("num_microbatches", num_microbatches)
    f, b = _uniform_times(forward_s=forward_s, backward_s=backward_s)
    return (m + p - 1) * (f + b)


def interleaved_step_time(*, num_stages: int, num_microbatches: int, virtual_stages: int,
                          forward_s: float, backward_s: float) -> float:
    """Interleaved 1F1B on p ranks of v equal chunks, no p2p time: m(f + b) + (p - 1)(f + b)/v.

    `forward_s`, `backward_s` are a rank's whole share (all v chunks); the bubble is Megatron's
    (p - 1)(f + b)/v, i.e. (p - 1)/(v·m) of the ideal m(f + b). Needs m % p == 0.
    """
    p = _count("num_stages", num_stages)
    m = _count("num_microbatches", num_microbatches)
    v = _count("virtual_stages", virtual_stages)
    _check_shape(PipelineSchedule.INTERLEAVED_1F1B, p, m, v)
    f, b = _uniform_times(forward_s=forward_s, backward_s=backward_s)
    return (m + (p - 1) / v) * (f + b)
