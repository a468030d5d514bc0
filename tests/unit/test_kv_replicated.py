"""Tensor parallel over more ranks than an attention has key/value heads (multi-query and
grouped-query attention): the K and V projections found from the dataflow are replicated, each
rank computes them whole and reads the kv heads its query heads use, and their outputs'
gradients are all-reduced backward. Checked against hand counts on a hand-written Llama with one
kv head; a fused q/k/v projection cannot be replicated apart from Q and is refused, saying so."""

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
    assert kv_projections(graph.nodes) == {name: (1, False, k_bytes, HEADS) for name in found}
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
    assert block.tp_whole_params(4) == kv_params and block.tp_whole_params(1) == 0
    assert block.dense_on_tp_rank(4) == (block.dense_params - kv_params) / 4 + kv_params
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


def test_check_config_allows_multiples_of_separate_kv_heads_only():
    common = dict(world_size=8, global_batch_size=8, num_layers=2, num_heads=8, num_kv_heads=2)
    assert check_config(ParallelConfig(dp=2, tp=4), kv_fused=False, **common) == 4
    with pytest.raises(InvalidConfigError, match="one GEMM with Q"):
        check_config(ParallelConfig(dp=2, tp=4), kv_fused=True, **common)
    # 4 neither divides 3 kv heads nor is a multiple of them: a rank's query heads would read
    # parts of two kv heads' groups
    with pytest.raises(InvalidConfigError, match=r"allowed tp: \[1, 3, 6, 12\]"):
        check_config(ParallelConfig(dp=6, tp=4), kv_fused=False,
                     **{**common, "num_heads": 12, "num_kv_heads": 3, "world_size": 24,
                        "global_batch_size": 24})


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
    with pytest.raises(InvalidConfigError, match="one GEMM with Q"):
        autopar.estimate(bigcode, autopar.Cluster.from_profile("dgx-h100", num_nodes=1),
                         ParallelConfig(dp=4, tp=2), global_batch_size=8, seq_len=64)


def test_the_report_and_the_exports_say_so():
    plan = autopar.compile(_mqa_llama(), NODE, global_batch_size=16, seq_len=SEQ,
                           constraints={"tp": 8, "pp": 1, "cp": 1})
    entry = plan.intra_op["blocks.0"]
    assert entry["replicated_kv"] == ["blocks.0.attn.k.weight", "blocks.0.attn.v.weight"]
    assert "K/V projections (blocks.0.attn.k.weight" in " ".join(plan.report().split())
    notes = export_plan(plan, "megatron").notes
    assert any("exceeds the key/value heads" in n for n in notes), notes
