"""What the search's functions share: `SearchContext`, the problem one search (or the choice of
a plan's layout after it) solves and the memo tables it fills."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.estimate.core import EstimateOptions, EvalCache, ModelCosts
from autopar.ir import Graph
from autopar.search.settings import SearchSettings
from autopar.targets import AUTOPAR, EngineTarget

__all__ = ["SearchContext"]


@dataclass(frozen=True, kw_only=True)
class SearchContext:
    """The fixed inputs of one search: the model's costs, the cluster, the step's shape and
    software, how far the search looks and for which engine, and the memo tables its
    evaluations share. What varies within a search (the constraints of a region, the table of
    a mesh order) is passed beside it."""

    costs: ModelCosts
    """The model's per-unit costs, as the target runs it (its context and expert parallel)."""
    cluster: Cluster
    """The cluster planned within (less the memory headroom where the plan keeps it)."""
    global_batch_size: int
    """Sequences (or samples) of one training step."""
    dtype: str
    """The training precision: "bf16", "fp16", "fp8" or "fp32"."""
    options: EstimateOptions = EstimateOptions()
    """How every config is costed (kernels, overlap, optimizer, ...)."""
    settings: SearchSettings = SearchSettings()
    """How far the search looks; none of it changes what a config costs."""
    target: EngineTarget = AUTOPAR
    """The engine that runs the plan: its rules mask the space."""
    cache: EvalCache | None = None
    """Memo tables of this model and cluster (`EvalCache`), kept by the caller so that the work
    after the search reuses its unit and collective times; None where nothing is memoised."""
    graph_at: Callable[[int], Graph] | None = None
    """The model's graph traced at a micro-batch size (0: as traced), for the intra-op ILP of
    a plan's layout (`autopar.search.tp_layout.choose_layout`); None before the layout."""
