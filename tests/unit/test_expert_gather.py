"""Expert parallel of MoE layers autopar did not write (all-gather dispatch on the layer's own
forward): which layers it takes, the check that a layer's output is a sum over its experts
(against the same layer with a shared expert added, which it must refuse), what compile records
and that the estimate costs the all-gather and reduce-scatter it runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
from autopar import ParallelConfig
from autopar.estimate import EstimateOptions, ModelCosts, evaluate
from autopar.runtime.expert_gather import check_sum_of_experts, gathered_moe_modules

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corpus  # noqa: E402


class _LoopMoE(nn.Module):
    """Top-2 softmax routing over a list of GELU experts, optionally plus a dense shared expert
    added to every token's output (DeepSeek style), written independently of the corpus."""

    def __init__(self, dim: int = 16, num_experts: int = 4, shared: bool = False):
        super().__init__()
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 32, bias=False), nn.GELU(),
                                                   nn.Linear(32, dim, bias=False))
                                     for _ in range(num_experts))
        self.shared = nn.Linear(dim, dim, bias=False) if shared else None

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, expert(flat[token]) * weights[token, slot, None])
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view_as(x)


def test_finds_list_and_fused_moe_layers_by_structure():
    assert gathered_moe_modules(corpus.moe_loop()) == [f"decoder.{i}.moe" for i in range(4)]
    mixtral = gathered_moe_modules(corpus.hf_mixtral())
    assert mixtral == [f"model.layers.{i}.mlp.experts" for i in range(4)], mixtral
    assert gathered_moe_modules(corpus.plain_llama()) == []
    assert gathered_moe_modules(_LoopMoE(shared=True)) == [""]
    # a convolution's 3-D weight [out, in / groups, kernel] holds no experts (Mamba mixers)
    assert gathered_moe_modules(nn.Conv1d(8, 8, 4, groups=8)) == []
    with torch.device("meta"):
        jamba = gathered_moe_modules(corpus.hf_jamba())
    assert jamba == ["model.layers.1.feed_forward.experts",
                     "model.layers.3.feed_forward.experts"], jamba


@pytest.mark.parametrize("ep", [2, 4])
def test_a_layer_whose_output_sums_its_experts_passes_and_a_shared_expert_is_refused(ep):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    layer = _LoopMoE()
    before = layer(x)
    assert check_sum_of_experts(layer, "moe", ((x,), {}), ep) == 16  # an expert's width
    torch.testing.assert_close(layer(x), before)  # every expert is back in place
    # the shared expert would be added once per ep rank by the reduce-scatter
    with pytest.raises(ValueError, match="not the sum of its experts' contributions"):
        check_sum_of_experts(_LoopMoE(shared=True), "moe", ((x,), {}), ep)


def test_the_check_splits_fused_expert_weights_too():
    model = corpus.hf_mixtral()
    fqn = gathered_moe_modules(model)[0]
    layer = model.get_submodule(fqn)
    hidden = torch.randn(6, layer.gate_up_proj.shape[-1])
    index = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    weights = torch.rand(6, 2)
    assert check_sum_of_experts(layer, fqn, ((hidden, index, weights), {}), 2) is None

    class _Biased(type(layer)):  # a term outside the experts breaks the sum
        def forward(self, *args):
            return super().forward(*args) + 1.0

    layer.__class__ = _Biased
    with pytest.raises(ValueError, match="not the sum of its experts' contributions"):
        check_sum_of_experts(layer, fqn, ((hidden, index, weights), {}), 2)


def test_compile_runs_ep_of_other_moe_layers_with_tp():
    """Experts in a list and fused [E, ...] experts (Hugging Face Mixtral) run expert and
    tensor parallel together (each ep rank's experts on their tp shards)."""
    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=4)
    kw = dict(global_batch_size=8, seq_len=64, dtype="fp32")
    for model in (corpus.hf_mixtral(), corpus.moe_loop()):
        plan = autopar.compile(model, cluster, constraints={"ep": 2, "tp": 2}, **kw)
        assert plan.model.ep_dispatch == "all_gather"
        assert (plan.config.ep, plan.config.tp) == (2, 2)


def test_compile_refuses_ep_of_moe_layers_with_a_dense_dispatch_saying_why():
    """Stacked expert weights under a router, dispatched by one-hot einsums on a fixed
    capacity: the trace costs every expert on every token (the ops the model runs), so expert
    parallel has no routed tokens to split; a pin is refused with that reason, not with the
    search's empty space."""
    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=2)
    with torch.device("meta"):
        model = corpus.moe_batched()
    assert gathered_moe_modules(model)[0] == "stack.0.moe"
    with pytest.raises(ValueError, match="ep=2 cannot run on this model: .*dense dispatch"):
        autopar.compile(model, cluster, global_batch_size=8, seq_len=64, dtype="fp32",
                        constraints={"ep": 2})


def test_the_estimate_costs_the_all_gather_dispatch():
    with torch.device("meta"):
        model = corpus.moe_loop()
    graph = autopar.trace(model, global_batch_size=1, seq_len=128, dtype="bf16")
    costs = ModelCosts.from_graph(graph)
    gathered = costs.with_ep_dispatch("all_gather")
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=2)
    cfg = ParallelConfig(dp=16, ep=4)
    a2a = evaluate(costs, cluster, cfg, global_batch_size=64)
    ag = evaluate(gathered, cluster, cfg, global_batch_size=64)
    # top-2 routing: all-to-all moves 2 rows per token each way, all-gather + reduce-scatter
    # move every ep rank's tokens: the costs differ, and equal without ep
    assert ag.step_time_s != a2a.step_time_s
    one = ParallelConfig(dp=16)
    assert evaluate(gathered, cluster, one, global_batch_size=64).step_time_s == \
        evaluate(costs, cluster, one, global_batch_size=64).step_time_s
    with pytest.raises(ValueError, match="is not 'all_to_all' or 'all_gather'"):
        costs.with_ep_dispatch("ring")
    # under tensor parallel each tp rank gathers the whole tokens of its ep group (the MoE
    # sub-layer runs on local shards with its input whole), sequence parallel or not
    from autopar.estimate.groups import slowest_groups
    from autopar.estimate.timing import unit_times
    (unit,) = [u for u in gathered.units_for(1) if u.is_block]
    for sp in (False, True):
        cfg = ParallelConfig(dp=8, tp=2, ep=4, sequence_parallel=sp)
        groups = slowest_groups(cfg, cluster)
        times = unit_times(unit, cluster=cluster, dtype="bf16", cfg=cfg, groups=groups,
                           options=EstimateOptions(attention_kernel="flash"))
        assert times.ep_fwd == pytest.approx(
            cluster.collective_time("all_gather", unit.act_bytes * 4, groups.ep)
            + cluster.collective_time("reduce_scatter", unit.act_bytes * 4, groups.ep))


class _Renamed(nn.Module):
    """A token model of two `_LoopMoE`-like layers whose router and expert list carry other
    names (``scores``, ``ffns``) and six experts."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.layers = nn.ModuleList(_LoopMoE(num_experts=6) for _ in range(2))
        for layer in self.layers:
            layer.scores, layer.ffns = layer.router, layer.experts
            del layer.router, layer.experts
            layer.forward = _renamed_forward.__get__(layer)
        self.head = nn.Linear(16, 64)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _renamed_forward(self, x):
    self.router, self.experts = self.scores, self.ffns
    try:
        return _LoopMoE.forward(self, x)
    finally:
        del self.router, self.experts


def test_the_experts_are_counted_from_the_graph_not_their_names():
    """Experts per layer come from the traced MoE span (the expert outputs its combine reads),
    so a layer whose expert list is not called ``experts`` plans with ep over its 6 experts."""
    from autopar.estimate.core import ModelCosts

    graph = autopar.trace(_Renamed(), global_batch_size=4, seq_len=16)
    assert ModelCosts.from_graph(graph).num_experts == 6
    plan = autopar.compile(_Renamed(), autopar.Cluster.from_profile("cpu-gloo"),
                           global_batch_size=8, seq_len=16, constraints={"dp": 4, "ep": 2})
    assert plan.config.ep == 2
