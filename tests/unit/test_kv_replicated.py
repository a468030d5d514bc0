"""Tensor parallel over more ranks than an attention has key/value heads (multi-query and
grouped-query attention): the K and V projections found from the dataflow are replicated, each
rank computes them whole and reads the kv heads its query heads use, and their outputs'
gradients are gathered or all-reduced backward. A fused q/k/v projection that tp cannot split by
head (its output cut into q, k and v of unequal widths, or fewer kv heads than tp) is replicated
whole, each rank slicing its query heads. Checked against hand counts on a hand-written Llama
with one kv head and on StarCoder's and Phi-3's fused projections."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import autopar
from autopar.config import ParallelConfig, check_config
from autopar.errors import InvalidConfigError
from autopar.estimate.core import ModelCosts
from autopar.estimate.timing import op_times, tp_collectives
from autopar.ir.residual import kv_projections
from autopar.plan import export_plan, megatron_tp_placements

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corpus  # noqa: E402

NODE = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
DIM, HEADS, FFN, VOCAB, LAYERS = 512, 8, 1024, 1024, 2
HEAD_DIM = DIM // HEADS
BATCH, SEQ = 2, 128


def _mqa_llama(kv_heads: int = 1):
    with torch.device("meta"):
        return corpus.PlainLlama(vocab=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=HEADS,
                                 n_kv_heads=kv_heads, ffn_dim=FFN, max_seq=SEQ)


def _graph(model, batch: int = BATCH):
    return autopar.trace(model, global_batch_size=batch, seq_len=SEQ)


def _by_fqn(graph):
    return {p.fqn: n.name for n in graph.nodes for p in n.params}


def test_the_kv_projections_are_found_from_the_dataflow():
    graph = _graph(_mqa_llama())
    found = {_by_fqn(graph)[f"blocks.0.attn.{w}.weight"] for w in ("k", "v")}
    k_bytes = BATCH * HEADS * SEQ * HEAD_DIM * 4  # read as repeated to the 8 query heads
    assert kv_projections(graph.nodes) == {name: (1, False, (k_bytes,), HEADS, False, 0)
                                           for name in found}
    with torch.device("meta"):
        gpt = corpus.nano_gpt()
    fused = kv_projections(_graph(gpt).nodes)
    assert [kv[:2] for kv in fused.values()] == [(4, True)]  # c_attn: q, k and v at once


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_megatron_layout_replicates_k_and_v_where_tp_exceeds_their_heads(tp):
    placements = megatron_tp_placements(_graph(_mqa_llama(kv_heads=2)), tp)
    kv = "R" if tp > 2 else "S(0)"
    assert {w: placements[f"blocks.0.attn.{w}.weight"] for w in "qkvo"} == \
        {"q": "S(0)", "k": kv, "v": kv, "o": "S(1)"}


def test_the_estimate_runs_them_whole_and_reduces_their_gradients():
    costs = ModelCosts.from_graph(_graph(_mqa_llama()))
    block = next(u for u in costs.units if u.is_block)
    cfg = ParallelConfig(tp=4, sequence_parallel=False)
    kv_params = 2 * DIM * HEAD_DIM  # wk and wv: [head_dim, dim] each, no bias
    assert [(kv.heads, kv.params, kv.read_heads) for kv in block.kv_projections] == \
        [(1, DIM * HEAD_DIM, HEADS)] * 2
    norms = 2 * DIM  # the block's two RMSNorm weights: tp never splits them
    assert block.tp_shared_params == norms
    assert block.tp_whole_params(4) == kv_params + norms
    assert block.tp_whole_params(1) == norms  # at tp=1 no K/V projection is left whole
    assert block.dense_on_tp_rank(4) == (block.dense_params - kv_params - norms) / 4 \
        + kv_params + norms
    # a K/V GEMM takes as long on a rank at tp=4 as alone; the query projection a quarter
    gemms = [op for op in block.ops if op.kind == "gemm"]
    kv_op, q_op = next(op for op in gemms if op.kv_heads), gemms[0]
    assert q_op.kv_heads == 0
    alone = ParallelConfig(tp=1)
    assert op_times(kv_op, NODE, "bf16", cfg, "flash")[0] == \
        op_times(kv_op, NODE, "bf16", alone, "flash")[0]
    quarter = replace(q_op, flops_fwd=q_op.flops_fwd / 4, flops_bwd=q_op.flops_bwd / 4,
                      bytes_fwd=q_op.bytes_fwd / 4)
    assert op_times(q_op, NODE, "bf16", cfg, "flash") == \
        op_times(quarter, NODE, "bf16", alone, "flash")
    # backward: Megatron's two reductions of the hidden state, and the gradients of the
    # attention's K and V inputs (the kv head repeated to the 8 query heads: each rank read
    # its query heads' copies) all-gathered
    fwd, bwd = tp_collectives(block, cfg)
    hidden = BATCH * SEQ * DIM * 4  # fp32 trace
    kv = BATCH * SEQ * HEADS * HEAD_DIM * 4
    assert sorted(fwd) == [("all_reduce", hidden)] * 2
    assert sorted(bwd) == [("all_gather", kv)] * 2 + [("all_reduce", hidden)] * 2
    assert tp_collectives(block, ParallelConfig(tp=1)) == ([], [])


def test_check_config_allows_divisors_and_multiples_of_the_kv_heads():
    common = dict(world_size=8, global_batch_size=8, num_layers=2, num_heads=8, num_kv_heads=2)
    assert check_config(ParallelConfig(dp=2, tp=4), **common) == 4
    # 4 neither divides 3 kv heads nor is a multiple of them: a rank's query heads would read
    # parts of two kv heads' groups
    with pytest.raises(InvalidConfigError, match=r"allowed tp: \[1, 3, 6, 12\]"):
        check_config(ParallelConfig(dp=6, tp=4),
                     **{**common, "num_heads": 12, "num_kv_heads": 3, "world_size": 24,
                        "global_batch_size": 24})


def _corpus_graph(name: str, batch: int = 8, seq: int = 64):
    with torch.device("meta"):
        model = getattr(corpus, name)()
    return model, autopar.trace(model, global_batch_size=batch, seq_len=seq)


@pytest.mark.parametrize("name, heads, cut", [
    ("hf_gpt_bigcode", 1, True),  # q then one k/v head, split at unequal widths
    ("hf_phi3", 2, True),  # q, k, v rows sliced at unequal widths
    ("hf_falcon", 2, False),  # grouped by kv head: a split of its groups keeps them whole
    ("hf_gpt_neox", 4, False),  # head by head
    ("nano_gpt", 4, False),  # three equal chunks, each split by head (`fused_chunks`)
])
def test_fused_projections_that_tp_cannot_split_by_head_are_found(name, heads, cut):
    _, graph = _corpus_graph(name)
    (kv,) = {kv for node, kv in kv_projections(graph.nodes).items() if ".0." in node}
    assert (kv.fused, kv.heads, kv.cut) == (True, heads, cut)
    assert kv.query_bytes == 8 * 64 * 64 * 4  # the queries: batch x seq x hidden, fp32


def test_a_fused_projection_run_whole_gathers_its_queries_and_reduces_no_input():
    model, graph = _corpus_graph("hf_gpt_bigcode")  # hidden 64, 4 heads of 16, 1 kv head
    placements = megatron_tp_placements(graph, 2)
    assert {w: placements[f"transformer.h.0.attn.{w}"] for w in
            ("c_attn.weight", "c_attn.bias", "c_proj.weight")} == \
        {"c_attn.weight": "R", "c_attn.bias": "R", "c_proj.weight": "S(1)"}
    block = next(u for u in ModelCosts.from_graph(graph).units if u.is_block)
    c_attn = 64 * 96 + 96  # weight [96, 64] (q 64, k 16, v 16) and bias
    shared = block.tp_shared_params  # norms, row biases: tests/unit/test_tp_param_bytes.py
    assert block.tp_whole_params(2) == c_attn + shared
    assert block.tp_whole_params(1) == shared
    hidden, kv = 8 * 64 * 64 * 4, 8 * 64 * 16 * 4
    for sp in (False, True):
        fwd, bwd = tp_collectives(block, ParallelConfig(tp=2, sequence_parallel=sp))
        reduce = ("reduce_scatter", hidden) if sp else ("all_reduce", hidden)
        # forward: the two sub-layers' reductions (and under SP their inputs' gathers);
        # backward: the MLP's input gradient only (the whole c_attn hands back its input's
        # whole gradient), the queries' gradient gathered from the ranks' heads, and the
        # one-head K and V read by every rank summed
        assert sorted(fwd) == sorted([reduce] * 2 + ([("all_gather", hidden)] * 2 if sp
                                                      else []))
        assert sorted(bwd) == sorted([reduce, ("all_gather", hidden)]
                                     + [("all_reduce", kv)] * 2
                                     + ([("all_gather", hidden)] * 2 if sp else []))


def test_compile_plans_it_and_engines_that_split_kv_by_head_refuse_it():
    model = _mqa_llama()
    plan = autopar.compile(model, NODE, global_batch_size=16, seq_len=SEQ,
                           constraints={"tp": 8, "pp": 1, "cp": 1})
    assert plan.config.tp == 8
    assert plan.tp_placements["blocks.0.attn.k.weight"] == "R"
    assert plan.tp_placements["blocks.0.attn.q.weight"] == "S(0)"
    with pytest.raises(ValueError, match="tp divides the key/value heads"):
        autopar.compile(model, NODE, global_batch_size=16, seq_len=SEQ,
                        constraints={"tp": 8}, target="megatron")
    with torch.device("meta"):
        bigcode = corpus.hf_gpt_bigcode()  # multi-query attention in a fused c_attn
    whole = autopar.estimate(bigcode, autopar.Cluster.from_profile("dgx-h100", num_nodes=1),
                             ParallelConfig(dp=4, tp=2), global_batch_size=8, seq_len=64)
    assert whole.fits


def test_the_report_and_the_exports_say_so():
    plan = autopar.compile(_mqa_llama(), NODE, global_batch_size=16, seq_len=SEQ,
                           constraints={"tp": 8, "pp": 1, "cp": 1})
    entry = plan.intra_op["blocks.0"]
    assert entry["replicated_kv"] == ["blocks.0.attn.k.weight", "blocks.0.attn.v.weight"]
    assert "K/V projections (blocks.0.attn.k.weight" in " ".join(plan.report().split())
    notes = export_plan(plan, "megatron").notes
    assert any("exceeds the key/value heads" in n for n in notes), notes
