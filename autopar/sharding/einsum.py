"""Matmul-family strategies generated from an einsum equation, for one mesh axis.

For an equation such as ``"mk,kn->mn"`` every index letter gives one strategy:

* a letter of the output (``m``, ``n``, a batch letter ``b``): shard it wherever it occurs;
  operands without it stay replicated (their gradient is partial); the output is sharded on it;
* a contracted letter (``k``): shard it in every operand that has it; the output is a partial
  sum ("row parallel");
plus the all-replicated strategy. Operands that are *added* to the product (``addmm``'s bias)
are partial when the product is partial (the bias is added on one rank only).
A letter is usable only if its size is divisible by the axis size in every operand.

For ``mm`` with the weight as the ``kn`` operand this yields Megatron's column parallel
(shard ``n``: weight split on its output features) and row parallel (shard ``k``: input split
on the feature dim, output partial), plus batch/row splitting (shard ``m``). An ``mm`` or
``addmm`` whose activation operand the sharding problem lifted back to its leading dims (a
Linear's ``[batch, seq, k]`` input, flattened for the GEMM) takes a batch letter per extra
dim: ``amk,kn->amn``, so that the sequence ``m`` shards as well as the batch ``a``.
"""

from __future__ import annotations

from typing import Sequence

from autopar.sharding.placement import PARTIAL, REPLICATE, shard
from autopar.sharding.strategy import Strategy, default_input_grads

__all__ = ["MATMUL_EQUATIONS", "einsum_strategies", "matmul_equation"]

# Equation per ATen matmul op; a leading operand listed in "additive" is added to the result.
MATMUL_EQUATIONS = {
    "mm": ("mk,kn->mn", ()),
    "addmm": ("n,mk,kn->mn", (0,)),
    "bmm": ("bmk,bkn->bmn", ()),
    "baddbmm": ("bmn,bmk,bkn->bmn", (0,)),
    "mv": ("mk,k->m", ()),
    "addmv": ("m,mk,k->m", (0,)),
    "_scaled_mm": ("mk,kn->mn", ()),
    # a fused MoE layer's expert GEMM (`autopar.ir.MOE_GROUPED_MM`): routed rows times the
    # [experts, out, in] weight; its expert letter is not contracted (each row meets one
    # expert), so the rules never shard it
    "grouped_mm": ("mk,enk->mn", ()),
}
_BATCH_LETTERS = "abcdefgh"


def matmul_equation(op: str, ranks: Sequence[int]) -> tuple[str, tuple[int, ...]] | None:
    """The equation and additive operands of a matmul op with operands of ``ranks``."""
    if op == "matmul" and len(ranks) == 2:
        ra, rb = ranks
        if ra < 2 or rb < 2:
            return None
        batch = _BATCH_LETTERS[:max(ra, rb) - 2]
        a = batch[len(batch) - (ra - 2):] + "mk"
        b = batch[len(batch) - (rb - 2):] + "kn"
        return f"{a},{b}->{batch}mn", ()
    known = MATMUL_EQUATIONS.get(op)
    if known is None:
        return None
    eq, additive = known
    lhs = eq.split("->")[0].split(",")
    a = len(additive)  # the activation operand of mm/addmm, lifted to its leading dims
    if op in ("mm", "addmm") and len(ranks) == len(lhs) and ranks[a] > 2 \
            and all(r == len(t) for i, (r, t) in enumerate(zip(ranks, lhs)) if i != a):
        batch = _BATCH_LETTERS[:ranks[a] - 2]
        lhs[a] = batch + lhs[a]
        return f"{','.join(lhs)}->{batch}{eq.split('->')[1]}", additive
    if [len(t) for t in eq.split("->")[0].split(",")] != list(ranks[:eq.count(",") + 1]):
        return None
    return known


def einsum_strategies(equation: str, additive: Sequence[int],
                      input_shapes: Sequence[Sequence[int]], output_shape: Sequence[int],
                      axis_size: int) -> list[Strategy]:
    """Strategies of an einsum on one axis; inputs beyond the equation's stay replicated."""
    lhs, out = equation.split("->")
    operands = lhs.split(",")
    extra = len(input_shapes) - len(operands)
    assert extra >= 0, "an equation names at most the op's inputs"
    sizes: dict[str, set[int]] = {}
    for letters, shape in zip(operands, input_shapes):
        for letter, size in zip(letters, shape):
            sizes.setdefault(letter, set()).add(size)
    replicated = tuple([REPLICATE] * len(input_shapes))
    strategies = [Strategy(name="R", inputs=replicated, outputs=(REPLICATE,),
                           input_grads=replicated)]
    if axis_size == 1:
        return strategies
    letters = [c for c in dict.fromkeys(out + "".join(operands))]
    for letter in letters:
        if any(s % axis_size or s < axis_size for s in sizes.get(letter, {0})):
            continue
        contracted = letter not in out
        inputs = []
        for idx, letters_of in enumerate(operands):
            if letter in letters_of:
                inputs.append(shard(letters_of.index(letter)))
            elif contracted and idx in additive:
                inputs.append(PARTIAL)
            else:
                inputs.append(REPLICATE)
        inputs += [REPLICATE] * extra
        output = PARTIAL if contracted else shard(out.index(letter))
        if not contracted and output_shape[out.index(letter)] % axis_size:
            continue
        strategies.append(Strategy(
            name=f"S({letter})", inputs=tuple(inputs), outputs=(output,),
            input_grads=default_input_grads(inputs, split=True), work_divisor=axis_size))
    return strategies
