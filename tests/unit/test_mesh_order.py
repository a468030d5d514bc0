"""The mesh order (`ParallelConfig.mesh_order`): how the (pp, dp, cp, tp) mesh lies on the
global ranks. Rank groups against a brute-force mesh built from coordinates, the slowest group
of each axis against every group laid out one by one, the default order's fast path against
the general one, and the order carried through the estimate, compile, plans and exports."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
import torch

import autopar
from autopar.config import DEFAULT_MESH_ORDER, ParallelConfig, divisors
from autopar.estimate.groups import (_PROBES, _slowest_groups_any_order, mesh_groups,
                                     rank_groups, replica_axes, slowest_groups)
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama
from autopar.models.registry import preset
from autopar.plan.export import export_plan
from autopar.plan.plan import load_plan
from autopar.search.outer import mesh_orders

AXES = ("pp", "dp", "cp", "tp")


def _llama_8b():
    with torch.device("meta"):
        return Llama(preset("llama3-8b"))


def _coordinates(cfg: ParallelConfig):
    """{rank: {axis: coordinate}} of a mesh laid out in cfg.mesh_order, outer first, built
    by counting through the coordinates (no strides)."""
    sizes = [getattr(cfg, a) for a in cfg.mesh_order]
    return {rank: dict(zip(cfg.mesh_order, coords))
            for rank, coords in enumerate(itertools.product(*(range(n) for n in sizes)))}


def _groups(cfg: ParallelConfig, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Every group of `axes` (ranks equal off `axes`), listed over `axes` first-major; the
    groups in rank order (the other axes counted in mesh order)."""
    coords = _coordinates(cfg)
    rank_of = {tuple(c[a] for a in AXES): r for r, c in coords.items()}
    fixed = [a for a in cfg.mesh_order if a not in axes]
    out = []
    for rest in itertools.product(*(range(getattr(cfg, a)) for a in fixed)):
        group = []
        for inner in itertools.product(*(range(getattr(cfg, a)) for a in axes)):
            at = dict(zip(fixed, rest)) | dict(zip(axes, inner))
            group.append(rank_of[tuple(at[a] for a in AXES)])
        out.append(tuple(group))
    return out


SHAPES = [(2, 3, 2, 2), (1, 4, 2, 3), (3, 1, 1, 2), (2, 2, 3, 1), (2, 2, 2, 2)]  # pp, dp, cp, tp


@pytest.mark.parametrize("order", list(itertools.permutations(AXES)))
def test_rank_groups_and_mesh_groups_match_a_mesh_counted_out(order):
    for pp, dp, cp, tp in SHAPES:
        for ep in divisors(dp * cp):
            cfg = ParallelConfig(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, mesh_order=order)
            first = rank_groups(cfg)
            replicas = _groups(cfg, replica_axes(cfg))
            assert first.tp == _groups(cfg, ("tp",))[0]
            assert first.cp == _groups(cfg, ("cp",))[0]
            assert first.dp == replicas[0]
            assert first.ep == replicas[0][:ep]
            assert first.pp_hop == (_groups(cfg, ("pp",))[0][:2] if pp > 1 else None)
            for axes in (("tp",), ("cp",), ("pp",), replica_axes(cfg)):
                assert [tuple(g) for g in mesh_groups(cfg, axes).tolist()] == _groups(cfg, axes)


def test_the_replicas_are_flattened_outer_axis_first():
    assert replica_axes(ParallelConfig()) == ("dp", "cp")
    assert replica_axes(ParallelConfig(mesh_order=("cp", "pp", "dp", "tp"))) == ("cp", "dp")


def _probe(cluster, axis: str, group) -> float:
    kind, nbytes = _PROBES[axis]
    return cluster.collective_time(kind, nbytes, tuple(group))


def _hop(cluster, ring) -> float:
    """What the estimate pays for a cp ring: its first hop or its wrap-around, the slower."""
    return max(_probe(cluster, "cp", ring[:2]), _probe(cluster, "cp", (ring[-1], ring[0])))


def _all_configs(world: int, gpus_per_node: int, order=DEFAULT_MESH_ORDER):
    for tp in [t for t in divisors(world) if t <= gpus_per_node]:
        for cp in divisors(world // tp):
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                for ep in divisors(dp * cp)[:3]:
                    yield ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, mesh_order=order)
                if tp > 1:  # ep folded over tp: runs of a stage's ranks
                    for ep in divisors(dp * cp * tp)[1:4]:
                        yield ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=1,
                                             sequence_parallel=True, mesh_order=order)


@pytest.mark.parametrize("profile,nodes", [("dgx-h100", 4), ("dgx-h100", 64),
                                           ("dgx-a100-40g", 3)])
def test_any_order_path_costs_the_default_order_as_the_fast_path(profile, nodes):
    """In the default order `slowest_groups` takes rank 0's group where the groups lie alike
    and searches one period of the pattern otherwise; the general path lays out every group.
    Each axis's chosen group must cost the same either way."""
    cluster = autopar.Cluster.from_profile(profile, num_nodes=nodes)
    checked = 0
    for cfg in _all_configs(cluster.world_size, cluster.gpus_per_node):
        fast, general = slowest_groups(cfg, cluster), _slowest_groups_any_order(cfg, cluster)
        for axis in ("tp", "dp", "ep"):
            assert _probe(cluster, axis, getattr(fast, axis)) == pytest.approx(
                _probe(cluster, axis, getattr(general, axis)), rel=1e-12), (cfg, axis)
        assert _probe(cluster, "dp", fast.edp) == pytest.approx(
            _probe(cluster, "dp", general.edp), rel=1e-12), cfg
        if cfg.cp > 1:
            assert _hop(cluster, fast.cp) == pytest.approx(_hop(cluster, general.cp), rel=1e-12)
        if cfg.pp > 1:
            assert _probe(cluster, "pp", fast.pp_hop) == pytest.approx(
                _probe(cluster, "pp", general.pp_hop), rel=1e-12)
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("order,profile,nodes,per_leaf", [
    (("tp", "pp", "dp", "cp"), "dgx-a100-40g", 3, None),  # 24 GPUs, 8 a node
    (("pp", "cp", "dp", "tp"), "dgx-h100", 6, 2),  # 48 GPUs over 3 leaf switches
    (("dp", "tp", "pp", "cp"), "dgx-h100", 6, 2),
    (("cp", "tp", "dp", "pp"), "dgx-a100-40g", 3, None)])
def test_slowest_groups_in_any_order_are_the_slowest_of_all_groups(order, profile, nodes,
                                                                    per_leaf):
    """Brute force: every group of each axis (counted out from coordinates) costed on its own;
    the chosen group is one of the slowest, and its first rank is the first such group's."""
    overrides = {"nodes_per_leaf": per_leaf} if per_leaf else {}
    cl = autopar.Cluster.from_profile(profile, num_nodes=nodes, **overrides)
    for cfg in _all_configs(cl.world_size, cl.world_size, order):
        got = slowest_groups(cfg, cl)
        for axis, axes in (("tp", ("tp",)), ("dp", replica_axes(cfg))):
            groups = _groups(cfg, axes)
            worst = max(_probe(cl, axis, g) for g in groups)
            assert _probe(cl, axis, getattr(got, axis)) == worst, (cfg, axis)
            assert getattr(got, axis) == next(g for g in groups
                                              if _probe(cl, axis, g) == worst)
        if cfg.ep > 1:  # runs of the replicas, or folded of a stage's ranks in mesh order
            pool = (tuple(a for a in cfg.mesh_order if a != "pp") if cfg.folded
                    else replica_axes(cfg))
            groups = [g[k:k + cfg.ep] for g in _groups(cfg, pool)
                      for k in range(0, len(g), cfg.ep)]
            assert _probe(cl, "ep", got.ep) == max(_probe(cl, "ep", g) for g in groups)
        if cfg.cp > 1:
            rings = _groups(cfg, ("cp",))
            assert set(got.cp) in [set(r) for r in rings]
            slowest_hop = max(_probe(cl, "cp", (r[k], r[(k + 1) % len(r)]))
                              for r in rings for k in range(len(r)))
            assert _hop(cl, got.cp) == slowest_hop
        if cfg.pp > 1:
            hops = [(s[k], s[k + 1]) for s in _groups(cfg, ("pp",))
                    for k in range(cfg.pp - 1)]
            assert _probe(cl, "pp", got.pp_hop) == max(_probe(cl, "pp", h) for h in hops)


def test_mesh_order_is_checked_and_read_from_text():
    assert ParallelConfig().mesh_order == DEFAULT_MESH_ORDER
    assert ParallelConfig(mesh_order="dp,pp,cp,tp").mesh_order == ("dp", "pp", "cp", "tp")
    assert ParallelConfig(mesh_order=["tp", "cp", "dp", "pp"]).mesh_order == \
        ("tp", "cp", "dp", "pp")
    for bad in (("pp", "dp", "tp"), ("pp", "dp", "cp", "cp"), "pp,dp,cp,ep", 3):
        with pytest.raises(ValueError, match="mesh_order must name each of the mesh axes"):
            ParallelConfig(mesh_order=bad)
    assert "mesh=" not in ParallelConfig(tp=2).short()
    assert ParallelConfig(tp=2, mesh_order="dp,pp,cp,tp").short().endswith("mesh=dp,pp,cp,tp")


def test_the_estimate_costs_each_axis_on_the_nodes_the_order_puts_it():
    """2 nodes of 8: tp=4 and cp=4 cannot both stay in a node. tp innermost puts the cp ring
    across the nodes; cp innermost puts the tp all-reduces across them instead, which the
    estimate charges as more tp communication and less exposed ring time."""
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=2)
    model = _llama_8b()
    tp_inner = ParallelConfig(tp=4, cp=4, micro_batch_size=1)
    cp_inner = ParallelConfig(tp=4, cp=4, micro_batch_size=1, mesh_order=("pp", "dp", "tp", "cp"))
    a = autopar.estimate(model, cluster, tp_inner, global_batch_size=16, seq_len=8192)
    b = autopar.estimate(model, cluster, cp_inner, global_batch_size=16, seq_len=8192)
    assert b.breakdown["tp_comm"] > 2 * a.breakdown["tp_comm"]
    assert b.breakdown["cp_comm"] <= a.breakdown["cp_comm"]
    assert a.step_time_s < b.step_time_s  # tp's all-reduces are on the critical path
    # orders that put the ranks in the same places cost the same (size-1 axes anywhere)
    same = autopar.estimate(model, cluster, ParallelConfig(tp=4, cp=4, mesh_order="dp,cp,pp,tp"),
                            global_batch_size=16, seq_len=8192)
    assert same.step_time_s == a.step_time_s


def test_compile_honours_a_pinned_mesh_order_through_the_saved_plan(tmp_path):
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=2)
    model = _llama_8b()
    order = ("pp", "tp", "cp", "dp")
    plan = autopar.compile(model, cluster, global_batch_size=64, seq_len=4096,
                           constraints={"mesh_order": ",".join(order), "tp": 2, "pp": 1},
                           settings=autopar.SearchSettings(progress=False))
    assert plan.config.mesh_order == order
    assert plan.mesh.axes == tuple(order)
    assert plan.mesh.sizes == tuple(getattr(plan.config, a) for a in order)
    again = autopar.estimate(model, cluster, plan.config, global_batch_size=64, seq_len=4096,
                             software=plan.training.software,
                             tp_placements=plan.tp_placements)
    assert again.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-9)
    path = plan.save(tmp_path / "plan.json")
    loaded = load_plan(path)
    assert loaded.config == plan.config and "mesh=pp,tp,cp,dp" in loaded.report()
    data = json.loads(path.read_text())
    data["mesh"]["axes"] = list(DEFAULT_MESH_ORDER)  # hand-edited: no longer the config's
    bad = tmp_path / "edited.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="mesh axes .* are not its config's mesh_order"):
        load_plan(bad)


class _Plan:
    """What the exporters read, for a config."""

    def __init__(self, plan, cfg):
        self.__dict__.update(plan.__dict__)
        self.config = cfg


@pytest.fixture(scope="module")
def small_plan():
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=2)
    return autopar.compile(_llama_8b(), cluster, global_batch_size=64, seq_len=4096,
                           constraints={"tp": 2, "pp": 2, "cp": 1, "ep": 1},
                           settings=autopar.SearchSettings(progress=False))


def test_exports_carry_or_flag_the_mesh_order(small_plan):
    cfg = small_plan.config  # tp2 pp2, dp4

    def export(order, fmt):
        return export_plan(_Plan(small_plan, dataclasses.replace(cfg, mesh_order=order)), fmt)

    default = export(DEFAULT_MESH_ORDER, "megatron")
    assert "--use-tp-pp-dp-mapping" not in default.text
    assert not any("mesh order" in n for n in default.notes)
    # Megatron's other order, tp-pp-dp inner first; the size-1 cp may sit anywhere
    for order in (("dp", "pp", "cp", "tp"), ("cp", "dp", "pp", "tp")):
        out = export(order, "megatron")
        assert "--use-tp-pp-dp-mapping" in out.text
        assert not any("mesh order" in n for n in out.notes)
    other = export(("pp", "tp", "cp", "dp"), "megatron")
    assert "--use-tp-pp-dp-mapping" not in other.text
    assert any("mesh order pp,tp,cp,dp" in n and "--pin mesh_order=pp,dp,cp,tp" in n
               for n in other.notes)
    for fmt in ("torchtitan", "deepspeed"):
        assert not any("mesh order" in n for n in export(("cp", "pp", "dp", "tp"), fmt).notes)
        assert any("mesh order dp,pp,cp,tp" in n
                   for n in export(("dp", "pp", "cp", "tp"), fmt).notes)
    assert math.prod(getattr(cfg, a) for a in AXES) == 16


def _small_gpt():
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=8192, max_seq_len=1024, dim=1024, n_layers=8,
                             n_heads=16))


def test_searching_every_mesh_order_finds_the_best_pinned_order():
    """Brute force: the search over every order (`mesh_orders="all"`) against 24 compiles, one
    per pinned order. On PCIe nodes whose links are about as fast as the network, a tp=4,
    pp=2 plan on 2 nodes of 4 runs faster with the pipeline hop inside a node and the tp
    groups across the two (pp innermost) than the other way round."""
    cluster = autopar.Cluster.from_profile("h100-pcie-roce", num_nodes=2, gpus_per_node=4)
    model, pins = _small_gpt(), {"tp": 4, "pp": 2}

    def plan(orders="default", **pinned):
        return autopar.compile(model, cluster, global_batch_size=64, seq_len=1024,
                               constraints=pins | pinned,
                               settings=autopar.SearchSettings(progress=False,
                                                               mesh_orders=orders))

    pinned = {o: plan(mesh_order=o).estimate.step_time_s for o in mesh_orders("all")}
    fastest = min(pinned.values())
    best = plan("all")
    assert best.estimate.step_time_s == fastest
    # ties go to the earlier order of mesh_orders("all"), the default first
    assert best.config.mesh_order == next(o for o, t in pinned.items() if t == fastest)
    assert best.config.mesh_order.index("pp") > best.config.mesh_order.index("tp")
    assert fastest < pinned[DEFAULT_MESH_ORDER] * 0.99
    assert best.mesh.axes == best.config.mesh_order
    assert set(map(tuple, best.candidates["mesh_order"])) > {best.config.mesh_order}
    # a pinned order wins over the setting
    assert plan("all", mesh_order=DEFAULT_MESH_ORDER).config.mesh_order == DEFAULT_MESH_ORDER


def test_mesh_orders_setting_is_read_and_checked():
    assert mesh_orders("default") == [DEFAULT_MESH_ORDER]
    every = mesh_orders("all")
    assert len(every) == len(set(every)) == 24 and every[0] == DEFAULT_MESH_ORDER
    assert mesh_orders(["dp,pp,cp,tp", DEFAULT_MESH_ORDER, ("dp", "pp", "cp", "tp")]) == \
        [DEFAULT_MESH_ORDER, ("dp", "pp", "cp", "tp")]
    for bad in ("some", [], 3, ["pp,dp"]):
        with pytest.raises(ValueError, match="mesh_order"):
            mesh_orders(bad)


@pytest.mark.parametrize("profile", ["dgx-h100", "h100-pcie-roce"])
def test_orders_that_place_a_config_alike_estimate_it_alike(profile):
    """`placement_key` is all the estimate takes from the order: over every order of configs
    with two to four axes of more than one rank, the orders with one key give one estimate,
    closed form and simulated (the search costs each config once per key)."""
    from autopar.estimate import EstimateOptions, ModelCosts, evaluate
    from autopar.estimate.core import EvalCache, placement_key

    model = _small_gpt()
    costs = ModelCosts.from_graph(autopar.trace(model, global_batch_size=1, seq_len=1024))
    cluster = autopar.Cluster.from_profile(profile, num_nodes=4, gpus_per_node=4)
    cache, options = EvalCache(cluster), EstimateOptions()
    shared = distinct = 0
    for pp, dp, cp, tp in [(2, 2, 2, 2), (1, 4, 2, 2), (2, 8, 1, 1), (1, 2, 2, 4),
                           (2, 1, 2, 4)]:
        by_key: dict[tuple, list] = {}
        for order in mesh_orders("all"):
            cfg = ParallelConfig(pp=pp, dp=dp, cp=cp, tp=tp, mesh_order=order,
                                 zero_stage=3 if dp * cp > 1 else 0,
                                 pp_schedule="1f1b" if pp > 1 else "gpipe")
            by_key.setdefault(placement_key(cache, cfg), []).append(cfg)
        distinct += len(by_key)
        for cfgs in by_key.values():
            shared += len(cfgs) > 1
            for exact in (False, True):
                got = {(e.step_time_s, e.peak_memory_bytes) for e in (
                    evaluate(costs, cluster, c, global_batch_size=32, options=options,
                             cache=cache, exact=exact) for c in cfgs)}
                assert len(got) == 1, (cfgs[0].short(), [c.mesh_order for c in cfgs])
    assert shared and distinct > 5  # the keys both merge and tell orders apart


@pytest.mark.parametrize("seed", range(4))
def test_every_order_search_is_brute_force_over_configs_and_placements(seed):
    """The search over every order against brute force: every config in every order,
    each (config, placement) once -- in its first order -- estimated in closed form, the
    top_k fastest fitting simulated, the fastest of those the winner. The search gets there
    visiting a few hundred (it skips other orders' configs whose bound without
    communication cannot reach the top k)."""
    import random

    from autopar.estimate import EstimateOptions, ModelCosts, evaluate
    from autopar.estimate.core import EvalCache, placement_key
    from autopar.search import outer
    from test_exact_pruning import fitting_estimates

    rng = random.Random(seed)
    costs = ModelCosts.from_graph(autopar.trace(_small_gpt(), global_batch_size=1,
                                                seq_len=1024))
    cluster = autopar.Cluster.from_profile(rng.choice(["h100-pcie-roce", "dgx-h100"]),
                                           num_nodes=2, gpus_per_node=4)
    gbs, k = rng.choice([16, 32, 64]), rng.choice([4, 16])
    pins = rng.choice([{"tp": 2}, {"tp": 2, "pp": 2}, {"cp": 2, "tp": 2}, {"pp": 2, "dp": 2}])
    options, cache = EstimateOptions(), EvalCache(cluster)
    settings = outer.SearchSettings(progress=False, mesh_orders="all", top_k_exact=k)
    def placements():  # each config in the first order of each of its placements
        for cfg in outer.enumerate_configs(costs, cluster, global_batch_size=gbs,
                                           constraints=pins, options=options, settings=settings):
            keys = set()
            for order in mesh_orders("all"):
                placed = dataclasses.replace(cfg, mesh_order=order)
                key = placement_key(cache, placed)
                if key not in keys:
                    keys.add(key)
                    yield placed

    fast = fitting_estimates(costs, cluster, placements(), global_batch_size=gbs,
                             options=options, cache=cache)
    top = sorted(fast, key=outer._rank_key)[:k]
    simulated = [evaluate(costs, cluster, e.config, global_batch_size=gbs, options=options,
                          cache=cache, exact=True) for e in top]
    expected = min((e for e in simulated if e.fits), key=outer._rank_key)
    got = outer.search(costs, cluster, global_batch_size=gbs, dtype="bf16", constraints=pins,
                       options=options, settings=settings)
    assert got.best.config == expected.config
    assert got.best.step_time_s == expected.step_time_s
    assert len(got.candidates) < len(fast) / 2
