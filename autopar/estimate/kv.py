"""Key/value projections under tensor parallel: those every tp rank runs whole, and what
their gradients move (`autopar.ir.residual.kv_projections` finds them in the graph)."""

from __future__ import annotations

from typing import NamedTuple

from autopar.config import ParallelConfig

__all__ = ["KvGemm", "kv_whole"]


def kv_whole(kv_heads: int, tp: int, cut: bool = False) -> bool:
    """Whether a projection making ``kv_heads`` key/value heads (0: none) runs whole on every
    tp rank: tp does not divide its heads, or it is a fused q/k/v projection tp cannot split
    by head (``cut``, `KvGemm.cut`). `autopar.plan.megatron_tp_placements` replicates it;
    each rank reads the kv heads (and slices the query heads) its own query heads use."""
    return bool(kv_heads) and tp > 1 and (kv_heads % tp != 0 or cut)


class KvGemm(NamedTuple):
    """A GEMM that makes an attention's keys or values, in a unit
    (`autopar.ir.residual.kv_projections`); bytes at the unit's batch."""

    heads: int  # kv heads it makes
    params: int  # elements of its parameters the unit owns
    reads: tuple[float, ...]  # bytes of each attention input (K, V) it makes
    read_heads: int  # their heads (more where the model repeats K/V to the query heads)
    cut: bool = False  # a fused q/k/v projection tp cannot split by head (cut unevenly)
    query_bytes: float = 0.0  # a fused projection's: bytes of the attention's queries
    # a fused projection's input read by no other weight GEMM: run whole, it hands back that
    # input's whole gradient, which the sub-layer then does not reduce over tp
    input_bytes: float = 0.0

    def whole(self, tp: int) -> bool:
        """Whether every rank of ``tp`` runs it whole (`kv_whole`)."""
        return kv_whole(self.heads, tp, self.cut)

    def backward(self, cfg: ParallelConfig
                 ) -> tuple[list[tuple[str, float]], tuple[str, float] | None]:
        """Run whole under ``cfg``: the collectives its gradients add backward, per layer and
        micro-batch as ``(kind, nbytes)`` (`autopar.estimate.timing.tp_collectives`), and the
        sub-layer's input reduction it spares (None: none). The gradient of each attention
        input it makes is all-gathered where tp divides its heads (each rank read its query
        heads' copies of K/V repeated to them), else all-reduced (partial sums); a fused
        projection's queries, which each rank sliced to its heads, are all-gathered."""
        if not self.whole(cfg.tp):
            return [], None
        kind = "all_reduce" if self.read_heads % cfg.tp else "all_gather"
        added = [(kind, n / cfg.cp) for n in self.reads]
        if self.query_bytes:
            added.append(("all_gather", self.query_bytes / cfg.cp))
        spared = ("reduce_scatter" if cfg.sequence_parallel else "all_reduce",
                  self.input_bytes / cfg.cp)
        return added, spared if self.input_bytes else None
