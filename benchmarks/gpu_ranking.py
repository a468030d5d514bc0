"""Is autopar.compile's choice of micro-batch size and recompute on one GPU the measured-fastest?

Reads the ``ranking`` section of a file written by benchmarks/gpu_calibrate.py (default:
tests/data/h100_measurements.json, one H100 SXM, 2026-11-25): for a few one-GPU training
problems, every candidate -- micro-batch size mb dividing the global batch B, recompute none
and full -- timed as a whole step of the global batch (B/mb micro-batches with gradient
accumulation, one fused-AdamW step; bf16 weights, fp32 masters) or marked out of memory.
For each problem it

- predicts every candidate with autopar.estimate on a one-GPU cluster of the profile, with the
  options of benchmarks/gpu_check.py's eager bf16 harness (cuDNN attention, eager kernels and
  loss). The steps ran for seconds at boost clocks, so the predicted column divides
  `SUSTAINED_COMPUTE_FRACTION` out of the GEMM and attention time as gpu_check does (the
  estimate evaluated with the fraction set to 1), and, like gpu_check, it costs the harness's
  optimizer (fused AdamW and the master copy, no clipping norm) and its fp32 master-gradient
  cast (6 bytes per parameter at the profile's bandwidth); it also adds the harness's
  gradient accumulation, which training software fuses into the weight-gradient GEMMs: for
  every micro-batch after the first, autograd's ``grad += new`` over the bf16 gradients (6
  bytes per parameter). The "est" column is the estimate as compile ranks it (sustained
  clocks, no harness terms);
- runs autopar.compile on the same problem with dp, tp, pp and cp pinned to 1 (so only the
  micro-batch size and recompute vary; "selective" recompute is no candidate for these models'
  fused attention) and reports its pick;
- prints each candidate's measured and predicted step time and peak memory, which fit, the
  measured rank of compile's pick and its time over the measured best, and the rank
  correlations (Spearman's rho, Kendall's tau-b) of predicted and measured step time over
  the candidates that ran.

Run: python benchmarks/gpu_ranking.py [--file PATH] [--profile dgx-h100]
Measure (on a GPU): python benchmarks/gpu_calibrate.py --out DIR --sections ranking
"""

from __future__ import annotations

import argparse
import contextlib
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
from autopar.estimate.core import ModelCosts, evaluate  # noqa: E402
from autopar import SearchSettings  # noqa: E402
from costmodels import compute as _compute  # noqa: E402
from costmodels.compute import memory_time_s, optimizer_time_s  # noqa: E402

from benchmarks.gpu_check import DEFAULT_FILE, HARNESS_CAST_BYTES_PER_PARAM, _model  # noqa: E402

# gpu_check's eager bf16 harness: SDPA on cuDNN, eager memory-bound kernels and loss
OPTIONS = EstimateOptions(attention_kernel="cudnn", kernels="eager", loss_kernel="eager")
CONSTRAINTS = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "zero_stage": 0}
HARNESS_ACCUMULATE_BYTES_PER_PARAM = 6.0  # bf16 .grad += new: two reads and a write


@dataclass(frozen=True)
class Candidate:
    micro_batch: int
    recompute: str
    measured_s: float | None     # None: out of memory (or failed)
    oom: bool
    measured_peak_bytes: float   # at an OOM: the peak allocated before it
    predicted_s: float           # at boost clocks, with the harness's terms
    estimate_s: float            # the estimate compile ranks (sustained clocks)
    predicted_peak_bytes: float  # the estimate's tensors (what the allocator's peak measures)
    predicted_fits: bool         # the estimate's peak (context, buffers, reserve) within usable

    @property
    def key(self) -> tuple[int, str]:
        return (self.micro_batch, self.recompute)

    @property
    def ran(self) -> bool:
        return self.measured_s is not None


@dataclass(frozen=True)
class ProblemCheck:
    problem: str
    seq_len: int
    global_batch: int
    params: int
    candidates: tuple[Candidate, ...]
    pick: tuple[int, str]        # compile's (micro-batch size, recompute)

    def ran(self) -> list[Candidate]:
        """The candidates that ran, measured-fastest first."""
        return sorted((c for c in self.candidates if c.ran), key=lambda c: c.measured_s)

    def candidate(self, key: tuple[int, str]) -> Candidate:
        return next(c for c in self.candidates if c.key == key)

    @property
    def best(self) -> Candidate:
        return self.ran()[0]

    @property
    def pick_rank(self) -> int | None:
        """1 for the measured-fastest; None if compile's pick did not run (out of memory)."""
        keys = [c.key for c in self.ran()]
        return keys.index(self.pick) + 1 if self.pick in keys else None

    @property
    def pick_over_best(self) -> float | None:
        pick = self.candidate(self.pick)
        return pick.measured_s / self.best.measured_s if pick.ran else None

    def correlations(self, attr: str = "predicted_s") -> tuple[float, float]:
        """(Spearman's rho, Kendall's tau-b) of `attr` against the measured step time over
        the candidates that ran."""
        ran = self.ran()
        return (spearman([getattr(c, attr) for c in ran], [c.measured_s for c in ran]),
                kendall([getattr(c, attr) for c in ran], [c.measured_s for c in ran]))


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1  # ties share their average rank
        i = j + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float:
    """Pearson's correlation of the ranks (ties averaged)."""
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def kendall(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b: concordant minus discordant pairs over the pairs untied in each."""
    conc = disc = tx = ty = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif (dx > 0) == (dy > 0):
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + tx) * (conc + disc + ty)) ** 0.5
    return (conc - disc) / denom if denom else float("nan")


@contextlib.contextmanager
def boost_clocks(arch: str):
    """GEMM and attention at the short run's boost clocks: the sustained fraction set to 1."""
    table = _compute.SUSTAINED_COMPUTE_FRACTION
    had, old = arch in table, table.get(arch)
    table[arch] = 1.0
    try:
        yield
    finally:
        if had:
            table[arch] = old
        else:
            del table[arch]


def check_problem(rows: list[dict], cluster: autopar.Cluster) -> ProblemCheck:
    """Predictions and compile's pick for one measured problem's candidate rows."""
    first = rows[0]
    batch, seq = first["global_batch"], first["seq_len"]
    device = cluster.hardware.device
    model = _model(first)
    params = sum(p.numel() for p in model.parameters())
    costs = ModelCosts.from_graph(autopar.trace(model, global_batch_size=1, seq_len=seq,
                                                dtype="bf16"))
    cast = memory_time_s(device, params * HARNESS_CAST_BYTES_PER_PARAM)
    optimizer = optimizer_time_s(device, params, "bf16", grad_clip=False)
    candidates = []
    for row in sorted(rows, key=lambda r: (r["micro_batch"], r["recompute"] != "none")):
        mb, recompute = row["micro_batch"], row["recompute"]
        cfg = autopar.ParallelConfig(dp=1, tp=1, pp=1, cp=1, zero_stage=0,
                                     micro_batch_size=mb, recompute=recompute)
        est = evaluate(costs, cluster, cfg, global_batch_size=batch, dtype="bf16",
                       options=OPTIONS)
        with boost_clocks(device.arch):
            boost = evaluate(costs, cluster, cfg, global_batch_size=batch, dtype="bf16",
                             options=OPTIONS)
        accumulate = (batch // mb - 1) * memory_time_s(
            device, params * HARNESS_ACCUMULATE_BYTES_PER_PARAM)
        predicted = (boost.step_time_s - boost.breakdown["optimizer"] + optimizer + cast
                     + accumulate)
        candidates.append(Candidate(
            micro_batch=mb, recompute=recompute,
            measured_s=row.get("step_s"), oom=bool(row.get("oom")),
            measured_peak_bytes=float(row.get("peak_allocated_bytes", 0)),
            predicted_s=predicted, estimate_s=est.step_time_s,
            predicted_peak_bytes=est.tensor_memory_bytes, predicted_fits=est.fits))
    plan = autopar.compile(model, cluster, global_batch_size=batch, seq_len=seq, dtype="bf16",
                           constraints=CONSTRAINTS, options=OPTIONS,
                           settings=SearchSettings(progress=False))
    pick = (plan.config.micro_batch_size, plan.config.recompute)
    return ProblemCheck(problem=first["problem"], seq_len=seq, global_batch=batch,
                        params=params, candidates=tuple(candidates), pick=pick)


def check_file(path: Path = DEFAULT_FILE, profile: str = "dgx-h100") -> list[ProblemCheck]:
    data = json.loads(Path(path).read_text())
    cluster = autopar.Cluster.from_profile(profile, num_nodes=1, gpus_per_node=1)
    problems: dict[str, list[dict]] = {}
    for row in data["ranking"]:
        problems.setdefault(row["problem"], []).append(row)
    return [check_problem(rows, cluster) for rows in problems.values()]


def _gib(b: float) -> str:
    return f"{b / 2**30:5.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=Path, default=DEFAULT_FILE)
    ap.add_argument("--profile", default="dgx-h100")
    args = ap.parse_args(argv)
    checks = check_file(args.file, args.profile)
    print("meas/pred ms: measured step of the global batch / predicted (boost clocks, harness "
          "terms); est ms: the estimate compile ranks;\nmeas GiB: peak allocated (OOM: reached "
          "before the error); pred GiB: the estimate's tensors; fits and rank (among those that "
          "ran): measured/predicted")
    ratios = []
    for p in checks:
        ran = p.ran()
        rank = {c.key: i + 1 for i, c in enumerate(ran)}
        pred_rank = {c.key: i + 1 for i, c in
                     enumerate(sorted(ran, key=lambda c: c.predicted_s))}
        print(f"\n{p.problem}: {p.params / 1e9:.2f} B parameters, seq {p.seq_len}, global "
              f"batch {p.global_batch}")
        print(f"  {'mb':>3s} {'recompute':9s} {'meas ms':>8s} {'pred ms':>8s} {'ratio':>6s} "
              f"{'est ms':>8s} {'meas GiB':>8s} {'pred GiB':>8s}  {'fits m/p':8s} "
              f"{'rank m/p':8s}")
        for c in p.candidates:
            meas = f"{c.measured_s * 1e3:8.1f}" if c.ran else f"{'OOM' if c.oom else 'error':>8s}"
            ratio = f"{c.measured_s / c.predicted_s:6.3f}" if c.ran else f"{'':6s}"
            if c.ran:
                ratios.append(c.measured_s / c.predicted_s)
            fits = f"{'yes' if c.ran else 'no':>3s}/{'yes' if c.predicted_fits else 'no':3s}"
            ranks = f"{rank[c.key]}/{pred_rank[c.key]}" if c.ran else ""
            mark = "  <- compile" if c.key == p.pick else ""
            print(f"  {c.micro_batch:3d} {c.recompute:9s} {meas} {c.predicted_s * 1e3:8.1f} "
                  f"{ratio} {c.estimate_s * 1e3:8.1f} {_gib(c.measured_peak_bytes):>8s} "
                  f"{_gib(c.predicted_peak_bytes):>8s}  {fits:8s} {ranks:8s}{mark}")
        best = p.best
        pick = p.candidate(p.pick)
        rho, tau = p.correlations()
        if pick.ran:
            verdict = (f"measured rank {p.pick_rank} of {len(ran)}, {p.pick_over_best:.3f}x the "
                       f"measured best (mb {best.micro_batch} {best.recompute}, "
                       f"{best.measured_s * 1e3:.1f} ms)")
        else:
            verdict = "out of memory when measured"
        print(f"  compile picks mb {p.pick[0]} recompute {p.pick[1]}: {verdict}")
        print(f"  predicted vs measured over the {len(ran)} that ran: Spearman {rho:.3f}, "
              f"Kendall tau-b {tau:.3f}")
        wrong = [c for c in p.candidates if c.ran != c.predicted_fits]
        print("  fits: " + ("as predicted for every candidate" if not wrong else "; ".join(
            f"mb {c.micro_batch} {c.recompute} {'ran' if c.ran else 'OOM'} (predicted "
            f"{'fit' if c.predicted_fits else 'no fit'}, tensors {_gib(c.predicted_peak_bytes)} "
            f"GiB)" for c in wrong)))
    if ratios:
        print(f"\nmeasured/predicted step, every candidate that ran: median "
              f"{statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
