"""Ops of a model's blocks that read its token sequence across positions, other than
attention: what context parallel of the model's own forward cannot run on sequence shards.

Context parallel of a model's own forward (``runtime.sharded_sequence``) hands every block its
tokens split on the sequence over cp and runs attention as a ring; every other op must work
on each rank's positions alone, as the estimate charges it. A convolution over the sequence
(a Mamba or short-convolution mixer), a scan over positions, a view that cuts the sequence
into chunks (chunked linear attention) or a product that contracts over it does not: DTensor
gathers the sequence for it, or the op fails on the shard.

Which dims are the sequence's comes from the shapes, not from names or sizes: the model is
traced a second time at half the sequence length, and a dim of a block's tensor is a
sequence dim where its size differs between the two traces (positions, the flattened batch
and positions, the count of chunks). `sequence_mixing_op` then reads each block node of the
first trace against its twin:

* a block whose ops differ in number between the traces loops over positions or chunks;
* a convolution whose spatial dims are sequence dims convolves along the sequence;
* a product of two activations, a softmax or a norm whose last dim is a sequence dim mixes
  positions (attention written with its own ops, linear attention);
* a reshape that cuts a sequence dim into two pieces (chunks of positions) or any other op
  whose output holds fewer sequence dims than its inputs (a reduction, a cumulative sum, a
  step of a scan) leaves the shard.

Attention nodes and MoE routing (which ``cp_moe`` runs on each rank's own tokens) pass."""

from __future__ import annotations

from autopar.ir import Graph, Node, OpKind, op_name
from autopar.sharding.strided import refinement
from autopar.sharding.views import RESHAPE_OPS

__all__ = ["sequence_mixing_op"]

_PASS = {OpKind.ATTENTION, OpKind.MOE_DISPATCH, OpKind.MOE_COMBINE}
_SCANS = {"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"}


def sequence_mixing_op(graph: Graph, half: Graph) -> str | None:
    """Why ``graph``'s blocks cannot run on sequence shards (the first op that reads the
    sequence across positions, named by its module), given ``half``, the same model traced
    at half the sequence length; None when every block op is local to its positions."""
    nodes = {n.name: n for n in graph.nodes}
    twins = {n.name: n for n in half.nodes}
    for block, other in zip(graph.blocks, half.blocks):
        if len(block.node_names) != len(other.node_names):
            return (f"{block.representative} runs {len(block.node_names)} ops at "
                    f"{graph.seq_len} tokens and {len(other.node_names)} at {half.seq_len}: "
                    f"it loops over positions or chunks of the sequence")
        for name, twin in zip(block.node_names, other.node_names):
            node = nodes[name]
            why = _mixes(node, twins[twin])
            if why:
                return f"{node.module_path or node.name} ({op_name(node.target)}) {why}"
    return None


def _scaling(shape: tuple[int, ...], twin: tuple[int, ...]) -> tuple[int, ...]:
    """The dims whose size follows the sequence length (they differ between the traces)."""
    if len(shape) != len(twin):
        return tuple(range(len(shape)))
    return tuple(d for d, (a, b) in enumerate(zip(shape, twin)) if a != b)


def _mixes(node: Node, twin: Node) -> str | None:
    if node.kind in _PASS or not node.outputs or len(node.inputs) != len(twin.inputs):
        return None
    ins = [_scaling(t.shape, u.shape) for t, u in zip(node.inputs, twin.inputs)]
    if not any(ins):
        return None
    outs = [_scaling(t.shape, u.shape) for t, u in zip(node.outputs, twin.outputs)]
    last = len(node.inputs[0].shape) - 1
    if node.kind is OpKind.CONV:
        return "convolves along the sequence" if any(d >= 2 for d in ins[0]) else None
    if node.kind is OpKind.MATMUL and not node.params and len(ins) >= 2 and last in ins[0]:
        return "contracts two activations over the sequence"
    if node.kind in (OpKind.SOFTMAX, OpKind.NORM) and last in ins[0]:
        return "normalises over the sequence"
    if op_name(node.target) in _SCANS:
        return "accumulates along the sequence"
    if node.kind is OpKind.VIEW and op_name(node.target) in RESHAPE_OPS and _chunks(node, twin):
        return "cuts the sequence into chunks"
    if max(len(d) for d in outs) < max(len(d) for d in ins):
        return "leaves the sequence split across fewer dims than it read"
    return None


def _chunks(node: Node, twin: Node) -> bool:
    """Whether a reshape cuts a sequence dim into chunks: within one input dim, a piece of the
    coarsest refinement of input and output that follows the sequence is followed by a
    constant piece larger than one (positions split as ``(chunks, chunk)``; a constant piece
    before it, ``(experts, tokens)`` or ``(batch, positions)``, keeps each position whole)."""
    x, y = node.inputs[0].shape, node.outputs[0].shape
    pieces = refinement(x, y)
    halves = refinement(twin.inputs[0].shape, twin.outputs[0].shape)
    if pieces is None or halves is None or len(pieces) != len(halves):
        return False
    dims, d, filled = [], 0, 1
    for piece in pieces:  # the input dim each piece lies in (dims of one left out)
        while d < len(x) and x[d] == 1:
            d += 1
        dims.append(d)
        filled *= piece
        if d < len(x) and filled == x[d]:
            d, filled = d + 1, 1
    for k, (a, b) in enumerate(zip(pieces, halves)):
        if a != b and any(dims[j] == dims[k] and pieces[j] == halves[j] and pieces[j] > 1
                          for j in range(k + 1, len(pieces))):
            return True
    return False
