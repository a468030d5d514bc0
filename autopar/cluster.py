"""`autopar.Cluster`: a hardware profile times a number of nodes, and what collectives cost on it.

A Cluster is plain data: the validated `HardwareProfile` (device, scale-up node, scale-out
network) and `num_nodes`. Global rank r lives on node r // gpus_per_node. The communication
model itself is in `costmodels.collectives`; this class only fixes the world and checks input.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import hwprofiles
from costmodels.collectives import (CollectiveEstimate, GroupLayout, check_ranks,
                                   estimate_on_layout, group_layout)
from costmodels.hardware import HardwareProfile

__all__ = ["Cluster"]


def _check_num_nodes(num_nodes: Any) -> None:
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes must be an integer >= 1, got {num_nodes!r}")


def _as_ranks(ranks: Sequence[int]) -> tuple[int, ...]:
    if type(ranks) is tuple and set(map(type, ranks)) <= {int}:
        return ranks  # already what the checks below would return
    try:
        out = tuple(int(r) for r in ranks)
    except (TypeError, ValueError):
        raise ValueError(f"ranks must be a sequence of global rank integers, got {ranks!r}") from None
    if any(isinstance(r, bool) or int(r) != r for r in ranks):
        raise ValueError(f"ranks must be integers, got {list(ranks)!r}")
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    hardware: HardwareProfile
    num_nodes: int

    def __post_init__(self) -> None:
        _check_num_nodes(self.num_nodes)
        if self.num_nodes > 1 and self.hardware.network.nics_per_node == 0:
            raise ValueError(f"profile {self.hardware.name!r} has no scale-out network "
                             f"(network_kind 'none'), so it has one node; got num_nodes="
                             f"{self.num_nodes}. Use num_nodes=1, or override nics_per_node, "
                             f"nic_gbps and network_kind to give it one")

    @classmethod
    def from_profile(cls, name: str, num_nodes: int = 1, **overrides: Any) -> "Cluster":
        """A cluster of `num_nodes` nodes of the shipped profile `name`.

        Keyword overrides replace profile fields by name for what-if questions, e.g.
        `Cluster.from_profile("dgx-a100-80g", num_nodes=48, nics_per_node=4, nic_gbps=100)`.
        """
        if not isinstance(name, str) or name.endswith(".toml"):
            raise ValueError(f"from_profile takes a shipped profile name "
                             f"({', '.join(hwprofiles.list_profiles())}); use "
                             f"Cluster.from_toml(path) for a file")
        return cls(hardware=HardwareProfile.load(name, **overrides), num_nodes=num_nodes)

    @classmethod
    def from_toml(cls, path: str | Path, num_nodes: int = 1, **overrides: Any) -> "Cluster":
        """A cluster of `num_nodes` nodes described by a profile TOML file (same schema)."""
        if Path(path).suffix != ".toml":
            raise ValueError(f"from_toml takes a path to a .toml profile, got {str(path)!r}")
        return cls(hardware=HardwareProfile.load(Path(path), **overrides), num_nodes=num_nodes)

    def with_memory_headroom(self, fraction: float) -> "Cluster":
        """This cluster with `fraction` of each device's memory held back: the memory a plan
        may fill (`SearchSettings.memory_headroom`). Only the memory changes."""
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                or not 0 <= fraction < 1:
            raise ValueError(f"memory headroom must be a fraction in [0, 1), got {fraction!r}")
        if fraction == 0:
            return self
        device = replace(self.hardware.device,
                         memory_bytes=self.hardware.device.memory_bytes * (1 - fraction))
        return replace(self, hardware=replace(self.hardware, device=device))

    @property
    def gpus_per_node(self) -> int:
        return self.hardware.node.gpus_per_node

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def name(self) -> str:
        return self.hardware.name

    def node_of(self, rank: int) -> int:
        """The node that global rank `rank` lives on."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        return rank // self.gpus_per_node

    def collective_estimate(self, kind: str, nbytes: float, ranks: Sequence[int], *,
                            algorithm: str | None = None) -> CollectiveEstimate:
        """The modelled collective with its algorithm, protocol, latency and bus bandwidth."""
        return estimate_on_layout(self.hardware, kind, nbytes, self.group_layout(ranks),
                                  algorithm=algorithm)

    def group_layout(self, ranks: Sequence[int]) -> GroupLayout:
        """Where the global `ranks` live (checked), what `costmodels.collectives.
        estimate_on_layout` costs a collective on; callers costing many collectives on one
        group lay it out once."""
        group = _as_ranks(ranks)
        check_ranks(self.hardware, group, self.world_size)
        return group_layout(group, self.gpus_per_node, self.hardware.network.nodes_per_leaf)

    def collective_time(self, kind: str, nbytes: float, ranks: Sequence[int]) -> float:
        """Seconds for one collective over global `ranks`.

        kind: all_reduce, all_gather, reduce_scatter, all_to_all, broadcast or send_recv (ranks
        [src, dst]); nbytes: the whole buffer, as nccl-tests counts it (for all_gather the
        gathered size).
        """
        return self.collective_estimate(kind, nbytes, ranks).time_s

    def fingerprint(self) -> str:
        """Stable short hash of the hardware fields and the node count."""
        return f"{self.hardware.fingerprint()}-n{self.num_nodes}"

    def describe(self) -> str:
        hw = self.hardware
        net = (f"{hw.network.nics_per_node}x {hw.network.nic_bytes_per_s * 8 / 1e9:g} Gb/s "
               f"{hw.network.kind}" if hw.network.nics_per_node else "no network")
        return (f"{self.num_nodes} x {hw.name}: {self.world_size} x {hw.device.model}, "
                f"{hw.node.fabric.value} {hw.node.fabric_bytes_per_s / 1e9:g} GB/s per device, "
                f"{net}")

    def __repr__(self) -> str:
        return f"Cluster({self.hardware.name!r}, num_nodes={self.num_nodes}, world_size={self.world_size})"
