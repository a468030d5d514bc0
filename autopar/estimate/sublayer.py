"""A block's sub-layers (`autopar.ir.residual.sublayers`) as the estimate sees them: what
running one replicated over tensor parallel changes (`autopar.estimate.units.Unit.replicated`).
Pure functions of the IR; no torch import."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.ir import Node, OpKind

__all__ = ["SubLayer", "sublayer_of"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SubLayer:
    """One sub-layer of a block (`autopar.ir.residual.sublayers`) at the traced batch: what
    running it replicated over tp changes (`Unit.replicated`)."""

    ops: tuple[int, ...]  # indices into `Unit.ops`
    reductions: int  # its row-parallel GEMMs: tp reductions per direction under Megatron's
    params: int  # elements of its GEMMs' parameters this unit owns that tp splits otherwise
    trainable: tuple[int, ...]  # elements of each of those parameters that trains
    per_op_partial: int  # of `Unit.saved_bytes_per_op_partial`: its row GEMMs' kept outputs
    # whether a runtime can run it replicated on the sequence shard: GEMMs (matmuls) with
    # weights, element-wise and norm ops only -- no attention (it needs the whole sequence),
    # no MoE routing, embedding or convolution
    replicable: bool


_NOT_REPLICABLE = frozenset({OpKind.ATTENTION, OpKind.MOE_DISPATCH, OpKind.MOE_COMBINE,
                             OpKind.EMBEDDING, OpKind.CONV})


def sublayer_of(run: list[Node], op_index: dict[str, int], residual, kept: dict[str, int],
                owned: dict[str, int], whole: set[str]) -> SubLayer:
    """`SubLayer` of one run of a block's nodes (``owned``: the parameters the unit counts;
    ``whole``: those of them tp never splits, `Unit.tp_shared_params`)."""
    gemm_params = {p.fqn: p for n in run if n.kind is OpKind.MATMUL for p in n.params
                   if p.fqn in owned}
    return SubLayer(
        ops=tuple(op_index[n.name] for n in run if n.name in op_index),
        reductions=sum(n.name in residual.row_gemms for n in run),
        params=sum(p.numel for p in gemm_params.values() if p.fqn not in whole),
        trainable=tuple(p.numel for p in gemm_params.values() if p.requires_grad),
        per_op_partial=sum(kept.get(n.name, 0) for n in run
                           if n.name in residual.row_gemms and n.kind is not OpKind.ATTENTION),
        replicable=bool(gemm_params) and not any(n.kind in _NOT_REPLICABLE
                                                 or n.target.startswith("moe.") for n in run))
