"""Which outputs of a block's ops recomputation keeps, per policy: the tail an early-stopping
recompute need not re-run, and what per-op selective checkpointing keeps. Pure functions of
the IR."""

from __future__ import annotations

from collections import Counter

from autopar.config import PER_OP_ALTERNATED, PER_OP_SAVED
from autopar.ir import MOE_GROUPED_MM, Node, OpKind

__all__ = ["per_op_kept", "recompute_tail"]


def recompute_tail(nodes: list[Node]) -> set[str]:
    """The trailing nodes a recompute that stops early need not re-run: walking back from
    the last node, each one that keeps no tensor of its own for backward and whose output no
    later node of the unit keeps (torch.utils.checkpoint's non-reentrant early stop re-runs a
    block only until every tensor its backward saved is back: in a transformer block, the last
    GEMM and the residual add after it)."""
    kept_later: set[str] = set()
    tail: set[str] = set()
    for node in reversed(nodes):
        if node.name in kept_later or node.name in node.saved_from:
            break
        tail.add(node.name)
        kept_later.update(node.saved_from)
    return tail


def per_op_kept(nodes: list[Node]) -> dict[str, int] | None:
    """The nodes per-op recompute keeps the output of, with its bytes: attention (its output
    and fp32 log-sum-exp; a fused kernel's, the math kernel's ops being re-run) and the ops of
    `PER_OP_SAVED` but every second `PER_OP_ALTERNATED` matmul, counted in forward order.

    A fused MoE layer's expert GEMM (`autopar.trace.moe`: one node per ``[E, out, in]`` weight)
    runs as one grouped matmul, or as one matmul per expert hit, expert after expert: with an
    even number of such weights (gate_up and down) each node falls on the same parity either
    way, however many experts the routing hits. With an odd number a per-expert loop's parity
    follows the routing: None (per-op recompute is not costed). A block with none of these
    ops (Linear layers with biases run ``addmm``, attention written with ``baddbmm``) keeps
    nothing: per-op recompute re-runs it whole, as full recompute does."""
    out: dict[str, int] = {}
    grouped = Counter(n.module_path for n in nodes if n.target == MOE_GROUPED_MM)
    if any(count % 2 for count in grouped.values()):
        return None
    matmuls = 0
    for node in nodes:
        if node.kind is OpKind.ATTENTION and node.attention is not None:
            a = node.attention
            out[node.name] = node.outputs[0].num_bytes + 4 * a.batch * a.num_heads * a.seq_q
            continue
        alternated = node.target in PER_OP_ALTERNATED or node.target == MOE_GROUPED_MM
        matmuls += alternated
        if (node.target in PER_OP_SAVED or alternated) and not (alternated and matmuls % 2 == 0):
            out[node.name] = sum(o.num_bytes for o in node.outputs)
    return out
