"""Megatron-style placement of layers on pipeline stages, for estimating a given config.

Block layers are split as evenly as possible over the pp x virtual_stages chunks in model
order (a remainder goes to the chunks after the first, which also holds the embedding); glue
before the first block joins the first chunk, glue after the last block joins the last chunk,
glue between blocks stays with the layer that follows it. Chunk c runs on pipeline rank
c mod pp (interleaved placement). The search may balance stages differently.
"""

from __future__ import annotations

from autopar.estimate.units import Unit

__all__ = ["Chunk", "assign_stages", "cut_stages", "layer_sequence"]

Chunk = list[tuple[Unit, tuple[str, ...]]]  # (unit, the layer FQNs of it placed here)


def assign_stages(units: tuple[Unit, ...], num_chunks: int) -> list[Chunk]:
    items = [(u, fqn) for u in units for fqn in u.layer_fqns]
    is_block = [u.is_block for u, _ in items]
    body_idx = [i for i, b in enumerate(is_block) if b] or list(range(len(items)))
    first, last = body_idx[0], body_idx[-1]
    body = items[first:last + 1]
    if len(body) < num_chunks:
        raise ValueError(f"{num_chunks} pipeline stages for {len(body)} layers: every stage "
                         f"needs at least one layer; lower pp or virtual_stages")
    base, extra = divmod(len(body), num_chunks)
    sizes = [base + (1 if 0 < c <= extra else 0) for c in range(num_chunks)]
    if extra and sizes[0] == base and sum(sizes) < len(body):
        sizes[-1] += len(body) - sum(sizes)
    chunks: list[list[tuple[Unit, str]]] = []
    start = 0
    for size in sizes:
        chunks.append(body[start:start + size])
        start += size
    chunks[0] = items[:first] + chunks[0]
    chunks[-1] = chunks[-1] + items[last + 1:]
    return [_group(c) for c in chunks]


def _group(items: list[tuple[Unit, str]]) -> Chunk:
    out: Chunk = []
    for unit, fqn in items:
        if out and out[-1][0] is unit:
            out[-1] = (unit, out[-1][1] + (fqn,))
        else:
            out.append((unit, (fqn,)))
    return out


def layer_sequence(units: tuple[Unit, ...]) -> list[tuple[Unit, str]]:
    """Every layer of the model in order, glue included: (unit, module path)."""
    return [(u, fqn) for u in units for fqn in u.layer_fqns]


def cut_stages(units: tuple[Unit, ...], boundaries: tuple[tuple[int, int], ...]) -> list[Chunk]:
    """Chunks from explicit half-open layer ranges over `layer_sequence(units)` (e.g. the
    inter-op stage DP's cut); the ranges must cover the sequence in order."""
    items = layer_sequence(units)
    if boundaries[0][0] != 0 or boundaries[-1][1] != len(items) or any(
            a[1] != b[0] or a[0] >= a[1] for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError(f"stage boundaries {boundaries} do not cut the {len(items)} layers "
                         f"into contiguous non-empty ranges")
    return [_group(items[a:b]) for a, b in boundaries]
