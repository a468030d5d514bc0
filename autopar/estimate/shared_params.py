"""The parameters a unit's tensor-parallel layout keeps whole on every tp rank while ops on
split data read them, so that each rank's gradient of them is a partial sum over tp
(`autopar.estimate.tp_comm.partial_gradients`): the sequence-sharded stream's, routers' and
low-rank projections', heads' scales and scalars, and row-parallel GEMMs' biases."""

from __future__ import annotations

from autopar.ir import Node, OpKind
from autopar.ir.residual import (Residual, after_row_ops, made_of_params, moe_dispatch,
                                 router_gemms, sublayers)

__all__ = ["shared_params"]


def shared_params(nodes: list[Node], residual: Residual, stream: set[str], sharded: set[str],
                  whole: dict[str, set[str]], owned: dict[str, int], broadcast: set[str]
                  ) -> tuple[dict[str, int], ...]:
    """{fqn: trainable elements} of the parameters, owned by this unit, that tp never splits
    and ops on split data read: those on the sequence-sharded ``stream`` (and after row
    GEMMs), routers' and low-rank projections' (`_router_params`), those of ops on split
    features (``sharded``) that read them as heads (`_head_params`) or ``broadcast`` along
    the split features (`autopar.ir.reductions.broadcast_params`), and row-parallel GEMMs'
    biases."""
    scales = {p.fqn: p.numel for n in nodes for p in n.params
              if p.fqn in broadcast and p.requires_grad and p.fqn in owned}
    return (_params_of(nodes, stream | after_row_ops(nodes, residual), owned),
            _router_params(nodes, residual, whole, owned),
            _head_params(nodes, sharded, owned) | scales,
            {p.fqn: p.numel for n in nodes if n.name in residual.row_gemms for p in n.params
             if len(p.shape) == 1 and p.requires_grad and p.fqn in owned})


def _params_of(nodes: list[Node], users: set[str], owned: dict[str, int]) -> dict[str, int]:
    """{fqn: trainable elements} of the parameters, owned by this unit, the nodes ``users``
    read, directly or through ops made of parameters alone (`made_of_params`)."""
    users = users | made_of_params(nodes, users)
    return {p.fqn: p.numel for n in nodes if n.name in users for p in n.params
            if p.requires_grad and p.fqn in owned}


def _head_params(nodes: list[Node], sharded: set[str], owned: dict[str, int]
                 ) -> dict[str, int]:
    """Trainable elements of the parameters, owned by this unit, of the ops on split features
    (``sharded``, `tp_split_ops`) that read them as heads (a 4-D ``[..., heads, head_dim]``
    input: tp splits the heads, not what the op normalises or scales), and of the ops made of
    parameters alone that only those read (`made_of_params`)."""
    return _params_of(nodes, {n.name for n in nodes if n.name in sharded and any(
        len(t.shape) >= 4 for t, src in zip(n.inputs, n.input_sources)
        if not src.startswith(("param:", "buffer:", "const")))}, owned)


def _router_params(nodes: list[Node], residual, whole: dict[str, set[str]],
                   owned: dict[str, int]) -> dict[str, int]:
    """{fqn: trainable elements} of the parameters, owned by this unit, that every tp rank holds
    whole before split features: an MoE sub-layer's routers (`router_gemms`) and gate of one
    output feature (Qwen2-MoE's on its shared expert), which tp cannot split, and the low-rank
    projections ``whole`` with the ops after them (`bottleneck_gemms`)."""
    found = _params_of(nodes, set(whole).union(*whole.values()), owned)
    for run in (r for r in sublayers(nodes, residual) if moe_dispatch(r) is not None):
        for node in router_gemms(run) + [n for n in run if n.kind is OpKind.MATMUL and n.params
                                         and n.outputs and n.outputs[0].shape[-1] == 1]:
            found.update({p.fqn: p.numel for p in node.params
                          if p.requires_grad and p.fqn in owned})
    return found
