"""Sub-layers from dataflow (``autopar.ir.residual``): the residual adds and the row-parallel
GEMMs of a block do not depend on how its norms are written, on module names, or on whether the
residual is sequential or parallel; the Megatron layout and the estimate's tensor-parallel
synchronisation points follow from them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import autopar
from autopar.estimate.units import units_from_graph
from autopar.ir.residual import residual_structure, sublayers
from autopar.plan import megatron_tp_placements

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corpus  # noqa: E402


class _HandNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


class _Block(nn.Module):
    def __init__(self, dim, norm, parallel):
        super().__init__()
        self.n1, self.n2, self.parallel = norm(dim), norm(dim), parallel
        self.a_in, self.a_out = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.m_in, self.m_out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        h = self.n1(x)
        attn = self.a_out(torch.tanh(self.a_in(h)))
        if self.parallel == "one-norm":  # GPT-J's: both branches read one norm's output
            return attn + self.m_out(torch.relu(self.m_in(h))) + x
        if self.parallel == "in-place":  # Falcon's ``mlp_output += attention_output``
            out = self.m_out(torch.relu(self.m_in(self.n2(x))))
            out += attn
            return x + out
        if self.parallel:
            return x + attn + self.m_out(torch.relu(self.m_in(self.n2(x))))
        x = x + attn
        return x + self.m_out(torch.relu(self.m_in(self.n2(x))))


class _Net(nn.Module):
    def __init__(self, norm, parallel=False, dim=16):
        super().__init__()
        self.emb = nn.Embedding(64, dim)
        self.blocks = nn.ModuleList(_Block(dim, norm, parallel) for _ in range(2))
        self.head = nn.Linear(dim, 64, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _block_nodes(graph):
    names = set(graph.blocks[0].node_names)
    return [n for n in graph.nodes if n.name in names]


def _trace(model):
    return autopar.trace(model, global_batch_size=2, seq_len=8, dtype="fp32")


@pytest.mark.parametrize("parallel", [False, True, "in-place"])
@pytest.mark.parametrize("norm", [_HandNorm, nn.RMSNorm, nn.LayerNorm])
def test_row_gemms_are_the_ones_that_feed_the_residual_adds(norm, parallel):
    """(An op that adds in place reads the value it overwrites: the MLP's output, which
    reaches the residual add through it.)"""
    graph = _trace(_Net(norm, parallel))
    found = residual_structure(_block_nodes(graph))
    assert len(found.residual_adds) == (1 if parallel == "in-place" else 2)
    rows = {n.split("/")[0] for n in found.row_gemms}
    assert rows == {"blocks.0.a_out", "blocks.0.m_out"}
    tp = megatron_tp_placements(graph)
    assert tp["blocks.0.a_in.weight"] == tp["blocks.0.m_in.weight"] == "S(0)"
    assert tp["blocks.0.a_out.weight"] == tp["blocks.0.m_out.weight"] == "S(1)"
    assert tp["blocks.0.a_out.bias"] == "R" and tp["blocks.0.a_in.bias"] == "S(0)"
    assert tp["emb.weight"] == tp["head.weight"] == "S(0)"


@pytest.mark.parametrize("norm", [_HandNorm, nn.LayerNorm])
def test_sublayers_end_at_the_residual_adds(norm):
    """A sequential block cuts into its two sub-layers, each from its norm to its add, with
    the GEMMs of its own modules; neither holds attention, so both could run replicated."""
    graph = _trace(_Net(norm, parallel=False))
    nodes = _block_nodes(graph)
    found = residual_structure(nodes)
    runs = sublayers(nodes, found)
    assert [run[-1].name for run in runs] == list(found.residual_adds)
    assert sum(map(len, runs)) == len(nodes)
    gemms = [{n.name.split("/")[0] for n in run if n.params and n.kind.name == "MATMUL"}
             for run in runs]
    assert gemms == [{"blocks.0.a_in", "blocks.0.a_out"}, {"blocks.0.m_in", "blocks.0.m_out"}]
    (unit,) = [u for u in units_from_graph(graph) if u.is_block]
    assert [sub.replicable for sub in unit.sublayers] == [True, True]
    assert [sub.reductions for sub in unit.sublayers] == [1, 1]


def test_a_hand_written_norm_costs_the_same_tensor_parallel_traffic_as_the_library_norm():
    """The estimate's synchronisation points and the hidden-state bytes they move per block
    are the same whatever the norm is written as."""
    def block_unit(norm):
        units = units_from_graph(_trace(_Net(norm)))
        return next(u for u in units if u.name == "blocks.0")

    hand, library = block_unit(_HandNorm), block_unit(nn.RMSNorm)
    assert hand.tp_reductions == library.tp_reductions == (2, 2)
    assert hand.stream_params == library.stream_params == (16, 16)  # the two norms' weights
    assert hand.act_bytes == library.act_bytes


class _LatentBlock(nn.Module):
    """Multi-head latent attention as DeepSeek-V2/V3 write it, by hand: the queries and the
    keys/values from low-rank down-projections, each followed by its own norm, then
    projected up to the heads."""

    def __init__(self, dim=32, heads=4, rank=8):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = _HandNorm(dim), _HandNorm(dim)
        self.q_down, self.q_norm, self.q_up = nn.Linear(dim, rank), _HandNorm(rank), \
            nn.Linear(rank, dim)
        self.kv_down, self.kv_norm, self.kv_up = nn.Linear(dim, rank), _HandNorm(rank), \
            nn.Linear(rank, 2 * dim)
        self.o = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        h = self.n1(x)
        q = self.q_up(self.q_norm(self.q_down(h))).view(b, s, self.heads, -1).transpose(1, 2)
        k, v = self.kv_up(self.kv_norm(self.kv_down(h))).view(
            b, s, self.heads, -1).transpose(1, 2).chunk(2, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, d))
        return x + self.down(torch.relu(self.up(self.n2(x))))


def test_a_low_rank_projection_the_next_gemm_reads_runs_whole():
    """The down-projections of latent attention feed, through a norm, the up-projections
    to the heads: Megatron's layout (as Megatron-Core's MLA) runs them whole on every tp rank
    with their norms, splits the up-projections by head; the estimate runs them whole, and
    their gradients and their norms' are partial sums reduced once a step (no per-row
    statistics over split features)."""
    from autopar.ir.residual import bottleneck_gemms

    net = _Net(nn.LayerNorm, dim=32)
    net.blocks = nn.ModuleList(_LatentBlock() for _ in range(2))
    graph = _trace(net)
    nodes = _block_nodes(graph)
    found = bottleneck_gemms(nodes, residual_structure(nodes))
    assert {n.split("/")[0] for n in found} == {"blocks.0.q_down", "blocks.0.kv_down"}
    tp = megatron_tp_placements(graph, 2)
    assert [tp[f"blocks.0.{m}.weight"] for m in ("q_down", "kv_down", "q_up", "kv_up", "o")] \
        == ["R", "R", "S(0)", "S(0)", "S(1)"]
    (unit,) = [u for u in units_from_graph(graph) if u.name == "blocks.0"]
    assert sum(op.tp_whole for op in unit.ops) == 2
    assert not [s for s in unit.tp_syncs if s[1] in ("stat", "weight")]
    whole = sum(p.numel() for m in (net.blocks[0].q_down, net.blocks[0].kv_down,
                                    net.blocks[0].q_norm, net.blocks[0].kv_norm)
                for p in m.parameters())
    assert sum(unit.router_params) == whole
    for name in ("hf_llama", "hf_gpt2", "litgpt_style"):  # MLPs feed a row GEMM: none
        with torch.device("meta"):
            other = _trace(getattr(corpus, name)())
        nodes = _block_nodes(other)
        assert not bottleneck_gemms(nodes, residual_structure(nodes)), name


@pytest.mark.parametrize("parallel, forward, forward_sp, backward", [
    (False, 2, 2, 2),  # the first sum is read by the second norm too: reduced there
    (True, 1, 2, 2),  # (x + attn) + mlp: under sequence parallel x is a sequence shard
    ("in-place", 1, 1, 2),  # (mlp += attn) + x: two norms, two input gradients
    ("one-norm", 1, 1, 1),  # (attn + mlp) + x, both branches after one norm
])
def test_parallel_branches_share_their_reductions(parallel, forward, forward_sp, backward):
    """A parallel attention and MLP sum their partial outputs before one reduction forward
    (under sequence parallel, where the sum meets the stream's shard), and reduce their
    input gradients once where they read one tensor; a sequential block reduces each
    sub-layer's alone. What the estimate charges (`tp_collectives`) and the plan tells the
    runtime (`summed_row_weights`) follow."""
    from autopar.config import ParallelConfig
    from autopar.estimate.timing import tp_collectives
    from autopar.ir.reductions import reduction_points
    from autopar.plan import summed_row_weights

    graph = _trace(_Net(nn.LayerNorm, parallel))
    nodes = _block_nodes(graph)
    assert reduction_points(nodes, residual_structure(nodes)) == (forward, forward_sp,
                                                                  backward)
    (unit,) = [u for u in units_from_graph(graph) if u.name == "blocks.0"]
    act = float(unit.act_bytes)
    for sp, reduced in ((False, forward), (True, forward_sp)):
        fwd, bwd = tp_collectives(unit, ParallelConfig(tp=2, sequence_parallel=sp))
        if sp:
            assert sorted(fwd) == [("all_gather", act)] * backward \
                + [("reduce_scatter", act)] * reduced
            assert sorted(bwd) == [("all_gather", act)] * reduced \
                + [("reduce_scatter", act)] * backward
        else:
            assert (fwd, bwd) == ([("all_reduce", act)] * reduced,
                                  [("all_reduce", act)] * backward)
        summed = {f.rsplit(".", 1)[0] for f in summed_row_weights(graph, sp)}
        assert summed == (set() if reduced == 2 else {
            f"blocks.{i}.{m}" for i in range(2) for m in ("a_out", "m_out")})


@pytest.mark.parametrize("factory,rows", [
    ("plain_llama", {"attn.o", "mlp.down"}),
    ("hf_llama", {"self_attn.o_proj", "mlp.down_proj"}),
    ("litgpt_style", {"attn.proj", "mlp.proj"}),
    ("nano_gpt", {"attn.c_proj", "mlp.c_proj"}),
    ("hf_gpt2", {"attn.c_proj", "mlp.c_proj"}),
    ("hf_falcon", {"self_attention.dense", "mlp.dense_4h_to_h"}),  # adds one into the other
    ("moe_loop", {"self_attn.out", *(f"moe.experts.{e}.w_down" for e in range(4))}),
])
def test_models_written_elsewhere_come_out_megatron_shaped(factory, rows):
    """Hand-written RMSNorm (plain_llama, Hugging Face Llama), a parallel residual (lit-gpt),
    fused q/k/v (nanoGPT), GPT-2's Conv1D (weights laid out [in, out], read as they are), a
    loop over a list of experts: the GEMMs feeding the residual adds -- in an expert, its
    last GEMM -- are row-parallel (sharded on their input features), the others
    column-parallel (on their output features), the router replicated."""
    with torch.device("meta"):
        model = getattr(corpus, factory)()
    graph = _trace(model)
    block = graph.blocks[0].representative
    tp = megatron_tp_placements(graph)
    conv1d = factory == "hf_gpt2"  # output features on dim 1
    for name, p in model.named_parameters():
        if not name.startswith(block + ".") or p.dim() != 2:
            continue
        local = name[len(block) + 1:].rsplit(".", 1)[0]
        if local == "moe.gate":
            assert tp[name] == "R"
            continue
        want = "S(1)" if (local in rows) != conv1d else "S(0)"
        assert tp[name] == want, (name, tp[name])


class _EncoderWithHeads(_Net):
    """An encoder whose glue holds GEMMs beside the vocabulary projection: a projection of
    the embedding into the stream before the blocks, and BERT's MLM transform (dense,
    activation, norm) before the head."""

    def __init__(self, dim=16):
        super().__init__(nn.LayerNorm, dim=dim)
        self.proj_in = nn.Linear(dim, dim)
        self.transform, self.norm = nn.Linear(dim, dim), nn.LayerNorm(dim)

    def forward(self, tokens):
        x = self.proj_in(self.emb(tokens))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(F.gelu(self.transform(x))))


def test_gemms_outside_the_blocks_run_whole_but_the_vocabulary_projection():
    """A GEMM of the glue that no cross-entropy reads (a transform before the head, an input
    projection) runs whole on every tp rank, as Megatron-LM's BERT head and pooler: the plan
    replicates it, the estimate charges it no collective (the head's input gradient alone is
    reduced backward, the loss's per-row values forward) and runs it on the stream's rows --
    all of them without sequence parallel, a shard with it -- and its gradient joins the
    partial sums reduced once a step."""
    from autopar.config import ParallelConfig
    from autopar.estimate.timing import op_times

    graph = _trace(_EncoderWithHeads())
    tp = megatron_tp_placements(graph, 2)
    assert [tp[f"{m}.weight"] for m in ("proj_in", "transform", "head")] == ["R", "R", "S(0)"]
    assert tp["transform.bias"] == "R"
    units = {u.name: u for u in units_from_graph(graph)}
    post, pre = units["post"], units["pre"]
    assert [(d, k) for d, k, _ in post.tp_syncs] == [("backward", "reduce")] + \
        [("forward", "loss")] * 3
    assert [(d, k) for d, k, _ in pre.tp_syncs] == [("forward", "reduce")]  # the lookup
    (transform,) = [op for op in post.ops if op.kind == "gemm" and not op.vocab]
    assert transform.tp_replicated
    cluster = autopar.Cluster.from_profile("dgx-h100")
    assert (transform.tp_rows(2, False), transform.tp_rows(2, True)) == (1, 2)
    times = [op_times(transform, cluster, "bf16", ParallelConfig(tp=tp, sequence_parallel=sp),
                      "flash")[0] for tp, sp in ((1, False), (2, False), (2, True))]
    assert times[0] == times[1] > times[2]
    whole = sum(p.numel() for m in ("transform", "norm") for p in
                getattr(_EncoderWithHeads(), m).parameters())
    assert sum(post.stream_params) == whole


def test_sequence_parallel_gathers_a_head_where_its_vocabulary_projection_runs():
    """BERT's MLM head module holds the bias its decoder (the tied vocabulary projection)
    adds: under sequence parallel the runtime gathers the sequence at the decoder, not at the
    head, so the transform and its norm before it run on the shard, as the estimate costs
    them (`autopar.runtime.tensor_parallel._sublayer_entries`)."""
    from autopar.runtime.tensor_parallel import _sublayer_entries

    model = corpus.hf_bert()
    holders = {"bert.embeddings.word_embeddings", "cls.predictions", "cls.predictions.decoder"}
    assert model.cls.predictions.bias is model.cls.predictions.decoder.bias
    glue = {e for e in _sublayer_entries(model, holders) if ".layer." not in e}
    assert glue == {"bert.embeddings.word_embeddings", "cls.predictions.decoder"}


class _BareMLP(nn.Module):
    """Weights held directly, no sub-modules: the trace finds no block."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Parameter(torch.randn(64, 16))
        self.w1, self.w2 = nn.Parameter(torch.randn(48, 16)), nn.Parameter(torch.randn(64, 48))

    def forward(self, tokens):
        return F.linear(torch.relu(F.linear(F.embedding(tokens, self.emb), self.w1)), self.w2)


def test_matmuls_are_glue_only_around_blocks():
    """Glue is what lies around blocks: a model of one-layer blocks without residual adds (an
    MLP as an ``nn.Sequential``) and one the trace finds no block in keep their matmuls
    column-parallel, each output gathered but the logits a cross-entropy reads, in the plan and
    in the estimate alike."""
    mlp = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 32),
                        nn.ReLU(), nn.Linear(32, 64))
    for model, weights in ((mlp, ("1.weight", "3.weight", "5.weight")), (_BareMLP(), ("w1",))):
        graph = _trace(model)
        tp = megatron_tp_placements(graph, 2)
        assert [tp[w] for w in weights] == ["S(0)"] * len(weights), (weights, tp)
        units = units_from_graph(graph)
        assert not any(op.tp_replicated for u in units for op in u.ops)
        assert sum(k == "gather" for u in units for _, k, _ in u.tp_syncs) == len(weights)
    assert not _trace(_BareMLP()).blocks
