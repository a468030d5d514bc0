"""Hardware dataclasses in SI units, built from a validated hardware profile.

A `HardwareProfile` is what every cost model reads: the device (peaks, memory), the scale-up
node (fabric, its bandwidth and latency) and the scale-out network (NICs, line rate, topology).
Profiles are data (hwprofiles/*.toml, validated by `hwprofiles.schema`); this module only turns
their unit-suffixed fields into seconds, bytes and bytes/s. No torch import here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import hwprofiles

__all__ = ["Fabric", "Protocol", "DeviceSpec", "NodeSpec", "NetworkSpec", "HardwareProfile"]

_GB = 1e9
_US = 1e-6


class Fabric(StrEnum):
    NVSWITCH = "nvswitch"  # any-to-any at full per-device bandwidth
    NVLINK_MESH = "nvlink_mesh"  # direct links between (some) pairs, no switch
    XGMI = "xgmi"  # AMD Infinity Fabric full mesh
    PCIE = "pcie"  # through PCIe switches / host bridge
    HOST = "host"  # CPU processes on one host (shared memory / loopback)


class Protocol(StrEnum):
    """NCCL's wire protocols: LL (8-byte lines, lowest latency), LL128, Simple (full bandwidth)."""

    LL = "ll"
    LL128 = "ll128"
    SIMPLE = "simple"


def _freeze(mapping: Mapping[str, float], scale: float) -> Mapping[str, float]:
    return MappingProxyType({k: float(v) * scale for k, v in sorted(mapping.items())})


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    model: str
    arch: str
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    memory_efficiency: float
    peak_flops: Mapping[str, float]  # dense FLOP/s per dtype name
    gemm_efficiency: Mapping[str, float]
    gemm_half_efficiency_flops: float | None = None  # None: costmodels.compute's default
    op_overhead_s: float | None = None  # None: costmodels.compute.KERNEL_GAP_S


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeSpec:
    gpus_per_node: int
    fabric: Fabric
    fabric_bytes_per_s: float  # per device, per direction, line rate
    fabric_links_per_device: int
    fabric_efficiency: float
    fabric_hop_latency_s: Mapping[Protocol, float]
    in_switch_reduction: bool

    @property
    def fabric_effective_bytes_per_s(self) -> float:
        """Achievable per-device scale-up bandwidth (line rate x efficiency)."""
        return self.fabric_bytes_per_s * self.fabric_efficiency


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkSpec:
    kind: str
    nics_per_node: int
    nic_bytes_per_s: float  # line rate per NIC, per direction
    nic_efficiency: float
    hop_latency_s: Mapping[Protocol, float]
    topology: str
    nodes_per_leaf: int
    oversubscription: float
    in_network_reduction: bool

    @property
    def node_effective_bytes_per_s(self) -> float:
        """Achievable scale-out bandwidth of one node, all NICs together, per direction."""
        return self.nics_per_node * self.nic_bytes_per_s * self.nic_efficiency


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    name: str
    description: str
    device: DeviceSpec
    node: NodeSpec
    network: NetworkSpec
    library: str
    net_overhead_s: float
    call_overhead_s: float
    document: Mapping[str, Any]  # the validated TOML document this was built from
    # per-collective corrections measured by `autopar calibrate` (collective name -> factor;
    # an absent collective gets 1.0): of the latency, call overhead included, and of the bus
    # bandwidth the collective model gives
    latency_factor: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    bandwidth_factor: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def load(cls, name_or_path: str | Path, **overrides: Any) -> "HardwareProfile":
        """Load a shipped profile by name or a TOML file by path, with fields overridden by name."""
        doc = hwprofiles.apply_overrides(hwprofiles.read_profile(name_or_path), overrides)
        return cls.from_document(doc)

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> "HardwareProfile":
        dev, node, net, coll = doc["device"], doc["node"], doc["network"], doc["collectives"]
        return cls(
            name=doc["name"],
            description=doc["description"],
            device=DeviceSpec(
                model=dev["model"],
                arch=dev["arch"],
                memory_bytes=dev["device_memory_gb"] * _GB,
                memory_bandwidth_bytes_per_s=dev["memory_bandwidth_gb_per_s"] * _GB,
                memory_efficiency=dev["memory_efficiency"],
                peak_flops=_freeze(dev["peak_tflops"], 1e12),
                gemm_efficiency=_freeze(dev["gemm_efficiency"], 1.0),
                gemm_half_efficiency_flops=(dev["gemm_half_efficiency_gflop"] * 1e9
                                            if "gemm_half_efficiency_gflop" in dev else None),
                op_overhead_s=(dev["op_overhead_us"] * _US if "op_overhead_us" in dev else None),
            ),
            node=NodeSpec(
                gpus_per_node=node["gpus_per_node"],
                fabric=Fabric(node["fabric"]),
                fabric_bytes_per_s=node["fabric_gb_per_s"] * _GB,
                fabric_links_per_device=node["fabric_links_per_device"],
                fabric_efficiency=node["fabric_efficiency"],
                fabric_hop_latency_s=MappingProxyType(
                    {Protocol(k): v * _US for k, v in node["fabric_hop_latency_us"].items()}),
                in_switch_reduction=node["in_switch_reduction"],
            ),
            network=NetworkSpec(
                kind=net["network_kind"],
                nics_per_node=net["nics_per_node"],
                nic_bytes_per_s=net["nic_gbps"] * 1e9 / 8,
                nic_efficiency=net["nic_efficiency"],
                hop_latency_s=MappingProxyType(
                    {Protocol(k): v * _US for k, v in net["network_hop_latency_us"].items()}),
                topology=net["network_topology"],
                nodes_per_leaf=net["nodes_per_leaf"],
                oversubscription=net["oversubscription"],
                in_network_reduction=net["in_network_reduction"],
            ),
            library=coll["library"],
            net_overhead_s=coll["net_overhead_us"] * _US,
            call_overhead_s=coll["call_overhead_us"] * _US,
            document=MappingProxyType(dict(doc)),
            latency_factor=_freeze(coll.get("latency_factor", {}), 1.0),
            bandwidth_factor=_freeze(coll.get("bandwidth_factor", {}), 1.0),
        )

    def fingerprint(self) -> str:
        """A short stable hash of every field of the profile (sources excluded)."""
        body = {k: v for k, v in self.document.items() if k not in ("sources", "description")}
        blob = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
