"""The profile `autopar calibrate` writes: the base profile's document with every measured
field replaced by its fitted value and cited as measured, every other number keeping the base's
citation with a note saying why it was not measured, and the TOML text of it.

How a fitted quantity becomes schema fields (only products enter the cost model, so the split
follows the schema's conventions):

- an effective bandwidth (scale-up, NIC) keeps the base's line rate and sets the efficiency to
  measured / line rate; where the measurement beats the line rate, or the fabric is the host
  (`fabric = "host"`, whose rate is itself a measurement), the measured rate becomes the rate
  and the efficiency 1.0;
- the large-GEMM rate of a dtype sets `gemm_efficiency` against the base's datasheet peak the
  same way; on CPUs (`arch = "cpu"`) the peak is the measured rate and the efficiency 1.0;
- the copy bandwidth sets `memory_efficiency` against the spec bandwidth (CPU: the bandwidth).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any

from autopar.calibrate.fit import (CollectiveFit, FittedValue, GemmFit, copy_bandwidth,
                                   fit_collectives, fit_gemms)
from autopar.calibrate.records import Measurements
from costmodels.compute import GEMM_HALF_EFFICIENCY_FLOPS
from hwprofiles.schema import FIELDS, SECTIONS, validate

__all__ = ["Fitted", "calibrate_profile", "build_profile", "profile_toml",
           "with_ranks_per_node"]

Doc = dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class Fitted:
    """What the fits found, for `build_profile`."""

    collectives: CollectiveFit | None
    gemms: GemmFit | None
    memory_bytes_per_s: float | None


def _sig(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def _pct(error: float) -> str:
    return "n/a" if math.isnan(error) else f"{100 * error:.1f}%"


def with_ranks_per_node(base: Doc, ranks_per_node: int) -> Doc:
    """The base document with the node holding the ranks calibrate ran per node."""
    doc = copy.deepcopy(base)
    doc["node"]["gpus_per_node"] = ranks_per_node
    return doc


def _expand_sources(doc: Doc) -> dict[str, str]:
    """The document's sources with every whole-table citation copied onto each key."""
    sources = dict(doc["sources"])
    for name, spec in FIELDS.items():
        path = f"{spec.section}.{name}"
        if spec.kind.endswith("_table") and path in sources and name in doc[spec.section]:
            text = sources.pop(path)
            for key in doc[spec.section][name]:
                sources.setdefault(f"{path}.{key}", text)
    return sources


class _Writer:
    """Sets fields of the output document and their citations."""

    def __init__(self, base: Doc, stamp: str) -> None:
        self.doc = copy.deepcopy(base)
        self.sources = _expand_sources(base)
        self.stamp = stamp  # "measured by autopar calibrate on DATE, N node(s) x G ranks"
        self.measured: set[str] = set()

    def set(self, path: str, value: Any, how: str) -> None:
        section, _, rest = path.partition(".")
        name, _, key = rest.partition(".")
        if key:
            self.doc[section].setdefault(name, {})[key] = value
        else:
            self.doc[section][name] = value
        for old in [k for k in self.sources if k == path or k.startswith(path + ".")]:
            del self.sources[old]
        self.sources[path] = f"{self.stamp}, {how}"
        self.measured.add(path)

    def keep(self, path_prefix: str, why: str) -> None:
        """Note on every base citation under `path_prefix` that it was not measured."""
        for key in sorted(self.sources):
            if (key == path_prefix or key.startswith(path_prefix + ".")) \
                    and key not in self.measured:
                self.sources[key] = f"not measured by autopar calibrate ({why}); from the " \
                                    f"base profile: {self.sources[key]}"
                self.measured.add(key)

    def finish(self, base_name: str) -> Doc:
        for key in sorted(self.sources):
            if key not in self.measured:
                self.sources[key] = (f"not measured by autopar calibrate; from the base "
                                     f"profile {base_name}: {self.sources[key]}")
        self.doc["sources"] = dict(sorted(self.sources.items()))
        return self.doc


def _error_text(value: FittedValue) -> str:
    return (f"fit error {_pct(value.fit_error)} (median |predicted/measured - 1| over the "
            f"{value.num_points} fitted sizes; held-out sizes {_pct(value.held_out_error)})")


def _split_rate(measured: float, line: float, *, host: bool) -> tuple[float, float]:
    """(rate field, efficiency field) for an effective rate `measured`."""
    if host or measured > line:
        return _sig(measured), 1.0
    return line, _sig(measured / line)


def _write_collectives(out: _Writer, fit: CollectiveFit, base: Doc) -> None:
    node, net = base["node"], base["network"]
    for value in fit.values:
        err = _error_text(value)
        if value.name == "fabric_bandwidth":
            rate, eff = _split_rate(value.value, node["fabric_gb_per_s"],
                                    host=node["fabric"] == "host")
            out.set("node.fabric_gb_per_s", rate, f"effective scale-up bus bandwidth "
                    f"{value.value:.4g} GB/s (rate x efficiency), {err}")
            out.set("node.fabric_efficiency", eff, f"effective bus bandwidth / "
                    f"fabric_gb_per_s, {err}")
        elif value.name == "nic_bandwidth":
            rate, eff = _split_rate(value.value, net["nic_gbps"], host=False)
            out.set("network.nic_gbps", rate, f"effective rate per NIC {value.value:.4g} Gb/s "
                    f"(line rate x efficiency), {err}")
            out.set("network.nic_efficiency", eff, f"effective rate / nic_gbps, {err}")
        elif value.name in ("fabric_hop", "network_hop"):
            section, field = (("node", "fabric_hop_latency_us") if value.name == "fabric_hop"
                              else ("network", "network_hop_latency_us"))
            table = fit.doc[section][field]
            for proto in sorted(table):
                out.set(f"{section}.{field}.{proto}", _sig(table[proto]),
                        f"hop latency, the base's LL/LL128/Simple ratios kept, {err}")
        elif value.name == "call_overhead":  # the fit's floor of 0.001 us means none
            out.set("collectives.call_overhead_us", _sig(value.value) if value.value >= 0.01
                    else 0.0, f"per-call cost beyond the hop latencies, {err}")
        else:
            table, _, kind = value.name.partition(".")
            out.set(f"collectives.{table}.{kind}", _sig(value.value),
                    f"{kind}'s correction to the shared fields, {err}")


def _write_compute(out: _Writer, fitted: Fitted, run: Measurements, base: Doc) -> None:
    dev = base["device"]
    cpu = dev["arch"] == "cpu"
    if fitted.memory_bytes_per_s is not None:
        rate = fitted.memory_bytes_per_s / 1e9
        how = (f"copy of {run.copies[0].nbytes >> 20} MiB (read + write) on every rank at "
               f"once, median {rate:.4g} GB/s")
        bw, eff = _split_rate(rate, dev["memory_bandwidth_gb_per_s"], host=cpu)
        out.set("device.memory_bandwidth_gb_per_s", bw, how)
        out.set("device.memory_efficiency", eff, how)
    if fitted.gemms is not None:
        gemm = fitted.gemms
        for dtype, rate in sorted(gemm.rate_flops.items()):
            how = (f"large-GEMM rate {rate / 1e12:.4g} TFLOP/s fitted to "
                   f"{gemm.num_points[dtype]} transformer-shaped torch.matmul timings on every "
                   f"rank at once, fit error {_pct(gemm.fit_error[dtype])}")
            peak, eff = _split_rate(rate / 1e12, dev["peak_tflops"][dtype], host=cpu)
            out.set(f"device.peak_tflops.{dtype}", peak, how)
            out.set(f"device.gemm_efficiency.{dtype}", eff, how)
        if gemm.half_flops is not None:
            out.set("device.gemm_half_efficiency_gflop", _sig(gemm.half_flops / 1e9),
                    "GEMM size at half the large-GEMM rate, fitted jointly with the rates")
        out.keep("device.gemm_half_efficiency_gflop", "every GEMM measured is large enough "
                 "to run at its full rate")
    if run.memory_bytes is not None:
        out.set("device.device_memory_gb", _sig(run.memory_bytes / 1e9), run.memory_how)
    if run.op_overhead_s is not None:
        out.set("device.op_overhead_us", _sig(run.op_overhead_s * 1e6), "eager forward "
                "cost of one tiny autograd op (a chain of 200 one-element multiplies), median")
    out.keep("device.peak_tflops", "dtype not measured")
    out.keep("device.gemm_efficiency", "dtype not measured")


def build_profile(base: Doc, base_name: str, run: Measurements, fitted: Fitted, *,
                  name: str) -> Doc:
    """The calibrated profile document (validated)."""
    where = (f"{run.num_nodes} node{'s' if run.num_nodes > 1 else ''} x {run.ranks_per_node} "
             f"ranks")
    stamp = (f"measured by autopar calibrate on {run.date}, {where} ({run.backend}, "
             f"{run.device_name}, torch {run.torch_version})")
    base = with_ranks_per_node(base, run.ranks_per_node)
    out = _Writer(base, stamp)
    out.set("node.gpus_per_node", run.ranks_per_node, "the ranks torchrun ran on each node")
    if fitted.collectives is not None:
        _write_collectives(out, fitted.collectives, base)
    _write_compute(out, fitted, run, base)
    if run.num_nodes == 1:
        out.keep("network", "one node: no network to measure")
    out.keep("collectives.net_overhead_us", "folded into the fitted hop latencies")
    out.keep("network.nodes_per_leaf", "topology, not a timing")
    out.keep("network.oversubscription", "topology, not a timing")
    doc = out.finish(base_name)
    doc["name"] = name
    doc["description"] = (f"{name}: measured by autopar calibrate on {run.date}, {where} "
                          f"({run.backend}, {run.device_name}); other numbers from {base_name}")
    return validate(doc, origin=f"calibrated profile {name!r}")


def calibrate_profile(base: Doc, base_name: str, run: Measurements, *, name: str) -> Doc:
    """Fit every measured part of `run` (`autopar.calibrate.fit`) and build the profile."""
    start = with_ranks_per_node(base, run.ranks_per_node)
    dev = start["device"]
    memory = copy_bandwidth(run.copies) if run.copies else None
    gemms = None
    if run.gemms:
        bandwidth = memory or dev["memory_bandwidth_gb_per_s"] * dev["memory_efficiency"] * 1e9
        half = dev.get("gemm_half_efficiency_gflop", GEMM_HALF_EFFICIENCY_FLOPS / 1e9) * 1e9
        gemms = fit_gemms(run.gemms, bandwidth, half)
    fitted = Fitted(collectives=fit_collectives(start, run.collectives) if run.collectives
                    else None, gemms=gemms, memory_bytes_per_s=memory)
    return build_profile(base, base_name, run, fitted, name=name)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def profile_toml(doc: Doc, header: str) -> str:
    """The profile as TOML in the shipped files' layout; `header` becomes the top comment."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += [f"schema_version = {doc['schema_version']}", f"name = {_toml_value(doc['name'])}",
              f"description = {_toml_value(doc['description'])}"]
    for section in SECTIONS:
        lines += ["", f"[{section}]"]
        order = [n for n, spec in FIELDS.items() if spec.section == section]
        lines += [f"{name} = {_toml_value(doc[section][name])}" for name in order
                  if name in doc[section]]
    lines += ["", "[sources]"]
    lines += [f"{json.dumps(key)} = {_toml_value(text)}" for key, text in doc["sources"].items()]
    return "\n".join(lines) + "\n"
