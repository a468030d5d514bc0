"""The cost model against one GPU's measurements: per-kind kernel time and peak memory of
training steps, and the measured constants they determine.

Reads a file written by benchmarks/gpu_calibrate.py (default: tests/data/h100_measurements.json,
one H100 SXM, 2026-11-22) and, for every training step of one precision in it (eager bf16, or
bf16 under torch.compile: the "fused" memory-bound ops), predicts the same step on a one-GPU
cluster of the profile: GEMM, attention, memory-bound (everything else) and optimizer time, then
prints measured / predicted per kind and for the whole step, and the peak bytes.

The steps ran for seconds at boost clocks; `SUSTAINED_COMPUTE_FRACTION` (hours-long runs at the
power limit, fitted on published runs) is divided out of the predicted compute here. The
harness's optimizer is fused AdamW and the master-to-model weight copy without gradient
clipping, so its predicted time leaves out the clipping norm. Its fp32 master-gradient casts
(6 bytes per parameter, a copy kernel that training software avoids by accumulating gradients
in fp32) are taken out of the measured memory-bound time and added to the predicted step at
the profile's bandwidth. The eager steps' loss is F.cross_entropy on fp32-upcast logits, the
compiled steps' the fused kernel torch.compile makes of it.

Run: python benchmarks/gpu_check.py [--file PATH] [--profile dgx-h100] [--precision compiled]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from autopar.estimate import EstimateOptions  # noqa: E402
from autopar.estimate.core import ModelCosts  # noqa: E402
from autopar.estimate.timing import op_times  # noqa: E402
from autopar.models import GPTConfig, build  # noqa: E402
from costmodels.compute import (MEMORY_OP_TRAFFIC_FACTOR, memory_time_s, optimizer_time_s,  # noqa: E402
                                sustained_fraction)

DEFAULT_FILE = ROOT / "tests" / "data" / "h100_measurements.json"
HARNESS_CAST_BYTES_PER_PARAM = 6.0  # bf16 gradient read, fp32 master gradient written
# the software each ran: its memory-bound kernels, and its loss (compiled: under torch.compile)
KERNELS_OF_PRECISION = {"bf16": "eager", "compiled": "fused"}


@dataclass(frozen=True)
class StepCheck:
    step_id: str
    measured: dict[str, float]   # seconds by kind, plus "step" and "peak_bytes"
    predicted: dict[str, float]  # the same keys


def _model(step: dict):
    if step["preset"] == "gpt":
        return build(GPTConfig(max_seq_len=step["seq_len"], **step["overrides"]))
    extra = {"max_seq_len": step["seq_len"]} if step["preset"].startswith("gpt") else {}
    return build(step["preset"], **step["overrides"], **extra)


def check_step(step: dict, cluster: autopar.Cluster, *, attention_kernel: str = "cudnn") -> StepCheck:
    """Measured and predicted seconds by kernel kind for one measured bf16 step."""
    device = cluster.hardware.device
    mb, seq, recompute = step["micro_batch"], step["seq_len"], step["recompute"]
    kernels = KERNELS_OF_PRECISION[step["precision"]]
    loss_kernel = kernels  # the EstimateOptions.loss_kernel of the same name
    model = _model(step)
    cfg = autopar.ParallelConfig(dp=1, tp=1, pp=1, zero_stage=0, micro_batch_size=mb,
                                 recompute=recompute)
    graph = autopar.trace(model, global_batch_size=mb, seq_len=seq, dtype="bf16")
    costs = ModelCosts.from_graph(graph)
    boost = 1.0 / sustained_fraction(device.arch)
    pred = {"gemm": 0.0, "attention": 0.0, "memory": 0.0, "loss": 0.0}
    for unit in costs.units_for(mb):
        rerun = 2 if recompute == "full" and unit.count > 1 else 1  # blocks re-run forward
        for op in unit.ops:
            fwd, bwd, _ = op_times(op, cluster, "bf16", cfg, attention_kernel, kernels,
                                   loss_kernel)
            scale = 1.0 if op.kind == "memory" else boost
            pred[op.kind] += unit.count * (rerun * fwd + bwd) / scale
            if op.logits:
                pred["loss"] += unit.count * (fwd + bwd)
    pred["optimizer"] = optimizer_time_s(device, step["params"], "bf16", grad_clip=False)
    est = autopar.estimate(graph, cluster, cfg, global_batch_size=mb, seq_len=seq, dtype="bf16",
                           options=EstimateOptions(attention_kernel=attention_kernel,
                                                   kernels=kernels, loss_kernel=loss_kernel))
    cast = memory_time_s(device, step["params"] * HARNESS_CAST_BYTES_PER_PARAM)
    replaced = sum(est.breakdown.get(term, 0.0) for term in ("compute", "recompute", "optimizer"))
    pred["step"] = (est.step_time_s - replaced + pred["gemm"] + pred["attention"] + pred["memory"]
                    + pred["optimizer"] + cast)
    pred["peak_bytes"] = est.tensor_memory_bytes
    k = step["kernel_s_by_kind"]
    meas = {"gemm": k.get("gemm", 0.0), "attention": k.get("attention", 0.0),
            "memory": k.get("other", 0.0) - cast, "optimizer": k.get("optimizer", 0.0),
            "step": step["step_s"], "peak_bytes": float(step["peak_allocated_bytes"])}
    return StepCheck(step_id=step["id"], measured=meas, predicted=pred)


def traffic_factor(check: StepCheck, factor: float) -> float:
    """The step's memory-bound time other than its cross-entropy (predicted per kernel pass,
    costmodels.compute.loss_traffic_bytes) over its ops' minimum traffic at the profile's
    bandwidth: what MEMORY_OP_TRAFFIC_FACTOR would be for this step alone."""
    loss = check.predicted["loss"]
    return (check.measured["memory"] - loss) / (check.predicted["memory"] - loss) * factor


def check_file(path: Path = DEFAULT_FILE, profile: str = "dgx-h100",
               precision: str = "bf16") -> list[StepCheck]:
    """The steps of one training precision: "bf16" (eager) or "compiled" (torch.compile)."""
    data = json.loads(Path(path).read_text())
    cluster = autopar.Cluster.from_profile(profile, num_nodes=1, gpus_per_node=1)
    return [check_step(s, cluster) for s in data["steps"] if s.get("precision") == precision]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=Path, default=DEFAULT_FILE)
    ap.add_argument("--profile", default="dgx-h100")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "compiled"),
                    help="eager bf16 steps, or the same under torch.compile (fused kernels)")
    args = ap.parse_args(argv)
    rows = check_file(args.file, args.profile, args.precision)
    kinds = ("gemm", "attention", "memory", "optimizer", "step")
    print(f"{'step':30s}" + "".join(f"{k:>22s}" for k in kinds) + f"{'peak GiB':>16s}")
    print(f"{'':30s}" + "".join(f"{'meas ms  pred  ratio':>22s}" for _ in kinds)
          + f"{'meas  pred':>16s}")
    for r in rows:
        line = f"{r.step_id:30s}"
        for k in kinds:
            m, p = r.measured[k] * 1e3, r.predicted[k] * 1e3
            line += f"{m:9.1f} {p:6.1f} {m / p:5.2f}"
        line += f"{r.measured['peak_bytes'] / 2**30:9.1f} {r.predicted['peak_bytes'] / 2**30:5.1f}"
        print(line)
    for k in kinds:
        ratios = [r.measured[k] / r.predicted[k] for r in rows]
        print(f"{k:10s} measured/predicted: median {statistics.median(ratios):.3f}, "
              f"range {min(ratios):.3f}-{max(ratios):.3f}")
    kernels = KERNELS_OF_PRECISION[args.precision]
    factor = MEMORY_OP_TRAFFIC_FACTOR[kernels]
    mem = [traffic_factor(r, factor) for r in rows]
    print(f"memory-bound time less the loss / minimum IR traffic at profile bandwidth: median "
          f"{statistics.median(mem):.2f}, range {min(mem):.2f}-{max(mem):.2f} "
          f"(MEMORY_OP_TRAFFIC_FACTOR[{kernels!r}] = {factor})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
