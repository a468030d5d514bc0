"""The models of tests/corpus.py run as plain PyTorch: logits of the right shape and finite,
the same weights from every call of a factory, no dropout (two training-mode forwards agree),
a gradient on every parameter that took part, and construction on the meta device.  Also
``logits_of`` on each kind of output."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corpus  # noqa: E402

pytest.importorskip("transformers")  # the hf_* factories; a dev dependency

ALL = corpus.TOKEN_MODELS + corpus.IMAGE_MODELS
BATCH, SEQ = 8, 64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: at these sizes more threads only add contention (seconds of
    stalls on a busy machine), and the thread count is restored for the other modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _inputs(name):
    """A fixed batch and its targets: 8 sequences of 64 token ids, or 8 images and labels."""
    gen = torch.Generator().manual_seed(7)
    if name in corpus.IMAGE_MODELS:
        images = torch.randn(BATCH, *corpus.IMAGE_SHAPE, generator=gen)
        return images, torch.randint(0, corpus.NUM_CLASSES, (BATCH,), generator=gen)
    tokens = torch.randint(0, corpus.VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, tokens


def _expected_shape(name):
    if name in corpus.IMAGE_MODELS:
        return (BATCH, corpus.NUM_CLASSES)
    return (BATCH, SEQ, corpus.VOCAB + (name == "hf_gpt2_odd_vocab"))


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_lists_name_every_factory_once():
    factories = {name for name, f in vars(corpus).items() if inspect.isfunction(f)
                 and f.__module__ == corpus.__name__ and not name.startswith("_")} - {"logits_of"}
    assert len(set(ALL)) == len(ALL) and set(ALL) == factories
    assert not set(corpus.TOKEN_MODELS) & set(corpus.IMAGE_MODELS)


@pytest.mark.parametrize("name", ALL)
def test_forward_gives_finite_logits_without_dropout(name):
    model = getattr(corpus, name)()
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    model.train()  # dropout would act here: two forwards must still agree
    x, _ = _inputs(name)
    with torch.no_grad():
        first, second = corpus.logits_of(model(x)), corpus.logits_of(model(x))
    assert first.shape == _expected_shape(name)
    assert first.dtype == torch.float32
    assert torch.isfinite(first).all()
    assert torch.equal(first, second)
    assert all(m.p == 0 for m in model.modules() if isinstance(m, nn.Dropout))


@pytest.mark.parametrize("name", ALL)
def test_factory_is_deterministic(name):
    a, b = getattr(corpus, name)(), getattr(corpus, name)()
    assert a is not b
    named_a = dict(a.named_parameters()) | dict(a.named_buffers())
    named_b = dict(b.named_parameters()) | dict(b.named_buffers())
    assert named_a.keys() == named_b.keys()
    for key, tensor in named_a.items():
        assert tensor is not named_b[key]
        assert torch.equal(tensor, named_b[key]), key


def _modules_fed_only_empty_inputs(model):
    """Run-time record of the modules whose every call had an empty first input (an MoE
    expert that no token chose); their parameters get no gradient, rightly."""
    calls: dict[str, list[bool]] = {}
    handles = []
    for path, module in model.named_modules():
        def hook(_, args, path=path):
            if args and isinstance(args[0], torch.Tensor):
                calls.setdefault(path, []).append(args[0].numel() == 0)
        handles.append(module.register_forward_pre_hook(hook))
    return calls, handles


@pytest.mark.parametrize("name", ALL)
def test_backward_reaches_every_parameter(name):
    model = getattr(corpus, name)()
    calls, handles = _modules_fed_only_empty_inputs(model)
    x, y = _inputs(name)
    _loss(corpus.logits_of(model(x)), y).backward()
    for h in handles:
        h.remove()
    idle = {path for path, empties in calls.items() if all(empties)}
    missing = []
    for pname, p in model.named_parameters():
        owner = pname.rsplit(".", 1)[0] if "." in pname else ""
        if p.grad is None:
            if owner not in idle and p.requires_grad:
                missing.append(pname)
            continue
        assert torch.isfinite(p.grad).all(), pname
    assert not missing, f"no gradient for {missing}"
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_every_expert_of_the_loop_moe_gets_tokens():
    # the gradient test exempts experts no token chose; at this batch none is idle, so the
    # exemption does not hide the experts of moe_loop
    model = corpus.moe_loop()
    calls, handles = _modules_fed_only_empty_inputs(model)
    model(_inputs("moe_loop")[0])
    for h in handles:
        h.remove()
    experts = [path for path in calls if path.split(".")[-2:-1] == ["experts"]]
    assert len(experts) == 16  # 4 layers x 4
    assert not any(any(calls[path]) for path in experts)


@pytest.mark.parametrize("name", ALL)
def test_builds_on_the_meta_device(name):
    with torch.device("meta"):
        meta = getattr(corpus, name)()
    real = getattr(corpus, name)()
    assert all(t.is_meta for t in meta.parameters())
    assert all(t.is_meta for t in meta.buffers())
    assert {k: v.shape for k, v in meta.named_parameters()} == \
        {k: v.shape for k, v in real.named_parameters()}


def test_styles_keep_their_conventions():
    gpt = corpus.nano_gpt()
    assert gpt.transformer.wte.weight is gpt.lm_head.weight
    hf_gpt = corpus.hf_gpt2()
    assert hf_gpt.lm_head.weight is hf_gpt.transformer.wte.weight
    llama = corpus.plain_llama()
    assert {"rope_cos", "rope_sin"} <= dict(llama.named_buffers()).keys()
    assert not any("rope" in key for key in llama.state_dict())  # non-persistent
    assert not any(isinstance(m, nn.RMSNorm) for m in llama.modules())
    assert corpus.hf_qwen2().model.layers[0].self_attn.q_proj.bias is not None
    assert corpus.moe_batched().stack[0].moe.w_in.shape == (4, 64, 128)


def test_output_kinds():
    x = _inputs("plain_llama")[0][:2, :8]
    assert isinstance(corpus.plain_llama()(x), torch.Tensor)
    out = corpus.nano_gpt()(x)
    assert isinstance(out, tuple) and out[1] is None
    assert isinstance(corpus.litgpt_style()(x), dict)
    assert hasattr(corpus.hf_llama()(x), "logits")


def test_logits_of_each_output_kind():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    logits = torch.randn(2, 3, 5)
    assert corpus.logits_of(logits) is logits
    assert corpus.logits_of((logits, None)) is logits
    assert corpus.logits_of([logits, torch.zeros(())]) is logits
    assert corpus.logits_of({"logits": logits, "aux": 1}) is logits
    assert corpus.logits_of(CausalLMOutputWithPast(logits=logits)) is logits
    assert corpus.logits_of(CausalLMOutputWithPast(loss=torch.zeros(()), logits=logits)) \
        is logits

    class WithLogits:
        def __init__(self, t):
            self.logits = t

    assert corpus.logits_of(WithLogits(logits)) is logits
    with pytest.raises(TypeError):
        corpus.logits_of(3)


@pytest.mark.parametrize("name", corpus.TOKEN_MODELS)
def test_token_models_are_causal(name):
    """Decoders: a later token moves no earlier logit; the encoders listed as bidirectional
    move them."""
    model = getattr(corpus, name)()
    tokens = _inputs(name)[0][:2]
    changed = tokens.clone()
    changed[:, 32:] = (changed[:, 32:] + 1) % corpus.VOCAB
    with torch.no_grad():
        a, b = corpus.logits_of(model(tokens)), corpus.logits_of(model(changed))
    if name in corpus.BIDIRECTIONAL:
        assert not torch.allclose(a[:, :32], b[:, :32])
    else:
        torch.testing.assert_close(a[:, :32], b[:, :32], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[:, 32:], b[:, 32:])


def test_interleaved_rope_matches_the_complex_form():
    # Meta's apply_rotary_emb: (even, odd) pairs as complex numbers times e^{i·pos·freq}
    x = torch.randn(2, 8, 4, 16)
    cos, sin = corpus._rope_tables(16, 8)
    freqs = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))
    want = torch.view_as_real(torch.view_as_complex(x.reshape(2, 8, 4, 8, 2))
                              * freqs[None, :, None, :]).flatten(3)
    torch.testing.assert_close(corpus._rotate_interleaved(x, cos, sin), want)


def test_einsum_dispatch_equals_a_per_token_top2_mixture():
    moe = corpus.moe_batched().stack[0].moe
    x = torch.randn(3, 10, 64)
    tokens = x.reshape(-1, 64)
    probs = moe.router(tokens).softmax(-1)
    top_p, top_e = probs.topk(2, dim=-1)
    top_p = top_p / top_p.sum(-1, keepdim=True)
    want = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(2):
            e = int(top_e[t, j])
            gate, up = (tokens[t] @ moe.w_in[e]).chunk(2)
            want[t] += top_p[t, j] * ((F.gelu(gate) * up) @ moe.w_out[e])
    with torch.no_grad():
        torch.testing.assert_close(moe(x).reshape(-1, 64), want.detach(), rtol=1e-5, atol=1e-5)
