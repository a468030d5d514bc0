"""Per-parameter placements keyed by mesh axis, for every parameter of the model.

Tensor-parallel placements come from a map {representative param FQN: placement}, either
the intra-op ILP's solution or `megatron_tp_placements` (the layout the estimate assumes):
in each sub-layer (the nodes up to a residual add, found from the dataflow by
`autopar.ir.residual`, whatever the norms are written as) the GEMM whose output reaches the
residual add is row-parallel (weight [out, in] sharded on dim 1, its bias replicated) and the
other GEMMs are column-parallel (weight and bias sharded on dim 0); embeddings and the vocabulary head
are vocab-parallel (dim 0); norms stay replicated. In an MoE sub-layer the router is
replicated and each expert of an experts list is its own column→row run (what the estimate
costs: expert weights split over tp, one tp reduction per sub-layer). Block representatives
expand to every layer of their block. The dp axis shards parameters on dim 0 under ZeRO-3 only; expert
parameters are sharded over ep on their expert dim.
"""

from __future__ import annotations

import re

from autopar.config import ParallelConfig
from autopar.estimate.units import vocab_sizes
from autopar.ir import Graph, OpKind
from autopar.ir.residual import fused_chunks, residual_structure

__all__ = ["fused_projections", "megatron_tp_placements", "param_placements"]

_EXPERT = re.compile(r"\.experts\.\d+\.")  # one expert of an experts list


def megatron_tp_placements(graph: Graph) -> dict[str, str]:
    vocab = vocab_sizes(graph)
    out: dict[str, str] = {}
    sublayer: list = []
    block_of = {name: b.representative for b in graph.blocks for name in b.node_names}
    runs: dict[str | None, list] = {}
    for node in graph.nodes:
        runs.setdefault(block_of.get(node.name), []).append(node)
    structure = {key: residual_structure(nodes) for key, nodes in runs.items()
                 if key is not None}
    adds = {name for r in structure.values() for name in r.residual_adds}
    rows = {name for r in structure.values() for name in r.row_gemms}

    def close(group: list) -> None:
        """One sub-layer (the nodes up to its residual add).  An MoE sub-layer is a replicated
        router (every rank needs
        all expert logits to route) and one column→row run per expert."""
        dispatch = next((i for i, n in enumerate(group) if n.kind is OpKind.MOE_DISPATCH), None)
        if dispatch is None:
            close_run(group)
            return
        for node in group[:dispatch]:
            if node.kind in (OpKind.MATMUL, OpKind.CONV):
                for p in node.params:
                    out.setdefault(p.fqn, "R")
        runs: dict[str, list] = {}
        for node in group[dispatch + 1:]:
            match = next((_EXPERT.search(p.fqn) for p in node.params if _EXPERT.search(p.fqn)),
                         None)
            runs.setdefault(match.group(0) if match else "", []).append(node)
        for run in runs.values():
            close_run(run, by_position=True)

    def close_run(group: list, by_position: bool = False) -> None:
        """Column-parallel GEMMs and the row-parallel ones: those the dataflow found, or in an
        expert (``by_position``) its last GEMM."""
        gemms = [n for n in group if n.kind in (OpKind.MATMUL, OpKind.CONV) and n.params]
        for i, node in enumerate(gemms):
            row = (i == len(gemms) - 1 and len(gemms) > 1) if by_position else node.name in rows
            for p in node.params:
                if p.shape and p.shape[0] in vocab and len(p.shape) == 2:
                    out.setdefault(p.fqn, "S(0)")
                elif len(p.shape) >= 2:
                    out.setdefault(p.fqn, "S(1)" if row else "S(0)")
                else:  # bias
                    out.setdefault(p.fqn, "R" if row else "S(0)")

    for node in graph.nodes:
        if node.kind is OpKind.EMBEDDING:
            tokens = any(src.startswith("input:") for src in node.input_sources)
            for p in node.params:
                out.setdefault(p.fqn, "S(0)" if tokens and p.shape[0] in vocab else "R")
        sublayer.append(node)
        if node.name in adds:
            close(sublayer)
            sublayer = []
    close(sublayer)
    return out


def _layer_names(graph: Graph):
    """``(node, param, [its FQN in every layer of its block])`` for every parameter use: a
    block parameter stands for the same parameter of every layer of the block."""
    block_of = {name: block for block in graph.blocks for name in block.node_names}
    for node in graph.nodes:
        block = block_of.get(node.name)
        prefix = block.representative + "." if block is not None else None
        for p in node.params:
            names = [layer + "." + p.fqn[len(prefix):] for layer in block.layer_fqns] \
                if prefix and block.layer_fqns and p.fqn.startswith(prefix) else [p.fqn]
            yield node, p, names


def fused_projections(graph: Graph) -> dict[str, int]:
    """``{param FQN: k}`` for every layer's fused projection whose output is k head-major chunks
    (``autopar.ir.residual.fused_chunks``): column parallelism splits each chunk."""
    chunks = fused_chunks(graph.nodes)
    return {name: chunks[p.fqn] for _, p, names in _layer_names(graph) if p.fqn in chunks
            for name in sorted(names)}


def param_placements(graph: Graph, cfg: ParallelConfig, tp_map: dict[str, str]
                     ) -> dict[str, dict[str, str]]:
    """{param FQN: {axis: placement}} for every parameter of the model, sorted by FQN."""
    result: dict[str, dict[str, str]] = {}
    for _, p, names in _layer_names(graph):
        expert = ".experts" in p.fqn
        axes = {"dp": "S(0)" if cfg.zero_stage == 3 else "R",
                "tp": tp_map.get(p.fqn, "R") if cfg.tp > 1 else "R"}
        if cfg.cp > 1:
            axes["cp"] = "R"
        if cfg.ep > 1:
            axes["ep"] = "S(0)" if expert else "R"
        for name in names:
            result[name] = dict(axes)
    return {name: result[name] for name in sorted(result)}
