"""Multi-rank gloo parity: plans compiled by ``autopar.compile``, saved, turned into a training
script by the ``autopar codegen`` command, launched with ``torchrun``, must print the same
per-step losses as the script's ``--reference`` run (one process, unsharded), to 1e-4 relative.  Also the bad
launches: a wrong world size and a plan for another model stop with a message, before any
collective."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.cli import main as cli_main
from autopar.codegen import codegen_main, generate_script

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import corpus  # noqa: E402
import tiny_models

PY = sys.executable
TORCHRUN = str(Path(PY).with_name("torchrun"))
STEPS = 3
TOL = 1e-4
BF16_TOL = 1e-2  # bf16 rounds to 3 significant digits, in other orders on other layouts
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)", re.MULTILINE)

# (id, ranks, model factory, constraints pinned in autopar.compile): the script's own paths
# (its data split over dp, a pipeline fed micro-batches, a Hugging Face model's output; GPT-2's
# script: test_fp8.py); each plan kind is trained in one launch per rank count in
# tests/distributed/test_runtime_matrix.py
CONFIGS = [
    ("dp", 2, "tiny_llama", {"dp": 2, "zero_stage": 0}),
    ("tp_pp", 4, "tiny_llama_wide", {"tp": 2, "pp": 2, "pp_schedule": "1f1b",
                                     "micro_batch_size": 2, "sequence_parallel": False}),
    # a Hugging Face model built from a config (tests/corpus.py): ModelOutput, nested blocks
    ("hf_llama_tp_sp_pp", 4, "corpus:hf_llama", {"tp": 2, "pp": 2, "pp_schedule": "1f1b",
                                                 "micro_batch_size": 2,
                                                 "sequence_parallel": True}),
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _make_script(tmp: Path, name: str, ranks: int, factory: str, constraints: dict,
                 dtype: str = "fp32", profile: str = "cpu-gloo") -> Path:
    cluster = autopar.Cluster.from_profile(profile, gpus_per_node=ranks)
    module, _, fn = factory.rpartition(":")
    model = getattr(corpus if module == "corpus" else tiny_models, fn)()
    plan = autopar.compile(model, cluster, global_batch_size=8, seq_len=64, dtype=dtype,
                           constraints=constraints)
    for key, value in constraints.items():
        assert getattr(plan.config, key) == value, (key, plan.config)
    plan_path = plan.save(tmp / f"{name}.json")
    script = tmp / f"{name}.py"
    # the `autopar codegen` command, as a user runs it (in-process: same code, no start-up)
    spec = factory if ":" in factory else f"tiny_models:{factory}"
    assert cli_main(["codegen", str(plan_path), "--model-factory", spec, "-o", str(script)]) == 0
    return script


def _run(cmd: list[str], timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=_env())


def _losses(out: str) -> list[float]:
    return [float(x) for _, x in STEP_LINE.findall(out)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Reference losses per model factory (the reference run depends only on the model, the
    batch shape and the seed, which all configs of one factory share)."""
    cache: dict[str, list[float]] = {}

    def get(script: Path, factory: str) -> list[float]:
        if factory not in cache:
            res = _run([PY, str(script), "--reference", "--steps", str(STEPS), "--seed", "0"])
            assert res.returncode == 0, res.stdout + res.stderr
            cache[factory] = _losses(res.stdout)
            assert len(cache[factory]) == STEPS, res.stdout
        return cache[factory]

    return get


def assert_script_matches(script: Path, ranks: int, ref: list[float], name: str,
                          tol: float = TOL):
    """Run a generated script on ``ranks`` processes for STEPS steps and assert every step's loss
    is within `tol` (relative) of the reference's; returns the finished process."""
    res = _run([TORCHRUN, "--standalone", f"--nproc_per_node={ranks}", str(script),
                "--steps", str(STEPS), "--seed", "0"])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = _losses(res.stdout)
    assert len(got) == STEPS, res.stdout
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    print(f"{name}: max relative loss difference {rel:.2e}")
    assert rel <= tol, (got, ref)
    return res


@pytest.mark.parametrize("name,ranks,factory,constraints", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_parity(tmp_path, references, name, ranks, factory, constraints):
    script = _make_script(tmp_path, name, ranks, factory, constraints)
    res = assert_script_matches(script, ranks, references(script, factory), name)
    assert "summary: median step" in res.stdout
    assert "model states held on pipeline rank" in res.stdout and "(plan " in res.stdout


# FSDP2 and a pipeline schedule under autocast (DDP, 1.6e-5, and tp + SP passed too when
# written; left out of the suite for its time)
BF16 = [("zero3", 2, {"dp": 2, "zero_stage": 3}),
        ("pp_1f1b", 2, {"pp": 2, "pp_schedule": "1f1b", "micro_batch_size": 2})]


@pytest.mark.parametrize("name,ranks,constraints", BF16, ids=[c[0] for c in BF16])
def test_bf16_plans_train_under_autocast_as_the_reference(tmp_path, name, ranks, constraints):
    """A bf16 plan trains under bf16 autocast (fp32 weights and optimizer states; FSDP2
    gathers the parameters in bf16) on every rank, as its --reference run does in one
    process: the same losses to bf16's precision.
    (These tiny models' first losses hardly move between bf16 and fp32; the next test checks
    that the forward runs in bf16.)"""
    script = _make_script(tmp_path, name, ranks, "tiny_llama_wide", constraints, dtype="bf16")
    res = _run([PY, str(script), "--reference", "--steps", str(STEPS), "--seed", "0"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert_script_matches(script, ranks, _losses(res.stdout), f"bf16 {name}", tol=BF16_TOL)


@pytest.mark.parametrize("dtype,want", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_the_runtime_runs_the_forward_in_the_plans_precision(dtype, want):
    """One rank, in this process: the model's logits come out of the forward in bf16 under a
    bf16 plan (autocast) and in fp32 under an fp32 plan; the weights stay fp32."""
    import torch.distributed as dist

    from autopar import runtime

    model = tiny_models.tiny_llama()
    plan = autopar.compile(model, autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=1),
                           global_batch_size=8, seq_len=64, dtype=dtype,
                           constraints={"micro_batch_size": 4})
    seen = []
    model.register_forward_hook(lambda _, __, out: seen.append(out.dtype))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rt = runtime.apply_plan(model, plan)
        x, y = tiny_models.batch("tiny_llama", model, plan)
        rt.train_step(x, y)
    finally:
        dist.destroy_process_group()
    assert seen == [want, want]  # two micro-batches of 4
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_wrong_world_size_stops_before_any_collective(tmp_path):
    script = _make_script(tmp_path, "dp", 2, "tiny_llama", {"dp": 2, "zero_stage": 0})
    res = _run([TORCHRUN, "--standalone", "--nproc_per_node=1", str(script), "--steps", "1"])
    assert res.returncode != 0
    assert "this plan needs 2 processes" in res.stderr and "1 were launched" in res.stderr
    assert "step 1" not in res.stdout
    # the script's own message, not a failure inside the process group or the runtime
    assert "error: this plan needs" in res.stderr and "autopar/runtime/apply.py" not in res.stderr


def test_plan_for_another_model_stops(tmp_path):
    script = _make_script(tmp_path, "dp", 2, "tiny_llama", {"dp": 2, "zero_stage": 0})
    text = script.read_text().replace("tiny_models import tiny_llama ", "tiny_models import other_llama ")
    assert "other_llama" in text
    script.write_text(text)
    res = _run([PY, str(script), "--reference", "--steps", "1"])
    assert res.returncode != 0
    assert "this plan was made for another model" in res.stderr
    assert "step 1" not in res.stdout


def test_codegen_main_writes_a_script(tmp_path):
    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=2)
    plan = autopar.compile(tiny_models.tiny_llama(), cluster, global_batch_size=8, seq_len=64,
                           dtype="fp32", constraints={"dp": 2, "zero_stage": 0})
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "train.py"
    assert codegen_main([str(tmp_path / "plan.json"), "--model-factory", "tiny_models:tiny_llama",
                         "-o", str(out)]) == 0
    text = out.read_text()
    assert "from autopar import runtime" in text and "def apply_plan" not in text
    compile(text, str(out), "exec")
    with pytest.raises(ValueError, match="MODULE:FN"):
        generate_script(plan, "not a spec", plan_path=tmp_path / "plan.json")
