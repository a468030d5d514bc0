"""Heads split inside a flattened dim: strided shards on one mesh axis.

A view that splits a sharded dim and merges its leading piece with dims before it
(``[s, b, heads · d]`` as ``[s, b · heads, d]``, as ``nn.MultiheadAttention`` writes it;
``[b, heads, s, d]`` as ``[b · heads, s, d]``, as BLOOM does) leaves the merged dim sharded in
strides, ``S(e)/f`` (`autopar.sharding.placement`; DTensor's ``_StridedShard``): it holds
``f`` runs, each split in blocks over the axis. Permutes carry such a placement to their
output dim, and a view that splits the merged dim again turns it back into a block shard of
the piece (the heads), as DTensor keeps them all without moving data. The rule table
(`autopar.sharding.rules`) sees one node at a time; `strided_strategies` follows the dataflow
of a block from the views that make strided placements to those that end them, and lists the
strategies along that path.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Sequence

from autopar.ir import Node, OpKind, op_name
from autopar.sharding.placement import REPLICATE, shard
from autopar.sharding.strategy import Strategy, default_input_grads
from autopar.sharding.views import view_dim_map

__all__ = ["refinement", "reshaped_shard", "strided_strategies"]

_RESHAPE = {"view", "_unsafe_view", "reshape", "flatten", "unflatten", "_reshape_alias",
            "clone", "contiguous", "alias"}
_PERMUTE = {"transpose", "t", "permute", "swapaxes", "movedim"}
_BATCHED = {"bmm", "baddbmm"}


_ROW_WISE = {OpKind.ELEMENTWISE, OpKind.SOFTMAX, OpKind.DROPOUT}


def _row_wise(node: Node, carried: dict[str, set[tuple[int, int]]], n: int
              ) -> tuple[tuple[Strategy, ...], set[tuple[int, int]]] | None:
    """An elementwise op, a softmax or a dropout on a strided shard of a dim it does not
    reduce (a softmax's last): its output sharded alike, operands of its shape alike, others
    (broadcast along that dim) replicated."""
    out = tuple(node.outputs[0].shape)
    given = {placed for src in node.input_sources for placed in carried.get(src, ())
             if placed[0] < len(out) and not (node.kind is OpKind.SOFTMAX
                                              and placed[0] == len(out) - 1)}
    if not given:
        return None
    made, kept = [], set()
    for dim, stride in sorted(given):
        ins = []
        for t in node.inputs:
            shape = tuple(t.shape)
            if shape == out:
                ins.append(shard(dim, stride))
            elif len(shape) < len(out) - dim or shape[dim - len(out) + len(shape)] == 1:
                ins.append(REPLICATE)  # broadcast along the sharded dim
            else:
                break
        else:
            made.append(_strided(shard(dim, stride), ins, shard(dim, stride), n))
            kept.add((dim, stride))
    return (tuple(made), kept) if made else None


def _strided(named: str, ins: Sequence[str], out: str, n: int) -> Strategy:
    """A strategy of one output that strided shards pass through, named by ``named``."""
    return Strategy(name=f"{named} strided", inputs=tuple(ins), outputs=(out,),
                    input_grads=default_input_grads(tuple(ins), True), work_divisor=n)


def _batched(node: Node, stride: int, n: int) -> Strategy:
    """A batched product over a dim merging batch and heads, sharded ``S(0)/stride``: each
    rank multiplies its own rows; every operand batched alike takes them, others replicated."""
    rows = node.outputs[0].shape[0]
    ins = tuple(shard(0, stride) if t.shape and t.shape[0] == rows else REPLICATE
                for t in node.inputs)
    return _strided(shard(0, stride), ins, shard(0, stride), n)


def _prefixes(shape: Sequence[int]) -> set[int]:
    return set(itertools.accumulate(shape, operator.mul))


def refinement(a: Sequence[int], b: Sequence[int], cuts: Sequence[int] = ()
               ) -> tuple[int, ...] | None:
    """The coarsest shape that both ``a`` and ``b`` are merges of (dims of 1 left out), cut
    also after each of ``cuts`` elements, or None where there is none (a dim of one
    straddles two of the other's)."""
    if math.prod(a) != math.prod(b) or not math.prod(a):
        return None
    found, before = [], 1
    for cut in sorted(_prefixes(a) | _prefixes(b) | set(cuts)):
        if cut % before:
            return None
        if cut > before:
            found.append(cut // before)
        before = cut
    return tuple(found)


def reshaped_shard(a: Sequence[int], b: Sequence[int], dim: int, stride: int, n: int
                   ) -> tuple[int, int] | None:
    """Where a reshape of ``a`` into ``b`` puts a shard of ``a``'s dim ``dim`` in strides of
    ``stride`` (1: blocks) over ``n`` ranks: ``(output dim, its stride)``, or None where the
    shard is no block of any output dim's pieces (its leading piece does not divide by n)."""
    size = a[dim]
    if size % stride or (size // stride) % n:
        return None
    start = math.prod(a[:dim]) * stride  # elements before the sharded run, in row-major order
    pieces = refinement(a, b, (start,))
    if pieces is None:
        return None
    offsets = itertools.accumulate(pieces, operator.mul, initial=1)
    lead = next((piece for piece, at in zip(pieces, offsets) if at == start), None)
    if lead is None or lead % n:
        return None  # the sharded run's leading piece
    outer = 1
    for e, length in enumerate(b):
        if outer <= start < outer * length:
            return e, start // outer
        outer *= length
    return None


def strided_strategies(nodes: Sequence[Node], n: int) -> dict[str, tuple[Strategy, ...]]:
    """``{node name: strategies}`` that make, carry and end strided shards among ``nodes``
    (a block's, in order): a reshape from a block or strided shard to a strided one or from
    a strided shard to a block one, a permute or a copy of a strided shard, and a batched
    product over strided rows (BLOOM's ``baddbmm`` over batch and heads flattened)."""
    carried: dict[str, set[tuple[int, int]]] = {}  # the strided placements a value may take
    found: dict[str, tuple[Strategy, ...]] = {}
    for node in nodes:
        if len(node.outputs) != 1 or not node.inputs:
            continue
        if node.kind is OpKind.MATMUL and op_name(node.target) in _BATCHED and not node.params:
            strides = {f for src in node.input_sources for d, f in carried.get(src, ()) if d == 0}
            if strides:
                found[node.name] = tuple(_batched(node, f, n) for f in sorted(strides))
                carried[node.name] = {(0, f) for f in strides}
            continue
        if node.kind in _ROW_WISE:
            carry = _row_wise(node, carried, n)
            if carry:
                found[node.name], carried[node.name] = carry
            continue
        if node.kind is not OpKind.VIEW:
            continue
        a, b = tuple(node.inputs[0].shape), tuple(node.outputs[0].shape)
        given = carried.get(node.input_sources[0], set())
        op = op_name(node.target)
        made = []
        if op in _RESHAPE or a == b:
            for dim, stride in [(d, 1) for d in range(len(a))] + sorted(given):
                where = reshaped_shard(a, b, dim, stride, n)
                if where is not None and (stride, where[1]) != (1, 1):
                    made.append(((dim, stride), where))
        elif op in _PERMUTE:
            moved = view_dim_map(node.target, a, b)
            made = [((dim, stride), (moved[dim], stride)) for dim, stride in sorted(given)
                    if dim in moved]
        if not made:
            continue
        extra = [REPLICATE] * (len(node.inputs) - 1)
        found[node.name] = tuple(
            _strided(shard(*src), (shard(*src), *extra), shard(*dst), n) for src, dst in made)
        carried[node.name] = {dst for _, dst in made if dst[1] > 1}
    return found
