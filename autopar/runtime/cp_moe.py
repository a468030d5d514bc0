"""MoE sub-layers under context parallel of a model's own forward: each rank routes its own
tokens.

A block's sub-layer that holds an MoE layer (``autopar.trace.moe.moe_experts``) works token by
token: a router, the experts on the tokens routed to them, their weighted sum. Under context
parallel its input is sequence-sharded over cp, and its routing ops (top-k, one-hot masks,
``index_add_``) have no DTensor sharding strategy, so DTensor would gather the whole sequence
on every cp rank and each rank would run every token's experts. This runs the sub-layer's own
forward on the rank's local tokens instead, its output rejoining as the sequence shard: no
collective, 1/cp of the work, and what the estimate costs. The parameters are the plain
tensors data parallel over dp x cp sums the gradients of.

Exact where the sub-layer's output on the whole sequence is its outputs on the sequence's
chunks, joined: `per_token_error` checks it on the input the sub-layer got in one forward of
an example micro-batch, for one sub-layer of each class, before the model is sharded; a class
that fails (a layer that mixes tokens, a capacity that drops tokens by their position in the
batch) keeps DTensor's execution, with a warning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_leaves, tree_map

from autopar.ir import SEQUENCE_DIM

__all__ = ["install_token_local", "per_token_error", "token_local_classes"]

_TOLERANCE = 1e-5  # relative: the same ops on fewer rows


def _first_tensor(out: Any) -> torch.Tensor | None:
    return next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)


@torch.no_grad()
def per_token_error(sublayer: nn.Module, inputs: tuple, parts: int) -> float:
    """The largest difference, relative to the output's largest value, between ``sublayer``'s
    output on its captured ``inputs`` (args, kwargs; the first argument ``[batch, seq, ...]``)
    and its outputs on ``parts`` chunks of the sequence, joined; inf where the output is not
    shaped like the input."""
    (x, *rest), kwargs = inputs
    whole = _first_tensor(sublayer(x, *rest, **kwargs))
    if whole is None or whole.shape != x.shape:
        return float("inf")
    joined = torch.cat([_first_tensor(sublayer(c.contiguous(), *rest, **kwargs))
                        for c in x.tensor_split(parts, dim=SEQUENCE_DIM)], dim=SEQUENCE_DIM)
    return float((joined - whole).abs().max() / whole.abs().max().clamp_min(1e-30))


def token_local_classes(model: nn.Module, cp: int, example: Callable[[], torch.Tensor]
                        ) -> set[type]:
    """The classes of ``model``'s MoE sub-layers (the block children holding an MoE layer)
    that run exactly on the local tokens of ``cp`` ranks (`per_token_error` on the inputs
    the first of each class got in one forward of ``example()``)."""
    from autopar.runtime.expert_gather import _capture_inputs
    from autopar.runtime.tensor_parallel import _sublayer_entries
    from autopar.runtime.tp_moe import moe_sublayers, verified_classes

    owners = {n.rpartition(".")[0] for n, _ in model.named_parameters()}
    names = moe_sublayers(model, _sublayer_entries(model, owners))
    if not names:
        return set()
    inputs = _capture_inputs(model, names, example())
    runnable = [n for n in names if n in inputs and inputs[n][0]
                and isinstance(inputs[n][0][0], torch.Tensor)]
    return verified_classes(model, runnable, lambda name, sub: per_token_error(
        sub, inputs[name], cp), _TOLERANCE,
        "its output on the whole sequence is not its outputs on the sequence's chunks "
        "(relative error %.1e), so under context parallel it runs with DTensor, which "
        "gathers the sequence on every rank")


def install_token_local(module: nn.Module, mesh: Any, classes: set[type]) -> None:
    """Run every sub-layer of ``module`` of one of ``classes`` on this rank's tokens: a
    sequence-sharded DTensor first argument enters as its local shard, and tensor outputs
    shaped like it rejoin as the sequence shard on the cp ``mesh``."""
    for sub in (m for m in module.modules() if type(m) in classes):
        _wrap(sub, mesh)


def _wrap(sub: nn.Module, mesh: Any) -> None:
    forward = sub.forward
    shard = (Shard(SEQUENCE_DIM),)

    def local_forward(x: Any, *args, **kwargs):
        if not isinstance(x, DTensor) or any(isinstance(t, DTensor)
                                             for t in tree_leaves((args, kwargs))):
            return forward(x, *args, **kwargs)
        local = (x if x.placements == shard else x.redistribute(mesh, shard)).to_local()
        out = forward(local, *args, **kwargs)
        return tree_map(lambda t: DTensor.from_local(t, mesh, shard, run_check=False)
                        if isinstance(t, torch.Tensor) and t.shape == local.shape else t, out)

    sub.forward = local_forward
