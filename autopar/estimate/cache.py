"""The memo tables of one (model, cluster) search (`EvalCache`) and the keys of what a
config's estimate takes from its mesh order (`order_key`, `placement_key`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from autopar.cluster import Cluster
from autopar.config import DEFAULT_MESH_ORDER, ParallelConfig
from autopar.estimate.layout import Structure, UnitVectors
from autopar.estimate.groups import RankGroups, slowest_groups
from autopar.estimate.timing import UnitCompute, UnitTimes
from autopar.estimate.units import Unit
from costmodels.collectives import GroupLayout, LayoutTimer

__all__ = ["EvalCache", "order_key", "placement_key"]


class EvalCache:
    """Memo tables for one (model, cluster) search, owned by the caller: scaled units and
    per-unit times (and their vectors) per (micro-batch, tp, cp, ep, SP, recompute), layer
    splits per (pp, v, boundaries), prepared layouts per both, rank groups and collective
    times. Every entry is a pure function of its key, so sharing a cache never changes a
    result. Duck-types the parts of `Cluster` the timing code uses."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.hardware = cluster.hardware
        self.world_size = cluster.world_size
        self.units: dict[int, tuple[Unit, ...]] = {}
        self.times: dict[tuple, dict[str, UnitTimes]] = {}
        self.compute: dict[tuple, dict[str, UnitCompute]] = {}  # per `core._degrees_key`
        # `autopar.estimate.bounds.unit_work`, per id(times)
        self.work: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.layouts: dict[tuple, Any] = {}  # `core._prepared`'s
        self.structures: dict[tuple, Structure | str] = {}
        self.vectors: dict[tuple, UnitVectors] = {}
        self.groups: dict[tuple, RankGroups] = {}
        self.group_memo: dict = {}  # `slowest_groups` in other mesh orders, per axis stride
        self.order_keys: dict[tuple, tuple] = {}  # `order_key`, per (tp, cp, ep) groups
        self._comm: dict[tuple, float] = {}
        self._timers: dict[tuple, LayoutTimer] = {}

    def collective_time(self, kind: str, nbytes: float, ranks) -> float:
        """`Cluster.collective_time`, memoised; each group is checked and laid out once."""
        group = ranks if type(ranks) is tuple else tuple(ranks)
        key = (kind, nbytes, group)
        t = self._comm.get(key)
        if t is None:
            t = self._comm[key] = self._timer(group).time_s(kind, nbytes)
        return t

    def group_layout(self, group: tuple[int, ...]) -> GroupLayout:
        """`Cluster.group_layout`, memoised."""
        return self._timer(group).layout

    def _timer(self, group: tuple[int, ...]) -> LayoutTimer:
        timer = self._timers.get(group)
        if timer is None:
            timer = self._timers[group] = LayoutTimer(self.hardware,
                                                      self.cluster.group_layout(group))
        return timer


def _rank_groups(cache: EvalCache, config: ParallelConfig) -> RankGroups:
    key = (config.tp, config.cp, config.dp, config.ep, config.folded, config.pp > 1)
    if config.mesh_order != DEFAULT_MESH_ORDER:  # strides there can hold dp and pp too
        key += (config.mesh_order, config.pp)
    if key not in cache.groups:
        cache.groups[key] = slowest_groups(config, cache.cluster, cache.group_memo)
    return cache.groups[key]


def order_key(cache: EvalCache, config: ParallelConfig) -> tuple:
    """What per-unit times depend on besides `core._times_key`'s degrees in a mesh order other
    than the default (where the tp, cp and ep groups follow from those degrees alone): the
    layouts of the tp group, of the cp ring's two costed hops and of the ep group."""
    if config.mesh_order == DEFAULT_MESH_ORDER:
        return ()
    return ("layouts",) + _unit_layouts(cache, _rank_groups(cache, config))


def _unit_layouts(cache: EvalCache, groups: RankGroups) -> tuple:
    key = (groups.tp, groups.cp, groups.ep)
    found = cache.order_keys.get(key)
    if found is None:
        layout = cache.group_layout
        ring = groups.cp
        found = cache.order_keys[key] = (
            layout(groups.tp),
            (layout(ring[:2]), layout((ring[-1], ring[0]))) if len(ring) > 1 else (),
            layout(groups.ep))
    return found


def placement_key(cache: EvalCache, config: ParallelConfig) -> tuple:
    """All that a config's estimate takes from its mesh order: the layouts (`group_layout`)
    of the groups it costs -- tp, the cp ring's two costed hops, ep, the data-parallel
    replicas and the expert replicas among them, the pipeline hop. Two orders that give a
    config the same key give it the same estimate."""
    groups = _rank_groups(cache, config)
    layout = cache.group_layout
    return _unit_layouts(cache, groups) + (
        layout(groups.dp), layout(groups.edp) if config.ep > 1 else (),
        layout(groups.pp_hop) if groups.pp_hop is not None else ())
