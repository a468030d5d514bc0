"""Which GEMMs fp8 training runs in fp8: one answer for the estimate (`units`, which costs them
and their operands' casts) and for the plan the runtime follows (``Plan.training
["fp8_weights"]``: `autopar.plan.placements.fp8_weights`, `autopar.runtime.fp8`).

A GEMM runs in fp8 when it multiplies activations by one 2-D parameter weight (a Linear layer,
a Conv1D's ``addmm``, ``x @ w``) whose dims are both multiples of `FP8_DIM_MULTIPLE`, and it is
not the projection onto the vocabulary. Attention, norms, the loss and every other op stay in
16 bits, as do experts fused into one ``[experts, out, in]`` weight (grouped GEMMs).

Sources: ``torch._scaled_mm`` (cuBLASLt's fp8 GEMMs) needs both dims of its right operand to
be multiples of 16, and torchao's ``Float8Linear`` conversion skips Linear layers whose
weights are not; torchtitan's float8 converter leaves the output head in bf16 by default
(``filter_fqns = ["output"]``), as Transformer Engine recipes keep the vocabulary projection
out of fp8. Pure functions of the IR; no torch import.
"""

from __future__ import annotations

from autopar.ir import MOE_GROUPED_MM, Node, OpKind

__all__ = ["FP8_DIM_MULTIPLE", "fp8_elements", "fp8_weight"]

FP8_DIM_MULTIPLE = 16


def fp8_weight(node: Node, vocab_dims: set[int]):
    """The parameter whose GEMM `node` runs in fp8 (a `ParamSpec`), or None."""
    if node.kind is not OpKind.MATMUL or node.target == MOE_GROUPED_MM or not node.params:
        return None
    if any(p.shape and p.shape[0] in vocab_dims for p in node.params):  # over the vocabulary
        return None
    weights = [p for p in node.params if len(p.shape) == 2]
    if len(weights) != 1 or any(d % FP8_DIM_MULTIPLE for d in weights[0].shape):
        return None
    return weights[0]


def fp8_elements(node: Node, vocab_dims: set[int]) -> tuple[float, float, float] | tuple[()]:
    """Elements of an fp8 GEMM's activation input, weight and output, whose casts fp8
    training pays (`units.OpCost.fp8_elements`); () for a GEMM that stays in 16 bits."""
    if fp8_weight(node, vocab_dims) is None:
        return ()
    params = {f"param:{p.fqn}" for p in node.params}
    inputs = sum(t.numel for t, src in zip(node.inputs, node.input_sources) if src not in params)
    return (float(inputs), float(sum(p.numel for p in node.params)),
            float(sum(t.numel for t in node.outputs[:1])))
