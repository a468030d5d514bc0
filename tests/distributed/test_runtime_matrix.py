"""A slice of ``benchmarks/runtime_matrix.py`` in the suite: models written independently of
autopar (a hand-written Llama, nanoGPT with its tied head, an MoE written as a loop, Hugging Face
Llama and Mixtral, a ViT) under tensor + sequence, pipeline, context parallel (alone and with a
pipeline) and 3-D plans on 2-8 gloo ranks, each
trained for 3 steps next to a one-process reference: every cell matches it (losses within 1e-4,
gradients within 1e-5 of the largest reference gradient) or was refused by compile with the
runtime's reason."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import runtime_matrix as rm  # noqa: E402

MODELS = ["plain_llama", "nano_gpt", "moe_loop", "hf_llama", "hf_mixtral", "vit_encoder"]
PLANS = ["tp", "tp_sp", "pp_zero_bubble", "tp_zero3", "tp_sp_pp", "cp", "cp_pp", "ep",
         "ep_zero3"]


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    return rm.run_matrix(MODELS, PLANS, tmp_path_factory.mktemp("matrix"))


@pytest.mark.parametrize("model", MODELS)
def test_every_cell_matches_the_reference_or_was_refused_at_compile(cells, model):
    for cell in (c for c in cells if c.model == model):
        if cell.loss_err is None:
            assert cell.status.startswith(("refused: ", "n/a")), (cell.plan, cell.status)
            continue
        assert cell.loss_err <= rm.LOSS_TOL and cell.grad_err <= rm.GRAD_TOL, \
            (cell.plan, cell.loss_err, cell.grad_err)


def test_plans_run_on_the_models_own_forward(cells):
    """Context parallel of models that compute attention themselves, expert parallel of MoE
    layers autopar did not write (a loop over an expert list, Hugging Face's fused experts),
    alone and with ZeRO-3 over the expert replicas, and the pipeline of an image model run;
    dense models have no ep cell."""
    by = {(c.model, c.plan): c.text() for c in cells}
    assert all(c.text().startswith("ok") for c in cells
               if c.plan == "cp" and c.model != "vit_encoder"), by
    assert "shards token sequences" in by["vit_encoder", "cp"]  # images: refused, saying why
    for model in ("moe_loop", "hf_mixtral"):
        assert by[model, "ep"].startswith("ok") and by[model, "ep_zero3"].startswith("ok"), by
    assert by["plain_llama", "ep"] == "n/a (dense)"
    assert by["vit_encoder", "pp_zero_bubble"].startswith("ok"), by  # an image model's stages


def test_vocab_parallel_logits_take_the_parallel_loss(cells):
    """Under tensor parallel the untied heads' logits stay vocab-sharded on the last stage and
    the loss runs under loss_parallel."""
    by = {(c.model, c.plan): c for c in cells}
    assert by["plain_llama", "tp_sp"].detail["loss_parallel"] is True
    assert by["hf_llama", "tp_zero3"].detail["loss_parallel"] is True


def test_tensor_parallel_issues_megatrons_collectives(cells):
    """nanoGPT (fused q/k/v split by ``split``, tied head) at tp=2 without sequence parallel, one
    micro-batch of 8: per block one all-reduce after each row-parallel GEMM forward and one for
    each sub-layer's input gradient backward (4 blocks x 4), the vocab-parallel embedding's
    forward (1), the vocab-parallel loss (max, sum and target logit: 3) and the head's input
    gradient (1) -- all-reduces only: no all-gather (q, k and v split on whole heads) and no
    re-layout."""
    by = {(c.model, c.plan): c for c in cells}
    assert by["nano_gpt", "tp"].detail["collectives"] == {"all_reduce": 21, "allreduce_": 1}
