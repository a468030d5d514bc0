"""Constants of NCCL's own tuning model and the few fitted corrections of autopar's collective model.

Library constants come from NVIDIA/nccl `src/graph/tuning.cc` (NCCL 2.30.7, commit 5067397).
Fitted corrections are named, say what they were fitted on and which measurements they were
*not* fitted on (tests/unit/test_collectives_measured.py checks both). Hardware numbers
(bandwidths, per-hop latencies) live in the profiles, not here.
"""

from __future__ import annotations

from types import MappingProxyType

from costmodels.hardware import Protocol

__all__ = [
    "BASE_LATENCY_S", "LL_MAX_BUSBW", "LL_BANDWIDTH_FRACTION", "LL128_BANDWIDTH_FRACTION",
    "TREE_BANDWIDTH_FRACTION", "TREE_LL_BANDWIDTH_DIVISOR", "TREE_LL128_BANDWIDTH_FRACTION",
    "RING_SIMPLE_MULTINODE_LATENCY_FACTOR", "TREE_NET_HOP_LATENCY_S", "NVLS_HOP_LATENCY_S", "NVLS_NET_HOP_LATENCY_S",
    "NVLSTREE_NET_HOP_LATENCY_S", "NVLS_ALGBW_EFFICIENCY", "ALLTOALL_FABRIC_EFFICIENCY",
    "PIPELINE_RAMP_BYTES", "ll_max_busbw",
]

_US = 1e-6
_GB = 1e9

# baseLat per algorithm and protocol, seconds (tuning.cc: Ring 6.6/14/8.4, Tree 6.8/14/8.4 us).
BASE_LATENCY_S = MappingProxyType({
    "ring": MappingProxyType({Protocol.LL: 6.6 * _US, Protocol.LL128: 14.0 * _US,
                              Protocol.SIMPLE: 8.4 * _US}),
    "tree": MappingProxyType({Protocol.LL: 6.8 * _US, Protocol.LL128: 14.0 * _US,
                              Protocol.SIMPLE: 8.4 * _US}),
})

# llMaxBw (bus bandwidth cap of the LL protocol), bytes/s, by arch and node count 1 / 2 / >=4.
# tuning.cc indexes the multi-node rows by host CPU vendor; the rows here are the GPU-arch rows
# for one node and the Intel/AMD rows NCCL uses on the systems of each generation.
LL_MAX_BUSBW = MappingProxyType({
    "volta": (39.0 * _GB, 39.0 * _GB, 20.4 * _GB),
    "ampere": (87.7 * _GB, 22.5 * _GB, 19.0 * _GB),
    "hopper": (141.0 * _GB, 45.0 * _GB, 35.0 * _GB),
    "blackwell": (282.0 * _GB, 90.0 * _GB, 70.0 * _GB),
    "cdna3": (87.7 * _GB, 22.5 * _GB, 19.0 * _GB),  # RCCL inherits NCCL's Ampere-era table
    "cpu": (float("inf"), float("inf"), float("inf")),  # gloo has no LL protocol cap
})


def ll_max_busbw(arch: str, num_nodes: int) -> float:
    row = LL_MAX_BUSBW[arch]
    return row[0] if num_nodes == 1 else row[1] if num_nodes == 2 else row[2]


LL_BANDWIDTH_FRACTION = 0.5  # ring LL: 8-byte lines carry 4 B of data (tuning.cc x0.5)
LL128_BANDWIDTH_FRACTION = 0.92  # ring LL128: 120 of 128 B per line (tuning.cc x0.92)
TREE_BANDWIDTH_FRACTION = 0.92  # tree Simple allreduce (tuning.cc x0.92)
TREE_LL_BANDWIDTH_DIVISOR = 3.8  # tree LL: busBw / 3.8 (tuning.cc)
TREE_LL128_BANDWIDTH_FRACTION = 120.0 / 128.0  # tree LL128 across nodes (tuning.cc)
RING_SIMPLE_MULTINODE_LATENCY_FACTOR = 1.4  # ring Simple multi-node allreduce plateau (tuning.cc)
# hwLat NET for the tree algorithm (and for rings with one GPU per node), per protocol (tuning.cc)
TREE_NET_HOP_LATENCY_S = MappingProxyType({Protocol.LL: 5.0 * _US, Protocol.LL128: 8.5 * _US,
                                           Protocol.SIMPLE: 14.0 * _US})
NVLS_HOP_LATENCY_S = 25.0 * _US  # hwLat NVLink NVLS Simple; replaces baseLat (tuning.cc)
NVLS_NET_HOP_LATENCY_S = 18.0 * _US  # hwLat NET NVLS Simple (tuning.cc)
NVLSTREE_NET_HOP_LATENCY_S = 20.9 * _US  # hwLat NET NVLSTree Simple (tuning.cc)

# -- fitted corrections ----------------------------------------------------------------------

# NVLS (NVLink SHARP) allreduce moves each byte once in each direction of a GPU's link, so its
# algorithm bandwidth is a fraction of the effective per-GPU NVLink bandwidth. Hopper: fitted on
# 8x H100 nccl-tests, algbw ~275 GB/s vs 370.8 effective (nccl-tests#212) -> 0.74. Blackwell:
# the Hopper fit scaled by NCCL's own Blackwell/Hopper NVLS efficiency ratio (nvlsEff 0.74/0.85,
# tuning.cc) -> 0.644; not fitted on any Blackwell measurement. Held out: 5-7 GPU H100 NVLS
# (nccl#1455), 8x H800 NVLS (nccl#1374), 8x B200 NVLS (GTC25, ml-engineering).
NVLS_ALGBW_EFFICIENCY = MappingProxyType({"hopper": 0.74, "blackwell": 0.74 * 0.74 / 0.85})

# All-to-all over a switched scale-up fabric reaches a fraction of the ring bus bandwidth
# (many concurrent peer streams, p2p channels). Fitted on the mean of 8x A100 (210/240) and
# 8x H100 (320/370.8) nccl-tests alltoall busbw (GTC25 S72583 slide 13); held out: 8x B200 and
# GB200 NVL72 (640 GB/s, same slide).
ALLTOALL_FABRIC_EFFICIENCY = 0.869

# Pipeline ramp: NCCL cuts a buffer into per-channel chunks that flow through the ring or tree
# steps; a small buffer leaves the pipeline short and channels idle, so the chunked protocols
# (LL128, Simple) reach eta = s / (s + s_half) of their bandwidth for a buffer of s bytes.
# Across nodes the pipeline is as deep as the tree, so the network s_half is given per tree
# level and multiplied by log2(nodes). Fitted (grid over powers of two and their midpoints) on
# the 8x A100 nccl-tests all_reduce scan (stas00/ml-engineering network/README.md @744d01e) for
# the scale-up tier and on the 4-node H100 scan (arXiv:2411.13055, read off its plot) for the
# network tier; held out: the 8x H200 NVLS, 32- and 8192-GPU NVLSTree, 512-node and B200 scans
# (benchmarks/collectives.py prints them).
PIPELINE_RAMP_BYTES = MappingProxyType({"fabric": 16.0 * 2**20, "network": 16.0 * 2**20})