"""The rank groups a parallel configuration communicates over, laid out on the cluster.

A config's mesh (`ParallelConfig.mesh_order`, outer axis first) places its global ranks; each
axis's groups are the ranks that differ only along it (`mesh_groups`). The estimate costs a
collective on the slowest group of its axis (`slowest_groups`: a step waits for its slowest
rank), so the nodes and leaf switches a group spans decide its cost. Expert-parallel groups are
runs of ep data-parallel replicas, or, folded over tp (`ParallelConfig.folded`), runs of ep
ranks of a stage; the ranks holding the same experts reduce their gradients (`RankGroups.edp`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from autopar.cluster import Cluster
from autopar.config import DEFAULT_MESH_ORDER, ParallelConfig
from costmodels.collectives import GroupLayout, estimate_on_layout, group_layout

__all__ = ["RankGroups", "axis_strides", "mesh_groups", "rank_groups", "replica_axes",
           "slowest_groups"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankGroups:
    """Global ranks of one group per mesh axis (laid out in the config's `mesh_order`): rank
    0's (`rank_groups`), or each axis's slowest (`slowest_groups`)."""

    tp: tuple[int, ...]
    cp: tuple[int, ...]  # a ring, in ring order
    ep: tuple[int, ...]  # ep consecutive replicas of `dp`'s order; folded over tp
    # (`ParallelConfig.folded`): ep consecutive ranks of the stage's (dp, cp, tp) in mesh order
    dp: tuple[int, ...]  # data-parallel replicas of the same parameters: dp x cp ranks, the
    # outer of the two in the mesh order major (`replica_axes`)
    edp: tuple[int, ...]  # the ranks holding the same expert weights as `ep`'s first
    pp_hop: tuple[int, int] | None  # a rank and the one holding its next pipeline stage


def _sizes(cfg: ParallelConfig) -> dict[str, int]:
    return {"pp": cfg.pp, "dp": cfg.dp, "cp": cfg.cp, "tp": cfg.tp}


def axis_strides(cfg: ParallelConfig) -> dict[str, int]:
    """The rank distance between neighbours along each mesh axis: the product of the sizes of
    the axes inside it in `cfg.mesh_order` (the innermost axis has stride 1)."""
    sizes, out, stride = _sizes(cfg), {}, 1
    for axis in reversed(cfg.mesh_order):
        out[axis] = stride
        stride *= sizes[axis]
    return out


def replica_axes(cfg: ParallelConfig) -> tuple[str, str]:
    """dp and cp, the outer first: the order the data-parallel replicas (ranks holding the
    same parameters) are flattened in, and the expert-parallel groups taken from them."""
    return ("dp", "cp") if cfg.mesh_order.index("dp") < cfg.mesh_order.index("cp") \
        else ("cp", "dp")


def rank_groups(cfg: ParallelConfig) -> RankGroups:
    """The groups rank 0 belongs to."""
    s = axis_strides(cfg)
    # the data-parallel replicas, the outer of dp and cp major, as the runtime flattens its
    # (dp, cp) mesh; evenly spaced when the inner one is alone or the outer one is next to it
    (outer, n_outer), (inner, n_inner) = ((a, getattr(cfg, a)) for a in replica_axes(cfg))
    if n_inner == 1 or s[outer] == s[inner] * n_inner:
        step = s[inner] if n_inner > 1 else s[outer]
        replicas = tuple(range(0, cfg.dp * cfg.cp * step, step))
    else:
        replicas = tuple((np.arange(n_outer)[:, None] * s[outer]
                          + np.arange(n_inner) * s[inner]).ravel().tolist())
    experts = _stage_ranks(cfg)[0] if cfg.folded else replicas
    return RankGroups(tp=tuple(t * s["tp"] for t in range(cfg.tp)),
                      cp=tuple(c * s["cp"] for c in range(cfg.cp)),
                      ep=tuple(experts[:cfg.ep]), dp=replicas,
                      edp=tuple(experts[::cfg.ep]),
                      pp_hop=(0, s["pp"]) if cfg.pp > 1 else None)


def _stage_ranks(cfg: ParallelConfig) -> list[list[int]]:
    """Each pipeline stage's ranks, the (dp, cp, tp) axes flattened in mesh order (outer
    first): the order folded expert-parallel groups are cut from."""
    return mesh_groups(cfg, tuple(a for a in cfg.mesh_order if a != "pp")).tolist()


def mesh_groups(cfg: ParallelConfig, axes: tuple[str, ...]) -> np.ndarray:
    """Every group of `axes` -- the ranks that differ only along those axes -- as the rows of
    an int array, each row over `axes` flattened in the order given (the first major; given
    in mesh order, as ``DeviceMesh[axes]._flatten()`` lists them); rows in rank order of the
    other axes."""
    sizes, strides = _sizes(cfg), axis_strides(cfg)
    return _strided(cfg.world_size, tuple((strides[a], sizes[a]) for a in axes))


# the collective that ranks an axis's groups by layout, and its size: a group spread over
# more nodes, or with fewer ranks on one of them, is slower at any size
_PROBES = {"tp": ("all_reduce", 2.0**26), "cp": ("send_recv", 2.0**26),
           "ep": ("all_to_all", 2.0**26), "dp": ("all_reduce", 2.0**30),
           "pp": ("send_recv", 2.0**26)}


def _aligned(size: int, gpus_per_node: int) -> bool:
    return gpus_per_node % size == 0 or size % gpus_per_node == 0


def slowest_groups(cfg: ParallelConfig, cluster: Cluster, memo: dict | None = None
                   ) -> RankGroups:
    """One group per axis that no rank's group of that axis is slower than: a step runs at
    its slowest rank's pace.

    An axis's groups lie alike on the nodes -- each within a node, or over whole nodes with
    the same number of ranks on each -- when the block of ranks they tile (tp; tp x cp for
    cp; tp x ep for ep, ep alone when folded over tp; the stage, tp x cp x dp, for dp)
    divides the node or is a multiple of it; every rank's next pipeline stage is on another node when a stage holds a node's
    ranks or more (on the same one when the world is one node). Such an axis takes rank 0's
    group (`rank_groups`). Otherwise (tp = 3 or 6 on 8-GPU nodes, say: some tensor-parallel
    groups straddle two nodes) every group of the axis within one period of the pattern (the
    block and the node's least common multiple, at most the world) is laid out and the
    slowest by its `_PROBES` collective taken, the first of equals; a cp ring is listed from
    its slowest hop. Which leaf switches a group spans is as it comes within that period.
    The choice for tp, cp and ep depends on their degrees and the node, not on dp or pp.

    In another mesh order than the default (pp, dp, cp, tp) every group of each axis is laid
    out and the slowest taken likewise (`_slowest_groups_any_order`; `memo`, a dict kept
    for one cluster, holds its answers per axis stride and size)."""
    if cfg.mesh_order != DEFAULT_MESH_ORDER:
        return _slowest_groups_any_order(cfg, cluster, memo)
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
    if ep > 1 and cfg.folded and not _aligned(ep, g):  # runs of ep ranks in a stage
        out["ep"] = slowest("ep", (tuple(range(b, b + ep))
                                   for b in range(0, min(math.lcm(ep, g), world), ep)))
    elif ep > 1 and not cfg.folded and not _aligned(tp * ep, g):
        out["ep"] = slowest("ep", strided(tp * ep, ep))
    if dp * cp > 1 and not _aligned(stage, g):
        out["dp"] = slowest("dp", strided(stage, dp * cp))
        if not cfg.folded:
            out["edp"] = out["dp"][::ep]
    if cfg.pp > 1 and stage < g < world:  # some next stages share a node, some do not
        out["pp_hop"] = slowest("pp", ((r, r + stage)
                                       for r in range(min(math.lcm(stage, g), world - stage))))
    return dataclasses.replace(first, **out) if out else first


def _layouts(groups: np.ndarray, gpus_per_node: int, nodes_per_leaf: int) -> np.ndarray:
    """`group_layout` of each row of `groups` as the int columns (ranks, nodes, least and most
    ranks on one node, leaves), all rows at once."""
    count, n = groups.shape
    nodes = np.sort(groups // gpus_per_node, axis=1)
    starts = np.ones((count, n), dtype=bool)  # where a row's run of one node begins
    starts[:, 1:] = nodes[:, 1:] != nodes[:, :-1]
    first = np.flatnonzero(starts.ravel())  # every row starts a run, so no run spans rows
    runs = np.diff(np.append(first, count * n))
    row_first = np.searchsorted(first, np.arange(count) * n)
    leaves = nodes // nodes_per_leaf
    return np.stack((np.full(count, n), starts.sum(axis=1),
                     np.minimum.reduceat(runs, row_first), np.maximum.reduceat(runs, row_first),
                     1 + (leaves[:, 1:] != leaves[:, :-1]).sum(axis=1)), axis=1)


def _strided(world: int, dims: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The groups of ranks spaced as `dims`, a (stride, size) per axis (the first major within
    a group): one row per group, in rank order of its first rank."""
    ranks = np.arange(world)
    first = np.ones(world, dtype=bool)
    offsets = np.zeros(1, dtype=np.int64)
    for stride, size in dims:
        first &= (ranks // stride) % size == 0
        offsets = (offsets[:, None] + np.arange(size) * stride).ravel()
    return ranks[first][:, None] + offsets


def _slowest_groups_any_order(cfg: ParallelConfig, cluster: Cluster,
                              memo: dict | None = None) -> RankGroups:
    """`slowest_groups` for any mesh order: of every group of each axis (`mesh_groups`), the
    first whose nodes make its `_PROBES` collective slowest; for cp the ring whose slowest hop
    (same node, same leaf, or neither) is slowest, listed from that hop; for pp the slowest
    hop between neighbouring stages. The groups are told apart by the nodes they are on
    (`group_layout`, all at once in numpy: `_layouts`). An axis's groups follow from its
    stride and size alone (`_strided`), so `memo` (a dict of one cluster) keeps each axis's
    answer per (stride, size) across configs and orders."""
    g, per_leaf = cluster.gpus_per_node, cluster.hardware.network.nodes_per_leaf
    world, strides = cfg.world_size, axis_strides(cfg)
    memo = {} if memo is None else memo

    def time_of(axis: str, layout: GroupLayout) -> float:
        if (axis, layout) not in memo:
            kind, nbytes = _PROBES[axis]
            memo[axis, layout] = estimate_on_layout(cluster.hardware, kind, nbytes,
                                                    layout).time_s
        return memo[axis, layout]

    def slowest(axis: str, groups: np.ndarray) -> tuple[int, ...]:
        layouts = _layouts(groups, g, per_leaf)
        key = layouts[:, 1]
        for column, top in zip(layouts.T[2:], (groups.shape[1] + 1, groups.shape[1] + 1,
                                               cluster.num_nodes + 1)):
            key = key * top + column
        best, worst = None, -1.0
        for i in np.sort(np.unique(key, return_index=True)[1]):  # one group per layout
            n_ranks, n_nodes, low, high, leaves = map(int, layouts[i])
            t = time_of(axis, GroupLayout(num_ranks=n_ranks, num_nodes=n_nodes,
                                          min_ranks_per_node=low, max_ranks_per_node=high,
                                          num_leaves=leaves))
            if t > worst:
                best, worst = tuple(groups[i].tolist()), t
        return best

    def ring(stride: int, size: int) -> tuple[int, ...]:
        rings = _strided(world, ((stride, size),))
        here, there = rings // g, np.roll(rings, -1, axis=1) // g  # each hop's two nodes
        kinds = (here == there) * 2 + (here // per_leaf == there // per_leaf)
        pair = {0: (0, g * per_leaf), 1: (0, g), 3: (0, 1)}  # a hop of each kind
        hop_times = np.zeros(4)
        for kind in np.unique(kinds).tolist():  # the kinds there are (a one-node world
            hop_times[kind] = time_of("cp", group_layout(pair[kind], g, per_leaf))  # has no 0)
        per_hop = hop_times[kinds]
        k = int(np.argmax(per_hop.max(axis=1)))  # the first of the slowest rings
        return tuple(np.roll(rings[k], -int(np.argmax(per_hop[k]))).tolist())

    def hops(stride: int, size: int) -> np.ndarray:  # each rank and its next stage's
        stages = _strided(world, ((stride, size),))
        return np.stack((stages[:, :-1].ravel(), stages[:, 1:].ravel()), axis=1)

    def answer(key: tuple, make) -> tuple[int, ...]:
        if key not in memo:
            memo[key] = make()
        return memo[key]

    replicas = tuple((strides[a], getattr(cfg, a)) for a in replica_axes(cfg))
    out = {}
    if cfg.tp > 1:
        out["tp"] = answer(("tp", strides["tp"], cfg.tp), lambda: slowest(
            "tp", _strided(world, ((strides["tp"], cfg.tp),))))
    if cfg.cp > 1:
        out["cp"] = answer(("cp", strides["cp"], cfg.cp), lambda: ring(strides["cp"], cfg.cp))
    if cfg.dp * cfg.cp > 1:
        out["dp"] = answer(("dp", replicas), lambda: slowest("dp", _strided(world, replicas)))
    if cfg.dp * cfg.cp > 1 and not cfg.folded:
        out["edp"] = out["dp"][::cfg.ep]
    if cfg.ep > 1:
        pool = replicas if not cfg.folded else tuple(
            (strides[a], getattr(cfg, a)) for a in cfg.mesh_order if a != "pp")
        out["ep"] = answer(("ep", pool, cfg.ep), lambda: slowest(
            "ep", _strided(world, pool).reshape(-1, cfg.ep)))
    if cfg.pp > 1:
        out["pp_hop"] = answer(("pp", strides["pp"], cfg.pp), lambda: slowest(
            "pp", hops(strides["pp"], cfg.pp)))
    return dataclasses.replace(rank_groups(cfg), **out)
