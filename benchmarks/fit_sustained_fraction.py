"""Refit `SUSTAINED_COMPUTE_FRACTION` (costmodels/compute.py) on the published runs.

The sustained fraction is the one constant of the compute model fitted to published training
runs rather than measured on a GPU (long runs hold the GPU at its power limit; a short
benchmark does not). Protocol, per architecture: every row of benchmarks/data/published_
runs_calibration.csv on that architecture, except the groups in `NOT_MODELED`, is estimated at each
fraction of a 0.60-1.00 grid (step 0.01); the fit minimises the median |error|, ties broken by
the mean |error|. It prints the curve, the fit, and a leave-one-group-out check (each group
predicted with the fraction fitted on the other groups of its architecture), which shows how
far the groups agree.

Run: python benchmarks/fit_sustained_fraction.py [--arch ampere,hopper]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from autopar import estimate  # noqa: E402
from benchmarks.published_runs import PublishedRun, load_runs  # noqa: E402
from costmodels import compute  # noqa: E402

# DeepSpeed's 2021 ZeRO-3 steps are mostly its synchronous per-parameter gathers
# (EstimateOptions(zero3_gather="sync"), a constant measured elsewhere); their rows would pull
# the compute fit towards that communication model's error.
NOT_MODELED = ("sc21-t2-zero3",)
GRID = tuple(x / 100 for x in range(60, 101))


def _errors(runs: list[PublishedRun], graphs: dict, arch: str, fraction: float) -> dict[str, float]:
    """Relative step-time error per run id with the architecture's fraction set to `fraction`."""
    saved = compute.SUSTAINED_COMPUTE_FRACTION[arch]
    compute.SUSTAINED_COMPUTE_FRACTION[arch] = fraction
    try:
        out = {}
        for run in runs:
            if run.run_id not in graphs:
                graphs[run.run_id] = autopar.trace(
                    run.build_model(), global_batch_size=run.config.micro_batch_size,
                    seq_len=run.seq_len, dtype=run.dtype)
            est = estimate(graphs[run.run_id], run.make_cluster(), run.config,
                           global_batch_size=run.global_batch_size, seq_len=run.seq_len,
                           dtype=run.dtype, options=run.options())
            out[run.run_id] = est.step_time_s / run.published_step_time_s - 1.0
        return out
    finally:
        compute.SUSTAINED_COMPUTE_FRACTION[arch] = saved


def _score(errors: list[float]) -> tuple[float, float]:
    absolute = [abs(e) for e in errors]
    return statistics.median(absolute), statistics.mean(absolute)


def fit(runs: list[PublishedRun], graphs: dict, arch: str) -> tuple[float, dict[float, dict]]:
    """(best fraction, errors per grid point) over `runs`."""
    curve = {f: _errors(runs, graphs, arch, f) for f in GRID}
    best = min(GRID, key=lambda f: (_score(list(curve[f].values())), f))
    return best, curve


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="ampere,hopper")
    args = ap.parse_args(argv)
    all_runs = [r for r in load_runs() if r.group not in NOT_MODELED]
    graphs: dict = {}
    for arch in args.arch.split(","):
        runs = [r for r in all_runs if r.make_cluster().hardware.device.arch == arch]
        if not runs:
            print(f"{arch}: no published rows")
            continue
        groups = sorted({r.group for r in runs})
        best, curve = fit(runs, graphs, arch)
        print(f"{arch}: {len(runs)} rows of {', '.join(groups)}")
        print(f"  {'fraction':>8} {'median |err| %':>15} {'mean |err| %':>13} "
              f"{'median err %':>13}")
        for f in GRID:
            errs = list(curve[f].values())
            med, mean = _score(errs)
            if abs(f - best) <= 0.05:
                print(f"  {f:8.2f} {med * 100:15.1f} {mean * 100:13.1f} "
                      f"{statistics.median(errs) * 100:+13.1f}{'  <- fit' if f == best else ''}")
        print(f"  fit: {best:.2f} (in use: {compute.SUSTAINED_COMPUTE_FRACTION.get(arch)})")
        if len(groups) > 1:
            print("  leave one group out: group, fraction fitted on the others, the group's "
                  "median |err| at it and at the joint fit")
            for group in groups:
                rest = [r for r in runs if r.group != group]
                own = [r for r in runs if r.group == group]
                held, _ = fit(rest, graphs, arch)
                at_held = _score(list(_errors(own, graphs, arch, held).values()))[0]
                at_best = _score([curve[best][r.run_id] for r in own])[0]
                print(f"    {group:18s} {held:5.2f} {at_held * 100:6.1f}% {at_best * 100:6.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
