"""How many partial sums a block reduces over tensor parallel, from dataflow alone: which
row-parallel GEMMs' outputs are summed before one reduction (a parallel attention and MLP),
and which sub-layers share the reduction of their input's gradient (`reduction_points`).
The estimate charges these (`autopar.estimate.units`), the plan names the summed GEMMs
(`autopar.plan.summed_row_weights`) and the runtime reduces so. Outside the blocks, which
GEMMs tp splits over the vocabulary and which it keeps whole (`whole_glue_gemms`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from autopar.ir.graph import Node, OpKind, op_name
from autopar.ir.residual import (Residual, _activations, consumers, moe_dispatch,
                                 parameter_values, sublayers)

__all__ = ["BroadcastParams", "Reductions", "broadcast_params", "dense_row_gemms",
           "hands_on_partial_gradients", "loss_reader", "reduction_points", "summed_row_gemms",
           "whole_glue_gemms"]


class Reductions(NamedTuple):
    """Partial sums one layer of a block reduces over tp under Megatron's layout: forward,
    forward under sequence parallel, backward (`reduction_points`)."""

    forward: int
    forward_sp: int
    backward: int


def reduction_points(nodes: Sequence[Node], residual: Residual) -> Reductions:
    """How many partial sums one layer of a block reduces over tp under Megatron's layout.

    An MoE sub-layer runs on its tp shards and reduces its output once each way, with the
    row GEMMs of a shared expert beside its experts (`autopar.runtime.tp_moe`). Elsewhere
    forward, row GEMMs whose partial outputs are summed before any other op reads them (a
    parallel attention and MLP: ``x + attn(n(x)) + mlp(n(x))``) share one reduction, each
    other row GEMM's output is reduced alone (`summed_row_gemms`); backward, sub-layers
    whose column GEMMs read the same tensor (one norm before both branches) share the
    reduction of its gradient, the others reduce their own (`_shared_inputs`)."""
    rows = dense_row_gemms(nodes, residual)
    runs = sum(moe_dispatch(run) is not None for run in sublayers(nodes, residual))
    return Reductions(
        forward=runs + len(summed_row_gemms(nodes, residual, rows, sequence_parallel=False)),
        forward_sp=runs + len(summed_row_gemms(nodes, residual, rows,
                                               sequence_parallel=True)),
        backward=runs + len(_shared_inputs(nodes, residual, rows)))


def dense_row_gemms(nodes: Sequence[Node], residual: Residual) -> list[str]:
    """The row GEMMs of ``nodes`` outside MoE sub-layers, in order."""
    moe = {n.name for run in sublayers(nodes, residual) if moe_dispatch(run) is not None
           for n in run}
    return [n.name for n in nodes if n.name in residual.row_gemms and n.name not in moe]


def _groups(rows: Sequence[str], links: Sequence[tuple[str, str]]) -> list[set[str]]:
    """``rows`` grouped by the ``links`` between them (connected components)."""
    root = {r: r for r in rows}

    def find(r: str) -> str:
        while root[r] != r:
            r = root[r]
        return r

    for a, b in links:
        root[find(a)] = find(b)
    out: dict[str, set[str]] = {}
    for r in rows:
        out.setdefault(find(r), set()).add(r)
    return list(out.values())


def summed_row_gemms(nodes: Sequence[Node], residual: Residual, rows: Sequence[str], *,
                     sequence_parallel: bool) -> list[set[str]]:
    """The row GEMMs ``rows`` grouped by the one reduction their partial outputs share.

    A partial sum passes views and adds, where it meets another (a parallel attention and
    MLP) or, without sequence parallel, a replicated value (the stream: each rank adds its
    share, as DTensor adds a replicated tensor to a partial one); under sequence parallel a
    stream value is a sequence shard, and an add of it reduce-scatters the partial sum.
    Row GEMMs whose partial sums meet form one group where the sum is reduced in one place
    (read by one op that does not pass it, or leaving the block); otherwise (a sequential
    block, whose first sum is read by the next norm too) each is reduced where it leaves
    its GEMM, alone."""
    partial: dict[str, str] = {r: r for r in rows}  # value -> a row GEMM whose sum it carries
    links, ends = [], dict.fromkeys(rows, 0)
    for node in nodes:
        acts = [src for src, _ in _activations(node)]
        summed = [partial[src] for src in acts if src in partial]
        if not summed or node.name in partial:
            continue
        view = node.kind is OpKind.VIEW and len(acts) == 1
        add = node.kind is OpKind.ELEMENTWISE and len(acts) == 2 and \
            node.target.split(".")[:2] in (["aten", "add"], ["aten", "add_"])
        if view or (add and (len(summed) == 2 or not sequence_parallel)):
            links += [(summed[0], other) for other in summed[1:]]
            partial[node.name] = summed[0]
        else:
            for row in summed:
                ends[row] += 1
    if nodes and nodes[-1].name in partial:
        ends[partial[nodes[-1].name]] += 1
    return [part for group in _groups(rows, links) for part in (
        [group] if sum(ends[r] for r in group) <= 1 else [{r} for r in sorted(group)])]


def _shared_inputs(nodes: Sequence[Node], residual: Residual, rows: Sequence[str]
                   ) -> list[set[str]]:
    """The row GEMMs ``rows`` grouped by the tensors their sub-layers' column GEMMs read
    (through views): branches that read one tensor have their input gradients summed there
    before the one reduction."""
    by_name = {n.name: n for n in nodes}

    def source(name: str) -> str:
        node = by_name.get(name)
        while node is not None and node.kind is OpKind.VIEW and len(_activations(node)) == 1:
            name = _activations(node)[0][0]
            node = by_name.get(name)
        return name

    read: dict[str, str] = {}  # a column GEMM's input -> a row GEMM that reads through it
    links = []
    for row in rows:
        stack, seen = [row], {row}
        while stack:
            for src, _ in _activations(by_name[stack.pop()]):
                node = by_name.get(src)
                if node is None or src in seen or src in residual.stream:
                    continue
                seen.add(src)
                if node.kind is OpKind.MATMUL and node.params and src not in residual.row_gemms:
                    for tensor, _ in _activations(node):
                        first = read.setdefault(source(tensor), row)
                        links.append((first, row))
                else:
                    stack.append(src)
    return _groups(rows, links)


def is_cross_entropy(node: Node) -> bool:
    return node.kind is OpKind.LOSS and node.target == "F.cross_entropy"


def loss_reader(name: str, readers: dict[str, list[Node]]) -> Node | None:
    """The cross-entropy that reads value ``name`` through views and element-wise ops (a final
    logit soft-capping keeps the logits split), or None (``readers``: `consumers`)."""
    for nxt in readers.get(name, ()):
        if is_cross_entropy(nxt):
            return nxt
        if nxt.kind in (OpKind.VIEW, OpKind.ELEMENTWISE) and \
                (found := loss_reader(nxt.name, readers)) is not None:
            return found
    return None


def whole_glue_gemms(nodes: Sequence[Node], vocab_dims: set[int]) -> set[str]:
    """The weight matmuls of glue (a run outside the blocks with no residual add) Megatron's
    layout keeps whole on every tp rank: all but the vocabulary projections (a weight with a
    vocabulary-sized dim 0, or an output a cross-entropy reads), which tp splits over their
    outputs. A transform before the vocabulary projection (BERT's) or a pooler would gain
    nothing from a split its next op (a norm, the blocks' stream) gathers at once: whole, it
    runs on the stream's rows (a sequence shard under sequence parallel), its gradient partial
    over those rows. Convolutions keep their output channels split (a CNN's layers are its
    glue), and a graph without blocks has no glue: its matmuls stay column-parallel."""
    readers = consumers(nodes)
    return {n.name for n in nodes
            if n.kind is OpKind.MATMUL and n.params
            and not any(p.shape and p.shape[0] in vocab_dims for p in n.params)
            and loss_reader(n.name, readers) is None}


# elementwise ops linear in their input, whose backward DTensor runs on a partial output
# gradient (sums, products with another operand, casts); on others (softplus) it reduces it
_LINEAR_IN_INPUT = {"add", "add_", "sub", "sub_", "neg", "cat", "clone", "copy", "copy_", "sum",
                    "mul", "mul_", "div", "div_", "_to_copy", "to", "type_as"}


def hands_on_partial_gradients(node: Node) -> bool:
    """Whether a partial gradient passes back through ``node`` as DTensor runs it: a view, or
    an op linear in its input."""
    return node.kind is OpKind.VIEW or op_name(node.target) in _LINEAR_IN_INPUT


class BroadcastParams(NamedTuple):
    """Trainable parameters that ops on split features read broadcast along them (one
    element there), whose gradients are partial sums over tp (`broadcast_params`)."""

    reduced: list[Node]  # the ops where DTensor reduces such a gradient, every backward
    params: set[str]  # parameters whose gradients stay partial until the step's reduction


def broadcast_params(nodes: Sequence[Node], split: set[str]) -> BroadcastParams:
    """The parameters an op of ``split`` (ops on features tp splits) reads broadcast along those
    features, directly or through ops on parameters alone: a partial gradient passes back
    through views and ops linear in their input to the parameter, reduced with the step's
    other partial gradients (a learned scale ``alpha * x``); at an op that is not (xIELU's
    ``softplus(alpha)``) DTensor reduces it in every backward."""
    made = parameter_values(nodes)
    by_name = {n.name: n for n in nodes}
    trainable = _trainable(nodes, made)
    reduced: dict[str, Node] = {}
    params: set[str] = set()
    stack = [src for node in nodes if node.name in split and node.outputs
             and node.outputs[0].shape and node.outputs[0].shape[-1] > 1
             for src, spec in zip(node.input_sources, node.inputs)
             if (src in trainable or src.startswith("param:"))
             and (not spec.shape or spec.shape[-1] == 1)]
    seen: set[str] = set()
    while stack:
        src = stack.pop()
        if src in seen:
            continue
        seen.add(src)
        if src.startswith("param:"):
            params.add(src[len("param:"):])
        elif src in trainable and not hands_on_partial_gradients(by_name[src]):
            reduced.setdefault(src, by_name[src])
        elif src in trainable:
            stack += by_name[src].input_sources
    return BroadcastParams(list(reduced.values()), params)


def _trainable(nodes: Sequence[Node], made: set[str]) -> set[str]:
    """Of the values ``made`` of parameters alone, those made from a trainable one."""
    out: set[str] = set()
    for node in nodes:
        if node.name in made and (any(p.requires_grad for p in node.params)
                                  or any(src in out for src in node.input_sources)):
            out.add(node.name)
    return out
