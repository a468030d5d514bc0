"""MoE sub-layers under context parallel run on each rank's own tokens
(`autopar.runtime.cp_moe`): the check that a sub-layer's output on the whole sequence is its
outputs on the sequence's chunks, joined, on Hugging Face Mixtral and Qwen2-MoE (a shared
expert beside the routed ones) and an MoE written as a loop; a sub-layer that mixes tokens
fails it. Runs in one process, on the whole weights; the multi-rank run is
tests/distributed/test_runtime_matrix.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from autopar.runtime.cp_moe import per_token_error, token_local_classes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corpus  # noqa: E402


@pytest.mark.parametrize("make, sub", [(corpus.hf_mixtral, "model.layers.0.mlp"),
                                       (corpus.hf_qwen2_moe, "model.layers.0.mlp"),
                                       (corpus.moe_loop, "decoder.0.moe")])
def test_an_moe_sublayer_works_token_by_token(make, sub):
    torch.manual_seed(0)
    model = make()
    tokens = torch.randint(0, corpus.VOCAB, (2, 32))
    classes = token_local_classes(model, 4, lambda: tokens)
    assert type(model.get_submodule(sub)) in classes
    x = torch.randn(2, 32, 64)
    assert per_token_error(model.get_submodule(sub), ((x,), {}), 4) < 1e-5


def test_a_sublayer_that_mixes_tokens_is_not_run_on_chunks():
    """A running mean over the sequence (as a causal convolution or attention mixes tokens):
    each chunk's outputs miss the tokens before it."""

    class RunningMean(torch.nn.Module):
        def forward(self, x):
            return x.cumsum(1) / torch.arange(1, x.shape[1] + 1)[:, None]

    x = torch.randn(2, 32, 64)
    assert per_token_error(RunningMean(), ((x,), {}), 2) > 1e-3
    assert per_token_error(RunningMean(), ((x,), {}), 1) == 0.0
