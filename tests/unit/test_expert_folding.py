"""Expert parallel folded over tensor parallel (`ParallelConfig.etp` = 1, MoE parallel folding):
the config's rules, the groups it communicates over (against a brute-force layout of the
ranks), what the estimate charges for it next to the unfolded layout, the search, the exports
and the runtime's refusal."""

from __future__ import annotations

import functools
import itertools
import tomllib

import numpy as np
import pytest
import torch

import autopar
from autopar.config import ParallelConfig, check_config
from autopar.errors import InvalidConfigError, RuntimeLimitError
from autopar.estimate.core import ModelCosts, estimate_graph
from autopar.estimate.groups import rank_groups, slowest_groups, _slowest_groups_any_order
from autopar.estimate.timing import tp_collectives
from autopar.models.mixtral import Mixtral, MixtralConfig
from autopar.plan.export import export_plan
from autopar.search.outer import enumerate_configs

SEQ = 256
CHECK = dict(world_size=16, global_batch_size=32, num_layers=4, num_heads=8, num_kv_heads=4,
             num_experts=8, seq_len=SEQ)


def _model(device: str = "meta") -> Mixtral:
    with torch.device(device):
        return Mixtral(MixtralConfig(vocab_size=4096, dim=256, n_layers=4, n_heads=8,
                                     n_kv_heads=4, ffn_dim=512, max_seq_len=SEQ, num_experts=8,
                                     top_k=2))


@functools.lru_cache(maxsize=None)
def _graph():
    return autopar.trace(_model(), global_batch_size=1, seq_len=SEQ)


def _cluster(nodes: int = 2) -> autopar.Cluster:
    return autopar.Cluster.from_profile("dgx-h100", num_nodes=nodes)


# ------------------------------------------------------------------------------------ config

def test_etp_is_zero_or_one_and_one_spelling_per_layout():
    assert ParallelConfig(tp=2, etp=2).etp == 0  # etp = tp is the unfolded layout
    assert ParallelConfig(tp=1, etp=1) == ParallelConfig(tp=1)  # nothing to fold at tp 1
    assert not ParallelConfig(tp=1, etp=1).folded
    cfg = ParallelConfig(dp=4, tp=2, ep=8, etp=1, sequence_parallel=True)
    assert cfg.folded and cfg.expert_tp == 1 and cfg.expert_dp == 1 and "etp1" in cfg.short()
    assert ParallelConfig(dp=4, tp=2, ep=2).expert_dp == 2
    with pytest.raises(ValueError, match="etp must be 0"):
        ParallelConfig(tp=4, etp=2)


def test_folding_draws_ep_from_tp_and_needs_sequence_parallel():
    unfolded = ParallelConfig(dp=8, tp=2, ep=16, sequence_parallel=True)
    with pytest.raises(InvalidConfigError, match="or etp=1 to fold ep over tp x cp x dp = 16"):
        check_config(unfolded, **CHECK)
    folded = ParallelConfig(dp=8, tp=2, ep=8, etp=1, sequence_parallel=True)
    assert check_config(folded, **CHECK) == 4
    with pytest.raises(InvalidConfigError, match="needs sequence_parallel=True"):
        check_config(ParallelConfig(dp=8, tp=2, ep=8, etp=1), **CHECK)
    with pytest.raises(InvalidConfigError, match=r"must divide 2\*1\*4 = 8; allowed ep: "
                                                 r"\[1, 2, 4, 8\]"):
        check_config(ParallelConfig(dp=4, tp=2, pp=2, ep=16, etp=1, sequence_parallel=True),
                     **{**CHECK, "num_experts": 16})
    with pytest.raises(InvalidConfigError, match="needs a model with experts"):
        check_config(folded, **{**CHECK, "num_experts": None})


# ------------------------------------------------------------------------------------ groups

def _coords(cfg: ParallelConfig) -> dict[int, dict[str, int]]:
    """Each global rank's coordinate per axis: the mesh laid out outer axis first."""
    sizes = {"pp": cfg.pp, "dp": cfg.dp, "cp": cfg.cp, "tp": cfg.tp}
    order = cfg.mesh_order
    return {rank: dict(zip(order, idx)) for rank, idx in
            enumerate(itertools.product(*(range(sizes[a]) for a in order)))}


def _folded_oracle(cfg: ParallelConfig) -> tuple[set[tuple[int, ...]], set[tuple[int, ...]]]:
    """Folded ep groups and expert replica groups by their definition: number a stage's ranks
    by (dp, cp, tp) in mesh order, outer first; ep groups are runs of ep of those numbers,
    replicas the ranks with the same number mod ep."""
    coords = _coords(cfg)
    inner = [a for a in cfg.mesh_order if a != "pp"]
    sizes = {"dp": cfg.dp, "cp": cfg.cp, "tp": cfg.tp}

    def number(rank: int) -> int:
        n = 0
        for a in inner:
            n = n * sizes[a] + coords[rank][a]
        return n

    by_stage: dict[int, list[int]] = {}
    for rank in sorted(coords, key=number):
        by_stage.setdefault(coords[rank]["pp"], []).append(rank)
    groups, replicas = set(), set()
    for ranks in by_stage.values():
        groups |= {tuple(ranks[i:i + cfg.ep]) for i in range(0, len(ranks), cfg.ep)}
        replicas |= {tuple(ranks[j::cfg.ep]) for j in range(cfg.ep)}
    return groups, replicas


ORDERS = [("pp", "dp", "cp", "tp"), ("pp", "tp", "cp", "dp"), ("dp", "pp", "tp", "cp"),
          ("tp", "dp", "pp", "cp")]


@pytest.mark.parametrize("order", ORDERS)
def test_folded_groups_are_runs_of_a_stage_in_mesh_order(order):
    cluster = _cluster(4)
    checked = 0
    for tp, cp, pp in itertools.product((2, 4), (1, 2), (1, 2)):
        dp = 32 // (tp * cp * pp)
        for ep in (e for e in (2, 4, 8, 16) if (dp * cp * tp) % e == 0):
            cfg = ParallelConfig(dp=dp, tp=tp, cp=cp, pp=pp, ep=ep, etp=1, mesh_order=order,
                                 sequence_parallel=True)
            groups, replicas = _folded_oracle(cfg)
            first = rank_groups(cfg)
            assert first.ep in groups and 0 in first.ep, cfg
            assert first.edp in replicas and 0 in first.edp, cfg
            assert slowest_groups(cfg, cluster).ep in groups, cfg
            assert _slowest_groups_any_order(cfg, cluster).ep in groups, cfg
            checked += 1
    assert checked >= 12


def test_folding_keeps_an_ep_group_in_the_node_where_striding_over_tp_leaves_it():
    """dp8 tp2 on two 8-GPU nodes: ep 8 within dp strides over tp (ranks 0, 2, ..., 14: both
    nodes); folded, it is ranks 0-7, one node, and the experts' replicas are 0 and 8."""
    unfolded = ParallelConfig(dp=8, tp=2, ep=8, sequence_parallel=True)
    folded = ParallelConfig(dp=8, tp=2, ep=8, etp=1, sequence_parallel=True)
    assert rank_groups(unfolded).ep == tuple(range(0, 16, 2))
    assert rank_groups(unfolded).edp == (0,)
    assert rank_groups(folded).ep == tuple(range(8))
    assert rank_groups(folded).edp == (0, 8)
    cluster = _cluster(2)
    assert cluster.collective_time("all_to_all", 2**24, rank_groups(folded).ep) < \
        cluster.collective_time("all_to_all", 2**24, rank_groups(unfolded).ep) / 2


# ---------------------------------------------------------------------------------- estimate

def test_folded_moe_reduces_nothing_over_tp():
    costs = ModelCosts.from_graph(_graph())
    block = next(u for u in costs.units if u.is_block)
    assert block.moe_reductions == 1
    base = ParallelConfig(dp=4, tp=2, pp=2, ep=4, sequence_parallel=True)
    folded = ParallelConfig(dp=4, tp=2, pp=2, ep=8, etp=1, sequence_parallel=True)
    (fwd, bwd), (ffwd, fbwd) = tp_collectives(block, base), tp_collectives(block, folded)
    # one reduce-scatter forward and its all-gather backward, and the pair the other way
    for kind in ("reduce_scatter", "all_gather"):
        assert [k for k, _ in ffwd].count(kind) == [k for k, _ in fwd].count(kind) - 1
        assert [k for k, _ in fbwd].count(kind) == [k for k, _ in bwd].count(kind) - 1


def test_estimate_holds_whole_experts_and_shards_their_states_over_the_expert_replicas():
    graph, cluster = _graph(), _cluster(2)
    costs = ModelCosts.from_graph(graph)
    expert = sum(u.expert_params * u.count for u in costs.units)
    kw = dict(global_batch_size=32, dtype="bf16")
    for cfg in (ParallelConfig(dp=8, tp=2, ep=4, zero_stage=1, sequence_parallel=True),
                ParallelConfig(dp=8, tp=2, ep=4, etp=1, zero_stage=1, sequence_parallel=True),
                ParallelConfig(dp=8, tp=2, ep=8, etp=1, zero_stage=1, sequence_parallel=True)):
        est = estimate_graph(graph, cluster, cfg, **kw)
        dense = sum(u.dense_on_tp_rank(cfg.tp) * u.count for u in costs.units)
        params = est.memory_by_stage[0]["_params"]
        assert params == pytest.approx(dense + expert / (cfg.expert_tp * cfg.ep), rel=1e-9)
        # the optimizer's fp32 states: dense over dp x cp, experts over their replicas
        optim = est.memory_by_stage[0]["_optimizer"]
        assert optim == pytest.approx(12 * (dense / 8 + expert / (cfg.expert_tp * cfg.ep)
                                            / cfg.expert_dp), rel=1e-9)


def test_folded_all_to_all_in_the_node_is_faster_than_striding_over_tp():
    graph, cluster = _graph(), _cluster(2)
    kw = dict(global_batch_size=32, dtype="bf16")
    unfolded = estimate_graph(graph, cluster, ParallelConfig(
        dp=8, tp=2, ep=8, sequence_parallel=True), **kw)
    folded = estimate_graph(graph, cluster, ParallelConfig(
        dp=8, tp=2, ep=8, etp=1, sequence_parallel=True), **kw)
    assert folded.breakdown["ep_comm"] < unfolded.breakdown["ep_comm"] / 2
    assert folded.breakdown["tp_comm"] < unfolded.breakdown["tp_comm"]


# ---------------------------------------------------------------- search, exports, runtime

def _space(target: str, **pins):
    from autopar.estimate.core import EstimateOptions
    from autopar.search.settings import SearchSettings
    from autopar.targets import get_target

    t = get_target(target)
    options = autopar.SOFTWARE[t.software].options
    return list(enumerate_configs(ModelCosts.from_graph(_graph()), _cluster(2),
                                  global_batch_size=32, constraints=pins,
                                  options=options or EstimateOptions(),
                                  settings=SearchSettings(), target=t))


def test_the_search_offers_folding_where_the_engine_runs_it():
    titan = _space("torchtitan", tp=2, zero_stage=3, pp=1)
    folded = [c for c in titan if c.folded]
    assert folded and all(c.sequence_parallel for c in folded)
    # torchtitan: ep borrows all of cp x tp and part of the FSDP shards
    assert all(c.ep % (c.cp * c.tp) == 0 and (c.dp * c.cp * c.tp) % c.ep == 0
               for c in folded)
    assert any(c.ep > c.dp * c.cp for c in _space("megatron", tp=4, etp=1))


def test_autopar_runtime_refuses_folding_at_compile_and_at_apply():
    with pytest.raises(RuntimeLimitError, match="etp=1 cannot run: this runtime splits experts"):
        autopar.compile(_model(), _cluster(2), global_batch_size=32, seq_len=SEQ,
                        constraints={"tp": 2, "etp": 1})
    plan = autopar.compile(_model(), _cluster(2), global_batch_size=32, seq_len=SEQ,
                           constraints={"tp": 2, "ep": 8, "etp": 1, "pp": 1},
                           target="megatron")
    assert plan.config.folded and plan.mesh.ep_within == "tp*cp*dp"
    experts = {n: a for n, a in plan.placements.items() if ".experts." in n}
    assert experts and all(a["tp"] == "R" and a["ep"] == "S(0)" for a in experts.values())
    assert any(a["tp"] != "R" for n, a in plan.placements.items() if n not in experts)
    flags = export_plan(plan, "megatron").text.split()
    assert flags[flags.index("--expert-tensor-parallel-size") + 1] == "1"
    with pytest.raises(ValueError, match="folds expert parallel over tp"):
        autopar.runtime.apply_plan(_model("cpu"), plan)


def test_torchtitan_export_names_the_expert_tensor_parallel_degree():
    plan = autopar.compile(_model(), _cluster(2), global_batch_size=32, seq_len=SEQ,
                           constraints={"tp": 2, "ep": 4, "etp": 1, "zero_stage": 3, "pp": 1},
                           target="torchtitan")
    toml = tomllib.loads(export_plan(plan, "torchtitan").text)
    assert toml["parallelism"]["expert_tensor_parallel_degree"] == 1
    assert toml["parallelism"]["expert_parallel_degree"] == 4
    assert np.isfinite(plan.estimate.step_time_s)


def test_full_recompute_runs_the_expert_dispatch_again():
    """A recomputed MoE block dispatches its tokens again (its forward's all-to-alls, or
    all-gather and reduce-scatter on the layer's own forward): full recompute's time grows by
    the forward's expert-parallel collectives, the step's listed collectives by their count."""
    from autopar.estimate.options import EstimateOptions
    from autopar.estimate.timing import ep_collectives, unit_times
    from autopar.estimate.tp_comm import ep_step_collectives

    graph, cluster = _graph(), _cluster(2)
    base = ParallelConfig(dp=8, tp=2, ep=4, sequence_parallel=True)
    full = ParallelConfig(dp=8, tp=2, ep=4, sequence_parallel=True, recompute="full")
    for dispatch, kinds in (("all_to_all", ["all_to_all"] * 2),
                            ("all_gather", ["all_gather", "reduce_scatter"])):
        costs = ModelCosts.from_graph(graph).with_ep_dispatch(dispatch)
        moe = next(u for u in costs.units if u.moe_dispatch_bytes)
        fwd, bwd = ep_collectives(moe, base)
        assert [k for k, _ in fwd] == kinds and sorted(bwd) == sorted(fwd)
        charged = sum(cluster.collective_time(k, n, rank_groups(base).ep) for k, n in fwd)
        kw = dict(cluster=cluster, dtype="bf16", groups=rank_groups(base),
                  options=EstimateOptions(recompute_early_stop=False))
        kept, again = unit_times(moe, cfg=base, **kw), unit_times(moe, cfg=full, **kw)
        assert kept.ep_fwd == pytest.approx(charged) and charged > 0
        assert again.recompute == pytest.approx(again.compute_fwd + again.tp_fwd + charged)
        listed = [ep_step_collectives(costs, cfg, global_batch_size=32) for cfg in (base, full)]
        assert len(listed[1]) == len(listed[0]) * 3 // 2 > 0
