"""Fitting a hardware profile's fields to what `autopar calibrate` measured. Pure functions of
plain records and a profile document: no torch, no process group.

Collectives are fitted through the planner's own model (`costmodels.collectives.
estimate_on_layout`), so the fitted profile predicts the measurements with the very functions
`compile` calls. Every fit minimises the sum of squared log-ratios

    Σ_i ( log(predicted_i / measured_i) )²

over the fit sizes (held-out sizes never enter it), by Levenberg-Marquardt on the logarithms
of the fields (`least_squares`); for collectives the squares are softened beyond 10%
(soft-L1, `_ROBUST_SCALE`), so one size that runs another way does not pull the rest. Two
stages:

1. shared fields, jointly over every collective: the effective scale-up bandwidth
   (fabric_gb_per_s x fabric_efficiency) and the fabric hop latency (the protocol table
   scaled as a whole, keeping the base profile's LL/LL128/Simple ratios) from groups inside a
   node; the effective NIC bandwidth (nic_gbps x nic_efficiency) and the network hop latency
   from groups that span nodes; the call overhead from all. Start values come per regime:
   latencies scaled by the median measured/predicted ratio over the smallest quarter of the
   sizes, bandwidths by the median predicted/measured ratio over the largest quarter.
2. per-collective corrections: with the shared fields fixed, `latency_factor[kind]` and
   `bandwidth_factor[kind]` on that collective's fit sizes alone.

GEMMs: t = max((F + F_half) / R_dtype, bytes / memory bandwidth), one large-GEMM rate R per
dtype, read off its GEMMs of at least half its largest FLOPs (the plateau), and one
half-efficiency size F_half (the compute model's F / (F + F_half) ramp) by least squares with
the rates held, so that the smallest shapes tell the ramp without pulling the plateau. Memory bandwidth: the median copy rate (read + write).

The error of a fit is the median |predicted / measured - 1| over the sizes it saw; the error
on held-out sizes is reported apart.
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from autopar.calibrate.records import CollectivePoint, CopyPoint, GemmPoint
from costmodels.collectives import estimate_on_layout, group_layout
from costmodels.hardware import HardwareProfile

__all__ = ["least_squares", "Knob", "FittedValue", "CollectiveFit", "GemmFit",
           "collective_knobs", "predict_collectives", "fit_collectives", "fit_gemms",
           "gemm_time_s", "copy_bandwidth", "relative_error", "median_error"]

Doc = dict[str, Any]


def least_squares(residuals: Callable[[np.ndarray], np.ndarray], x0: Sequence[float],
                  lower: Sequence[float], upper: Sequence[float], *,
                  max_iter: int = 200) -> np.ndarray:
    """Levenberg-Marquardt: the x within [lower, upper] (box, by clipping) that minimises
    sum(residuals(x)**2), from x0, with a forward-difference Jacobian."""
    lo, hi = np.asarray(lower, float), np.asarray(upper, float)
    x = np.clip(np.asarray(x0, float), lo, hi)
    r = residuals(x)
    cost, damping = float(r @ r), 1e-3
    for _ in range(max_iter):
        jac = np.empty((r.size, x.size))
        for j in range(x.size):
            step = 1e-6 * max(1.0, abs(x[j]))
            probe = x.copy()
            probe[j] += step
            jac[:, j] = (residuals(probe) - r) / step
        gradient, normal = jac.T @ r, jac.T @ jac
        while damping < 1e12:
            shift = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12),
                                    -gradient)
            trial = np.clip(x + shift, lo, hi)
            r_trial = residuals(trial)
            trial_cost = float(r_trial @ r_trial)
            if trial_cost < cost:
                break
            damping *= 4.0
        else:
            return x  # no step lowers the cost: a minimum (of the box) is reached
        converged = cost - trial_cost <= 1e-12 * (1.0 + cost)
        x, r, cost, damping = trial, r_trial, trial_cost, max(damping / 3.0, 1e-9)
        if converged:
            break
    return x


def relative_error(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0


def median_error(pairs: Sequence[tuple[float, float]]) -> float:
    """Median |predicted / measured - 1| over (predicted, measured) pairs; nan when empty."""
    if not pairs:
        return math.nan
    return statistics.median(abs(relative_error(p, m)) for p, m in pairs)


# -- collectives ------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class Knob:
    """One fitted quantity and how it is written into a profile document (during the fit:
    a bandwidth goes into the line-rate field with efficiency 1.0, as only the product
    counts)."""

    name: str  # "fabric_bandwidth", "fabric_hop", "call_overhead", "nic_bandwidth",
    #            "network_hop", "latency_factor.<kind>", "bandwidth_factor.<kind>"
    lower: float
    upper: float

    def read(self, doc: Doc) -> float:
        node, net, coll = doc["node"], doc["network"], doc["collectives"]
        if self.name == "fabric_bandwidth":
            return node["fabric_gb_per_s"] * node["fabric_efficiency"]
        if self.name == "nic_bandwidth":
            return net["nic_gbps"] * net["nic_efficiency"]
        if self.name == "fabric_hop":
            return node["fabric_hop_latency_us"]["simple"]
        if self.name == "network_hop":
            return net["network_hop_latency_us"]["simple"]
        if self.name == "call_overhead":
            return coll["call_overhead_us"]
        table, _, kind = self.name.partition(".")
        return coll.get(table, {}).get(kind, 1.0)

    def write(self, doc: Doc, value: float) -> None:
        node, net, coll = doc["node"], doc["network"], doc["collectives"]
        if self.name == "fabric_bandwidth":
            node["fabric_gb_per_s"], node["fabric_efficiency"] = value, 1.0
        elif self.name == "nic_bandwidth":
            net["nic_gbps"], net["nic_efficiency"] = value, 1.0
        elif self.name == "fabric_hop":
            node["fabric_hop_latency_us"] = _scaled_hops(node["fabric_hop_latency_us"], value)
        elif self.name == "network_hop":
            net["network_hop_latency_us"] = _scaled_hops(net["network_hop_latency_us"], value)
        elif self.name == "call_overhead":
            coll["call_overhead_us"] = value
        else:
            table, _, kind = self.name.partition(".")
            coll[table] = {**coll.get(table, {}), kind: value}

    @property
    def is_latency(self) -> bool:
        return self.name in ("fabric_hop", "network_hop", "call_overhead")


def _scaled_hops(table: dict[str, float], simple_us: float) -> dict[str, float]:
    """The protocol table scaled so that Simple takes `simple_us` (the ratios kept)."""
    ref = table["simple"]
    if ref <= 0:
        return {proto: simple_us for proto in table}
    return {proto: value * simple_us / ref for proto, value in table.items()}


_BANDWIDTH = (1e-4, 1e6)  # GB/s (fabric) or Gb/s (NIC)
_LATENCY = (1e-3, 1e6)  # us
_FACTOR = (1e-3, 1e3)


def collective_knobs(doc: Doc, points: Sequence[CollectivePoint]) -> list[Knob]:
    """The shared fields the measured groups can tell: the fabric's where a group has two or
    more ranks on a node, the network's where one spans nodes; the call overhead always."""
    layouts = [_layout(doc, p) for p in points]
    knobs = []
    if any(lay.max_ranks_per_node > 1 for lay in layouts):
        knobs += [Knob(name="fabric_bandwidth", lower=_BANDWIDTH[0], upper=_BANDWIDTH[1]),
                  Knob(name="fabric_hop", lower=_LATENCY[0], upper=_LATENCY[1])]
    if any(lay.num_nodes > 1 for lay in layouts):
        knobs += [Knob(name="nic_bandwidth", lower=_BANDWIDTH[0], upper=_BANDWIDTH[1]),
                  Knob(name="network_hop", lower=_LATENCY[0], upper=_LATENCY[1])]
    if points:
        knobs.append(Knob(name="call_overhead", lower=_LATENCY[0], upper=_LATENCY[1]))
    return knobs


def _layout(doc: Doc, point: CollectivePoint):
    return group_layout(point.ranks, doc["node"]["gpus_per_node"],
                        doc["network"]["nodes_per_leaf"])


def predict_collectives(doc: Doc, points: Sequence[CollectivePoint]) -> list[float]:
    """Seconds the collective model gives each point under the profile document `doc`."""
    hw = HardwareProfile.from_document(doc)
    layouts: dict[tuple[int, ...], Any] = {}
    out = []
    for p in points:
        layout = layouts.get(p.ranks)
        if layout is None:
            layout = layouts[p.ranks] = group_layout(p.ranks, hw.node.gpus_per_node,
                                                     hw.network.nodes_per_leaf)
        out.append(estimate_on_layout(hw, p.kind, p.nbytes, layout).time_s)
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class FittedValue:
    name: str  # the knob's name
    value: float
    num_points: int  # fit sizes that inform it
    fit_error: float  # median |predicted / measured - 1| over them, with the fitted profile
    held_out_error: float  # the same over the held-out sizes of the same kind (nan if none)


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveFit:
    doc: Doc  # the base document with every fitted knob written in (fit representation)
    values: tuple[FittedValue, ...]
    predicted_s: tuple[float, ...]  # per point, with the fitted document
    fit_error: float
    held_out_error: float


# Scale of the soft-L1 loss on log-ratios: errors well under it count as squares, larger
# ones grow linearly, so a size that a library runs another way (gloo's one-element-per-rank
# all-reduce runs at half the latency of two) or a noisy spell does not pull the rest
_ROBUST_SCALE = 0.1


def _soft_l1(residuals: np.ndarray) -> np.ndarray:
    """Residuals whose sum of squares is the soft-L1 loss 2·s²·Σ(sqrt(1 + (r/s)²) - 1)."""
    s = _ROBUST_SCALE
    return np.sign(residuals) * s * np.sqrt(2.0 * (np.sqrt(1.0 + (residuals / s) ** 2) - 1.0))


def _fit_knobs(doc: Doc, knobs: Sequence[Knob], points: Sequence[CollectivePoint],
               start: Sequence[float]) -> Doc:
    """`doc` with `knobs` set to their least-squares values over `points`."""
    work = copy.deepcopy(doc)
    measured = np.log([p.time_s for p in points])

    def residuals(x: np.ndarray) -> np.ndarray:
        for knob, value in zip(knobs, np.exp(x)):
            knob.write(work, float(value))
        return _soft_l1(np.log(predict_collectives(work, points)) - measured)

    best = least_squares(residuals, np.log(start), np.log([k.lower for k in knobs]),
                         np.log([k.upper for k in knobs]))
    for knob, value in zip(knobs, np.exp(best)):
        knob.write(work, float(value))
    return work


def _regime_start(doc: Doc, knobs: Sequence[Knob], points: Sequence[CollectivePoint]
                  ) -> list[float]:
    """Base values with the latencies scaled to the smallest sizes and the bandwidths to the
    largest (a quarter of the size grid each), so the descent starts near the answer."""
    sizes = sorted({p.nbytes for p in points})
    quarter = max(1, len(sizes) // 4)
    small, large = set(sizes[:quarter]), set(sizes[-quarter:])
    predicted = predict_collectives(doc, points)
    lat_ratio = statistics.median(p.time_s / t for p, t in zip(points, predicted)
                                  if p.nbytes in small)
    bw_ratio = statistics.median(t / p.time_s for p, t in zip(points, predicted)
                                 if p.nbytes in large)
    floor_us = 1e-2 * min(p.time_s for p in points) * 1e6
    start = []
    for knob in knobs:
        value = knob.read(doc)
        if knob.is_latency:
            value = max(value, floor_us) * lat_ratio
        elif "bandwidth" in knob.name and "factor" not in knob.name:
            value *= bw_ratio
        start.append(min(max(value, knob.lower), knob.upper))
    return start


def fit_collectives(base: Doc, points: Sequence[CollectivePoint]) -> CollectiveFit:
    """Fit the shared collective fields, then each measured collective's corrections, to the
    fit points; `base` is the profile document the fit starts from (not modified)."""
    fit_points = [p for p in points if not p.held_out]
    if not fit_points:
        raise ValueError("no collective measurements to fit: the run measured no group of "
                         "two or more ranks (run on at least 2 ranks)")
    shared = collective_knobs(base, fit_points)
    doc = _fit_knobs(base, shared, fit_points, _regime_start(base, shared, fit_points))
    kinds = sorted({p.kind for p in fit_points})
    for kind in kinds:
        mine = [p for p in fit_points if p.kind == kind]
        pair = [Knob(name=f"latency_factor.{kind}", lower=_FACTOR[0], upper=_FACTOR[1]),
                Knob(name=f"bandwidth_factor.{kind}", lower=_FACTOR[0], upper=_FACTOR[1])]
        doc = _fit_knobs(doc, pair, mine, [1.0, 1.0])
    predicted = predict_collectives(doc, points)
    by_point = dict(zip(points, predicted))
    values = []
    for knob in shared + [Knob(name=f"{t}.{k}", lower=_FACTOR[0], upper=_FACTOR[1])
                          for k in kinds for t in ("latency_factor", "bandwidth_factor")]:
        informed = _informed(doc, knob, points)
        values.append(FittedValue(
            name=knob.name, value=knob.read(doc),
            num_points=sum(not p.held_out for p in informed),
            fit_error=median_error([(by_point[p], p.time_s) for p in informed if not p.held_out]),
            held_out_error=median_error([(by_point[p], p.time_s) for p in informed
                                         if p.held_out])))
    return CollectiveFit(
        doc=doc, values=tuple(values), predicted_s=tuple(predicted),
        fit_error=median_error([(t, p.time_s) for p, t in by_point.items() if not p.held_out]),
        held_out_error=median_error([(t, p.time_s) for p, t in by_point.items() if p.held_out]))


def _informed(doc: Doc, knob: Knob, points: Sequence[CollectivePoint]) -> list[CollectivePoint]:
    """The points whose fit sizes determine `knob` (and whose held-out sizes test it)."""
    if knob.name.startswith(("fabric_", "nic_", "network_")):
        want_nodes = knob.name.startswith(("nic_", "network_"))
        return [p for p in points
                if (_layout(doc, p).num_nodes > 1) == want_nodes
                and (want_nodes or _layout(doc, p).max_ranks_per_node > 1)]
    if "." in knob.name:
        return [p for p in points if p.kind == knob.name.partition(".")[2]]
    return list(points)


# -- compute ----------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class GemmFit:
    rate_flops: dict[str, float]  # large-GEMM FLOP/s per dtype
    half_flops: float | None  # F_half, or None where no GEMM measured was small enough
    fit_error: dict[str, float]  # per dtype, median |predicted / measured - 1|
    num_points: dict[str, int]


def gemm_time_s(point: GemmPoint, rate_flops: float, half_flops: float,
                memory_bytes_per_s: float) -> float:
    """The compute model's time for one GEMM at a microbenchmark's rate (the estimate
    multiplies long runs' GEMMs by costmodels.compute.sustained_fraction on top)."""
    return max((point.flops + half_flops) / rate_flops, point.nbytes / memory_bytes_per_s)


# F_half counts as measured when the fitted ramp slows the smallest GEMM by this much and
# removes this share of the error left by the fit that keeps the base's F_half; otherwise the
# GEMMs did not tell it, and the rates are those fitted with the base's value
_HALF_EFFECT = 0.1
_HALF_EXPLAINS = 0.5


def _plateau_rates(points: Sequence[GemmPoint], dtypes: list[str],
                   half_flops: float) -> np.ndarray:
    """Per dtype, the large-GEMM rate the GEMMs of at least half its largest FLOPs show: the
    median of (F + F_half) / t over them (the plateau a MAMF-style sweep reads)."""
    rates = []
    for d in dtypes:
        mine = [p for p in points if p.dtype == d]
        top = max(p.flops for p in mine)
        rates.append(statistics.median((p.flops + half_flops) / p.time_s
                                       for p in mine if p.flops >= top / 2))
    return np.array(rates)


def fit_gemms(points: Sequence[GemmPoint], memory_bytes_per_s: float,
              start_half_flops: float) -> GemmFit:
    """Per dtype the large-GEMM rate, read off its largest GEMMs, and one shared F_half fitted
    by least squares with those rates held (see the module docstring): the small shapes tell
    the ramp and do not pull the plateau. `start_half_flops` is the base profile's F_half,
    kept unless the GEMMs tell it."""
    dtypes = sorted({p.dtype for p in points})
    if not dtypes:
        raise ValueError("no GEMM measurements to fit")
    measured = np.log([p.time_s for p in points])
    index = [dtypes.index(p.dtype) for p in points]

    def residuals_at(rates: np.ndarray, half: float) -> np.ndarray:
        return np.log([gemm_time_s(p, float(rates[i]), half, memory_bytes_per_s)
                       for p, i in zip(points, index)]) - measured

    kept_rates = _plateau_rates(points, dtypes, start_half_flops)
    x = least_squares(lambda v: residuals_at(kept_rates, float(np.exp(v[0]))),
                      np.log([start_half_flops]), np.log([1.0]), np.log([1e15]))
    half = float(np.exp(x[0]))
    rates = _plateau_rates(points, dtypes, half)
    sse, sse_without = (float(r @ r) for r in (residuals_at(rates, half),
                                              residuals_at(kept_rates, start_half_flops)))
    smallest = min(p.flops for p in points)
    identified = (half / (smallest + half) >= _HALF_EFFECT
                  and sse <= (1.0 - _HALF_EXPLAINS) * sse_without)
    if not identified:
        rates, half = kept_rates, start_half_flops
    predicted = np.exp(residuals_at(rates, half) + measured)
    errors = {d: median_error([(t, p.time_s) for p, t in zip(points, predicted) if p.dtype == d])
              for d in dtypes}
    return GemmFit(rate_flops={d: float(r) for d, r in zip(dtypes, rates)},
                   half_flops=half if identified else None, fit_error=errors,
                   num_points={d: sum(p.dtype == d for p in points) for d in dtypes})


def copy_bandwidth(points: Sequence[CopyPoint]) -> float:
    """Median memory bandwidth of the copies, bytes/s, counting read and write."""
    if not points:
        raise ValueError("no copy measurements")
    return statistics.median(2.0 * p.nbytes / p.time_s for p in points)
