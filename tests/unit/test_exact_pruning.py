"""Skipping simulations the search cannot need, against exhaustive simulation.

- `simulated_lower_bound` never exceeds the simulator's makespan (random non-uniform stages,
  every schedule, p2p time) and meets it on equal stages (1F1B, zero-bubble), and `exact_step_lower_bound` never exceeds the simulated
  estimate of a config;
- `outer._simulate_best` picks the same winner as simulating every candidate, and every
  candidate it skips is slower once simulated than that winner (seeded random instances:
  model depth, cluster memory, global batch).
"""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.estimate import EstimateOptions, ModelCosts, evaluate
from autopar.estimate.bounds import exact_step_lower_bound
from autopar.estimate.core import EvalCache
from autopar.estimate.layout import simulated_lower_bound
from autopar.models.gpt import GPT, GPTConfig
from autopar.search import outer
from autopar.search.outer import SearchSettings, enumerate_configs
from costmodels.pipeline import simulate_pipeline

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


@st.composite
def instances(draw):
    schedule = draw(st.sampled_from(SCHEDULES))
    p = draw(st.integers(1, 5))
    v = draw(st.integers(1, 4)) if schedule == "interleaved-1f1b" else 1
    m = p * draw(st.integers(1, 3)) if schedule == "interleaved-1f1b" else draw(st.integers(1, 9))
    n = p * v
    time = st.floats(0.0, 4.0, allow_nan=False)
    fs = draw(st.lists(time, min_size=n, max_size=n))
    bs = draw(st.lists(time, min_size=n, max_size=n))
    ws = [b * draw(st.floats(0.0, 1.0)) for b in bs]
    p2p = draw(st.floats(0.0, 0.5))
    return schedule, p, v, m, fs, bs, [min(w, b) for w, b in zip(ws, bs)], p2p


@settings(max_examples=400, deadline=None)
@given(instances())
def test_simulated_lower_bound_never_exceeds_the_simulated_step(inst):
    schedule, p, v, m, fs, bs, ws, p2p = inst
    work = np.array(fs) + np.array(bs)
    lay = SimpleNamespace(chunk_fwd=np.array(fs), chunk_bwd=np.array(bs),
                          chunk_wgrad=np.array(ws),
                          rank_work=np.array([work[r::p].sum() for r in range(p)]))
    cfg = SimpleNamespace(pp=p, pp_schedule=schedule)
    sim = simulate_pipeline(schedule=schedule, num_stages=p, num_microbatches=m,
                            virtual_stages=v, forward_s=fs, backward_s=bs, weight_grad_s=ws,
                            p2p_s=p2p)
    assert simulated_lower_bound(cfg, m, lay, p2p) <= sim.step_time_s * (1 + 1e-12) + 1e-12


def test_the_bound_is_tight_on_equal_stages_without_p2p():
    # 1F1B on p equal stages takes (m + p - 1)(f + b): the last rank's fill + work + drain
    lay = SimpleNamespace(chunk_fwd=np.ones(4), chunk_bwd=2 * np.ones(4),
                          rank_work=3 * np.ones(4))
    cfg = SimpleNamespace(pp=4, pp_schedule="1f1b")
    assert simulated_lower_bound(cfg, 8, lay, 0.0) == (8 + 3) * 3.0


@pytest.mark.parametrize("p,m,w", [(4, 8, 0.5), (4, 32, 0.8), (2, 16, 0.3), (8, 8, 1.0)])
def test_the_zero_bubble_bound_is_tight_on_equal_stages(p, m, w):
    # ZB-H1 on equal stages with W the shortest pass, without p2p: m (F + B + W) +
    # (p - 1)(F + B - W) (Qi et al. 2023; B the input grad, b - w here), reached by the last
    # micro-batch's input grad crossing back to rank 0, which then owes one W
    f, b, p2p = 1.0, 2.0, 0.0
    lay = SimpleNamespace(chunk_fwd=np.full(p, f), chunk_bwd=np.full(p, b),
                          chunk_wgrad=np.full(p, w), rank_work=np.full(p, f + b))
    cfg = SimpleNamespace(pp=p, pp_schedule="zero-bubble")
    sim = simulate_pipeline(schedule="zero-bubble", num_stages=p, num_microbatches=m,
                            forward_s=f, backward_s=b, weight_grad_s=w, p2p_s=p2p)
    bound = simulated_lower_bound(cfg, m, lay, p2p)
    assert bound == pytest.approx(m * (f + b) + (p - 1) * (f + b - 2 * w), rel=1e-12)
    assert bound == pytest.approx(sim.step_time_s, rel=1e-12)


def fitting_estimates(costs: ModelCosts, cluster, configs, *, global_batch_size: int,
                      options: EstimateOptions, cache: EvalCache) -> list:
    """The closed-form estimates of those of `configs` that evaluate and fit, in order."""
    fast = []
    for cfg in configs:
        try:
            est = evaluate(costs, cluster, cfg, global_batch_size=global_batch_size,
                           options=options, cache=cache, exact=False)
        except ValueError:
            continue
        if est.fits:
            fast.append(est)
    return fast


def _costs(layers: int) -> ModelCosts:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=8192, max_seq_len=1024, dim=512, n_layers=layers,
                              n_heads=8))
    return ModelCosts.from_graph(autopar.trace(model, global_batch_size=1, seq_len=1024))


@pytest.mark.parametrize("seed", range(12))
def test_skipping_simulations_keeps_the_winner_of_simulating_all(seed):
    rng = random.Random(seed)
    costs = _costs(rng.choice([4, 6, 8, 12]))
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=rng.choice([1, 2]),
                                           device_memory_gb=rng.choice([4, 8, 80]))
    gbs = rng.choice([16, 32, 64])
    constraints = rng.choice([{}, {"pp": 2}, {"pp": 4}])  # pipelines: the bound is not exact
    options, cache = EstimateOptions(), EvalCache(cluster)
    fast = fitting_estimates(costs, cluster, enumerate_configs(
        costs, cluster, global_batch_size=gbs, constraints=constraints, options=options,
        settings=SearchSettings(progress=False)), global_batch_size=gbs, options=options,
        cache=cache)
    top = sorted(fast, key=outer._rank_key)[:rng.choice([4, 16, 40])]
    assert top
    every = [evaluate(costs, cluster, e.config, global_batch_size=gbs, options=options,
                      exact=True) for e in top]
    for e, sim in zip(top, every):
        bound = exact_step_lower_bound(costs, cluster, e.config, global_batch_size=gbs,
                                       options=options)
        assert bound <= sim.step_time_s * (1 + 1e-12)
    expected = min((e for e in every if e.fits), key=outer._rank_key, default=None)
    some = outer._simulate_best(costs, cluster, top, global_batch_size=gbs, dtype="bf16",
                                options=options, cache=cache)
    got = min((e for e in some if e.fits), key=outer._rank_key, default=None)
    if expected is None:
        assert got is None and len(some) == len(top)  # nothing fits: all were simulated
        return
    assert got.config == expected.config and got.step_time_s == expected.step_time_s
    simulated = {e.config for e in some}
    assert [e.config for e in some] == [e.config for e in top if e.config in simulated]
    for sim in every:
        if sim.config not in simulated:
            assert outer._rank_key(sim) > outer._rank_key(expected)


@pytest.mark.parametrize("seed", range(6))
def test_the_bound_holds_for_given_stage_boundaries(seed):
    # `_rebalance_stages` drops an inter-op DP cut without simulating it when this bound is
    # already no faster than the winner
    rng = random.Random(seed)
    costs = _costs(8)
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
    pp, v = rng.choice([(2, 1), (4, 1), (2, 2)])
    schedule = "interleaved-1f1b" if v > 1 else rng.choice(["gpipe", "1f1b", "zero-bubble"])
    cfg = autopar.ParallelConfig(dp=8 // pp, tp=1, pp=pp, pp_schedule=schedule,
                                 virtual_stages=v)
    layers = costs.num_layers
    edges = sorted(rng.sample(range(1, layers), pp * v - 1))
    cut = tuple(zip([0] + edges, edges + [layers]))
    bound = exact_step_lower_bound(costs, cluster, cfg, global_batch_size=32,
                                   stage_boundaries=cut)
    sim = evaluate(costs, cluster, cfg, global_batch_size=32, stage_boundaries=cut)
    assert bound <= sim.step_time_s * (1 + 1e-12)
