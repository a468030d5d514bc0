"""fp8 training in the runtime (`autopar.runtime.fp8`) against an independent oracle: the same
fp8 operands, dequantised and multiplied in float64; which GEMMs a plan runs in fp8
(`autopar.plan.fp8_weights`) and what the estimate charges for them under per-op recompute."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.estimate.timing import fp8_casts, unit_compute
from autopar.estimate.units import units_from_graph
from autopar.plan import fp8_weights
from autopar.runtime.fp8 import float8_gemms
from autopar.trace import trace

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _plan(names: list[str], dtype: str = "fp8", **options) -> SimpleNamespace:
    """What `float8_gemms` reads of a plan: its training section's fp8 weights, precision and
    options."""
    return SimpleNamespace(training=SimpleNamespace(fp8_weights=names, dtype=dtype,
                                                    options=options))


def dequantised(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as dynamic tensorwise scaling leaves it: scaled so its amax is the format's largest
    value, rounded to the format, scaled back -- in float64."""
    fmax = torch.finfo(dtype).max
    scale = fmax / t.detach().double().abs().max().clamp(min=1e-12)
    return (t.detach().double() * scale).clamp(-fmax, fmax).to(dtype).double() / scale


def oracle(x, w, b, g):
    """(y, grad x, grad w, grad b) of y = x wᵀ + b with x, w in e4m3 and g in e5m2."""
    xq, wq, gq = dequantised(x, E4M3), dequantised(w, E4M3), dequantised(g, E5M2)
    return xq @ wq.T + b.double(), gq @ wq, gq.T @ xq, g.double().sum(0)


@pytest.mark.parametrize("rows", [37, 64])  # 37: the weight gradient's inner dim is padded
def test_an_fp8_linear_is_the_product_of_its_fp8_operands(rows):
    from autopar.runtime.fp8 import float8_linear

    torch.manual_seed(0)
    x = torch.randn(rows, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    b = torch.randn(48, requires_grad=True)
    y = float8_linear(x, w, b, out_dtype=torch.float32)
    g = torch.randn_like(y)
    y.backward(g)
    want = oracle(x, w, b, g)
    for got, ref in zip((y, x.grad, w.grad, b.grad), want):
        assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    # and fp8 is not bf16: the product of the unrounded operands differs by far more
    assert (F.linear(x, w, b).double() - want[0]).abs().max() > 1e-2 * want[0].abs().max()


class Styles(nn.Module):
    """GEMMs of parameter weights written three ways, and one the mode does not take."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 48, bias=False)
        self.conv1d = nn.Module()  # GPT-2's Conv1D: addmm(bias, x, w[in, out])
        self.conv1d.weight = nn.Parameter(torch.randn(48, 64) * 0.1)
        self.conv1d.bias = nn.Parameter(torch.randn(64) * 0.1)
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.randn(64, 32) * 0.1)  # x @ w
        self.left = nn.Module()
        self.left.weight = nn.Parameter(torch.randn(16, 16) * 0.1)  # w @ x: stays bf16
        self.conv1d.forward = lambda x: torch.addmm(self.conv1d.bias, x, self.conv1d.weight)
        self.proj.forward = lambda x: x @ self.proj.weight
        self.left.forward = lambda x: self.left.weight @ x

    def forward(self, x):
        h = self.proj(self.conv1d(self.linear(x)))
        return h + self.left(h.reshape(16, -1)).reshape(h.shape)


def test_the_mode_runs_a_plans_fp8_weights_whatever_op_calls_them(caplog):
    torch.manual_seed(0)
    model = Styles()
    names = ["linear.weight", "conv1d.weight", "proj.weight", "left.weight"]
    plan = _plan(names)
    mode = float8_gemms(model, plan)
    x = torch.randn(16, 32)
    with mode:
        y = model(x)
    with caplog.at_level(logging.INFO, logger="autopar.runtime.fp8"):
        mode.check()
    assert mode.ran == {"linear.weight", "conv1d.weight", "proj.weight"}
    assert "GEMMs of 3 weight(s) ran in fp8" in caplog.text
    assert "1 weight(s) ran their GEMMs in bf16" in caplog.text and "left.weight" in caplog.text
    # the oracle, op by op
    h = dequantised(x, E4M3) @ dequantised(model.linear.weight, E4M3).T
    h = dequantised(h.float(), E4M3) @ dequantised(model.conv1d.weight.T, E4M3).T \
        + model.conv1d.bias.double()
    h = dequantised(h.float(), E4M3) @ dequantised(model.proj.weight.T, E4M3).T
    want = h + (model.left.weight.double() @ h.reshape(16, -1)).reshape(h.shape)
    assert (y.double() - want).abs().max() <= 1e-5 * want.abs().max()
    # outside the mode (a probe forward), the same modules run as written
    assert torch.equal(model(x), Styles.forward(model, x))


def test_an_fp8_plan_names_every_layers_gemm_weights_but_the_vocabulary_projection():
    from tests import corpus

    model = corpus.PlainLlama(vocab=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2,
                              ffn_dim=176, max_seq=64)
    graph = trace(model, global_batch_size=1, seq_len=64)
    names = fp8_weights(graph)
    weights = {n for n, p in model.named_parameters() if p.dim() == 2}
    head = [n for n, p in model.named_parameters() if p.shape[0] == 256]  # embedding, output
    assert set(names) == weights - set(head) and len(names) == 3 * 7
    # a width that is not a multiple of 16 keeps the GEMMs reading it in bf16
    odd = corpus.PlainLlama(vocab=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            ffn_dim=168, max_seq=64)
    kept = fp8_weights(trace(odd, global_batch_size=1, seq_len=64))
    assert len(kept) == 2 * 4 and not any(".w1." in n or ".w2." in n or ".w3." in n
                                          for n in kept)


def test_per_op_recompute_reruns_the_casts_of_the_fp8_gemms_it_keeps():
    from tests import corpus

    model = corpus.PlainLlama(vocab=256, dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=512, max_seq=256)
    graph = trace(model, global_batch_size=4, seq_len=256)
    cluster = autopar.Cluster.from_profile("dgx-h100", gpus_per_node=1)
    block = next(u for u in units_from_graph(graph) if u.is_block)
    cfg = autopar.ParallelConfig(recompute="per_op")
    # fused kernels: no selective-checkpoint dispatch on the host, which counts ops by dtype
    kw = dict(cluster=cluster, cfg=cfg, attention_kernel="flash", kernels="fused")
    fp8 = unit_compute(block, dtype="fp8", **kw)
    kept = [op for op in block.ops if op.kind == "gemm" and op.kept and op.fp8_elements]
    assert kept
    casts = sum(fp8_casts(op, cluster, cfg, "tensorwise", "fused")[0] for op in kept)
    dropped = dataclasses.replace(block, ops=tuple(
        dataclasses.replace(op, fp8_elements=()) if op in kept else op for op in block.ops))
    without = unit_compute(dropped, dtype="fp8", **kw)
    # the same block with the kept GEMMs in bf16: their GEMM is not re-run either way, so the
    # difference in what is re-run is their casts alone
    assert fp8.per_op_fwd + fp8.per_op_tail_fwd == pytest.approx(
        without.per_op_fwd + without.per_op_tail_fwd + casts, rel=1e-9)


def test_an_fp8_linear_runs_backward_under_autocast_and_takes_no_rows():
    """A pipeline schedule runs backward under the forward's autocast (which refuses fp8
    tensors in its ops); an expert that no token reached gets an empty input."""
    from autopar.runtime.fp8 import float8_linear

    x = torch.randn(21, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = float8_linear(x, w)
        assert y.dtype is torch.bfloat16
        y.float().sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    empty = torch.zeros(0, 32, requires_grad=True)
    out = float8_linear(empty, w, out_dtype=torch.float32)
    out.sum().backward()
    assert out.shape == (0, 16) and not w.grad.isnan().any()


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_the_ops_a_block_dispatches_are_the_ones_per_op_recompute_is_charged_for(dtype):
    """`selective_checkpoint_time_s` counts the ops one layer dispatches in eager PyTorch
    (traced nodes plus what each GEMM dispatches besides): within 5% of a dispatch-mode count
    of a hand-written Llama block (the CPU's fp8 GEMM dispatches 5 ops more than the GPU's one
    ``_scaled_mm``: two casts to fp32, the product, two scale multiplies)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.estimate.timing import selective_checkpoint_time_s
    from costmodels.compute import SAC_DISPATCH_S
    from tests import corpus

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = corpus.PlainLlama(vocab=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=704, max_seq=128)
    graph = trace(model, global_batch_size=2, seq_len=128)
    block = next(u for u in units_from_graph(graph) if u.is_block)
    plan = _plan(fp8_weights(graph), dtype)
    h = model.embed(torch.randint(0, 512, (2, 128)))
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            (float8_gemms(model, plan) if dtype == "fp8" else torch.autocast("cpu")), Count():
        model.blocks[0](h, model.rope_cos[:128], model.rope_sin[:128])
    gemms = sum(op.kind == "gemm" for op in block.ops)
    dispatched = Count.n - (5 * gemms if dtype == "fp8" else 0)
    assert selective_checkpoint_time_s(block, dtype) / SAC_DISPATCH_S == pytest.approx(
        dispatched, rel=0.05)


def rowwise(t: torch.Tensor, dim: int, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """t as torchao's rowwise recipe leaves it: one power-of-two scale per slice along `dim`
    (its amax to at most the format's largest value), rounded to the format -- in float64."""
    fmax = torch.finfo(dtype).max
    amax = t.detach().double().abs().amax(dim=dim, keepdim=True).clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(fmax / amax)))
    return (t.detach().double() * scale).clamp(-fmax, fmax).to(dtype).double() / scale


@pytest.mark.parametrize("rows", [37, 64])
def test_a_rowwise_fp8_linear_is_the_product_of_its_axiswise_fp8_operands(rows):
    """Rowwise: forward x per row and w per output row; input gradient the output gradient
    per row and w per column; weight gradient both over the tokens; all in e4m3."""
    from autopar.runtime.fp8 import float8_linear

    torch.manual_seed(1)
    x = torch.randn(rows, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    y = float8_linear(x, w, out_dtype=torch.float32, recipe="rowwise")
    g = torch.randn_like(y)
    y.backward(g)
    want_y = rowwise(x, -1) @ rowwise(w, -1).T
    want_gx = rowwise(g, -1) @ rowwise(w, 0)
    want_gw = rowwise(g, 0).T @ rowwise(x, 0)
    # the GEMMs write bf16 (the rowwise kernels' only output), hence bf16's rounding
    for got, want in ((y, want_y), (x.grad, want_gx), (w.grad, want_gw)):
        assert (got.double() - want).abs().max() <= 2 ** -8 * want.abs().max()
    tensorwise = float8_linear(x, w, out_dtype=torch.float32)
    assert (tensorwise.double() - want_y).abs().max() > 2 ** -8 * want_y.abs().max()


def test_a_plan_costed_rowwise_runs_rowwise():
    model = Styles()
    plan = _plan(["linear.weight"], fp8_recipe="rowwise")
    assert float8_gemms(model, plan).recipe == "rowwise"
    other = Styles()
    delayed = _plan(["linear.weight"], fp8_recipe="delayed")
    assert float8_gemms(other, delayed).recipe == "tensorwise"
