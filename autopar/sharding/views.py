"""Which input dim of a view-like op becomes which output dim, from shapes alone.

The IR keeps a view's target and shapes but not its arguments, so the dim map is inferred:

* reshape family (``view``, ``_unsafe_view``, ``reshape``, ``flatten``, ``unflatten``,
  ``squeeze``, ``unsqueeze``, ...): input and output dims are cut into contiguous groups of
  equal element count; the leading non-unit dim of a group maps to the leading non-unit dim of
  its image (a block shard of the leading dim of a contiguous group is the same set of
  elements on both sides when both leading sizes are divisible by the axis size -- the caller
  checks that). This covers ``[b, s, h] <-> [b*s, h]`` and ``[b, s, h] <-> [b, s, a, d]``.
* ``transpose``/``t``/``permute``: every permutation consistent with the shapes is a
  candidate; a dim maps only where all candidates agree (so a swap of two equal-sized dims is
  never guessed).
* rank-preserving slicing (``slice``, ``narrow``, ``split``, ``chunk``, ``expand``, ...): dims
  of equal size map to themselves (right-aligned for ``expand``), others do not.
* rank-dropping (``select``, ``unbind``): every way of deleting dims that yields the output
  shape is a candidate; a dim maps where all candidates agree.
* ``view_as_complex``/``view_as_real`` (RoPE as complex products): the dims before the
  trailing pair of reals map to themselves.
Anything else maps no dim (only replicate/partial propagate).
"""

from __future__ import annotations

import itertools
from typing import Sequence

from autopar.ir import op_name

__all__ = ["RESHAPE_OPS", "view_dim_map"]

RESHAPE_OPS = {"view", "_unsafe_view", "reshape", "flatten", "unflatten", "_reshape_alias",
               "squeeze", "unsqueeze", "contiguous", "alias", "detach", "lift_fresh", "clone",
               "view_as", "reshape_as"}
_PERMUTE = {"transpose", "t", "permute", "swapaxes", "movedim", "mT"}
_SAME_RANK = {"slice", "narrow", "split", "split_with_sizes", "chunk", "expand", "expand_as"}
_DROP = {"select", "unbind"}
_COMPLEX = {"view_as_complex", "view_as_real"}


def _agree(candidates: Sequence[dict[int, int]]) -> dict[int, int]:
    if not candidates:
        return {}
    first = candidates[0]
    return {d: e for d, e in first.items() if all(c.get(d) == e for c in candidates[1:])}


def _reshape_map(a: Sequence[int], b: Sequence[int]) -> dict[int, int]:
    if 0 in a or 0 in b:
        return {}
    mapping: dict[int, int] = {}
    i = j = 0
    while i < len(a) and j < len(b):
        group_a, group_b = [i], [j]
        prod_a, prod_b = a[i], b[j]
        i, j = i + 1, j + 1
        while prod_a != prod_b:
            if prod_a < prod_b:
                if i == len(a):
                    return {}
                group_a.append(i)
                prod_a *= a[i]
                i += 1
            else:
                if j == len(b):
                    return {}
                group_b.append(j)
                prod_b *= b[j]
                j += 1
        lead_a = next((d for d in group_a if a[d] > 1), None)
        lead_b = next((d for d in group_b if b[d] > 1), None)
        if lead_a is not None and lead_b is not None:
            mapping[lead_a] = lead_b
    return mapping


def _permute_map(a: Sequence[int], b: Sequence[int], op: str) -> dict[int, int]:
    if len(a) != len(b) or len(a) > 6:
        return {}
    if op in ("transpose", "t", "swapaxes", "mT"):
        perms = []
        for i, j in itertools.combinations(range(len(a)), 2):
            p = list(range(len(a)))
            p[i], p[j] = j, i
            perms.append(p)
        if len(a) < 2 or tuple(a) == tuple(b):
            perms.append(list(range(len(a))))
    else:
        perms = [list(p) for p in itertools.permutations(range(len(a)))]
    # out dim e takes in dim p[e]
    ok = [p for p in perms if all(b[e] == a[p[e]] for e in range(len(b)))]
    return _agree([{p[e]: e for e in range(len(b))} for p in ok])


def _same_rank_map(a: Sequence[int], b: Sequence[int]) -> dict[int, int]:
    offset = len(b) - len(a)  # expand may prepend dims
    if offset < 0:
        return {}
    return {d: d + offset for d in range(len(a)) if a[d] == b[d + offset]}


def _drop_map(a: Sequence[int], b: Sequence[int]) -> dict[int, int]:
    removed = len(a) - len(b)
    if removed < 0 or len(a) > 8:
        return {}
    candidates = []
    for gone in itertools.combinations(range(len(a)), removed):
        kept = [d for d in range(len(a)) if d not in gone]
        if all(a[d] == b[e] for e, d in enumerate(kept)):
            candidates.append({d: e for e, d in enumerate(kept)})
    return _agree(candidates)


def view_dim_map(target: str, input_shape: Sequence[int],
                 output_shape: Sequence[int]) -> dict[int, int]:
    """``{input dim: output dim}`` for dims whose block shards pass through the view."""
    op = op_name(target)
    a, b = tuple(input_shape), tuple(output_shape)
    if op in _PERMUTE:
        return _permute_map(a, b, op)
    if op in _DROP:
        return _drop_map(a, b)
    if op in _COMPLEX:
        return {d: d for d in range(min(len(a), len(b))) if a[d] == b[d] and a[d] > 1}
    if op in _SAME_RANK:
        return _same_rank_map(a, b)
    if op in RESHAPE_OPS or a == b:
        return _reshape_map(a, b) if a != b else {d: d for d in range(len(a)) if a[d] > 1}
    return {}
