"""Pipeline stages and schedules from a plan, on ``torch.distributed.pipelining``.

``plan.stages`` lists, per (virtual) stage in order, the module paths it owns
(``tok_embeddings``, ``layers.3``, ``norm+output``).  Each rank builds its stage modules from a
deep copy of the full model: block containers become a ``ModuleDict`` keyed by the original
index (so parameter FQNs stay those of the reference model, and the plan's placements still
apply), and top-level modules the stage does not own become ``nn.Identity``.  The model's own
``forward`` then runs unchanged on a stage: embeddings pass the hidden state through, the
blocks iterate over the kept layers, and the head is skipped.  This needs a model whose
top-level forward is "embed → blocks → head" with nothing else that owns parameters
(the reference Llama; GPT's learned position embedding is refused on non-first stages).

Virtual stages are placed looped: rank r holds stages r, r + pp, r + 2·pp, ….
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

__all__ = ["SCHEDULES", "build_stage_modules", "make_schedule", "stage_ids_for_rank"]

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


def stage_ids_for_rank(pp_rank: int, pp: int, num_stages: int) -> list[int]:
    return list(range(pp_rank, num_stages, pp))


def _owned(stage: list[str]) -> set[str]:
    names: set[str] = set()
    for entry in stage:
        names.update(part.strip() for part in entry.split("+"))
    return names


def build_stage_modules(model: nn.Module, stages: list[list[str]], ids: list[int]) -> list[nn.Module]:
    """One module per stage id in ``ids``, each a trimmed deep copy of ``model``."""
    all_owned = set().union(*(_owned(s) for s in stages))
    out = []
    for sid in ids:
        owned = _owned(stages[sid])
        mod = copy.deepcopy(model)
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
                if name == "pos_embeddings":
                    raise ValueError("pipelining a model with learned position embeddings is not "
                                     "supported by this runtime yet")
                setattr(mod, name, nn.Identity())
        if getattr(getattr(model, "config", None), "tie_embeddings", False):
            raise ValueError("pipelining a model with tied embeddings is not supported yet")
        out.append(mod)
    return out


def make_schedule(plan: Any, stages: list[Any], n_microbatches: int, loss_fn: Any):
    """The ``torch.distributed.pipelining`` schedule for ``plan.config.pp_schedule``."""
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
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    if len(stages) != 1:
        raise ValueError(f"schedule {name!r} runs one stage per rank, this rank has {len(stages)}")
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)


def make_pipeline_stages(modules: list[nn.Module], ids: list[int], num_stages: int,
                         device: torch.device, group: Any) -> list[Any]:
    from torch.distributed.pipelining import PipelineStage

    return [PipelineStage(m, sid, num_stages, device, group=group) for m, sid in zip(modules, ids)]
