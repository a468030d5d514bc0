"""Residual streams and sub-layers of a run of IR nodes (a block), from dataflow alone.

A transformer block carries a hidden state along a residual stream and adds to it the output of
each sub-layer (attention, MLP, MoE).  Nothing here reads op names of norms or modules: a norm
written by hand (``x * rsqrt(mean(x²) + eps) * w``) and ``nn.RMSNorm`` give the same answer.

* **stream**: the run's hidden-state inputs (activations from outside the run with the shape
  of the run's output) and every node that computes from the stream alone, without mixing
  features (no GEMM, convolution, attention or embedding): norms, scales, views;
* **residual add**: an ``add`` of a stream value and a value of the same shape that went
  through a mixing op in the run; its output is the stream again;
* **row GEMM**: a weight GEMM whose output reaches a residual add through element-wise and
  view ops only, and whose input is not the stream itself: the last GEMM of a sub-layer, which
  Megatron-LM splits on its input features (row-parallel) so that one reduction per sub-layer
  completes it.  Parallel residuals (``x + attn(n1(x)) + mlp(n2(x))``) have two.

Other structure read from the dataflow alike: fused projections and their chunks, the K and V
projections of attention (`kv_projections`), the vocabulary tables (`vocab_sizes`), and nodes
made of parameters alone (`made_of_params`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import NamedTuple

from autopar.ir.graph import Graph, Node, OpKind

__all__ = ["KvProjection", "MIXING_KINDS", "Residual", "after_row_ops", "bottleneck_gemms",
           "consumers", "fused_chunks", "fused_splits", "kv_projections", "made_of_params",
           "moe_dispatch", "output_biases", "parameter_values", "residual_structure",
           "router_gemms", "routing_nodes", "split_statistics", "sublayers", "token_lookup",
           "tp_split_ops", "vocab_sizes"]

MIXING_KINDS = frozenset({OpKind.MATMUL, OpKind.CONV, OpKind.ATTENTION, OpKind.EMBEDDING,
                     OpKind.MOE_DISPATCH, OpKind.MOE_COMBINE})
_NOT_ACTIVATION = ("param:", "buffer:", "const")


@dataclass(frozen=True)
class Residual:
    """The residual structure of a run of nodes (see the module docstring)."""

    stream: frozenset[str]
    residual_adds: tuple[str, ...]  # in node order
    row_gemms: frozenset[str]


def consumers(nodes: Sequence[Node]) -> dict[str, list[Node]]:
    """``{value name: the nodes of ``nodes`` that read it}``, in node order."""
    out: dict[str, list[Node]] = {}
    for node in nodes:
        for src in node.input_sources:
            out.setdefault(src, []).append(node)
    return out


def _is_add(node: Node) -> bool:
    return node.kind is OpKind.ELEMENTWISE and node.target.split(".")[:2] == ["aten", "add"]


def _activations(node: Node) -> list[tuple[str, tuple[int, ...]]]:
    return [(src, spec.shape) for src, spec in zip(node.input_sources, node.inputs)
            if not src.startswith(_NOT_ACTIVATION)]


def parameter_values(nodes: Sequence[Node]) -> set[str]:
    """The nodes of ``nodes`` computed from parameters, buffers and constants alone."""
    made: set[str] = set()
    for node in nodes:
        if all(src.startswith(_NOT_ACTIVATION) or src in made for src in node.input_sources):
            made.add(node.name)
    return made


def residual_structure(nodes: Sequence[Node]) -> Residual:
    """The stream, residual adds and row GEMMs of ``nodes`` (one block, in execution order)."""
    if not nodes:
        return Residual(stream=frozenset(), residual_adds=(), row_gemms=frozenset())
    names = {n.name for n in nodes}
    hidden = nodes[-1].outputs[0].shape if nodes[-1].outputs else ()
    stream: set[str] = set()
    mixed: set[str] = set()  # values computed through a mixing op of the run
    adds: list[str] = []
    weights = parameter_values(nodes)  # a norm's ``1 + w`` is no activation
    for node in nodes:
        acts = [(src, shape) for src, shape in _activations(node) if src not in weights]
        on_stream = [src in stream or (src not in names and shape == hidden)
                     for src, shape in acts]
        through_mixing = [src in mixed for src, _ in acts]
        if node.kind in MIXING_KINDS:
            mixed.add(node.name)
        elif acts and all(on_stream):
            stream.add(node.name)
        elif _is_add(node) and any(on_stream) and any(through_mixing) and node.outputs and \
                all(shape == node.outputs[0].shape for _, shape in acts):
            stream.add(node.name)
            adds.append(node.name)
        elif any(through_mixing):
            mixed.add(node.name)
    readers = consumers(nodes)
    residual = set(adds)
    rows = set()
    for node in nodes:
        if node.kind is not OpKind.MATMUL or not node.params:
            continue
        if any(src in stream for src, _ in _activations(node)):
            continue  # read straight off the stream: a sub-layer of one GEMM stays column-wise
        frontier, seen = [node.name], set()
        while frontier:
            for nxt in readers.get(frontier.pop(), ()):
                if nxt.name in residual:
                    rows.add(node.name)
                elif nxt.kind not in MIXING_KINDS and nxt.name not in seen \
                        and nxt.name not in stream:
                    seen.add(nxt.name)
                    frontier.append(nxt.name)
    return Residual(stream=frozenset(stream), residual_adds=tuple(adds),
                    row_gemms=frozenset(rows))


def sublayers(nodes: Sequence[Node], residual: Residual) -> list[list[Node]]:
    """``nodes`` cut after each residual add of ``residual`` (their structure): the nodes of
    each sub-layer from the one after the previous add through its own add (a sub-layer's
    norm, GEMMs and add), in order, and the nodes after the last add, if any, as one more."""
    adds = set(residual.residual_adds)
    out: list[list[Node]] = [[]]
    for node in nodes:
        out[-1].append(node)
        if node.name in adds:
            out.append([])
    return [run for run in out if run]


def moe_dispatch(run: Sequence[Node]) -> int | None:
    """The index of the MoE dispatch in ``run`` (a sub-layer), or None."""
    return next((i for i, n in enumerate(run) if n.kind is OpKind.MOE_DISPATCH), None)


def _routing(run: Sequence[Node]) -> list[Node]:
    """The nodes of a sub-layer (``run``) before its MoE dispatch whose outputs decide the
    routing: those the dispatch reads besides the tokens it routes (a router's logits) or the
    combine reads besides the experts' outputs (routing weights), and what they are made
    from. A shared expert run on the same tokens before the dispatch is not among them."""
    dispatch = moe_dispatch(run)
    if dispatch is None:
        return []
    before = {n.name: n for n in run[:dispatch]}
    combine = next((n for n in run[dispatch:] if n.kind is OpKind.MOE_COMBINE), None)
    todo = list(run[dispatch].input_sources[1:]) + (
        [s for s in combine.input_sources if s in before] if combine is not None else [])
    seen: set[str] = set()
    while todo:
        src = todo.pop()
        if src in before and src not in seen:
            seen.add(src)
            todo += before[src].input_sources
    return [n for n in run[:dispatch] if n.name in seen]


def router_gemms(run: Sequence[Node]) -> list[Node]:
    """The GEMMs that route a sub-layer's (``run``, one of `sublayers`) tokens to its experts
    (`_routing`): its router, which every rank runs whole (routing needs all the experts'
    logits); none in a sub-layer without a dispatch."""
    return [n for n in _routing(run) if n.kind in (OpKind.MATMUL, OpKind.CONV)]


def routing_nodes(nodes: Sequence[Node], residual: Residual) -> set[str]:
    """The nodes of the MoE sub-layers of ``nodes`` (their structure ``residual``) that route
    their tokens, off the residual stream: the router (`router_gemms`) and what turns its
    logits into routing weights (`_routing`)."""
    return {n.name for run in sublayers(nodes, residual) if router_gemms(run)
            for n in _routing(run) if n.name not in residual.stream}


_RESHAPES = ("aten.view", "aten.reshape", "aten._unsafe_view")
_SPLITS = ("aten.split", "aten.split_with_sizes", "aten.chunk", "aten.unbind", "aten.tensor_split")


def fused_chunks(nodes: Sequence[Node]) -> dict[str, int]:
    """``{parameter FQN: k}`` for the weight (and bias) of each GEMM whose output
    features are k equal chunks of head-major features (a fused q/k/v projection): its output
    is split into k equal parts on the last dim (``qkv.split(h, -1)``), or viewed as
    ``(k, heads, head_dim)`` with as many heads as an attention of ``nodes`` has.  Column
    parallelism must then split each chunk, not the whole output, for every rank to hold
    whole heads of q, k and v. Likewise the ``[E, out, in]`` weight of grouped expert GEMMs
    whose output a gated activation halves (an expert's fused gate and up projections): its
    two chunks."""
    gated = {p.fqn: 2 for p in _gated_expert_weights(nodes)}
    return gated | {fqn: k for fqn, (k, _) in _fused(nodes).items()}


def _gated_expert_weights(nodes: Sequence[Node]) -> list:
    """The 3-D weights of GEMMs whose output of width ``2f`` an elementwise op reads into
    ``f`` features (the gated activation of fused ``[E, 2f, h]`` gate/up expert weights)."""
    readers = consumers(nodes)
    out = []
    for node in nodes:
        if node.kind is not OpKind.MATMUL or not node.outputs:
            continue
        width = node.outputs[0].shape[-1]
        if any(r.kind is OpKind.ELEMENTWISE and r.outputs and 2 * r.outputs[0].shape[-1] == width
               for r in readers.get(node.name, ())):
            out += [p for p in node.params if len(p.shape) == 3 and p.shape[1] == width]
    return out


def fused_splits(nodes: Sequence[Node]) -> dict[str, int]:
    """``{node name: k}``: the op that cuts a fused projection's output (see ``fused_chunks``)
    into its k chunks: a split on the last dim, or a view as ``(k, heads, head_dim)``.  A
    column-parallel split of the projection by chunk hands that op every chunk sharded alike
    (on the features, or on the heads)."""
    return {cut: k for k, cut in _fused(nodes).values()}


def _fused(nodes: Sequence[Node]) -> dict[str, tuple[int, str]]:
    """``{parameter FQN: (k, the node that cuts the projection's output into k chunks)}``."""
    heads = {(n.attention.num_heads, n.attention.head_dim) for n in nodes
             if n.attention is not None}
    readers = consumers(nodes)
    biases = output_biases(nodes)
    out = {}
    for node in nodes:
        if node.kind is not OpKind.MATMUL or not node.params or not node.outputs:
            continue
        width = node.outputs[0].shape[-1]
        k, cut = _chunks(node.name, width, readers, heads)
        # a weight laid out [out_features, in_features] (nn.Linear) or [in, out] (GPT-2's
        # Conv1D), and its bias
        if k > 1 and any(len(p.shape) == 2 and width in p.shape for p in node.params):
            out.update({p.fqn: (k, cut) for p in (*node.params, *biases.get(node.name, ()))
                        if width in p.shape[:2]})
    return out


def output_biases(nodes: Sequence[Node]) -> dict[str, list]:
    """``{GEMM node name: [parameter]}``: the 1-D parameters added to a weight GEMM's output by
    an op of their own (``linear(x, W) + b`` written apart, as ``nn.MultiheadAttention``'s
    packed projection runs on 3-D inputs), after views that keep its features whole. They are
    the GEMM's bias: tensor parallelism splits them as it splits the output features."""
    readers = consumers(nodes)
    found: dict[str, list] = {}
    for node in nodes:
        if node.kind is not OpKind.MATMUL or not node.params or not node.outputs:
            continue
        width, frontier = node.outputs[0].shape[-1], [node.name]
        while frontier:
            for nxt in readers.get(frontier.pop(), ()):
                if nxt.target.startswith(_RESHAPES) and nxt.outputs and \
                        nxt.outputs[0].shape[-1] == width:
                    frontier.append(nxt.name)
                elif _is_add(nxt):
                    found.setdefault(node.name, []).extend(
                        p for p in nxt.params if tuple(p.shape) == (width,))
    return found


def _chunks(name: str, width: int, readers: dict[str, list[Node]],
            heads: set[tuple[int, int]]) -> tuple[int, str | None]:
    """The chunk count of ``width`` features seen by the first op after ``name`` that splits
    them (views that keep the features whole and elementwise ops on them, a bias add, are
    followed) and that op, or ``(1, None)``. A view cuts them into k chunks as ``(k, heads,
    head_dim)`` with an attention's heads (not cut along the heads: then the k are groups, as
    Falcon's kv groups), or as ``(k, heads · head_dim)`` (``nn.MultiheadAttention``'s packed
    projection), each chunk an attention's heads."""
    counts, widths = {h for h, _ in heads}, {h * d for h, d in heads}
    for nxt in readers.get(name, ()):
        out = nxt.outputs[0].shape if nxt.outputs else ()
        if nxt.target.startswith(_SPLITS) and len(nxt.outputs) > 1:
            sizes = {o.shape[-1] for o in nxt.outputs}
            if len(sizes) == 1 and sizes.pop() * len(nxt.outputs) == width:
                return len(nxt.outputs), nxt.name
            return 1, None
        if nxt.kind is OpKind.ELEMENTWISE and len(nxt.outputs) == 1 and out and \
                out[-1] == width:
            return _chunks(nxt.name, width, readers, heads)
        if nxt.target.startswith(_RESHAPES) and out:
            if out[-1] == width:
                return _chunks(nxt.name, width, readers, heads)
            if len(out) >= 3 and out[-3] * out[-2] * out[-1] == width and out[-2] in counts \
                    and out[-3] > 1 and not _feature_axis(nxt.name, tuple(out), len(out) - 2,
                                                          readers)[0]:
                return out[-3], nxt.name
            if len(out) >= 2 and out[-2] * out[-1] == width and out[-2] > 1 and \
                    out[-1] in widths:
                return out[-2], nxt.name
    return 1, None


class KvProjection(NamedTuple):
    """A GEMM that makes the keys or values of attention (`kv_projections`)."""

    heads: int  # the kv heads it makes
    fused: bool  # it makes queries too (a fused q/k/v projection)
    reads: tuple[int, ...]  # bytes of each attention input (K, V) it reaches
    read_heads: int  # their heads: its own, or as many as the queries' where it is repeated
    # a fused projection whose output is cut into q, k and v along the features a
    # column-parallel split would shard (Phi-3's slices of unequal width, StarCoder's split
    # of q from one k/v head): tp cannot split it by head
    cut: bool = False
    query_bytes: int = 0  # a fused projection's: bytes of the attention's queries it makes


def kv_projections(nodes: Sequence[Node]) -> dict[str, KvProjection]:
    """``{GEMM node name: KvProjection}`` for each weight GEMM of ``nodes`` that makes the
    keys or values of an attention: its output reaches the attention's K or V input through
    ops that mix no features (views, a norm, RoPE, a head repeat). Its kv heads are the heads
    it makes (its output features over the attention's head dim: K and V repeated to the
    query heads before the attention, as grouped-query attention is often written, still come
    from fewer), at most the attention's kv heads; a fused projection's are the attention's,
    or fewer where a view lays its features out in fewer groups (Falcon's ``(kv heads, q per
    kv + 2, head_dim)``: what a column-parallel split of it shards).
    A tensor-parallel layout may replicate a K/V projection where tp does not divide its
    heads, or a fused one that tp cannot split by head (``cut``); each rank then reads the kv
    heads of its query heads from the attention input they reach: its gradient is
    all-gathered from the ranks' heads where tp divides that input's heads (K and V repeated
    to the query heads), else all-reduced (and a fused projection's queries, which each rank
    slices to its heads, have their gradient all-gathered)."""
    by_name = {n.name: n for n in nodes}
    readers = consumers(nodes)
    fused_params = _fused(nodes)  # equal chunks: split by head within each (`fused_chunks`)
    chunked = {n.name for n in nodes if any(p.fqn in fused_params for p in n.params)}
    out: dict[str, KvProjection] = {}
    for node in nodes:
        if node.kind is not OpKind.ATTENTION or node.attention is None or \
                len(node.input_sources) < 3:
            continue
        q, *kv = (_projections(src, by_name) for src in node.input_sources[:3])
        head_dim = node.inputs[1].shape[-1]
        for i, made in enumerate(kv, start=1):
            for name in made:
                seen = out.get(name, KvProjection(1 << 30, False, (), 1 << 30))
                fused = name in q or seen.fused
                heads = node.attention.num_kv_heads
                gemm_out = tuple(by_name[name].outputs[0].shape)
                cut = False
                if not fused and head_dim and gemm_out[-1] % head_dim == 0:
                    heads = min(heads, gemm_out[-1] // head_dim)
                elif fused and name not in chunked:  # split as laid out: by its groups
                    cut, groups = _feature_axis(name, gemm_out, len(gemm_out) - 1, readers)
                    heads = min(heads, groups)
                query = node.inputs[0].num_bytes if name in q and i == 1 else 0
                out[name] = KvProjection(min(heads, seen.heads), fused,
                                         seen.reads + (node.inputs[i].num_bytes,),
                                         min(node.attention.num_kv_heads, seen.read_heads),
                                         cut, seen.query_bytes + query)
    return out


def _feature_axis(name: str, shape: tuple, axis: int, readers: dict[str, list[Node]]
                  ) -> tuple[bool, int]:
    """``(cut, groups)`` of value ``name`` (of ``shape``, its features from dim ``axis`` on:
    the outermost is what a column-parallel split shards): whether a reader takes a piece of
    the features along ``axis`` (a slice, a split, an index), directly or after views that
    keep the features together (a view into ``(groups, ..., head_dim)`` moves ``axis`` to the
    groups), and the fewest groups such a view makes (``shape[axis]`` without one)."""
    features, groups = prod(shape[axis:]), shape[axis]
    for nxt in readers.get(name, ()):
        for piece in (tuple(o.shape) for o in nxt.outputs):
            if len(piece) == len(shape) and piece[axis] < shape[axis] and \
                    all(a == b for d, (a, b) in enumerate(zip(piece, shape)) if d != axis):
                return True, groups
        if nxt.kind is OpKind.VIEW and len(nxt.outputs) == 1:
            view = tuple(nxt.outputs[0].shape)
            k = next((k for k in range(1, len(view) + 1) if prod(view[-k:]) == features), 0)
            if k and prod(view[:-k]) == prod(shape[:axis]):
                cut, inner = _feature_axis(nxt.name, view, len(view) - k, readers)
                if cut:
                    return True, inner
                groups = min(groups, inner)
    return False, groups


def _projections(src: str, by_name: dict[str, Node]) -> set[str]:
    """The weight GEMMs whose outputs reach the value ``src`` through ops mixing no
    features."""
    found: set[str] = set()
    stack, seen = [src], set()
    while stack:
        node = by_name.get(stack.pop())
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if node.kind is OpKind.MATMUL and node.params:
            found.add(node.name)
        elif node.kind not in MIXING_KINDS:
            stack += [s for s in node.input_sources if not s.startswith(_NOT_ACTIVATION)]
    return found


def made_of_params(nodes: list[Node], readers_in: set[str]) -> set[str]:
    """The nodes computed from parameters, buffers and constants alone (Gemma's norm scale
    ``1 + w``, a weight's cast) whose outputs only nodes of ``readers_in`` read, directly or
    through other such nodes: their parameters' gradients are those of the ops reading them."""
    made = parameter_values(nodes)
    readers = consumers(nodes)
    out: set[str] = set()
    for node in reversed(nodes):
        reads = readers.get(node.name, ())
        if node.name in made and reads and all(r.name in readers_in or r.name in out
                                               for r in reads):
            out.add(node.name)
    return out


def vocab_sizes(graph: Graph) -> set[int]:
    """Rows of the embedding tables indexed by the model's token input (not positions)."""
    return {p.shape[0] for n in graph.nodes if token_lookup(graph, n) for p in n.params
            if p.shape}


def token_lookup(graph: Graph, node: Node) -> bool:
    """Whether ``node`` is an embedding lookup of the model's token ids: its indices are a
    model input, or views of one (``input_ids.view(-1, s)``), not positions made inside."""
    if node.kind is not OpKind.EMBEDDING:
        return False
    by_name = {n.name: n for n in graph.nodes}
    for src in node.input_sources:
        while src in by_name and by_name[src].kind is OpKind.VIEW:
            src = by_name[src].input_sources[0]
        if src.startswith("input:"):
            return True
    return False


def after_row_ops(nodes: Sequence[Node], residual: Residual) -> set[str]:
    """The ops of a block after a row GEMM or an MoE combine and before its residual add (a
    post-norm): they mix no features and are off the stream; under sequence parallel they
    run on the sequence shard the sub-layer's output is reduce-scattered to."""
    readers = consumers(nodes)
    after: set[str] = set()
    frontier = list(residual.row_gemms) + [n.name for n in nodes
                                           if n.kind is OpKind.MOE_COMBINE]
    while frontier:
        for nxt in readers.get(frontier.pop(), ()):
            if nxt.name not in after and nxt.kind not in MIXING_KINDS \
                    and nxt.name not in residual.stream:
                after.add(nxt.name)
                frontier.append(nxt.name)
    return after


def split_statistics(nodes: Sequence[Node], residual: Residual,
                     whole: Mapping[str, set[str]] | None = None) -> list[tuple[Node, list]]:
    """The reductions over the features a column-parallel GEMM of a block splits over tp,
    each with the parameters that scale those features: a norm over a whole projection
    (OLMo 2's q and k norms), whose per-row statistic each rank sums over its share of the
    features and all-reduces (and its gradient backward), and whose weight's gradient each
    rank holds for its share. Found from the dataflow: from a weight GEMM that is not a row
    GEMM nor a router, through element-wise ops and views that keep its output features as
    the last dim, a reduction of that dim to one. ``whole``: the block's `bottleneck_gemms`,
    if already found."""
    if not residual.residual_adds:
        return []
    readers = consumers(nodes)
    # a router and a low-rank projection every rank runs whole
    whole = routing_nodes(nodes, residual) | set(
        bottleneck_gemms(nodes, residual) if whole is None else whole)
    found: list[tuple[Node, list]] = []
    for gemm in nodes:
        if gemm.kind is not OpKind.MATMUL or not gemm.params or not gemm.outputs or \
                gemm.name in residual.row_gemms or gemm.name in whole:
            continue
        width, stack, seen = gemm.outputs[0].shape[-1], [gemm.name], {gemm.name}
        scales: list = []
        stats: list[Node] = []
        while stack:
            for nxt in readers.get(stack.pop(), ()):
                if nxt.name in seen or not nxt.outputs or nxt.name in residual.stream:
                    continue
                seen.add(nxt.name)
                last = nxt.outputs[0].shape[-1]
                if nxt.kind is OpKind.REDUCE and last == 1 and \
                        nxt.inputs[0].shape[-1] == width:
                    stats.append(nxt)
                    stack.append(nxt.name)
                elif nxt.kind in (OpKind.ELEMENTWISE, OpKind.VIEW) and last in (1, width):
                    scales += [p for p in nxt.params if p.shape == (width,)]
                    stack.append(nxt.name)
        found += [(stat, scales) for stat in stats[:1]] + [(stat, []) for stat in stats[1:]]
    return found


def bottleneck_gemms(nodes: Sequence[Node], residual: Residual) -> dict[str, set[str]]:
    """The weight GEMMs (of ``[out, in]`` weights) of a block's dense sub-layers whose output
    another column-parallel GEMM reads, through ops that mix no features: a low-rank
    projection before the heads' (multi-head latent attention's q and kv down-projections,
    each followed by a norm).
    Megatron's layout runs them whole on every tp rank (Megatron-Core's MLA duplicates them),
    so that the GEMM after them reads a whole input. ``{GEMM: the ops between it and the
    GEMMs it feeds}``."""
    if not residual.residual_adds:
        return {}
    readers, kind = consumers(nodes), {n.name: n.kind for n in nodes}
    moe = {n.name for run in sublayers(nodes, residual) if moe_dispatch(run) is not None
           for n in run}
    found: dict[str, set[str]] = {}
    for gemm in nodes:
        if gemm.kind is not OpKind.MATMUL or not gemm.params or gemm.name in moe \
                or gemm.name in residual.row_gemms or any(len(p.shape) > 2 for p in gemm.params):
            continue
        stack, seen, feeds = [gemm.name], set(), False
        while stack:
            for nxt in readers.get(stack.pop(), ()):
                if nxt.name in seen or nxt.name in residual.stream:
                    continue
                seen.add(nxt.name)
                if nxt.kind is OpKind.MATMUL and nxt.params:
                    feeds |= nxt.name not in residual.row_gemms
                elif nxt.kind not in MIXING_KINDS:
                    stack.append(nxt.name)
        if feeds:
            found[gemm.name] = {n for n in seen if kind[n] not in MIXING_KINDS}
    return found


def tp_split_ops(nodes: Sequence[Node], residual: Residual,
                 whole: Mapping[str, set[str]] | None = None) -> set[str]:
    """The memory-bound ops of a block on features Megatron's layout splits over tp: those
    computed from a sub-layer's mixing ops (its column-parallel GEMMs, attention; not the
    `bottleneck_gemms` every rank runs whole) that are not on the residual stream and not
    after its row-parallel GEMM (whose reduced output, like the stream, is whole on every rank
    without sequence parallel). ``whole``: the block's `bottleneck_gemms`, if already found."""
    if not residual.residual_adds:
        return set()
    after_row = after_row_ops(nodes, residual)
    whole = bottleneck_gemms(nodes, residual) if whole is None else whole
    mixed: set[str] = set()
    for node in nodes:
        if node.kind in MIXING_KINDS and node.name not in whole:
            mixed.add(node.name)
        elif any(src in mixed for src in node.input_sources) and node.name not in \
                residual.stream and node.name not in after_row:
            mixed.add(node.name)
    return {n.name for n in nodes if n.name in mixed and n.kind not in MIXING_KINDS
            and n.kind is not OpKind.VIEW}
