"""The estimate's tensor memory against the allocator's peak on every measured GPU run.

Reads the one-GPU runs in tests/data (h100_measurements.json: the "steps" and the "ranking"
candidates that ran; h200_kernels.json: the generated scripts) and prints, per run, the
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
    out += [("script", r["model"].split(":")[1], r["peak_allocated_mib"] / r["predicted_tensor_mib"],
             r["predicted_tensor_mib"] * 2**20 / h200["memory_bytes"]) for r in h200["scripts"]]
    return out


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
