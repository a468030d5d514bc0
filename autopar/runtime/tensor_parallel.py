"""Tensor and sequence parallelism from a plan's per-parameter placements, with DTensor.

The plan says, per parameter and per mesh axis, "R" (replicated) or "S(dim)" (sharded on
that tensor dimension).  On the ``tp`` axis this module turns that into
``parallelize_module`` styles: an ``nn.Linear`` weight sharded on dim 0 is column-parallel, on
dim 1 row-parallel; an ``nn.Embedding`` sharded on dim 0 is a vocab-parallel embedding
(``RowwiseParallel`` on the embedding).  The LM head, when sharded, is column-parallel with
its logits gathered (``output_layouts=Replicate()``), so the loss needs no ``loss_parallel``.

Megatron sequence parallelism (``plan.config.sequence_parallel``) is applied only when every
block's attention and feed-forward are Megatron-shaped (all input projections column-, the
output projection row-parallel) and the embedding is vocab-parallel; otherwise it is skipped
with a warning, since the plan then replicates those blocks on the tp axis.  It is also
skipped (with a warning) under pipeline parallelism: stage boundaries carry the full sequence.

Attention modules that keep ``n_heads`` / ``n_kv_heads`` attributes (the reference models)
get them divided by the tp degree when their projections are column-parallel, because the
local projection holds only ``heads / tp`` heads.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["apply_tensor_parallel", "tp_styles"]

log = logging.getLogger(__name__)

_SHARD = re.compile(r"^S\((-?\d+)\)$")


def _tp_dim(placements: dict[str, dict[str, str]], fqn: str) -> int | None:
    """The tensor dim the plan shards parameter ``fqn`` on over the tp axis, or None."""
    spec = placements.get(fqn, {}).get("tp", "R")
    if spec in ("R", "P"):
        return None
    m = _SHARD.match(spec)
    if not m:
        raise ValueError(f"placement {spec!r} of {fqn} on the tp axis is not 'R', 'P' or 'S(d)'")
    return int(m.group(1))


def tp_styles(module: nn.Module, placements: dict[str, dict[str, str]]) -> dict[str, str]:
    """``{module FQN: "colwise" | "rowwise" | "vocab"}`` for every Linear/Embedding whose
    weight the plan shards on tp.  Raises ValueError for layouts this runtime cannot run."""
    styles: dict[str, str] = {}
    # layers that shard their own parameters on tp (expert-parallel MoE layers) are left alone
    own = [name for name, mod in module.named_modules()
           if getattr(mod, "handles_own_tensor_parallel", False)]
    for name, mod in module.named_modules():
        if not isinstance(mod, (nn.Linear, nn.Embedding)):
            continue
        if any(name.startswith(prefix + ".") for prefix in own):
            continue
        dim = _tp_dim(placements, f"{name}.weight")
        if dim is None:
            continue
        dim %= 2
        if isinstance(mod, nn.Embedding):
            if dim != 0:
                raise ValueError(f"{name}: only vocab-parallel embeddings (S(0) on tp) run; "
                                 f"the plan shards dim {dim}")
            styles[name] = "vocab"
        else:
            styles[name] = "colwise" if dim == 0 else "rowwise"
    return styles


def _megatron_blocks(module: nn.Module, styles: dict[str, str]) -> bool:
    """True when every attention/feed-forward with Linear children is column→row shaped."""
    found = False
    for name, mod in module.named_modules():
        linears = [f"{name}.{c}" for c, m in mod.named_children() if isinstance(m, nn.Linear)]
        if not linears or name in ("", "output"):
            continue
        kinds = [styles.get(fqn) for fqn in linears]
        rows = [k for k in kinds if k == "rowwise"]
        if len(rows) != 1 or any(k is None for k in kinds):
            return False
        found = True
    return found


def _shrink_heads(module: nn.Module, styles: dict[str, str], tp: int) -> None:
    for name, mod in module.named_modules():
        if not hasattr(mod, "n_heads"):
            continue
        if styles.get(f"{name}.wq") != "colwise":
            continue
        for attr in ("n_heads", "n_kv_heads"):
            heads = getattr(mod, attr, None)
            if heads is None:
                continue
            if heads % tp:
                raise ValueError(f"{name}.{attr}={heads} is not divisible by tp={tp}")
            setattr(mod, attr, heads // tp)


def apply_tensor_parallel(module: nn.Module, plan: Any, tp_mesh: Any) -> dict[str, Any]:
    """Shard ``module`` (the whole model or one pipeline stage; FQNs as in the plan) over
    ``tp_mesh`` as the plan's placements say.  Returns the style dict that was applied."""
    tp = tp_mesh.size()
    styles = tp_styles(module, plan.placements)
    if not styles:
        log.info("tp=%d but the plan replicates every parameter on tp: nothing to shard", tp)
        return {}
    fused = [n for n in styles if n.endswith(".qkv")]
    if fused:
        raise ValueError(f"column-parallel fused qkv projections ({fused[0]}) need a head-aware "
                         f"split this runtime does not have; plan with tp=1 for this model")
    sp = bool(plan.config.sequence_parallel)
    blocks_ok = _megatron_blocks(module, styles)
    embed_ok = all(styles.get(n) == "vocab" for n, m in module.named_modules()
                   if isinstance(m, nn.Embedding))
    if sp and plan.config.pp > 1:
        log.warning("sequence_parallel=True with pipeline parallel: the hidden state between "
                    "stages would be sequence-sharded, which this runtime does not pass yet; "
                    "running tensor parallel without sequence parallel")
        sp = False
    if sp and not (blocks_ok and embed_ok):
        log.warning("sequence_parallel=True but the plan's tp placements are not Megatron-shaped "
                    "in every block; running tensor parallel without sequence parallel")
        sp = False
    tp_plan: dict[str, Any] = {}
    for name, kind in styles.items():
        is_head = name == "output"
        if kind == "vocab":
            tp_plan[name] = RowwiseParallel(input_layouts=Replicate(),
                                            output_layouts=Shard(1) if sp else Replicate())
        elif is_head:
            tp_plan[name] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                            output_layouts=Replicate())
        elif kind == "colwise":
            tp_plan[name] = ColwiseParallel()
        else:
            tp_plan[name] = RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())
    if sp:
        for name, mod in module.named_modules():
            if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)):
                tp_plan[name] = SequenceParallel()
            children = [c for c, m in mod.named_children() if isinstance(m, nn.Linear)]
            if children and name != "output" and f"{name}.{children[0]}" in styles:
                n_inputs = 3 if hasattr(mod, "n_heads") else 1  # attention takes (x, cos, sin)
                tp_plan[name] = PrepareModuleInput(
                    input_layouts=(Shard(1),) + (None,) * (n_inputs - 1),
                    desired_input_layouts=(Replicate(),) + (None,) * (n_inputs - 1))
        if "output" in module._modules and "output" not in styles \
                and isinstance(module.output, nn.Linear):
            tp_plan["output"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),),
                                                   use_local_output=True)
    _shrink_heads(module, styles, tp)
    parallelize_module(module, tp_mesh, tp_plan)
    log.info("tensor parallel over %d ranks%s: %s", tp, " with sequence parallel" if sp else "",
             ", ".join(f"{k}={v}" for k, v in sorted(styles.items())))
    return tp_plan
