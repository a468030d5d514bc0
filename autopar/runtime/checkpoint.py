"""Checkpoints that reshard between plans, on ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory: DCP's files (``.metadata`` and one ``__R_0.distcp`` per writing
rank) plus ``autopar_checkpoint.json``, written by rank 0, with the step it was taken after and
the layout it was written under.  Tensors are stored by the reference model's parameter names
(FQNs) and global shapes, whatever the plan: DCP's state-dict helpers
(``torch.distributed.checkpoint.state_dict``) strip the DDP / activation-checkpoint wrappers and
keep FSDP2 / tensor-parallel ``DTensor`` shards as such, and DCP writes each shard at its global
offset.  Loading under another plan (other degrees, another world size, pipeline stages instead
of data parallel, or one unsharded process) reads back exactly the pieces every rank holds.

The optimizer's state goes through the same helpers in their *flattened* form
(``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), so it reshards too: AdamW's ``exp_avg``,
``exp_avg_sq`` and ``step`` follow their parameter to whichever rank holds it under the new plan.

A pipeline rank may hold several stage modules (trimmed deep copies of the model whose names
are the reference model's) and one optimizer over all of them; they are seen as one module,
``_StageUnion``, so that one call maps every optimizer parameter to its name.

Without a process group (the generated script's ``--reference`` run) the same functions save
and load the same format in one process (DCP's single-process mode).

DCP writes each rank's shard as one block at one global offset, which a lone ``_StridedShard``
placement (tensor parallel's head-aware split of a fused qkv projection: three row blocks per
rank) is not; such tensors are written and read as ``Shard`` on the same dim (one redistribute
each way), so the files are the same whichever plan wrote them.

Not covered: expert-parallel layouts whose ranks hold different experts under one name.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.runtime.apply import RuntimeModel

if TYPE_CHECKING:
    from autopar.plan.plan import Plan

__all__ = ["INFO_FILE", "checkpoint_info", "load_checkpoint", "save_checkpoint"]

log = logging.getLogger(__name__)

INFO_FILE = "autopar_checkpoint.json"
FORMAT_VERSION = 1
REFERENCE_LAYOUT = "reference (one process, unsharded)"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


class _StageUnion(nn.Module):
    """The stage modules of one pipeline rank seen as one module, for state dicts only (it has
    no forward): every parameter and persistent buffer under the name it has in the reference
    model, taken from the stage that holds it.  Modules a stage only stands in for (blocks it
    passes through, modules outside the blocks it does not run) hold neither, so they add
    nothing."""

    def __init__(self, stages: list[nn.Module]):
        super().__init__()
        for stage in stages:
            _merge(self, getattr(stage, "module", stage) if _is_ddp(stage) else stage)


def _holds_state(module: nn.Module) -> bool:
    """Whether ``module`` or a module under it has a parameter or a persistent buffer."""
    return any(True for _ in module.parameters()) or any(
        name not in m._non_persistent_buffers_set
        for m in module.modules() for name in m._buffers)


def _merge(into: nn.Module, module: nn.Module) -> None:
    """Add ``module``'s parameters, persistent buffers and the children that hold some to
    ``into`` under the same names."""
    for name, param in module.named_parameters(recurse=False):
        _take(into, name, param, into.register_parameter)
    for name, buf in module.named_buffers(recurse=False):
        if name not in module._non_persistent_buffers_set:
            _take(into, name, buf, into.register_buffer)
    for name, child in module.named_children():
        if not _holds_state(child):
            continue
        if name not in into._modules:
            into.add_module(name, nn.Module())
        _merge(into._modules[name], child)


def _take(into: nn.Module, name: str, value: Any, register: Any) -> None:
    held = into._parameters.get(name, into._buffers.get(name))
    if held is value:
        return
    if held is not None:
        raise ValueError(f"two pipeline stages of this rank both hold {name!r}; the plan's "
                         f"stages must be disjoint")
    register(name, value)


def _is_ddp(module: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


def _state_module(model: RuntimeModel | nn.Module) -> nn.Module:
    """One module whose state-dict names are the reference model's."""
    if isinstance(model, RuntimeModel):
        return model.modules[0] if len(model.modules) == 1 else _StageUnion(model.modules)
    if isinstance(model, nn.Module):
        return model
    raise TypeError(f"expected the RuntimeModel from autopar.runtime.apply_plan or an nn.Module "
                    f"(the unsharded reference), got {type(model).__name__}")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _state(model: RuntimeModel | nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    module = _state_module(model)
    return {"model": get_model_state_dict(module, options=_OPTIONS),
            "optim": get_optimizer_state_dict(module, optimizer, options=_OPTIONS)}


def _lone_strided(t: Any) -> bool:
    """A DTensor with a ``_StridedShard`` that later mesh dims do not complete (FSDP2 + TP's
    ``(_StridedShard(0, tp), Shard(0))`` is complete: each rank's shard is one block)."""
    if not isinstance(t, DTensor):
        return False
    for i, p in enumerate(t.placements):
        if isinstance(p, _StridedShard):
            later = 1
            for j in range(i + 1, len(t.placements)):
                q = t.placements[j]
                if isinstance(q, (Shard, _StridedShard)) and q.dim == p.dim:
                    later *= t.device_mesh.size(j)
            if later != p.split_factor:
                return True
    return False


def _for_dcp(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every lone-strided DTensor redistributed to plain ``Shard`` placements."""
    out: dict[str, Any] = {}
    for section, entries in state.items():
        out[section] = dict(entries)
        for key, value in entries.items():
            if _lone_strided(value):
                plain = [Shard(p.dim) if isinstance(p, _StridedShard) else p
                         for p in value.placements]
                out[section][key] = value.redistribute(value.device_mesh, plain)
    return out


def _from_dcp(loaded: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """Loaded tensors back in the placements of ``like`` (the inverse of ``_for_dcp``)."""
    out: dict[str, Any] = {}
    for section, entries in loaded.items():
        out[section] = dict(entries)
        for key, value in entries.items():
            want = like[section][key]
            if _lone_strided(want):
                out[section][key] = value.redistribute(want.device_mesh, want.placements)
    return out


def _layout(model: RuntimeModel | nn.Module, plan: Plan) -> str:
    if not isinstance(model, RuntimeModel):
        return REFERENCE_LAYOUT
    world = dist.get_world_size() if _distributed() else 1
    label = plan.config.short() if plan is not None else "an unnamed plan"
    return f"{label} on {world} ranks"


def _write_info(path: Path, info: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{INFO_FILE}.", dir=path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path / INFO_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(path: str | Path, runtime_model: RuntimeModel | nn.Module,
                    optimizer: torch.optim.Optimizer, step: int, *,
                    plan: Plan | None = None) -> Path:
    """Write model and optimizer state after ``step`` into the directory ``path`` (collective:
    every rank calls it).  ``runtime_model`` is what ``apply_plan`` returned, or the plain model
    of a single-process reference run; ``plan`` (optional) is recorded for ``load_checkpoint``'s
    report."""
    path = Path(path)
    distributed = _distributed()
    if not distributed or dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    state = _state(runtime_model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        dcp.save(_for_dcp(state), checkpoint_id=str(path))  # creates the directory on the other ranks
    if not distributed or dist.get_rank() == 0:
        info = {"format": "autopar-checkpoint", "version": FORMAT_VERSION, "step": int(step),
                "layout": _layout(runtime_model, plan), "torch": torch.__version__,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if plan is not None:
            info["model"] = {"class": plan.model.model_class,
                             "num_params": plan.model.num_params}
            if isinstance(runtime_model, RuntimeModel):
                info["plan"] = {"config": plan.config.to_dict(), "mesh": plan.mesh.to_dict()}
        _write_info(path, info)
    if distributed:
        dist.barrier()  # the info file exists before any rank goes on
    log.info("saved checkpoint %s after step %d", path, step)
    return path


def checkpoint_info(path: str | Path) -> dict[str, Any]:
    """The small JSON record next to a checkpoint: step, layout it was written under, …"""
    path = Path(path)
    info_file = path / INFO_FILE
    if not (path / ".metadata").is_file() or not info_file.is_file():
        raise ValueError(f"{path} is not an autopar checkpoint (it needs .metadata and "
                         f"{INFO_FILE}); write one with the training script's --save DIR, or "
                         f"autopar.runtime.save_checkpoint")
    info = json.loads(info_file.read_text())
    if info.get("format") != "autopar-checkpoint" or info.get("version") != FORMAT_VERSION:
        raise ValueError(f"{info_file} is not an autopar checkpoint record of version "
                         f"{FORMAT_VERSION} (got format {info.get('format')!r}, version "
                         f"{info.get('version')!r}); re-save it with this autopar")
    return info


def _names(kind: str, names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    return f"{len(names)} {kind} ({shown}{', ...' if len(names) > 3 else ''})"


def _check_same_model(path: Path, state: dict[str, Any], info: dict[str, Any]) -> None:
    """ValueError, on every rank alike, unless the checkpoint holds exactly this model's
    parameters (names and global shapes) and the state this rank's optimizer needs."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing, reshaped, optim_missing = [], [], []
    for section, entries in state.items():
        for key, value in entries.items():
            meta = saved.get(f"{section}.{key}")
            if meta is None:
                (missing if section == "model" else optim_missing).append(key)
            elif isinstance(value, torch.Tensor) and isinstance(meta, TensorStorageMetadata) \
                    and tuple(meta.size) != tuple(value.shape):  # DTensor: the global shape
                reshaped.append(f"{key!r} has shape {list(meta.size)} in the checkpoint and "
                                f"{list(value.shape)} in this model")
    mine = (missing, reshaped, optim_missing, set(state["model"]))
    everyone = [mine]
    if _distributed():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    missing, reshaped, optim_missing = (sorted({x for rank in everyone for x in rank[i]})
                                        for i in range(3))
    held = set().union(*(rank[3] for rank in everyone))
    extra = sorted(k[6:] for k in saved if k.startswith("model.") and k[6:] not in held)
    problems = reshaped[:3]
    if missing:
        problems.append(_names("parameters of this model are not in the checkpoint", missing))
    if extra:
        problems.append(_names("parameters in the checkpoint are not in this model", extra))
    if not problems and optim_missing:
        problems.append(_names("optimizer entries are not in the checkpoint (was it saved with "
                               "another optimizer?)", optim_missing))
    if problems:
        saved_model = info.get("model", {})
        what = f" for {saved_model['class']}" if saved_model.get("class") else ""
        raise ValueError(
            f"checkpoint {path} (written{what} under {info.get('layout', '?')}) does not fit "
            f"this model: {'; '.join(problems)}. Resume with the model and optimizer it was "
            f"saved from, or train from scratch without --resume")


def load_checkpoint(path: str | Path, runtime_model: RuntimeModel | nn.Module,
                    optimizer: torch.optim.Optimizer) -> int:
    """Load model and optimizer state from ``path`` into this rank's shards, whatever plan wrote
    it (collective: every rank calls it, before training).  Returns the step it was saved after;
    training continues with the next one."""
    path = Path(path)
    info = checkpoint_info(path)
    module = _state_module(runtime_model)
    state = _state(runtime_model, optimizer)  # this layout's tensors, DCP loads into them
    _check_same_model(path, state, info)
    loaded = _for_dcp(state)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        dcp.load(loaded, checkpoint_id=str(path))
    state = _from_dcp(loaded, state)
    set_model_state_dict(module, state["model"], options=_OPTIONS)
    set_optimizer_state_dict(module, optimizer, state["optim"], options=_OPTIONS)
    log.info("loaded checkpoint %s: step %d, written under %s", path, info["step"], info["layout"])
    return int(info["step"])
