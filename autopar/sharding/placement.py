"""Placements of a tensor on one mesh axis, and what moving between two of them costs.

A placement is a short string, the same spelling plans use:

* ``"R"``    -- replicate: every rank of the axis holds the whole tensor;
* ``"S(d)"`` -- shard: dim ``d`` (non-negative) is split into equal contiguous blocks;
* ``"S(d)/f"`` -- strided shard: dim ``d`` seen as ``(f, size / f)``, the second split into
  blocks (heads split inside a dim that merges batch and heads: DTensor's ``_StridedShard``);
* ``"P"``    -- partial sum: every rank holds a full-size tensor and the true value is their sum.

Resharding ``src -> dst`` of a tensor of ``nbytes`` (its full, unsharded size) is one collective
on the axis, or nothing:

====================  =====================================  =========================
src -> dst            how                                    collective
====================  =====================================  =========================
same                  nothing                                --
R -> S(d), R -> P     local slice / keep on one rank only    --
S(d) -> P             zero-fill the other blocks locally     --
S(d) -> R             gather the blocks                      all_gather(nbytes)
P -> R                sum                                    all_reduce(nbytes)
P -> S(d)             sum and keep one block                 reduce_scatter(nbytes)
S(i) -> S(j)          exchange blocks                        all_to_all(nbytes / n)
                      (strided shards likewise)
====================  =====================================  =========================

``nbytes`` follows ``Cluster.collective_time`` (nccl-tests' convention: the whole buffer; for
all_gather the gathered size, for reduce_scatter the input size, for all_to_all the buffer
each rank sends, hence ``nbytes / n``).

Gradients flow the other way. The gradient of a tensor placed ``p`` in the forward is wanted
as ``grad_placement(p)``: ``R -> R``, ``S(d) -> S(d)``, ``P -> R`` (every summand of a
partial sum gets the same, replicated gradient).
"""

from __future__ import annotations

import functools
import re

__all__ = ["REPLICATE", "PARTIAL", "shard", "shard_dim", "shard_stride", "is_shard",
           "grad_placement", "reshard_collective"]

REPLICATE = "R"
PARTIAL = "P"
_SHARD_RE = re.compile(r"^S\((\d+)\)(?:/(\d+))?$")


@functools.cache  # a handful of dims
def shard(dim: int, stride: int = 1) -> str:
    """The placement sharding non-negative tensor dim ``dim`` (in strides of ``stride``)."""
    assert dim >= 0, "shard dims are normalised to be non-negative"
    return f"S({dim})" if stride == 1 else f"S({dim})/{stride}"


@functools.cache  # a handful of placements, asked about again and again
def shard_dim(placement: str) -> int | None:
    """The dim a ``"S(d)"`` or ``"S(d)/f"`` placement shards, else ``None``."""
    match = _SHARD_RE.match(placement)
    return int(match.group(1)) if match else None


@functools.cache
def shard_stride(placement: str) -> int:
    """The stride ``f`` of a ``"S(d)/f"`` placement; 1 for any other."""
    match = _SHARD_RE.match(placement)
    return int(match.group(2)) if match and match.group(2) else 1


@functools.cache
def is_shard(placement: str) -> bool:
    return shard_dim(placement) is not None


def grad_placement(placement: str) -> str:
    """Placement in which a tensor placed ``placement`` in the forward wants its gradient."""
    return REPLICATE if placement == PARTIAL else placement


def reshard_collective(src: str, dst: str, nbytes: float, axis_size: int
                       ) -> tuple[str, float] | None:
    """The collective ``(kind, nbytes)`` that turns ``src`` into ``dst``, or ``None`` if free."""
    if src == dst or axis_size == 1 or src == REPLICATE or dst == PARTIAL:
        return None
    if src == PARTIAL:
        return ("all_reduce", nbytes) if dst == REPLICATE else ("reduce_scatter", nbytes)
    assert is_shard(src), f"unknown placement {src!r}"
    if dst == REPLICATE:
        return ("all_gather", nbytes)
    assert is_shard(dst), f"unknown placement {dst!r}"
    return ("all_to_all", nbytes / axis_size)
