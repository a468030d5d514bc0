"""How far the search looks, and what a caller may pin: `SearchSettings`, the constraints
(`check_constraints`: ParallelConfig fields) and the mesh orders searched (`mesh_orders`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Any

from autopar.config import DEFAULT_MESH_ORDER, ParallelConfig

__all__ = ["ALL_ORDERS", "CONFIG_FIELDS", "ORDER_RANK", "SearchSettings", "check_constraints",
           "mesh_orders"]

CONFIG_FIELDS = tuple(f.name for f in fields(ParallelConfig))
# the 24 mesh orders, the default first, the rest as itertools.permutations lists them: the
# order searched in and the last tie-break
ALL_ORDERS = (DEFAULT_MESH_ORDER,) + tuple(
    o for o in itertools.permutations(DEFAULT_MESH_ORDER) if o != DEFAULT_MESH_ORDER)
ORDER_RANK = {o: k for k, o in enumerate(ALL_ORDERS)}


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSettings:
    """How far the search looks (none of these changes what a config costs)."""

    top_k_exact: int = 16
    """Candidates for the simulated schedule (a bound skips those that cannot win)."""
    max_micro_batch_size: int = 32
    """The largest micro-batch size tried."""
    max_virtual_stages: int = 8
    """The most virtual stages per pipeline rank tried (interleaved-1f1b)."""
    max_cp: int = 16
    """The largest context-parallel degree tried."""
    recompute_every: tuple[int, ...] = (1, 2, 4)
    """Full recompute is tried on one block in each k of these (k at most the layers of each
    chunk of a pipeline rank): 1 checkpoints every block, 2 every second one."""
    progress: bool = True
    """A progress bar once a search has run for a second."""
    list_unfit_below: int = 16
    """Configs whose first pipeline rank alone exceeds memory get no row in the candidate
    table, unless fewer than this many fitting configs turn up: then it lists every config
    visited, to show the near misses (a saved plan keeps fitting rows only)."""
    memory_headroom: float = 0.02
    """Fraction of each device's memory a plan leaves free beyond the estimate's peak (which
    already adds the CUDA context, communication buffers and a 5% allocator reserve to the
    tensors). Over 36 measured one-GPU runs (`benchmarks/memory_error.py`) the allocator's
    peak over the estimate's tensors is 1.002 median, 1.09 p90, 1.15 at most; runs without
    recompute above 60% of the device are within 0.2% (a 12-layer Llama-3-8B-wide step planned
    at 97.9% of an 80 GB H100 ran), while full recompute has erred by up to +12% at 82% (a
    GPT-3-175B-wide two-layer step). 0.02 keeps the plans that ran and flags the rest: the
    report says how far the estimate has erred once a plan passes 90% of the device; raise it
    for recompute-heavy plans near the limit. `autopar.compile` plans within the device less
    this; when nothing fits there, it returns the best plan that fits the whole device and
    says so."""
    tp_layouts: str = "ilp"
    """The tensor-parallel layouts a plan may take: "ilp" (the intra-op ILP's cheapest of
    Megatron-LM's layout and, under sequence parallel for autopar's runtime, Megatron-LM's with
    sub-layers such as the MLP replicated on the sequence shard, where the whole estimate
    agrees it is faster and fits) or "megatron" (Megatron-LM's layout always; the ILP's is
    reported only). Plans for another engine (`compile(target=...)`) take Megatron-LM's."""
    mesh_orders: Any = "default"
    """The mesh orders searched (`mesh_orders`): "default" (pp, dp, cp, tp: tp innermost, as
    Megatron-LM and torchtitan lay ranks out), "all" (the 24 orders of pp, dp, cp, tp) or a list
    of orders. Each config is costed once per placement of its ranks, and in the orders after
    the first only where its bound without communication can reach the top."""

    def __post_init__(self) -> None:
        if self.tp_layouts not in ("ilp", "megatron"):
            raise ValueError(f"SearchSettings.tp_layouts must be 'ilp' or 'megatron', got "
                             f"{self.tp_layouts!r}")


def check_constraints(constraints: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of `constraints`, its fields checked and a pinned mesh order as a tuple (given
    as a list or as "dp,pp,cp,tp")."""
    constraints = dict(constraints or {})
    unknown = sorted(set(constraints) - set(CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"unknown constraint(s) {unknown}; constraints pin ParallelConfig "
                         f"fields: {', '.join(CONFIG_FIELDS)}")
    if "mesh_order" in constraints:
        constraints["mesh_order"] = ParallelConfig(
            mesh_order=constraints["mesh_order"]).mesh_order
    return constraints


def mesh_orders(value: Any) -> list[tuple[str, ...]]:
    """`SearchSettings.mesh_orders` as a list of orders, in the order searched (`ALL_ORDERS`:
    the default first): "default", "all" (the 24 orders of pp, dp, cp, tp) or a sequence of
    orders."""
    if value == "default":
        return [DEFAULT_MESH_ORDER]
    if value == "all":
        return list(ALL_ORDERS)
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"SearchSettings.mesh_orders must be 'default', 'all' or a non-empty "
                         f"list of mesh orders (e.g. [('pp', 'dp', 'cp', 'tp'), 'dp,pp,cp,tp'])"
                         f", got {value!r}")
    return sorted({ParallelConfig(mesh_order=o).mesh_order for o in value},
                  key=ORDER_RANK.__getitem__)
