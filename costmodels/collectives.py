"""α-β collective cost model: the time of one NCCL-style collective on a group of global ranks.

For each collective the model lists the algorithms NCCL would choose between and, for each, its
protocols (LL, LL128, Simple), and returns the fastest, as NCCL's tuner does:

    t = λ_kind · (call_overhead + latency(algorithm, protocol, group))
        + nbytes · f_kind / (β_kind · busbw · η(s))

- `f_kind` is nccl-tests' bus factor (all_reduce 2(n-1)/n; all_gather, reduce_scatter,
  all_to_all (n-1)/n; broadcast, send_recv 1) and `nbytes` the whole buffer, so `busbw` is the
  same "bus bandwidth" nccl-tests prints and can be compared with measurements directly.
- `busbw` comes from the topology: the scale-up tier (per-device fabric bandwidth x efficiency;
  on a mesh fabric a sub-group reaches only the links to its peers), the scale-out tier (the
  NIC share of the group's GPUs on the busiest node, divided by the oversubscription when the
  group spans leaf groups), and algorithm/protocol fractions from NCCL's tuning model.
- `latency` follows NCCL's tuning model: base latency plus per-step hop latencies per tier
  (ring: linear in steps; tree: logarithmic in nodes; NVLS: one switch round trip).
- `λ_kind`, `β_kind` are the profile's per-collective corrections (`latency_factor`,
  `bandwidth_factor`, 1.0 unless `autopar calibrate` measured them): a library whose
  collectives differ from each other more than the tiers and steps above say (gloo's
  reduce-scatter runs at a fraction of its all-reduce's bus bandwidth) gets them fitted.
- `η(s) = s / (s + s_half)` is the pipeline ramp of the chunked protocols (LL128, Simple): a single α + n/B is
  1.3-1.6x optimistic at 4-64 MiB (least-squares α-β fits to stas00/ml-engineering's 8x A100
  nccl-tests and 8x H200 / B200 all-reduce scans, rows of tests/data/collective_measurements.csv).

Algorithms: ring (all kinds but all_to_all / send_recv), tree (multi-node all_reduce), NVLS and
NVLS-tree (all_reduce on NVSwitch with in-switch reduction), in-network reduction (IB SHARP
where the profile has it), direct exchange (all_to_all, whose inter-node bandwidth is bound by
each GPU's NIC share) and point-to-point (send_recv). Gloo (cpu) uses the ring only.
No torch import here.
"""

from __future__ import annotations

import collections
import itertools
import math
import operator
from dataclasses import dataclass
from enum import StrEnum
from typing import Iterable, Sequence

from costmodels import nccl_constants as K
from costmodels.hardware import Fabric, HardwareProfile, Protocol

__all__ = ["Collective", "GroupLayout", "CollectiveEstimate", "group_layout", "check_ranks",
           "estimate_collective", "estimate_on_layout", "collective_candidates", "LayoutTimer",
           "collective_time", "bus_factor",
           "ZERO3_SYNC_GATHER_BYTES_PER_S", "ZERO3_PERSISTENCE_THRESHOLD"]

# DeepSpeed ZeRO-3 before v0.5 (2021) fetched each partitioned parameter with its own
# all-gather, waited for it (its "async" fetch called torch.cuda.synchronize after every
# gather) and copied the result out of the gather buffer -- DeepSpeed PR #1188 (June 2021)
# names both and removes them. Beyond the collective itself this moved
# ZERO3_SYNC_GATHER_BYTES_PER_S of parameters per GPU: DeepSpeed issue #1174 (v0.3.16, one
# 8x A100 NVLink node, a 5.1B-parameter BERT of 64 layers at h = 2560) measured a 480 ms
# forward under ZeRO-3 against 60 ms under ZeRO-2; the 420 ms difference less this model's
# NCCL time for its 386 gathers (73 ms on dgx-a100-40g) leaves 10.23 GB in 347 ms
# (tests/unit/test_collectives.py re-derives it). Parameters of at most
# ZERO3_PERSISTENCE_THRESHOLD elements (the default stage3_param_persistence_threshold) stay
# whole on every rank and are never gathered.
ZERO3_SYNC_GATHER_BYTES_PER_S = 29.5e9
ZERO3_PERSISTENCE_THRESHOLD = 100_000


class Collective(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupLayout:
    """Where a group's ranks live: how many, on how many nodes and leaf groups."""

    num_ranks: int
    num_nodes: int
    min_ranks_per_node: int
    max_ranks_per_node: int
    num_leaves: int


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveEstimate:
    kind: Collective
    algorithm: str
    protocol: Protocol
    nbytes: float
    time_s: float
    latency_s: float
    busbw_bytes_per_s: float  # bus bandwidth achieved at this size (nccl-tests definition)


def bus_factor(kind: Collective, n: int) -> float:
    """nccl-tests' factor from algorithm bandwidth (nbytes / t) to bus bandwidth."""
    if kind is Collective.ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return (n - 1) / n
    return 1.0


def group_layout(ranks: Sequence[int], gpus_per_node: int, nodes_per_leaf: int) -> GroupLayout:
    counts = collections.Counter(map(operator.floordiv, ranks, itertools.repeat(gpus_per_node)))
    leaves = {node // nodes_per_leaf for node in counts}
    return GroupLayout(num_ranks=len(ranks), num_nodes=len(counts),
                       min_ranks_per_node=min(counts.values()),
                       max_ranks_per_node=max(counts.values()), num_leaves=len(leaves))


def _check_request(kind: str | Collective, nbytes: float) -> Collective:
    try:
        kind_enum = Collective(kind)
    except ValueError:
        raise ValueError(f"unknown collective {kind!r}; allowed: "
                         f"{', '.join(c.value for c in Collective)}") from None
    if not (isinstance(nbytes, (int, float)) and nbytes >= 0 and math.isfinite(nbytes)):
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
    return kind_enum


def check_ranks(hw: HardwareProfile, ranks: Sequence[int], world_size: int) -> None:
    """Raise unless `ranks` are distinct global ranks of a world of `world_size`."""
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks must be distinct, got {list(ranks)}")
    if ranks and set(map(type, ranks)) <= {int} and 0 <= min(ranks) and max(ranks) < world_size:
        return  # the common case, without a test per rank
    bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < world_size)]
    if bad:
        raise ValueError(f"ranks {bad} are outside the cluster's 0..{world_size - 1} "
                         f"({world_size // hw.node.gpus_per_node} nodes x "
                         f"{hw.node.gpus_per_node} GPUs)")


# -- bandwidth of the tiers -------------------------------------------------------------------

def _fabric_busbw(hw: HardwareProfile, ranks_on_node: int) -> float:
    """Effective per-device scale-up bandwidth available to a group of `ranks_on_node` ranks."""
    node = hw.node
    if ranks_on_node <= 1:
        return math.inf
    full = node.fabric_effective_bytes_per_s
    if node.fabric in (Fabric.NVLINK_MESH, Fabric.XGMI):
        # a full mesh spreads each device's links over its peers: a sub-group reaches only the
        # links to its own members
        return full * min(1.0, (ranks_on_node - 1) / max(1, node.gpus_per_node - 1))
    return full


def _network_busbw(hw: HardwareProfile, layout: GroupLayout) -> float:
    """Scale-out bandwidth per node available to the group (its GPUs' share of the NICs)."""
    if layout.num_nodes == 1:
        return math.inf
    net = hw.network
    share = net.node_effective_bytes_per_s * layout.min_ranks_per_node / hw.node.gpus_per_node
    if layout.num_leaves > 1:
        share /= net.oversubscription
    return share


def _ramp(hw: HardwareProfile, nbytes: float, proto: Protocol, tier: str,
          num_nodes: int) -> float:
    """Pipeline ramp of NCCL's chunked protocols; LL (8-byte lines) and gloo have none.

    Across nodes the pipeline is as deep as the tree over the nodes, so the half-bandwidth
    size grows with log2(nodes).
    """
    if proto is Protocol.LL or nbytes <= 0 or hw.library == "gloo":
        return 1.0
    half = K.PIPELINE_RAMP_BYTES[tier]
    if tier == "network":
        half *= max(1.0, math.log2(num_nodes))
    return nbytes / (nbytes + half)


# -- candidates -------------------------------------------------------------------------------

def _hop(hw: HardwareProfile, proto: Protocol, inter: bool, algorithm: str = "ring") -> float:
    """Latency of one step: on the fabric, or across nodes (NCCL's tree NET table for trees)."""
    if not inter:
        return hw.node.fabric_hop_latency_s[proto]
    if algorithm == "tree" and hw.library != "gloo":
        return K.TREE_NET_HOP_LATENCY_S[proto]
    return hw.network.hop_latency_s[proto]


def _intra_hop_multinode(hw: HardwareProfile, proto: Protocol) -> float:
    """An intra-node step of a multi-node collective also pays the host's network overhead."""
    overhead = hw.net_overhead_s * (3.0 if proto is Protocol.SIMPLE else 1.0)
    return max(_hop(hw, proto, inter=False), overhead)


def _protocols(hw: HardwareProfile, layout: GroupLayout) -> list[Protocol]:
    if hw.library == "gloo":
        return [Protocol.SIMPLE]
    protos = [Protocol.LL, Protocol.SIMPLE]
    nvlink = hw.node.fabric in (Fabric.NVSWITCH, Fabric.NVLINK_MESH, Fabric.XGMI)
    inter_ok = layout.num_nodes == 1 or hw.device.arch in ("hopper", "blackwell")
    if nvlink and inter_ok:  # LL128 only on NVLink paths (and Hopper+ across nodes)
        protos.insert(1, Protocol.LL128)
    return protos


def _ring(hw: HardwareProfile, kind: Collective, layout: GroupLayout, busbw: float,
          large: bool) -> Iterable[tuple[str, Protocol, float, float, str]]:
    """`large`: at least 64 bytes per rank (`_large`), where a multi-node Simple all_reduce
    pays NCCL's extra ring latency."""
    n, nodes = layout.num_ranks, layout.num_nodes
    if kind is Collective.ALL_REDUCE:
        steps, inter_steps = 2 * (n - 1), 2 * (nodes - 1)
    elif kind is Collective.BROADCAST:
        steps, inter_steps = 1, 1 if nodes > 1 else 0
    else:
        steps, inter_steps = n - 1, nodes - 1
    tier = "network" if nodes > 1 else "fabric"
    gloo = hw.library == "gloo"
    for proto in _protocols(hw, layout):
        if nodes > 1 and not gloo:
            intra_hop = _intra_hop_multinode(hw, proto)
        else:
            intra_hop = _hop(hw, proto, False)
        # with one GPU per node NCCL's ring uses the tree NET latency (tuning.cc)
        inter_alg = "tree" if layout.max_ranks_per_node == 1 else "ring"
        base = 0.0 if gloo else K.BASE_LATENCY_S["ring"][proto]
        lat = (base + (steps - inter_steps) * intra_hop
               + inter_steps * _hop(hw, proto, True, inter_alg))
        if (kind is Collective.ALL_REDUCE and nodes > 1 and proto is Protocol.SIMPLE
                and large and not gloo):
            lat *= K.RING_SIMPLE_MULTINODE_LATENCY_FACTOR
        if proto is Protocol.LL:
            bw = min(K.ll_max_busbw(hw.device.arch, nodes), K.LL_BANDWIDTH_FRACTION * busbw)
        elif proto is Protocol.LL128:
            bw = K.LL128_BANDWIDTH_FRACTION * busbw
        else:
            bw = busbw
        yield "ring", proto, lat, bw, tier


def _tree(hw: HardwareProfile, layout: GroupLayout, busbw: float
          ) -> Iterable[tuple[str, Protocol, float, float, str]]:
    levels = math.ceil(math.log2(layout.num_nodes))
    for proto in _protocols(hw, layout):
        lat = K.BASE_LATENCY_S["tree"][proto] + 2 * (
            (layout.max_ranks_per_node - 1) * _hop(hw, proto, False)
            + levels * _hop(hw, proto, True, "tree"))
        if proto is Protocol.LL:
            bw = min(K.ll_max_busbw(hw.device.arch, layout.num_nodes),
                     busbw / K.TREE_LL_BANDWIDTH_DIVISOR)
        elif proto is Protocol.LL128:
            bw = busbw * K.TREE_LL128_BANDWIDTH_FRACTION
        else:
            bw = busbw * K.TREE_BANDWIDTH_FRACTION
        yield "tree", proto, lat, bw, "network"


def _nvls(hw: HardwareProfile, layout: GroupLayout, fabric: float, network: float
          ) -> Iterable[tuple[str, Protocol, float, float, str]]:
    eff = K.NVLS_ALGBW_EFFICIENCY.get(hw.device.arch)
    if eff is None or layout.max_ranks_per_node < 2:
        return
    n = layout.num_ranks
    # in-switch reduction: each byte crosses a GPU's link once per direction, so the algorithm
    # bandwidth is the link's; expressed as bus bandwidth that is x 2(n-1)/n
    intra_algbw = hw.node.fabric_effective_bytes_per_s * eff
    if layout.num_nodes == 1:
        yield "nvls", Protocol.SIMPLE, K.NVLS_HOP_LATENCY_S, intra_algbw * 2 * (n - 1) / n, "fabric"
        return
    levels = math.ceil(math.log2(layout.num_nodes))
    bw = min(intra_algbw * 2 * (n - 1) / n, network)
    lat = K.NVLS_HOP_LATENCY_S + 2 * levels * K.NVLSTREE_NET_HOP_LATENCY_S
    yield "nvls_tree", Protocol.SIMPLE, lat, bw, "network"
    if hw.network.in_network_reduction:
        # the switches reduce: a node sends and receives the buffer once through its NICs
        sharp = min(intra_algbw, network) * 2 * (n - 1) / n
        yield "nvls_sharp", Protocol.SIMPLE, K.NVLS_HOP_LATENCY_S + 2 * K.NVLS_NET_HOP_LATENCY_S, \
            sharp, "network"


def _direct(hw: HardwareProfile, kind: Collective, layout: GroupLayout, fabric: float
            ) -> Iterable[tuple[str, Protocol, float, float, str]]:
    """all_to_all and send_recv: concurrent point-to-point transfers."""
    multi = layout.num_nodes > 1
    if multi:
        # each GPU's flows leave through its own share of the node's NICs (PXN routes traffic
        # to the destination rail); the traffic that stays in the node does not speed it up
        # (nccl-tests#267: all-to-all across nodes runs at one NIC's bandwidth)
        bw = hw.network.node_effective_bytes_per_s / hw.node.gpus_per_node
        if layout.num_leaves > 1:
            bw /= hw.network.oversubscription
    elif kind is Collective.SEND_RECV:
        bw = hw.node.fabric_effective_bytes_per_s
        if hw.node.fabric in (Fabric.NVLINK_MESH, Fabric.XGMI):  # only the links to that peer
            links = hw.node.fabric_links_per_device
            bw *= max(1, links // max(1, hw.node.gpus_per_node - 1)) / links
    else:
        bw = fabric * K.ALLTOALL_FABRIC_EFFICIENCY
    gloo = hw.library == "gloo"
    if not multi and kind is Collective.ALL_TO_ALL and gloo:
        bw = fabric  # gloo's pairwise exchange: no NVSwitch-fitted efficiency
    tier = "network" if multi else "fabric"
    for proto in (Protocol.SIMPLE,) if gloo else (Protocol.LL, Protocol.SIMPLE):
        if gloo:  # pairwise exchange: one step per peer (Thakur et al.), no base latency
            steps = layout.num_ranks - 1 if kind is Collective.ALL_TO_ALL else 1
            lat = steps * _hop(hw, proto, multi)
        else:  # NCCL posts all peers' transfers at once
            lat = K.BASE_LATENCY_S["ring"][proto] + _hop(hw, proto, multi)
        pbw = min(K.ll_max_busbw(hw.device.arch, layout.num_nodes),
                  K.LL_BANDWIDTH_FRACTION * bw) if proto is Protocol.LL else bw
        yield "p2p" if kind is Collective.SEND_RECV else "direct", proto, lat, pbw, tier


def _large(nbytes: float, layout: GroupLayout) -> bool:
    return nbytes / layout.num_ranks >= 64


def _options(hw: HardwareProfile, kind: Collective, layout: GroupLayout, large: bool
             ) -> list[tuple[str, Protocol, float, float, str]]:
    """(algorithm, protocol, latency with the call overhead, bandwidth before the ramp,
    tier) of every candidate, in tie order, with the profile's per-collective corrections;
    all that does not depend on the size but `large`."""
    fabric = _fabric_busbw(hw, layout.max_ranks_per_node)
    network = _network_busbw(hw, layout)
    busbw = min(fabric, network)
    if kind in (Collective.ALL_TO_ALL, Collective.SEND_RECV):
        options = list(_direct(hw, kind, layout, fabric))
    else:
        options = list(_ring(hw, kind, layout, busbw, large))
        if kind is Collective.ALL_REDUCE and hw.library != "gloo":
            if layout.num_nodes > 1:
                options += _tree(hw, layout, busbw)
            if hw.node.in_switch_reduction and hw.node.fabric is Fabric.NVSWITCH:
                options += _nvls(hw, layout, fabric, network)
    call = hw.call_overhead_s
    lat_f = hw.latency_factor.get(kind.value, 1.0)
    bw_f = hw.bandwidth_factor.get(kind.value, 1.0)
    return [(alg, proto, (lat + call) * lat_f, bw * bw_f, tier)
            for alg, proto, lat, bw, tier in options]


def _timed(hw: HardwareProfile, option: tuple[str, Protocol, float, float, str],
           nbytes: float, factor: float, num_nodes: int) -> tuple[float, float]:
    """(latency, seconds) of one candidate at `nbytes`."""
    _, proto, lat, bw, tier = option
    eff_bw = bw * _ramp(hw, nbytes, proto, tier, num_nodes)
    return lat, lat + (nbytes * factor / eff_bw if nbytes > 0 else 0.0)


def _estimate(kind: Collective, option: tuple[str, Protocol, float, float, str], nbytes: float,
              factor: float, lat: float, time_s: float) -> CollectiveEstimate:
    achieved = nbytes * factor / time_s if time_s > 0 else 0.0
    return CollectiveEstimate(kind=kind, algorithm=option[0], protocol=option[1], nbytes=nbytes,
                              time_s=time_s, latency_s=lat, busbw_bytes_per_s=achieved)


def collective_candidates(hw: HardwareProfile, kind: Collective, nbytes: float,
                          layout: GroupLayout) -> list[CollectiveEstimate]:
    """Every (algorithm, protocol) the model considers for this collective, with its time."""
    factor = bus_factor(kind, layout.num_ranks)
    return [_estimate(kind, option, nbytes, factor,
                      *_timed(hw, option, nbytes, factor, layout.num_nodes))
            for option in _options(hw, kind, layout, _large(nbytes, layout))]


class LayoutTimer:
    """`estimate_on_layout(hw, kind, nbytes, layout).time_s` for one laid-out group, the same
    numbers, with each kind's candidates (everything but the size's ramp) worked out once:
    for callers that time many sizes on few groups (the intra-op ILP, the search's memo)."""

    def __init__(self, hw: HardwareProfile, layout: GroupLayout) -> None:
        self.hw, self.layout = hw, layout
        self._options: dict[tuple[Collective, bool], tuple[list, float]] = {}

    def time_s(self, kind: str | Collective, nbytes: float) -> float:
        kind = _check_request(kind, nbytes)
        layout = self.layout
        if layout.num_ranks <= 1 or nbytes == 0:
            return 0.0
        key = (kind, _large(nbytes, layout))
        found = self._options.get(key)
        if found is None:
            if kind is Collective.SEND_RECV and layout.num_ranks != 2:
                raise ValueError(f"send_recv takes the two ranks [src, dst], got "
                                 f"{layout.num_ranks} ranks")
            found = self._options[key] = (_options(self.hw, kind, layout, key[1]),
                                          bus_factor(kind, layout.num_ranks))
        options, factor = found
        best = math.inf
        for option in options:  # the first of equals, as min() in estimate_on_layout
            t = _timed(self.hw, option, nbytes, factor, layout.num_nodes)[1]
            if t < best:
                best = t
        return best


def estimate_collective(hw: HardwareProfile, kind: str | Collective, nbytes: float,
                        ranks: Sequence[int], *, world_size: int,
                        algorithm: str | None = None) -> CollectiveEstimate:
    """The fastest candidate (or the named `algorithm`) for `kind` over global `ranks`.

    A group of one rank, or an empty buffer, costs zero. Ties go to the first candidate in the
    order ring, tree, nvls, direct/p2p and LL, LL128, Simple.
    """
    kind_enum = _check_request(kind, nbytes)
    check_ranks(hw, ranks, world_size)
    layout = group_layout(ranks, hw.node.gpus_per_node, hw.network.nodes_per_leaf)
    return estimate_on_layout(hw, kind_enum, nbytes, layout, algorithm=algorithm)


def estimate_on_layout(hw: HardwareProfile, kind: str | Collective, nbytes: float,
                       layout: GroupLayout, *, algorithm: str | None = None
                       ) -> CollectiveEstimate:
    """`estimate_collective` for a group already checked and laid out (`check_ranks`,
    `group_layout`): what the estimate calls, which costs many collectives on few groups."""
    kind_enum = _check_request(kind, nbytes)
    if kind_enum is Collective.SEND_RECV and layout.num_ranks not in (1, 2):
        raise ValueError(f"send_recv takes the two ranks [src, dst], got {layout.num_ranks} "
                         f"ranks")
    if layout.num_ranks <= 1 or nbytes == 0:
        return CollectiveEstimate(kind=kind_enum, algorithm="none", protocol=Protocol.SIMPLE,
                                  nbytes=nbytes, time_s=0.0, latency_s=0.0, busbw_bytes_per_s=0.0)
    options = _options(hw, kind_enum, layout, _large(nbytes, layout))
    if algorithm is not None:
        named = [o for o in options if o[0] == algorithm]
        if not named:
            have = sorted({o[0] for o in options})
            raise ValueError(f"algorithm {algorithm!r} is not available for {kind_enum.value} on "
                             f"this group; available: {', '.join(have)}")
        options = named
    factor = bus_factor(kind_enum, layout.num_ranks)
    timed = [_timed(hw, o, nbytes, factor, layout.num_nodes) for o in options]
    k = min(range(len(options)), key=lambda i: timed[i][1])  # the first of equals
    return _estimate(kind_enum, options[k], nbytes, factor, *timed[k])


def collective_time(hw: HardwareProfile, kind: str | Collective, nbytes: float,
                    ranks: Sequence[int], *, world_size: int) -> float:
    """Seconds for one collective of `nbytes` (whole buffer, as nccl-tests) over `ranks`."""
    return estimate_collective(hw, kind, nbytes, ranks, world_size=world_size).time_s
