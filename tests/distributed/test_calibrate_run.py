"""`autopar calibrate` as a user runs it: ``torchrun --nproc_per_node 4 -m autopar calibrate
--base cpu-gloo --quick -o cpu.toml`` on this host's CPU with gloo. The profile it writes must
load with `Cluster.from_toml` and predict the collective sizes the fit held back within 15% of
their measurement (widened by three standard errors of the measurement, at least 5% each; 15%
for the median over the held-out sizes), where the shipped cpu-gloo profile is far off; and a
rank that never starts must be named, within the timeout, instead of waited for."""

from __future__ import annotations

import csv
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import autopar
import hwprofiles

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TORCHRUN = str(Path(PY).with_name("torchrun"))
TOLERANCE = 0.15
# A size timed again in another run on this host lands within about 5% (one standard error)
# even where one run's rounds agree more closely (all-gather at 256 KiB: 2.9-3.6 ms over six
# runs): a held-out size's uncertainty is at least that
RUN_TO_RUN = 0.05


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _ranks(group: str) -> list[int]:
    """The table's group ("intra x4") as the ranks the calibration measured."""
    return list(range(int(group.rsplit("x", 1)[1])))


@pytest.mark.slow
def test_quick_calibration_predicts_held_out_gloo_sizes_within_15_percent(tmp_path):
    out = tmp_path / "cpu.toml"
    res = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "4", "-m", "autopar",
                          "calibrate", "--base", "cpu-gloo", "--quick", "-o", str(out)],
                         capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    print(res.stdout)
    cluster = autopar.Cluster.from_toml(out)
    assert cluster.world_size == 4 and cluster.name == "cpu"
    with open(out.with_suffix(".calibration.csv"), encoding="utf-8") as table:
        rows = list(csv.DictReader(table))
    held = [r for r in rows if r["role"] == "held-out"]
    kinds = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"}
    assert {r["what"] for r in held} == kinds and len(held) == 3 * len(kinds)
    bad, errors = [], []
    for r in held:
        measured, rse = float(r["measured_s"]), float(r["measured_rse"])
        predicted = cluster.collective_time(r["what"], float(r["size"]), _ranks(r["group"]))
        assert predicted == pytest.approx(float(r["fitted_s"]), rel=1e-3)  # the file's own
        errors.append(abs(predicted / measured - 1))
        # within 15% of the measurement, widened by the measurement's own uncertainty (three
        # standard errors of its median): a small message between 4 processes on 2 cores
        # waits on the scheduler, and its time varies several-fold from call to call
        if errors[-1] > TOLERANCE + 3 * max(rse, RUN_TO_RUN):
            bad.append((r["what"], r["size"], measured, predicted, rse))
    assert not bad, f"held-out sizes predicted more than {TOLERANCE:.0%} off: {bad}"
    assert statistics.median(errors) <= TOLERANCE
    base_errors = [abs(float(r["base_error"])) for r in held]
    assert statistics.median(base_errors) > 2 * TOLERANCE  # the shipped profile misses them
    sources = hwprofiles.read_profile(out)["sources"]
    measured_by = [k for k, v in sources.items() if v.startswith("measured by autopar "
                                                                 "calibrate on ")]
    assert {"node.fabric_gb_per_s", "collectives.call_overhead_us",
            "device.peak_tflops.fp32"} <= set(measured_by)
    assert "fit error" in sources["node.fabric_gb_per_s"]
    table = out.with_suffix(".calibration.txt").read_text()
    assert "base err" in table and "fitted err" in table and table in res.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_that_never_starts_is_named_within_the_timeout(tmp_path):
    """Rank 0 of a 2-rank job alone: it stops after --timeout naming rank 1."""
    env = _env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    res = subprocess.run([PY, "-m", "autopar", "calibrate", "--base", "cpu-gloo", "--quick",
                          "--timeout", "3", "-o", str(tmp_path / "x.toml")],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "rank 0: rank(s) 1 of 2 did not join within 3 s" in res.stderr
    assert not (tmp_path / "x.toml").exists()
