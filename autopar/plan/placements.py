"""Per-parameter placements keyed by mesh axis, for every parameter of the model.

Tensor-parallel placements come from a map {representative param FQN: placement}, either
the intra-op ILP's solution or `megatron_tp_placements` (the layout the estimate assumes):
in each sub-layer (the nodes up to a residual add, found from the dataflow by
`autopar.ir.residual`, whatever the norms are written as) the GEMM whose output reaches the
residual add is row-parallel (weight sharded on its input features, its bias replicated), a
low-rank projection another GEMM of the sub-layer reads (`autopar.ir.residual.bottleneck_gemms`:
multi-head latent attention's down-projections) is replicated, and the other GEMMs are
column-parallel (weight and bias sharded on the output features: dim 0 of
an ``[out, in]`` weight read transposed as nn.Linear's, dim 1 of an ``[in, out]`` one read as
it is as GPT-2's Conv1D, told apart by how the GEMM reads it); embeddings and the vocabulary
head are vocab-parallel; other matmuls outside the blocks (a pooler, a transform before the
head: `autopar.ir.reductions.whole_glue_gemms`) and norms stay replicated. Where
tp does not divide an attention's key/value heads (but is a multiple of them: multi-query or
grouped-query attention with fewer kv heads than ranks), its K and V projections
(`autopar.ir.residual.kv_projections`) are replicated: each rank computes them whole and reads
the kv heads its query heads use (the gradient of what
it read is gathered or reduced at the attention's input, as `tp_collectives` charges it, so
their weight gradients are whole). So is a fused q/k/v projection tp cannot split by head (its
output cut into q, k and v of unequal widths, or its kv heads fewer than tp): each rank slices
its query heads from the whole queries. In an MoE sub-layer the router is
replicated (the GEMMs whose outputs decide the routing, `autopar.ir.residual.router_gemms`)
and each expert's GEMMs, and a shared expert's beside them, are a column→row chain (the last
GEMM, fed by another and feeding none, is row-parallel: what the estimate costs, expert
weights split over tp, one tp reduction per sub-layer); a GEMM of one output (a gate) stays
whole. Block representatives
expand to every layer of their block. The dp axis shards parameters on dim 0 under ZeRO-3 only;
expert parameters (those of the ops between an MoE dispatch and its combine) are sharded over
ep on their expert dim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from autopar.config import ParallelConfig
from autopar.errors import InvalidConfigError
from autopar.estimate.fp8 import fp8_weight
from autopar.estimate.kv import kv_whole
from autopar.estimate.units import Unit
from autopar.ir import Graph, OpKind
from autopar.ir.reductions import dense_row_gemms, summed_row_gemms, whole_glue_gemms
from autopar.ir.residual import (MIXING_KINDS, bottleneck_gemms, consumers, fused_chunks,
                                 kv_projections, moe_dispatch, output_biases, residual_structure,
                                 router_gemms, sublayers, token_lookup, vocab_sizes)

__all__ = ["fp8_weights", "fused_projections", "megatron_tp_placements", "param_placements",
           "replicated_kv", "replicated_sublayers", "summed_row_weights"]


def megatron_tp_placements(graph: Graph, tp: int = 1) -> dict[str, str]:
    vocab = vocab_sizes(graph)
    out: dict[str, str] = dict.fromkeys(replicated_kv(graph, tp), "R")
    sublayer: list = []
    block_of = {name: b.representative for b in graph.blocks for name in b.node_names}
    runs: dict[str | None, list] = {}
    for node in graph.nodes:
        runs.setdefault(block_of.get(node.name), []).append(node)
    structure = {key: residual_structure(nodes) for key, nodes in runs.items()
                 if key is not None}
    adds = {name for r in structure.values() for name in r.residual_adds}
    rows = {name for r in structure.values() for name in r.row_gemms}
    whole = {name for key, r in structure.items() for name in bottleneck_gemms(runs[key], r)}
    whole |= _whole_glue(graph, block_of, vocab)

    def close(group: list) -> None:
        """One sub-layer (the nodes up to its residual add).  An MoE sub-layer is a replicated
        router (every rank needs all expert logits to route) and a column→row chain per
        expert and per shared expert."""
        dispatch = moe_dispatch(group)
        if dispatch is None:
            close_run(group)
            return
        for p in (p for node in router_gemms(group) for p in node.params):
            out.setdefault(p.fqn, "R")
        close_run(group, experts=True)  # the experts and a shared expert beside them

    def close_run(group: list, experts: bool = False) -> None:
        """Column-parallel GEMMs and the row-parallel ones: those the dataflow found, or among
        ``experts`` each expert's last GEMM (one that another GEMM feeds and that feeds none)."""
        gemms = [n for n in group if n.kind in (OpKind.MATMUL, OpKind.CONV) and n.params]
        chained = _gemm_chains(group) if experts else {}
        biases = output_biases(group)
        for node in gemms:
            feeds, fed = chained.get(node.name, (True, False))
            row = (fed and not feeds) if experts else node.name in rows
            for p in (*node.params, *biases.get(node.name, ())):
                features, inputs = _feature_dims(node, p)
                if node.name in whole or _grouped(node):
                    # a low-rank projection, a GEMM of the glue, a grouped convolution (each
                    # group reads its own input channels: tp splits none, `sharding.rules`)
                    out.setdefault(p.fqn, "R")
                elif p.shape and p.shape[features] in vocab and len(p.shape) == 2:
                    out.setdefault(p.fqn, f"S({features})")
                elif not row and p.shape and p.shape[features] == 1:
                    out.setdefault(p.fqn, "R")  # one output: a gate tp cannot split
                elif len(p.shape) >= 2:
                    out.setdefault(p.fqn, f"S({inputs})" if row else f"S({features})")
                else:  # bias
                    out.setdefault(p.fqn, "R" if row else "S(0)")

    for node in graph.nodes:
        if node.kind is OpKind.EMBEDDING:
            tokens = token_lookup(graph, node)
            for p in node.params:
                out.setdefault(p.fqn, "S(0)" if tokens and p.shape[0] in vocab else "R")
        sublayer.append(node)
        if node.name in adds:
            close(sublayer)
            sublayer = []
    close(sublayer)
    return out


def _grouped(node) -> bool:
    """A convolution whose weight reads fewer input channels than its input has (grouped or
    depthwise, as a Mamba mixer's)."""
    return node.kind is OpKind.CONV and node.inputs[1].shape[1] != node.inputs[0].shape[1]


def _whole_glue(graph: Graph, block_of: Mapping[str, str], vocab: set[int]) -> set[str]:
    """`whole_glue_gemms` of each run of nodes outside the blocks with no residual add (the
    glue the estimate costs so, `autopar.estimate.units`); none in a graph without blocks."""
    if not graph.blocks:
        return set()
    runs: list[list] = [[]]
    for node in graph.nodes:
        if node.name in block_of:
            runs.append([])
        else:
            runs[-1].append(node)
    return {name for run in runs if run and not residual_structure(run).residual_adds
            for name in whole_glue_gemms(run, vocab)}


def replicated_kv(graph: Graph, tp: int) -> dict[str, int]:
    """``{param FQN: kv heads}`` of the K/V projections the layout replicates at ``tp``
    (`autopar.estimate.kv.kv_whole`: tp does not divide their kv heads, or they are fused
    q/k/v projections tp cannot split by head)."""
    return {p.fqn: kv.heads for name, kv in kv_projections(graph.nodes).items()
            if kv_whole(kv.heads, tp, kv.cut) for p in graph.node(name).params}


def replicated_sublayers(graph: Graph, units: Sequence[Unit], tp_placements: Mapping[str, str],
                         *, sequence_parallel: bool, tp: int = 1
                         ) -> dict[str, frozenset[int]]:
    """``{block representative: indices of its sub-layers}`` (``units``: the graph's,
    `units_from_graph`) that ``tp_placements`` ({param
    FQN: placement on tp}, a block's layers read at its representative) runs replicated where
    Megatron-LM's layout splits them: every parameter of the sub-layer "R", under sequence
    parallel, in a sub-layer a runtime can run so on the sequence shard
    (`autopar.estimate.sublayer.SubLayer.replicable`). Every other parameter must be placed as
    `megatron_tp_placements` does at ``tp``: InvalidConfigError otherwise, naming the first
    that is not."""
    megatron = megatron_tp_placements(graph, tp)
    placed = lambda fqn: tp_placements.get(fqn, "R")  # noqa: E731
    owner = {name: b for b in graph.blocks for name in b.node_names}
    by_name = {u.name: u for u in units if u.sublayers}
    out: dict[str, frozenset[int]] = {}
    for block in graph.blocks:
        names = set(block.node_names)
        nodes = [n for n in graph.nodes if n.name in names]
        unit = by_name.get(block.representative)
        runs = sublayers(nodes, residual_structure(nodes)) if unit is not None else [nodes]
        chosen = set()
        for i, run in enumerate(runs):
            params = [p.fqn for n in run for p in n.params]
            if all(placed(f) == megatron.get(f, "R") for f in params):
                continue
            if unit is not None and sequence_parallel and unit.sublayers[i].replicable \
                    and all(placed(f) == "R" for f in params):
                chosen.add(i)
                continue
            _refuse(next(f for f in params if placed(f) != megatron.get(f, "R")),
                    placed, megatron, sequence_parallel)
        if chosen:
            out[block.representative] = frozenset(chosen)
    for node in graph.nodes:
        if node.name not in owner:
            for p in node.params:
                if placed(p.fqn) != megatron.get(p.fqn, "R"):
                    _refuse(p.fqn, placed, megatron, sequence_parallel)
    return out


def _refuse(fqn: str, placed, megatron: dict[str, str], sequence_parallel: bool) -> None:
    raise InvalidConfigError(
        f"{fqn} is placed {placed(fqn)} on tp where Megatron-LM's layout places it "
        f"{megatron.get(fqn, 'R')}; the estimate and the runtime take Megatron-LM's layout, "
        f"or whole sub-layers without attention or routing replicated (every parameter 'R') "
        f"under sequence parallel{'' if sequence_parallel else ' (this config has none)'}: "
        f"use a plan's placements (Plan.tp_placements) or leave tp_placements out")


def _gemm_chains(nodes: list) -> dict[str, tuple[bool, bool]]:
    """Per GEMM of ``nodes`` (with parameters): whether its output reaches another such GEMM
    through ops that mix no features, and whether one reaches it."""
    gemm = {n.name for n in nodes if n.kind in (OpKind.MATMUL, OpKind.CONV) and n.params}
    readers = consumers(nodes)
    feeds, fed = set(), set()
    for start in gemm:
        frontier, seen = [start], {start}
        while frontier:
            for nxt in readers.get(frontier.pop(), ()):
                if nxt.name in gemm:
                    feeds.add(start)
                    fed.add(nxt.name)
                elif nxt.name not in seen and nxt.kind not in MIXING_KINDS:
                    seen.add(nxt.name)
                    frontier.append(nxt.name)
    return {name: (name in feeds, name in fed) for name in gemm}


def _feature_dims(node, param) -> tuple[int, int]:
    """The dims of a GEMM's weight that hold its output and its input features: (0, 1) for a
    2-D weight laid out ``[out, in]`` and read transposed (``x @ W.T``: nn.Linear), (1, 0)
    for one read as it is (``x @ W``: GPT-2's Conv1D), (1, 2) for grouped expert weights
    ``[E, out, in]`` (as the trace's MoE leaf reads them), (0, 1) for a convolution's
    ``[out, in, ...]``."""
    if node.kind is OpKind.MATMUL and len(param.shape) == 3:
        return 1, 2
    if node.kind is not OpKind.MATMUL or len(param.shape) != 2:
        return 0, 1
    uses = [i for i, src in enumerate(node.input_sources) if src == f"param:{param.fqn}"]
    return (0, 1) if not uses or any(node.reads_transposed(i) for i in uses) else (1, 0)


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


def summed_row_weights(graph: Graph, sequence_parallel: bool) -> list[str]:
    """The FQNs, in every layer, of the parameters of row-parallel GEMMs whose partial
    outputs are summed before one reduction (`autopar.ir.reductions.summed_row_gemms`: a
    parallel attention and MLP), as the estimate costs them: the runtime leaves their
    outputs partial, for DTensor to reduce where the sum is read."""
    rows: set[str] = set()
    for block in graph.blocks:
        nodes = [graph.node(name) for name in block.node_names]
        residual = residual_structure(nodes)
        for group in summed_row_gemms(nodes, residual, dense_row_gemms(nodes, residual),
                                      sequence_parallel=sequence_parallel):
            rows |= group if len(group) > 1 else set()
    return sorted({name for node, _, names in _layer_names(graph) if node.name in rows
                   for name in names})


def fp8_weights(graph: Graph) -> list[str]:
    """The FQNs of the weights, in every layer, whose GEMMs fp8 training runs in fp8
    (`autopar.estimate.fp8`): what an fp8 plan's runtime converts, and its estimate costs."""
    vocab, names = vocab_sizes(graph), {}
    for node, p, layer_names in _layer_names(graph):
        weight = fp8_weight(node, vocab)
        if weight is not None and weight.fqn == p.fqn:
            names.update(dict.fromkeys(layer_names))
    return list(names)


def _expert_params(graph: Graph) -> set[str]:
    """The parameters of the ops between an MoE dispatch and its combine (the experts; the
    router before the dispatch and a shared expert beside it are not)."""
    inside, out = False, set()
    for node in graph.nodes:
        if node.kind is OpKind.MOE_DISPATCH:
            inside = True
        elif node.kind is OpKind.MOE_COMBINE:
            inside = False
        elif inside:
            out.update(p.fqn for p in node.params)
    return out


def param_placements(graph: Graph, cfg: ParallelConfig, tp_map: dict[str, str]
                     ) -> dict[str, dict[str, str]]:
    """{param FQN: {axis: placement}} for every parameter of the model, sorted by FQN. With
    expert parallel folded over tp (`ParallelConfig.folded`) experts are whole on their
    ranks: "R" on tp, "S(0)" on an ep group that spans tp (``Plan.mesh.ep_within``)."""
    result: dict[str, dict[str, str]] = {}
    experts = _expert_params(graph)
    for _, p, names in _layer_names(graph):
        expert = p.fqn in experts
        split = cfg.tp > 1 and not (expert and cfg.folded)
        axes = {"dp": "S(0)" if cfg.zero_stage == 3 else "R",
                "tp": tp_map.get(p.fqn, "R") if split else "R"}
        if cfg.cp > 1:
            axes["cp"] = "R"
        if cfg.ep > 1:
            axes["ep"] = "S(0)" if expert else "R"
        for name in names:
            result[name] = dict(axes)
    return {name: result[name] for name in sorted(result)}
