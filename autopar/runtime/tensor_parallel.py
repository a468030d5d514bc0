"""Tensor and sequence parallelism from a plan's per-parameter placements, with DTensor.

The plan says, per parameter and per mesh axis, "R" (replicated) or "S(dim)" (sharded on
that tensor dimension).  On the ``tp`` axis this module turns that into
``parallelize_module`` styles: an ``nn.Linear`` weight sharded on dim 0 is column-parallel, on
dim 1 row-parallel; an ``nn.Embedding`` sharded on dim 0 is a vocab-parallel embedding
(``RowwiseParallel`` on the embedding); an ``nn.Conv1d/2d/3d`` sharded on dim 0 is
output-channel parallel (``ChannelParallel``: each rank convolves the full input with its
channels, the output is all-gathered on the channel dim, so batch norms and residual adds see
the full activation; input-channel and grouped convolutions are refused).  A parameter the
plan shards on tp that none of these runs is replicated, and a warning lists it (its memory per
rank is then above the plan's estimate).  The LM head, when sharded, is column-parallel; with
``loss_parallel=True`` (the runtime's default loss) its logits stay sharded on the vocabulary as
a DTensor for DTensor's ``loss_parallel`` cross entropy, otherwise they are gathered
(``output_layouts=Replicate()``) for a loss function that expects plain tensors.

Megatron sequence parallelism (``plan.config.sequence_parallel``) is applied only when every
block's attention and feed-forward are Megatron-shaped (all input projections column-, the
output projection row-parallel); otherwise it is skipped with a warning, since the plan then
replicates those blocks on the tp axis.  A vocab-parallel embedding emits the sequence shard
itself; a replicated one (GPT's learned positions) has its output cut to it.  Sequence
parallelism is also skipped (with a warning) under pipeline parallelism: stage boundaries carry
the full sequence.

Fused projections (a Linear named ``qkv`` whose output the model views as
``(3, n_heads, head_dim)``: GPT, ViT) are split head-aware: rank r holds the q, k and v rows of
its ``n_heads / tp`` heads.  The parameter is a DTensor placed ``_StridedShard(0, split_factor=3)``
(three chunks, each sharded over tp), so it still *is* the reference tensor for ``full_tensor()``,
state dicts and checkpoints (checkpoint.py converts the layout for DCP, which cannot write it).
DTensor's ``F.linear`` on that placement gives each rank exactly its heads' columns.  When
ZeRO ≥ 1 follows, FSDP2 shards the fused weight over dp on dim 1 (data_parallel.py), since its
rows cannot be split again without breaking the heads; its 1-D bias has no second dim, so it
stays replicated on tp and each rank slices its heads in forward (a warning says so).

Parameters tied to each other (``tie_embeddings``: the LM head reuses the token embedding) take
the placement of the first name, and are tied again after sharding (the styles distribute each
module's parameters separately).

Attention modules that keep ``n_heads`` / ``n_kv_heads`` attributes (the reference models)
get them divided by the tp degree when their projections are column-parallel, because the
local projection holds only ``heads / tp`` heads.
"""

from __future__ import annotations

import inspect
import logging
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.runtime.pipeline import tied_parameters

__all__ = ["ChannelParallel", "apply_tensor_parallel", "tp_styles", "vocab_sharded_head"]

log = logging.getLogger(__name__)

_SHARD = re.compile(r"^S\((-?\d+)\)$")
FUSED_CHUNKS = {"qkv": 3}  # fused projections by Linear name: their output's leading chunks
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _aliases(module: nn.Module) -> dict[str, str]:
    """{FQN: first FQN of the same parameter} for tied parameters (the plan keys the first)."""
    return {name: group[0] for group in tied_parameters(module) for name in group[1:]}


def _tp_dim(placements: dict[str, dict[str, str]], fqn: str) -> int | None:
    """The tensor dim the plan shards parameter ``fqn`` on over the tp axis, or None."""
    spec = placements.get(fqn, {}).get("tp", "R")
    if spec in ("R", "P"):
        return None
    m = _SHARD.match(spec)
    if not m:
        raise ValueError(f"placement {spec!r} of {fqn} on the tp axis is not 'R', 'P' or 'S(d)'")
    return int(m.group(1))


def _own_prefixes(module: nn.Module) -> list[str]:
    """Layers that shard their own parameters on tp (expert-parallel MoE layers)."""
    return [name for name, mod in module.named_modules()
            if getattr(mod, "handles_own_tensor_parallel", False)]


def _conv_style(name: str, mod: nn.Module, dim: int) -> str:
    """"channels" for a convolution the plan shards on its output channels; ValueError (naming
    the module) for the conv layouts this runtime cannot run."""
    if type(mod) not in _CONVS:
        raise ValueError(f"{name}: tensor parallel runs plain nn.Conv1d/2d/3d, this is a "
                         f"{type(mod).__name__} with its own class; plan this model with tp=1 "
                         f"(constraints={{'tp': 1}}) or use a plain convolution")
    if dim != 0:
        raise ValueError(f"{name}: the plan shards this convolution's weight on dim {dim} "
                         f"(input channels) over tp; this runtime runs only output-channel "
                         f"parallel convolutions (S(0) on tp); plan this model with tp=1 "
                         f"(constraints={{'tp': 1}})")
    if mod.groups != 1:
        raise ValueError(f"{name}: a grouped convolution (groups={mod.groups}) cannot be split "
                         f"on its output channels by this runtime (each group reads its own "
                         f"input channels); only groups=1 convolutions run tensor-parallel: "
                         f"plan this model with tp=1 (constraints={{'tp': 1}})")
    return "channels"


def tp_styles(module: nn.Module, placements: dict[str, dict[str, str]]) -> dict[str, str]:
    """``{module FQN: "colwise" | "heads" | "rowwise" | "vocab" | "channels"}`` for every
    Linear/Embedding/Conv whose weight the plan shards on tp ("heads": a fused qkv projection,
    column-parallel by head; "channels": an output-channel parallel convolution).  A tied
    weight follows the placement of its first name.  Raises ValueError for layouts this
    runtime cannot run."""
    styles: dict[str, str] = {}
    aliases = _aliases(module)
    own = _own_prefixes(module)  # left alone
    for name, mod in module.named_modules():
        if not isinstance(mod, (nn.Linear, nn.Embedding, *_CONVS)):
            continue
        if any(name.startswith(prefix + ".") for prefix in own):
            continue
        weight = f"{name}.weight"
        dim = _tp_dim(placements, aliases.get(weight, weight))
        if dim is None:
            continue
        dim %= mod.weight.dim()
        if isinstance(mod, _CONVS):
            styles[name] = _conv_style(name, mod, dim)
        elif isinstance(mod, nn.Embedding):
            if dim != 0:
                raise ValueError(f"{name}: only vocab-parallel embeddings (S(0) on tp) run; "
                                 f"the plan shards dim {dim}")
            styles[name] = "vocab"
        elif dim == 0 and name.rsplit(".", 1)[-1] in FUSED_CHUNKS:
            styles[name] = "heads"
        else:
            styles[name] = "colwise" if dim == 0 else "rowwise"
    return styles


class _HeadParallelLinear(nn.Linear):
    """A fused projection (``chunks`` equal parts of the output, e.g. q, k, v) whose parameters
    are DTensors on the tp mesh; forward returns this rank's local ``[..., out / tp]`` columns:
    the rows of its heads in each chunk, in chunk order.  The input's gradient is summed over tp
    (DTensor turns the partial gradient of the replicated input into an all-reduce)."""

    chunks: int = 3

    def _heads(self, p: DTensor | None) -> DTensor | None:
        if p is None:
            return None
        heads = (_StridedShard(0, split_factor=self.chunks),)
        # replicated on tp (FSDP follows): a local slice, whose gradient DTensor all-gathers
        return p if tuple(p.placements) == heads else p.redistribute(p.device_mesh, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = self.weight.device_mesh
        if isinstance(x, DTensor):  # sequence parallel: gathered by PrepareModuleInput
            x = x.redistribute(mesh, (Replicate(),))
        else:
            x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        return F.linear(x, self._heads(self.weight), self._heads(self.bias)).to_local()


class HeadParallel(ParallelStyle):
    """Column parallelism of a fused projection by head: parameters placed
    ``_StridedShard(0, chunks)`` (those named in ``replicate``: Replicate), module turned into a
    ``_HeadParallelLinear``.  Parameter names and global shapes are unchanged."""

    def __init__(self, chunks: int, *, replicate: tuple[str, ...] = ()):
        super().__init__()
        self.chunks, self.replicate = chunks, replicate

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if type(module) is not nn.Linear:
            raise ValueError(f"head-parallel split needs a plain nn.Linear, got "
                             f"{type(module).__name__}; plan with tp=1 for this model")
        tp = device_mesh.size()
        if module.out_features % (self.chunks * tp):
            raise ValueError(f"a fused projection of {module.out_features} outputs does not split "
                             f"into {self.chunks} chunks of tp={tp} equal parts; pick tp dividing "
                             f"the number of heads")
        for name, p in list(module.named_parameters(recurse=False)):
            placements = (Replicate(),) if name in self.replicate else \
                (_StridedShard(0, split_factor=self.chunks),)
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(p.detach(), device_mesh, placements,
                                  src_data_rank=self.src_data_rank),
                requires_grad=p.requires_grad))
        module.__class__ = _HeadParallelLinear
        module.chunks = self.chunks
        return module


class _ChannelParallelConv:
    """Forward of an output-channel parallel convolution whose weight (and bias) are DTensors
    ``Shard(0)`` on the tp mesh: this rank convolves the replicated input with its channels, and
    the output is all-gathered on the channel dim (dim 1), so the next layer sees the full
    activation.  Backward: the output gradient is cut to this rank's channels (no traffic) and
    the input gradient, a partial sum over the local channels, is all-reduced over tp."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = self.weight.device_mesh
        if isinstance(x, DTensor):
            x = x.redistribute(mesh, (Replicate(),))
        else:
            x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        # the local input gradient covers only this rank's channels: Partial, summed in backward
        x = x.to_local(grad_placements=(Partial(),))
        bias = None if self.bias is None else self.bias.to_local()
        out = self._conv_forward(x, self.weight.to_local(), bias)
        out = DTensor.from_local(out, mesh, (Shard(1),), run_check=False)
        return out.redistribute(mesh, (Replicate(),)).to_local()


class ChannelParallelConv1d(_ChannelParallelConv, nn.Conv1d):
    """``nn.Conv1d`` run output-channel parallel (see ``_ChannelParallelConv``)."""


class ChannelParallelConv2d(_ChannelParallelConv, nn.Conv2d):
    """``nn.Conv2d`` run output-channel parallel (see ``_ChannelParallelConv``)."""


class ChannelParallelConv3d(_ChannelParallelConv, nn.Conv3d):
    """``nn.Conv3d`` run output-channel parallel (see ``_ChannelParallelConv``)."""


_CHANNEL_PARALLEL = {nn.Conv1d: ChannelParallelConv1d, nn.Conv2d: ChannelParallelConv2d,
                     nn.Conv3d: ChannelParallelConv3d}


class ChannelParallel(ParallelStyle):
    """Output-channel parallelism of a convolution: weight and bias become ``Shard(0)`` DTensors
    on the tp mesh (the reference tensors for ``full_tensor()``, state dicts, checkpoints and
    FSDP2), and the module runs as ``ChannelParallelConv{1,2,3}d``.  Input and output are plain
    replicated tensors; parameter names and global shapes are unchanged."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        cls = _CHANNEL_PARALLEL.get(type(module))
        if cls is None:
            raise ValueError(f"output-channel parallel runs a plain nn.Conv1d/2d/3d, got "
                             f"{type(module).__name__}; plan this model with tp=1")
        tp = device_mesh.size()
        if module.groups != 1 or module.out_channels % tp:
            raise ValueError(f"a convolution of {module.out_channels} output channels and "
                             f"groups={module.groups} does not split into tp={tp} equal "
                             f"channel slices (needs groups=1 and channels divisible by tp); "
                             f"pick a tp that divides the channels, or plan with tp=1")
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(p.detach(), device_mesh, (Shard(0),),
                                  src_data_rank=self.src_data_rank),
                requires_grad=p.requires_grad))
        module.__class__ = cls
        return module


class SequenceShardOutput(ParallelStyle):
    """Sequence parallel for a replicated embedding (learned positions): its output ``[..., seq,
    dim]`` is cut to this rank's sequence shard, to add to the sequence-sharded hidden state.
    The backward all-gathers the output gradient, so every rank's weight gradient is full."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def cut(_mod, _inputs, out):
            full = DTensor.from_local(out, device_mesh, (Replicate(),), run_check=False)
            return full.redistribute(device_mesh, (Shard(out.dim() - 2),)).to_local()

        module.register_forward_hook(cut)
        return module


def _retie(module: nn.Module, groups: list[list[str]]) -> None:
    """Tie again the parameters that shared one tensor before sharding, to the sharded one."""
    for group in groups:
        params = [module.get_parameter(fqn) for fqn in group]
        sharded = [p for p in params if isinstance(p, DTensor)]
        if not sharded:
            continue
        keep = sharded[0]
        for fqn, p in zip(group, params):
            if isinstance(p, DTensor) and (p.placements, p.device_mesh) != \
                    (keep.placements, keep.device_mesh):
                raise ValueError(f"tied parameters {group[0]} and {fqn} were sharded differently "
                                 f"({keep.placements} vs {p.placements}); give them one placement "
                                 f"or untie them")
            owner, _, name = fqn.rpartition(".")
            setattr(module.get_submodule(owner), name, keep)


def _megatron_blocks(module: nn.Module, styles: dict[str, str]) -> bool:
    """True when every attention/feed-forward with Linear children is column→row shaped."""
    found = False
    for name, mod in module.named_modules():
        linears = [f"{name}.{c}" for c, m in mod.named_children() if isinstance(m, nn.Linear)]
        if not linears or name in ("", "output"):
            continue
        kinds = [styles.get(fqn) for fqn in linears]
        rows = [k for k in kinds if k == "rowwise"]  # the rest: colwise or heads
        if len(rows) != 1 or any(k is None for k in kinds):
            return False
        found = True
    return found


def _n_inputs(module: nn.Module) -> int:
    """Number of positional inputs of ``module.forward``."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in inspect.signature(module.forward).parameters.values())


def _shrink_heads(module: nn.Module, styles: dict[str, str], tp: int) -> None:
    for name, mod in module.named_modules():
        if not hasattr(mod, "n_heads"):
            continue
        if styles.get(f"{name}.wq") != "colwise" and styles.get(f"{name}.qkv") != "heads":
            continue
        for attr in ("n_heads", "n_kv_heads"):
            heads = getattr(mod, attr, None)
            if heads is None:
                continue
            if heads % tp:
                raise ValueError(f"{name}.{attr}={heads} is not divisible by tp={tp}")
            setattr(mod, attr, heads // tp)


def _unhandled(module: nn.Module, placements: dict[str, dict[str, str]],
               styles: dict[str, str]) -> list[str]:
    """Parameters the plan shards on tp that no style here shards (they run replicated).  A
    tied parameter counts as run when any of its names belongs to a styled module (a pipeline
    stage may list the tied matrix first under a holder, e.g. GPT's last stage)."""
    aliases, own = _aliases(module), _own_prefixes(module)
    names: dict[int, list[str]] = {}
    for fqn, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    left = []
    for group in names.values():
        if all(_tp_dim(placements, aliases.get(n, n)) is None for n in group):
            continue
        if any(n.rpartition(".")[0] in styles or any(n.startswith(pre + ".") for pre in own)
               for n in group):
            continue
        left.append(group[0])
    return left


def _head_name(module: nn.Module) -> str | None:
    """The output head: the last Linear that is a direct child of the model (or of the last
    pipeline stage), e.g. Llama's and GPT's ``output``, ViT's ``head``; None on other stages."""
    names = [n for n, m in module.named_children() if isinstance(m, nn.Linear)]
    return names[-1] if names else None


def vocab_sharded_head(tp_plan: dict[str, Any]) -> bool:
    """Whether the applied styles leave the head's logits sharded on their last dimension."""
    return any(isinstance(style, ColwiseParallel) and not style.use_local_output
               for style in tp_plan.values())


def apply_tensor_parallel(module: nn.Module, plan: Any, tp_mesh: Any, *,
                          loss_parallel: bool = False) -> dict[str, Any]:
    """Shard ``module`` (the whole model or one pipeline stage; FQNs as in the plan) over
    ``tp_mesh`` as the plan's placements say.  ``loss_parallel``: keep a sharded head's logits
    vocab-sharded (the caller computes the loss under ``loss_parallel()``).  Returns the style
    dict that was applied."""
    tp = tp_mesh.size()
    styles = tp_styles(module, plan.placements)
    for name in (n for n, kind in styles.items() if kind == "channels"):
        conv = module.get_submodule(name)
        if conv.out_channels % tp:
            raise ValueError(f"{name}: the plan shards its {conv.out_channels} output channels "
                             f"over tp={tp}, which does not divide them; this runtime splits "
                             f"channels evenly: plan with a tp that divides every sharded "
                             f"convolution's channels (or tp=1)")
    left = _unhandled(module, plan.placements, styles)
    if left:
        log.warning("the plan shards %d parameter(s) on tp that this runtime replicates (%s%s): "
                    "their memory per rank is tp=%d times what the plan counts; tensor parallel "
                    "runs nn.Linear (column/row), fused qkv, vocab-parallel nn.Embedding and "
                    "output-channel parallel nn.Conv1d/2d/3d",
                    len(left), ", ".join(left[:4]), ", ..." if len(left) > 4 else "", tp)
    if not styles:
        log.info("tp=%d: no parameter of this module runs sharded on tp", tp)
        return {}
    cfg = plan.config
    fsdp_follows = cfg.zero_stage >= 1 and cfg.dp * cfg.cp > 1
    if fsdp_follows and "heads" in styles.values():
        log.warning("zero_stage=%d with tensor-parallel fused projections (%s): their weights "
                    "are sharded over dp on dim 1, but FSDP2 cannot shard a 1-D head-aware "
                    "bias, so those biases stay replicated on tp (sharded over dp only): their "
                    "memory is tp times what the plan counts", cfg.zero_stage,
                    ", ".join(n for n, k in styles.items() if k == "heads"))
    sp = bool(plan.config.sequence_parallel)
    blocks_ok = _megatron_blocks(module, styles)
    if sp and plan.config.pp > 1:
        log.warning("sequence_parallel=True with pipeline parallel: the hidden state between "
                    "stages would be sequence-sharded, which this runtime does not pass yet; "
                    "running tensor parallel without sequence parallel")
        sp = False
    if sp and not blocks_ok:
        log.warning("sequence_parallel=True but the plan's tp placements are not Megatron-shaped "
                    "in every block; running tensor parallel without sequence parallel")
        sp = False
    tp_plan: dict[str, Any] = {}
    head = _head_name(module)
    for name, kind in styles.items():
        is_head = name == head
        if kind == "vocab":
            tp_plan[name] = RowwiseParallel(input_layouts=Replicate(),
                                            output_layouts=Shard(1) if sp else Replicate())
        elif is_head:
            tp_plan[name] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                            output_layouts=Shard(-1) if loss_parallel
                                            else Replicate(),
                                            use_local_output=not loss_parallel)
        elif kind == "heads":
            tp_plan[name] = HeadParallel(FUSED_CHUNKS[name.rsplit(".", 1)[-1]],
                                         replicate=("bias",) if fsdp_follows else ())
        elif kind == "channels":
            tp_plan[name] = ChannelParallel()
        elif kind == "colwise":
            tp_plan[name] = ColwiseParallel()
        else:
            tp_plan[name] = RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())
    if sp:
        for name, mod in module.named_modules():
            if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)):
                tp_plan[name] = SequenceParallel()
            if isinstance(mod, nn.Embedding) and name not in styles:
                tp_plan[name] = SequenceShardOutput()
            children = [c for c, m in mod.named_children() if isinstance(m, nn.Linear)]
            if children and name and name != head and f"{name}.{children[0]}" in styles:
                n_inputs = _n_inputs(mod)  # Llama's attention takes (x, cos, sin), GPT's x
                tp_plan[name] = PrepareModuleInput(
                    input_layouts=(Shard(1),) + (None,) * (n_inputs - 1),
                    desired_input_layouts=(Replicate(),) + (None,) * (n_inputs - 1))
        if head is not None and head not in styles:
            tp_plan[head] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),),
                                                   use_local_output=True)
    tied = tied_parameters(module)
    _shrink_heads(module, styles, tp)
    parallelize_module(module, tp_mesh, tp_plan)
    _retie(module, tied)
    log.info("tensor parallel over %d ranks%s: %s", tp, " with sequence parallel" if sp else "",
             ", ".join(f"{k}={v}" for k, v in sorted(styles.items())))
    return tp_plan
