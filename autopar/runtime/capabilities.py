"""What this runtime can run for a given model, known at compile time (compile returns only
plans the runtime can run for the model it was given).

``runtime_limits`` names, per parallelism axis this runtime cannot run for the model, the
reason; ``autopar.compile`` keeps the search to degree 1 on those axes and refuses a pin above
1 with the reason.  Every check reads the model's structure or its traced forward, never
module names:

* pipeline parallel: the model takes token ids (the stages read each micro-batch's tokens), has
  a block list (``structure.block_slots``) and no parameter shared between a block and
  anything else (no stage split holds it once);
* context parallel: the model's attention goes through the ``SequenceShard`` hook of
  ``autopar.models.common.attention`` (ring attention and global positions come through it);
* expert parallel: the model's MoE layers are ones ``expert_parallel`` can split.
"""

from __future__ import annotations

from torch import nn

from autopar.ir import Graph, OpKind
from autopar.runtime.pipeline import tied_parameters
from autopar.runtime.structure import block_names

__all__ = ["runtime_limits"]


def _pipeline_limit(model: nn.Module, token_model: bool) -> str | None:
    if not token_model:
        return ("pipeline parallel in this runtime runs token models (inputs [batch, seq] of "
                "token ids), and this model takes other inputs")
    blocks = block_names(model)
    if not blocks:
        return (f"{type(model).__name__} has no block list (a ModuleList, Sequential or "
                f"ModuleDict of two or more modules of one class) to cut into pipeline stages")
    for group in tied_parameters(model):
        homes = {next((b for b in blocks if n.startswith(b + ".")), None) for n in group}
        if len(homes) > 1 and homes != {None}:
            return (f"parameter {group[0]} is shared by {', '.join(group)}: a parameter of a "
                    f"block used elsewhere cannot be cut into pipeline stages")
    return None


def runtime_limits(model: nn.Module, graph: Graph, *, token_model: bool,
                   attention_hook_calls: int, num_experts: int | None) -> dict[str, str]:
    """``{axis: reason}`` for each of pp, cp, ep that this runtime cannot run for ``model``
    (traced as ``graph``; ``attention_hook_calls``: the calls of
    ``autopar.models.common.attention`` during the trace; ``num_experts``: the experts the
    search would split over ep)."""
    from autopar.runtime.expert_parallel import find_moe_modules

    limits = {}
    reason = _pipeline_limit(model, token_model)
    if reason:
        limits["pp"] = reason
    kinds = {node.kind for node in graph.nodes}
    if OpKind.ATTENTION in kinds and not attention_hook_calls:
        limits["cp"] = ("context parallel in this runtime needs the model's attention to go "
                        "through autopar.models.common.attention (its SequenceShard hook runs "
                        "ring attention at global positions); this model computes attention "
                        "itself")
    if (num_experts or OpKind.MOE_DISPATCH in kinds) and not find_moe_modules(model):
        limits["ep"] = ("expert parallel in this runtime splits MoE layers with a router "
                        "nn.Linear, an nn.ModuleList of experts and a top-k setting it can "
                        "read; this model's MoE layers are written otherwise")
    return limits
