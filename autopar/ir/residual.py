"""Residual streams and sub-layers of a run of IR nodes (a block), from dataflow alone.

A transformer block carries a hidden state along a residual stream and adds to it the output of
each sub-layer (attention, MLP, MoE).  Nothing here reads op names of norms or modules: a norm
written by hand (``x * rsqrt(mean(x²) + eps) * w``) and ``nn.RMSNorm`` give the same answer.

* **stream**: the run's hidden-state inputs (activations from outside the run with the shape
  of the run's output) and every node that computes from the stream alone, without mixing
  features (no GEMM, convolution, attention or embedding): norms, scales, views;
* **residual add**: an ``add`` of a stream value and a value of the same shape that went
  through a mixing op in the run; its output is the stream again;
* **row GEMM**: a weight GEMM whose output reaches a residual add through element-wise and
  view ops only, and whose input is not the stream itself: the last GEMM of a sub-layer, which
  Megatron-LM splits on its input features (row-parallel) so that one reduction per sub-layer
  completes it.  Parallel residuals (``x + attn(n1(x)) + mlp(n2(x))``) have two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.ir.graph import Node, OpKind

__all__ = ["Residual", "residual_structure"]

_MIXING = frozenset({OpKind.MATMUL, OpKind.CONV, OpKind.ATTENTION, OpKind.EMBEDDING,
                     OpKind.MOE_DISPATCH, OpKind.MOE_COMBINE})
_NOT_ACTIVATION = ("param:", "buffer:", "const")


@dataclass(frozen=True)
class Residual:
    """The residual structure of a run of nodes (see the module docstring)."""

    stream: frozenset[str]
    residual_adds: tuple[str, ...]  # in node order
    row_gemms: frozenset[str]


def _is_add(node: Node) -> bool:
    return node.kind is OpKind.ELEMENTWISE and node.target.split(".")[:2] == ["aten", "add"]


def _activations(node: Node) -> list[tuple[str, tuple[int, ...]]]:
    return [(src, spec.shape) for src, spec in zip(node.input_sources, node.inputs)
            if not src.startswith(_NOT_ACTIVATION)]


def residual_structure(nodes: Sequence[Node]) -> Residual:
    """The stream, residual adds and row GEMMs of ``nodes`` (one block, in execution order)."""
    if not nodes:
        return Residual(stream=frozenset(), residual_adds=(), row_gemms=frozenset())
    names = {n.name for n in nodes}
    hidden = nodes[-1].outputs[0].shape if nodes[-1].outputs else ()
    stream: set[str] = set()
    mixed: set[str] = set()  # values computed through a mixing op of the run
    adds: list[str] = []
    for node in nodes:
        acts = _activations(node)
        on_stream = [src in stream or (src not in names and shape == hidden)
                     for src, shape in acts]
        through_mixing = [src in mixed for src, _ in acts]
        if node.kind in _MIXING:
            mixed.add(node.name)
        elif acts and all(on_stream):
            stream.add(node.name)
        elif _is_add(node) and any(on_stream) and any(through_mixing) and node.outputs and \
                all(shape == node.outputs[0].shape for _, shape in acts):
            stream.add(node.name)
            adds.append(node.name)
        elif any(through_mixing):
            mixed.add(node.name)
    consumers: dict[str, list[Node]] = {}
    for node in nodes:
        for src, _ in _activations(node):
            consumers.setdefault(src, []).append(node)
    residual = set(adds)
    rows = set()
    for node in nodes:
        if node.kind is not OpKind.MATMUL or not node.params:
            continue
        if any(src in stream for src, _ in _activations(node)):
            continue  # read straight off the stream: a sub-layer of one GEMM stays column-wise
        frontier, seen = [node.name], set()
        while frontier:
            for nxt in consumers.get(frontier.pop(), ()):
                if nxt.name in residual:
                    rows.add(node.name)
                elif nxt.kind not in _MIXING and nxt.name not in stream and nxt.name not in seen:
                    seen.add(nxt.name)
                    frontier.append(nxt.name)
    return Residual(stream=frozenset(stream), residual_adds=tuple(adds),
                    row_gemms=frozenset(rows))
