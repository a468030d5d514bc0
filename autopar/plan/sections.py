"""The typed sections of a `Plan`: its mesh, the model and cluster it was made for, and the
training shape and software it was costed with. Each saves as a JSON object under the key
names the plan file has always used (`to_dict`, `from_dict`); a field that is None where the
file leaves it out (e.g. `PlanTraining.input` of a token model) is not written.

Reading a section by its saved key (``plan.training["dtype"]``) still works, for scripts
written against the plan file's objects; code in autopar reads the attributes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["PlanCluster", "PlanMesh", "PlanModel", "PlanTraining"]


class _Section:
    """Saving, loading and read access by saved key, shared by the sections."""

    _KEYS: ClassVar[dict[str, str]] = {}  # attribute -> saved key, where they differ
    _OMIT_NONE: ClassVar[frozenset[str]] = frozenset()  # attributes left out when None

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in self._OMIT_NONE:
                continue
            out[self._KEYS.get(f.name, f.name)] = list(value) if isinstance(value, tuple) \
                else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        """The section saved as `data`; raises KeyError for a required key it lacks and
        TypeError for a key it does not know."""
        if not isinstance(data, dict):
            raise TypeError(f"{cls.__name__} must be a JSON object, got {type(data).__name__}")
        saved = {cls._KEYS.get(f.name, f.name): f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(saved))
        if unknown:
            raise TypeError(f"{cls.__name__} has no field(s) {unknown}")
        kwargs = {}
        for key, f in saved.items():
            if key in data:
                kwargs[f.name] = tuple(data[key]) if f.type.startswith("tuple") else data[key]
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise KeyError(key)
        return cls(**kwargs)

    def _attribute(self, key: str) -> str:
        names = {v: k for k, v in self._KEYS.items()}
        name = names.get(key, key)
        if name not in {f.name for f in dataclasses.fields(self)}:
            raise KeyError(key)
        return name

    def __getitem__(self, key: str) -> Any:
        name = self._attribute(key)
        value = getattr(self, name)
        if value is None and name in self._OMIT_NONE:
            raise KeyError(key)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return key in self.to_dict()


@dataclass(frozen=True, kw_only=True)
class PlanMesh(_Section):
    """The device mesh the plan runs on."""

    axes: tuple[str, ...]
    """The mesh axes, outermost first: the config's `mesh_order` (pp, dp, cp, tp by default)."""
    sizes: tuple[int, ...]
    """Each axis' degree, in the order of `axes`."""
    ep: int = 1
    """Expert-parallel degree: ranks that each hold a part of the experts."""
    ep_within: str = "dp*cp"
    """The ranks expert parallelism draws from: "dp*cp", or "tp*cp*dp" when the experts are
    whole on each rank and ep is folded over tensor parallel (`ParallelConfig.etp = 1`)."""


@dataclass(frozen=True, kw_only=True)
class PlanModel(_Section):
    """The model the plan was made for."""

    _KEYS: ClassVar[dict[str, str]] = {"model_class": "class"}
    _OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"fused_projections",
                                                      "summed_row_weights"})

    model_class: str
    """The traced module's class name (saved as "class")."""
    fingerprint: str
    """Hash of the traced graph: `load_plan(..., model=)` refuses a plan for another model."""
    num_params: int
    """Parameters of the model, in total."""
    num_layers: int
    """Repeated blocks the pipeline cuts between."""
    cp_layout: str = "zigzag"
    """How autopar's runtime runs context parallel on this model: "zigzag" (load-balanced
    chunks through autopar's attention), or "contiguous" (the model's own attention on
    sequence-sharded DTensors)."""
    ep_dispatch: str = "all_to_all"
    """How autopar's runtime sends tokens to their experts: "all_to_all", or "all_gather"
    (every expert-parallel rank gathers the tokens and runs the MoE layer's own forward)."""
    fused_projections: dict[str, int] | None = None
    """``{param FQN: k}`` for each fused projection whose output is k head-major chunks, each
    of which column parallel splits; None where the model has none."""
    summed_row_weights: list[str] | None = None
    """The parameters of row-parallel GEMMs whose partial outputs the plan sums before one
    reduction over tp (a parallel attention and MLP), every layer; None where it sums none."""


@dataclass(frozen=True, kw_only=True)
class PlanCluster(_Section):
    """The cluster the plan was made for."""

    profile: str
    """The hardware profile's name (e.g. "dgx-h100")."""
    num_nodes: int
    """Nodes of the profile."""
    world_size: int
    """Ranks in all: the number to launch with torchrun."""
    fingerprint: str
    """Hash of the hardware description: `load_plan(..., cluster=)` refuses another cluster."""


@dataclass(frozen=True, kw_only=True)
class PlanTraining(_Section):
    """The training shape, precision and software the plan was costed for."""

    _OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"input", "fp8_weights", "unrestricted"})

    global_batch_size: int
    """Sequences (or samples) per optimizer step, over all data-parallel ranks."""
    seq_len: int | None
    """Tokens per sequence; None for a model planned from `example_inputs`."""
    dtype: str
    """Training precision: "bf16", "fp16", "fp8" or "fp32"."""
    input: dict[str, Any] | None = None
    """Shape and dtype of one micro-batch's `example_inputs`, for a model planned from them."""
    constraints: dict[str, Any] = field(default_factory=dict)
    """The ParallelConfig fields the plan was pinned to."""
    fp8_weights: list[str] | None = None
    """The weights whose GEMMs run in FP8, for an "fp8" plan."""
    memory_headroom: float = 0.0
    """Fraction of device memory the search kept free (`SearchSettings.memory_headroom`)."""
    memory_headroom_kept: bool = True
    """False when no plan fit within the headroom and the plan uses the whole device."""
    device_memory_bytes: float | None = None
    """The device memory the plan was costed against."""
    software: str | None = None
    """The software preset the plan was costed with (`autopar.SOFTWARE`); None for options
    matching no preset."""
    options: dict[str, Any] = field(default_factory=dict)
    """Every `EstimateOptions` field the estimate assumed, by name."""
    target: str = "autopar"
    """The engine the plan is for: "autopar", "megatron", "torchtitan" or "deepspeed"."""
    unrestricted: dict[str, Any] | None = None
    """For another engine than autopar's: the best plan for autopar's runtime under the same
    pins and software (its "step_time_s" and "config"), or the "reason" there is none."""

    @property
    def estimate_options(self) -> Any:
        """`options` as the `EstimateOptions` they name (fields this autopar does not know,
        from another version's plan, left out)."""
        from autopar.estimate.options import EstimateOptions

        known = EstimateOptions.__dataclass_fields__
        return EstimateOptions(**{k: v for k, v in self.options.items() if k in known})
