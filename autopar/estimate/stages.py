"""Megatron-style placement of layers on pipeline stages, for estimating a given config.

Block layers are split as evenly as possible over the pp x virtual_stages chunks in model
order (a remainder goes to the chunks after the first, which also holds the embedding); glue
before the first block joins the first chunk, glue after the last block joins the last chunk,
glue between blocks stays with the layer that follows it. Chunk c runs on pipeline rank
c mod pp (interleaved placement). The search may balance stages differently.
"""

from __future__ import annotations

import numpy as np

from autopar.estimate.units import Unit
from autopar.errors import InvalidConfigError

__all__ = ["Boundaries", "megatron_boundaries", "check_boundaries", "layer_sequence"]

Boundaries = tuple[tuple[int, int], ...]  # half-open layer ranges over layer_sequence(units)


def megatron_boundaries(units: tuple[Unit, ...], num_chunks: int) -> np.ndarray:
    """Megatron's placement (module docstring) as half-open ranges over `layer_sequence`:
    int64 [chunk, (start, end)]."""
    spans, start = [], 0  # (first layer, end) of each unit's layers in the sequence
    for u in units:
        spans.append((start, start + len(u.layer_fqns)))
        start += len(u.layer_fqns)
    body = [span for u, span in zip(units, spans) if u.is_block and span[0] < span[1]]
    first, end = (body[0][0], body[-1][1]) if body else (0, start)
    n_body = end - first
    if n_body < num_chunks:
        raise InvalidConfigError(f"{num_chunks} pipeline stages for {n_body} layers: every stage "
                         f"needs at least one layer; lower pp or virtual_stages")
    base, extra = divmod(n_body, num_chunks)
    chunk = np.arange(num_chunks, dtype=np.int64)
    cuts = np.empty((num_chunks, 2), dtype=np.int64)
    cuts[:, 1] = first + base * (chunk + 1) + np.minimum(chunk, extra)
    cuts[-1, 1] = start
    cuts[0, 0] = 0
    cuts[1:, 0] = cuts[:-1, 1]
    return cuts


def layer_sequence(units: tuple[Unit, ...]) -> list[tuple[Unit, str]]:
    """Every layer of the model in order, glue included: (unit, module path)."""
    return [(u, fqn) for u in units for fqn in u.layer_fqns]


def check_boundaries(num_layers: int, boundaries: Boundaries) -> None:
    """Raise unless `boundaries` cut `num_layers` layers into contiguous non-empty ranges."""
    if boundaries[0][0] != 0 or boundaries[-1][1] != num_layers or any(
            a[1] != b[0] or a[0] >= a[1] for a, b in zip(boundaries, boundaries[1:])):
        raise InvalidConfigError(
            f"stage boundaries {boundaries} do not cut the {num_layers} layers "
            f"into contiguous non-empty ranges")
