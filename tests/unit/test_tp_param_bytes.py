"""The parameters one tensor-parallel rank holds, by the estimate's units
(`Unit.dense_on_tp_rank`, which the memory, the optimizer step and the data-parallel traffic
read), against the placements the plan saves and the runtime runs: each parameter whole on every
rank where it is replicated ("R": norms, a row-parallel GEMM's bias, a position table, K/V
projections tp cannot split), a 1/tp share where it is split. Over the dense models of
tests/corpus.py (hand-written and library norms, tied heads, learned positions as an Embedding
or a bare Parameter, fused q/k/v, multi-query attention, an image encoder) at tp = 2 and 4."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.config import ParallelConfig
from autopar.estimate.core import costs_of_layout
from autopar.plan import megatron_tp_placements
from autopar.plan.placements import param_placements

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corpus  # noqa: E402

pytest.importorskip("transformers")  # the hf_* factories; a dev dependency

MODELS = ["plain_llama", "plain_mqa", "nano_gpt", "litgpt_style", "hf_llama", "hf_gpt2",
          "hf_qwen3", "hf_gemma", "hf_opt", "hf_gpt_bigcode", "hf_phi3", "hf_bloom", "hf_bert",
          "vit_encoder"]


@pytest.mark.parametrize("name", MODELS)
def test_a_tp_rank_holds_what_the_placements_say(name):
    with torch.device("meta"):
        model = getattr(corpus, name)()
    if name in corpus.IMAGE_MODELS:
        graph = autopar.trace(model, example_inputs=(
            torch.empty(2, *corpus.IMAGE_SHAPE, device="meta"),))
    else:
        graph = autopar.trace(model, global_batch_size=2, seq_len=64)
    params = {n: p.numel() for n, p in model.named_parameters()}  # tied ones once
    for tp in (2, 4):
        config = ParallelConfig(tp=tp)
        layout = megatron_tp_placements(graph, tp)
        placed = param_placements(graph, config, layout)  # every parameter, as the plan saves
        want = sum(n if placed[fqn]["tp"] == "R" else n / tp for fqn, n in params.items())
        costs = costs_of_layout(graph, config, layout)
        got = sum(u.count * u.dense_on_tp_rank(tp) for u in costs.units)
        assert got == pytest.approx(want), (name, tp)
