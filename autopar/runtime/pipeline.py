"""Pipeline stages and schedules from a plan, on ``torch.distributed.pipelining``.

``plan.stages`` lists, per (virtual) stage in order, the module paths it owns
(``tok_embeddings``, ``layers.3``, ``norm+output``).  Each rank builds its stage modules from a
deep copy of the full model: block containers become a ``ModuleDict`` keyed by the original
index (so parameter FQNs stay those of the reference model, and the plan's placements still
apply), and top-level modules the stage does not own become ``nn.Identity``.  The model's own
``forward`` then runs unchanged on a stage: the blocks iterate over the kept layers, the head is
skipped, and on a stage after the first the input is the previous stage's hidden state:

* a model whose only input module is a token embedding (the reference Llama) passes it through
  the ``nn.Identity`` that replaced the embedding;
* a model with more input modules (GPT: token *and* learned position embeddings, summed, then
  dropout) must say ``accepts_hidden_states = True`` and skip its input step on a floating-point
  input (``autopar.models.gpt.GPT.forward``); others are refused, since identities in place of
  both embeddings would add the hidden state to itself.

Tied parameters across stages (GPT's and Llama's ``tie_embeddings``: the LM head reuses the
token-embedding matrix) are handled as Megatron-LM does: the last stage keeps its own copy of
the matrix, held under the reference name (``tok_embeddings.weight``) by a pass-through
``_TiedHolder`` in place of the embedding module, and after every schedule step the gradients of
the copies are summed between the pipeline ranks that hold them, so the copies take identical
optimizer steps and stay equal.  The copies start equal (deep copies of one model), so the
step matches the reference, which accumulates both uses into one gradient.

Virtual stages are placed looped: rank r holds stages r, r + pp, r + 2·pp, ….
"""

from __future__ import annotations

import copy
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["SCHEDULES", "build_stage_modules", "make_pipeline_stages", "make_schedule",
           "stage_ids_for_rank", "tied_parameters"]

log = logging.getLogger(__name__)

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved-1f1b": "ScheduleInterleaved1F1B",
             "zero-bubble": "ScheduleInterleavedZeroBubble"}
MULTI_STAGE = ("interleaved-1f1b", "zero-bubble")  # schedules that take a list of stages


class _KeptLayers(nn.ModuleDict):
    """The blocks a stage keeps, keyed by their index in the full model; iterating yields the
    blocks (not the keys) in order, so ``for layer in self.layers`` still works."""

    def __iter__(self):
        return iter(self._modules.values())


class _TiedHolder(nn.Identity):
    """Stands in for a module this stage does not run (it passes its input through, like the
    ``nn.Identity`` of other skipped modules) but whose parameter the stage needs under the
    reference name, because a module the stage does run is tied to it (the last stage's LM head
    reuses ``tok_embeddings.weight``)."""


@dataclass(frozen=True)
class TiedCopy:
    """One parameter (reference FQN ``fqn``) of which the stages ``stage_ids`` each hold a copy."""

    fqn: str
    stage_ids: tuple[int, ...]


# stage module → the tied parameters of which it holds one copy (set by build_stage_modules)
_TIED: weakref.WeakKeyDictionary[nn.Module, list[TiedCopy]] = weakref.WeakKeyDictionary()


def stage_ids_for_rank(pp_rank: int, pp: int, num_stages: int) -> list[int]:
    return list(range(pp_rank, num_stages, pp))


def _owned(stage: list[str]) -> set[str]:
    names: set[str] = set()
    for entry in stage:
        names.update(part.strip() for part in entry.split("+"))
    return names


def tied_parameters(module: nn.Module) -> list[list[str]]:
    """Groups of FQNs that name one shared parameter, each in registration order (the first is
    the name ``named_parameters`` and state dicts of the optimizer use)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _top(fqn: str) -> str:
    return fqn.split(".", 1)[0]


def _is_blocks(module: nn.Module | None) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def _input_modules(model: nn.Module, stages: list[list[str]]) -> list[str]:
    """Top-level modules with parameters that the first stage runs before its blocks."""
    first = _owned(stages[0])
    return sorted(n for n, c in model.named_children()
                  if n in first and not _is_blocks(c) and any(True for _ in c.parameters()))


def _check_stage_input(model: nn.Module, stages: list[list[str]]) -> None:
    inputs = _input_modules(model, stages)
    if len(inputs) > 1 and not getattr(model, "accepts_hidden_states", False):
        raise ValueError(f"{type(model).__name__} has several input modules ({', '.join(inputs)}) "
                         f"and its forward does not take a hidden state: the stages after the "
                         f"first cannot skip them.  Allowed: one token embedding, or a model with "
                         f"accepts_hidden_states = True whose forward skips its input step on a "
                         f"floating-point input (see autopar.models.gpt.GPT); else plan with pp=1")


def _stage_entry(model: nn.Module, fqn: str) -> str:
    """The plan-stage entry a parameter belongs to: ``layers.3`` or a top-level module name."""
    parts = fqn.split(".")
    return ".".join(parts[:2]) if _is_blocks(getattr(model, parts[0], None)) else parts[0]


def _tied_across_stages(model: nn.Module, stages: list[list[str]]) -> list[TiedCopy]:
    """Tied parameter groups whose members sit in modules owned by different stages."""
    owner: dict[str, int] = {}
    for sid, stage in enumerate(stages):
        for name in _owned(stage):
            owner.setdefault(name, sid)
    out = []
    for group in tied_parameters(model):
        sids = set()
        for fqn in group:
            sid = owner.get(_stage_entry(model, fqn))
            if sid is None:
                raise ValueError(f"tied parameter {fqn} is in no plan stage; re-plan for this model")
            sids.add(sid)
        if len(sids) > 1:
            canonical = group[0]
            if canonical.count(".") != 1 or _is_blocks(getattr(model, _top(canonical))):
                raise ValueError(f"tied parameter {canonical} spans pipeline stages but is not a "
                                 f"direct parameter of a top-level module; this runtime ties only "
                                 f"those across stages (e.g. tok_embeddings.weight with "
                                 f"output.weight).  Untie it or plan with pp=1")
            out.append(TiedCopy(fqn=canonical, stage_ids=tuple(sorted(sids))))
    return out


def build_stage_modules(model: nn.Module, stages: list[list[str]], ids: list[int]) -> list[nn.Module]:
    """One module per stage id in ``ids``, each a trimmed deep copy of ``model``."""
    all_owned = set().union(*(_owned(s) for s in stages))
    if len(stages) > 1:
        _check_stage_input(model, stages)
    tied = _tied_across_stages(model, stages)
    out = []
    for sid in ids:
        owned = _owned(stages[sid])
        mod = copy.deepcopy(model)
        holders: dict[str, dict[str, nn.Parameter]] = {}
        for t in tied:
            if sid in t.stage_ids and _top(t.fqn) not in owned:  # keep the reference name
                top, pname = t.fqn.split(".")
                holders.setdefault(top, {})[pname] = getattr(getattr(mod, top), pname)
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.ModuleList):
                keep = {str(i): blk for i, blk in enumerate(child) if f"{name}.{i}" in owned}
                missing = [f"{name}.{i}" for i in range(len(child)) if f"{name}.{i}" not in all_owned]
                if missing:
                    raise ValueError(f"plan stages do not cover {missing[0]}; re-plan for this model")
                setattr(mod, name, _KeptLayers(keep))
            elif name not in owned:
                if any(True for _ in child.parameters()) and name not in all_owned:
                    raise ValueError(f"module {name!r} owns parameters but no plan stage holds it; "
                                     f"this runtime pipelines embed → blocks → head models only")
                stand_in = _TiedHolder() if name in holders else nn.Identity()
                for pname, p in holders.get(name, {}).items():
                    stand_in.register_parameter(pname, p)
                setattr(mod, name, stand_in)
        mine = [t for t in tied if sid in t.stage_ids]
        if mine:
            _TIED[mod] = mine
        out.append(mod)
    if tied:
        log.info("tied parameters across pipeline stages (gradients summed after each step): %s",
                 ", ".join(f"{t.fqn} on stages {list(t.stage_ids)}" for t in tied))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class _TiedGradientSum:
    """After a schedule step: each tied parameter's gradient becomes the sum of the gradients of
    all its copies (on this rank, and on the one other pipeline rank that holds copies).  Both
    ranks add the same two numbers (IEEE addition commutes), so the copies stay bitwise equal."""

    def __init__(self, stages: list[Any]):
        self.group = stages[0].group
        pp_rank, pp = stages[0].group_rank, stages[0].group_size
        by_fqn: dict[str, tuple[TiedCopy, list[nn.Module]]] = {}
        for stage in stages:
            for t in _TIED.get(stage.submod, []):
                by_fqn.setdefault(t.fqn, (t, []))[1].append(stage.submod)
        self.entries: list[tuple[str, list[nn.Module], int | None]] = []
        for fqn, (t, mods) in sorted(by_fqn.items()):
            peers = sorted({sid % pp for sid in t.stage_ids} - {pp_rank})
            if len(peers) > 1:
                raise NotImplementedError(f"{fqn} is tied across {len(peers) + 1} pipeline ranks; "
                                          f"this runtime sums tied gradients between two ranks "
                                          f"only.  Untie it or use fewer pipeline ranks")
            self.entries.append((fqn, mods, peers[0] if peers else None))

    def __call__(self) -> None:
        import torch.distributed as dist

        for fqn, mods, peer in self.entries:
            grads = []
            for m in mods:  # looked up now: FSDP swaps the registered parameter objects
                p = dict(m.named_parameters())[fqn]
                if p.grad is None:
                    raise RuntimeError(f"tied parameter {fqn} got no gradient on this stage")
                if hasattr(p.grad, "placements") and p.grad.placements != p.placements:
                    # e.g. a vocab-parallel embedding's gradient comes back Replicate
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
                grads.append(_local(p.grad))
            total = grads[0].clone()
            for g in grads[1:]:
                total += g
            if peer is not None:
                theirs = torch.empty_like(total)
                for req in dist.batch_isend_irecv([
                        dist.P2POp(dist.isend, total, group=self.group, group_peer=peer),
                        dist.P2POp(dist.irecv, theirs, group=self.group, group_peer=peer)]):
                    req.wait()
                total += theirs
            for g in grads:
                g.copy_(total)


class _ScheduleWithTiedSum:
    """The plan's schedule, followed on every ``step`` by the tied-gradient sum."""

    def __init__(self, schedule: Any, tied_sum: _TiedGradientSum):
        self._schedule, self._tied_sum = schedule, tied_sum

    def step(self, *args: Any, **kwargs: Any) -> Any:
        out = self._schedule.step(*args, **kwargs)
        self._tied_sum()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._schedule, name)


def make_schedule(plan: Any, stages: list[Any], n_microbatches: int, loss_fn: Any):
    """The ``torch.distributed.pipelining`` schedule for ``plan.config.pp_schedule`` (with the
    tied-gradient sum after each step when this rank holds a tied parameter's copy)."""
    from torch.distributed.pipelining import schedules

    name = plan.config.pp_schedule
    if name not in SCHEDULES:
        raise NotImplementedError(f"pipeline schedule {name!r} is not in this runtime yet "
                                  f"(runs: {', '.join(SCHEDULES)}); pin pp_schedule when compiling")
    cls = getattr(schedules, SCHEDULES[name])
    if n_microbatches < plan.config.pp:
        raise ValueError(f"{n_microbatches} micro-batches is fewer than the {plan.config.pp} "
                         f"pipeline ranks; lower micro_batch_size")
    if name in MULTI_STAGE:
        schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    elif len(stages) != 1:
        raise ValueError(f"schedule {name!r} runs one stage per rank, this rank has {len(stages)}")
    else:
        schedule = cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    if any(_TIED.get(s.submod) for s in stages):
        return _ScheduleWithTiedSum(schedule, _TiedGradientSum(stages))
    return schedule


def make_pipeline_stages(modules: list[nn.Module], ids: list[int], num_stages: int,
                         device: torch.device, group: Any) -> list[Any]:
    from torch.distributed.pipelining import PipelineStage

    return [PipelineStage(m, sid, num_stages, device, group=group) for m, sid in zip(modules, ids)]
