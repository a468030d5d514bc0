"""Megatron-style placement of layers on pipeline stages, for estimating a given config.

Block layers are split as evenly as possible over the pp x virtual_stages chunks in model
order (a remainder goes to the chunks after the first, which also holds the embedding); glue
before the first block joins the first chunk, glue after the last block joins the last chunk,
glue between blocks stays with the layer that follows it. With more chunks than block layers,
the glue after the blocks (the head and loss), then the glue before them (the embedding), take
a chunk of their own, one block per other chunk -- as Megatron-LM runs such splits when it
counts the loss and the embedding as pipeline layers (`--account-for-loss-in-pipeline-split`,
`--account-for-embedding-in-pipeline-split`; the Zero Bubble fork's padded layers). Chunk c
runs on pipeline rank c mod pp (interleaved placement). The search may balance stages
differently; `weight_balanced_boundaries` is nanotron's placement.
"""

from __future__ import annotations

import numpy as np

from autopar.estimate.units import Unit
from autopar.errors import InvalidConfigError

__all__ = ["Boundaries", "body_span", "megatron_boundaries", "check_boundaries",
           "layer_sequence", "unit_order", "weight_balanced_boundaries"]

Boundaries = tuple[tuple[int, int], ...]  # half-open layer ranges over layer_sequence(units)


def megatron_boundaries(units: tuple[Unit, ...], num_chunks: int) -> np.ndarray:
    """Megatron's placement (module docstring) as half-open ranges over `layer_sequence`:
    int64 [chunk, (start, end)]."""
    start = sum(len(u.layer_fqns) for u in units)
    first, end = body_span(units)
    n_body = end - first
    if n_body < num_chunks:
        spare = num_chunks - n_body  # chunks the glue before and after the blocks take alone
        tail = min(spare, int(end < start))
        lead = spare - tail
        if lead > int(first > 0) or not n_body:
            raise InvalidConfigError(
                f"{num_chunks} pipeline stages for {n_body} block layers and "
                f"{int(first > 0) + int(end < start)} modules before and after them: every "
                f"stage needs at least one layer (or the embedding or the head alone); lower "
                f"pp or virtual_stages")
        body = list(range(first, end))  # one block layer per chunk
        if not lead:
            body[0] = 0  # the glue before joins the first block
        starts = [0] * lead + body + [end] * tail
        cuts = np.empty((num_chunks, 2), dtype=np.int64)
        cuts[:, 0] = starts
        cuts[:-1, 1] = starts[1:]
        cuts[-1, 1] = start
        return cuts
    base, extra = divmod(n_body, num_chunks)
    chunk = np.arange(num_chunks, dtype=np.int64)
    cuts = np.empty((num_chunks, 2), dtype=np.int64)
    cuts[:, 1] = first + base * (chunk + 1) + np.minimum(chunk, extra)
    cuts[-1, 1] = start
    cuts[0, 0] = 0
    cuts[1:, 0] = cuts[:-1, 1]
    return cuts


def weight_balanced_boundaries(units: tuple[Unit, ...], num_chunks: int) -> Boundaries:
    """nanotron's placement of layers on pipeline stages (`build_model`, models/base.py, at
    e24d248 and since): each layer costs the elements of its GEMM weights (for a Llama block
    with full multi-head attention 4·h² + 3·ffn·h, nanotron's `get_block_compute_costs`; the
    head vocab·h; an embedding lookup and norms nothing), and the layers go in model order to
    the current chunk until the running total passes that chunk's share of the whole
    (total·(c+1)/num_chunks), the layer that passes it staying on it. Megatron's placement
    where this would leave a chunk empty or the model has no GEMM weights."""
    layers = layer_sequence(units)
    cost = {id(u): sum(op.param_bytes for op in u.ops if op.kind == "gemm") for u in units}
    running = np.cumsum([cost[id(u)] for u, _ in layers])
    total = float(running[-1]) if len(running) else 0.0
    owner, chunk = [], 0
    for value in running:
        owner.append(chunk)
        if chunk < num_chunks - 1 and value > total * (chunk + 1) / num_chunks:
            chunk += 1
    if total <= 0 or chunk < num_chunks - 1 or owner[-1] != num_chunks - 1:
        return tuple(map(tuple, megatron_boundaries(units, num_chunks).tolist()))
    starts = [0] + [i for i in range(1, len(owner)) if owner[i] != owner[i - 1]]
    return tuple(zip(starts, starts[1:] + [len(owner)]))


def unit_order(units: tuple[Unit, ...]) -> list[int]:
    """The unit of each layer in model order (`Unit.positions`; the units' own order where
    they carry none): copies of two blocks may alternate (sliding-window and global attention
    layers, dense and MoE layers)."""
    placed = all(len(u.positions) == u.count for u in units)
    keyed = sorted((u.positions[k] if placed else i, i, k)
                   for i, u in enumerate(units) for k in range(u.count))
    return [i for _, i, _ in keyed]


def body_span(units: tuple[Unit, ...]) -> tuple[int, int]:
    """Half-open range over `layer_sequence` from the first block layer to the end of the
    last (the glue between blocks included); the whole sequence when there are no blocks."""
    order = unit_order(units)
    body = [p for p, i in enumerate(order) if units[i].is_block]
    return (body[0], body[-1] + 1) if body else (0, len(order))


def layer_sequence(units: tuple[Unit, ...]) -> list[tuple[Unit, str]]:
    """Every layer of the model in order, glue included: (unit, module path)."""
    seen = [0] * len(units)
    out = []
    for i in unit_order(units):
        out.append((units[i], units[i].layer_fqns[seen[i]]))
        seen[i] += 1
    return out


def check_boundaries(num_layers: int, boundaries: Boundaries) -> None:
    """Raise unless `boundaries` cut `num_layers` layers into contiguous non-empty ranges."""
    if boundaries[0][0] != 0 or boundaries[-1][1] != num_layers or any(
            a[1] != b[0] or a[0] >= a[1] for a, b in zip(boundaries, boundaries[1:])):
        raise InvalidConfigError(
            f"stage boundaries {boundaries} do not cut the {num_layers} layers "
            f"into contiguous non-empty ranges")
