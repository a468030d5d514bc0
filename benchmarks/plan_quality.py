"""autopar's plan vs the published expert configuration, both predicted by the same cost model.

For every row of benchmarks/data/published_runs_calibration.csv: compile for the same model,
cluster, global batch, sequence length, dtype and software (benchmarks/published_runs.py's
SOFTWARE), estimate the published configuration, and print the speed-up of the plan
(published predicted step / plan predicted step; >= 1.00 means autopar's plan is not slower)
and what it chose differently. Median speed-up and the minimum close the table.

Run: python benchmarks/plan_quality.py [--group GROUP]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.estimate import ModelCosts, evaluate  # noqa: E402
from benchmarks.published_runs import load_runs  # noqa: E402

_FIELDS = ("dp", "tp", "pp", "cp", "ep", "zero_stage", "micro_batch_size", "pp_schedule",
           "virtual_stages", "sequence_parallel", "recompute")


def _diff(published: autopar.ParallelConfig, chosen: autopar.ParallelConfig) -> str:
    parts = [f"{f} {getattr(published, f)}->{getattr(chosen, f)}" for f in _FIELDS
             if getattr(published, f) != getattr(chosen, f)]
    return ", ".join(parts) or "same config"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", action="append")
    args = parser.parse_args()
    settings = autopar.SearchSettings(progress=False)
    print(f"{'id':<32} {'GPUs':>5} {'published s':>11} {'plan s':>8} {'speed-up':>8} "
          f"{'search s':>8}  what autopar chose differently")
    ratios = []
    for run in load_runs():
        if args.group and run.group not in args.group:
            continue
        options = run.options()
        cluster = run.make_cluster()
        # the published config through the same cost path compile ranks with (one trace per
        # sequence, scaled to the micro-batch), so equal configs compare equal
        costs = ModelCosts.from_graph(autopar.trace(run.build_model(), global_batch_size=1,
                                                    seq_len=run.seq_len, dtype=run.dtype))
        published = evaluate(costs, cluster, run.config, global_batch_size=run.global_batch_size,
                             dtype=run.dtype, options=options)
        start = time.perf_counter()
        plan = autopar.compile(run.build_model(), cluster, global_batch_size=run.global_batch_size,
                               seq_len=run.seq_len, dtype=run.dtype, options=options,
                               settings=settings)
        seconds = time.perf_counter() - start
        ratio = published.step_time_s / plan.estimate.step_time_s
        ratios.append(ratio)
        print(f"{run.run_id:<32} {run.n_gpus:>5} {published.step_time_s:>11.3f} "
              f"{plan.estimate.step_time_s:>8.3f} {ratio:>8.2f} {seconds:>8.1f}  "
              f"{_diff(run.config, plan.config)}")
    print(f"\n{len(ratios)} rows: median speed-up {statistics.median(ratios):.2f}x, "
          f"min {min(ratios):.2f}x, rows below 1.00: {sum(r < 1.0 for r in ratios)}")


if __name__ == "__main__":
    main()
