"""The hardware-profile schema: which fields a profile has, their types, units and limits.

One table (`FIELDS`) declares every field; `validate` checks a parsed TOML document against it
and raises `ValueError` naming the origin (file), the field and what is allowed. Units are in
the field names: `_gb` = 1e9 bytes, `_gb_per_s` = 1e9 bytes/s per direction, `_gbps` = 1e9
bits/s (NIC line rate, as vendors quote it), `_us` = microseconds, `_tflops` = 1e12 FLOP/s dense.
hwprofiles/README.md documents the same fields for people.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FIELDS", "SECTIONS", "DTYPES", "PROTOCOLS", "COLLECTIVES", "FieldSpec", "validate",
           "overridable_fields"]

SCHEMA_VERSION = 1
SECTIONS = ("device", "node", "network", "collectives")
DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8")
PROTOCOLS = ("ll", "ll128", "simple")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
_TABLE_KEYS = {"dtype_table": DTYPES, "protocol_table": PROTOCOLS, "collective_table": COLLECTIVES}


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldSpec:
    section: str
    kind: str  # "str", "int", "float", "bool", "dtype_table", "protocol_table", "collective_table"
    doc: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None  # inclusive lower bound
    maximum: float | None = None  # inclusive upper bound
    positive: bool = False  # strictly > 0
    optional: bool = False  # may be left out; the cost model then uses its documented default


def _f(section: str, kind: str, doc: str, **kw: Any) -> FieldSpec:
    return FieldSpec(section=section, kind=kind, doc=doc, **kw)


FIELDS: dict[str, FieldSpec] = {
    # -- device ---------------------------------------------------------------------------------
    "model": _f("device", "str", "accelerator model, e.g. 'NVIDIA H100 SXM5 80GB'"),
    "arch": _f("device", "str", "architecture family; selects NCCL-model constants",
               choices=("volta", "ampere", "hopper", "blackwell", "cdna3", "cpu")),
    "device_memory_gb": _f("device", "float", "device memory, GB (1e9 B)", positive=True),
    "memory_bandwidth_gb_per_s": _f("device", "float", "device memory bandwidth (spec), GB/s",
                                    positive=True),
    "memory_efficiency": _f("device", "float", "achievable fraction of memory bandwidth for "
                            "streaming kernels", positive=True, maximum=1.0),
    "peak_tflops": _f("device", "dtype_table", "dense peak per dtype, TFLOP/s; a dtype that is "
                      "absent is not supported by the device", positive=True),
    "gemm_efficiency": _f("device", "dtype_table", "achievable fraction of peak for large "
                          "GEMMs, per dtype (same keys as peak_tflops)", positive=True,
                          maximum=1.0),
    "gemm_half_efficiency_gflop": _f("device", "float", "GEMM size (GFLOP) at which a GEMM "
                                     "reaches half the large-GEMM rate (optional; default "
                                     "costmodels.compute.GEMM_HALF_EFFICIENCY_FLOPS)",
                                     positive=True, optional=True),
    "op_overhead_us": _f("device", "float", "time each launched op costs besides its work: the "
                         "gap between dependent kernels on a GPU, eager dispatch on a CPU, us "
                         "(optional; default costmodels.compute.KERNEL_GAP_S)", minimum=0.0,
                         optional=True),
    # -- node (scale-up domain) -----------------------------------------------------------------
    "gpus_per_node": _f("node", "int", "devices in one scale-up domain (NVLink/xGMI/PCIe "
                        "island); global rank r lives on node r // gpus_per_node", minimum=1),
    "fabric": _f("node", "str", "scale-up fabric kind",
                 choices=("nvswitch", "nvlink_mesh", "xgmi", "pcie", "host")),
    "fabric_gb_per_s": _f("node", "float", "scale-up bandwidth per device, per direction, "
                          "line rate, GB/s", positive=True),
    "fabric_links_per_device": _f("node", "int", "scale-up links per device (a full-mesh "
                                  "fabric reaches each peer over fabric_links/(peers) of them)",
                                  minimum=1),
    "fabric_efficiency": _f("node", "float", "achievable fraction of the scale-up line rate "
                            "for collective traffic", positive=True, maximum=1.0),
    "fabric_hop_latency_us": _f("node", "protocol_table", "per-step latency on the scale-up "
                                "fabric, per NCCL protocol, us", minimum=0.0),
    "in_switch_reduction": _f("node", "bool", "the scale-up switch reduces in-network "
                              "(NVLink SHARP / NVLS)"),
    # -- network (scale-out) --------------------------------------------------------------------
    "network_kind": _f("network", "str", "scale-out fabric kind",
                       choices=("infiniband", "roce", "efa", "ethernet", "none")),
    "nics_per_node": _f("network", "int", "compute NICs per node (0 only with network_kind "
                        "'none')", minimum=0),
    "nic_gbps": _f("network", "float", "line rate per NIC, Gb/s (1e9 bits)", positive=True),
    "nic_efficiency": _f("network", "float", "achievable fraction of NIC line rate for NCCL "
                         "traffic", positive=True, maximum=1.0),
    "network_hop_latency_us": _f("network", "protocol_table", "per-step latency of an "
                                 "inter-node hop, per NCCL protocol, us", minimum=0.0),
    "network_topology": _f("network", "str", "scale-out topology",
                           choices=("rail-optimized-fat-tree", "fat-tree", "single-switch",
                                    "none")),
    "nodes_per_leaf": _f("network", "int", "nodes under one leaf group (scalable unit); "
                         "traffic between leaf groups crosses the spine", minimum=1),
    "oversubscription": _f("network", "float", "leaf-to-spine oversubscription ratio "
                           "(1.0 = non-blocking)", minimum=1.0),
    "in_network_reduction": _f("network", "bool", "switches reduce in-network (IB SHARP)"),
    # -- collectives ----------------------------------------------------------------------------
    "library": _f("collectives", "str", "collective library the cost model imitates",
                  choices=("nccl", "rccl", "gloo")),
    "net_overhead_us": _f("collectives", "float", "host-side overhead per inter-node step "
                          "(NCCL netOverhead: 1 us Intel hosts, 2 us AMD hosts)", minimum=0.0),
    "call_overhead_us": _f("collectives", "float", "fixed cost per collective call beyond the "
                           "library's own base latency (launch, proxy), us", minimum=0.0),
    "latency_factor": _f("collectives", "collective_table", "per-collective multiplier of the "
                         "modelled latency, call overhead included, as measured by autopar "
                         "calibrate (optional; a collective that is absent gets 1.0)",
                         positive=True, optional=True),
    "bandwidth_factor": _f("collectives", "collective_table", "per-collective multiplier of the "
                           "modelled bus bandwidth, as measured by autopar calibrate (optional; "
                           "a collective that is absent gets 1.0)", positive=True, optional=True),
}


def overridable_fields() -> tuple[str, ...]:
    """Field names a caller may override by name (every field of the schema)."""
    return tuple(FIELDS)


def _fail(origin: str, field: str, problem: str) -> None:
    raise ValueError(f"{origin}: field '{field}' {problem}")


def _check_number(origin: str, path: str, value: Any, spec: FieldSpec, integer: bool) -> None:
    ok_types = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_types):
        want = "an integer" if integer else "a number"
        _fail(origin, path, f"must be {want}, got {type(value).__name__} {value!r}")
    if spec.positive and not value > 0:
        _fail(origin, path, f"must be > 0, got {value}")
    if spec.minimum is not None and value < spec.minimum:
        _fail(origin, path, f"must be >= {spec.minimum}, got {value}")
    if spec.maximum is not None and value > spec.maximum:
        _fail(origin, path, f"must be <= {spec.maximum}, got {value}")


def _check_field(origin: str, name: str, value: Any, spec: FieldSpec) -> list[str]:
    """Check one field; return the dotted paths of its numeric leaves (which need sources)."""
    path = f"{spec.section}.{name}"
    if spec.kind == "str":
        if not isinstance(value, str):
            _fail(origin, path, f"must be a string, got {type(value).__name__}")
        if spec.choices and value not in spec.choices:
            _fail(origin, path, f"is {value!r}; allowed: {', '.join(spec.choices)}")
        return []
    if spec.kind == "bool":
        if not isinstance(value, bool):
            _fail(origin, path, f"must be true or false, got {value!r}")
        return []
    if spec.kind in ("int", "float"):
        _check_number(origin, path, value, spec, integer=spec.kind == "int")
        return [path]
    keys = _TABLE_KEYS[spec.kind]
    if not isinstance(value, dict) or not value:
        _fail(origin, path, f"must be a non-empty table with keys from {', '.join(keys)}")
    leaves = []
    for key, item in value.items():
        if key not in keys:
            _fail(origin, f"{path}.{key}", f"is not a known key; allowed: {', '.join(keys)}")
        _check_number(origin, f"{path}.{key}", item, spec, integer=False)
        leaves.append(f"{path}.{key}")
    if spec.kind == "protocol_table" and set(value) != set(PROTOCOLS):
        missing = sorted(set(PROTOCOLS) - set(value))
        _fail(origin, path, f"is missing protocols {missing}; give all of {', '.join(PROTOCOLS)}")
    return leaves


def _check_sources(origin: str, sources: Any, leaves: list[str], tables: set[str]) -> None:
    if not isinstance(sources, dict):
        _fail(origin, "sources", "must be a table mapping field paths to citations")
    known = set(leaves) | tables
    for key, text in sources.items():
        if key not in known:
            _fail(origin, f"sources.{key}", "names no numeric field or table of this profile")
        if not isinstance(text, str) or len(text.strip()) < 8:
            _fail(origin, f"sources.{key}", "must be a citation string (where the number "
                  "comes from: datasheet, paper, measurement with date)")
    for leaf in leaves:
        parent = leaf.rsplit(".", 1)[0]
        if leaf not in sources and parent not in sources:
            _fail(origin, leaf, f"has no source: add \"{leaf}\" (or its table) to [sources]")


def validate(doc: dict[str, Any], origin: str) -> dict[str, Any]:
    """Validate a parsed profile; return it unchanged. Raises ValueError naming origin/field."""
    allowed_top = {"schema_version", "name", "description", "sources", *SECTIONS}
    for key in doc:
        if key not in allowed_top:
            _fail(origin, key, f"is not a profile section; allowed: {', '.join(sorted(allowed_top))}")
    if doc.get("schema_version") != SCHEMA_VERSION:
        _fail(origin, "schema_version", f"must be {SCHEMA_VERSION}, got {doc.get('schema_version')!r}")
    for key in ("name", "description"):
        if not isinstance(doc.get(key), str) or not doc[key]:
            _fail(origin, key, "is missing or not a non-empty string")
    leaves: list[str] = []
    tables: set[str] = set()
    for section in SECTIONS:
        body = doc.get(section)
        if not isinstance(body, dict):
            _fail(origin, section, "is missing: every profile has [device], [node], [network] "
                  "and [collectives]")
        expected = {n for n, s in FIELDS.items() if s.section == section}
        for key in body:
            if key not in expected:
                _fail(origin, f"{section}.{key}", f"is not a known field; allowed in "
                      f"[{section}]: {', '.join(sorted(expected))}")
        for name in sorted(expected):
            if name not in body:
                if FIELDS[name].optional:
                    continue
                _fail(origin, f"{section}.{name}", f"is missing ({FIELDS[name].doc})")
            leaves += _check_field(origin, name, body[name], FIELDS[name])
            if FIELDS[name].kind.endswith("_table"):
                tables.add(f"{section}.{name}")
    _check_consistency(origin, doc)
    _check_sources(origin, doc.get("sources", {}), leaves, tables)
    return doc


def _check_consistency(origin: str, doc: dict[str, Any]) -> None:
    device, network = doc["device"], doc["network"]
    if set(device["gemm_efficiency"]) != set(device["peak_tflops"]):
        _fail(origin, "device.gemm_efficiency", "must have the same dtypes as "
              f"device.peak_tflops ({', '.join(sorted(device['peak_tflops']))})")
    if (network["nics_per_node"] == 0) != (network["network_kind"] == "none"):
        _fail(origin, "network.nics_per_node", "must be 0 exactly when network_kind is 'none'")
