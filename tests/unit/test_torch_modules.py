"""PyTorch's own transformer modules (``nn.MultiheadAttention``, ``nn.TransformerEncoder``) in
the trace, the layout and the runtime's helpers.

Oracles: the module's own structure (4 heads of 16 over a packed ``[3·64, 64]`` projection),
a torch-function mode that records what it sees, a brute-force check of shape refinements,
and the encoder's own forward run with a stand-in for one layer.
"""

import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import autopar
from autopar.ir import OpKind
from autopar.ir.residual import fused_chunks, output_biases
from autopar.plan.placements import megatron_tp_placements
from autopar.runtime.local_attention import _view_shape
from autopar.runtime.stand_ins import PassBlock
from autopar.sharding.strided import refinement
from autopar.trace.nested import NESTED, run_nested


class EncoderLM(nn.Module):
    def __init__(self, dim=64, heads=4, layers=2):
        super().__init__()
        self.tok = nn.Embedding(256, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 256, bias=False)

    def forward(self, idx):
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        return self.head(self.encoder(self.tok(idx), mask=mask, is_causal=True))


@pytest.fixture(scope="module")
def graph():
    with torch.device("meta"):
        model = EncoderLM()
    return autopar.trace(model, global_batch_size=2, seq_len=32)


def test_multihead_attention_is_one_attention_over_its_heads(graph):
    """``F.multi_head_attention_forward`` calls SDPA inside: the trace sees that call (one
    causal ATTENTION node over 4 heads of 16 in the block both layers repeat), not the meta
    device's decomposition."""
    attention = [n for n in graph.nodes if n.kind is OpKind.ATTENTION]
    assert len(attention) == 1 and [b.layer_indices for b in graph.blocks] == [(0, 1)]
    spec = attention[0].attention
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.causal) == (4, 4, 16, True)
    assert not any(n.kind is OpKind.SOFTMAX for n in graph.nodes)


def test_the_packed_projection_splits_by_chunk_weight_and_bias_alike(graph):
    """The packed q/k/v projection (``linear`` on a sequence-first input, its bias added
    apart, the output viewed as ``(3, embed_dim)``) is three chunks of the heads: tp splits
    its weight and its bias by chunk, column-parallel; the output projection and the MLP are
    Megatron's."""
    chunks = fused_chunks(graph.nodes)
    attn = "encoder.layers.0.self_attn."
    assert chunks[attn + "in_proj_weight"] == chunks[attn + "in_proj_bias"] == 3
    assert [p.fqn for ps in output_biases(graph.nodes).values() for p in ps] == \
        [attn + "in_proj_bias"]
    placed = megatron_tp_placements(graph, 2)
    assert [placed[attn + n] for n in ("in_proj_weight", "in_proj_bias", "out_proj.weight",
                                       "out_proj.bias")] == ["S(0)", "S(0)", "S(1)", "R"]
    layer = "encoder.layers.0."
    assert [placed[layer + n] for n in ("linear1.weight", "linear2.weight")] == ["S(0)", "S(1)"]


def test_a_mode_sees_the_calls_inside_a_nested_function():
    """A torch-function mode is off while it handles a call; `run_nested` runs
    ``F.multi_head_attention_forward`` with the mode on inside it, so the mode sees its SDPA,
    the numbers are the function's own, and the function's module is left as it was."""
    seen = []

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            if func in NESTED:
                return run_nested(self, func, args, kwargs or {})
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    expected, _ = mha(x, x, x, need_weights=False)
    check = F.has_torch_function
    with Recording():
        got, _ = mha(x, x, x, need_weights=False)
    assert F.scaled_dot_product_attention in seen
    assert F.has_torch_function is check
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_shape_refinement_against_brute_force():
    """`refinement(a, b)`: the coarsest shape both are merges of. On shapes made by grouping
    one factor list two ways it is a shape both group into, and no coarser one is (each of its
    cuts is a cut of a or of b); shapes with no common refinement give None."""
    rng = random.Random(0)

    def groups(factors):
        cuts = sorted(rng.sample(range(1, len(factors)), rng.randint(0, len(factors) - 1)))
        bounds = [0, *cuts, len(factors)]
        return tuple(math.prod(factors[i:j]) for i, j in zip(bounds, bounds[1:]))

    def prefix_products(shape):
        return set(itertools.accumulate(shape, lambda x, y: x * y))

    for _ in range(300):
        factors = [rng.choice([2, 3, 4, 5, 8]) for _ in range(rng.randint(1, 6))]
        a, b = groups(factors), groups(factors)
        finest = refinement(a, b)
        assert math.prod(finest) == math.prod(a)
        assert prefix_products(a) | prefix_products(b) == prefix_products(finest)
    assert refinement((6, 4), (4, 6)) is None
    assert refinement((64, 2, 64), (64, 8, 16)) == (64, 2, 4, 16)


def test_view_shapes_of_view_reshape_and_unflatten():
    t = torch.empty(4, 6, 8, device="meta")
    assert _view_shape(torch.Tensor.view, t, (4, -1, 2), {}) == (4, 24, 2)
    assert _view_shape(torch.Tensor.reshape, t, ((24, 8),), {}) == (24, 8)
    assert _view_shape(torch.Tensor.unflatten, t, (-1, (2, 4)), {}) == (4, 6, 2, 4)
    assert _view_shape(torch.Tensor.unflatten, t, (), {"dim": 1, "sizes": (3, -1)}) == \
        (4, 3, 2, 8)


def test_a_stand_in_keeps_what_the_encoder_reads_off_its_first_layer():
    """A pipeline stage stands in for a layer it does not own: the stand-in holds no
    parameters or sub-modules a module walk would find, yet answers what
    ``nn.TransformerEncoder.forward`` reads off its first layer (``self_attn.batch_first``,
    the weights' shapes), and the encoder runs with it, its output the other layer's."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    original = encoder.layers[0]
    encoder.layers[0] = stand_in = PassBlock(None, original)
    assert not list(stand_in.parameters()) and list(stand_in.named_modules()) == \
        [("", stand_in)]
    assert stand_in.self_attn.batch_first is True
    assert stand_in.self_attn.in_proj_weight.shape == original.self_attn.in_proj_weight.shape
    assert stand_in.norm1.eps == original.norm1.eps
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(encoder(x), encoder.layers[1](x))


def _held(shape, dim, stride, n, rank):
    """The flat indices rank ``rank`` of ``n`` holds of a row-major tensor of ``shape``
    sharded ``S(dim)/stride``: dim seen as (stride, size / stride), the second in blocks."""
    size = shape[dim]
    idx = torch.arange(math.prod(shape)).view(*shape[:dim], stride, size // stride,
                                              *shape[dim + 1:])
    block = size // stride // n
    return set(idx.narrow(dim + 1, rank * block, block).flatten().tolist())


def test_a_reshaped_strided_shard_holds_the_same_elements_on_every_rank():
    """`reshaped_shard` against brute force: for views that split and merge dims (as
    ``nn.MultiheadAttention`` and BLOOM view their heads), a block or strided shard of an
    input dim, where it names an output dim and stride, is the very same set of elements on
    each rank as that output placement."""
    from autopar.sharding.strided import reshaped_shard

    rng = random.Random(1)
    n, checked = 2, 0
    for _ in range(400):
        factors = [rng.choice([1, 2, 3, 4]) for _ in range(rng.randint(2, 5))]
        cuts_a = sorted(rng.sample(range(1, len(factors)), rng.randint(0, len(factors) - 1)))
        cuts_b = sorted(rng.sample(range(1, len(factors)), rng.randint(0, len(factors) - 1)))
        a = tuple(math.prod(factors[i:j]) for i, j in zip([0, *cuts_a], [*cuts_a, None]))
        b = tuple(math.prod(factors[i:j]) for i, j in zip([0, *cuts_b], [*cuts_b, None]))
        for dim, stride in itertools.product(range(len(a)), (1, 2, 3, 4)):
            if a[dim] % stride or (a[dim] // stride) % n:
                continue
            where = reshaped_shard(a, b, dim, stride, n)
            if where is None:
                continue
            e, g = where
            assert b[e] % g == 0 and (b[e] // g) % n == 0
            for rank in range(n):
                assert _held(a, dim, stride, n, rank) == _held(b, e, g, n, rank), \
                    (a, b, dim, stride)
            checked += 1
    assert checked > 100
    assert reshaped_shard((64, 2, 64), (64, 8, 16), 2, 1, 2) == (1, 2)  # heads inside b*heads
    assert reshaped_shard((8, 64, 16), (2, 4, 64, 16), 0, 2, 2) == (1, 1)  # back out: heads


def test_the_ilp_runs_megatrons_layout_through_heads_inside_a_flattened_dim(graph):
    """Pinned to Megatron's layout, the intra-op ILP executes the encoder layer with
    Megatron's collectives alone (one all-reduce per sub-layer each way): the q/k/v heads stay
    split through ``[s, b · heads, d]`` as strided shards, where without them it would gather
    the packed projection."""
    from autopar.search.intra_op import solve_block
    from autopar.sharding.problem import BlockSetting

    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
    block = graph.blocks[0]
    solved = solve_block(graph, block.node_names,
                         BlockSetting(tp=2, cluster=cluster, dtype="bf16", boundary="replicated"),
                         pinned_params=megatron_tp_placements(graph, 2))
    assert [k for k, _ in solved.forward_collectives] == ["all_reduce"] * 2
    assert [k for k, _ in solved.backward_collectives] == ["all_reduce"] * 2
    assert any(s.endswith("strided") for s in solved.node_strategies.values())


class FlatHeadsAttention(nn.Module):
    """Attention written over batch and heads flattened, as Megatron-LM's unfused attention
    and XGLM's eager one: ``[b * heads, s, d]`` products, the softmax on them."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = (lin(x).view(b, s, self.heads, -1).transpose(1, 2).reshape(
            b * self.heads, s, -1) for lin in (self.q, self.k, self.v))
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(dim // self.heads)
        out = torch.bmm(torch.softmax(scores, dim=-1), v)
        return x + self.o(out.view(b, self.heads, s, -1).transpose(1, 2).reshape(b, s, dim))


class FlatHeadsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.layers = nn.ModuleList(FlatHeadsAttention() for _ in range(2))
        self.head = nn.Linear(64, 256)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_the_ilp_keeps_heads_split_through_products_and_softmax_over_flattened_heads():
    """Products and the softmax over ``[b * heads, s, s]`` carry the strided shard of their
    rows: Megatron's layout runs with one all-reduce each way, as the estimate charges."""
    from autopar.search.intra_op import solve_block
    from autopar.sharding.problem import BlockSetting

    with torch.device("meta"):
        model = FlatHeadsModel()
    graph = autopar.trace(model, global_batch_size=2, seq_len=32)
    block = graph.blocks[0]
    solved = solve_block(graph, block.node_names,
                         BlockSetting(tp=2, cluster=autopar.Cluster.from_profile(
                             "dgx-h100", num_nodes=1), dtype="bf16", boundary="replicated"),
                         pinned_params=megatron_tp_placements(graph, 2))
    assert [k for k, _ in solved.forward_collectives] == ["all_reduce"]
    assert [k for k, _ in solved.backward_collectives] == ["all_reduce"]
    by_name = {n.name: n for n in graph.nodes}
    assert {by_name[v].kind for v, s in solved.node_strategies.items()
            if s.endswith("strided")} >= {OpKind.MATMUL, OpKind.SOFTMAX, OpKind.VIEW}


class _ConvMixer(nn.Module):
    """A Mamba-style mixer: a projection, a causal depthwise convolution over the sequence,
    an output projection."""

    def __init__(self, dim=32):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.in_proj = nn.Linear(dim, 2 * dim)
        self.conv = nn.Conv1d(2 * dim, 2 * dim, kernel_size=3, groups=2 * dim, padding=2)
        self.out_proj = nn.Linear(2 * dim, dim)

    def forward(self, x):
        h = self.in_proj(self.norm(x)).transpose(1, 2)
        h = self.conv(h)[..., :x.shape[1]].transpose(1, 2)
        return x + self.out_proj(F.silu(h))


class _ConvMixerLM(nn.Module):
    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_ConvMixer(dim) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_depthwise_convolution_stays_whole_under_tensor_parallel():
    """Each group of a grouped convolution reads its own input channels, which neither the
    sharding rules nor the runtime split: Megatron's layout keeps its weight and bias whole
    (the projections around it split as usual), so the plan holds a layout the runtime runs."""
    with torch.device("meta"):
        model = _ConvMixerLM()
    graph = autopar.trace(model, global_batch_size=2, seq_len=16, dtype="fp32")
    placed = megatron_tp_placements(graph, 2)
    assert placed["layers.0.conv.weight"] == placed["layers.0.conv.bias"] == "R"
    assert placed["layers.0.in_proj.weight"] == "S(0)"
    assert placed["layers.0.out_proj.weight"] == "S(1)"
    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=2)
    plan = autopar.compile(model, cluster, global_batch_size=4, seq_len=16, dtype="fp32",
                           constraints={"tp": 2, "sequence_parallel": True})
    assert plan.tp_placements["layers.1.conv.weight"] == "R"
