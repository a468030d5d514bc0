"""The `autopar` command line end to end, in a subprocess, as a user runs it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def autopar(*args, check=True):
    env = {**os.environ, "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "autopar.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli")
    path = out / "plan.json"
    proc = autopar("plan", "--model", "cli_models:tiny_gpt", "--cluster", "dgx-h100",
                   "--global-batch", "32", "--seq-len", "512", "--pin", "pp=2",
                   "-o", str(path), "--plots", str(out / "plots"))
    assert "Prediction" in proc.stdout and f"saved {path}" in proc.stdout
    assert sorted(p.name for p in (out / "plots").iterdir()) == [
        "breakdown.png", "candidates.png", "memory.png", "timeline.png"]
    return path


def test_plan_report_export_and_explain(plan_file):
    data = json.loads(plan_file.read_text())
    assert data["config"]["pp"] == 2 and data["training"]["constraints"] == {"pp": 2}
    assert "Next candidates" in autopar("report", str(plan_file)).stdout
    assert autopar("report", str(plan_file), "--format", "md").stdout.count("|") > 20
    flags = autopar("export", str(plan_file), "--format", "megatron")
    assert "--pipeline-model-parallel-size 2" in flags.stdout
    assert "setup: data parallelism is not a flag" in flags.stderr
    why = autopar("explain", str(plan_file), "--model", "cli_models:tiny_gpt", "--pin", "tp=2")
    assert "why not tp=2?" in why.stdout


def test_a_plan_for_an_engine_exports_to_it_without_notes_and_reports_its_cost(tmp_path):
    path = tmp_path / "megatron.json"
    proc = autopar("plan", "--model", "cli_models:tiny_gpt", "--cluster", "dgx-h100",
                   "--global-batch", "32", "--seq-len", "512", "--pin", "pp=2",
                   "--pin", "zero_stage=1", "--target", "megatron", "-o", str(path))
    assert "target   megatron: only what Megatron-LM core_r0.13.0 runs" in proc.stdout
    assert re.search(r"restriction cost [+-]\d+\.\d%: best for autopar's runtime .* vs best for "
                     r"megatron ", proc.stdout)
    assert json.loads(path.read_text())["training"]["target"] == "megatron"
    flags = autopar("export", str(path), "--format", "megatron")
    assert "--use-distributed-optimizer" in flags.stdout and "note:" not in flags.stderr
    titan = autopar("export", str(path), "--format", "torchtitan")
    notes = [line for line in titan.stderr.splitlines() if line.startswith("note:")]
    assert "made for target megatron, not torchtitan" in notes[0]
    assert any(line.startswith("note: zero_stage 1:") for line in notes[1:])


@pytest.mark.parametrize("args,message", [
    (["plan", "--model", "nope", "--cluster", "dgx-h100", "--global-batch", "8",
      "--seq-len", "128"], "unknown model preset 'nope'"),
    (["plan", "--model", "gpt2", "--cluster", "dgx-h900", "--global-batch", "8",
      "--seq-len", "128"], "unknown hardware profile 'dgx-h900'"),
    (["plan", "--model", "gpt2", "--cluster", "dgx-h100", "--global-batch", "8",
      "--seq-len", "128", "--pin", "tp=3"], "no configuration satisfies the constraints"),
    (["plan", "--model", "gpt2", "--cluster", "dgx-h100", "--global-batch", "8",
      "--seq-len", "128", "--target", "deepspeed", "--pin", "tp=2"],
     "tp=2 cannot run on DeepSpeed 0.16.4 (target='deepspeed')"),
    (["report", "/nonexistent/plan.json"], "cannot read plan"),
    (["collective", "--size", "lots"], "cannot read size 'lots'"),
])
def test_user_mistakes_end_in_one_line_and_exit_2(args, message):
    proc = autopar(*args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_profiles_lists_every_shipped_profile():
    out = autopar("profiles").stdout
    for name in ("dgx-h100", "gb200-nvl72", "mi300x-8", "cpu-gloo"):
        assert name in out


def test_model_factory_resolves_from_the_working_directory(tmp_path):
    """As in the README: `--model examples.small_models:small_llama` from the repository root
    (not on PYTHONPATH), with a profile field overridden by --set. Through the installed
    `autopar` command: `python -m` would put the working directory on sys.path by itself."""
    root = HERE.parents[1]
    command = Path(sys.executable).with_name("autopar")
    assert command.exists(), f"{command}: the project is not installed in this environment"
    proc = subprocess.run([str(command), "plan", "--model",
                           "examples.small_models:small_llama", "--cluster", "cpu-gloo",
                           "--set", "gpus_per_node=4", "--global-batch", "8", "--seq-len", "64",
                           "--dtype", "fp32", "--pin", "tp=2", "-o", str(tmp_path / "p.json")],
                          capture_output=True, text=True, cwd=root, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["cluster"]["world_size"] == 4 and plan["config"]["tp"] == 2


def test_plan_takes_a_mesh_order_pin_over_the_orders_searched(tmp_path):
    path = tmp_path / "plan.json"
    autopar("plan", "--model", "cli_models:tiny_gpt", "--cluster", "dgx-h100", "--global-batch",
            "32", "--seq-len", "512", "--pin", "tp=2", "--pin", "mesh_order=pp,tp,cp,dp",
            "--mesh-orders", "all", "-o", str(path))
    data = json.loads(path.read_text())
    assert data["config"]["mesh_order"] == data["mesh"]["axes"] == ["pp", "tp", "cp", "dp"]
    assert data["training"]["constraints"]["mesh_order"] == ["pp", "tp", "cp", "dp"]
