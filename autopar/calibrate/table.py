"""The measured-against-predicted table of a calibration: one row per collective, group and
size (and per GEMM shape, copy and attention shape), with the measurement's relative standard
error (collectives), the base profile's prediction and the calibrated profile's, their errors,
and whether the fit saw the row ("fit"), held it back ("held-out") or only reports it
("report": attention has no profile field). Rendered as text (printed and stored) and as CSV.
"""

from __future__ import annotations

import csv
import io
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from autopar.calibrate.fit import gemm_time_s, predict_collectives
from autopar.calibrate.records import Measurements
from costmodels import compute
from costmodels.hardware import HardwareProfile

__all__ = ["Row", "table_rows", "render_table", "table_csv", "summary_lines"]

Doc = dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    what: str  # "all_reduce", ..., "gemm bf16", "copy", "attention bf16"
    group: str  # "intra x4", "inter x2", "world x16"; a GEMM's "m x k x n"; "" otherwise
    size: float  # bytes (collectives, copy) or FLOP (GEMM, attention)
    unit: str  # "B" or "FLOP"
    measured_s: float
    base_s: float
    fitted_s: float
    role: str  # "fit", "held-out" or "report"
    measured_rse: float = 0.0  # relative standard error of the measurement (0: not known)

    @property
    def base_error(self) -> float:
        return self.base_s / self.measured_s - 1.0

    @property
    def fitted_error(self) -> float:
        return self.fitted_s / self.measured_s - 1.0


def _gemm_params(hw: HardwareProfile, dtype: str) -> tuple[float, float, float]:
    dev = hw.device
    return (dev.peak_flops[dtype] * dev.gemm_efficiency[dtype],
            dev.gemm_half_efficiency_flops or compute.GEMM_HALF_EFFICIENCY_FLOPS,
            dev.memory_bandwidth_bytes_per_s * dev.memory_efficiency)


def _attention_s(hw: HardwareProfile, batch: int, heads: int, seq: int, dim: int,
                 causal: bool) -> float:
    """The compute model's fused (flash) attention forward, at a microbenchmark's rate."""
    t = compute.attention_time_s(hw.device, "bf16", compute.AttentionCall(
        flops=4.0 * batch * heads * seq * seq * dim, io_bytes=4.0 * batch * heads * seq * dim * 2,
        score_bytes=2.0 * batch * heads * seq * seq, causal=causal, seq_kv=seq),
        kernel="flash", backward=False)
    return t * compute.sustained_fraction(hw.device.arch)


def table_rows(run: Measurements, base: Doc, fitted: Doc) -> list[Row]:
    """Every measurement with both profiles' predictions (`base` already holds the ranks per
    node that ran)."""
    rows = []
    points = list(run.collectives)
    for p, b, f in zip(points, predict_collectives(base, points),
                       predict_collectives(fitted, points)):
        rows.append(Row(what=p.kind, group=f"{p.group} x{len(p.ranks)}", size=p.nbytes, unit="B",
                        measured_s=p.time_s, base_s=b, fitted_s=f,
                        role="held-out" if p.held_out else "fit", measured_rse=p.rse))
    hw_base, hw_fit = HardwareProfile.from_document(base), HardwareProfile.from_document(fitted)
    for g in run.gemms:
        rows.append(Row(what=f"gemm {g.dtype}", group=f"{g.m}x{g.k}x{g.n}", size=g.flops,
                        unit="FLOP", measured_s=g.time_s,
                        base_s=gemm_time_s(g, *_gemm_params(hw_base, g.dtype)),
                        fitted_s=gemm_time_s(g, *_gemm_params(hw_fit, g.dtype)), role="fit"))
    for c in run.copies:
        rows.append(Row(what="copy", group="", size=c.nbytes, unit="B", measured_s=c.time_s,
                        base_s=compute.memory_time_s(hw_base.device, 2 * c.nbytes),
                        fitted_s=compute.memory_time_s(hw_fit.device, 2 * c.nbytes), role="fit"))
    for a in run.attention:
        shape = (a.batch, a.heads, a.seq_len, a.head_dim, a.causal)
        rows.append(Row(what="attention bf16", group=f"b{a.batch} h{a.heads} s{a.seq_len} "
                        f"d{a.head_dim}", size=4.0 * a.batch * a.heads * a.seq_len**2
                        * a.head_dim, unit="FLOP", measured_s=a.time_s,
                        base_s=_attention_s(hw_base, *shape),
                        fitted_s=_attention_s(hw_fit, *shape), role="report"))
    return rows


def _size(value: float, unit: str) -> str:
    if unit == "FLOP":
        for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if value >= scale:
                return f"{value / scale:.3g} {prefix}FLOP"
        return f"{value:.0f} FLOP"
    for shift, prefix in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if value >= 1 << shift:
            return f"{value / (1 << shift):.4g} {prefix}"
    return f"{value:.0f} B"


def _time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"


def _pct(error: float) -> str:
    return f"{100 * error:+.1f}%"


_HEAD = ("what", "group", "size", "measured", "+-", "base", "base err", "fitted",
         "fitted err", "role")


def render_table(rows: Sequence[Row]) -> str:
    """The rows as an aligned text table ("+-": the measurement's relative standard error)."""
    body = [(r.what, r.group, _size(r.size, r.unit), _time(r.measured_s),
             f"{100 * r.measured_rse:.0f}%" if r.measured_rse else "", _time(r.base_s),
             _pct(r.base_error), _time(r.fitted_s), _pct(r.fitted_error), r.role) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(_HEAD, *body)]
    left = {0, 1, 9}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(_HEAD), line(["-" * w for w in widths])] + [line(b) for b in body])


def summary_lines(rows: Sequence[Row]) -> list[str]:
    """Median and largest |error| of the base and the calibrated profile, per collective and
    role, and over every collective's held-out sizes."""
    out = []
    kinds = sorted({r.what for r in rows if r.unit == "B" and r.what != "copy"})
    for role in ("fit", "held-out"):
        for kind in kinds + ["all collectives"]:
            mine = [r for r in rows if r.role == role and r.what != "copy" and r.unit == "B"
                    and (kind == "all collectives" or r.what == kind)]
            if not mine:
                continue
            base = [abs(r.base_error) for r in mine]
            fit = [abs(r.fitted_error) for r in mine]
            out.append(f"{role:>8} {kind:<16} {len(mine):>3} sizes: base profile median "
                       f"{100 * statistics.median(base):.1f}% (max {100 * max(base):.1f}%), "
                       f"calibrated median {100 * statistics.median(fit):.1f}% "
                       f"(max {100 * max(fit):.1f}%)")
    return out


def table_csv(rows: Sequence[Row]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["what", "group", "size", "unit", "measured_s", "measured_rse", "base_s",
                     "base_error", "fitted_s", "fitted_error", "role"])
    for r in rows:
        writer.writerow([r.what, r.group, f"{r.size:.6g}", r.unit, f"{r.measured_s:.6g}",
                         f"{r.measured_rse:.4f}", f"{r.base_s:.6g}", f"{r.base_error:.4f}",
                         f"{r.fitted_s:.6g}", f"{r.fitted_error:.4f}", r.role])
    return buf.getvalue()
