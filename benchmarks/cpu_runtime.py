"""Predicted vs measured step time of real runs on this machine: plans for the `cpu-gloo`
profile, run by their generated scripts under `torchrun` (gloo, one thread per rank).

This is the one end-to-end check of the estimate (compute roofline, op overhead, gloo
collectives, pipeline schedule, data-parallel traffic) against runs we can make without a GPU.
For each case: `autopar.compile` with the case's pins → `plan.save` → `generate_script` →
`torchrun --nproc_per_node=N script --steps S`; the measured step time is the median of the
steps after the first two (warm-up: allocation, DTensor sharding-propagation caches).
Run it on an otherwise idle machine: the profile was measured with one busy process per core.

Run: python benchmarks/cpu_runtime.py [--steps 12] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "distributed"))

import autopar  # noqa: E402
import tiny_models  # noqa: E402
from autopar.codegen import generate_script  # noqa: E402

# (name, ranks, model factory, pins[, SearchSettings fields])
CASES = [
    ("single", 1, "tiny_llama", {}),
    ("dp2_zero0", 2, "tiny_llama", {"dp": 2, "zero_stage": 0}),
    ("dp2_zero3", 2, "tiny_llama", {"dp": 2, "zero_stage": 3}),
    ("pp2_1f1b", 2, "tiny_llama", {"pp": 2, "pp_schedule": "1f1b", "micro_batch_size": 2}),
    ("pp2_gpipe", 2, "tiny_llama", {"pp": 2, "pp_schedule": "gpipe", "micro_batch_size": 2}),
    ("tp2", 2, "tiny_llama", {"tp": 2, "sequence_parallel": False}),
    ("single_wide", 1, "tiny_llama_wide", {}),
    ("dp2_wide", 2, "tiny_llama_wide", {"dp": 2, "zero_stage": 0}),
    ("tp2_wide", 2, "tiny_llama_wide", {"tp": 2, "sequence_parallel": False}),
    # one sequence per micro-batch with sequence parallel: the intra-op ILP's layout (the MLP
    # replicated on the sequence shard) against Megatron-LM's, side by side
    ("tp2_sp_ilp", 2, "tiny_llama_wide", {"tp": 2, "sequence_parallel": True,
                                          "micro_batch_size": 1}),
    ("tp2_sp_meg", 2, "tiny_llama_wide", {"tp": 2, "sequence_parallel": True,
                                          "micro_batch_size": 1}, {"tp_layouts": "megatron"}),
]
STEP = re.compile(r"^step (\d+) loss \S+ time_ms (\S+)", re.MULTILINE)


def run_case(tmp: Path, name: str, ranks: int, factory: str, pins: dict, steps: int,
             settings: dict | None = None):
    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=ranks)
    plan = autopar.compile(getattr(tiny_models, factory)(), cluster, global_batch_size=8,
                           seq_len=64, dtype="fp32", constraints=pins,
                           settings=autopar.SearchSettings(progress=False, **(settings or {})))
    script = tmp / f"{name}.py"
    script.write_text(generate_script(plan, f"tiny_models:{factory}",
                                      plan_path=plan.save(tmp / f"{name}.json")))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "distributed"),
                                           os.environ.get("PYTHONPATH", "")]))
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    res = subprocess.run([torchrun, "--standalone", f"--nproc_per_node={ranks}", str(script),
                          "--steps", str(steps)], capture_output=True, text=True, env=env,
                         timeout=600, check=False)
    if res.returncode:
        raise RuntimeError(f"{name} failed:\n{res.stderr[-2000:]}")
    times = [float(t) for _, t in STEP.findall(res.stdout)][2:]
    return plan, statistics.median(times) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    print(f"load average at start {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'case':<12} {'ranks':>5}  {'plan':<34} {'pred ms':>8} {'meas ms':>8} {'ratio':>6}  "
          f"largest predicted terms")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, ranks, factory, pins, *settings in CASES:
            if args.only and name not in args.only:
                continue
            plan, measured = run_case(Path(tmp), name, ranks, factory, pins, args.steps,
                                      *settings)
            pred = plan.estimate.step_time_s
            ratios.append(pred / measured)
            terms = sorted(((v, k) for k, v in plan.estimate.breakdown.items()
                            if k in ("compute", "tp_comm", "dp_comm", "bubble", "optimizer",
                                     "pp_comm")), reverse=True)[:3]
            print(f"{name:<12} {ranks:>5}  {plan.config.short()[:34]:<34} {pred * 1e3:8.2f} "
                  f"{measured * 1e3:8.2f} {pred / measured:6.2f}  "
                  + ", ".join(f"{k} {v * 1e3:.2f}" for v, k in terms))
    errs = sorted(abs(r - 1) for r in ratios)
    print(f"\n{len(ratios)} cases: median |pred/meas - 1| {statistics.median(errs) * 100:.0f}%, "
          f"max {errs[-1] * 100:.0f}%; load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
