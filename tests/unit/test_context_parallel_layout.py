"""Context parallel of models whose attention does not go through autopar's hook: compile
chooses the contiguous layout, keeps it apart from expert parallel, and the estimate charges the busiest rank's share of causal
attention; the gradient shares the runtime hands to the data-parallel reduction sum to the
gradient, and the GEMMs it runs on local shards of (cp, tp) activations lay their outputs
and gradients out as DTensor would."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
import costmodels.compute
from autopar import ParallelConfig
from autopar.api import _within_limits
from autopar.estimate import ModelCosts, evaluate
from autopar.estimate.timing import cp_attention_load
from autopar.runtime.capabilities import RuntimeLimits
from autopar.runtime.sharded_sequence import gradient_share

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corpus  # noqa: E402

EXCLUSIVE = RuntimeLimits(axes={"pp": "no blocks"}, cp_layout="contiguous",
                          exclusive=((frozenset({"cp"}), frozenset({"tp", "ep"}), "why"),))


def test_exclusive_axes_split_the_search_into_regions():
    assert _within_limits({}, EXCLUSIVE) == [{"pp": 1, "tp": 1, "ep": 1}, {"pp": 1, "cp": 1}]
    assert _within_limits({"cp": 2}, EXCLUSIVE) == [{"cp": 2, "pp": 1, "tp": 1, "ep": 1}]
    assert _within_limits({"tp": 2}, EXCLUSIVE) == [{"tp": 2, "pp": 1, "cp": 1}]
    assert _within_limits({"cp": 1}, RuntimeLimits()) == [{"cp": 1}]
    with pytest.raises(ValueError, match="cp=2, ep=2 cannot run together on this model: why"):
        _within_limits({"cp": 2, "ep": 2}, EXCLUSIVE)
    with pytest.raises(ValueError, match="pp=2 cannot run on this model: no blocks"):
        _within_limits({"pp": 2}, EXCLUSIVE)


def test_compile_runs_cp_of_a_model_without_the_hook_with_tp_and_ep():
    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=4)
    kw = dict(global_batch_size=8, seq_len=64, dtype="fp32")
    plan = autopar.compile(corpus.plain_llama(), cluster, constraints={"cp": 2}, **kw)
    assert plan.model.cp_layout == "contiguous"
    assert (plan.config.cp, plan.config.tp, plan.config.ep) == (2, 1, 1)
    both = autopar.compile(corpus.plain_llama(), cluster, constraints={"cp": 2, "tp": 2}, **kw)
    assert (both.model.cp_layout, both.config.cp, both.config.tp) == ("contiguous", 2, 2)
    ep = autopar.compile(corpus.moe_loop(), cluster, constraints={"cp": 2, "ep": 2}, **kw)
    assert (ep.model.cp_layout, ep.model.ep_dispatch) == ("contiguous", "all_gather")
    assert (ep.config.cp, ep.config.ep) == (2, 2)
    moe = autopar.compile(corpus.moe_loop(), cluster, constraints={"cp": 2, "tp": 2}, **kw)
    assert (moe.config.cp, moe.config.tp) == (2, 2)
    with pytest.raises(ValueError, match="shards token sequences"):
        autopar.compile(corpus.vit_encoder(), cluster, constraints={"cp": 2},
                        global_batch_size=8,
                        example_inputs=torch.zeros(8, *corpus.IMAGE_SHAPE), dtype="fp32")


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_contiguous_cp_charges_the_last_ranks_causal_share(cp, monkeypatch):
    # the last of cp contiguous chunks attends to every earlier key: (cp - 1/2) of the
    # cp^2 / 2 chunk pairs under the mask, against an even share of cp / 2
    pairs = sum(r + 0.5 for r in range(cp))
    assert cp_attention_load(cp, causal=True, balanced=False) == pytest.approx(
        (cp - 0.5) / (pairs / cp))
    assert cp_attention_load(cp, causal=True, balanced=True) == 1.0
    assert cp_attention_load(cp, causal=False, balanced=False) == 1.0
    # the work alone: this small model's attention calls would sit at their per-call floor
    monkeypatch.setattr(costmodels.compute, "ATTENTION_CALL_FLOOR_S", {"fwd": 0.0, "bwd": 0.0})
    with torch.device("meta"):
        model = corpus.PlainLlama(max_seq=8192)  # long enough for attention to dominate
    graph = autopar.trace(model, global_batch_size=1, seq_len=8192, dtype="bf16")
    zigzag = ModelCosts.from_graph(graph)
    contiguous = zigzag.with_cp_layout("contiguous")
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
    times = {}
    for name, costs in (("zigzag", zigzag), ("contiguous", contiguous)):
        for degree in (1, cp):
            est = evaluate(costs, cluster, ParallelConfig(dp=8 // degree, cp=degree),
                           global_batch_size=8)
            times[name, degree] = est.breakdown["compute"]
    assert times["contiguous", 1] == times["zigzag", 1]
    assert times["contiguous", cp] > times["zigzag", cp]


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_gradient_shares_sum_to_the_gradient(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    local = torch.arange(6.0).reshape(2, 3)
    partial = DTensor.from_local(local, mesh, (Partial(),), run_check=False)
    assert torch.equal(gradient_share(partial), local)
    replicated = DTensor.from_local(local, mesh, (Replicate(),), run_check=False)
    assert torch.equal(gradient_share(replicated), local / 4)
    sharded = DTensor.from_local(local, mesh, (Shard(0),), run_check=False)  # rows 2..3 of 8
    share = gradient_share(sharded)
    assert share.shape == (8, 3)
    assert torch.equal(share[2:4], local) and share.sum() == local.sum()
    plain = torch.ones(2)
    assert gradient_share(plain) is plain


@pytest.fixture
def cp_tp_mesh(fake_world):
    """A (cp, tp) mesh of 2 x 2 on which this process is rank 1: cp rank 0, tp rank 1."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))


def test_a_tp_parameter_lifted_to_cp_tp_gets_its_cp_share_on_tp(cp_tp_mesh):
    from types import SimpleNamespace

    from autopar.runtime.sharded_sequence import _GradientShare

    mesh, tp = cp_tp_mesh, cp_tp_mesh["tp"]
    weight = DTensor.from_local(torch.ones(2, 3), tp, (Shard(0),), run_check=False)
    ctx = SimpleNamespace()
    lifted = _GradientShare.forward(ctx, weight, mesh)
    assert lifted.placements == (Replicate(), Shard(0)) and lifted.shape == (4, 3)
    local = torch.arange(6.0).reshape(2, 3)
    for cp_placement, share in ((Partial(), local), (Replicate(), local / 2)):
        grad = DTensor.from_local(local, mesh, (cp_placement, Shard(0)), run_check=False)
        got, _ = _GradientShare.backward(ctx, grad)
        assert got.device_mesh == tp and got.placements == (Shard(0),)
        assert got.shape == (4, 3) and torch.equal(got.to_local(), share)
    # a tp partial sum stays one: the step's gradient settling reduces it over tp
    grad = DTensor.from_local(local, mesh, (Partial(), Partial()), run_check=False)
    got, _ = _GradientShare.backward(ctx, grad)
    assert got.placements == (Partial(),) and torch.equal(got.to_local(), local)


def test_gemms_on_local_shards_lay_out_their_outputs_as_the_math_says(cp_tp_mesh):
    from autopar.runtime.sharded_sequence import _gemm_on_rows

    mesh = cp_tp_mesh
    torch.manual_seed(0)
    x_local, w_local, b_local = torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(5)

    def on(local, *placements):
        return DTensor.from_local(local, mesh, placements, run_check=False)

    # rows over cp, output features over tp (column parallel): this rank's block
    out = _gemm_on_rows(on(x_local, Shard(1), Replicate()), on(w_local, Replicate(), Shard(0)),
                        on(b_local, Replicate(), Shard(0)), 0)
    assert out.placements == (Shard(1), Shard(2)) and out.shape == (2, 6, 10)
    torch.testing.assert_close(out.to_local(), torch.nn.functional.linear(x_local, w_local,
                                                                          b_local))
    # input features over tp (row parallel): a partial sum, the bias added as a share
    out = _gemm_on_rows(on(x_local, Shard(1), Shard(2)), on(w_local, Replicate(), Shard(1)),
                        on(b_local, Replicate(), Replicate()), 0)
    assert out.placements == (Shard(1), Partial()) and out.shape == (2, 6, 5)
    torch.testing.assert_close(out.to_local(), x_local @ w_local.T + b_local / 2)
    # torch.addmm's [in, out] weight; replicated over both: DTensor's own
    assert _gemm_on_rows(on(x_local[0], Shard(0), Replicate()),
                         on(w_local.T, Replicate(), Shard(1)), None, 1).placements == \
        (Shard(0), Shard(1))
    assert _gemm_on_rows(on(x_local, Replicate(), Replicate()),
                         on(w_local, Replicate(), Replicate()), None, 0) is None
    # the input split on its features where the weight is not: not a local GEMM
    assert _gemm_on_rows(on(x_local, Shard(1), Shard(2)), on(w_local, Replicate(), Shard(0)),
                         None, 0) is None


class _Mixer(torch.nn.Module):
    """One block of a token model: causal attention, then ``mix`` reading the sequence."""

    def __init__(self, mix: str, dim: int = 16):
        super().__init__()
        self.mix, self.proj = mix, torch.nn.Linear(dim, dim)
        self.conv = torch.nn.Conv1d(dim, dim, 3, groups=dim, padding=2)

    def forward(self, x):
        b, s, d = x.shape
        q = self.proj(x).view(b, s, 2, d // 2).transpose(1, 2)
        h = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        h = h.transpose(1, 2).reshape(b, s, d)
        if self.mix == "conv":  # a Mamba or short-convolution mixer
            h = self.conv(h.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)
        elif self.mix == "chunks":  # chunked linear attention
            h = h.reshape(b, s // 4, 4, d).cumsum(2).reshape(b, s, d)
        elif self.mix == "scan":  # a recurrence over positions
            state, out = torch.zeros_like(h[:, 0]), []
            for i in range(h.shape[1]):
                state = 0.5 * state + h[:, i]
                out.append(state)
            h = torch.stack(out, 1)
        elif self.mix == "product":  # k^T v over the sequence
            h = h @ (h.transpose(1, 2) @ h)
        return x + h


class _MixerLM(torch.nn.Module):
    def __init__(self, mix: str, vocab: int = 32, dim: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(_Mixer(mix, dim) for _ in range(2))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("mix, why", [("conv", "convolves along the sequence"),
                                      ("chunks", "cuts the sequence into chunks"),
                                      ("scan", "loops over positions or chunks"),
                                      ("product", "contracts two activations over the sequence")])
def test_compile_refuses_cp_of_blocks_that_read_the_sequence_outside_attention(mix, why):
    """Found from the shapes of a second trace at half the sequence: a block op whose
    sequence dims (those that follow the length) it convolves, chunks, scans or contracts
    names the refusal; the same model without the mixer plans cp."""
    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=2)
    kw = dict(global_batch_size=4, seq_len=32, dtype="fp32")
    with pytest.raises(ValueError, match=f"cp=2 cannot run on this model: .*{why}"):
        autopar.compile(_MixerLM(mix), cluster, constraints={"cp": 2}, **kw)
    plain = autopar.compile(_MixerLM("none"), cluster, constraints={"cp": 2}, **kw)
    assert plain.config.cp == 2
