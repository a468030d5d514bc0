"""The plan's tensor-parallel layout from the intra-op ILP in full price
(`autopar.search.tp_layout`): models written elsewhere, at widths where replicated states do
not fit, come out Megatron-shaped from the ILP alone; a fused q/k/v projection is split by
chunk; the price the ILP sees is the estimate's."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import autopar
from autopar.plan import megatron_tp_placements
from autopar.search.intra_op import BlockSetting, solve_block
from autopar.search.tp_layout import block_budget, layout_price
from costmodels.memory import ALLOCATOR_RESERVE_FRACTION, state_bytes_per_param

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corpus  # noqa: E402

NODE = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)


def _plain_llama_405b_widths():
    """Meta-style Llama (hand-written RMSNorm, SwiGLU, grouped-query attention 128/8) at
    Llama-3-405B's widths, 8 layers."""
    return corpus.PlainLlama(vocab=128256, dim=16384, n_layers=8, n_heads=128, n_kv_heads=8,
                             ffn_dim=53248, max_seq=8192)


def _nano_gpt_175b_widths():
    """nanoGPT (fused c_attn split in three, LayerNorm, GELU, biases) at GPT-3 175B's
    widths, 8 layers."""
    return corpus.NanoGPT(vocab=50304, block_size=4096, n_layer=8, n_head=96, n_embd=12288)


@pytest.mark.parametrize("make, seq_len, column, row", [
    (_plain_llama_405b_widths, 8192,
     ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"), ("attn.o", "mlp.down")),
    (_nano_gpt_175b_widths, 4096, ("attn.c_attn", "mlp.c_fc"), ("attn.c_proj", "mlp.c_proj")),
])
def test_models_written_elsewhere_come_out_megatron_shaped_from_the_ilp(make, seq_len, column,
                                                                        row):
    with torch.device("meta"):
        model = make()
    plan = autopar.compile(model, NODE, global_batch_size=16, seq_len=seq_len,
                           constraints={"tp": 8})
    (entry,) = plan.intra_op.values()
    assert entry["matches_estimate_layout"]  # the ILP's own choice
    layer = next(iter(plan.intra_op))
    # and its proven optimum: CP-SAT on the same problem (the price and the rank's free
    # memory) places the parameters alike
    graph = autopar.trace(model, global_batch_size=plan.config.micro_batch_size,
                          seq_len=seq_len, dtype="bf16")
    state, step = layout_price(plan.estimate, "bf16")
    exact = solve_block(graph, graph.blocks[0].node_names, BlockSetting(
        tp=8, cluster=NODE, dtype="bf16", bytes_per_param=state, step_s_per_param=step,
        boundary="S(1)", microbatches=plan.estimate.num_microbatches),
        memory_budget_bytes=entry.get("memory_budget_bytes"), method="cp-sat")
    assert plan.config.sequence_parallel and exact.optimal
    megatron = megatron_tp_placements(graph)
    assert all(megatron.get(fqn, "R") == p for fqn, p in exact.param_placements.items())
    for name in column:
        assert plan.placements[f"{layer}.{name}.weight"]["tp"] == "S(0)", name
    for name in row:
        assert plan.placements[f"{layer}.{name}.weight"]["tp"] == "S(1)", name
    # replicating even the attention's output projection in every layer would hold more
    # than the rank has free
    weights = dict(model.named_parameters())
    layers = {name.split(".")[-3 - row[0].count(".")] for name in weights
              if name.endswith(f".{row[0]}.weight")}
    numel = weights[f"{layer}.{row[0]}.weight"].numel()
    free = plan.estimate.usable_memory_bytes - plan.estimate.peak_memory_bytes
    assert len(layers) * numel * (1 - 1 / 8) * state > free


def test_a_fused_projection_is_split_by_chunk():
    # nanoGPT's c_attn output is split into q, k and v: Megatron's layout (c_attn split per
    # chunk) runs without resharding between the projection and the attention, so the
    # block's forward has two tp reductions, one per sub-layer, as the estimate charges
    graph = autopar.trace(corpus.nano_gpt(), global_batch_size=8, seq_len=64)
    block = graph.blocks[0]
    sol = solve_block(graph, block.node_names,
                      BlockSetting(tp=4, cluster=NODE, dtype="bf16", boundary="replicated"),
                      pinned_params=megatron_tp_placements(graph))
    assert [kind for kind, _ in sol.forward_collectives] == ["all_reduce", "all_reduce"]
    assert sol.node_strategies[next(n for n in block.node_names if "split" in n)] \
        == "S(2) by chunk"


def test_the_price_is_the_estimates_state_and_step_work():
    with torch.device("meta"):
        model = _plain_llama_405b_widths()
    plan = autopar.compile(model, NODE, global_batch_size=16, seq_len=8192,
                           constraints={"tp": 8})
    est, cfg = plan.estimate, plan.config
    state, step = layout_price(est, "bf16")
    assert state == state_bytes_per_param("bf16", cfg.zero_stage, cfg.dp * cfg.cp)
    params = max(m["_params"] for m in est.memory_by_stage)
    per_step = est.breakdown["dp_comm"] + est.breakdown["optimizer"]
    assert step * params * est.num_microbatches == pytest.approx(per_step)
    layers = autopar.trace(model, global_batch_size=1, seq_len=8192).blocks[0].layer_fqns
    assert len(layers) == 8 and cfg.pp == 1  # all on the one pipeline rank
    free = (est.usable_memory_bytes - est.peak_memory_bytes) / (1 + ALLOCATOR_RESERVE_FRACTION)
    assert block_budget(est, layers, 1e9) == pytest.approx(1e9 + free / 8)


def test_a_replicated_mlp_costs_its_whole_weights_and_no_activation_traffic():
    """`Unit.replicated` against the module's own parameter counts: Megatron's layout with a
    hand-written Llama's MLP replicated on the sequence shard (tp=4, sequence parallel) drops
    that sub-layer's reduction each way, holds the MLP's weights whole on every rank (its
    training state grows by their elements x (1 - 1/tp) x bytes per element, nothing else),
    and all-reduces their gradients once a step with the norms'."""
    from autopar.estimate.core import ModelCosts, costs_of_layout
    from autopar.estimate.tp_comm import tp_step_collectives

    model = corpus.PlainLlama(vocab=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
                              ffn_dim=768, max_seq=256)
    graph = autopar.trace(model, global_batch_size=1, seq_len=256, dtype="fp32")
    cfg = autopar.ParallelConfig(dp=2, tp=4, sequence_parallel=True, micro_batch_size=1)
    layout = megatron_tp_placements(graph)
    layout.update({f"blocks.0.mlp.{w}.weight": "R" for w in ("gate", "up", "down")})
    megatron = ModelCosts.from_graph(graph)
    relaid = costs_of_layout(graph, cfg, layout)
    (block,) = [u for u in megatron.units if u.is_block]
    (mlp,) = [u for u in relaid.units if u.is_block]
    mlp_params = sum(p.numel() for p in model.blocks[0].mlp.parameters())
    assert mlp.tp_replicated_params == mlp_params
    assert mlp.dense_on_tp_rank(4) - block.dense_on_tp_rank(4) == mlp_params * 3 / 4
    assert mlp.tp_reductions == (1, 1) and block.tp_reductions == (2, 2)
    assert sum(mlp.stream_params) - sum(block.stream_params) == mlp_params
    # the step's tp traffic: per micro-batch one all-gather and one reduce-scatter of the
    # hidden state fewer each way per layer, and the MLP gradients in the one all-reduce
    per_layer = 256 * 256 * 4  # one sequence's hidden state, fp32
    def step(costs, reduce: bool) -> Counter:
        return Counter(c for c in tp_step_collectives(costs, cfg, global_batch_size=2)
                       if (c[0] == "all_reduce") == reduce)

    assert step(megatron, False) - step(relaid, False) == \
        Counter({("all_gather", per_layer): 8, ("reduce_scatter", per_layer): 8})
    assert not step(relaid, False) - step(megatron, False)
    reduced = [sum(n * k for (_, n), k in step(c, True).items()) for c in (megatron, relaid)]
    assert reduced[1] - reduced[0] == 4 * mlp_params * 4  # 4 layers, fp32
    # the estimate's training state grows by exactly the MLP weights' extra elements
    shape = dict(global_batch_size=2, dtype="fp32")
    states = [autopar.estimate(graph, NODE, cfg, **shape, tp_placements=t)
              .memory_by_stage[0]["states"] for t in (None, layout)]
    per_elem = state_bytes_per_param("fp32", cfg.zero_stage, cfg.dp, False)
    assert states[1] - states[0] == pytest.approx(4 * mlp_params * 3 / 4 * per_elem)


def test_the_plan_takes_the_fastest_layout_of_the_winner_and_its_runners_up():
    """Llama-3-8B widths, 8K tokens, on one DGX H100 with tp=2 pinned: every simulated
    runner-up the search kept with sequence parallel is a rival (fits, tp > 1, ordered by its
    step less its tp communication, which no layout can beat); the plan is the estimate of
    its own config in its own layout, and no slower than the search's winner in
    Megatron-LM's layout."""
    from autopar.models.llama import Llama, LlamaConfig
    from autopar.search.tp_layout import _rivals

    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=128256, dim=4096, n_layers=8, n_heads=32,
                                  n_kv_heads=8, ffn_dim=14336, max_seq_len=8192))
    shape = dict(global_batch_size=16, seq_len=8192)
    plan = autopar.compile(model, NODE, **shape, constraints={"tp": 2})
    megatron = autopar.compile(model, NODE, **shape, constraints={"tp": 2},
                               settings=autopar.SearchSettings(tp_layouts="megatron"))
    assert plan.estimate.step_time_s <= megatron.estimate.step_time_s
    again = autopar.estimate(model, NODE, plan.config, **shape, software="autopar",
                             tp_placements=plan.tp_placements)
    assert again.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-12)
    rivals = _rivals(plan.candidates, megatron.config)
    assert rivals and all(r.config.sequence_parallel and r.config.tp > 1 for r in rivals)
    assert megatron.config not in [r.config for r in rivals]
    assert [r.step_bound for r in rivals] == sorted(r.step_bound for r in rivals)
    table = plan.candidates
    for r in rivals:
        row = table[(table["step_time_s"] - table["t_tp_comm"]) == r.step_bound].iloc[0]
        assert bool(row["fits"]) and bool(row["exact"])


@pytest.mark.parametrize("make", [
    lambda: corpus.PlainLlama(vocab=32000, dim=2048, n_layers=4, n_heads=16, n_kv_heads=4,
                              ffn_dim=5632, max_seq=4096),
    lambda: corpus.NanoGPT(vocab=50304, block_size=4096, n_layer=4, n_head=16, n_embd=2048)])
def test_the_ilp_prices_a_blocks_kernels_as_the_estimate_does(make):
    """The ILP's compute for the layout a plan takes (sequence parallel, tp=4, its MLP
    replicated) equals the estimate's for the plan's layer (`unit_compute`: every kernel's
    work and launch), to the ILP's integer nanoseconds; and the ops on features Megatron's
    layout splits (an MLP's activation) are split over tp without sequence parallel too."""
    from autopar.estimate.core import costs_of_layout
    from autopar.estimate.software import software_options
    from autopar.estimate.timing import unit_compute

    opts = software_options("autopar", autopar.EstimateOptions())
    with torch.device("meta"):
        model = make()
    plan = autopar.compile(model, NODE, global_batch_size=32, seq_len=2048,
                           constraints={"tp": 4, "micro_batch_size": 1,
                                        "sequence_parallel": True})
    cfg = plan.config
    graph = autopar.trace(model, global_batch_size=1, seq_len=2048, dtype="bf16")
    (unit,) = [u for u in costs_of_layout(graph, cfg, plan.tp_placements).units if u.is_block]
    c = unit_compute(unit, cluster=NODE, dtype="bf16", cfg=cfg,
                     attention_kernel=opts.attention_kernel, kernels=opts.kernels,
                     loss_kernel=opts.loss_kernel)
    (block,) = plan.intra_op.values()
    assert block["replicated_sublayers"] == [1]
    assert block["compute_s"] == pytest.approx(c.fwd + c.bwd, rel=1e-5)
    sharded = [op for op in unit.ops if op.kind == "memory" and op.tp_sharded]
    assert sharded and not any(op.param_bytes for op in sharded)  # no norm among them


@pytest.mark.parametrize("make", [
    lambda: corpus.PlainLlama(vocab=32000, dim=2048, n_layers=4, n_heads=16, n_kv_heads=4,
                              ffn_dim=5632, max_seq=4096),
    lambda: corpus.NanoGPT(vocab=50304, block_size=4096, n_layer=4, n_head=16, n_embd=2048)])
def test_the_ilp_prices_a_blocks_collectives_as_the_estimate_does(make):
    """The ILP's communication for the layout a plan takes (sequence parallel, tp=4, its MLP
    replicated) is the estimate's: its forward and backward collectives timed on the plan's
    tp group are the estimate's per layer and micro-batch (`tp_collectives`), and the rest of
    its communication is its layer's share, per micro-batch, of the once-a-step all-reduce
    of the partial gradients the sequence shard leaves on all the rank's parameters, its
    own bytes being the estimate's (`partial_gradient_bytes`); the estimate's step holds the
    same terms, per layer and micro-batch and once a step (`breakdown["tp_comm"]`)."""
    from autopar.estimate.core import costs_of_layout
    from autopar.estimate.groups import slowest_groups
    from autopar.estimate.timing import tp_collectives
    from autopar.estimate.tp_comm import partial_gradient_bytes

    with torch.device("meta"):
        model = make()
    plan = autopar.compile(model, NODE, global_batch_size=32, seq_len=2048,
                           constraints={"tp": 4, "micro_batch_size": 1,
                                        "sequence_parallel": True})
    cfg, est = plan.config, plan.estimate
    graph = autopar.trace(model, global_batch_size=1, seq_len=2048, dtype="bf16")
    units = costs_of_layout(graph, cfg, plan.tp_placements).units
    (unit,) = [u for u in units if u.is_block]
    (block,) = plan.intra_op.values()
    assert block["replicated_sublayers"] == [1] and cfg.pp == 1
    group = slowest_groups(cfg, NODE).tp

    def seconds(collectives):
        return sum(NODE.collective_time(kind, n, group) for kind, n in collectives)

    def all_reduce_beyond_empty(nbytes):
        return seconds([("all_reduce", nbytes)]) - seconds([("all_reduce", 1.0)])

    activations = seconds(block["forward_collectives"] + block["backward_collectives"])
    assert activations == pytest.approx(seconds(sum(tp_collectives(unit, cfg), [])), rel=1e-4)
    grads = sum(n for _, n in block["gradient_collectives"])
    assert grads == pytest.approx(partial_gradient_bytes(unit, True))
    m = est.num_microbatches
    stream = sum(partial_gradient_bytes(u, True) * u.count for u in units)  # a final norm's too
    share = all_reduce_beyond_empty(stream) * grads / stream / m
    assert block["comm_s"] == pytest.approx(activations + share, rel=1e-4)
    assert est.breakdown["tp_comm"] == pytest.approx(
        m * sum(u.count * seconds(sum(tp_collectives(u, cfg), [])) for u in units)
        + seconds([("all_reduce", stream)]), rel=1e-6)


def _gloo_plan_units(make, sequence_parallel):
    """The plan of ``make()``'s model at tp=2 on 2 gloo ranks (8 sequences of 64 tokens) and
    the estimate's units in its layout at the micro-batch, by name."""
    from autopar.estimate.core import costs_of_layout

    with torch.device("meta"):
        model = make()
    gloo = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=2)
    plan = autopar.compile(model, gloo, global_batch_size=8, seq_len=64, dtype="fp32",
                           constraints={"tp": 2, "sequence_parallel": sequence_parallel})
    graph = autopar.trace(model, global_batch_size=plan.config.micro_batch_size, seq_len=64,
                          dtype="fp32")
    units = costs_of_layout(graph, plan.config, plan.tp_placements).units
    return plan, {u.name: u for u in units}


@pytest.mark.parametrize("make", [corpus.hf_mixtral, corpus.moe_loop])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_ilp_prices_an_moe_block_as_the_runtime_runs_it(make, sequence_parallel):
    """MoE blocks (Hugging Face Mixtral's fused [E, out, in] experts with the router outside
    them, and experts in a loop over a list) at tp=2, on a cluster where a collective's
    latency dominates (gloo): the ILP's solve of the plan's layout issues the estimate's
    collectives, one reduction each way per sub-layer (the routing hands partial gradients
    back, "R~P"; the fused experts' weights and gated activation split on features), and
    the partial parameter gradients it leaves are the estimate's, the router's among them
    (`partial_gradient_bytes`)."""
    from autopar.estimate.timing import tp_collectives
    from autopar.estimate.tp_comm import partial_gradient_bytes, primitive_collectives

    plan, units = _gloo_plan_units(make, sequence_parallel)
    (unit,) = [u for u in units.values() if u.is_block]
    assert sum(unit.router_params) > 0
    (block,) = plan.intra_op.values()
    fwd, bwd = tp_collectives(unit, plan.config)
    assert primitive_collectives(block["forward_collectives"] + block["backward_collectives"]) \
        == primitive_collectives(fwd + bwd)
    assert sum(n for _, n in block["gradient_collectives"]) == pytest.approx(
        partial_gradient_bytes(unit, sequence_parallel))


@pytest.mark.parametrize("make", [corpus.hf_gemma2, corpus.titan_llama,
                                  corpus.hf_deepseek_v3])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_ilp_runs_attention_as_written_on_split_heads(make, sequence_parallel):
    """Attention as models write it: Gemma 2's eager scores (``q @ k.transpose`` with
    soft-capping, k/v heads repeated by ``expand``), torchtitan's RoPE as complex products
    (``view_as_complex``), DeepSeek-V3's latent attention (low-rank down-projections every
    rank runs whole, their partial gradients handed back to the sub-layer's input). At tp=2
    on gloo the ILP's best execution of the plan's layout keeps the heads split through
    them, with the estimate's collectives: no all-to-all to a batch split, no gathered
    projection, no reduction inside the sub-layer."""
    from autopar.estimate.timing import tp_collectives
    from autopar.estimate.tp_comm import primitive_collectives

    plan, units = _gloo_plan_units(make, sequence_parallel)
    for name, block in plan.intra_op.items():
        fwd, bwd = tp_collectives(units[name], plan.config)
        ilp = block["forward_collectives"] + block["backward_collectives"]
        assert primitive_collectives(ilp) == primitive_collectives(fwd + bwd), name
        assert len(ilp) == len(fwd + bwd) and "all_to_all" not in {k for k, _ in ilp}, name


def test_a_model_given_example_inputs_has_its_layout_solved_at_the_micro_batch():
    """A ViT compiled from example inputs of 8 images, with 2 images per micro-batch pinned
    (dp2 tp2 pp2): the intra-op ILP solves its block traced at the micro-batch, so the
    block's collectives in the plan are the estimate's for one layer (solved at the 8 traced
    images, each was 4 times the bytes)."""
    from autopar.estimate.core import costs_of_layout
    from autopar.estimate.timing import tp_collectives
    from autopar.estimate.tp_comm import primitive_collectives

    with torch.device("meta"):
        model = corpus.vit_encoder()
    images = torch.empty(8, *corpus.IMAGE_SHAPE, device="meta")
    gloo = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=8)
    plan = autopar.compile(model, gloo, global_batch_size=8, example_inputs=(images,),
                           dtype="fp32", constraints={"dp": 2, "tp": 2, "pp": 2,
                                                      "micro_batch_size": 2})
    graph = autopar.trace(model, example_inputs=(images[:2],), dtype="fp32")
    units = {u.name: u for u in costs_of_layout(graph, plan.config, plan.tp_placements).units}
    (block, entry), = plan.intra_op.items()
    charged = primitive_collectives(sum(tp_collectives(units[block], plan.config), []))
    assert charged and primitive_collectives(entry["forward_collectives"]
                                             + entry["backward_collectives"]) == charged
