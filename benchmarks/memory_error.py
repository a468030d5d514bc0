"""The estimate's tensor memory against the allocator's peak on every measured GPU run.

Reads the one-GPU runs in tests/data (h100_measurements.json: the "steps" and the "ranking"
candidates that ran; h200_kernels.json: the generated scripts, estimated anew as autopar's
runtime runs them) and prints, per run, the
measured peak allocated bytes over the estimate's tensor bytes and the predicted share of
device memory, then the median, p90 and largest ratio -- what `SearchSettings.memory_headroom`
is chosen from.

Run: python benchmarks/memory_error.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_check import DEFAULT_FILE, check_file  # noqa: E402
from benchmarks.gpu_ranking import check_file as check_rankings  # noqa: E402


def rows() -> list[tuple[str, str, float, float]]:
    """(kind, run, measured / predicted tensor bytes, predicted tensor share of the device)."""
    device = json.loads(Path(DEFAULT_FILE).read_text())["memory_bytes"]
    out = [("step", c.step_id, c.measured["peak_bytes"] / c.predicted["peak_bytes"],
            c.predicted["peak_bytes"] / device) for c in check_file(DEFAULT_FILE)]
    for p in check_rankings(DEFAULT_FILE):
        out += [("ranking", f"{p.problem} mb{c.key[0]} {c.key[1]}",
                 c.measured_peak_bytes / c.predicted_peak_bytes, c.predicted_peak_bytes / device)
                for c in p.candidates if c.ran]
    h200 = json.loads((ROOT / "tests" / "data" / "h200_kernels.json").read_text())
    for r in h200["scripts"]:
        predicted = _script_tensor_bytes(r)
        out.append(("script", r["model"].split(":")[1],
                    r["peak_allocated_mib"] * 2**20 / predicted, predicted / h200["memory_bytes"]))
    return out


def _script_tensor_bytes(row: dict) -> float:
    """Today's estimate of a generated script's tensor bytes, costed as autopar's runtime runs
    it (software="autopar")."""
    import importlib

    import torch

    import autopar

    module, fn = row["model"].split(":")
    with torch.device("meta"):
        model = getattr(importlib.import_module(module), fn)()
    batch = row["global_batch"]
    graph = autopar.trace(model, global_batch_size=batch, seq_len=row["seq_len"],
                          dtype=row["dtype"])
    cluster = autopar.Cluster.from_profile(row["cluster"], num_nodes=1, gpus_per_node=1)
    config = autopar.ParallelConfig(micro_batch_size=batch)
    return autopar.estimate(graph, cluster, config, global_batch_size=batch,
                            seq_len=row["seq_len"], dtype=row["dtype"],
                            software="autopar").tensor_memory_bytes


def main() -> int:
    table = rows()
    print(f"{'kind':8s} {'run':42s} {'measured/predicted':>18s} {'predicted share':>16s}")
    for kind, run, ratio, share in sorted(table, key=lambda r: r[2]):
        print(f"{kind:8s} {run:42s} {ratio:18.3f} {100 * share:15.1f}%")
    ratios = sorted(r[2] for r in table)
    print(f"{len(ratios)} runs: median {statistics.median(ratios):.3f}, p90 "
          f"{ratios[int(0.9 * len(ratios))]:.3f}, largest {ratios[-1]:.3f}; above 60% of the "
          f"device: largest {max(r[2] for r in table if r[3] > 0.6):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
