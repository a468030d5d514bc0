"""GPT (learned position embeddings, fused qkv with biases, LayerNorm, tied LM head) under the
runtime's tensor, sequence and pipeline parallelism, against one-process references:

* gradient parity: one ``train_step`` per plan, loss and every gradient (DTensor gradients
  gathered) within 1e-5 of the reference step; one torchrun launch per world size
  (grad_worker.py).  Covers the head-aware qkv split (tp, tp+sp, tp under pipeline stages and
  under ZeRO-3), the pipeline stages that skip the embeddings, and the tied embedding whose two
  pipeline copies sum their gradients (also sharded by FSDP, dp×pp ZeRO-1; and Llama's);
* loss parity of the generated training script at pp2×tp2 over three AdamW steps;
* a checkpoint written under tp=2 (head-aware qkv layout) resumed under pp=2 (tied copies on
  both stages), matching the uninterrupted run in losses, parameters and optimizer state.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import test_checkpoint
import test_parity
import tiny_models
from test_checkpoint import SPLIT, _assert_close, _launch, _trained
from test_checkpoint import STEPS as CKPT_STEPS
from test_gradients import run_gradient_plans
from test_parity import _losses, _make_script, assert_script_matches

from autopar.runtime import checkpoint_info, load_checkpoint

# the module-scoped reference runs of those tests, as fixtures of this module
references = test_parity.references
reference = test_checkpoint.reference

MB2 = {"micro_batch_size": 2}
# (id, model factory, constraints pinned in autopar.compile), per world size
GRAD_PLANS = {
    2: [("gpt_tp", "tiny_gpt", {"tp": 2, "sequence_parallel": False}),
        ("gpt_tp_sp", "tiny_gpt", {"tp": 2, "sequence_parallel": True}),
        ("gpt_pp_1f1b", "tiny_gpt", {"pp": 2, "pp_schedule": "1f1b", **MB2}),
        ("gpt_pp_zero_bubble", "tiny_gpt", {"pp": 2, "pp_schedule": "zero-bubble", **MB2}),
        # the tied copy on the last stage is a pass-through that Llama's forward does call
        ("llama_tied_pp_gpipe", "tiny_llama_tied", {"pp": 2, "pp_schedule": "gpipe", **MB2})],
    4: [("gpt_pp_tp", "tiny_gpt", {"pp": 2, "tp": 2, "pp_schedule": "1f1b",
                                   "sequence_parallel": False, **MB2}),
        ("gpt_dp_tp_sp_zero3", "tiny_gpt", {"dp": 2, "tp": 2, "zero_stage": 3,
                                            "sequence_parallel": True}),
        ("gpt_dp_pp_zero1", "tiny_gpt", {"dp": 2, "pp": 2, "zero_stage": 1,
                                         "pp_schedule": "1f1b", **MB2})],
}


@pytest.mark.parametrize("world", sorted(GRAD_PLANS))
def test_gpt_gradients_match_the_reference(tmp_path, world):
    results = run_gradient_plans(tmp_path, world, GRAD_PLANS[world])
    if world == 4:  # ZeRO-3 over tp: the fused qkv weight is split by head on tp, dim 1 on dp
        got = results["gpt_dp_tp_sp_zero3"]
        full = tiny_models.tiny_gpt().get_parameter("layers.0.attention.qkv.weight").numel()
        held = [g["local_numel"]["layers.0.attention.qkv.weight"] for g in got]
        assert held == [full // 4] * 4, (held, full)


def test_gpt_pp_tp_script_matches_the_reference(tmp_path, references):
    """The generated script at pp2×tp2 (1F1B): three AdamW steps, losses to 1e-4 relative."""
    script = _make_script(tmp_path, "gpt_pp_tp", 4, "tiny_gpt",
                          {"pp": 2, "tp": 2, "pp_schedule": "1f1b", "sequence_parallel": False,
                           **MB2})
    assert_script_matches(script, 4, references(script, "tiny_gpt"), "gpt pp2xtp2")


def test_gpt_checkpoint_from_tp_resumes_under_pp(tmp_path, reference):
    """Steps 1-2 under tp=2 (qkv split by head), saved; steps 3-4 under pp=2 (the tied
    embedding held by both stages), resumed; then steps 3-4 again under tp=2, which reads the
    head-aware layout back."""
    ref, ref_ckpt = reference("tiny_gpt")
    script_a = _make_script(tmp_path, "a", 2, "tiny_gpt", {"tp": 2, "sequence_parallel": False})
    script_b = _make_script(tmp_path, "b", 2, "tiny_gpt",
                            {"pp": 2, "pp_schedule": "1f1b", **MB2})
    ckpt = tmp_path / "ckpt"
    res = _launch(script_a, 2, "--steps", str(SPLIT), "--save", str(ckpt))
    _assert_close(_losses(res.stdout), ref[:SPLIT], "gpt tp=2")
    assert checkpoint_info(ckpt)["step"] == SPLIT
    res = _launch(script_b, 2, "--steps", str(CKPT_STEPS), "--resume", str(ckpt),
                  "--save", str(tmp_path / "final"))
    assert f"resumed from {ckpt} after step {SPLIT}" in res.stdout
    _assert_close(_losses(res.stdout), ref[SPLIT:], "gpt pp=2 resumed")
    _assert_same_state_but_key_bias(tmp_path / "final", ref_ckpt)
    res = _launch(script_a, 2, "--steps", str(CKPT_STEPS), "--resume", str(ckpt))
    _assert_close(_losses(res.stdout), ref[SPLIT:], "gpt tp=2 resumed (head-aware layout read)")


def _assert_same_state_but_key_bias(ckpt: Path, ref_ckpt: Path) -> None:
    """test_checkpoint's state comparison (parameters to 1e-4, AdamW moments to 1e-3 of their
    scale), except for the attention's key bias: its exact gradient is zero (adding ``q·b_k``
    to every score of a row leaves the softmax unchanged), so both runs feed AdamW round-off
    (second moments ~1e-21 against >= 1e-11 elsewhere) and AdamW turns any round-off into steps
    of ~lr with arbitrary sign.  Those elements are found by their second moment, and must be
    exactly the key thirds of the qkv biases."""
    (model, opt), (ref_model, ref_opt) = (_trained("tiny_gpt", steps=0) for _ in range(2))
    assert load_checkpoint(ckpt, model, opt) == load_checkpoint(ref_ckpt, ref_model, ref_opt)
    dim = ref_model.config.dim
    worst = {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            got, want = opt.state[p], ref_opt.state[q]
            assert float(got["step"]) == float(want["step"]) == CKPT_STEPS, name
            noise = want["exp_avg_sq"] < 1e-15
            expected = torch.zeros_like(noise)
            if name.endswith("attention.qkv.bias"):
                expected[dim:2 * dim] = True
            assert torch.equal(noise, expected), f"{name}: unexpected zero-gradient elements"
            worst["param"] = max(worst["param"], float((p - q).abs()[~noise].max()))
            for key in ("exp_avg", "exp_avg_sq"):
                diff = (got[key] - want[key]).abs().max() / want[key].abs().max()
                worst[key] = max(worst[key], float(diff))
    print(f"state vs reference: {worst}")
    assert worst["param"] <= 1e-4 and worst["exp_avg"] <= 1e-3 and worst["exp_avg_sq"] <= 1e-3
