"""The intra-op sharding ILP: brute-force oracle (for CP-SAT and for variable elimination),
rediscovery of Megatron TP, errors, caching."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

import autopar
from autopar.errors import ShardingInfeasibleError
from autopar.ir import Graph, Node, OpKind, ParamSpec, TensorSpec
from autopar.models.registry import build, preset
from autopar.search.elimination import solve_by_elimination
from autopar.search.intra_op import BlockSetting, BlockSharding, solve_block, solve_problem
from autopar.sharding import expand_nd, reshard_collective, strategies
from autopar.sharding.problem import build_problem, pin_params
from autopar.sharding.views import view_dim_map

DT = "bfloat16"


@pytest.fixture(scope="module")
def cluster():
    return autopar.Cluster.from_profile("dgx-h100", num_nodes=1)


# ---- small hand-built graphs for the oracle ---------------------------------------------

def _t(shape):
    return TensorSpec(shape=tuple(shape), dtype=DT)


def _mm(name, src, x_shape, w_out, fqn):
    m, k = x_shape
    flops = 2 * m * k * w_out
    nbytes = 2 * (m * k + k * w_out + m * w_out)
    return Node(name=name, kind=OpKind.MATMUL, target="aten.mm.default",
                inputs=(_t((m, k)), _t((k, w_out))), input_sources=(src, f"param:{fqn}"),
                outputs=(_t((m, w_out)),), flops_fwd=flops, flops_bwd=2 * flops,
                bytes_read=nbytes - 2 * m * w_out, bytes_written=2 * m * w_out,
                params=(ParamSpec(fqn=fqn, shape=(w_out, k), dtype=DT),),
                saved_bytes=2 * m * k)


def _pointwise(name, target, srcs, shape, kind=OpKind.ELEMENTWISE):
    n = 2 * shape[0] * shape[1]
    return Node(name=name, kind=kind, target=target, inputs=tuple(_t(shape) for _ in srcs),
                input_sources=tuple(srcs), outputs=(_t(shape),), bytes_read=n * len(srcs),
                bytes_written=n, saved_bytes=n)


def _graph(nodes):
    return Graph(nodes=tuple(nodes), blocks=(), inputs=(_t((1, 1)),), model_class="Toy",
                 batch_size=1)


def _chain(m=2048, h=1024):
    return _graph([
        _mm("up", "input:0", (m, h), 4 * h, "up.weight"),
        _pointwise("act", "aten.gelu.default", ["up"], (m, 4 * h)),
        _mm("down", "act", (m, 4 * h), h, "down.weight"),
        _pointwise("soft", "aten._softmax.default", ["down"], (m, h), OpKind.SOFTMAX),
    ])


def _diamond(m=2048, h=1024):
    return _graph([
        _mm("inp", "input:0", (m, h), h, "inp.weight"),
        _mm("a", "inp", (m, h), 2 * h, "a.weight"),
        _mm("b", "inp", (m, h), 2 * h, "b.weight"),
        _pointwise("mul", "aten.mul.Tensor", ["a", "b"], (m, 2 * h)),
        _mm("out", "mul", (m, 2 * h), h, "out.weight"),
        _pointwise("res", "aten.add.Tensor", ["out", "inp"], (m, h)),
    ])


def _brute_force(problem, budget=None, pins=None):
    """The least objective over all assignments (within `budget`; placing every parameter
    as `pins` says, an unlisted one replicated)."""
    best = None
    names = problem.nodes
    for combo in itertools.product(*(range(len(problem.strategies[v])) for v in names)):
        choice = dict(zip(names, combo))
        if pins is not None and any(problem.param_placement(u, choice[u.node])
                                    != pins.get(u.fqn, "R") for u in problem.params):
            continue
        cost = problem.evaluate(choice)
        if cost is None or (budget is not None and problem.memory(choice) > budget):
            continue
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("method", ["cp-sat", "elimination"])
@pytest.mark.parametrize("make", [_chain, _diamond])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("step_s_per_param", [0.0, 2e-11])
def test_ilp_matches_brute_force(make, tp, method, step_s_per_param, cluster):
    g = make()
    problem = build_problem(
        g, [n.name for n in g.nodes],
        BlockSetting(tp=tp, cluster=cluster, dtype="bf16", step_s_per_param=step_s_per_param))
    choice, optimal = solve_problem(problem, method=method)
    assert optimal
    assert problem.evaluate(choice) == _brute_force(problem)


@pytest.mark.parametrize("seed", range(4))
def test_parameter_state_work_is_charged_per_element_held(seed, cluster):
    """The full price of an assignment is its block price plus, per parameter, the elements
    one rank holds (all of it replicated, 1/tp sharded) times the per-element step work."""
    rng, g, rate, tp = random.Random(seed), _diamond(), 3e-11, 4
    names = [n.name for n in g.nodes]
    plain = build_problem(g, names, BlockSetting(tp=tp, cluster=cluster, dtype="bf16"))
    priced = build_problem(g, names, BlockSetting(tp=tp, cluster=cluster, dtype="bf16",
                                                  step_s_per_param=rate))
    for _ in range(20):
        choice = {v: rng.randrange(len(plain.strategies[v])) for v in plain.nodes}
        if plain.evaluate(choice) is None:
            continue
        held = {u.fqn: u.numel / (tp if plain.param_placement(u, choice[u.node]) != "R" else 1)
                for u in plain.params}
        extra = sum(round(h * rate * 1e9) for h in held.values())
        assert priced.evaluate(choice) - plain.evaluate(choice) == extra


def test_the_step_price_of_replicated_weights_turns_the_layout_to_sharded(cluster):
    # a narrow MLP at a large batch: split by rows, its weights replicated, it needs no
    # activation traffic, only its weight gradients all-reduced; charging each replicated
    # element its share of the optimizer step and data-parallel reduction shards them
    g = _chain(m=65536, h=1024)
    names = [n.name for n in g.nodes]
    free = solve_block(g, names, BlockSetting(tp=4, cluster=cluster, dtype="bf16"))
    priced = solve_block(g, names, BlockSetting(tp=4, cluster=cluster, dtype="bf16",
                                                step_s_per_param=1e-10))
    assert free.param_placements == {"up.weight": "R", "down.weight": "R"}
    assert priced.param_placements == {"up.weight": "S(0)", "down.weight": "S(1)"}
    # rounded to whole nanoseconds per parameter tensor
    assert priced.state_s == pytest.approx(2 * 4 * 1024 * 1024 / 4 * 1e-10, abs=2e-9)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("make", [_chain, _diamond])
def test_pinned_parameters_match_brute_force(make, seed, cluster):
    """Pinning the parameter layout leaves the ILP the best execution of that layout: the
    brute-force optimum over the assignments that place the parameters so."""
    rng = random.Random(seed)
    g = make()
    problem = build_problem(
        g, [n.name for n in g.nodes],
        BlockSetting(tp=2, cluster=cluster, dtype="bf16"))
    pins = {u.fqn: rng.choice(["R", "S(0)", "S(1)"]) for u in problem.params}
    pinned = pin_params(problem, pins)
    for method in ("elimination", "cp-sat"):
        choice, optimal = solve_problem(pinned, method=method)
        assert optimal
        assert {u.fqn: pinned.param_placement(u, choice[u.node]) for u in pinned.params} \
            == {u.fqn: pins[u.fqn] for u in problem.params}
        assert pinned.evaluate(choice) == _brute_force(problem, pins=pins)
    assert _brute_force(problem, pins=pins) >= _brute_force(problem)


def test_a_parameter_placement_no_strategy_gives_is_refused(cluster):
    g = _chain()
    problem = build_problem(
        g, [n.name for n in g.nodes],
        BlockSetting(tp=2, cluster=cluster, dtype="bf16"))
    with pytest.raises(ValueError, match=r"no strategy of up places its parameters as "
                                         r"\{'up.weight': 'S\(2\)'\}"):
        pin_params(problem, {"up.weight": "S(2)"})


def _tie_broken(problem, choice):
    """The ILP's whole objective: W x cost + the sum of strategy indices (its tie-break)."""
    weight = 1 + sum(len(problem.strategies[v]) - 1 for v in problem.nodes)
    return weight * problem.evaluate(choice) + sum(choice.values())


def _random_graph(rng, m=1024, h=512):
    """A few matmuls and pointwise ops with random fan-out (residual-like adds, a weight
    shared by two matmuls, an op reading one tensor twice)."""
    nodes = [_mm("n0", "input:0", (m, h), h, "w0.weight")]
    for k in range(1, rng.randint(3, 5)):
        a = rng.choice(nodes).name
        kind = rng.choice(["mm", "shared", "add", "square", "gelu"])
        if kind in ("mm", "shared"):
            fqn = "w0.weight" if kind == "shared" else f"w{k}.weight"
            nodes.append(_mm(f"n{k}", a, (m, h), h, fqn))
        elif kind == "add":
            b = rng.choice(nodes).name
            nodes.append(_pointwise(f"n{k}", "aten.add.Tensor", [a, b], (m, h)))
        elif kind == "square":
            nodes.append(_pointwise(f"n{k}", "aten.mul.Tensor", [a, a], (m, h)))
        else:
            nodes.append(_pointwise(f"n{k}", "aten.gelu.default", [a], (m, h)))
    return _graph(nodes)


@pytest.mark.parametrize("seed", range(12))
def test_elimination_matches_brute_force_with_tie_break(seed, cluster):
    """On random small graphs variable elimination reaches the brute-force optimum of the
    ILP's whole objective, tie-break included, and CP-SAT agrees on its value."""
    rng = random.Random(seed)
    g = _random_graph(rng)
    tp = rng.choice([2, 4])
    problem = build_problem(
        g, [n.name for n in g.nodes],
        BlockSetting(tp=tp, cluster=cluster, dtype="bf16"))
    best = None
    for combo in itertools.product(*(range(len(problem.strategies[v])) for v in problem.nodes)):
        choice = dict(zip(problem.nodes, combo))
        if problem.evaluate(choice) is not None:
            value = _tie_broken(problem, choice)
            best = value if best is None else min(best, value)
    found = solve_by_elimination(problem)
    assert found is not None and _tie_broken(problem, found) == best
    ilp, optimal = solve_problem(problem, method="cp-sat")
    assert optimal and _tie_broken(problem, ilp) == best


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_elimination_and_cp_sat_agree_on_llama_block(llama, tp, cluster):
    g, names = llama
    setting = BlockSetting(tp=tp, cluster=cluster, dtype="bf16")
    by_elimination = solve_block(g, names, setting, method="elimination")
    by_cp_sat = solve_block(g, names, setting, method="cp-sat")
    assert by_elimination == by_cp_sat


@pytest.mark.parametrize("tp", [2, 8])
def test_elimination_tables_add_up_to_the_objective(llama, tp, cluster):
    """The node and tensor cost tables variable elimination builds (reshard prices as arrays
    over placement pairs) sum to the ILP's whole objective, tie-break included, at sampled
    assignments of a Llama block (tensors with several consumers, with and without
    gradients)."""
    from autopar.search.elimination import _node_factors, _reshards, _tensor_factor
    from autopar.sharding.problem import BLOCK_INPUT, BLOCK_OUTPUT

    g, names = llama
    problem = build_problem(g, names, BlockSetting(tp=tp, cluster=cluster, dtype="bf16"))
    sizes = [len(problem.strategies[v]) for v in problem.nodes]
    weight = 1 + sum(n - 1 for n in sizes)
    index = {v: i for i, v in enumerate(problem.nodes)}
    reshards = _reshards(problem, weight)
    factors = _node_factors(problem, weight, sizes) + [
        _tensor_factor(problem, t, index, reshards) for t in problem.tensors]
    assert any(len(t.consumers) > 1 for t in problem.tensors)
    assert {t.requires_grad for t in problem.tensors} == {False, True}
    rng = random.Random(tp)
    for _ in range(40):
        combo = [rng.randrange(n) for n in sizes]
        combo[index[BLOCK_OUTPUT]] = combo[index[BLOCK_INPUT]]  # the periodic boundary
        total = sum(f.table[tuple(combo[u] for u in f.scope)] for f in factors)
        assert total == _tie_broken(problem, dict(zip(problem.nodes, combo)))


@pytest.mark.parametrize("seed", range(30))
def test_elimination_chain_link_matches_the_general_step(seed):
    """Variable elimination's chain-link step (v between two other nodes, one factor each)
    gives exactly the general joint-table step's message scope, argmin (ties included) and
    minimum, on random small-integer tables with many ties and some ∞, in every order of the
    three nodes' indices."""
    import numpy as np

    from autopar.search.elimination import _Factor, _joint, _link

    rng = np.random.default_rng(seed)
    v, left, right = (int(u) for u in rng.permutation(3))
    sizes = [int(n) for n in rng.integers(1, 7, size=3)]

    def factor(u, w):
        scope = tuple(sorted((u, w)))
        table = rng.integers(0, 4, size=[sizes[x] for x in scope]).astype(float)
        table[rng.random(table.shape) < 0.1] = np.inf
        return _Factor(scope, table)

    first, second = factor(left, v), factor(v, right)
    unary = rng.integers(0, 3, size=sizes[v]).astype(float)
    fast = _link(v, first, second, unary)
    general = _joint(v, [first, second], unary, sizes)
    assert fast[0] == general[0]
    for got, want in zip(fast[1:], general[1:]):
        assert got.shape == want.shape and (got == want).all()
    assert _link(v, first, factor(left, v), unary) is None  # both over {left, v}: general


def test_elimination_hands_wide_or_budgeted_problems_to_cp_sat(cluster):
    g = _diamond()
    problem = build_problem(
        g, [n.name for n in g.nodes],
        BlockSetting(tp=4, cluster=cluster, dtype="bf16"))
    assert solve_by_elimination(problem, max_table_entries=1) is None
    with pytest.raises(ValueError, match="memory budget"):
        solve_problem(problem, memory_budget_bytes=1e12, method="elimination")
    with pytest.raises(ValueError, match="method must be"):
        solve_problem(problem, method="simplex")


def test_a_tensor_read_at_every_step_of_a_long_loop_goes_to_cp_sat(cluster):
    """An unrolled scan (a Mamba layer's reference loop) reads one tensor at each of its 70
    steps: one table over 71 nodes, beyond what variable elimination (and numpy) can hold;
    the solve hands it to CP-SAT and gets a layout."""
    m, h = 256, 64
    steps = [_pointwise(f"step{i}", "aten.mul.Tensor", ["inp", f"step{i - 1}" if i else "inp"],
                        (m, h)) for i in range(70)]
    g = _graph([_mm("inp", "input:0", (m, h), h, "inp.weight"), *steps,
                _mm("out", "step69", (m, h), h, "out.weight")])
    problem = build_problem(g, [n.name for n in g.nodes],
                            BlockSetting(tp=2, cluster=cluster, dtype="bf16"))
    assert solve_by_elimination(problem) is None
    choice = solve_problem(problem)[0]
    assert set(choice) == set(problem.nodes)


@pytest.mark.parametrize("method", ["auto", "cp-sat"])
@pytest.mark.parametrize("make", [_chain, _diamond])
@pytest.mark.parametrize("fraction", [0.3, 0.45, 0.6, 0.8])
def test_ilp_matches_brute_force_under_memory_budget(make, fraction, method, cluster):
    # "auto" certifies a Lagrangian optimum found by variable elimination (or hands the
    # problem to CP-SAT when it cannot); either way the budgeted optimum, as brute force finds
    g = make()
    problem = build_problem(
        g, [n.name for n in g.nodes],
        BlockSetting(tp=4, cluster=cluster, dtype="bf16", step_s_per_param=1e-12))
    free, _ = solve_problem(problem)
    replicated = problem.memory({v: 0 for v in problem.nodes})
    budget = fraction * replicated
    want = _brute_force(problem, budget)
    if want is None:
        with pytest.raises(ShardingInfeasibleError, match="memory_budget"):
            solve_problem(problem, memory_budget_bytes=budget, method=method)
        return
    choice, optimal = solve_problem(problem, memory_budget_bytes=budget, method=method)
    assert optimal and problem.memory(choice) <= budget
    # a Lagrangian certificate holds to a unit (ns) per node
    assert want <= problem.evaluate(choice) <= want + len(problem.nodes)
    assert problem.evaluate(choice) >= problem.evaluate(free)


# ---- rediscovery on traced models -------------------------------------------------------

@pytest.fixture(scope="module")
def llama(cluster):
    g = autopar.trace(build(preset("llama3-8b", n_layers=2)), global_batch_size=1,
                      seq_len=2048, dtype="bf16")
    return g, g.blocks[0].node_names


def _hidden_bytes(g):
    return g.batch_size * g.seq_len * 4096 * 2


def _one_reduction_per_sublayer(collectives, nbytes):
    """Two sub-layers, each either one all-reduce or one reduce-scatter + all-gather."""
    kinds = sorted(k for k, b in collectives if b == nbytes)
    return kinds in (["all_reduce"] * 2, ["all_gather"] * 2 + ["reduce_scatter"] * 2)


def test_llama_block_tp8_is_megatron(llama, cluster):
    g, names = llama
    r = solve_block(g, names, BlockSetting(tp=8, cluster=cluster, dtype="bf16"))
    place = {fqn.split(".", 2)[2]: p for fqn, p in r.param_placements.items()}
    for col in ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                "feed_forward.w1.weight", "feed_forward.w3.weight"):
        assert place[col] == "S(0)", col  # column parallel: output features
    for row in ("attention.wo.weight", "feed_forward.w2.weight"):
        assert place[row] == "S(1)", row  # row parallel: input features
    sdpa = next(n for n in names if n.endswith("/sdpa"))
    assert r.node_strategies[sdpa] == "S(heads)"
    h = _hidden_bytes(g)
    assert _one_reduction_per_sublayer(r.forward_collectives, h)
    assert [c for c in r.forward_collectives if c[1] != h] == []
    assert _one_reduction_per_sublayer(
        [c for c in r.backward_collectives if c[0] != "all_reduce" or c[1] != 2 * 4096], h)
    assert r.optimal


def test_gpt_mlp_is_column_then_row(cluster):
    g = autopar.trace(build(preset("gpt3-1.3b", n_layers=2)), global_batch_size=1,
                      seq_len=2048, dtype="bf16")
    names = g.blocks[0].node_names
    r = solve_block(g, names, BlockSetting(tp=4, cluster=cluster, dtype="bf16"))
    place = {fqn.split(".", 2)[2]: p for fqn, p in r.param_placements.items()}
    assert place["feed_forward.w1.weight"] == "S(0)"
    assert place["feed_forward.w1.bias"] == "S(0)"
    assert place["feed_forward.w2.weight"] == "S(1)"
    gelu = next(n for n in names if n.endswith("/gelu"))
    assert r.output_placements[gelu] == ("S(2)",)  # the 4h activation never materialises


def test_context_parallel_costs_one_ranks_share_of_the_sequence(cluster):
    # cp=2 at 8,192 tokens: every tensor between the block's nodes and every kept activation
    # is that of 4,096 tokens (a trace at half the sequence is the oracle); attention's work
    # is half the full sequence's, more than the half-length trace's quarter (ring attention
    # covers the whole sequence)
    model = build(preset("gpt3-1.3b", n_layers=2, max_seq_len=8192))
    full, half = (autopar.trace(model, global_batch_size=1, seq_len=s, dtype="bf16")
                  for s in (8192, 4096))
    setting = BlockSetting(tp=4, cluster=cluster, dtype="bf16")
    shared = solve_block(full, full.blocks[0].node_names,
                         dataclasses.replace(setting, sequence_shards=2))
    short = solve_block(half, half.blocks[0].node_names, setting)
    whole = solve_block(full, full.blocks[0].node_names, setting)
    assert shared.node_strategies == short.node_strategies
    assert (shared.forward_collectives, shared.backward_collectives) == \
        (short.forward_collectives, short.backward_collectives)
    assert shared.comm_s == short.comm_s < whole.comm_s
    assert shared.memory_bytes == pytest.approx(short.memory_bytes)
    assert short.compute_s < shared.compute_s < whole.compute_s


def test_tp1_is_replicated_without_communication(llama, cluster):
    g, names = llama
    r = solve_block(g, names, BlockSetting(tp=1, cluster=cluster, dtype="bf16"))
    assert set(r.node_strategies.values()) == {"R"}
    assert set(r.param_placements.values()) == {"R"}
    assert r.forward_collectives == r.backward_collectives == ()
    assert r.comm_s == 0


@pytest.mark.parametrize("vocab, expect_parallel", [(128256, True), (64, False)])
def test_vocab_parallel_head_when_it_pays(vocab, expect_parallel, cluster):
    g = autopar.trace(build(preset("llama3-8b", n_layers=2, vocab_size=vocab)),
                      global_batch_size=1, seq_len=2048, dtype="bf16")
    names = [n.name for n in g.nodes if g.block_of(n) is None]
    r = solve_block(g, names, BlockSetting(tp=8, cluster=cluster, dtype="bf16"))
    loss = next(n for n in names if n.endswith("cross_entropy"))
    if expect_parallel:
        assert r.param_placements["output.weight"] == "S(0)"  # LM head split on the vocab
        assert r.node_strategies[loss] == "S(vocab)"
        assert r.param_placements["tok_embeddings.weight"] != "R"
    else:
        assert r.param_placements["output.weight"] == "R"
        assert r.param_placements["tok_embeddings.weight"] == "R"
        assert r.node_strategies[loss] == "R"


def test_resnet_block_finds_a_split(cluster):
    g = autopar.trace(build("resnet50"), example_inputs=torch.empty(32, 3, 224, 224,
                                                                    device="meta"), dtype="bf16")
    block = next(b for b in g.blocks if b.representative == "layer3.1")
    r = solve_block(g, block.node_names, BlockSetting(tp=4, cluster=cluster, dtype="bf16"))
    assert set(r.node_strategies.values()) != {"R"}
    problem = build_problem(g, block.node_names, BlockSetting(tp=4, cluster=cluster, dtype="bf16"))
    replicated = problem.evaluate({v: 0 for v in problem.nodes})
    assert round(r.objective_s * 1e9) <= replicated


# ---- errors, determinism, caching -------------------------------------------------------

def test_infeasible_memory_budget_names_the_family(cluster):
    g = _diamond()
    names = [n.name for n in g.nodes]
    with pytest.raises(ShardingInfeasibleError, match="memory_budget: the smallest footprint") as e:
        solve_block(g, names, BlockSetting(tp=4, cluster=cluster, dtype="bf16"),
                    memory_budget_bytes=1e3)
    assert e.value.family == "memory_budget" and e.value.smallest_bytes > 1e3
    assert isinstance(e.value, ValueError)


def test_bad_arguments_raise_value_error(cluster):
    g = _chain()
    with pytest.raises(ValueError, match="tp must be"):
        solve_block(g, ["up"], BlockSetting(tp=0, cluster=cluster, dtype="bf16"))
    with pytest.raises(ValueError, match="unknown"):
        solve_block(g, ["nope"], BlockSetting(tp=2, cluster=cluster, dtype="bf16"))


def test_deterministic_and_cached(llama, cluster):
    g, names = llama
    setting = BlockSetting(tp=4, cluster=cluster, dtype="bf16")
    first = solve_block(g, names, setting)
    second = solve_block(g, names, setting)
    assert first == second
    cache: dict = {}
    a = solve_block(g, names, setting, cache=cache)
    b = solve_block(g, names, setting, cache=cache)
    def solved():
        return sum(isinstance(v, BlockSharding) for v in cache.values())

    assert a is b and solved() == 1 and a == first
    solve_block(g, names, dataclasses.replace(setting, tp=8), cache=cache)
    assert solved() == 2
    # a pinned solve of the block reuses its problem, and finds the same optimum
    pinned = solve_block(g, names, setting, cache=cache,
                         pinned_params=dict(first.param_placements))
    assert solved() == 3 and pinned.objective_s == first.objective_s


# ---- rules ------------------------------------------------------------------------------

def test_reshard_collectives():
    assert reshard_collective("S(0)", "R", 800, 8) == ("all_gather", 800)
    assert reshard_collective("P", "R", 800, 8) == ("all_reduce", 800)
    assert reshard_collective("P", "S(1)", 800, 8) == ("reduce_scatter", 800)
    assert reshard_collective("S(0)", "S(1)", 800, 8) == ("all_to_all", 100)
    assert reshard_collective("R", "S(1)", 800, 8) is None
    assert reshard_collective("R", "P", 800, 8) is None


def test_view_dim_maps():
    assert view_dim_map("aten.view.default", (2, 128, 768), (256, 768)) == {0: 0, 2: 1}
    assert view_dim_map("aten.view.default", (1, 128, 768), (128, 768)) == {1: 0, 2: 1}
    assert view_dim_map("aten.view.default", (2, 128, 4096), (2, 128, 32, 128)) == {
        0: 0, 1: 1, 2: 2}
    assert view_dim_map("aten.transpose.int", (2, 128, 32, 64), (2, 32, 128, 64)) == {
        0: 0, 1: 2, 2: 1, 3: 3}
    # a swap of two equal-sized dims cannot be told from the identity: nothing is guessed
    assert view_dim_map("aten.transpose.int", (2, 64, 64), (2, 64, 64)) == {0: 0}
    assert view_dim_map("aten.unbind.int", (3, 2, 12, 64), (2, 12, 64)) == {1: 0, 2: 1, 3: 2}


def test_matmul_rules_from_einsum():
    node = _mm("up", "input:0", (64, 32), 128, "up.weight")
    by_name = {s.name: s for s in strategies(node, 4)}
    assert set(by_name) == {"R", "S(m)", "S(k)", "S(n)"}
    assert by_name["S(n)"].inputs == ("R", "S(1)") and by_name["S(n)"].outputs == ("S(1)",)
    assert by_name["S(k)"].inputs == ("S(1)", "S(0)") and by_name["S(k)"].outputs == ("P",)
    assert by_name["S(m)"].input_grads == ("S(0)", "P")  # replicated weight: partial grad
    assert strategies(node, 1) == (by_name["R"],)


def test_view_dim_maps_of_complex_views():
    """RoPE as complex products (torchtitan): the dims before the pair of reals pass."""
    assert view_dim_map("aten.view_as_complex.default", (2, 64, 4, 8, 2), (2, 64, 4, 8)) == {
        0: 0, 1: 1, 2: 2, 3: 3}
    assert view_dim_map("aten.view_as_real.default", (2, 64, 4, 8), (2, 64, 4, 8, 2)) == {
        0: 0, 1: 1, 2: 2, 3: 3}


def test_batched_matmul_rules_shard_each_batch_dim():
    """``q @ k.transpose(-2, -1)`` on [batch, heads, seq, head_dim], recorded whole: the
    heads shard (dim 1 of both operands and of the scores), as the batch does."""
    q, k = _t((2, 4, 64, 16)), _t((2, 4, 16, 64))
    node = Node(name="scores", kind=OpKind.MATMUL, target="torch.matmul", inputs=(q, k),
                input_sources=("q", "k"), outputs=(_t((2, 4, 64, 64)),))
    by_name = {s.name: s for s in strategies(node, 2)}
    assert by_name["S(b)"].inputs == ("S(1)", "S(1)") and by_name["S(b)"].outputs == ("S(1)",)
    assert by_name["S(a)"].outputs == ("S(0)",) and by_name["S(k)"].outputs == ("P",)


def test_a_replicated_weight_may_scale_split_features_by_its_slice():
    """A norm's weight scaling split features: sharded with them, or replicated with each
    rank reading its slice, its gradient all-gathered backward (as DTensor runs a replicated
    weight against a sharded activation); no partial sum passes ``x + eps``, which is not
    linear in ``x``."""
    x, w = _t((8, 64, 64)), _t((64,))
    scale = Node(name="scale", kind=OpKind.ELEMENTWISE, target="aten.mul.Tensor",
                 inputs=(x, w), input_sources=("x", "param:norm.weight"), outputs=(x,),
                 params=(ParamSpec(fqn="norm.weight", shape=(64,), dtype=DT),))
    on_features = [s for s in strategies(scale, 2) if s.outputs == ("S(2)",)]
    assert [(s.inputs, s.input_grads, s.bwd_collectives) for s in on_features] == [
        (("S(2)", "S(0)"), ("S(2)", "S(0)"), ()),
        (("S(2)", "R"), ("S(2)", "R"), (("all_gather", float(w.num_bytes)),))]
    plus_eps = Node(name="eps", kind=OpKind.ELEMENTWISE, target="aten.add.Tensor",
                    inputs=(_t((8, 64, 1)),), input_sources=("mean",),
                    outputs=(_t((8, 64, 1)),))
    assert all("P" not in s.inputs for s in strategies(plus_eps, 2))
    both = dataclasses.replace(plus_eps, inputs=(x, x), input_sources=("a", "b"), outputs=(x,))
    assert any(s.inputs == ("P", "P") for s in strategies(both, 2))


def test_grouped_expert_gemm_rules_split_features_never_experts():
    """A fused MoE layer's expert GEMM (routed rows times [E, out, in]) shards its output
    features (column), its input features (row: output partial) or its rows, and never the
    expert dim; the gated activation after it keeps the features split from both halves."""
    rows, h, f, e = 64, 32, 16, 4
    gemm = Node(name="gate_up", kind=OpKind.MATMUL, target="moe.grouped_mm",
                inputs=(_t((rows, h)), _t((e, 2 * f, h))),
                input_sources=("dispatch", "param:experts.gate_up"), outputs=(_t((rows, 2 * f)),),
                params=(ParamSpec(fqn="experts.gate_up", shape=(e, 2 * f, h), dtype=DT),))
    by_name = {s.name: s for s in strategies(gemm, 2)}
    assert set(by_name) == {"R", "S(m)", "S(k)", "S(n)"}
    assert by_name["S(n)"].inputs == ("R", "S(1)") and by_name["S(n)"].outputs == ("S(1)",)
    assert by_name["S(k)"].inputs == ("S(1)", "S(2)") and by_name["S(k)"].outputs == ("P",)
    act = Node(name="act", kind=OpKind.ELEMENTWISE, target="moe.expert_gate",
               inputs=(_t((rows, f)), _t((rows, 2 * f))), input_sources=("silu", "gate_up"),
               outputs=(_t((rows, f)),))
    split = [s for s in strategies(act, 2) if s.outputs == ("S(1)",)]
    assert [s.inputs for s in split] == [("S(1)", "S(1)")]
    user_glu = Node(name="glu", kind=OpKind.ELEMENTWISE, target="aten.glu.default",
                    inputs=(_t((rows, 2 * f)),), input_sources=("x",), outputs=(_t((rows, f)),))
    assert not [s for s in strategies(user_glu, 2) if s.outputs == ("S(1)",)]


def test_expand_nd_is_the_product_of_axis_rules():
    node = _mm("up", "input:0", (64, 32), 128, "up.weight")
    nd = expand_nd({"dp": 2, "tp": 4}, [t.shape for t in node.inputs],
                   [t.shape for t in node.outputs], lambda n: strategies(node, n))
    assert len(nd) == len(strategies(node, 2)) * len(strategies(node, 4))
    both = next(s for s in nd if s.name == "dp:S(m) x tp:S(n)")
    assert both.work_divisor == 8
    tiny = _mm("t", "input:0", (4, 4), 4, "t.weight")  # S(m) on both axes would need 8 | 4
    nd = expand_nd({"dp": 2, "tp": 4}, [t.shape for t in tiny.inputs],
                   [t.shape for t in tiny.outputs], lambda n: strategies(tiny, n))
    assert all(s.name != "dp:S(m) x tp:S(m)" for s in nd)
