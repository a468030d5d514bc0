"""The reference zoo: presets carry published sizes, models run for real on tiny configs."""

from __future__ import annotations

import pytest
import torch

from autopar import models


def _llama_params(v, h, layers, heads, kv_heads, f, tied=False):
    # embeddings + per layer (wq, wo: h²; wk, wv: h·h_kv; w1, w2, w3: h·f; 2 RMSNorms) + final
    # norm + untied output head
    h_kv = kv_heads * h // heads
    per_layer = 2 * h * h + 2 * h * h_kv + 3 * h * f + 2 * h
    return v * h + layers * per_layer + h + (0 if tied else v * h)


def _gpt_params(v, ctx, h, layers):
    # tied token embedding, learned positions; per layer: qkv + out proj with biases,
    # 4h MLP with biases, 2 LayerNorms (weight + bias); final LayerNorm.
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (8 * h * h + 5 * h) + 4 * h
    return v * h + ctx * h + layers * per_layer + 2 * h


@pytest.mark.parametrize("name,expected", [
    ("gpt2", _gpt_params(50257, 1024, 768, 12)),
    ("gpt3-175b", _gpt_params(50257, 2048, 12288, 96)),
    ("llama3-8b", _llama_params(128256, 4096, 32, 32, 8, 14336)),
    ("llama3-70b", _llama_params(128256, 8192, 80, 64, 8, 28672)),
    ("llama3-405b", _llama_params(128256, 16384, 126, 128, 8, 53248)),
])
def test_preset_param_counts_match_closed_form(name, expected):
    model = models.build(name)
    assert sum(p.numel() for p in model.parameters()) == expected


def test_published_sizes_in_billions():
    # the headline sizes the names promise (Llama 3: 8.0B, 70.6B, 405.9B; GPT-2: 124M;
    # Mixtral 8x7B: 46.7B; ViT-B/16: 86.6M; ResNet-50: 25.6M)
    def size(name):
        return sum(p.numel() for p in models.build(name).parameters())
    assert round(size("gpt2") / 1e6) == 124
    assert round(size("llama3-8b") / 1e9, 1) == 8.0
    assert round(size("llama3-405b") / 1e9) == 406
    assert round(size("mixtral-8x7b") / 1e9, 1) == 46.7
    assert round(size("vit-b-16") / 1e6, 1) == 86.6
    assert round(size("resnet50") / 1e6, 1) == 25.6


def test_all_presets_build_on_meta_with_layers_list():
    for name in models.list_presets():
        model = models.build(name)
        assert all(p.device.type == "meta" for p in model.parameters())
        if not name.startswith(("resnet", "wide")):
            assert isinstance(model.layers, torch.nn.ModuleList)


def test_torchtitan_style_names():
    names = dict(models.build("llama3-8b", n_layers=1).named_parameters())
    assert {"layers.0.attention.wq.weight", "layers.0.feed_forward.w1.weight",
            "tok_embeddings.weight", "output.weight"} <= set(names)


@pytest.mark.parametrize("name,overrides,inputs", [
    ("gpt2", dict(n_layers=2, dim=32, n_heads=4, vocab_size=64, max_seq_len=16, dropout=0.1),
     torch.randint(0, 64, (2, 8))),
    ("llama3-8b", dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64),
     torch.randint(0, 64, (2, 8))),
    ("mixtral-8x7b", dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=48,
                          vocab_size=64, num_experts=4, top_k=2), torch.randint(0, 64, (2, 8))),
    ("vit-b-16", dict(n_layers=2, dim=32, n_heads=4, mlp_dim=64, image_size=32, patch_size=8,
                      num_classes=10), torch.randn(2, 3, 32, 32)),
    ("resnet50", dict(blocks=(1, 1, 1, 1), num_classes=10), torch.randn(2, 3, 32, 32)),
])
def test_tiny_models_train_for_real(name, overrides, inputs):
    torch.manual_seed(0)
    model = models.build(name, device="cpu", **overrides)
    out = model(inputs)
    out.float().square().mean().backward()
    assert torch.isfinite(out).all()
    assert all(p.grad is not None for p in model.parameters())


def test_math_and_sdpa_attention_agree():
    torch.manual_seed(0)
    kw = dict(n_layers=1, dim=32, n_heads=4, vocab_size=64, max_seq_len=16, device="cpu")
    sdpa = models.build("gpt2", **kw)
    math_ = models.build("gpt2", attention=models.AttentionImpl.MATH, **kw)
    math_.load_state_dict(sdpa.state_dict())
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(sdpa(tokens), math_(tokens), atol=1e-5, rtol=1e-5)


def _saved_bytes_and_grads(model, tokens):
    """Bytes autograd keeps for backward in one forward, and the gradients after backward."""
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes() if t.layout == torch.strided else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    return sum(saved), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_selective_recompute_drops_only_the_attention_scores(impl):
    """Under recompute_attention_core, unfused attention keeps no score-sized tensor (at least
    softmax's [b, h, s, s] output per layer goes), gradients are unchanged (dropout included:
    the RNG is replayed); fused attention is left as it is."""
    from autopar.models.common import recompute_attention_core

    kw = dict(n_layers=2, dim=32, n_heads=4, vocab_size=64, max_seq_len=32, device="cpu",
              attention=models.AttentionImpl(impl), dropout=0.1)
    model = models.build("gpt2", **kw)
    tokens = torch.randint(0, 64, (2, 32))
    torch.manual_seed(0)
    plain, want = _saved_bytes_and_grads(model, tokens)
    model.zero_grad()
    torch.manual_seed(0)
    with recompute_attention_core():
        selective, got = _saved_bytes_and_grads(model, tokens)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-5, msg=name)
    scores = 2 * 4 * 32 * 32 * 4  # one [b, h, s, s] fp32 tensor
    if impl == "math":
        assert plain - selective >= 2 * scores, (plain, selective)
    else:
        assert selective == plain


def test_bad_presets_and_configs():
    with pytest.raises(ValueError, match="unknown preset"):
        models.build("gpt5")
    with pytest.raises(ValueError, match="divisible"):
        models.GPTConfig(dim=100, n_heads=3)
    with pytest.raises(ValueError, match="n_kv_heads"):
        models.LlamaConfig(n_heads=32, n_kv_heads=5)
    with pytest.raises(ValueError, match="top_k"):
        models.MixtralConfig(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="no model"):
        models.build(object())
