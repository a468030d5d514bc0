"""The sharding rule table: strategies of each op kind on one mesh axis.

``strategies(node, axis_size)`` lists what a node may do on an axis of ``axis_size`` ranks.
Every list starts with the all-replicated strategy, so every graph has a feasible assignment;
at ``axis_size == 1`` it is the only one. A dim is shardable when its size is a positive
multiple of the axis size. The table, by ``OpKind``:

===========  ============================================================================
MATMUL       from einsum equations (:mod:`autopar.sharding.einsum`): shard any output
             letter (batch/rows, columns) or the contracted letter (output partial); a
             fused MoE layer's expert GEMM likewise, never on its experts
ATTENTION    heads (q, k, v, out on dim 1; q-only with replicated k/v when the kv heads do
             not divide), batch (dim 0)
NORM         any non-normalised dim; batch norm also its channel dim (params sharded) and
             its batch dim (statistics all-reduced: 2 · C fp32 forward and backward)
ELEMENTWISE  any output dim, inputs following by right-aligned broadcasting (a broadcast or
DROPOUT      a differently-sized input dim stays replicated / excludes the dim), a parameter
             among them also replicated, read by its slice (gradient all-gathered); linear
             ops (add, sub of two tensors, neg, cat, clone, stack) also pass partial sums
             through; ``stack``
             any input dim, moved past the new dim; an MoE layer's gated expert activation
             its features, from both halves of its input
SOFTMAX      any dim but the last (the softmax dim in every traced model)
REDUCE       any kept dim; sum/mean also a reduced dim, giving a partial output
VIEW         a shard of an input dim that maps 1:1 to an output dim (:mod:`.views`); R and
             P pass through
EMBEDDING    vocab parallel (table S(0), output partial), hidden parallel (table S(1),
             output S(last)), batch (indices sharded, table replicated)
CONV         batch, output channels (weight S(0), output S(1)), input channels (weight S(1),
             input S(1), output partial); grouped convolutions batch only
POOL         batch, channels
LOSS         batch (output partial), vocab parallel (logits S(1); Megatron's parallel cross
             entropy: three all-reduces of N fp32 values forward)
MOE_COMBINE  partial experts' outputs in, partial out (a weighted sum; routing weights
             replicated, their gradient partial)
MOE_DISPATCH replicate, and "R~P" (below): its backward is linear in the routed rows' gradient
other        replicate only
===========  ============================================================================

Views, elementwise ops, dropout and an MoE dispatch also have "R~P": replicated forward,
partial gradients in and out (their backward is linear in the output gradient), so several
column-parallel consumers of one tensor share a single gradient all-reduce, as in Megatron.
So has any op the caller says defers its gradients (``strategies(..., defers_gradients=True)``:
an MoE layer's routing, which the caller finds in the sub-layer): a router's weight gradient is
then a partial sum, reduced once a step with the other replicated parameters' (the runtime runs
the MoE sub-layer on local shards so).

Parameter inputs take the placement the strategy asks of the operand; the caller maps it
back through a transposed view (``nn.Linear`` traces ``x @ W.T``).
"""

from __future__ import annotations

import functools
from typing import Sequence

from autopar.ir import Node, OpKind, op_name
from autopar.sharding.einsum import einsum_strategies, matmul_equation
from autopar.sharding.placement import PARTIAL, REPLICATE, shard
from autopar.sharding.strategy import Strategy, default_input_grads
from autopar.sharding.views import view_dim_map

__all__ = ["on_sequence_shard", "per_chunk", "signature", "strategies"]

_LINEAR = {"add", "add_", "sub", "sub_", "neg", "cat", "clone", "copy", "copy_", "sum"}
_BINARY = {"add", "add_", "sub", "sub_"}
_LINEAR_REDUCE = {"sum", "mean"}
_BATCH_NORM = {"native_batch_norm", "_native_batch_norm_legit",
               "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
               "batch_norm"}
_FP32_BYTES = 4  # statistics and loss reductions run in fp32



def _ok(size: int, n: int) -> bool:
    return size >= n and size % n == 0


@functools.cache  # strategies are immutable: nodes of the same arity share these two
def _replicate(num_inputs: int, num_outputs: int) -> Strategy:
    ins = (REPLICATE,) * num_inputs
    return Strategy(name="R", inputs=ins, outputs=(REPLICATE,) * num_outputs, input_grads=ins)


@functools.cache
def _replicate_partial_grad(num_inputs: int, num_outputs: int) -> Strategy:
    """Replicated forward whose backward takes and hands on partial gradients (its backward
    is linear in the output gradient, so the sum can be deferred to a producer)."""
    return Strategy(name="R~P", inputs=(REPLICATE,) * num_inputs,
                    outputs=(REPLICATE,) * num_outputs, input_grads=(PARTIAL,) * num_inputs,
                    output_grads=(PARTIAL,) * num_outputs)


def on_sequence_shard(sts: tuple[Strategy, ...], node: Node, shard_placement: str
                      ) -> tuple[Strategy, ...]:
    """Of ``sts``, those of an op with parameters on the residual stream (a norm's scale)
    that take every activation input on the sequence shard (``shard_placement``), as the
    runtime runs it under sequence parallelism (its parameter's gradient then a partial sum);
    all of ``sts`` where none does."""
    acts = [i for i, src in enumerate(node.input_sources)
            if not src.startswith(("param:", "buffer:", "const"))]
    return tuple(s for s in sts if all(s.inputs[i] == shard_placement for i in acts)) or sts


def _make(name: str, inputs: Sequence[str], outputs: Sequence[str], n: int, *,
          split: bool = True, fwd=(), bwd=()) -> Strategy:
    return Strategy(name=name, inputs=tuple(inputs), outputs=tuple(outputs),
                    input_grads=default_input_grads(inputs, split),
                    work_divisor=n if split else 1, fwd_collectives=tuple(fwd),
                    bwd_collectives=tuple(bwd))


def _follow(shape: Sequence[int], ref: Sequence[int], dim: int, n: int) -> str | None:
    """Placement of a tensor of ``shape`` broadcast against ``ref`` sharded on ``dim``:
    the aligned dim if it has the same size, R if it is broadcast, None if impossible."""
    offset = len(ref) - len(shape)
    own = dim - offset
    if own < 0 or shape[own] == 1:
        return REPLICATE
    if shape[own] != ref[dim] or not _ok(shape[own], n):
        return None
    return shard(own)


def _aux_output(shape: Sequence[int], ref: Sequence[int], dim: int, n: int) -> str:
    """Placement of a secondary output (statistics, indices) when the main input is S(dim)."""
    if len(shape) == len(ref) and shape[dim] == ref[dim] and _ok(shape[dim], n):
        return shard(dim)
    if len(shape) == 1 and shape[0] == ref[dim] and _ok(shape[0], n):
        return shard(0)
    return REPLICATE


def _pointwise(node: Node, n: int, excluded: set[int] = frozenset()) -> list[Strategy]:
    """Shard any output dim not in ``excluded``; inputs follow by broadcasting. A parameter
    that follows the shard may also stay replicated, each rank reading its slice: its
    gradient, split likewise, is then all-gathered backward (a norm's weight scaling the
    features of a column-parallel projection, as DTensor runs it)."""
    out = node.outputs[0].shape
    params = [i for i, src in enumerate(node.input_sources) if src.startswith("param:")]
    found = []
    for d in range(len(out)):
        if d in excluded or not _ok(out[d], n):
            continue
        ins = [_follow(t.shape, out, d, n) for t in node.inputs]
        if None in ins:
            continue
        outs = [_follow(t.shape, out, d, n) or REPLICATE for t in node.outputs]
        found.append(_make(f"S({d})", ins, outs, n))
        sliced = [i for i in params if ins[i] != REPLICATE]
        if sliced:
            whole = [REPLICATE if i in sliced else p for i, p in enumerate(ins)]
            grads = tuple(REPLICATE if i in sliced else g
                          for i, g in enumerate(default_input_grads(ins, True)))
            gathers = tuple(("all_gather", float(node.inputs[i].num_bytes)) for i in sliced)
            found.append(Strategy(name=f"S({d}) sliced", inputs=tuple(whole),
                                  outputs=tuple(outs), input_grads=grads, work_divisor=n,
                                  bwd_collectives=gathers))
    return found


def _stacked(node: Node, n: int) -> list[Strategy]:
    """``stack`` of equal-shape inputs on a new dim: any input dim, sharded alike in every
    input, is the output dim it moves to (the new dim is found from the shapes: the one whose
    removal leaves the inputs' shape and whose size is their count)."""
    x, out = node.inputs[0].shape, node.outputs[0].shape
    new = [k for k in range(len(out)) if out[k] == len(node.inputs)
           and tuple(out[:k] + out[k + 1:]) == tuple(x)]
    if len(new) != 1 or any(t.shape != x for t in node.inputs):
        return []
    k = new[0]
    return [_make(f"S({d})", [shard(d)] * len(node.inputs), [shard(d if d < k else d + 1)], n)
            for d in range(len(x)) if _ok(x[d], n)]


def _elementwise(node: Node, n: int) -> list[Strategy]:
    if op_name(node.target) == "stack":
        return _stacked(node, n) + [_make("P", [PARTIAL] * len(node.inputs), [PARTIAL], n,
                                          split=False)]
    found = _pointwise(node, n) + _gated_halves(node, n)
    if op_name(node.target) in _LINEAR and node.outputs[0].shape and not (
            op_name(node.target) in _BINARY and len(node.inputs) < 2):  # x + eps: not linear
        found.append(_make("P", [PARTIAL] * len(node.inputs), [PARTIAL] * len(node.outputs),
                           n, split=False))
    return found


def _matmul(node: Node, n: int) -> list[Strategy]:
    found = matmul_equation(op_name(node.target), [len(t.shape) for t in node.inputs])
    if found is None:
        return []
    equation, additive = found
    strategies = einsum_strategies(equation, additive, [t.shape for t in node.inputs],
                                   node.outputs[0].shape, n)
    return [s for s in strategies if s.name not in ("R", "S(e)")]


def _gated_halves(node: Node, n: int) -> list[Strategy]:
    """An MoE layer's gated expert activation (``act(gate) * up`` on the halves of a
    ``[rows, 2f]`` input, `autopar.trace.moe`) on features: a column-parallel gate_up split
    by chunk gives each rank its features of both halves, so ``S(1)`` in, ``S(1)`` out."""
    out = node.outputs[0].shape
    last = len(out) - 1
    if not node.target.startswith("moe.") or not _ok(out[last], n) or any(
            t.shape[-1] not in (out[last], 2 * out[last]) for t in node.inputs):
        return []
    return [_make(f"S({last})", [shard(len(t.shape) - 1) for t in node.inputs], [shard(last)], n)]


def _attention(node: Node, n: int) -> list[Strategy]:
    spec = node.attention
    q = node.inputs[0].shape
    found = []
    rest = [REPLICATE] * (len(node.inputs) - 3)
    if _ok(q[0], n):
        mask = [shard(0) if len(t.shape) == 4 and t.shape[0] == q[0] else REPLICATE
                for t in node.inputs[3:]]
        found.append(_make("S(batch)", [shard(0)] * 3 + mask, [shard(0)] * len(node.outputs), n))
    heads = spec.num_heads if spec else q[1]
    kv_heads = spec.num_kv_heads if spec else node.inputs[1].shape[1]
    if _ok(heads, n):
        kv = shard(1) if _ok(kv_heads, n) else REPLICATE
        found.append(_make("S(heads)", [shard(1), kv, kv] + rest,
                           [shard(1)] * len(node.outputs), n))
    return found


def _norm(node: Node, n: int) -> list[Strategy]:
    x = node.inputs[0].shape
    op = op_name(node.target)
    if op in _BATCH_NORM:
        found = []
        channels = x[1] if len(x) > 1 else 1
        if _ok(channels, n):
            ins = [shard(1)] + [shard(0) if t.shape == (channels,) else REPLICATE
                                for t in node.inputs[1:]]
            outs = [_aux_output(t.shape, x, 1, n) for t in node.outputs]
            found.append(_make("S(channel)", ins, outs, n))
        if _ok(x[0], n):
            stats = ("all_reduce", 2 * channels * _FP32_BYTES)
            ins = [shard(0)] + [REPLICATE] * (len(node.inputs) - 1)
            outs = [_aux_output(t.shape, x, 0, n) for t in node.outputs]
            found.append(_make("S(batch)", ins, outs, n, fwd=[stats], bwd=[stats]))
        return found
    normalized = len(node.inputs[1].shape) if len(node.inputs) > 1 else 1
    found = []
    for d in range(len(x) - normalized):
        if _ok(x[d], n):
            ins = [shard(d)] + [REPLICATE] * (len(node.inputs) - 1)
            outs = [_aux_output(t.shape, x, d, n) for t in node.outputs]
            found.append(_make(f"S({d})", ins, outs, n))
    return found


def _embedding(node: Node, n: int) -> list[Strategy]:
    table, idx = node.inputs[0].shape, node.inputs[1].shape
    out = node.outputs[0].shape
    found = []
    if _ok(table[0], n):
        found.append(_make("S(vocab)", [shard(0), REPLICATE], [PARTIAL], n))
    if _ok(table[1], n):
        found.append(_make("S(hidden)", [shard(1), REPLICATE], [shard(len(out) - 1)], n))
    for d in range(len(idx)):
        if _ok(idx[d], n):
            found.append(_make(f"S({d})", [REPLICATE, shard(d)], [shard(d)], n))
    return found


def _conv(node: Node, n: int) -> list[Strategy]:
    x, w = node.inputs[0].shape, node.inputs[1].shape
    bias = len(node.inputs) > 2
    found = []
    if _ok(x[0], n):
        found.append(_make("S(batch)", [shard(0), REPLICATE] + [REPLICATE] * bias,
                           [shard(0)], n))
    if w[1] != x[1]:  # grouped / depthwise: the channel rules below do not hold
        return found
    if _ok(w[0], n):
        found.append(_make("S(out_channel)", [REPLICATE, shard(0)] + [shard(0)] * bias,
                           [shard(1)], n))
    if _ok(w[1], n):
        found.append(_make("S(in_channel)", [shard(1), shard(1)] + [PARTIAL] * bias,
                           [PARTIAL], n))
    return found


def _pool(node: Node, n: int) -> list[Strategy]:
    return _pointwise(node, n, excluded=set(range(2, len(node.outputs[0].shape))))


def _softmax(node: Node, n: int) -> list[Strategy]:
    return _pointwise(node, n, excluded={len(node.outputs[0].shape) - 1})


def _reduce(node: Node, n: int) -> list[Strategy]:
    x, out = node.inputs[0].shape, node.outputs[0].shape
    if len(out) == len(x):
        kept = {d: d for d in range(len(x)) if x[d] == out[d] and x[d] > 1}
    else:
        kept = view_dim_map("aten.select.int", x, out)
    found = []
    extra = [REPLICATE] * (len(node.inputs) - 1)
    for d in range(len(x)):
        if not _ok(x[d], n):
            continue
        if d in kept and _ok(out[kept[d]], n):
            outs = [shard(kept[d])] + [REPLICATE] * (len(node.outputs) - 1)
            found.append(_make(f"S({d})", [shard(d)] + extra, outs, n))
        elif d not in kept and op_name(node.target) in _LINEAR_REDUCE:
            found.append(_make(f"S({d})->P", [shard(d)] + extra,
                               [PARTIAL] * len(node.outputs), n))
    return found


def _view(node: Node, n: int) -> list[Strategy]:
    x = node.inputs[0].shape
    extra = [REPLICATE] * (len(node.inputs) - 1)
    found = [_make("P", [PARTIAL] + extra, [PARTIAL] * len(node.outputs), n, split=False)]
    maps = [view_dim_map(node.target, x, t.shape) for t in node.outputs]
    for d in range(len(x)):
        if not _ok(x[d], n):
            continue
        outs = []
        for t, dim_map in zip(node.outputs, maps):
            e = dim_map.get(d)
            outs.append(shard(e) if e is not None and _ok(t.shape[e], n) else None)
        if None not in outs:
            found.append(_make(f"S({d})", [shard(d)] + extra, outs, n))
    return found


def _loss(node: Node, n: int) -> list[Strategy]:
    logits = node.inputs[0].shape
    found = []
    rest = [REPLICATE] * (len(node.inputs) - 2)
    outs = [PARTIAL] * len(node.outputs)
    if _ok(logits[0], n) and len(node.inputs) > 1 and node.inputs[1].shape[:1] == logits[:1]:
        found.append(_make("S(batch)", [shard(0), shard(0)] + rest, outs, n))
    if len(logits) == 2 and _ok(logits[1], n):
        # Megatron parallel cross entropy: all-reduce max, sum of exp and target logit.
        reductions = [("all_reduce", logits[0] * _FP32_BYTES)] * 3
        found.append(_make("S(vocab)", [shard(1), REPLICATE] + rest,
                           [REPLICATE] * len(node.outputs), n, fwd=reductions))
    return found


def _moe_combine(node: Node, n: int) -> list[Strategy]:
    """A weighted sum of its experts' outputs (the inputs as wide as its output): their
    partial sums pass through, the output partial; the routing weights stay replicated,
    and their gradient is then a partial sum."""
    width = node.outputs[0].shape[-1] if node.outputs[0].shape else None
    experts = [bool(t.shape) and t.shape[-1] == width for t in node.inputs]
    if not any(experts):
        return []
    return [Strategy(name="P", inputs=tuple(PARTIAL if e else REPLICATE for e in experts),
                     outputs=(PARTIAL,),
                     input_grads=tuple(REPLICATE if e else PARTIAL for e in experts))]


def per_chunk(node: Node, n: int) -> tuple[Strategy, ...]:
    """The op that cuts a fused projection's output into its chunks (``fused_splits``) with
    the features sharded by chunk, as the projection's column-parallel weight laid out by
    chunk gives them: a split hands each chunk on sharded on its features, a view as
    ``(k, heads, head_dim)`` on its heads, one as ``(k, features)`` on its features."""
    last = len(node.inputs[0].shape) - 1
    if len(node.outputs) > 1:  # a split
        outs = tuple((len(t.shape) - 1, t.shape[-1]) for t in node.outputs)
    else:  # [..., k * heads * head_dim] -> [..., k, heads, head_dim] or [..., k, features]
        shape = node.outputs[0].shape
        outs = ((last + 1, shape[last + 1]),)
    if last < 0 or not all(size % n == 0 for _, size in outs):
        return ()
    ins = (shard(last),) + (REPLICATE,) * (len(node.inputs) - 1)
    return (Strategy(name=f"S({last}) by chunk", inputs=ins,
                     outputs=tuple(shard(d) for d, _ in outs),
                     input_grads=default_input_grads(ins, True), work_divisor=n),)


_RULES = {
    OpKind.MOE_COMBINE: _moe_combine,
    OpKind.MATMUL: _matmul, OpKind.ATTENTION: _attention, OpKind.NORM: _norm,
    OpKind.ELEMENTWISE: _elementwise, OpKind.DROPOUT: _elementwise, OpKind.SOFTMAX: _softmax,
    OpKind.REDUCE: _reduce, OpKind.VIEW: _view, OpKind.EMBEDDING: _embedding,
    OpKind.CONV: _conv, OpKind.POOL: _pool, OpKind.LOSS: _loss,
}

# Ops without parameters whose replicated strategy may also defer partial gradients.
_PARTIAL_GRAD_KINDS = {OpKind.VIEW, OpKind.ELEMENTWISE, OpKind.DROPOUT, OpKind.MOE_DISPATCH}


def signature(node: Node) -> tuple:
    """All that :func:`strategies` reads of ``node``: nodes with equal signatures have the
    same strategies on an axis of any size."""
    return (node.kind, node.target, tuple(t.shape for t in node.inputs),
            tuple(t.shape for t in node.outputs), node.attention)


def strategies(node: Node, axis_size: int, *, defers_gradients: bool = False
               ) -> tuple[Strategy, ...]:
    """The strategies of ``node`` on one mesh axis of ``axis_size`` ranks, replicate first;
    "R~P" too where its kind allows it or the caller says it ``defers_gradients``."""
    if axis_size < 1:
        raise ValueError(f"axis size must be >= 1, got {axis_size}")
    base = _replicate(len(node.inputs), len(node.outputs))
    if axis_size == 1 or not node.outputs or not node.inputs:
        return (base,)
    rule = _RULES.get(node.kind)
    found = rule(node, axis_size) if rule is not None else []
    if (node.kind in _PARTIAL_GRAD_KINDS or defers_gradients) and node.outputs[0].shape:
        found.append(_replicate_partial_grad(len(node.inputs), len(node.outputs)))
    arity = (len(node.inputs), len(node.outputs))
    unique: dict[tuple, Strategy] = {}
    for s in [base, *found]:
        assert (len(s.inputs), len(s.outputs)) == arity
        unique.setdefault((s.inputs, s.outputs, s.input_grads, s.grad_outputs), s)
    return tuple(unique.values())
