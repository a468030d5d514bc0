"""The outer search's columnar space and bounds against one-config oracles.

- enumeration: the table lists the same configs in the same order as the nested loops it
  replaced (kept here as the oracle), with and without constraints, for dense and MoE models;
- bounds: the column forms of the memory lower bound (model states) and of
  `step_lower_bound` equal the one-config forms bit for bit, and both stay below what
  `evaluate(exact=False)` predicts; the first pipeline rank's memory never exceeds the
  closed-form peak (it is the rank-0 term of that maximum);
- skipping configs that cannot fit changes neither the plan nor its fitting candidates, and a
  saved plan not at all.
"""

import functools

import numpy as np
import pytest
import torch

import autopar
from autopar import ParallelConfig
from autopar.config import divisors
from autopar.estimate import EstimateOptions, ModelCosts, evaluate
from autopar.estimate.bounds import data_parallel_floor, step_lower_bound
from autopar.estimate.core import EvalCache
from autopar.estimate.memory import activation_bytes
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.mixtral import Mixtral, MixtralConfig
from autopar.search import bounds, outer, space
from autopar.search.candidates import space_table
from autopar.search.context import SearchContext
from autopar.search.outer import SearchSettings, enumerate_configs
from autopar.search.space import first_rank_memory, states_lower_bounds
from costmodels.memory import COMM_BUFFER_BYTES, CUDA_CONTEXT_BYTES, state_bytes_per_param

SEQ = 1024


@functools.lru_cache(maxsize=None)
def gpt_costs(layers: int = 6) -> ModelCosts:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=8192, max_seq_len=SEQ, dim=512, n_layers=layers,
                              n_heads=8))
    return ModelCosts.from_graph(autopar.trace(model, global_batch_size=1, seq_len=SEQ))


@functools.lru_cache(maxsize=None)
def moe_costs() -> ModelCosts:
    with torch.device("meta"):
        model = Mixtral(MixtralConfig(vocab_size=8192, dim=512, n_layers=4, n_heads=8,
                                      n_kv_heads=4, ffn_dim=1024, max_seq_len=SEQ,
                                      num_experts=8, top_k=2))
    return ModelCosts.from_graph(autopar.trace(model, global_batch_size=1, seq_len=SEQ))


def _oracle_configs(costs, cluster, *, global_batch_size, constraints, options, settings):
    """The enumeration as nested loops over ParallelConfig objects (the pre-columnar code)."""
    def allowed(name, values):
        return [v for v in values if v == constraints[name]] if name in constraints else values

    world, g, heads = cluster.world_size, cluster.gpus_per_node, costs.num_heads
    kv_heads = costs.num_kv_heads
    body = max(u.count for u in costs.units)
    gbs = global_batch_size
    for tp in allowed("tp", [t for t in divisors(world)
                             if t <= g and (heads is None or heads % t == 0)
                             # K/V split by head, or replicated where tp is a multiple of
                             # their heads
                             and (kv_heads is None or kv_heads % t == 0
                                  or t % kv_heads == 0)]):
        cps = [c for c in divisors(world // tp) if c <= settings.max_cp
               and (c == 1 or (heads is not None and costs.seq_len
                               and costs.seq_len % (2 * c) == 0))]
        for cp in allowed("cp", cps):
            for pp in allowed("pp", [p for p in divisors(world // (tp * cp))
                                     if p <= costs.num_layers]):
                dp = world // (tp * cp * pp)
                if ("dp" in constraints and constraints["dp"] != dp) or gbs % dp:
                    continue
                eps = [(e, 0) for e in divisors(dp * cp)
                       if costs.num_experts and costs.num_experts % e == 0] or [(1, 0)]
                if costs.num_experts and tp > 1 and costs.seq_len % (tp * cp) == 0:
                    # ep folded over tp x cp x dp, experts whole: with SP only
                    eps += [(e, 1) for e in divisors(dp * cp * tp)
                            if costs.num_experts % e == 0]
                for ep, etp in eps:
                    if constraints.get("ep", ep) != ep or constraints.get("etp", etp) != etp:
                        continue
                    zeros = [0, 1, 2, 3] if dp * cp > 1 else [0]
                    sps = [False, True] if tp > 1 else [False]
                    rcs = ["none"] + ["selective"] * (options.attention_kernel == "math") \
                        + ["per_op"] * costs.per_op_costed + ["full"]
                    if pp == 1:
                        scheds = [("1f1b", 1)]
                    else:
                        vs = [v for v in range(2, settings.max_virtual_stages + 1)
                              if body // pp >= v and body % (pp * v) == 0]
                        scheds = [("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1)] + \
                            [("interleaved-1f1b", v) for v in vs]
                    for mbs in allowed("micro_batch_size",
                                       [b for b in divisors(gbs // dp)
                                        if b <= settings.max_micro_batch_size]):
                        m = gbs // (dp * mbs)
                        everies = [k for k in settings.recompute_every
                                   if k == 1 or k * pp <= body]
                        choices = [(rc, k) for rc in allowed("recompute", rcs)
                                   for k in (everies if rc == "full" else [1])]
                        for rc, every in choices:
                            if constraints.get("recompute_every", every) != every:
                                continue
                            for sp in allowed("sequence_parallel",
                                              [True] if etp and True in sps else
                                              [] if etp else sps):
                                for sched, v in scheds:
                                    if constraints.get("pp_schedule", sched) != sched or \
                                            constraints.get("virtual_stages", v) != v:
                                        continue
                                    if sched == "interleaved-1f1b" and m % pp:
                                        continue
                                    if m < pp and sched != "gpipe":  # GPipe alone runs it
                                        continue
                                    if every * pp * v > body:  # k blocks in every chunk
                                        continue
                                    for zero in allowed("zero_stage", zeros):
                                        yield ParallelConfig(
                                            dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp,
                                            zero_stage=zero,
                                            micro_batch_size=mbs, pp_schedule=sched,
                                            virtual_stages=v, sequence_parallel=sp,
                                            recompute=rc, recompute_every=every)


def _states_oracle(costs, cfg, dtype):
    dense = sum(u.dense_params * u.count for u in costs.units) / (cfg.tp * cfg.pp)
    expert = sum(u.expert_params * u.count for u in costs.units) / (
        (1 if cfg.etp else cfg.tp) * cfg.pp * cfg.ep)
    shards = cfg.dp * cfg.cp
    expert_shards = shards * (cfg.tp if cfg.etp else 1) // cfg.ep  # the ranks with its experts
    return (dense * state_bytes_per_param(dtype, cfg.zero_stage, shards)
            + expert * state_bytes_per_param(dtype, cfg.zero_stage, expert_shards)
            + COMM_BUFFER_BYTES + CUDA_CONTEXT_BYTES)


CASES = [
    ("gpt", 2, {}, EstimateOptions()),
    ("gpt", 4, {"tp": 2}, EstimateOptions(attention_kernel="math")),
    ("gpt", 2, {"pp_schedule": "interleaved-1f1b", "zero_stage": 1}, EstimateOptions()),
    ("gpt", 1, {"pp": 2, "micro_batch_size": 2, "sequence_parallel": True}, EstimateOptions()),
    ("moe", 2, {}, EstimateOptions()),
    ("moe", 1, {"ep": 4, "recompute": "full"}, EstimateOptions()),
]


def _case(kind, nodes, constraints, options):
    costs = gpt_costs() if kind == "gpt" else moe_costs()
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=nodes)
    kw = {"global_batch_size": 64, "constraints": constraints, "options": options,
          "settings": SearchSettings(max_virtual_stages=6)}
    return costs, cluster, kw


@pytest.mark.parametrize("kind,nodes,constraints,options", CASES)
def test_the_table_enumerates_what_the_nested_loops_did_in_their_order(kind, nodes, constraints,
                                                                        options):
    costs, cluster, kw = _case(kind, nodes, constraints, options)
    got = list(enumerate_configs(costs, cluster, **kw))
    assert got == list(_oracle_configs(costs, cluster, **kw))
    assert got and all(isinstance(getattr(c, f), type(getattr(got[0], f)))
                       for c in got for f in outer.CONFIG_FIELDS)


@pytest.mark.parametrize("kind,nodes,constraints,options", CASES)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_column_bounds_equal_the_one_config_forms_bit_for_bit(kind, nodes, constraints, options,
                                                              dtype):
    costs, cluster, kw = _case(kind, nodes, constraints, options)
    table = space_table(costs, cluster, **kw)
    configs = list(table.configs())
    states = states_lower_bounds(
        table, dense_params=sum(u.dense_params * u.count for u in costs.units),
        expert_params=sum(u.expert_params * u.count for u in costs.units), dtype=dtype)
    assert states.tolist() == [_states_oracle(costs, c, dtype) for c in configs]
    cache = EvalCache(cluster)
    rows = np.arange(len(table))
    step, failed, _ = bounds._step_bounds(
        SearchContext(costs=costs, cluster=cluster, global_batch_size=64, dtype=dtype,
                      options=options, cache=cache), table, rows)
    one = EvalCache(cluster)
    expected = []
    for c in configs:
        try:
            expected.append(step_lower_bound(costs, cluster, c, global_batch_size=64,
                                             dtype=dtype, options=options, cache=one))
        except ValueError:  # e.g. more pipeline chunks than layers: the search drops the row
            expected.append(None)
    assert failed.tolist() == [e is None for e in expected]
    assert any(e is not None for e in expected)
    assert step[~failed].tolist() == [e for e in expected if e is not None]


@pytest.mark.parametrize("kind,nodes,constraints,options", CASES + [
    ("gpt", 2, {}, EstimateOptions(overlap_dp_comm=False)),  # the traffic is all exposed
    ("moe", 2, {}, EstimateOptions(zero3_gather="sync", grad_reduce_dtype="bf16")),
])
def test_bounds_stay_below_the_closed_form_estimate(kind, nodes, constraints, options):
    costs, cluster, kw = _case(kind, nodes, constraints, options)
    table = space_table(costs, cluster, **kw)
    cache = EvalCache(cluster)
    rows = np.arange(len(table))
    step, _, work = bounds._step_bounds(
        SearchContext(costs=costs, cluster=cluster, global_batch_size=64, dtype="bf16",
                      options=options, cache=cache), table, rows)
    first = first_rank_memory(
        table, rows, units=cache.units,
        structure_of=functools.partial(bounds._split, costs, cache),
        activations_of=activation_bytes, dtype="bf16", global_batch_size=64, options=options)
    checked = lifted = exact = 0
    for i in range(0, len(table), max(1, len(table) // 300)):
        try:
            est = evaluate(costs, cluster, table.config(i), global_batch_size=64,
                           options=options, cache=cache, exact=False)
        except ValueError:
            continue
        checked += 1
        assert step[i] <= est.step_time_s
        # the data-parallel and optimizer floor the visit raises a bound by
        floor = data_parallel_floor(costs, cache, est.config, "bf16", options)
        raised = step[i] + floor.exposed_and_optimizer(work[i], est.num_microbatches)
        assert raised * (1 - 1e-9) <= est.step_time_s
        # the optimizer and traffic floors are at most the estimate's, and equal to them where
        # the floor's parameters are the heaviest rank's: with experts (the optimizer) and on
        # one pipeline rank (the traffic too, where one collective a step runs: ZeRO 0-2)
        assert floor.optimizer <= est.breakdown["optimizer"] * (1 + 1e-12)
        total = est.breakdown["dp_comm_total"]
        per_step = floor.traffic * (est.num_microbatches if floor.per_micro_batch else 1)
        assert per_step <= total * (1 + 1e-12)
        if kind == "moe" or est.config.pp == 1:
            assert floor.optimizer == pytest.approx(est.breakdown["optimizer"], rel=1e-12)
        if kind == "gpt" and est.config.pp == 1 and est.config.zero_stage < 3:
            assert per_step == pytest.approx(total, rel=1e-12)
            exact += 1
        lifted += raised > step[i]
        assert first[i] <= est.peak_memory_bytes * (1 + 1e-12)
        if est.config.pp == 1:  # one rank: the bound is the closed-form peak itself
            assert first[i] == pytest.approx(est.peak_memory_bytes, rel=1e-12)
    assert checked > 20 and lifted > checked // 2
    assert exact or kind == "moe" or constraints  # unpinned GPT spaces have pp=1 ZeRO 0-2 rows


def _small_gpt():
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=8192, max_seq_len=4096, dim=2048, n_layers=8,
                             n_heads=16))


def test_the_data_parallel_floor_changes_what_is_visited_not_the_plan(monkeypatch):
    # short sequences on 4 nodes: ZeRO-3's gathers over the network outlast the compute, so
    # the floor raises bounds; oracle: every raised bound stays below its closed-form
    # estimate, and the search without the floor picks the same plan
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=4, device_memory_gb=10)
    kw = dict(global_batch_size=64, seq_len=512, settings=SearchSettings(progress=False))
    costs = ModelCosts.from_graph(autopar.trace(_small_gpt(), global_batch_size=1, seq_len=512))
    table = space_table(costs, cluster, global_batch_size=64, constraints={},
                         options=EstimateOptions(), settings=SearchSettings())
    cache = EvalCache(cluster)
    rows = np.flatnonzero(table.columns["zero_stage"] == 3)
    step, failed, work = bounds._step_bounds(
        SearchContext(costs=costs, cluster=cluster, global_batch_size=64, dtype="bf16",
                      cache=cache), table, rows)
    raised = 0
    for k in np.flatnonzero(~failed)[::7]:
        cfg = table.config(int(rows[k]))
        est = evaluate(costs, cluster, cfg, global_batch_size=64, cache=cache, exact=False)
        floor = data_parallel_floor(costs, cache, cfg, "bf16", EstimateOptions())
        gap = floor.exposed_and_optimizer(work[k], est.num_microbatches) - floor.optimizer
        assert step[k] + gap + floor.optimizer <= est.step_time_s * (1 + 1e-9)
        raised += gap > 0
    assert raised > 10
    with_floor = autopar.compile(_small_gpt(), cluster, **kw)
    monkeypatch.setattr(outer, "data_parallel_floor", lambda *args: None)
    without = autopar.compile(_small_gpt(), cluster, **kw)
    assert with_floor.config == without.config and with_floor.estimate == without.estimate
    a, b = with_floor.candidates, without.candidates
    assert len(a) < len(b)  # configs the floor ruled out were not evaluated
    assert set(map(tuple, a.values.tolist())) <= set(map(tuple, b.values.tolist()))


@pytest.mark.parametrize("build,memory_gb,gbs,seq,constraints", [
    (_small_gpt, 10, 64, 4096, {}),  # 23 fitting rows of 44 visited
    (lambda: autopar.models.build("gpt3-6.7b"), 32, 64, 2048,  # 8 fitting rows
     {"tp": 1, "pp": 1, "cp": 1}),
])
def test_skipping_configs_that_cannot_fit_keeps_the_plan_and_its_fitting_candidates(
        build, memory_gb, gbs, seq, constraints):
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=1, device_memory_gb=memory_gb)
    plans = {k: autopar.compile(build(), cluster, global_batch_size=gbs, seq_len=seq,
                                constraints=constraints,
                                settings=SearchSettings(progress=False, list_unfit_below=k))
             for k in (0, 10**9)}
    skip, full = plans[0], plans[10**9]
    assert skip.config == full.config and skip.estimate == full.estimate
    a, b = skip.candidates, full.candidates
    assert len(a) < len(b)
    fitting = lambda t: t[t["fits"] | t["exact"]].reset_index(drop=True)  # noqa: E731
    assert fitting(a).equals(fitting(b))
    assert skip.search["num_pruned_by_memory"] > full.search["num_pruned_by_memory"]
    assert skip.to_json() == full.to_json()  # a saved plan keeps fitting rows only
    # by default the table lists every visited config while fewer fit than are simulated
    settings = SearchSettings(progress=False)
    default = autopar.compile(build(), cluster, global_batch_size=gbs, seq_len=seq,
                              constraints=constraints, settings=settings)
    assert default.to_json() == full.to_json()
    if b["fits"].sum() < settings.list_unfit_below:
        assert default.candidates.equals(b)


@pytest.mark.parametrize("exact", [False, True])
def test_evaluations_through_a_shared_cache_equal_fresh_ones(exact):
    # the search memoises layouts, pipeline terms and simulations across configs; none of it
    # may leak between configs that share a layout (ZeRO stages, schedules, global batch)
    costs = gpt_costs()
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
    shared = EvalCache(cluster)
    configs = [ParallelConfig(dp=4 // pp, tp=2, pp=pp, zero_stage=z, pp_schedule=s,
                              virtual_stages=v, sequence_parallel=True)
               for pp in (1, 2) for z in (0, 1, 3)
               for s, v in ([("1f1b", 1)] if pp == 1 else
                            [("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1),
                             ("interleaved-1f1b", 3)])]
    for gbs in (32, 64):
        for cfg in configs:
            a = evaluate(costs, cluster, cfg, global_batch_size=gbs, cache=shared, exact=exact)
            b = evaluate(costs, cluster, cfg, global_batch_size=gbs, exact=exact)
            assert (a.step_time_s, a.peak_memory_bytes, a.breakdown, a.memory_by_stage,
                    a.stage_layers, a.stage_forward_s, a.mfu) == \
                   (b.step_time_s, b.peak_memory_bytes, b.breakdown, b.memory_by_stage,
                    b.stage_layers, b.stage_forward_s, b.mfu)
            if exact:
                assert a.timeline.busy_s == b.timeline.busy_s
                assert a.timeline.ops == b.timeline.ops and len(a.timeline.ops[0]) > 0


@pytest.mark.parametrize("seed", range(6))
def test_the_visit_order_sorted_a_prefix_at_a_time_is_one_lexsort(seed):
    # many equal bounds and equal tie columns, asked for in uneven steps
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5000))
    step = rng.integers(0, 40, n).astype(float) / 4
    # tie columns of a larger table, of which the search kept `rows`
    rows = np.sort(rng.choice(2 * n, n, replace=False))
    table_ties = tuple(rng.integers(0, 3, 2 * n) for _ in range(3))
    ties = tuple(col[rows] for col in table_ties)
    expected = np.lexsort(tuple(reversed(ties)) + (step,))
    order = outer._VisitOrder(step, table_ties, rows)
    for want in sorted(rng.integers(1, n + 2, 4)) + [n]:
        got = order.upto(int(want))
        assert len(got) >= min(want, n)
        np.testing.assert_array_equal(got, expected[:len(got)])
    assert len(order.upto(n)) == n


@pytest.mark.parametrize("seed", range(6))
def test_key_groups_number_keys_as_a_sort_would(seed):
    # dense codes (a table over all codes) and sparse ones (a sort), rows a random subset
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    high = [3, 40, 5000][seed % 3]
    columns = {name: rng.integers(0, high, n) for name in ("a", "b", "c")}
    rows = np.sort(rng.choice(n, int(rng.integers(1, n + 1)), replace=False))
    names = ("a", "b", "c")[:1 + seed % 3]
    first, inverse = space.key_groups(space.ConfigTable(columns), rows, names)
    keys = np.stack([columns[name][rows] for name in names], axis=1)
    distinct, expected_first, expected_inverse = np.unique(
        keys, axis=0, return_index=True, return_inverse=True)
    np.testing.assert_array_equal(first, expected_first)
    np.testing.assert_array_equal(inverse, expected_inverse.reshape(-1))
