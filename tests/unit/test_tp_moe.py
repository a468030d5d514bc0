"""MoE sub-layers under tensor parallel (`autopar.runtime.tp_moe`): Megatron-LM's layout of
expert weights written as a list or as fused ``[E, out, in]`` tensors, the check that a
sub-layer's output is the sum of its ranks' outputs on their shards, and the router's
partial gradient in the estimate. Runs in one process, on the whole weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import autopar
from autopar.estimate.core import ModelCosts
from autopar.estimate.tp_comm import partial_gradient_bytes
from autopar.plan import fused_projections, megatron_tp_placements
from autopar.runtime.tp_moe import local_shard, partial_sum_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corpus  # noqa: E402


def _placements(model: nn.Module, sub: str, tp_map: dict[str, str], chunks: dict[str, int]):
    """The tp placement of each parameter of sub-layer ``sub`` in `_LocalParams` order, as
    the runtime derives it from the plan's map."""
    out = []
    for m, mod in model.get_submodule(sub).named_modules():
        for n, p in mod._parameters.items():
            if p is None:
                continue
            fqn = ".".join(x for x in (sub, m, n) if x)
            spec = tp_map.get(fqn, "R")
            if spec == "R":
                out.append(Replicate())
            elif chunks.get(fqn, 1) > 1:
                out.append(_StridedShard(int(spec[2:-1]), split_factor=chunks[fqn]))
            else:
                out.append(Shard(int(spec[2:-1])))
    return out


def _expand(model: nn.Module, tp_map: dict[str, str]) -> dict[str, str]:
    """A block representative's placements for every layer (the names of layer 0 for all)."""
    import re
    names = dict(model.named_parameters())
    return {n: tp_map[re.sub(r"\.\d+\.", ".0.", n, count=1)] for n in names
            if re.sub(r"\.\d+\.", ".0.", n, count=1) in tp_map}


def test_fused_expert_weights_split_on_their_features_and_their_gate_up_chunks():
    """Hugging Face Mixtral's ``gate_up_proj [E, 2f, h]`` is column-parallel on its 2f
    features, by chunk (gate and up), and ``down_proj [E, h, f]`` row-parallel on its f;
    the expert dim stays whole (expert parallel's)."""
    graph = autopar.trace(corpus.hf_mixtral(), global_batch_size=2, seq_len=16)
    tp = megatron_tp_placements(graph)
    experts = "model.layers.0.mlp.experts"
    assert tp[f"{experts}.gate_up_proj"] == "S(1)" and tp[f"{experts}.down_proj"] == "S(2)"
    assert tp["model.layers.0.mlp.gate.weight"] == "R"  # the router
    assert fused_projections(graph)[f"{experts}.gate_up_proj"] == 2


@pytest.mark.parametrize("make, sub", [(corpus.moe_loop, "decoder.0.moe"),
                                       (corpus.hf_mixtral, "model.layers.0.mlp")])
@pytest.mark.parametrize("tp", [2, 4])
def test_an_moe_sublayer_is_the_sum_of_its_ranks_outputs_on_their_shards(make, sub, tp):
    torch.manual_seed(0)
    model = make()
    graph = autopar.trace(model, global_batch_size=2, seq_len=16)
    placements = _placements(model, sub, _expand(model, megatron_tp_placements(graph)),
                             fused_projections(graph))
    assert any(not isinstance(p, Replicate) for p in placements)
    x = torch.randn(2, 16, 64)
    assert partial_sum_error(model.get_submodule(sub), ((x,), {}), placements, tp) < 1e-5


def test_a_bias_after_the_row_gemm_is_not_a_sum_of_shards():
    """Experts whose down projection adds a bias: each rank would add it, so the sub-layer
    is not the sum of its ranks' outputs (the runtime then keeps DTensor's execution)."""
    torch.manual_seed(0)
    model = corpus.moe_loop()
    for expert in model.decoder[0].moe.experts:
        expert.w_down.bias = nn.Parameter(torch.randn(expert.w_down.out_features))
    graph = autopar.trace(model, global_batch_size=2, seq_len=16)
    placements = _placements(model, "decoder.0.moe",
                             _expand(model, megatron_tp_placements(graph)), {})
    x = torch.randn(2, 16, 64)
    assert partial_sum_error(model.decoder[0].moe, ((x,), {}), placements, 2) > 1e-3


def test_local_shards_are_dtensors_layout():
    """`local_shard` lays out ranks' parts as DTensor's ``Shard`` and ``_StridedShard`` do:
    the ranks' parts of a strided shard, joined by rank, are each chunk split in order."""
    full = torch.arange(2 * 8 * 3).reshape(2, 8, 3)
    parts = [local_shard(full, _StridedShard(1, split_factor=2), 2, r) for r in range(2)]
    gate, up = full.chunk(2, 1)
    assert torch.equal(parts[0], torch.cat([gate[:, :2], up[:, :2]], 1))
    assert torch.equal(parts[1], torch.cat([gate[:, 2:], up[:, 2:]], 1))
    assert torch.equal(local_shard(full, Shard(2), 3, 1), full[:, :, 1:2])
    assert local_shard(full, Replicate(), 2, 1) is full


def test_the_router_gradient_is_reduced_once_a_step():
    """A router's gradient is a partial sum over tp once its sub-layer's output is reduced
    once: its bytes join the step's all-reduce of partial gradients, with or without
    sequence parallel (the stream's norms only with it)."""
    with torch.device("meta"):
        model = corpus.moe_loop()
    graph = autopar.trace(model, global_batch_size=1, seq_len=64, dtype="fp32")
    (unit,) = [u for u in ModelCosts.from_graph(graph).units if u.is_block]
    router = model.decoder[0].moe.gate.weight.numel()
    assert unit.router_params == (router,)
    assert partial_gradient_bytes(unit, False) == 4 * router
    assert partial_gradient_bytes(unit, True) == 4 * (router + sum(unit.stream_params))


def test_a_shared_expert_run_before_the_routing_is_split_like_an_mlp():
    """Qwen2-MoE runs its shared expert on the tokens before its router: it is a column->row
    chain beside the experts, not part of the router, and its one-output sigmoid gate, which
    tp cannot split, stays whole. The sub-layer is then the sum of its ranks' outputs and
    reduces once each way, its gate's gradient joining the once-a-step all-reduce."""
    torch.manual_seed(0)
    model = corpus.hf_qwen2_moe()
    graph = autopar.trace(model, global_batch_size=2, seq_len=16)
    tp_map = megatron_tp_placements(graph, 2)
    mlp = "model.layers.0.mlp"
    assert {k[len(mlp) + 1:]: v for k, v in tp_map.items() if k.startswith(mlp)} == {
        "gate.weight": "R", "experts.gate_up_proj": "S(1)", "experts.down_proj": "S(2)",
        "shared_expert.gate_proj.weight": "S(0)", "shared_expert.up_proj.weight": "S(0)",
        "shared_expert.down_proj.weight": "S(1)", "shared_expert_gate.weight": "R"}
    placements = _placements(model, mlp, _expand(model, tp_map), fused_projections(graph))
    x = torch.randn(2, 16, 64)
    assert partial_sum_error(model.get_submodule(mlp), ((x,), {}), placements, 2) < 1e-5
    (unit,) = [u for u in ModelCosts.from_graph(graph).units if u.is_block]
    assert unit.tp_reductions == (2, 2)  # attention and the MoE sub-layer
    gate = model.model.layers[0].mlp.gate.weight.numel()
    assert sorted(unit.router_params) == [64, gate]  # the shared gate: one output x 64
