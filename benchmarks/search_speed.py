"""Wall time of `autopar.compile` (trace + full search) on large clusters, and its growth with
depth. Prints a table: case, GPUs, configs considered, median and least wall seconds over
repeats, the median CPU seconds of the process (less disturbed by other load on the machine)
and of the outer search alone (`plan.search["seconds"]`, wall), the chosen plan; then the
128-layer / 32-layer ratios (same width, same cluster). The cases run in rounds, each once per
round, so that the two depths are timed side by side. Goals (issue 5): Llama-3-70B on 1,024
H100 <= 10 s, Llama-3-405B on 16,384 H100 <= 60 s, ratio <= 1.2.

The two depths need not pick the same plan, and work that follows from the plan is in the
compile time. A last table gives the median wall time of each phase of compile
(`plan.search["phase_seconds"]`: trace, search, stage_dp, intra_op, plan) for the two depths.
The garbage of building each model is collected before its compile is timed (a full collection
it brings due costs ~0.1 s with a 128-layer model alive and landed in the trace of some rounds).
On the host of 2026-11-26 (eleven rounds) the 128-layer compile took 1.19x the 32-layer one
(0.17 vs 0.14 s; the outer search 1.16x): its space is 42% larger (more pipeline degrees,
virtual-stage splits and one-in-k full recompute choices), its winner (dp256 tp4, full
recompute of one block in four) needs the intra-op problems of its block and of the layouts
it prices (+5.5 ms), and the trace's +2 ms is the repeated-block check over 4x the layers.
The recompute choices for these fused-attention models are none, per_op, full, full/2 and
full/4: Llama-3-70B on 1,024 H100 considers 83,064 configs in 0.15 s. The search column
separates the outer search. On a shared machine the wall times swing; the CPU column is the
steadier one, and the per-round ratios (the two depths back to back) show the spread.

Run: python benchmarks/search_speed.py [--repeats N]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.models.llama import Llama  # noqa: E402
from autopar.models.registry import preset  # noqa: E402

import torch  # noqa: E402


def _llama(name: str, layers: int | None = None):
    cfg = preset(name)
    if layers is not None:
        cfg = dataclasses.replace(cfg, n_layers=layers)
    with torch.device("meta"):
        return Llama(cfg)


_SHALLOW = ("llama3-70b", 32, 128, 1024, 8192)
_DEEP = ("llama3-70b", 128, 128, 1024, 8192)
CASES = [
    ("llama3-70b", None, 128, 1024, 8192),
    ("llama3-405b", None, 2048, 2048, 8192),
    _SHALLOW,
    _DEEP,
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=11)  # rounds: the ratio swings
    args = parser.parse_args()
    settings = autopar.SearchSettings(progress=False)
    print(f"{'case':<24} {'GPUs':>6} {'configs':>8} {'median s':>9} {'min s':>7} {'cpu s':>6} "
          f"{'search s':>8}  plan")
    clusters = [autopar.Cluster.from_profile("dgx-h100", num_nodes=nodes)
                for _, _, nodes, _, _ in CASES]
    # rounds: every case once per round, so that the depths are measured side by side and a
    # drift of the machine's speed during the run weighs on both alike
    runs: list[list[tuple[float, float, float]]] = [[] for _ in CASES]
    phases: list[list[dict[str, float]]] = [[] for _ in CASES]  # plan.search["phase_seconds"]
    plans: list = [None] * len(CASES)
    for _ in range(args.repeats):
        for k, (name, layers, _, gbs, seq) in enumerate(CASES):
            model = _llama(name, layers)
            # the garbage of building the model is collected before the clock starts: in some
            # rounds a full collection it brings due (~0.1 s with a 128-layer model alive)
            # would otherwise land inside the compile; collections of compile's own garbage stay
            gc.collect()
            start, start_cpu = time.perf_counter(), time.process_time()
            plan = autopar.compile(model, clusters[k], global_batch_size=gbs, seq_len=seq,
                                   settings=settings)
            runs[k].append((time.perf_counter() - start, time.process_time() - start_cpu,
                            plan.search["seconds"]))
            phases[k].append(plan.search["phase_seconds"])
            plans[k] = plan
    medians: list[tuple[float, ...]] = []
    for (name, layers, _, _, _), cluster, plan, got in zip(CASES, clusters, plans, runs):
        times, cpu, search = zip(*got)
        label = name + (f" ({layers} layers)" if layers else "")
        med = tuple(statistics.median(x) for x in (times, cpu, search))
        medians.append(med)
        print(f"{label:<24} {cluster.world_size:>6} {plan.search['num_considered']:>8} "
              f"{med[0]:>9.2f} {min(times):>7.2f} {med[1]:>6.2f} {med[2]:>8.2f}  "
              f"{plan.config.short()} ({plan.estimate.step_time_s:.2f} s/step, "
              f"MFU {100 * plan.estimate.mfu:.1f}%)")
    deep, shallow = (CASES.index(case) for case in (_DEEP, _SHALLOW))
    wall, cpu, search = (d / s for d, s in zip(medians[deep], medians[shallow]))
    print(f"\n128 layers / 32 layers (1,024 GPUs): {wall:.2f}x  (goal <= 1.2); "
          f"CPU time {cpu:.2f}x, outer search {search:.2f}x")
    # the two depths run back to back in each round: their ratio per round, less moved by
    # the machine's speed drifting between rounds than the ratio of medians
    paired = sorted(d[0] / s[0] for d, s in zip(runs[deep], runs[shallow]))
    q1, q3 = (paired[round(f * (len(paired) - 1))] for f in (0.25, 0.75))
    print(f"per round: median {statistics.median(paired):.2f}x, quartiles {q1:.2f}-{q3:.2f}x "
          f"over {len(paired)} rounds")
    # where the deeper model's time goes: each phase of compile, median over the rounds
    print(f"\n{'phase (ms, median)':<20} {'32 layers':>10} {'128 layers':>11} {'difference':>11}")
    for phase in phases[deep][0]:
        a, b = (1e3 * statistics.median(p[phase] for p in phases[k]) for k in (shallow, deep))
        print(f"{phase:<20} {a:>10.1f} {b:>11.1f} {b - a:>+11.1f}")


if __name__ == "__main__":
    main()
