"""What this runtime can run for a given model, known at compile time (compile returns only
plans the runtime can run for the model it was given).

``runtime_limits`` names, per parallelism axis this runtime cannot run for the model, the
reason, and the context-parallel layout the runtime will use; ``autopar.compile`` keeps the
search to degree 1 on those axes and refuses a pin above 1 with the reason.  Every check reads
the model's structure or its traced forward, never module names:

* pipeline parallel: the model takes one input tensor, token ids or other (every stage reads
  its micro-batch's input), has a block list (``structure.block_slots``) and no parameter
  shared between a block and anything else (no stage split holds it once);
* context parallel: the model takes token ids, its attention has no dropout, and its blocks
  read the sequence across positions only in attention (`sequence_mixing`: no scan,
  convolution, chunking or product over the sequence, found by tracing it again at half the
  sequence length).  A model whose
  attention goes through the ``SequenceShard`` hook of ``autopar.models.common.attention``
  runs it load-balanced (zigzag chunks); any other runs it through its own forward on
  sequence-sharded DTensors (one contiguous chunk per rank: causal attention loads the last
  rank most, as the estimate charges), on the (cp, tp) mesh under tensor parallel, its MoE
  layers on each rank's own tokens (``cp_moe``; under expert parallel those tokens are
  gathered over the ep group, which may hold cp ranks), and with a pipeline and tensor
  parallel too only for streams ``[batch, seq, ...]`` (``one_of``);
* expert parallel: the model's MoE layers hold a list of alike experts with a router or a
  top-k, or parameters with a leading expert dim (``autopar.trace.moe.moe_experts``).
  autopar's own router/experts/top-k layers run with all-to-all dispatch; others on their own
  forward with all-gathered tokens (``expert_gather``). Experts are split over tp as the dense
  layers are: expert parallel folded over tp (``ParallelConfig.etp`` = 1) is Megatron-Core's
  and torchtitan's, not this runtime's (``RuntimeLimits.fields``); fused experts with a bias
  per expert (GPT-OSS's) run split over ep or over tp, not both (their tp shards' partial sums
  would each add the bias);
* tensor parallel splits a vocabulary it does not divide unevenly, which FSDP cannot shard
  again: ZeRO stays at 0 unless tp divides it (``RuntimeLimits.one_of``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from autopar.ir import Graph, OpKind
from autopar.ir.residual import vocab_sizes
from autopar.runtime.pipeline import tied_parameters
from autopar.runtime.structure import block_names
from autopar.trace.moe import moe_experts

__all__ = ["RuntimeLimits", "runtime_limits"]


def _pipeline_limit(model: nn.Module, one_input: bool) -> str | None:
    if not one_input:
        return ("pipeline parallel in this runtime runs models with one input tensor (token "
                "ids, or one example tensor such as images), and this model takes several")
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


@dataclass(frozen=True)
class RuntimeLimits:
    """What the runtime can run for one model: ``axes``, ``{axis: reason}`` for each axis it
    cannot run above 1; ``exclusive``, groups of axes of which one plan may use only one group
    above 1, with the reason; ``cp_layout``, how it runs context parallel ("zigzag" through
    autopar's attention hook, "contiguous" through the model's own forward); ``ep_dispatch``,
    how it runs expert parallel ("all_to_all" for autopar's MoE layers, "all_gather" on the
    layer's own forward); ``fields``, ``{field: (value, reason)}`` for each other config field
    it runs at one value only; ``one_of``, sets of alternative pins of which a plan must hold
    one, with the reason."""

    axes: dict[str, str] = field(default_factory=dict)
    fields: dict[str, tuple[Any, str]] = field(default_factory=dict)
    exclusive: tuple[tuple[frozenset[str], frozenset[str], str], ...] = ()
    # (alternative pins of which a plan must satisfy one, reason)
    one_of: tuple[tuple[tuple[dict[str, Any], ...], str], ...] = ()
    cp_layout: str = "zigzag"
    ep_dispatch: str = "all_to_all"  # or "all_gather": MoE layers on their own forward


def runtime_limits(model: nn.Module, graph: Graph, *, token_model: bool, one_input: bool,
                   attention_hook_calls: int, num_experts: int | None) -> RuntimeLimits:
    """What this runtime can run for ``model`` (traced as ``graph``; ``token_model``: it takes
    token ids; ``one_input``: it takes one input tensor, token ids or other;
    ``attention_hook_calls``: the calls of ``autopar.models.common.attention`` during the
    trace; ``num_experts``: the experts the search would split over ep)."""
    from autopar.runtime.expert_gather import gathered_moe_modules
    from autopar.runtime.expert_parallel import find_moe_modules

    limits = {}
    reason = _pipeline_limit(model, one_input)
    if reason:
        limits["pp"] = reason
    kinds = {node.kind for node in graph.nodes}
    attention = [n for n in graph.nodes if n.kind == OpKind.ATTENTION]
    if attention and not token_model:
        limits["cp"] = ("context parallel in this runtime shards token sequences (inputs "
                        "[batch, seq] of token ids), and this model takes other inputs")
    elif any(n.attention and n.attention.dropout_p for n in attention):
        limits["cp"] = ("context parallel in this runtime runs attention without dropout, and "
                        "this model's attention has dropout; set it to 0 to plan with cp")
    exclusive = []
    cp_layout, ep_dispatch = "zigzag", "all_to_all"
    gathered = gathered_moe_modules(model)
    if not attention_hook_calls and "cp" not in limits:
        cp_layout = "contiguous"
        mixing = _sequence_mixing(model, graph)
        if mixing:
            limits["cp"] = (f"context parallel runs this model's blocks on sequence shards with "
                            f"attention as a ring, and {mixing}")
    if gathered and not (num_experts or OpKind.MOE_DISPATCH in kinds):
        limits["ep"] = (f"expert parallel splits the tokens each expert computes on, and this "
                        f"model's MoE layers ({gathered[0]}{', ...' if len(gathered) > 1 else ''})"
                        f" compute every expert on a fixed capacity whatever the routing (a "
                        f"dense dispatch, such as one-hot einsums): the trace costs them as the "
                        f"dense ops they are, and this runtime would run every expert on every "
                        f"ep rank's gathered tokens")
    elif (num_experts or OpKind.MOE_DISPATCH in kinds) and not find_moe_modules(model):
        if gathered:
            ep_dispatch = "all_gather"
            biased = [n for n in gathered if _expert_biases(model.get_submodule(n))]
            if biased:
                exclusive.append((frozenset({"ep"}), frozenset({"tp"}), (
                    f"this model's fused experts ({biased[0]}{', ...' if len(biased) > 1 else ''}"
                    f") add a bias per expert; with experts split over ep and tp each tp rank "
                    f"runs its shard of them as a partial sum, which would add it tp times")))
        else:
            limits["ep"] = ("expert parallel in this runtime splits MoE layers that hold a list "
                            "of alike experts with a router or a top-k, or parameters with a "
                            "leading expert dim; this model's MoE layers are written otherwise")
    fields = {}
    if num_experts or OpKind.MOE_DISPATCH in kinds:
        fields["etp"] = (0, "this runtime splits experts over tp as the dense layers (etp=0); "
                            "expert parallel folded over tp (etp=1) runs on Megatron-Core and "
                            "torchtitan: compile with target='megatron' or 'torchtitan'")
    one_of = _uneven_vocabulary(graph)
    if cp_layout == "contiguous" and _sequence_first(graph, attention):
        one_of += ((({"pp": 1}, {"cp": 1}, {"tp": 1}), (
            "its blocks take sequence-first streams ([seq, batch, ...]), and pipeline stages "
            "of this runtime send activations split on dim 1 (their batch) over cp and tp "
            "together; plan with one of pp, cp and tp at 1")),)
    return RuntimeLimits(axes=limits, fields=fields, exclusive=tuple(exclusive),
                         one_of=one_of, cp_layout=cp_layout, ep_dispatch=ep_dispatch)


def _sequence_mixing(model: nn.Module, graph: Graph) -> str | None:
    """`sequence_mixing.sequence_mixing_op` of ``model``, traced again at half the sequence
    length (None where the length does not halve into a whole number of cp chunks, or the
    model does not trace at half of it)."""
    from autopar.errors import TraceError
    from autopar.runtime.sequence_mixing import sequence_mixing_op
    from autopar.trace import trace

    seq = graph.seq_len
    if not seq or seq % 4:
        return None
    loggers = [logging.getLogger(f"autopar.trace.{m}") for m in ("api", "recorder")]
    for logger in loggers:  # what the probe finds again was said by the first trace
        logger.addFilter(_silent)
    try:
        half = trace(model, global_batch_size=graph.batch_size, seq_len=seq // 2)
    except TraceError:
        return None
    finally:
        for logger in loggers:
            logger.removeFilter(_silent)
    return sequence_mixing_op(graph, half)


def _silent(record: logging.LogRecord) -> bool:
    return False


def _sequence_first(graph: Graph, attention: list) -> bool:
    """Whether the first block reads its stream as ``[seq, batch, ...]`` (PyTorch's
    ``nn.TransformerEncoder`` by default): the first 3-D tensor a node of layer 0 reads from
    outside the layer has the attention's sequence length first and its batch second."""
    if not attention:
        return False
    spec = attention[0].attention
    layer = {n.name: n.layer_index for n in graph.nodes}
    for node in graph.nodes:
        if node.layer_index != 0:
            continue
        for t, src in zip(node.inputs, node.input_sources):
            if layer.get(src, -1) != 0 and len(t.shape) == 3:
                return t.shape[0] == spec.seq_q != spec.batch and t.shape[1] == spec.batch
    return False


def _expert_biases(module: nn.Module) -> bool:
    """Whether a fused MoE layer (`moe_experts`) holds per-expert biases: 2-D parameters
    ``[experts, features]`` beside its 3-D weights."""
    layout = moe_experts(module)
    return layout is not None and layout[0] == "fused" and any(
        getattr(module, n).dim() == 2 for n in layout[1])


def _uneven_vocabulary(graph: Graph) -> tuple[tuple[tuple[dict[str, Any], ...], str], ...]:
    """A vocabulary some tp of up to 64 ranks does not divide (GPT-2's 50,257 tokens) splits
    unevenly over tp, which FSDP2 cannot shard again: such a plan keeps ZeRO at 0 or takes a tp
    that divides it (under dp x cp = 1 ZeRO shards nothing, the first alternative's costs)."""
    sizes = vocab_sizes(graph)
    fits = [t for t in _TP_CANDIDATES if all(v % t == 0 for v in sizes)]
    if len(fits) == len(_TP_CANDIDATES):
        return ()
    return (((({"zero_stage": 0},) + tuple({"tp": t} for t in fits)),
             f"tensor parallel splits the vocabulary of {', '.join(map(str, sorted(sizes)))} "
             f"tokens unevenly over a tp that does not divide it, and FSDP cannot shard such "
             f"a split again; plan with zero_stage=0 or tp in {fits}"),)


_TP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
