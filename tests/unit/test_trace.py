"""Tracer checks against independent oracles: closed-form FLOPs (Megatron, and the SwiGLU/GQA
variant derived here), FlopCounterMode on real tiny models, Korthikanti et al. 2022 activation
memory, parameter counts, real-vs-meta identity, repeated blocks, MoE, errors."""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from autopar import models
from autopar.errors import TraceError
from autopar.ir import OpKind
from autopar.models import AttentionImpl
from autopar.trace import blocks, trace

aten = torch.ops.aten
TINY_GPT = dict(n_layers=2, dim=64, n_heads=4, vocab_size=128, max_seq_len=64)
TINY_LLAMA = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128,
                  max_seq_len=64)
TINY_MIXTRAL = dict(TINY_LLAMA, num_experts=4, top_k=2)


def layer_nodes(graph, index=0):
    return [n for n in graph.nodes if n.layer_index == index]


# FlopCounterMode has no formulas for the CPU flash-attention kernels (torch/utils/flop_counter.py
# registers the CUDA flash, efficient and cuDNN ones), so on CPU it counts attention as 0;
# these are its own sdpa formulas, registered per counter (they receive shapes).
CPU_SDPA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *a, **kw: sdpa_flop_count(q, k, v),
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *a, **kw: sdpa_backward_flop_count(g, q, k, v),
}


def measured_train_flops(model, tokens):
    """fwd+bwd FLOPs of a real CPU step under FlopCounterMode."""
    with FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS) as counter:
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return counter.get_total_flops()


# ---------------------------------------------------------------- FLOPs: closed forms
@pytest.mark.parametrize("b,s", [(2, 128), (1, 512)])
def test_gpt_layer_forward_flops_match_megatron(b, s):
    # Megatron (Narayanan et al. 2021): 24·b·s·h² + 4·b·s²·h per layer forward, attention
    # counted over the full s×s score matrix (non-causal). The IR uses the same convention
    # and marks the attention node causal=True separately.
    h = 256
    model = models.build("gpt2", n_layers=3, dim=h, n_heads=8, max_seq_len=1024)
    graph = trace(model, global_batch_size=b, seq_len=s)
    got = sum(n.flops_fwd for n in layer_nodes(graph))
    expected = 24 * b * s * h**2 + 4 * b * s**2 * h
    assert got == pytest.approx(expected, rel=0.01)
    attn = [n for n in layer_nodes(graph) if n.kind is OpKind.ATTENTION]
    assert len(attn) == 1 and attn[0].attention.causal


def test_llama_layer_forward_flops_match_swiglu_gqa_closed_form():
    # Per layer, with h = dim, h_kv = n_kv_heads·head_dim, f = ffn_dim, T = b·s tokens:
    #   wq, wo: 2·T·h·h each; wk, wv: 2·T·h·h_kv each; w1, w3, w2: 2·T·h·f each;
    #   attention: QKᵀ and PV over all query heads, 2·T·s·h each (non-causal count).
    b, s, h, heads, kv_heads, f = 2, 64, 128, 8, 2, 320
    model = models.build("llama3-8b", n_layers=2, dim=h, n_heads=heads, n_kv_heads=kv_heads,
                         ffn_dim=f, vocab_size=256, max_seq_len=128)
    graph = trace(model, global_batch_size=b, seq_len=s)
    t, h_kv = b * s, kv_heads * (h // heads)
    expected = 4 * t * h * h + 4 * t * h * h_kv + 6 * t * h * f + 4 * t * s * h
    assert sum(n.flops_fwd for n in layer_nodes(graph)) == pytest.approx(expected, rel=0.01)
    attn = next(n for n in graph.nodes if n.kind is OpKind.ATTENTION)
    assert (attn.attention.num_heads, attn.attention.num_kv_heads) == (heads, kv_heads)


@pytest.mark.parametrize("name,overrides", [("gpt2", TINY_GPT), ("llama3-8b", TINY_LLAMA),
                                            ("mixtral-8x7b", TINY_MIXTRAL),
                                            ("gpt2", dict(TINY_GPT, attention=AttentionImpl.MATH))])
def test_whole_model_train_flops_match_flop_counter_on_real_model(name, overrides):
    # Mixtral: the real step routes tokens randomly, but every token still meets exactly k
    # experts, so the expected-routing count (capacity factor 1) equals the real one.
    torch.manual_seed(0)
    model = models.build(name, device="cpu", **overrides)
    tokens = torch.randint(0, 128, (2, 16))
    graph = trace(model, global_batch_size=2, seq_len=16)
    assert graph.flops_fwd + graph.flops_bwd == measured_train_flops(model, tokens)


@pytest.mark.parametrize("name,overrides", [
    ("vit-b-16", dict(n_layers=2, dim=32, n_heads=4, mlp_dim=64, image_size=32, patch_size=8,
                      num_classes=10)),
    ("resnet50", dict(blocks=(2, 1, 1, 1), num_classes=10)),
])
def test_vision_train_flops_match_flop_counter(name, overrides):
    # images need no gradient, so the first conv's backward is the weight gradient only (1x)
    torch.manual_seed(0)
    model = models.build(name, device="cpu", **overrides)
    images, labels = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    with FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS) as counter:
        F.cross_entropy(model(images), labels).backward()
    graph = trace(model, example_inputs=images)
    assert graph.flops_fwd + graph.flops_bwd == counter.get_total_flops()
    assert graph.batch_size == 2 and graph.seq_len is None


# ---------------------------------------------------------------- activation memory
def _gpt_saved_per_layer(*, dropout, attention, recompute=False, b=2, s=128, h=256, a=8):
    model = models.build("gpt2", n_layers=2, dim=h, n_heads=a, dropout=dropout,
                         attention=attention, dtype=torch.bfloat16)
    graph = trace(model, global_batch_size=b, seq_len=s)
    field = "saved_bytes_recompute" if recompute else "saved_bytes"
    return sum(getattr(n, field) for n in layer_nodes(graph)), (b, s, h, a)


# Korthikanti et al. 2022, eq. 1, 16-bit activations: 34·s·b·h + 5·a·s²·b bytes per layer.
# Small terms the paper leaves out and the IR keeps: two fp32 statistics (mean, rstd) per
# token for each of the 2 LayerNorms (16·s·b bytes), and with a fused (flash) kernel the
# fp32 log-sum-exp per query row (4·a·s·b bytes).
def _ln_stats(s, b):
    return 2 * 2 * 4 * s * b


def test_gpt_activations_match_korthikanti_with_dropout_and_explicit_attention():
    saved, (b, s, h, a) = _gpt_saved_per_layer(dropout=0.1, attention=AttentionImpl.MATH)
    assert saved == 34 * s * b * h + 5 * a * s * s * b + _ln_stats(s, b)


def test_a_batched_product_is_one_node_with_its_batch_dims_apart():
    """Attention written with ``q @ k.transpose(-2, -1)`` and ``p @ v`` on [b, heads, s, d]:
    one MATMUL node each, over the operands as the model holds them (ATen would run a bmm
    over the batch and heads flattened), the scores marked as such."""
    model = models.build("gpt2", **dict(TINY_GPT, attention=AttentionImpl.MATH))
    graph = trace(model, global_batch_size=2, seq_len=16)
    products = [n for n in layer_nodes(graph) if n.target == "torch.matmul"]
    assert [(n.inputs[0].shape, n.inputs[1].shape, n.outputs[0].shape) for n in products] == [
        ((2, 4, 16, 16), (2, 4, 16, 16), (2, 4, 16, 16)),
        ((2, 4, 16, 16), (2, 4, 16, 16), (2, 4, 16, 16))]
    assert not any("bmm" in n.target for n in graph.nodes)
    assert [n.flops_fwd for n in products] == [2 * 2 * 4 * 16 * 16 * 16] * 2


def test_selective_recompute_leaves_34sbh():
    saved, (b, s, h, a) = _gpt_saved_per_layer(dropout=0.1, attention=AttentionImpl.MATH,
                                               recompute=True)
    assert saved == 34 * s * b * h + _ln_stats(s, b)


def test_fused_attention_keeps_no_score_tensors():
    # flash-style SDPA: dropout happens inside the kernel, so no s² mask or probabilities.
    saved, (b, s, h, a) = _gpt_saved_per_layer(dropout=0.1, attention=AttentionImpl.SDPA)
    assert saved == 34 * s * b * h + 4 * a * s * b + _ln_stats(s, b)


def test_without_dropout_the_mask_terms_vanish():
    # No dropout: the two s·b·h masks (attention output, MLP output) and the a·s²·b
    # attention-probability mask plus its 2·a·s²·b output are absent: 32·s·b·h + 2·a·s²·b
    # (the softmax output kept for its own backward and for the PV matmul).
    saved, (b, s, h, a) = _gpt_saved_per_layer(dropout=0.0, attention=AttentionImpl.MATH)
    assert saved == 32 * s * b * h + 2 * a * s * s * b + _ln_stats(s, b)


class _SquashSavingInput(torch.autograd.Function):
    """x * tanh(x) + x, with a backward of its own: autograd keeps the input alone."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.tanh(x) + x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        t = torch.tanh(x)
        return grad * (t + x * (1 - t * t) + 1)


def test_a_custom_autograd_function_keeps_what_it_saves():
    """A block whose activation is a custom autograd Function saving its input alone: the
    trace charges what autograd keeps, measured on CPU by saved-tensor hooks (distinct
    storages), not what the Function's ops would save on their own."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            return self.down(_SquashSavingInput.apply(self.up(x)))

    torch.manual_seed(0)
    model = Block()
    x = torch.randn(4, 8, 32)
    storages: dict[int, int] = {}

    def pack(t):
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = sum(n for ptr, n in storages.items() if ptr not in weights)
    graph = trace(model, example_inputs=(x,))
    assert measured == 4 * 8 * (32 + 64 + 64) * 4  # up's input, the Function's, down's input
    assert sum(n.saved_bytes for n in graph.nodes) == measured


def test_dtype_override_costs_tensors_in_that_precision():
    model = models.build("gpt2", **TINY_GPT)  # fp32 weights
    fp32 = trace(model, global_batch_size=2, seq_len=32)
    bf16 = trace(model, global_batch_size=2, seq_len=32, dtype="bf16")
    assert bf16.saved_bytes * 2 == pytest.approx(fp32.saved_bytes, rel=0.02)
    assert bf16.flops_fwd == fp32.flops_fwd
    with pytest.raises(ValueError, match="dtype"):
        trace(model, global_batch_size=2, seq_len=32, dtype="fp7")


# ---------------------------------------------------------------- params, identity, blocks
@pytest.mark.parametrize("name,kwargs", [
    ("gpt2", dict(global_batch_size=1, seq_len=64)),
    ("llama3-8b", dict(global_batch_size=1, seq_len=64)),
    ("mixtral-8x7b", dict(global_batch_size=1, seq_len=64)),
    ("vit-b-16", dict(example_inputs=torch.empty(2, 3, 224, 224, device="meta"))),
    ("resnet50", dict(example_inputs=torch.empty(2, 3, 224, 224, device="meta"))),
])
def test_param_count_equals_sum_of_numel(name, kwargs):
    model = models.build(name)
    graph = trace(model, **kwargs)
    assert graph.num_params == sum(p.numel() for p in model.parameters())


def test_meta_model_and_real_weight_twin_give_identical_ir():
    torch.manual_seed(0)
    real = models.build("llama3-8b", device="cpu", **TINY_LLAMA)
    before = {n: p.detach().clone() for n, p in real.named_parameters()}
    meta = models.build("llama3-8b", device="meta", **TINY_LLAMA)
    g_real = trace(real, global_batch_size=2, seq_len=16)
    g_meta = trace(meta, global_batch_size=2, seq_len=16)
    assert g_real == g_meta and g_real.fingerprint() == g_meta.fingerprint()
    for n, p in real.named_parameters():  # the real model is untouched
        assert p.device.type == "cpu" and torch.equal(p, before[n])


def test_405b_is_one_block_times_126():
    model = models.build("llama3-405b")
    graph = trace(model, global_batch_size=1, seq_len=8192)
    assert [(b.representative, b.count) for b in graph.blocks] == [("layers.0", 126)]
    block = graph.blocks[0]
    assert block.layer_fqns == tuple(f"layers.{i}" for i in range(126))
    assert {n.module_path.split(".")[1] for n in graph.nodes if n.layer_index is not None} == {"0"}
    assert graph.num_params == sum(p.numel() for p in model.parameters())


def test_depth_scales_totals_not_nodes():
    small = trace(models.build("gpt2", **dict(TINY_GPT, n_layers=2)), global_batch_size=2, seq_len=16)
    big = trace(models.build("gpt2", **dict(TINY_GPT, n_layers=10)), global_batch_size=2, seq_len=16)
    assert len(small.nodes) == len(big.nodes)
    per_layer = sum(n.flops_fwd for n in layer_nodes(small))
    assert big.flops_fwd - small.flops_fwd == 8 * per_layer


def test_resnet_stage_blocks_and_layer_indices():
    graph = trace(models.build("resnet50"), example_inputs=torch.empty(1, 3, 64, 64, device="meta"))
    counts = {b.representative: b.count for b in graph.blocks}
    assert counts == {"layer1.0": 1, "layer1.1": 2, "layer2.0": 1, "layer2.1": 3,
                      "layer3.0": 1, "layer3.1": 5, "layer4.0": 1, "layer4.1": 2}
    assert sorted(i for b in graph.blocks for i in b.layer_indices) == list(range(16))


class _Layer(nn.Module):
    def __init__(self, dim, layer_idx, kind):
        super().__init__()
        self.layer_idx, self.kind = layer_idx, kind  # layer numbers are ignored, kinds are not
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(x).relu() if self.kind == "relu" else self.proj(x).tanh()


class _Stack(nn.Module):
    def __init__(self, kinds, widths=None):
        super().__init__()
        widths = widths or [8] * len(kinds)
        self.layers = nn.ModuleList(_Layer(w, i, k) for i, (w, k) in enumerate(zip(widths, kinds)))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum(-1, keepdim=True).expand(-1, 2)


def test_blocks_group_by_structure_and_config_not_layer_number():
    graph = trace(_Stack(["relu", "tanh", "relu", "tanh", "relu"]),
                  example_inputs=torch.empty(4, 8))
    groups = {b.representative: b.layer_fqns for b in graph.blocks}
    assert groups == {"layers.0": ("layers.0", "layers.2", "layers.4"),
                      "layers.1": ("layers.1", "layers.3")}


class _Mode(enum.Enum):
    A = 1
    B = 2


@dataclasses.dataclass
class _Cfg:
    width: int


def _random_module(rng: random.Random, depth: int = 0) -> nn.Module:
    """A small random module tree drawn from few choices, so that many draws coincide."""
    m = nn.Module()
    for name in ("hidden", "mode", "cfg", "stride", "layer_idx", "table"):
        if rng.random() < 0.5:
            setattr(m, name, {"hidden": lambda: rng.choice([4, 8]),
                              "mode": lambda: rng.choice(list(_Mode)),
                              "cfg": lambda: _Cfg(rng.choice([1, 2])),
                              "stride": lambda: rng.choice([(1, 1), (2, 1)]),
                              "layer_idx": lambda: rng.randrange(100),  # ignored
                              "table": lambda: [rng.random()]}[name]())  # not configuration
    for name in ("weight", "bias"):
        if rng.random() < 0.5:
            m.register_parameter(name, None if rng.random() < 0.2 else nn.Parameter(
                torch.empty(rng.choice([(2,), (2, 3)]), dtype=rng.choice(
                    [torch.float32, torch.bfloat16])), requires_grad=rng.random() < 0.8))
    if rng.random() < 0.3:
        m.register_buffer("scale", torch.empty(rng.choice([1, 2])))
    if depth < 2:
        for key in rng.sample(["a", "b", "c"], rng.randrange(3)):
            m.add_module(key, _random_module(rng, depth + 1))
    return m


def _nested_signature(m: nn.Module, depth: int = 0, key: str = "") -> tuple:
    """The same structure written another way (the oracle): one tuple per submodule."""
    skip = {"training", "layer_idx"}
    config = []
    for k in sorted(v for v in vars(m) if not v.startswith("_") and v not in skip):
        v = vars(m)[k]
        if isinstance(v, enum.Enum) or dataclasses.is_dataclass(v):
            v = repr(v)
        elif not isinstance(v, (int, float, str, bool, tuple, type(None))):
            continue
        config.append((k, v))
    params = tuple((k, tuple(p.shape), p.dtype, p.requires_grad)
                   for k, p in m._parameters.items() if p is not None)
    bufs = tuple((k, tuple(b.shape), b.dtype) for k, b in m._buffers.items())
    here = ((depth, key, type(m), tuple(config), params, bufs),)
    return here + sum((_nested_signature(c, depth + 1, k) for k, c in m._modules.items()), ())


@pytest.mark.parametrize("seed", range(4))
def test_block_signatures_are_equal_exactly_when_modules_are_alike(seed):
    rng = random.Random(seed)
    modules = [_random_module(rng) for _ in range(300)]
    flat = [blocks.signature(m) for m in modules]
    nested = [_nested_signature(m) for m in modules]
    pairs = [(i, j) for i in range(len(modules)) for j in range(i)]
    assert [flat[i] == flat[j] for i, j in pairs] == [nested[i] == nested[j] for i, j in pairs]
    assert sum(nested[i] == nested[j] for i, j in pairs) > 0  # the draws do coincide


class _Other(nn.Module):
    pass


def _mutate(rng: random.Random, m: nn.Module) -> None:
    """Change one field `signature` reads, in place (the class, a config value, a
    parameter's shape, dtype or requires_grad or its absence, a buffer's shape)."""
    params = [k for k, p in m._parameters.items() if p is not None]
    change = rng.choice(["class", "config", "buffer"] + ["param"] * bool(params))
    if change == "class":
        m.__class__ = _Other
    elif change == "config":
        m.hidden = 12 if getattr(m, "hidden", None) != 12 else 4
    elif change == "buffer":
        m.register_buffer("scale", torch.empty(3))
    else:
        k = rng.choice(params)
        p = m._parameters[k]
        how = rng.choice(["shape", "dtype", "grad", "none"])
        if how == "grad":
            p.requires_grad_(not p.requires_grad)
        elif how == "none":
            m._parameters[k] = None
        else:
            shape, dtype = ((5,), p.dtype) if how == "shape" else (p.shape, torch.float16)
            m._parameters[k] = nn.Parameter(torch.empty(shape, dtype=dtype),
                                            requires_grad=p.requires_grad)


@pytest.mark.parametrize("seed", range(4))
def test_column_check_of_a_stack_agrees_with_the_signatures(seed):
    # `_columns_alike` may be unsure (False) but never wrong when it says True; `all_alike`
    # answers exactly. Lists are drawn half from a module's family (copies differing in their
    # layer numbers, and copies with one field changed) or from independent draws that
    # coincide, so every answer occurs.
    rng = random.Random(seed)
    modules = [_random_module(rng) for _ in range(300)]
    pools = []
    for m in modules[:60]:  # each with twins and with mutants that differ in one field
        family = [m]
        for k in range(4):
            twin = copy.deepcopy(m)
            for sub in twin.modules():
                if hasattr(sub, "layer_idx"):
                    sub.layer_idx = rng.randrange(100)
            if k >= 2:
                _mutate(rng, rng.choice(list(twin.modules())))
            family.append(twin)
        pools.append(family)
    alike: dict[tuple, list[nn.Module]] = {}  # and independent draws that coincide
    for m in modules:
        alike.setdefault(blocks.signature(m), []).append(m)
    pools += [group for group in alike.values() if len(group) > 1]
    answers = []
    for _ in range(300):
        pool = rng.choice(pools) if rng.random() < 0.5 else modules
        picked = rng.sample(pool, min(len(pool), rng.randrange(2, 5)))
        same = len({blocks.signature(m) for m in picked}) == 1
        sure = blocks._columns_alike(picked)
        assert not sure or same
        assert blocks.all_alike(picked) == same
        answers.append((sure, same))
    assert {(True, True), (False, True), (False, False)} <= set(answers)


@pytest.mark.parametrize("name", ["llama3-8b", "gpt2", "mixtral-8x7b", "vit-b-16"])
def test_zoo_stacks_pass_the_column_check(name):
    # the fast path is the one deep models take (bias-free linears hold None parameters)
    model = models.build(name, n_layers=3) if name != "vit-b-16" else models.build(name)
    stacks = blocks.find_stacks(model)
    assert stacks
    for stack in stacks:
        container = model.get_submodule(stack.fqn)
        assert blocks._columns_alike(list(container.children()))


def test_shape_changing_blocks_are_traced_in_full():
    # identical blocks that are not shape-preserving: the parent reshapes between them, so
    # the stack is traced in full rather than trusting one representative.
    class Grow(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 16) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)[..., ::2] + 1
            return x[..., :2]

    graph = trace(Grow(), example_inputs=torch.empty(4, 8))
    assert [b.count for b in graph.blocks] == [1, 1, 1]
    assert len({n.module_path for n in graph.nodes if n.kind is OpKind.MATMUL}) == 3


# ---------------------------------------------------------------- MoE
def test_moe_is_costed_with_uniform_top_k_routing():
    b, s, h, f, experts, k = 2, 32, 64, 96, 4, 2
    model = models.build("mixtral-8x7b", **dict(TINY_MIXTRAL, dim=h, ffn_dim=f,
                                                num_experts=experts, top_k=k))
    graph = trace(model, global_batch_size=b, seq_len=s)
    moe = [n for n in layer_nodes(graph) if n.module_path.startswith("layers.0.feed_forward")]
    kinds = {n.kind for n in moe}
    assert {OpKind.MOE_DISPATCH, OpKind.MOE_COMBINE} <= kinds
    t = b * s
    router = 2 * t * h * experts
    expert_mlps = 3 * 2 * (t * k) * h * f  # w1, w3, w2 on the k·T routed rows
    assert sum(n.flops_fwd for n in moe) == router + expert_mlps
    used = {p.fqn for n in moe for p in n.params}
    assert {f"layers.0.feed_forward.experts.{e}.w1.weight" for e in range(experts)} <= used
    doubled = trace(model, global_batch_size=b, seq_len=s, moe_capacity_factor=2.0)
    assert doubled.flops_fwd > graph.flops_fwd



class _MetaRefusingExperts(nn.Module):
    """Fused experts ([experts, ffn, dim]) whose kernel raises inside its meta function, as a
    library's bf16-only grouped matmul does on fp32 fake tensors (operands in the wrong order
    here, so every torch refuses them)."""

    def __init__(self, experts=4, dim=16, ffn=32):
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, ffn, dim))
        self.top_k = 2

    def forward(self, x):
        return x + torch.mm(x.flatten(0, 1), self.w[0]).sum()


class _MetaRefusingMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.layers = nn.ModuleList([_MetaRefusingExperts() for _ in range(2)])
        self.head = nn.Linear(16, 64)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_moe_fallback_logs_one_info_line_and_no_error(every_log_record):
    # FakeTensorMode logs a failing meta kernel (with its traceback) at ERROR before raising;
    # the trace costs the experts as a leaf instead and says so once, at INFO.
    with torch.device("meta"):
        model = _MetaRefusingMoE()
    graph = trace(model, global_batch_size=2, seq_len=8)
    assert OpKind.MOE_DISPATCH in {n.kind for n in graph.nodes}
    loud = [f"{r.name}: {r.getMessage()}" for r in every_log_record
            if r.levelno >= logging.WARNING]
    assert loud == []
    leaf = [r for r in every_log_record if "MoE leaf" in r.getMessage()]
    assert [(r.name, r.levelno) for r in leaf] == [("autopar.trace.api", logging.INFO)]
    assert "layers.0" in leaf[0].getMessage() and "aten.mm" in leaf[0].getMessage()


# ---------------------------------------------------------------- unknown ops, errors
class _Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.cumprod(self.proj(x), dim=-1)


def test_unknown_op_is_kept_as_generic_and_reported(caplog):
    with caplog.at_level(logging.WARNING, logger="autopar.trace"):
        graph = trace(_Odd(), example_inputs=torch.empty(4, 8))
    generic = [n for n in graph.nodes if n.kind is OpKind.GENERIC]
    assert [n.target for n in generic] == ["aten.cumprod.default"]
    assert generic[0].module_path == "" and generic[0].bytes_read > 0
    assert "cumprod" in caplog.text


class _ItemUser(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.gate = nn.Identity()

    def forward(self, x):
        y = self.inner(x)
        return y * 2 if y.sum().item() > 0 else y


def test_untraceable_forward_names_module_op_and_remedy():
    with pytest.raises(TraceError) as info:
        trace(_ItemUser(), example_inputs=torch.empty(4, 8))
    err = info.value
    assert isinstance(err, ValueError)
    assert err.module_path == "" and err.op == "aten._local_scalar_dense.default"
    assert ".item()" in str(err) and "try:" in str(err)


def test_mismatched_inputs_give_value_error_with_module_path():
    vit = models.build("vit-b-16")
    with pytest.raises(ValueError) as info:
        trace(vit, example_inputs=torch.empty(2, 4, 224, 224))  # 4 channels, model wants 3
    assert info.value.module_path == "patch_embed" and "conv" in info.value.op
    with pytest.raises(ValueError, match="max_seq_len"):
        trace(models.build("gpt2", **TINY_GPT), global_batch_size=1, seq_len=65)


@pytest.mark.parametrize("kwargs,match", [
    (dict(), "need both"),
    (dict(global_batch_size=2), "need both"),
    (dict(global_batch_size=0, seq_len=8), "positive"),
    (dict(global_batch_size=2, seq_len=8, example_inputs=torch.empty(1, 8)), "not both"),
    (dict(example_inputs="tokens"), "example_inputs"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        trace(models.build("gpt2", **TINY_GPT), **kwargs)


def test_not_a_module():
    with pytest.raises(ValueError, match="nn.Module"):
        trace(lambda x: x, example_inputs=torch.empty(1))


def test_tensors_the_forward_makes_outside_the_fake_mode_are_traced():
    """A plain tensor attribute (not a buffer) and a list index (``x[..., [-2], :]``, which
    Python turns into an index tensor outside any mode) trace as the real forward computes
    them: the forward FLOPs FlopCounterMode counts on the real model."""

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, 32)
            self.blocks = nn.ModuleList(nn.Linear(32, 64) for _ in range(2))
            self.head = nn.Linear(32, 64)
            self.scale = torch.ones(32)  # an attribute, not a registered buffer

        def forward(self, x):
            h = self.emb(x) * self.scale
            for block in self.blocks:
                y = block(h).view(*h.shape[:2], 2, 32)
                h = h + y[..., [-2], :].squeeze(-2)
            return self.head(h)

    tokens = torch.zeros(2, 16, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        Plain()(tokens)
    with torch.device("meta"):
        meta = Plain()
    graph = trace(meta, global_batch_size=2, seq_len=16)
    assert graph.flops_fwd == counter.get_total_flops()
