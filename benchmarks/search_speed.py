"""Wall time of `autopar.compile` (trace + full search) on large clusters, and its growth with
depth. Prints a table: case, GPUs, configs considered, median seconds over repeats, the
chosen plan; then the 128-layer / 32-layer ratio (same width, same cluster). Goals (issue 5):
Llama-3-70B on 1,024 H100 <= 10 s, Llama-3-405B on 16,384 H100 <= 60 s, ratio <= 1.2.

Run: python benchmarks/search_speed.py [--repeats N]
"""

from __future__ import annotations

import argparse
import dataclasses
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


CASES = [
    ("llama3-70b", None, 128, 1024, 8192),
    ("llama3-405b", None, 2048, 2048, 8192),
    ("llama3-70b", 32, 128, 1024, 8192),
    ("llama3-70b", 128, 128, 1024, 8192),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    settings = autopar.SearchSettings(progress=False)
    print(f"{'case':<24} {'GPUs':>6} {'configs':>8} {'median s':>9} {'min s':>7}  plan")
    medians = {}
    for name, layers, nodes, gbs, seq in CASES:
        cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=nodes)
        times, plan = [], None
        for _ in range(args.repeats):
            model = _llama(name, layers)
            start = time.perf_counter()
            plan = autopar.compile(model, cluster, global_batch_size=gbs, seq_len=seq,
                                   settings=settings)
            times.append(time.perf_counter() - start)
        label = name + (f" ({layers} layers)" if layers else "")
        medians[(name, layers)] = statistics.median(times)
        print(f"{label:<24} {cluster.world_size:>6} {plan.search['num_considered']:>8} "
              f"{statistics.median(times):>9.2f} {min(times):>7.2f}  {plan.config.short()} "
              f"({plan.estimate.step_time_s:.2f} s/step, MFU {100 * plan.estimate.mfu:.1f}%)")
    ratio = medians[("llama3-70b", 128)] / medians[("llama3-70b", 32)]
    print(f"\n128 layers / 32 layers (1,024 GPUs): {ratio:.2f}x  (goal <= 1.2)")


if __name__ == "__main__":
    main()
