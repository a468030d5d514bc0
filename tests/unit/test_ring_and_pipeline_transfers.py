"""What context-parallel rings and pipelines send, counted by hand from the model's shapes: the
K/V of each attention (its kv heads x head_dim, K and V) per cp rank in the three ways
engines move them (`EstimateOptions.cp_rotate`), and a weight tied across pipeline stages
(Hugging Face GPT-2's head reads the token embedding), whose gradient the two stages sum once
a step. The multi-rank check that the runtime sends exactly these is
tests/distributed/test_runtime_matrix.py."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import autopar
from autopar.config import ParallelConfig
from autopar.estimate.software import SOFTWARE
from autopar.estimate.core import ModelCosts
from autopar.estimate.pipeline_comm import pp_step_collectives, tied_gradient_collectives
from autopar.estimate.timing import cp_collectives

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corpus  # noqa: E402

BATCH, SEQ = 2, 64
HIDDEN, KV_HEADS, HEAD_DIM, VOCAB = 64, 2, 16, corpus.VOCAB  # corpus._HF_DECODER


def _costs(factory, dtype="fp32"):
    with torch.device("meta"):
        model = factory()
    return ModelCosts.from_graph(autopar.trace(model, global_batch_size=BATCH, seq_len=SEQ,
                                               dtype=dtype))


@pytest.mark.parametrize("dtype,kv_bytes", [("fp32", 4), ("bf16", 2)])
@pytest.mark.parametrize("cp,tp", [(2, 1), (4, 1), (2, 2)])
def test_a_ring_passes_each_rank_s_share_of_k_and_v(dtype, kv_bytes, cp, tp):
    block = next(u for u in _costs(corpus.hf_llama, dtype).units if u.is_block)
    cfg = ParallelConfig(cp=cp, tp=tp)
    # a rank's K and V: its tokens, its kv heads (tp splits the 2 kv heads at tp=2)
    kv = 2 * BATCH * (SEQ // cp) * (KV_HEADS // tp) * HEAD_DIM * kv_bytes
    dkv = 2 * BATCH * (SEQ // cp) * (KV_HEADS // tp) * HEAD_DIM * 4  # fp32 accumulators

    def listed(rotate):
        return cp_collectives(block, cfg, replace(SOFTWARE["autopar"].options,
                                                  cp_rotate=rotate), dtype)

    assert listed("p2p") == ([("send_recv", kv)] * (cp - 1),
                             [("send_recv", kv)] * (2 * (cp - 1)))
    assert listed("ring") == ([("send_recv", kv)] * (cp - 1),
                              [("send_recv", kv)] * (cp - 1) + [("send_recv", dkv)] * cp)
    assert listed("all_gather") == ([("all_gather", kv * cp)],
                                    [("all_gather", kv * cp)] + [("all_to_all", dkv)] * cp)
    assert cp_collectives(block, ParallelConfig(tp=tp), SOFTWARE["autopar"].options,
                          dtype) == ([], [])


def test_the_last_gradient_hop_of_a_ring_is_never_hidden():
    """Whatever the attention's length, a rank waits for the dK/dV accumulator of its own K/V
    after its last block: at least one hop per layer and micro-batch is exposed, where
    Transformer Engine's K/V-with-dK/dV hops hide behind long attention entirely."""
    with torch.device("meta"):
        model = corpus.hf_llama()
    cluster = autopar.Cluster.from_profile("dgx-h100")
    cfg = ParallelConfig(dp=4, cp=2, micro_batch_size=1)
    exposed = {name: autopar.estimate(model, cluster, cfg, global_batch_size=8, seq_len=8192,
                                      software=name).breakdown["cp_comm"]
               for name in ("autopar", "megatron")}
    costs = ModelCosts.from_graph(autopar.trace(model, global_batch_size=1, seq_len=8192,
                                                dtype="bf16"))
    block = next(u for u in costs.units if u.is_block)
    dkv = cp_collectives(block, cfg, SOFTWARE["autopar"].options, "bf16")[1][-1][1]
    hop = cluster.collective_time("send_recv", dkv, (0, 1))
    layers, micro_batches = block.count, 2
    assert exposed["megatron"] == 0.0
    assert exposed["autopar"] >= layers * micro_batches * hop * (1 - 1e-9)


def test_a_head_tied_to_the_embedding_sums_its_gradient_between_the_two_stages():
    costs = _costs(corpus.hf_gpt2)
    head = next(u for u in costs.units if u.tied_params)
    assert [(numel, rows) for _, numel, rows in head.tied_params] == [(VOCAB * HIDDEN, VOCAB)]
    untied = _costs(corpus.hf_llama)  # Llama's head has a weight of its own
    assert not any(u.tied_params for u in untied.units)
    options = SOFTWARE["autopar"].options
    for cfg, shard in [(ParallelConfig(pp=2), 1), (ParallelConfig(pp=2, tp=2), 2),
                       (ParallelConfig(pp=2, dp=2, zero_stage=3), 2),
                       (ParallelConfig(pp=2, dp=2, zero_stage=0), 1)]:
        for rank in (0, 1):  # the embedding's stage and the head's
            sent = tied_gradient_collectives(costs.units, _layers_per_rank(costs, cfg), cfg,
                                             options, "fp32", rank)
            assert sent == [("send_recv", VOCAB * HIDDEN * 4 / shard)], (cfg, rank)
    odd = _costs(corpus.hf_gpt2_odd_vocab)  # 257 rows: the first tp rank holds 129
    cfg = ParallelConfig(pp=2, tp=2)
    assert tied_gradient_collectives(odd.units, _layers_per_rank(odd, cfg), cfg, options,
                                     "fp32", 0) == [("send_recv", 129 * HIDDEN * 4)]
    # both on one stage: nothing to sum
    assert pp_step_collectives(costs, ParallelConfig(), global_batch_size=BATCH) == []


def _layers_per_rank(costs, cfg):
    from autopar.estimate.layout import step_layers

    return step_layers(costs, cfg, cfg.dp * cfg.micro_batch_size, None)[2]


@pytest.mark.parametrize("pp,v,rank,hops", [(2, 1, 0, 1), (2, 1, 1, 1), (4, 1, 1, 2),
                                            (4, 1, 3, 1), (2, 2, 0, 3), (2, 2, 1, 3)])
def test_a_pipeline_rank_sends_activations_forward_and_gradients_back(pp, v, rank, hops):
    """Per micro-batch: each stage the rank holds sends to the next unless it is the last,
    and back to the previous unless it is the first (interleaved: rank r holds stages r and
    r + pp)."""
    costs = _costs(corpus.hf_llama)
    m = 4
    cfg = ParallelConfig(pp=pp, virtual_stages=v, micro_batch_size=1,
                         pp_schedule="interleaved-1f1b" if v > 1 else "1f1b")
    sent = pp_step_collectives(costs, cfg, global_batch_size=m, pipeline_rank=rank)
    assert sent == [("send_recv", SEQ * HIDDEN * 4)] * (hops * m)
    sp = replace(cfg, tp=2, sequence_parallel=True)
    assert set(pp_step_collectives(costs, sp, global_batch_size=m, pipeline_rank=rank)) == \
        {("send_recv", SEQ * HIDDEN * 4 / 2)}
    whole = replace(cfg, tp=2, sequence_parallel=False)  # replicated: each tp rank sends it
    assert set(pp_step_collectives(costs, whole, global_batch_size=m, pipeline_rank=rank)) \
        == {("send_recv", SEQ * HIDDEN * 4)}


def test_a_rank_passes_the_kv_heads_its_query_heads_read():
    """Under tp=2: StarCoder's one K/V head, read by SDPA as it is, is whole on each rank and
    the ring passes all of it; where the model repeats K/V to the query heads before SDPA
    (the hand-written MQA Llama), each rank passes the repeated heads its queries read, half;
    Hugging Face Llama's two K/V heads split over tp."""
    cfg = ParallelConfig(cp=2, tp=2)
    options = SOFTWARE["autopar"].options
    for factory, split in [(corpus.hf_gpt_bigcode, 1), (corpus.plain_mqa, 2),
                           (corpus.hf_llama, 2)]:
        block = next(u for u in _costs(factory).units if u.is_block)
        (sent,), _ = cp_collectives(block, cfg, options, "fp32")
        assert sent == ("send_recv", block.attention_kv_bytes / (2 * split)), factory


@pytest.mark.parametrize("pp, every", [(1, 1), (1, 2), (2, 2), (2, 3)])
def test_full_recompute_runs_again_the_blocks_the_runtime_checkpoints(pp, every):
    """Gemma 2's two kinds of block alternate (sliding-window, global): the layers whose
    forward full recompute re-runs on a pipeline rank are the k-th, 2k-th, ... of its blocks
    in the model's order, as the runtime wraps them (`runtime.apply._apply_recompute`),
    counted here over the block list itself."""
    from autopar.estimate.layout import recomputed_layers
    from autopar.estimate.stages import layer_sequence

    costs = _costs(corpus.hf_gemma2)
    units = list(costs.units)
    blocks = [u.name for u, _ in layer_sequence(units) if u.is_block]
    assert len(set(blocks)) == 2  # two block units, alternating
    per_rank = len(blocks) // pp
    for rank in range(pp):
        cfg = ParallelConfig(pp=pp, recompute="full", recompute_every=every)
        got = recomputed_layers(units, cfg, None, rank)
        mine = blocks[rank * per_rank:(rank + 1) * per_rank]
        want = [sum(name == u.name for name in mine[every - 1::every]) for u in units]
        assert got == want, (rank, got, want)
        none = replace(cfg, recompute="per_op", recompute_every=1)
        assert recomputed_layers(units, none, None, rank) == [0] * len(units)
