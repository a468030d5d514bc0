"""The pipeline-schedule simulator against closed forms, published bubbles and brute force.

Oracles: GPipe/1F1B step (m + p - 1)(f + b) on equal stages (Huang et al. 2019; Narayanan et
al. 2021), Megatron's interleaved bubble (p - 1)(f + b)/v, i.e. (p - 1)/(v·m) of the ideal
m(f + b) (Narayanan et al. 2021 §2.2.2); ZB-H1's bubble (p - 1)(T_F + T_B - T_W) against
1F1B's (p - 1)(T_F + T_B + T_W) (Qi et al. 2023 §2.1); the forward-fill lower bound (rank r
cannot start before the forwards of the stages ahead of it); and, on random non-uniform
instances, a brute-force re-check of every op: one F/B(/W) per (stage, micro-batch), on its
rank, with its duration, after its dependency plus hop, as early as its rank and dependency
allow, never overlapping, and in-flight counts recounted from the op lists.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodels.pipeline import (OpKind, PipelineSchedule, gpipe_step_time,
                                 interleaved_step_time, one_f_one_b_step_time, simulate_pipeline)

SCHEDULES = [s.value for s in PipelineSchedule]


def uniform(schedule, p, m, v=1, f=1.0, b=2.0, w=None, p2p=0.0, **extra):
    """Equal stages; f, b, w are a rank's whole share, split evenly over its v chunks."""
    n = p * v
    return simulate_pipeline(schedule=schedule, num_stages=p, num_microbatches=m,
                             virtual_stages=v, forward_s=[f / v] * n, backward_s=[b / v] * n,
                             weight_grad_s=None if w is None else [w / v] * n, p2p_s=p2p,
                             **extra)


# -- closed forms -----------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 16])
def test_gpipe_and_1f1b_take_m_plus_p_minus_1_slots(schedule, p, m):
    for f, b in [(1.0, 2.0), (1.0, 1.0), (0.5, 3.0)]:
        t = uniform(schedule, p, m, f=f, b=b)
        assert t.step_time_s == pytest.approx((m + p - 1) * (f + b))
        assert t.busy_s == pytest.approx([m * (f + b)] * p)
        assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert gpipe_step_time(num_stages=p, num_microbatches=m, forward_s=f, backward_s=b) \
            == pytest.approx(t.step_time_s)
        assert one_f_one_b_step_time(num_stages=p, num_microbatches=m, forward_s=f,
                                     backward_s=b) == pytest.approx(t.step_time_s)


@pytest.mark.parametrize("p,m", [(2, 1), (2, 5), (4, 4), (4, 9), (8, 16)])
def test_gpipe_pays_p2p_once_per_hop_of_each_wave(p, m):
    # forward wave fills in (p-1)(f+c), backward wave drains in (p-1)(b+c); no gaps between
    f, b, c = 1.0, 2.0, 0.25
    t = uniform("gpipe", p, m, f=f, b=b, p2p=c)
    assert t.step_time_s == pytest.approx((m + p - 1) * (f + b) + 2 * (p - 1) * c)
    assert gpipe_step_time(num_stages=p, num_microbatches=m, forward_s=f, backward_s=b,
                           p2p_s=c) == pytest.approx(t.step_time_s)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_interleaved_bubble_is_megatrons_p_minus_1_over_v(p, v, rounds):
    m = rounds * p
    for f, b in [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)]:
        t = uniform("interleaved-1f1b", p, m, v=v, f=f, b=b)
        ideal = m * (f + b)
        bubble = t.step_time_s - ideal
        assert bubble == pytest.approx((p - 1) * (f + b) / v, abs=1e-9)
        assert bubble / ideal == pytest.approx((p - 1) / (v * m), abs=1e-12)  # Megatron's ratio
        assert t.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
        assert interleaved_step_time(num_stages=p, num_microbatches=m, virtual_stages=v,
                                     forward_s=f, backward_s=b) == pytest.approx(t.step_time_s)


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (4, 16), (8, 8), (8, 24)])
def test_zero_bubble_h1_has_a_third_of_1f1bs_bubble_at_equal_f_b_w(p, m):
    # the paper's setting: T_F = T_B = T_W = 1, 1F1B's backward is B + W = 2
    zb = uniform("zero-bubble", p, m, f=1.0, b=2.0, w=1.0)
    ofob = uniform("1f1b", p, m, f=1.0, b=2.0)
    work = m * 3.0
    assert zb.step_time_s - work == pytest.approx((p - 1) * 1.0)        # (p-1)(F + B - W)
    assert ofob.step_time_s - work == pytest.approx((p - 1) * 3.0)      # (p-1)(F + B + W)
    assert zb.peak_inflight_microbatches == ofob.peak_inflight_microbatches
    assert zb.peak_inflight_microbatches == tuple(p - i for i in range(p))


@pytest.mark.parametrize("f,bi,w", [(1.0, 1.0, 0.5), (1.0, 1.0, 0.25), (2.0, 1.0, 1.0),
                                    (1.0, 2.0, 1.0), (2.0, 3.0, 0.5), (0.5, 1.0, 0.0)])
@pytest.mark.parametrize("p,m", [(4, 8), (8, 16), (3, 7)])
def test_zero_bubble_h1_bubble_is_the_papers_when_w_is_the_shortest_pass(f, bi, w, p, m):
    t = uniform("zero-bubble", p, m, f=f, b=bi + w, w=w)
    assert t.step_time_s - m * (f + bi + w) == pytest.approx((p - 1) * (f + bi - w))
    assert t.step_time_s <= uniform("1f1b", p, m, f=f, b=bi + w).step_time_s + 1e-9


@pytest.mark.parametrize("f,bi,w", [(1.0, 1.0, 1.5), (1.0, 0.5, 1.0), (1.0, 0.3, 0.7),
                                    (1.0, 2.0, 1.5), (0.5, 2.0, 1.0)])
@pytest.mark.parametrize("p,m", [(4, 8), (8, 16)])
def test_zero_bubble_h1_meets_the_lower_bound_when_w_is_longer(f, bi, w, p, m):
    # any schedule idles (p-1)·f on the last rank (forward fill) and, holding at most p
    # micro-batches like 1F1B, (p-1)·b on the first rank while its first B comes back
    t = uniform("zero-bubble", p, m, f=f, b=bi + w, w=w)
    assert t.step_time_s == pytest.approx((p - 1) * max(f, bi) + m * (f + bi + w))


# -- in-flight micro-batches ------------------------------------------------------------------

@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 4, 8, 20])
def test_inflight_1f1b_holds_p_minus_i_and_gpipe_holds_m(p, m):
    assert uniform("1f1b", p, m).peak_inflight_microbatches == \
        tuple(min(p - i, m) for i in range(p))
    assert uniform("gpipe", p, m).peak_inflight_microbatches == (m,) * p
    assert uniform("zero-bubble", p, m, w=1.0).peak_inflight_microbatches == \
        tuple(min(p - i, m) for i in range(p))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 4), (8, 2, 16)])
def test_inflight_interleaved_is_megatrons_warmup_plus_one_chunk(p, v, m):
    # rank i warms up 2(p-1-i) + (v-1)p chunk micro-batches (all m·v when m == p), plus the
    # forward of its first steady (F, B) pair
    t = uniform("interleaved-1f1b", p, m, v=v)
    expect = tuple(m * v if m == p else min(2 * (p - 1 - i) + (v - 1) * p + 1, m * v)
                   for i in range(p))
    assert t.peak_inflight_microbatches == expect


# -- p = 1 and p2p ----------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("m", [1, 2, 5])
def test_one_rank_runs_m_times_f_plus_b_with_no_bubble(schedule, m):
    v = 3 if schedule == "interleaved-1f1b" else 1
    fs, bs = [0.5, 1.0, 0.25][:v], [1.0, 2.5, 0.75][:v]
    t = simulate_pipeline(schedule=schedule, num_stages=1, num_microbatches=m,
                          virtual_stages=v, forward_s=fs, backward_s=bs,
                          weight_grad_s=[0.5 * b for b in bs], p2p_s=0.3)  # same-rank hops free
    assert t.step_time_s == pytest.approx(m * (sum(fs) + sum(bs)))
    assert t.bubble_fraction == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_p2p_time_lengthens_the_step_on_equal_stages(schedule, p):
    v = 2 if schedule == "interleaved-1f1b" else 1
    for m in (p, 2 * p):
        base = uniform(schedule, p, m, v=v, w=1.0).step_time_s
        assert uniform(schedule, p, m, v=v, w=1.0, p2p=0.01).step_time_s > base


# -- brute force on random non-uniform instances ----------------------------------------------

@st.composite
def instances(draw):
    schedule = draw(st.sampled_from(SCHEDULES))
    p = draw(st.integers(1, 4))
    v = draw(st.integers(1, 3)) if schedule == "interleaved-1f1b" else 1
    m = p * draw(st.integers(1, 3)) if schedule == "interleaved-1f1b" else draw(st.integers(1, 7))
    n = p * v
    time = st.floats(0.0, 4.0, allow_nan=False).map(lambda x: round(x, 2))
    fs = draw(st.lists(time, min_size=n, max_size=n))
    bs = draw(st.lists(time, min_size=n, max_size=n))
    ws = [round(b * draw(st.floats(0.0, 1.0)), 3) for b in bs]
    ws = [min(w, b) for w, b in zip(ws, bs)]
    p2p = draw(st.lists(st.floats(0.0, 0.5).map(lambda x: round(x, 2)),
                        min_size=n - 1, max_size=n - 1))
    return dict(schedule=schedule, num_stages=p, num_microbatches=m, virtual_stages=v,
                forward_s=fs, backward_s=bs, weight_grad_s=ws, p2p_s=p2p)


def _durations(kw):
    zb = kw["schedule"] == "zero-bubble"
    bs = [b - w for b, w in zip(kw["backward_s"], kw["weight_grad_s"])] if zb \
        else list(kw["backward_s"])
    return {OpKind.F: kw["forward_s"], OpKind.B: bs, OpKind.W: kw["weight_grad_s"]}, zb


@settings(max_examples=250, deadline=None)
@given(instances())
def test_every_op_respects_dependencies_ranks_and_runs_as_early_as_allowed(kw):
    t = simulate_pipeline(**kw)
    p, m, v = kw["num_stages"], kw["num_microbatches"], kw["virtual_stages"]
    n = p * v
    dur, zb = _durations(kw)
    hop = [0.0] + [kw["p2p_s"][s - 1] if p > 1 else 0.0 for s in range(1, n)]
    eps = 1e-9

    seen = {}
    for rank, ops in enumerate(t.ops):
        for op in ops:
            assert op.stage % p == rank
            assert op.end_s - op.start_s == pytest.approx(dur[op.kind][op.stage], abs=eps)
            assert (op.kind, op.stage, op.microbatch) not in seen
            seen[op.kind, op.stage, op.microbatch] = op
    kinds = (OpKind.F, OpKind.B, OpKind.W) if zb else (OpKind.F, OpKind.B)
    assert set(seen) == {(k, s, j) for k in kinds for s in range(n) for j in range(m)}

    def dependency_ready(op):
        if op.kind is OpKind.F:
            return 0.0 if op.stage == 0 else seen[OpKind.F, op.stage - 1, op.microbatch].end_s \
                + hop[op.stage]
        if op.kind is OpKind.B:
            if op.stage == n - 1:
                return seen[OpKind.F, op.stage, op.microbatch].end_s
            return seen[OpKind.B, op.stage + 1, op.microbatch].end_s + hop[op.stage + 1]
        return seen[OpKind.B, op.stage, op.microbatch].end_s

    for ops in t.ops:
        free = 0.0
        for op in ops:
            ready = dependency_ready(op)
            assert op.start_s >= ready - eps and op.start_s >= free - eps  # deps, no overlap
            assert op.start_s == pytest.approx(max(ready, free), abs=eps)  # as early as allowed
            free = op.end_s

    step = t.step_time_s
    assert step == pytest.approx(max((o.end_s for ops in t.ops for o in ops), default=0.0))
    assert step >= max(t.busy_s) - eps
    one_microbatch = sum(dur[OpKind.F]) + sum(dur[OpKind.B]) + 2 * sum(hop)
    assert step >= one_microbatch - eps
    if v == 1:  # forward fill: rank r starts no earlier than the forwards ahead of it
        for r in range(p):
            fill = sum(dur[OpKind.F][:r]) + sum(hop[1:r + 1])
            assert step >= fill + t.busy_s[r] - eps
    assert [b + i for b, i in zip(t.busy_s, t.idle_s)] == pytest.approx([step] * p)
    if step > 0:
        assert t.bubble_fraction == pytest.approx((step - sum(t.busy_s) / p) / step)

    for rank, ops in enumerate(t.ops):  # recount in-flight from op positions
        index = {(o.kind, o.stage, o.microbatch): i for i, o in enumerate(ops)}
        peak = 0
        for i, op in enumerate(ops):
            if op.kind is OpKind.F:
                live = sum(1 for (k, s, j), at in index.items() if k is OpKind.F and at <= i
                           and index[OpKind.B, s, j] > i)
                peak = max(peak, live)
        assert t.peak_inflight_microbatches[rank] == peak


def _reference_starts(kw, t):
    """The docstring's rule run naively: sweep the ranks over and over, placing a rank's next
    op (in the simulator's order) once its dependency has ended, at max(rank free, end of the
    dependency + hop), end = start + duration -- the same float operations, in the same order,
    as the simulator, so the numbers must agree to the last bit."""
    p, v = kw["num_stages"], kw["virtual_stages"]
    n = p * v
    dur, _ = _durations(kw)
    hop = [0.0] + [kw["p2p_s"][s - 1] if p > 1 else 0.0 for s in range(1, n)]
    ends: dict = {}
    free = [0.0] * p
    pos = [0] * p
    starts: list[list[float]] = [[] for _ in range(p)]
    while any(pos[r] < len(t.ops[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(t.ops[r]):
                op = t.ops[r][pos[r]]
                s, j = op.stage, op.microbatch
                if op.kind is OpKind.F:
                    dep = (OpKind.F, s - 1, j, hop[s]) if s > 0 else None
                elif op.kind is OpKind.B:
                    dep = (OpKind.B, s + 1, j, hop[s + 1]) if s < n - 1 else (OpKind.F, s, j, 0.0)
                else:
                    dep = (OpKind.B, s, j, 0.0)
                start = free[r]
                if dep is not None:
                    if dep[:3] not in ends:
                        break
                    start = max(start, ends[dep[:3]] + dep[3])
                starts[r].append(start)
                free[r] = ends[op.kind, s, j] = start + dur[op.kind][s]
                pos[r] += 1
                moved = True
        assert moved, "the reference deadlocked"
    return starts


@settings(max_examples=200, deadline=None)
@given(instances(), st.floats(0.1, 3.0))
def test_event_loop_equals_a_naive_sweep_to_the_last_bit(kw, scale):
    # times that are no short decimals (scaled by an arbitrary float), so any reordering of the
    # float operations in the event loop would show up as a last-bit difference
    kw = {**kw, **{k: [x * scale / 3 for x in kw[k]]
                   for k in ("forward_s", "backward_s", "weight_grad_s", "p2p_s")}}
    kw["weight_grad_s"] = [min(w, b) for w, b in zip(kw["weight_grad_s"], kw["backward_s"])]
    t = simulate_pipeline(**kw)
    reference = _reference_starts(kw, t)
    assert [[op.start_s for op in ops] for ops in t.ops] == reference
    assert t.step_time_s == max((o.end_s for ops in t.ops for o in ops), default=0.0)


@settings(max_examples=60, deadline=None)
@given(instances(), st.floats(0.01, 0.5))
def test_more_p2p_time_never_shortens_the_step(kw, extra):
    base = simulate_pipeline(**kw)
    slower = simulate_pipeline(**{**kw, "p2p_s": [c + extra for c in kw["p2p_s"]]})
    assert slower.step_time_s >= base.step_time_s - 1e-9


@settings(max_examples=120, deadline=None)
@given(instances(), st.data())
def test_peak_inflight_bytes_is_the_most_activation_bytes_held_at_once(kw, data):
    # oracle: live bytes just after each F starts, recounted from the recorded ops (a pair
    # holds its bytes from its F's start until its last B or W ends); and the same number as
    # reading the sweep off the recorded timeline (autopar.estimate.memory)
    from autopar.estimate.memory import peak_inflight_bytes

    n = kw["num_stages"] * kw.get("virtual_stages", 1)
    sizes = data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.5, 1e9, 123456789.125]),
                               min_size=n, max_size=n))
    full = simulate_pipeline(**kw, activation_bytes=sizes)
    for rank, ops in enumerate(full.ops):
        assert full.peak_inflight_bytes[rank] == peak_inflight_bytes(full, rank, sizes)
        held = {}
        for op in ops:
            key = (op.stage, op.microbatch)
            start, end = held.get(key, (math.inf, 0.0))
            held[key] = (min(start, op.start_s) if op.kind is OpKind.F else start,
                         max(end, op.end_s) if op.kind is not OpKind.F else end)
        peak = max([sum(sizes[s] for (s, _), (a, b) in held.items() if a <= t < b)
                    for t, _ in held.values()] + [0.0])
        assert full.peak_inflight_bytes[rank] == pytest.approx(peak, rel=1e-12, abs=1e-9)


# -- input checks -----------------------------------------------------------------------------

GOOD = dict(schedule="1f1b", num_stages=2, num_microbatches=4, forward_s=[1.0, 1.0],
            backward_s=[2.0, 2.0])


@pytest.mark.parametrize("change,message", [
    (dict(schedule="pipedream"), r"unknown pipeline schedule 'pipedream'; allowed: gpipe, 1f1b"),
    (dict(num_stages=0), r"num_stages must be an integer >= 1, got 0"),
    (dict(num_stages=2.0), r"num_stages must be an integer >= 1"),
    (dict(num_microbatches=0), r"num_microbatches must be an integer >= 1, got 0"),
    (dict(virtual_stages=0), r"virtual_stages must be an integer >= 1"),
    (dict(virtual_stages=2, forward_s=[1.0] * 4, backward_s=[2.0] * 4),
     r"virtual_stages=2 needs schedule 'interleaved-1f1b'"),
    (dict(schedule="interleaved-1f1b", num_microbatches=3),
     r"divisible by num_stages .*num_microbatches=3, num_stages=2"),
    (dict(forward_s=[1.0] * 3), r"forward_s has 3 entries; expected 2"),
    (dict(schedule="interleaved-1f1b", virtual_stages=2),
     r"forward_s has 2 entries; expected 4 \(one per pipeline stage"),
    (dict(backward_s=[2.0, -1.0]), r"backward_s must hold finite times >= 0 seconds, got -1.0"),
    (dict(forward_s=[1.0, math.nan]), r"forward_s must hold finite times >= 0"),
    (dict(p2p_s=-0.1), r"p2p_s must hold finite times >= 0"),
    (dict(p2p_s=[0.1, 0.1]), r"p2p_s has 2 entries; expected 1 \(one per stage boundary"),
    (dict(schedule="zero-bubble"), r"'zero-bubble' needs weight_grad_s"),
    (dict(weight_grad_s=[1.0, 3.0]), r"weight_grad_s\[1\] = 3.0 exceeds backward_s\[1\]"),
])
def test_bad_inputs_say_what_is_wrong_and_what_is_allowed(change, message):
    with pytest.raises(ValueError, match=message):
        simulate_pipeline(**{**GOOD, **change})


def test_schedule_enum_and_interleaved_closed_form_check_their_inputs():
    t = simulate_pipeline(**{**GOOD, "schedule": PipelineSchedule.GPIPE})
    assert t.schedule is PipelineSchedule.GPIPE and t.num_stages == 2
    with pytest.raises(ValueError, match="divisible by num_stages"):
        interleaved_step_time(num_stages=4, num_microbatches=6, virtual_stages=2,
                              forward_s=1.0, backward_s=2.0)
