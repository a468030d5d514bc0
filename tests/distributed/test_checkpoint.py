"""Checkpoints reshard between plans: a generated script trains steps 1-2 under plan A and saves
(``--save``); the script of plan B (other degrees, possibly another world size) resumes
(``--resume``) and trains steps 3-4, whose losses must be the uninterrupted reference run's to
1e-4 relative.  The single-process ``--reference`` run reads and writes the same format.  Also:
a checkpoint of another model is refused with a message that says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_models
from test_parity import PY, TOL, TORCHRUN, _losses, _make_script, _run

from autopar.runtime import (
    checkpoint_info,
    load_checkpoint,
    make_optimizer,
    save_checkpoint,
)

STEPS = 4
SPLIT = 2  # plan A trains steps 1..SPLIT, plan B the rest

# (id, model factory, (ranks, constraints) of plan A, (ranks, constraints) of plan B)
CASES = [
    ("zero3_to_pp_1f1b", "tiny_llama",
     (2, {"dp": 2, "zero_stage": 3}),
     (2, {"pp": 2, "pp_schedule": "1f1b", "micro_batch_size": 2})),
    ("dp_tp_4_to_dp_2", "tiny_llama_wide",  # lost half the nodes: re-plan for 2 ranks
     (4, {"dp": 2, "tp": 2, "zero_stage": 3, "sequence_parallel": True}),
     (2, {"dp": 2, "zero_stage": 0})),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per model factory: the uninterrupted reference losses (steps 1..STEPS) and the
    checkpoint it saves after step STEPS."""
    cache: dict[str, tuple[list[float], Path]] = {}

    def get(factory: str) -> tuple[list[float], Path]:
        if factory not in cache:
            tmp = tmp_path_factory.mktemp(f"ref_{factory}")
            script = _make_script(tmp, "ref", 2, factory, {"dp": 2})
            res = _run([PY, str(script), "--reference", "--steps", str(STEPS), "--seed", "0",
                        "--save", str(tmp / "ckpt")])
            assert res.returncode == 0, res.stdout + res.stderr
            cache[factory] = (_losses(res.stdout), tmp / "ckpt")
            assert len(cache[factory][0]) == STEPS, res.stdout
        return cache[factory]

    return get


def _launch(script: Path, ranks: int, *args: str):
    cmd = [PY, str(script), "--reference"] if ranks == 0 else \
        [TORCHRUN, "--standalone", f"--nproc_per_node={ranks}", str(script)]
    res = _run(cmd + ["--seed", "0", *args])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def _assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), (got, want)
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"{what}: max relative loss difference {rel:.2e}")
    assert rel <= TOL, (what, got, want)


def _assert_same_state(ckpt: Path, ref_ckpt: Path, factory: str) -> None:
    """Parameters and AdamW state of two checkpoints agree.  The losses alone would not show a
    lost optimizer state: restarting AdamW from zero moves step 4's loss by only ~1e-5."""
    (model, opt), (ref_model, ref_opt) = (_trained(factory, steps=0) for _ in range(2))
    assert load_checkpoint(ckpt, model, opt) == load_checkpoint(ref_ckpt, ref_model, ref_opt)
    worst = {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            got, want = opt.state[p], ref_opt.state[q]
            assert float(got["step"]) == float(want["step"]) == STEPS, name
            # Adam turns grad noise of ~1e-7 into parameter differences of ~1e-5 (it divides
            # by sqrt(exp_avg_sq)); one step of a wrong or restarted state moves them ~lr=1e-3
            worst["param"] = max(worst["param"], float((p - q).abs().max()))
            for key in ("exp_avg", "exp_avg_sq"):  # relative to the tensor's scale
                diff = (got[key] - want[key]).abs().max() / want[key].abs().max()
                worst[key] = max(worst[key], float(diff))
    print(f"state vs reference: {worst}")
    assert worst["param"] <= 1e-4 and worst["exp_avg"] <= 1e-3 and worst["exp_avg_sq"] <= 1e-3


@pytest.mark.parametrize("name,factory,plan_a,plan_b", CASES, ids=[c[0] for c in CASES])
def test_resume_under_another_plan(tmp_path, reference, name, factory, plan_a, plan_b):
    ref, ref_ckpt = reference(factory)
    (ranks_a, cons_a), (ranks_b, cons_b) = plan_a, plan_b
    script_a = _make_script(tmp_path, "a", ranks_a, factory, cons_a)
    script_b = _make_script(tmp_path, "b", ranks_b, factory, cons_b)
    ckpt = tmp_path / "ckpt"

    res = _launch(script_a, ranks_a, "--steps", str(SPLIT), "--save", str(ckpt))
    _assert_close(_losses(res.stdout), ref[:SPLIT], f"{name} plan A")
    info = checkpoint_info(ckpt)
    assert info["step"] == SPLIT and info["layout"].endswith(f"on {ranks_a} ranks"), info
    assert info["plan"]["config"]["dp"] == cons_a["dp"]

    res = _launch(script_b, ranks_b, "--steps", str(STEPS), "--resume", str(ckpt),
                  "--save", str(tmp_path / "final"))
    assert f"resumed from {ckpt} after step {SPLIT}" in res.stdout
    assert "summary: median step" in res.stdout
    _assert_close(_losses(res.stdout), ref[SPLIT:], f"{name} plan B")
    _assert_same_state(tmp_path / "final", ref_ckpt, factory)

    # the same sharded checkpoint also loads in one process, without a process group
    res = _launch(script_b, 0, "--steps", str(STEPS), "--resume", str(ckpt))
    _assert_close(_losses(res.stdout), ref[SPLIT:], f"{name} reference resume")


def test_reference_and_interleaved_pipeline_hand_over(tmp_path, reference):
    """reference (no process group) saves after step 1 → pp=2 interleaved 1F1B (two stage
    modules and one optimizer per rank) resumes, trains steps 2-3 and saves → the reference
    resumes and trains step 4."""
    ref, ref_ckpt = reference("tiny_llama")
    script = _make_script(tmp_path, "pp", 2, "tiny_llama",
                          {"pp": 2, "pp_schedule": "interleaved-1f1b", "virtual_stages": 2,
                           "micro_batch_size": 2})
    first, second = tmp_path / "after1", tmp_path / "after3"
    res = _launch(script, 0, "--steps", "1", "--save", str(first))
    assert checkpoint_info(first)["layout"].startswith("reference")
    res = _launch(script, 2, "--steps", "3", "--resume", str(first), "--save", str(second))
    _assert_close(_losses(res.stdout), ref[1:3], "interleaved resume")
    res = _launch(script, 0, "--steps", str(STEPS), "--resume", str(second),
                  "--save", str(tmp_path / "final"))
    _assert_close(_losses(res.stdout), ref[3:], "reference resume of the pipeline's checkpoint")
    _assert_same_state(tmp_path / "final", ref_ckpt, "tiny_llama")


def _trained(factory, steps: int = 1):
    model = getattr(tiny_models, factory)()
    opt = make_optimizer(model.parameters())
    for _ in range(steps):
        model(torch.zeros(2, 8, dtype=torch.long)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_round_trip_in_one_process(tmp_path):
    model, opt = _trained("tiny_llama", steps=2)
    save_checkpoint(tmp_path / "ck", model, opt, 7)
    fresh, fresh_opt = _trained("tiny_llama", steps=0)
    assert load_checkpoint(tmp_path / "ck", fresh, fresh_opt) == 7
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), (name, key)


@pytest.mark.parametrize("saved,loaded", [("other_llama", "tiny_llama"),
                                          ("tiny_llama", "other_llama")])
def test_checkpoint_of_another_model_is_refused(tmp_path, saved, loaded):
    save_checkpoint(tmp_path / "ck", *_trained(saved), 1)
    model, opt = _trained(loaded, steps=0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"does not fit this model: .*parameters .*(not in the "
                                         r"checkpoint|not in this model).*without --resume"):
        load_checkpoint(tmp_path / "ck", model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_script_refuses_another_models_checkpoint_and_a_missing_one(tmp_path):
    save_checkpoint(tmp_path / "other", *_trained("other_llama"), 2)
    script = _make_script(tmp_path, "dp", 2, "tiny_llama", {"dp": 2, "zero_stage": 0})

    def resume(ckpt: str, steps: int):
        return _run([PY, str(script), "--reference", "--steps", str(steps),
                     "--resume", str(tmp_path / ckpt)])

    res = resume("other", 4)
    assert res.returncode != 0 and "step 3" not in res.stdout
    assert "error: checkpoint" in res.stderr and "does not fit this model" in res.stderr
    assert "Traceback" not in res.stderr
    res = resume("none", 4)
    assert res.returncode != 0 and "is not an autopar checkpoint" in res.stderr
    res = resume("other", 2)
    assert res.returncode != 0 and "leaves nothing to train" in res.stderr
    assert json.loads((tmp_path / "other" / "autopar_checkpoint.json").read_text())["step"] == 2
