"""A sharding strategy of one op on one mesh axis, and its expansion to an N-D mesh.

A :class:`Strategy` says, for one mesh axis, where each input must be, where each output ends
up, where the gradient of each input ends up, by how much the op's work is divided, and which
collectives the op itself runs (beyond resharding its operands). Rules
(:mod:`autopar.sharding.rules`) declare strategies for one axis only; :func:`expand_nd` forms
the strategies of an N-D mesh as the product of per-axis strategies, dropping combinations
whose shards do not divide a tensor dim (a dim sharded on several axes is split by the product
of their sizes, outer axis first).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from autopar.sharding.placement import PARTIAL, REPLICATE, grad_placement, shard_dim

__all__ = ["Collective", "Strategy", "NDStrategy", "default_input_grads", "expand_nd"]

Collective = tuple[str, float]  # (kind as Cluster.collective_time names it, nbytes)


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """How one op runs on one mesh axis.

    ``inputs[i]``/``outputs[j]`` are placements (``"R"``, ``"S(d)"``, ``"P"``);
    ``input_grads[i]`` is the placement of the gradient this strategy produces for input ``i``;
    ``output_grads[j]`` the placement it needs the gradient of output ``j`` in (empty: the
    usual ``grad_placement`` of the output; a replicated op whose backward is linear in the
    output gradient may also take it partial and hand partial gradients on);
    ``work_divisor`` is 1 when every rank does the whole op and the axis size when the work
    is split; ``fwd_collectives``/``bwd_collectives`` are collectives internal to the op.
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_grads: tuple[str, ...]
    output_grads: tuple[str, ...] = ()
    work_divisor: int = 1
    fwd_collectives: tuple[Collective, ...] = ()
    bwd_collectives: tuple[Collective, ...] = ()

    @property
    def split(self) -> bool:
        return self.work_divisor > 1

    @property
    def grad_outputs(self) -> tuple[str, ...]:
        """Placement of each output's gradient that this strategy's backward consumes."""
        return self.output_grads or tuple(map(grad_placement, self.outputs))


def default_input_grads(inputs: Sequence[str], split: bool) -> tuple[str, ...]:
    """Gradient placements implied by the forward ones.

    A sharded input gets a sharded gradient; a partial input a replicated one (every summand
    gets the same gradient); a replicated input a partial gradient when the work is split
    (each rank saw only its part of the consumers) and a replicated one when it is not.
    """
    out = []
    for p in inputs:
        if p == PARTIAL:
            out.append(REPLICATE)
        elif p == REPLICATE:
            out.append(PARTIAL if split else REPLICATE)
        else:
            out.append(p)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class NDStrategy:
    """One strategy per mesh axis, keyed by axis name (in mesh order, outer first)."""

    per_axis: tuple[tuple[str, Strategy], ...]

    @property
    def name(self) -> str:
        return " x ".join(f"{axis}:{s.name}" for axis, s in self.per_axis)

    @property
    def work_divisor(self) -> int:
        total = 1
        for _, s in self.per_axis:
            total *= s.work_divisor
        return total


def _fits(shape: Sequence[int], placements: Sequence[str], sizes: Sequence[int]) -> bool:
    """Whether sharding ``shape`` by ``placements`` on axes of ``sizes`` leaves whole blocks."""
    divisor = [1] * len(shape)
    for p, n in zip(placements, sizes):
        d = shard_dim(p)
        if d is not None:
            divisor[d] *= n
    return all(size % k == 0 for size, k in zip(shape, divisor))


def expand_nd(axis_sizes: Mapping[str, int], input_shapes: Sequence[Sequence[int]],
              output_shapes: Sequence[Sequence[int]],
              rule: Callable[[int], Sequence[Strategy]]) -> tuple[NDStrategy, ...]:
    """Product of the per-axis strategies ``rule(axis_size)``, keeping those whose combined
    shards divide every input and output dim. Order: lexicographic in the per-axis lists."""
    names = list(axis_sizes)
    sizes = [axis_sizes[a] for a in names]
    per_axis = [tuple(rule(n)) for n in sizes]
    out = []
    for combo in itertools.product(*per_axis):
        ok = all(_fits(shape, [s.inputs[i] for s in combo], sizes)
                 for i, shape in enumerate(input_shapes))
        ok = ok and all(_fits(shape, [s.outputs[j] for s in combo], sizes)
                        for j, shape in enumerate(output_shapes))
        if ok:
            out.append(NDStrategy(per_axis=tuple(zip(names, combo))))
    return tuple(out)
