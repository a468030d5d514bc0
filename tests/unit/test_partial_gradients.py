"""Replicated parameters whose gradients tensor parallel leaves as partial sums over tp, found
from the dataflow whatever the norm is written as, counted by hand from Hugging Face configs:
per-head q/k norms (tp splits the heads they read), norms after a row-parallel GEMM and
Gemma's ``x * (1 + w)`` norms (under sequence parallel they see a sequence shard); and the
loss reading soft-capped logits, which stay split over the vocabulary."""

from __future__ import annotations

import sys
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
    assert block.head_params == 2 * HEAD_DIM
    assert block.stream_params == 2 * HIDDEN  # input and post-attention RMSNorm
    fp32 = 4
    assert partial_gradient_bytes(block, False) == fp32 * 2 * HEAD_DIM
    assert partial_gradient_bytes(block, True) == fp32 * (2 * HEAD_DIM + 2 * HIDDEN)


def test_gemma_norms_and_post_norms_are_on_the_sequence_shard():
    (block,), _ = _units(corpus.hf_gemma)  # output * (1 + w): the weight reaches it via an add
    assert block.stream_params == 2 * HIDDEN
    blocks, glue = _units(corpus.hf_gemma2)
    # input, post-attention, pre- and post-feedforward norms; the post-norms read a row
    # GEMM's output, which sequence parallel reduce-scatters
    assert [b.stream_params for b in blocks] == [4 * HIDDEN] * len(blocks)
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
