"""Predicted vs measured collective bus bandwidth and latency, for every measured point we have.

The points are in tests/data/collective_measurements.csv: each row names a shipped profile
(with what-if overrides where the measured system differs), the group shape, the buffer size,
the measured value (bus bandwidth in GB/s, nccl-tests definition, or time in us), its source
and its role:

  large     issue 2's required large-message points (dgx-a100-80g, dgx-h100): within ±10%
  heldout   large-message points no constant was fitted on: within ±10%
  small     small-message latency: within 2x
  scan_fit  the size scans the pipeline-ramp constants were fitted on (printed)
  scan      held-out size scans (printed)
  report    points printed with their caveat (launch overhead, EFA vs IB, SHARP, ...)

Run: python benchmarks/collectives.py [--role ROLE] [--profile NAME]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autopar.cluster import Cluster  # noqa: E402

MEASUREMENTS = ROOT / "tests" / "data" / "collective_measurements.csv"
ROLES = ("large", "heldout", "small", "scan_fit", "scan", "report")


@dataclass(frozen=True)
class Point:
    row: dict
    predicted: float  # same unit as row["value"]
    algorithm: str
    protocol: str

    @property
    def measured(self) -> float:
        return float(self.row["value"])

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured


def _parse_overrides(text: str) -> dict:
    out: dict = {}
    for item in filter(None, (t.strip() for t in text.split(";"))):
        key, value = item.split("=")
        out[key] = {"true": True, "false": False}.get(value, None)
        if out[key] is None:
            out[key] = float(value) if "." in value else int(value)
    return out


@lru_cache(maxsize=None)
def _cluster(profile: str, overrides: str, num_nodes: int) -> Cluster:
    return Cluster.from_profile(profile, num_nodes=num_nodes, **_parse_overrides(overrides))


def load_measurements(path: Path = MEASUREMENTS) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def predict(row: dict) -> Point:
    nodes, per_node = int(row["num_nodes"]), int(row["ranks_per_node"])
    cluster = _cluster(row["profile"], row["overrides"], nodes)
    gpn = cluster.gpus_per_node
    ranks = [node * gpn + i for node in range(nodes) for i in range(per_node)]
    algorithm = None if row["algorithm"] == "auto" else row["algorithm"]
    est = cluster.collective_estimate(row["kind"], int(row["nbytes"]), ranks, algorithm=algorithm)
    if row["metric"] == "time_us":
        value = est.time_s * 1e6
    else:
        value = est.busbw_bytes_per_s / 1e9
    return Point(row=row, predicted=value, algorithm=est.algorithm, protocol=est.protocol.value)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=ROLES, action="append",
                        help="only these roles (default: all)")
    parser.add_argument("--profile", help="only points on this profile")
    args = parser.parse_args()
    roles = args.role or list(ROLES)
    points = [predict(r) for r in load_measurements()
              if r["role"] in roles and args.profile in (None, r["profile"])]
    header = (f"{'role':8} {'id':28} {'profile':14} {'kind':14} {'ranks':>9} {'size':>9} "
              f"{'measured':>9} {'predicted':>9} {'err':>7}  algorithm")
    for role in roles:
        group = [p for p in points if p.row["role"] == role]
        if not group:
            continue
        print(header)
        print("-" * len(header))
        for p in group:
            r = p.row
            unit = "us" if r["metric"] == "time_us" else "GB/s"
            ranks = f"{r['num_nodes']}x{r['ranks_per_node']}"
            print(f"{role:8} {r['id'][:28]:28} {r['profile']:14} {r['kind']:14} {ranks:>9} "
                  f"{_size(int(r['nbytes'])):>9} {p.measured:>7.1f}{unit[0]:>2} "
                  f"{p.predicted:>7.1f}{unit[0]:>2} {100 * (p.ratio - 1):+6.1f}%  "
                  f"{p.algorithm}/{p.protocol}")
        errs = sorted(abs(p.ratio - 1) for p in group)
        p90 = errs[min(len(errs) - 1, int(0.9 * len(errs)))]
        print(f"{role}: {len(group)} points, median |err| {100 * statistics.median(errs):.1f}%, "
              f"p90 {100 * p90:.1f}%, max {100 * errs[-1]:.1f}%  "
              f"(busbw in GB/s 'G', time in us 'u')\n")


if __name__ == "__main__":
    main()
