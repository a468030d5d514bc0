"""`Plan`: everything needed to run and to review a parallelization, as plain data.

A plan holds the chosen `ParallelConfig`, its predicted `Estimate`, the mesh (axis names in
order pp, dp, cp, tp, sizes), the pipeline stages as lists of module paths (virtual stages in
order), per-parameter placements keyed by mesh axis ("R", "S(dim)", "P"), the training shape,
the candidates the search evaluated, and provenance (model and cluster fingerprints, autopar
version). `to_json` is deterministic (sorted keys, no timings), so the same inputs give a
byte-identical file; `save` writes atomically and `load_plan` checks the version.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from autopar.config import ParallelConfig
from autopar.estimate.core import Estimate
from autopar.plan.sections import PlanCluster, PlanMesh, PlanModel, PlanTraining

__all__ = ["PLAN_VERSION", "Plan", "PlanCluster", "PlanMesh", "PlanModel", "PlanTraining",
           "check_plan", "load_plan"]

PLAN_VERSION = 1
_SAVED_CANDIDATES = 50  # the best fitting rows of the candidate table kept in the file


def _clean(value: Any) -> Any:
    """JSON-safe, deterministic values (floats rounded to 12 significant digits)."""
    if isinstance(value, float):
        return float(f"{value:.12g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item"):  # numpy scalars from the candidate table
        return _clean(value.item())
    return value


def _estimate_dict(est: Estimate) -> dict[str, Any]:
    return {"step_time_s": est.step_time_s, "tokens_per_s": est.tokens_per_s, "mfu": est.mfu,
            "model_tflops_per_gpu": est.model_tflops_per_gpu,
            "peak_memory_bytes": est.peak_memory_bytes,
            "usable_memory_bytes": est.usable_memory_bytes, "fits": est.fits,
            "breakdown": est.breakdown, "memory_by_stage": list(est.memory_by_stage),
            "num_microbatches": est.num_microbatches,
            "stage_forward_s": list(est.stage_forward_s),
            "stage_backward_s": list(est.stage_backward_s),
            "stage_wgrad_s": list(est.stage_wgrad_s), "p2p_s": est.p2p_s}


@dataclass(frozen=True, kw_only=True)
class Plan:
    config: ParallelConfig
    estimate: Estimate
    stages: list[list[str]]
    placements: dict[str, dict[str, str]]
    mesh: PlanMesh
    model: PlanModel
    cluster: PlanCluster
    training: PlanTraining
    candidates: pd.DataFrame = field(repr=False)
    intra_op: dict[str, Any] = field(default_factory=dict)  # per block: the ILP's solution
    search: dict[str, Any] = field(default_factory=dict, repr=False)  # not saved (timings)
    version: int = PLAN_VERSION
    # what `compile` made the plan from in this process (model, cluster, example_inputs), so
    # that `explain` needs them again only after `load_plan`; not saved, not compared
    origin: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def tp_placements(self) -> dict[str, str]:
        """``{param FQN: placement on the tp axis}``: the tensor-parallel layout the plan's
        estimate costs and the runtime runs (`autopar.estimate(..., tp_placements=...)`
        re-costs it)."""
        return {fqn: axes.get("tp", "R") for fqn, axes in self.placements.items()}

    def to_dict(self) -> dict[str, Any]:
        from autopar import __version__

        table = self.candidates
        keep = table.index < _SAVED_CANDIDATES  # the table lists fitting rows first
        if "fits" in table:  # which unfit rows were listed depends on the search's memory skip
            keep = keep & table["fits"].astype(bool).to_numpy()
        if "exact" in table:  # every simulated row, so "next candidates" survive a reload
            keep = keep | table["exact"].astype(bool).to_numpy()
        top = table[keep].to_dict(orient="records")
        return _clean({
            "plan_version": self.version, "autopar_version": __version__,
            "config": self.config.to_dict(), "estimate": _estimate_dict(self.estimate),
            "mesh": self.mesh.to_dict(), "stages": self.stages, "placements": self.placements,
            "model": self.model.to_dict(), "cluster": self.cluster.to_dict(),
            "training": self.training.to_dict(),
            "intra_op": self.intra_op, "candidates": top,
        })

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write the plan atomically (a temporary file renamed over the target)."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.to_json())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def explain(self, model: Any = None, cluster: Any = None, **pins: Any):
        """The best plan under extra pins (e.g. ``plan.explain(tp=16)``) and the difference
        term by term; see `autopar.plan.explain.explain`. It re-plans: a plan `compile` made in
        this process remembers its model and cluster; a loaded one needs them passed."""
        from autopar.plan.explain import explain

        model = model if model is not None else self.origin.get("model")
        cluster = cluster if cluster is not None else self.origin.get("cluster")
        if model is None or cluster is None:
            raise ValueError("this plan was loaded, so it does not hold its model and cluster: "
                             "pass them, e.g. plan.explain(model, cluster, tp=8)")
        if "example_inputs" not in pins and self.origin.get("example_inputs") is not None:
            pins["example_inputs"] = self.origin["example_inputs"]
        return explain(self, model, cluster, **pins)

    def diff(self, other: "Plan", fmt: str = "text") -> str:
        """This plan against `other`, term by term (`autopar.plan.explain.diff`)."""
        from autopar.plan.explain import diff

        return diff(self, other, fmt)

    def report(self, fmt: str = "text") -> str:
        """The full report: rich tables as plain text, or GitHub markdown with `fmt="md"`."""
        from autopar.plan.report import render_report

        return render_report(self, fmt)


def check_plan(plan: Plan, *, model: Any = None, cluster: Any = None) -> None:
    """Raise ValueError when `plan` was made for another model (graph fingerprint) or another
    cluster (hardware fingerprint and node count), saying which and how to re-plan."""
    if cluster is not None and cluster.fingerprint() != plan.cluster.fingerprint:
        raise ValueError(
            f"this plan was made for {plan.cluster.profile} x {plan.cluster.num_nodes} "
            f"nodes, not for {cluster.name} x {cluster.num_nodes}: re-plan with "
            f"autopar.compile(model, cluster, ...) for this cluster")
    if model is not None:
        from autopar.trace import trace

        seq = plan.training.seq_len
        graph = trace(model, global_batch_size=1, seq_len=seq, dtype=plan.training.dtype) \
            if seq else None
        if graph is not None and graph.fingerprint() != plan.model.fingerprint:
            raise ValueError(
                f"this plan was made for another model ({plan.model.model_class}, "
                f"{plan.model.num_params / 1e9:.2f} B parameters; this one is "
                f"{graph.model_class}, {graph.num_params / 1e9:.2f} B): re-plan with "
                f"autopar.compile for this model")


def load_plan(path: str | Path, *, model: Any = None, cluster: Any = None) -> Plan:
    """Read a plan saved by `Plan.save`; refuses other plan versions and corrupted files, and,
    when `model` / `cluster` are given, a plan made for another model or cluster."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read plan {path}: {exc}; re-plan with autopar.compile") from None
    if not isinstance(data, dict) or data.get("plan_version") != PLAN_VERSION:
        raise ValueError(f"plan {path} has version {data.get('plan_version') if isinstance(data, dict) else None!r}; "
                         f"this autopar reads version {PLAN_VERSION}: re-plan with autopar.compile")
    try:
        cfg = ParallelConfig(**data["config"])
        e = data["estimate"]
        est = Estimate(config=cfg, step_time_s=e["step_time_s"], tokens_per_s=e["tokens_per_s"],
                       mfu=e["mfu"], model_tflops_per_gpu=e["model_tflops_per_gpu"],
                       peak_memory_bytes=e["peak_memory_bytes"],
                       usable_memory_bytes=e["usable_memory_bytes"], breakdown=e["breakdown"],
                       memory_by_stage=tuple(e["memory_by_stage"]),
                       stage_layers=tuple(tuple(s) for s in data["stages"]),
                       num_microbatches=e["num_microbatches"],
                       stage_forward_s=tuple(e.get("stage_forward_s", ())),
                       stage_backward_s=tuple(e.get("stage_backward_s", ())),
                       stage_wgrad_s=tuple(e.get("stage_wgrad_s", ())),
                       p2p_s=e.get("p2p_s", 0.0))
        plan = Plan(config=cfg, estimate=est, stages=data["stages"],
                    placements=data["placements"], mesh=PlanMesh.from_dict(data["mesh"]),
                    model=PlanModel.from_dict(data["model"]),
                    cluster=PlanCluster.from_dict(data["cluster"]),
                    training=PlanTraining.from_dict(data["training"]),
                    intra_op=data.get("intra_op", {}),
                    candidates=pd.DataFrame(data["candidates"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"plan {path} is corrupted (missing or bad field {exc}); re-plan with "
                         f"autopar.compile") from None
    if plan.mesh.axes != cfg.mesh_order:
        raise ValueError(f"plan {path} is corrupted: its mesh axes {list(plan.mesh.axes)} are "
                         f"not its config's mesh_order {list(cfg.mesh_order)}; re-plan with "
                         f"autopar.compile")
    check_plan(plan, model=model, cluster=cluster)
    return plan
