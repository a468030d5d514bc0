"""Time of one copy of a unit, for one micro-batch, on one rank of a parallel configuration.

Sharding follows Megatron-LM for transformer-shaped units (the search's ILP may choose other
layouts later): GEMMs and attention are split over tp (column->row pairs, heads) and cp
(tokens); vocabulary GEMMs and lookups are vocab-parallel over tp; memory-bound ops are split
over cp, and over tp only with sequence parallelism. Communication goes through
`Cluster.collective_time` on the rank groups of the mesh, each axis's slowest
(`slowest_groups`: a step waits for its slowest rank), so the topology decides its cost:

- TP: per synchronisation point an all-reduce of the hidden state (all-gather +
  reduce-scatter with SP), forward and backward; exposed, or hidden behind the unit's GEMMs
  up to their duration when the software overlaps it.
- CP: ring attention passes K/V (forward) and their gradients (backward) cp-1 times,
  overlapped with the attention computation; only the excess is exposed.
- EP: all-to-all dispatch and combine of the routed tokens, forward and backward.
Recompute: "full" re-runs the unit's forward (compute and TP communication) in backward;
"selective" re-runs the attention core, which flash kernels already do by construction.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.estimate.units import OpCost, Unit
from costmodels.collectives import estimate_on_layout, group_layout
from costmodels.compute import (activation_memory_time_s, attention_time_s, gemm_time_s,
                                loss_time_s, op_overhead_s, unaligned_gemm_slowdown)

__all__ = ["BACKWARD_MEMORY_RATIO", "RankGroups", "UnitTimes", "op_times", "rank_groups",
           "slowest_groups", "unit_times"]

# A memory-bound op's backward reads the output gradient and the saved input and writes the
# input gradient: about twice the forward's traffic (read input, write output).
BACKWARD_MEMORY_RATIO = 2.0


@dataclass(frozen=True, kw_only=True, slots=True)
class RankGroups:
    """Global ranks of one group per mesh axis (mesh order pp, dp, cp, tp): rank 0's
    (`rank_groups`), or each axis's slowest (`slowest_groups`)."""

    tp: tuple[int, ...]
    cp: tuple[int, ...]  # a ring, in ring order
    ep: tuple[int, ...]
    dp: tuple[int, ...]  # data-parallel replicas of the same parameters: dp x cp ranks
    pp_hop: tuple[int, int] | None  # a rank and the one holding its next pipeline stage


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitTimes:
    """Seconds for one copy of a unit, one micro-batch, on one rank."""

    compute_fwd: float
    compute_bwd: float  # input and weight gradients
    compute_wgrad: float  # the weight-gradient share of compute_bwd (zero-bubble's W)
    recompute: float  # extra forward work in backward (compute and its TP communication)
    tp_fwd: float
    tp_bwd: float
    cp_fwd: float
    cp_bwd: float
    ep_fwd: float
    ep_bwd: float

    @property
    def forward(self) -> float:
        return self.compute_fwd + self.tp_fwd + self.cp_fwd + self.ep_fwd

    @property
    def backward(self) -> float:
        return self.compute_bwd + self.recompute + self.tp_bwd + self.cp_bwd + self.ep_bwd


def rank_groups(cfg: ParallelConfig) -> RankGroups:
    """The groups rank 0 belongs to."""
    tp, cp, dp = cfg.tp, cfg.cp, cfg.dp
    replicas = tuple(range(0, dp * cp * tp, tp))  # d·cp·tp + c·tp over (d, c) in mesh order
    return RankGroups(tp=tuple(range(tp)), cp=tuple(c * tp for c in range(cp)),
                      ep=replicas[:cfg.ep], dp=replicas,
                      pp_hop=(0, dp * cp * tp) if cfg.pp > 1 else None)


# the collective that ranks an axis's groups by layout, and its size: a group spread over
# more nodes, or with fewer ranks on one of them, is slower at any size
_PROBES = {"tp": ("all_reduce", 2.0**26), "cp": ("send_recv", 2.0**26),
           "ep": ("all_to_all", 2.0**26), "dp": ("all_reduce", 2.0**30),
           "pp": ("send_recv", 2.0**26)}


def _aligned(size: int, gpus_per_node: int) -> bool:
    return gpus_per_node % size == 0 or size % gpus_per_node == 0


def slowest_groups(cfg: ParallelConfig, cluster: Cluster) -> RankGroups:
    """One group per axis that no rank's group of that axis is slower than: a step runs at
    its slowest rank's pace.

    An axis's groups lie alike on the nodes -- each within a node, or over whole nodes with
    the same number of ranks on each -- when the block of ranks they tile (tp; tp x cp for
    cp; tp x ep for ep; the stage, tp x cp x dp, for dp) divides the node or is a multiple of
    it; every rank's next pipeline stage is on another node when a stage holds a node's
    ranks or more (on the same one when the world is one node). Such an axis takes rank 0's
    group (`rank_groups`). Otherwise (tp = 3 or 6 on 8-GPU nodes, say: some tensor-parallel
    groups straddle two nodes) every group of the axis within one period of the pattern (the
    block and the node's least common multiple, at most the world) is laid out and the
    slowest by its `_PROBES` collective taken, the first of equals; a cp ring is listed from
    its slowest hop. Which leaf switches a group spans is as it comes within that period.
    The choice for tp, cp and ep depends on their degrees and the node, not on dp or pp."""
    first = rank_groups(cfg)
    g, world = cluster.gpus_per_node, cluster.world_size
    tp, cp, dp, ep = cfg.tp, cfg.cp, cfg.dp, cfg.ep
    stage = tp * cp * dp
    times: dict[tuple[str, object], float] = {}  # per (axis, layout): groups share a few
    layouts: dict[tuple[int, ...], object] = {}  # per the nodes a group's ranks are on
    per_leaf = cluster.hardware.network.nodes_per_leaf

    def time_of(axis: str, group: tuple[int, ...]) -> float:
        nodes = tuple(r // g for r in group)  # the groups built below are valid rank sets
        layout = layouts.get(nodes)
        if layout is None:
            layout = layouts[nodes] = group_layout(group, g, per_leaf)
        t = times.get((axis, layout))
        if t is None:
            kind, nbytes = _PROBES[axis]
            t = times[axis, layout] = estimate_on_layout(cluster.hardware, kind, nbytes,
                                                         layout).time_s
        return t

    def slowest(axis: str, groups) -> tuple[int, ...]:
        best, worst = None, -1.0
        for group in groups:
            t = time_of(axis, group)
            if t > worst:
                best, worst = group, t
        return best

    def strided(block: int, size: int):  # groups of `size` ranks tp apart, one per offset
        period = math.lcm(block, g)  # divides the world: the block divides the stage
        return (tuple(s + j * tp + t for j in range(size))
                for s in range(0, period, block) for t in range(tp))

    hop_times: dict[tuple[bool, bool], float] = {}

    def hop(a: int, b: int) -> float:  # a pair's layout: one node or two, one leaf or two
        na, nb = a // g, b // g
        key = (na == nb, na // per_leaf == nb // per_leaf)
        t = hop_times.get(key)
        if t is None:
            t = hop_times[key] = time_of("cp", (a, b))
        return t

    def ring(group: tuple[int, ...]) -> tuple[int, ...]:
        hops = [hop(a, b) for a, b in zip(group, group[1:] + group[:1])]
        k = hops.index(max(hops))
        return group[k:] + group[:k]

    out = {}
    if not _aligned(tp, g):
        out["tp"] = slowest("tp", (tuple(range(b, b + tp))
                                   for b in range(0, math.lcm(tp, g), tp)))
    if cp > 1 and not _aligned(tp * cp, g):
        rings = [ring(group) for group in strided(tp * cp, cp)]
        out["cp"] = max(rings, key=lambda r: hop(*r[:2]))  # the first of the slowest
    if ep > 1 and not _aligned(tp * ep, g):
        out["ep"] = slowest("ep", strided(tp * ep, ep))
    if dp * cp > 1 and not _aligned(stage, g):
        out["dp"] = slowest("dp", strided(stage, dp * cp))
    if cfg.pp > 1 and stage < g < world:  # some next stages share a node, some do not
        out["pp_hop"] = slowest("pp", ((r, r + stage)
                                       for r in range(min(math.lcm(stage, g), world - stage))))
    return dataclasses.replace(first, **out) if out else first


def op_times(op: OpCost, cluster: Cluster, dtype: str, cfg: ParallelConfig,
             kernel: str, kernels: str = "eager", loss_kernel: str = "eager"
             ) -> tuple[float, float, float]:
    """(forward, backward, weight-grad part of backward) seconds of one op on one rank. A
    cross-entropy runs on logits sharded over tp (vocabulary-parallel) and cp."""
    device = cluster.hardware.device
    tp, cp = cfg.tp, cfg.cp
    if op.kind == "gemm":
        scale = tp * cp
        fwd = gemm_time_s(device, dtype, op.flops_fwd / scale, op.bytes_fwd / scale)
        bwd = gemm_time_s(device, dtype, op.flops_bwd / scale, 2 * op.bytes_fwd / scale)
        if not op.aligned and kernels == "eager":  # fused-kernel software pads the sizes
            fwd *= unaligned_gemm_slowdown(device, dtype, backward=False)
            bwd *= unaligned_gemm_slowdown(device, dtype, backward=True)
        return fwd, bwd, bwd / 2 if op.flops_bwd >= 2 * op.flops_fwd else 0.0
    if op.kind == "attention":
        scale = tp * cp
        common = dict(io_bytes=op.bytes_fwd / scale, score_bytes=op.score_bytes / scale,
                      causal=op.causal, kernel=kernel, seq_kv=op.seq_kv / cp, kernels=kernels,
                      dropout=op.dropout)
        fwd = attention_time_s(device, dtype, flops=op.flops_fwd / scale, backward=False, **common)
        bwd = attention_time_s(device, dtype, flops=op.flops_bwd / scale, backward=True, **common)
        return fwd, bwd, 0.0
    if op.logits:
        fwd, bwd = loss_time_s(device, op.logits / (tp * cp), op.logit_bytes, loss_kernel)
        return fwd, bwd, 0.0
    split = cp * (tp if cfg.sequence_parallel or op.vocab or op.expert else 1)
    fwd = activation_memory_time_s(device, op.bytes_fwd / split, kernels)
    return fwd, BACKWARD_MEMORY_RATIO * fwd, 0.0


def _tp_time(unit: Unit, cluster: Cluster, cfg: ParallelConfig, groups: RankGroups) -> float:
    """TP communication of one forward (the backward moves the same bytes)."""
    if cfg.tp == 1 or unit.tp_points == 0:
        return 0.0
    act = unit.act_bytes / cfg.cp
    if cfg.sequence_parallel:
        per_point = (cluster.collective_time("all_gather", act, groups.tp)
                     + cluster.collective_time("reduce_scatter", act, groups.tp))
    else:
        per_point = cluster.collective_time("all_reduce", act, groups.tp)
    return unit.tp_points * per_point


def unit_times(unit: Unit, *, cluster: Cluster, dtype: str, cfg: ParallelConfig,
               groups: RankGroups, attention_kernel: str, overlap_tp: bool = False,
               kernels: str = "eager", loss_kernel: str = "eager",
               early_stop: bool = False) -> UnitTimes:
    """Per micro-batch seconds of one layer of `unit`. Full recompute re-runs a block's
    forward and its TP communication (the glue -- embedding, head, loss -- is not
    checkpointed); with `early_stop` (torch's non-reentrant checkpoint) it stops before
    the unit's tail (`OpCost.tail`: the last GEMM and what follows it in a transformer block),
    and that GEMM's row-parallel reduction, one of the unit's TP points."""
    fwd = bwd = wgrad = attn_fwd = attn_bwd = gemm_fwd = gemm_bwd = tail_fwd = 0.0
    tail_gemms = 0
    for op in unit.ops:
        f, b, w = op_times(op, cluster, dtype, cfg, attention_kernel, kernels, loss_kernel)
        fwd, bwd, wgrad = fwd + f, bwd + b, wgrad + w
        if op.tail:
            tail_fwd += f
            tail_gemms += op.kind == "gemm"
        if op.kind == "attention":
            attn_fwd, attn_bwd = attn_fwd + f, attn_bwd + b
        elif op.kind == "gemm":
            gemm_fwd, gemm_bwd = gemm_fwd + f, gemm_bwd + b
    gap = op_overhead_s(cluster.hardware.device)
    fwd += unit.num_kernels * gap
    bwd += 2 * unit.num_kernels * gap
    tp = _tp_time(unit, cluster, cfg, groups)
    tp_fwd, tp_bwd = (max(0.0, tp - gemm_fwd), max(0.0, tp - gemm_bwd)) if overlap_tp else (tp, tp)

    cp_fwd = cp_bwd = 0.0
    if cfg.cp > 1 and unit.attention_kv_bytes:
        chunk = unit.attention_kv_bytes / (cfg.cp * cfg.tp)
        # a ring is as slow as its slowest link: the wrap-around pair crosses nodes whenever
        # the group spans nodes
        hop = max(cluster.collective_time("send_recv", chunk, groups.cp[:2]),
                  cluster.collective_time("send_recv", chunk, (groups.cp[-1], groups.cp[0])))
        ring = (cfg.cp - 1) * hop
        cp_fwd = max(0.0, ring - attn_fwd)
        cp_bwd = max(0.0, 2 * ring - attn_bwd)

    ep = 0.0
    if cfg.ep > 1 and unit.moe_dispatch_bytes:
        tokens = unit.moe_dispatch_bytes / (cfg.cp * (cfg.tp if cfg.sequence_parallel else 1))
        ep = 2 * cluster.collective_time("all_to_all", tokens, groups.ep)

    if cfg.recompute == "full" and not unit.is_block:
        recompute = 0.0  # checkpointing wraps the blocks (Megatron's layers, the runtime's)
    elif cfg.recompute == "full" and early_stop:
        points = unit.tp_points
        kept = (points - min(tail_gemms, points)) / points if points else 1.0
        recompute = fwd - tail_fwd - unit.tail_kernels * gap + tp_fwd * kept
    elif cfg.recompute == "full":
        recompute = fwd + tp_fwd
    elif cfg.recompute == "selective" and attention_kernel == "math":
        recompute = attn_fwd
    else:
        recompute = 0.0
    return UnitTimes(compute_fwd=fwd, compute_bwd=bwd, compute_wgrad=wgrad, recompute=recompute,
                     tp_fwd=tp_fwd, tp_bwd=tp_bwd, cp_fwd=cp_fwd, cp_bwd=cp_bwd, ep_fwd=ep, ep_bwd=ep)
