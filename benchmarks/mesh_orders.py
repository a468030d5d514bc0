"""Does the mesh order matter? For every row of benchmarks/data/published_runs_calibration.csv
(benchmarks/published_runs.py's models, clusters and software), `autopar.compile` with the
default mesh order (pp, dp, cp, tp: tp innermost) and with every order searched
(`SearchSettings(mesh_orders="all")`), side by side. Prints per row the two plans' predicted
step times, their ratio (default / all: above 1.00 means another order is faster), the order
the full search chose and both compile times (the least of `--repeats` compiles each, the two
settings alternating); then the rows where another order won and the median compile-time
ratio.

Run: python benchmarks/mesh_orders.py [--group GROUP] [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.config import DEFAULT_MESH_ORDER  # noqa: E402
from benchmarks.published_runs import load_runs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", action="append")
    parser.add_argument("--repeats", type=int, default=2,
                        help="compiles of each setting per row, alternating; the least time")
    args = parser.parse_args()
    print(f"{'id':<32} {'GPUs':>5} {'default s':>9} {'all s':>9} {'ratio':>6} "
          f"{'compile s':>9} {'all':>6}  plan (all orders)")
    ratios, slow, won = [], [], []
    for run in load_runs():
        if args.group and run.group not in args.group:
            continue
        plans, seconds = {}, {"default": [], "all": []}
        for orders in ("default", "all") * args.repeats:  # alternating: side by side
            settings = autopar.SearchSettings(progress=False, mesh_orders=orders)
            model, cluster = run.build_model(), run.make_cluster()
            start = time.perf_counter()
            plans[orders] = autopar.compile(model, cluster,
                                            global_batch_size=run.global_batch_size,
                                            seq_len=run.seq_len, dtype=run.dtype,
                                            options=run.options(), settings=settings)
            seconds[orders].append(time.perf_counter() - start)
        default, every = plans["default"], plans["all"]
        seconds = [min(seconds["default"]), min(seconds["all"])]
        ratio = default.estimate.step_time_s / every.estimate.step_time_s
        ratios.append(ratio)
        slow.append(seconds[1] / seconds[0])
        if every.config.mesh_order != DEFAULT_MESH_ORDER:
            won.append((run.run_id, ratio, every.config.short()))
        print(f"{run.run_id:<32} {run.n_gpus:>5} {default.estimate.step_time_s:>9.3f} "
              f"{every.estimate.step_time_s:>9.3f} {ratio:>6.3f} {seconds[0]:>9.2f} "
              f"{seconds[1]:>6.2f}  {every.config.short()}")
    print(f"\n{len(ratios)} rows: another order won on {len(won)} (ratio max "
          f"{max(ratios):.3f}); searching every order took {statistics.median(slow):.1f}x the "
          f"default's compile time (median; max {max(slow):.1f}x)")
    for run_id, ratio, label in won:
        print(f"  {run_id}: {ratio:.3f}x with {label}")


if __name__ == "__main__":
    main()
