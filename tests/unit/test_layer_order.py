"""Blocks of two kinds that alternate in one block list (sliding-window and global attention,
as Gemma 2/3 and Llama 4 lay them out; dense and MoE layers) are costed, cut into pipeline
stages and run in the model's order. Oracle: the layer order of the model as written, and
per-stage layer counts recounted from it by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.estimate.core import ModelCosts
from autopar.estimate.layout import structure
from autopar.estimate.stages import body_span, layer_sequence, megatron_boundaries

VOCAB, DIM, HEADS, LAYERS = 64, 32, 4, 6


class _Block(nn.Module):
    """Pre-norm attention + MLP; ``window`` > 0 masks keys more than ``window`` back."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, -1).transpose(1, 3).unbind(2)
        if self.window:
            i = torch.arange(s, device=x.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, DIM))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class _Alternating(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(_Block(window=8 if i % 2 == 0 else 0)
                                    for i in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@pytest.fixture(scope="module")
def costs():
    with torch.device("meta"):
        model = _Alternating()
    return ModelCosts.from_graph(autopar.trace(model, global_batch_size=2, seq_len=32))


def test_alternating_blocks_are_two_units_laid_out_in_model_order(costs):
    blocks = [u for u in costs.units if u.is_block]
    assert [u.layer_fqns for u in blocks] == [("blocks.0", "blocks.2", "blocks.4"),
                                               ("blocks.1", "blocks.3", "blocks.5")]
    order = [fqn for _, fqn in layer_sequence(costs.units)]
    assert order[1:-1] == [f"blocks.{i}" for i in range(LAYERS)]
    assert body_span(costs.units) == (1, LAYERS + 1)


@pytest.mark.parametrize("chunks", [2, 3, 6])
def test_stage_counts_are_recounted_from_the_model_order(costs, chunks):
    st = structure(costs.units, chunks, 1)
    order = layer_sequence(costs.units)
    names = [u.name for u in costs.units]
    for c, (a, b) in enumerate(megatron_boundaries(costs.units, chunks).tolist()):
        want = np.zeros(len(names))
        for unit, _ in order[a:b]:
            want[names.index(unit.name)] += 1
        assert st.counts[c].tolist() == want.tolist()
        assert st.stage_layers[c] == tuple(fqn for _, fqn in order[a:b])


def test_a_compiled_pipeline_owns_consecutive_blocks():
    with torch.device("meta"):
        model = _Alternating()
    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=2)
    plan = autopar.compile(model, cluster, global_batch_size=8, seq_len=32,
                           constraints={"pp": 2, "pp_schedule": "1f1b", "micro_batch_size": 2})
    blocks = [[int(n.rsplit(".", 1)[1]) for n in stage if n.startswith("blocks.")]
              for stage in plan.stages]
    assert blocks == [[0, 1, 2], [3, 4, 5]]


def test_the_runtime_refuses_stages_out_of_the_models_order():
    from autopar.runtime.pipeline import build_stage_modules

    model = _Alternating()
    stages = [["embed", "blocks.0", "blocks.2", "blocks.4"],
              ["blocks.1", "blocks.3", "blocks.5", "norm+head"]]
    with pytest.raises(ValueError, match="not in the order the model runs its blocks"):
        build_stage_modules(model, stages, [0], torch.zeros(2, 32, dtype=torch.long))
