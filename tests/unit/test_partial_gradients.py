"""Replicated parameters whose gradients tensor parallel leaves as partial sums over tp, found
from the dataflow whatever the norm is written as, counted by hand from Hugging Face configs:
per-head q/k norms (tp splits the heads they read), norms after a row-parallel GEMM and
Gemma's ``x * (1 + w)`` norms (under sequence parallel they see a sequence shard); and the
loss reading soft-capped logits, which stay split over the vocabulary."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

import autopar
from autopar.config import ParallelConfig
from autopar.estimate.core import ModelCosts
from autopar.estimate.timing import tp_collectives
from autopar.estimate.tp_comm import partial_gradient_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corpus  # noqa: E402

HIDDEN, HEAD_DIM, LAYERS = 64, 16, 4  # corpus._HF_DECODER, head_dim of the configs below


def _units(factory):
    with torch.device("meta"):
        model = factory()
    costs = ModelCosts.from_graph(autopar.trace(model, global_batch_size=2, seq_len=32))
    blocks = [u for u in costs.units if u.is_block]
    return blocks, {u.name: u for u in costs.units if not u.is_block}


def test_per_head_norms_reduce_their_gradients_with_or_without_sequence_parallel():
    (block,), _ = _units(corpus.hf_qwen3)  # q_norm and k_norm over each head's 16 features
    assert block.head_params == (HEAD_DIM, HEAD_DIM)
    assert block.stream_params == (HIDDEN, HIDDEN)  # input and post-attention RMSNorm
    fp32 = 4
    assert partial_gradient_bytes(block, False) == fp32 * 2 * HEAD_DIM
    assert partial_gradient_bytes(block, True) == fp32 * (2 * HEAD_DIM + 2 * HIDDEN)


def test_gemma_norms_and_post_norms_are_on_the_sequence_shard():
    (block,), _ = _units(corpus.hf_gemma)  # output * (1 + w): the weight reaches it via an add
    assert block.stream_params == (HIDDEN, HIDDEN)
    blocks, glue = _units(corpus.hf_gemma2)
    # input, post-attention, pre- and post-feedforward norms; the post-norms read a row
    # GEMM's output, which sequence parallel reduce-scatters
    assert [b.stream_params for b in blocks] == [(HIDDEN,) * 4] * len(blocks)
    assert sum(b.count for b in blocks) == LAYERS


def test_the_loss_reads_soft_capped_logits_split_over_the_vocabulary():
    _, glue = _units(corpus.hf_gemma2)  # logits / cap, tanh, * cap, then the cross-entropy
    post = glue["post"]
    fwd, bwd = tp_collectives(post, ParallelConfig(tp=2))
    rows = 2 * 32
    assert sorted(fwd) == [("all_reduce", rows * 4)] * 3  # max, sum, target logit (fp32)
    assert bwd == [("all_reduce", 2 * 32 * HIDDEN * 4)]  # the head's input gradient


def test_norms_over_a_whole_split_projection_reduce_their_statistics():
    """OLMo 2 normalises the whole q and k projections (64 and 32 features, which tp splits):
    each rank sums its share of a row's squares and the per-row statistic is all-reduced,
    forward and (its gradient) backward; the norms' weights, which scale split features,
    have their gradients gathered from the ranks' shares. Qwen3's per-head norms reduce
    the head dim, which tp does not split: nothing of the kind."""
    (block,), _ = _units(corpus.hf_olmo2)
    rows, fp32 = 2 * 32, 4
    stats = [("stat", rows * fp32)] * 2
    assert sorted((k, n) for d, k, n in block.tp_syncs if d == "forward" and k != "reduce") \
        == stats
    assert sorted((k, n) for d, k, n in block.tp_syncs if d == "backward" and k != "reduce") \
        == stats + [("weight", 32 * fp32), ("weight", 64 * fp32)]
    for sp in (False, True):
        fwd, bwd = tp_collectives(block, ParallelConfig(tp=2, sequence_parallel=sp))
        assert fwd.count(("all_reduce", rows * fp32)) == 2
        assert bwd.count(("all_reduce", rows * fp32)) == 2
        assert {("all_gather", 32 * fp32), ("all_gather", 64 * fp32)} <= set(bwd)
    twice = block.scaled(2)  # the statistics grow with the rows, the weights do not
    assert ("backward", "weight", 64 * fp32) in twice.tp_syncs
    assert ("forward", "stat", 2 * rows * fp32) in twice.tp_syncs
    (qwen3,), _ = _units(corpus.hf_qwen3)
    assert all(k in ("reduce", "loss", "gather") for _, k, _ in qwen3.tp_syncs)


def _costs(factory, dtype: str):
    with torch.device("meta"):
        model = factory()
    graph = autopar.trace(model, global_batch_size=1, seq_len=32, dtype=dtype)
    return model, ModelCosts.from_graph(graph).units


def test_fsdp2_reduces_each_partial_gradient_on_its_own_per_reduce_scatter_pass():
    """A hand-written Llama at tp=2 with sequence parallel, dp=2, two micro-batches a rank:
    without FSDP the norms' gradients (every 1-D parameter of the model: 2 per block and the
    final norm's) are all-reduced over tp in one buffer once a step; FSDP2 redistributes
    each DTensor gradient on its own when it reduces it, so each norm's is all-reduced alone
    in every reduce-scatter pass: per micro-batch under ZeRO-2 and -3 in the gathered
    parameters' dtype, once under ZeRO-1 in the reduce dtype it accumulated in."""
    from autopar.estimate.software import software_options
    from autopar.estimate.tp_comm import gradient_collectives

    fsdp2 = software_options("autopar", autopar.EstimateOptions())
    assert fsdp2.fsdp2 and fsdp2.grad_reduce_dtype == "fp32"
    for dtype, param_b in (("fp32", 4), ("bf16", 2)):
        model, units = _costs(corpus.plain_llama, dtype)
        norms = [p.numel() for p in model.parameters() if p.dim() == 1]
        assert len(norms) == 2 * LAYERS + 1

        def listed(zero: int, options) -> list:
            cfg = ParallelConfig(dp=2, tp=2, sequence_parallel=True, zero_stage=zero)
            return sorted(gradient_collectives(units, [u.count for u in units], cfg, options,
                                               2, dtype))

        one_buffer = [("all_reduce", sum(norms) * (4 if dtype == "fp32" else 2))]
        assert listed(0, fsdp2) == listed(2, autopar.EstimateOptions()) == one_buffer
        for zero, passes, per_elem in ((1, 1, 4), (2, 2, param_b), (3, 2, param_b)):
            assert listed(zero, fsdp2) == sorted([("all_reduce", n * per_elem)
                                                  for n in norms] * passes), (dtype, zero)


def test_a_fused_bias_is_whole_on_each_tp_rank_under_fsdp2():
    """nanoGPT's fused q/k/v bias, split by chunk over tp where FSDP2 does not shard the
    parameters: under FSDP2 (which cannot shard a chunk-strided 1-D tensor again) it is
    whole on every tp rank -- each block's FSDP unit gathers and reduce-scatters (1 - 1/tp)
    of it more -- and each rank's chunks of its gradient are all-gathered over tp in every
    reduce-scatter pass (per micro-batch under ZeRO-3, once in a pipeline)."""
    from autopar.estimate.data_parallel import dp_step_collectives
    from autopar.estimate.software import software_options
    from autopar.estimate.tp_comm import gradient_collectives

    fsdp2 = software_options("autopar", autopar.EstimateOptions())
    with torch.device("meta"):
        model = corpus.nano_gpt()
    graph = autopar.trace(model, global_batch_size=1, seq_len=32, dtype="fp32")
    costs = ModelCosts.from_graph(graph)
    units = costs.units
    bias = model.transformer.h[0].attn.c_attn.bias.numel()
    (block,) = [u for u in units if u.is_block]
    assert block.split_fused_biases(2) == (bias,)
    cfg = ParallelConfig(dp=2, tp=2, zero_stage=3)
    gathers = [c for c in gradient_collectives(units, [u.count for u in units], cfg, fsdp2, 2,
                                               "fp32") if c[0] == "all_gather"]
    assert gathers == [("all_gather", 4 * bias)] * (block.count * 2)
    piped = replace(cfg, pp=2)
    half = [(u.count + 1) // 2 for u in units]  # either stage's share, at most
    assert [c for c in gradient_collectives(units, half, piped, fsdp2, 2, "fp32")
            if c[0] == "all_gather"] == [("all_gather", 4 * bias)] * half[units.index(block)]
    assert not [c for c in gradient_collectives(units, [u.count for u in units], cfg,
                                                autopar.EstimateOptions(), 2, "fp32")
                if c[0] == "all_gather"]

    def unit_gathers(options) -> set:
        return {n for kind, n in dp_step_collectives(costs, cfg, options, global_batch_size=4,
                                                    dtype="fp32") if kind == "all_gather"}

    megatron = unit_gathers(autopar.EstimateOptions(fsdp2=False))
    per_layer = block.dense_on_tp_rank(2) * 4
    assert per_layer in megatron and per_layer + 4 * bias / 2 in unit_gathers(fsdp2)


def test_values_made_of_parameters_on_split_features_reduce_their_gradients_per_layer():
    """Apertus's xIELU activation scales the split MLP features by ``softplus(alpha)`` (one
    element, made of a parameter alone, two per layer): each tp rank's gradient of it is a
    partial sum, which DTensor all-reduces at the softplus in every backward. The estimate
    charges those two fp32 all-reduces per layer, whatever the batch, and the intra-op ILP's
    execution of Megatron's layout runs them too (it does not defer them to the parameter)."""
    from autopar.plan.placements import megatron_tp_placements
    from autopar.search.intra_op import solve_block
    from autopar.sharding.problem import BlockSetting

    (block,), _ = _units(corpus.hf_apertus)
    scalar = [s for s in block.tp_syncs if s[1] == "param"]
    assert scalar == [("backward", "param", 4)] * 2
    cfg = ParallelConfig(tp=2)
    _, bwd = tp_collectives(block.scaled(8.0), cfg)
    assert bwd.count(("all_reduce", 4)) == 2
    with torch.device("meta"):
        model = corpus.hf_apertus()
    graph = autopar.trace(model, global_batch_size=2, seq_len=32)
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
    solved = solve_block(graph, graph.blocks[0].node_names,
                         BlockSetting(tp=2, cluster=cluster, dtype="bf16", boundary="replicated"),
                         pinned_params=megatron_tp_placements(graph, 2))
    assert [c for c in solved.backward_collectives if c[1] < 16] == [("all_reduce", 4.0)] * 2


def test_a_learned_scalar_read_directly_joins_the_steps_partial_gradients():
    """A scalar parameter multiplying the split MLP features directly (``alpha * gelu(h)``):
    the product is linear in it, so DTensor hands its partial gradient back to the parameter,
    reduced with the step's other partial gradients (once a step), not at every layer."""
    (block,), _ = _units(corpus.scaled_mlp)
    assert block.head_params == (1,)
    assert not [s for s in block.tp_syncs if s[1] == "param"]
    assert partial_gradient_bytes(block, False) == 4
