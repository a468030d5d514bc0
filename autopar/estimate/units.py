"""Cost units: a traced graph cut into the pieces pipeline stages are made of.

A unit is either a repeated block (one representative standing for `count` layers, e.g.
`layers.0 … layers.79`) or a run of "glue" nodes between blocks (the embedding before the
first block, the final norm, head and loss after the last). Each unit keeps only what the
timing and memory models need, per micro-batch of the traced size, unsharded:

- its ops reduced to GEMM / attention / memory-bound work (FLOPs forward and backward, bytes);
- parameters, split into dense and expert (between an MoE dispatch and its combine);
- activation bytes saved for backward (all, under selective recompute, and the part saved by
  memory-bound ops, which tensor parallelism shards only with sequence parallelism), and the
  outputs per-op recompute keeps (`autopar.config.PER_OP_SAVED`);
- the tensor-parallel synchronisations of one layer, forward and backward (`tp_syncs`: in a
  block the hidden state's reductions `autopar.ir.reductions.reduction_points` finds from the
  dataflow; in the glue what each op moves, as `_tp_syncs` says), the size of the hidden
  state, the parameters whose gradients sequence parallelism leaves partial, MoE
  dispatch bytes and the K/V bytes ring attention passes around.

Pure functions of the IR; no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from autopar.estimate.fp8 import fp8_elements
from autopar.estimate.kept import per_op_kept, recompute_tail
from autopar.estimate.kv import KvGemm, kv_whole
from autopar.estimate.sublayer import SubLayer, sublayer_of
from autopar.ir import Graph, Node, OpKind, dtype_num_bytes
from autopar.estimate.shared_params import shared_params
from autopar.ir.reductions import (broadcast_params, is_cross_entropy, loss_reader,
                                   reduction_points, whole_glue_gemms)
from autopar.ir.residual import (bottleneck_gemms, consumers, fused_chunks, kv_projections,
                                 residual_structure, split_statistics, sublayers, tp_split_ops,
                                 vocab_sizes)

FIXED_SYNCS = ("weight", "param")  # `Unit.tp_syncs` kinds whose bytes the batch does not scale
LOSS_REDUCTIONS = 3  # a vocabulary-parallel cross-entropy all-reduces max, sum and target
LOSS_REDUCTION_BYTES = 4  # fp32 per row each

__all__ = ["FIXED_SYNCS", "LOSS_REDUCTIONS", "LOSS_REDUCTION_BYTES", "OpCost", "SubLayer",
           "Unit", "units_from_graph"]

_GEMM_KINDS = (OpKind.MATMUL, OpKind.CONV)
_FREE_KINDS = (OpKind.VIEW,)


@dataclass(frozen=True, kw_only=True, slots=True)
class OpCost:
    kind: str  # "gemm", "attention" or "memory"
    flops_fwd: float
    flops_bwd: float
    bytes_fwd: float
    param_bytes: float = 0.0  # the part of bytes_fwd that reads parameters
    # the part of bytes_fwd that does not grow with the batch: parameter, buffer and constant
    # reads and tensors made from those alone (a rotary table), read or written
    fixed_bytes: float = 0.0
    batch_free: bool = False  # every input is made without the model's inputs: no FLOP scales
    expert: bool = False
    causal: bool = False
    score_bytes: float = 0.0  # attention: the b·a·s_q·s_kv score matrix in the compute dtype
    seq_kv: int = 0  # attention: key/value length
    dropout: bool = False  # attention: dropout on the probabilities
    # attention under context parallel: each rank holds zigzag chunks (an equal share of a
    # causal mask's work) rather than one contiguous chunk (the last rank's share is largest)
    cp_balanced: bool = True
    vocab: bool = False  # a GEMM or lookup over the vocabulary (sharded by vocab-parallel TP)
    aligned: bool = True  # a GEMM whose operands' rows are all 16-byte aligned
    # in the unit's tail that an early-stopping recompute does not re-run (`recompute_tail`)
    tail: bool = False
    logits: float = 0.0  # a cross-entropy: elements of its logits (timed by `loss_time_s`)
    logit_bytes: int = 0  # bytes of one logit in its traced dtype
    # a GEMM fp8 training runs in fp8 (`autopar.estimate.fp8`): elements of its activation
    # input, weight and output, whose fp8 casts it pays (costmodels.compute.fp8_cast_time_s);
    # (): a GEMM that stays in 16 bits (no weight, a convolution, the vocabulary projection)
    fp8_elements: tuple[float, float, float] = ()
    # an MoE combine: routed rows added into their tokens' rows by index (in eager software an
    # atomic scatter-add, costmodels.compute.SCATTER_ADD_TRAFFIC_FACTOR)
    scatter_add: bool = False
    # in a block under per-op recompute: its output is kept for backward and it is not re-run
    # (a fused attention kernel, every other matmul; `autopar.config.PER_OP_SAVED`)
    kept: bool = False
    # a GEMM the layout replicates over tp (`Unit.replicated`, `whole_glue_gemms`): each tp rank
    # reads (and under fp8 casts) its whole weight, on the stream's rows (a shard under SP)
    tp_replicated: bool = False
    tp_whole: bool = False  # a low-rank projection every tp rank runs whole (`bottleneck_gemms`)
    # a GEMM that makes an attention's keys or values: its kv heads, and whether tp cannot
    # split it by head (`KvGemm.cut`); if so, or tp does not divide them, it runs whole
    # on every tp rank (`kv_whole`)
    kv_heads: int = 0
    kv_cut: bool = False
    # a GEMM whose output is k > 1 chunks (a fused q/k/v projection, `fused_chunks`): elements
    # of its trainable 1-D bias, which tp splits by chunk where it splits the GEMM
    fused_bias: int = 0
    # a memory-bound op on features Megatron's layout splits over tp (after a sub-layer's
    # column-parallel GEMMs, before its row-parallel one: an MLP's activation, RoPE on the
    # heads): its work is split over tp with or without sequence parallel
    tp_sharded: bool = False

    def whole_on_tp(self, tp: int) -> bool:
        """A GEMM every rank of ``tp`` runs whole: in a replicated sub-layer, a low-rank
        projection, or a K/V projection tp does not split (`kv_whole`)."""
        return self.tp_replicated or self.tp_whole or kv_whole(self.kv_heads, tp, self.kv_cut)

    def tp_rows(self, tp: int, sequence_parallel: bool) -> int:
        """Over how many tp ranks a GEMM's rows are split: none for one run whole on all rows
        (a low-rank projection, a K/V projection tp does not split, a replicated weight on a
        stream tp does not split), else tp (split features, or a sequence shard)."""
        if self.tp_whole or kv_whole(self.kv_heads, tp, self.kv_cut) or \
                (self.tp_replicated and not sequence_parallel):
            return 1
        return tp


@dataclass(frozen=True, kw_only=True, slots=True)
class Unit:
    name: str
    layer_fqns: tuple[str, ...]  # one module path per copy
    ops: tuple[OpCost, ...]
    num_kernels: int
    num_ops: int  # its traced nodes, views included: the ops eager PyTorch dispatches for it
    dense_params: int
    expert_params: int
    saved_bytes: int
    saved_bytes_recompute: int
    saved_bytes_memory_ops: int  # saved by norms/elementwise: replicated over tp without SP
    # kept under per-op recompute besides the block's input (`OpCost.kept`): outputs split over
    # tp (column-parallel GEMMs), partial sums a row-parallel GEMM writes whole, and what fused
    # attention kernels return (split over tp; an unfused kernel's ops are all re-run)
    saved_bytes_per_op: int = 0
    saved_bytes_per_op_partial: int = 0
    saved_bytes_per_op_attention: int = 0
    # fp8 training without recompute: each fp8 GEMM keeps its own 1-byte copy of its input
    # (`autopar.runtime.fp8`) where the traced graph charges what it saves in 16 bits
    fp8_saved_bytes_delta: int = 0
    act_bytes: int  # the hidden state entering the unit
    # tensor-parallel synchronisations per layer under Megatron's layout: (direction
    # "forward"/"backward", kind, nbytes at the traced batch); kind "reduce" (a partial sum:
    # an all-reduce, or with sequence parallel a reduce-scatter and an all-gather the other
    # way; "reduce_sp" one under sequence parallel only), "gather" (a split output gathered),
    # "loss" (a parallel cross-entropy's per-row all-reduce), "stat" (a norm's per-row
    # statistic over split features, all-reduced), "weight" (a replicated weight's gradient
    # over split features, all-gathered from the ranks' shares) or "param" (a value made of
    # parameters alone read broadcast over split features: its partial gradient all-reduced,
    # `broadcast_params`); the last two of bytes fixed by the batch (`FIXED_SYNCS`)
    tp_syncs: tuple[tuple[str, str, float], ...]
    moe_dispatch_bytes: int  # tokens x top-k x hidden, per MoE layer of the unit
    # of `tp_syncs`' reductions per direction, those of its MoE sub-layers (one per dispatch:
    # the experts' partial sums over tp); none when expert parallel is folded over tp
    moe_reductions: int = 0
    attention_kv_bytes: int  # K and V of all attention ops (what a CP ring passes on)
    attention_score_bytes: int  # what an unfused kernel would keep of the score matrices
    param_bytes: int  # parameters of one copy of the unit, in their traced dtype
    loss_logits: int = 0  # elements of its cross-entropy losses' inputs (the logits)
    loss_logit_bytes: int = 0  # the same in their traced dtype
    tail_kernels: int = 0  # kernels of the ops an early-stopping recompute skips (OpCost.tail)
    # what per-op recompute keeps depends on the routing (`per_op_kept`): not costed
    per_op_routed: bool = False
    # elements of each tp-replicated parameter of ops on the hidden stream (norms between the
    # sub-layers, a position table, the final norm): under sequence parallel they see a
    # sequence shard and their gradients are partial sums over tp, reduced once a step
    stream_params: tuple[int, ...] = ()
    # elements of each parameter every tp rank holds whole before split features: an MoE
    # sub-layer's routing GEMMs, a low-rank projection and the ops after it (`bottleneck_gemms`):
    # gradients partial sums, reduced once a step with the stream's, with or without SP
    router_params: tuple[int, ...] = ()
    # elements of each replicated parameter of ops on the heads tp splits (a per-head q/k
    # norm and its scale): its gradient a partial sum over the heads, as `router_params`
    head_params: tuple[int, ...] = ()
    # how expert parallel moves tokens: "all_to_all" (dispatch and combine of the routed rows) or
    # "all_gather" (every ep rank's tokens gathered, outputs reduce-scattered)
    ep_dispatch: str = "all_to_all"
    sublayers: tuple[SubLayer, ...] = ()  # a block's, in order
    # elements of `dense_params` whole on every tp rank in the sub-layers it replicates
    tp_replicated_params: int = 0
    # elements of the trainable parameters tp never splits in any layout: `stream_params`,
    # `router_params`, `head_params` as traced and the row-parallel GEMMs' biases
    tp_shared_params: int = 0
    # each copy's place in the model's layer order (`autopar.estimate.stages.layer_sequence`):
    # copies of one block may interleave with another's (alternating attention kinds)
    positions: tuple[float, ...] = ()
    # each GEMM that makes keys or values only (`OpCost.kv_heads`): whole on every tp rank
    # where tp does not divide its heads (`timing.tp_collectives` says what its gradient moves)
    kv_projections: tuple[KvGemm, ...] = ()
    # (owner unit, elements, rows) of each parameter it reads that an earlier unit owns (a head
    # tied to the embedding): on two pipeline stages, their gradients are summed once a step
    tied_params: tuple[tuple[str, int, int], ...] = ()

    @property
    def count(self) -> int:
        return len(self.layer_fqns)

    @property
    def tp_reductions(self) -> tuple[int, int]:
        """Partial sums reduced per layer, forward and backward (`tp_syncs`)."""
        return (sum(d == "forward" and k == "reduce" for d, k, _ in self.tp_syncs),
                sum(d == "backward" and k == "reduce" for d, k, _ in self.tp_syncs))

    def tp_whole_params(self, tp: int) -> int:
        """Elements of `dense_params` whole on every rank at ``tp``: those tp never splits
        (`tp_shared_params`), the replicated sub-layers' and K/V projections' (`kv_whole`)."""
        return self.tp_shared_params + self.tp_replicated_params + sum(
            kv.params for kv in self.kv_projections if kv.whole(tp))

    def dense_on_tp_rank(self, tp: int) -> float:
        """Dense parameter elements one tp rank holds of one layer."""
        whole = self.tp_whole_params(tp)
        return (self.dense_params - whole) / tp + whole

    def split_fused_biases(self, tp: int) -> tuple[int, ...]:
        """Elements of each fused projection's bias (`OpCost.fused_bias`) tp splits by chunk
        at ``tp``: those of GEMMs the layout neither replicates nor runs whole (`kv_whole`)."""
        return tuple(op.fused_bias for op in self.ops
                     if op.fused_bias and not op.whole_on_tp(tp))

    def replicated(self, which: frozenset[int]) -> "Unit":
        """This unit with the sub-layers ``which`` (indices into `sublayers`) run replicated
        over tp on the sequence shard under sequence parallel, where Megatron-LM's layout
        splits their GEMMs: each such sub-layer reduces nothing over tp, its weights are
        whole on every tp rank (their gradients, partial sums over the sequence shards,
        all-reduced once a step with the stream's: `stream_params`), and its row GEMMs'
        outputs are sequence shards rather than partial sums."""
        if not which:
            return self
        subs = [self.sublayers[i] for i in sorted(which)]
        if not all(sub.replicable for sub in subs):
            raise ValueError(f"{self.name}: sub-layers {sorted(which)} cannot all run "
                             f"replicated (attention, routing or no weights)")
        idx = {i for sub in subs for i in sub.ops}
        ops = tuple(replace(op, tp_replicated=True) if i in idx and op.kind == "gemm" else op
                    for i, op in enumerate(self.ops))
        cut = {"forward": sum(sub.reductions for sub in subs)}
        cut["backward"] = cut["forward"]
        syncs = []
        for sync in self.tp_syncs:
            direction, kind, _ = sync
            if kind == "reduce" and cut.get(direction, 0) > 0:
                cut[direction] -= 1
                continue
            syncs.append(sync)
        partial = sum(sub.per_op_partial for sub in subs)
        return replace(self, ops=ops, tp_syncs=tuple(syncs),
                       tp_replicated_params=self.tp_replicated_params
                       + sum(sub.params for sub in subs),
                       stream_params=self.stream_params + sum((s.trainable for s in subs), ()),
                       saved_bytes_per_op=self.saved_bytes_per_op + partial,
                       saved_bytes_per_op_partial=self.saved_bytes_per_op_partial - partial)

    @property
    def is_block(self) -> bool:
        """A repeated layer (a transformer block), not the glue before, between or after."""
        return self.count > 1 or self.name not in ("pre", "post") \
            and not self.name.startswith("glue")

    def scaled(self, factor: float) -> "Unit":
        """The unit for `factor` times the traced batch: work and activations scale;
        parameters, buffers and what is made of them alone (an op's `fixed_bytes`, a
        `batch_free` op's FLOPs) do not."""
        if factor == 1:
            return self
        ops = tuple(op if op.batch_free else
                    replace(op, flops_fwd=op.flops_fwd * factor, flops_bwd=op.flops_bwd * factor,
                            bytes_fwd=op.fixed_bytes + (op.bytes_fwd - op.fixed_bytes) * factor,
                            score_bytes=op.score_bytes * factor, logits=op.logits * factor,
                            fp8_elements=_scaled_fp8(op.fp8_elements, factor))
                    for op in self.ops)
        return replace(self, ops=ops, saved_bytes=self.saved_bytes * factor,
                       saved_bytes_recompute=self.saved_bytes_recompute * factor,
                       saved_bytes_memory_ops=self.saved_bytes_memory_ops * factor,
                       saved_bytes_per_op=self.saved_bytes_per_op * factor,
                       saved_bytes_per_op_partial=self.saved_bytes_per_op_partial * factor,
                       saved_bytes_per_op_attention=self.saved_bytes_per_op_attention * factor,
                       fp8_saved_bytes_delta=self.fp8_saved_bytes_delta * factor,
                       act_bytes=self.act_bytes * factor,
                       moe_dispatch_bytes=self.moe_dispatch_bytes * factor,
                       attention_kv_bytes=self.attention_kv_bytes * factor,
                       attention_score_bytes=self.attention_score_bytes * factor,
                       loss_logits=self.loss_logits * factor,
                       loss_logit_bytes=self.loss_logit_bytes * factor,
                       tp_syncs=tuple((d, k, n if k in FIXED_SYNCS else n * factor)
                                      for d, k, n in self.tp_syncs),
                       kv_projections=tuple(
                           kv._replace(reads=tuple(n * factor for n in kv.reads),
                                       query_bytes=kv.query_bytes * factor,
                                       input_bytes=kv.input_bytes * factor)
                           for kv in self.kv_projections),
                       sublayers=tuple(replace(sub, per_op_partial=sub.per_op_partial * factor)
                                       for sub in self.sublayers))


def _scaled_fp8(elements: tuple[float, ...], factor: float) -> tuple[float, ...]:
    """`OpCost.fp8_elements` at `factor` times the batch: the weight's do not scale."""
    if not elements:
        return elements
    inputs, weights, outputs = elements
    return inputs * factor, weights, outputs * factor


def _aligned(node: Node) -> bool:
    """Whether every operand and result of a GEMM has rows of a multiple of 16 bytes: tensor-
    core GEMM kernels need that alignment, and cuBLAS falls back to far slower ones without it
    (GPT-2's 50,257-token head; costmodels.compute.UNALIGNED_GEMM_FRACTION)."""
    tensors = [*node.inputs, *node.outputs, *node.params]
    return all(not t.shape or t.shape[-1] * dtype_num_bytes(t.dtype) % 16 == 0 for t in tensors)


def _segments(graph: Graph) -> list[tuple[str, list[Node], tuple[str, ...]]]:
    """Consecutive runs of nodes: block representatives and the glue between them."""
    owner = {name: b for b in graph.blocks for name in b.node_names}
    out: list[tuple[str, list[Node], tuple[str, ...]]] = []
    for node in graph.nodes:
        block = owner.get(node.name)
        key = block.representative if block else "glue"
        if out and out[-1][0] == key and (block is not None or not out[-1][2]):
            out[-1][1].append(node)
            continue
        fqns = block.layer_fqns if block else ()
        out.append((key, [node], fqns))
    named = []
    for i, (key, nodes, fqns) in enumerate(out):
        if key == "glue":
            paths = sorted({n.module_path.split(".")[0] for n in nodes if n.module_path})
            name = "pre" if i == 0 else "post" if i == len(out) - 1 else f"glue{i}"
            named.append((name, nodes, (name if not paths else "+".join(paths),)))
        else:
            named.append((key, nodes, fqns))
    return named


def _vocab_sized(node: Node, vocab_dims: set[int]) -> bool:
    return any(p.shape and p.shape[0] in vocab_dims for p in node.params)


def _fixed_bytes(node: Node, derived: dict[str, bool]) -> int:
    """What of a node's traffic does not grow with the batch: all of it for a node made
    without the model's inputs, else its reads of parameters, buffers, constants and of
    nodes made of those alone."""
    if not derived[node.name]:
        return node.bytes_read + node.bytes_written
    return sum(t.num_bytes for t, src in zip(node.inputs, node.input_sources)
               if not (src.startswith("input:") or derived.get(src, False)))


def _make_unit(name: str, nodes: list[Node], fqns: tuple[str, ...], vocab_dims: set[int],
               counted: dict[str, str], derived: dict[str, bool], around: bool) -> Unit:
    """`counted` maps the parameters earlier units own to their unit (tied weights count
    once); `derived` says which nodes derive from the model's inputs (`Graph.from_inputs`);
    `around`, whether it is glue around blocks (whose matmuls run whole: `whole_glue_gemms`)."""
    ops: list[OpCost] = []
    dense = expert = 0
    in_moe = False
    seen_params: dict[str, int] = {}
    tied: dict[str, tuple[str, int, int]] = {}
    saved_memory = kernels = dispatch = kv = scores = tail_kernels = fp8_delta = 0
    act = 0
    tail = recompute_tail(nodes)
    residual = residual_structure(nodes)
    whole = bottleneck_gemms(nodes, residual)
    sharded = tp_split_ops(nodes, residual, whole)
    glue = whole_glue_gemms(nodes, vocab_dims) if around and not residual.residual_adds else set()
    kept = per_op_kept(nodes)
    per_op_routed, kept = kept is None, kept or {}
    kv_gemms = kv_projections(nodes)
    fused = fused_chunks(nodes)
    gemm_readers = consumers([n for n in nodes if n.kind in _GEMM_KINDS and n.params])
    kv_made: list[KvGemm] = []
    per_op = per_op_partial = per_op_attention = 0
    op_index: dict[str, int] = {}
    for node in nodes:
        if node.kind is OpKind.MOE_DISPATCH:
            in_moe = True
            dispatch += sum(o.num_bytes for o in node.outputs)
        elif node.kind is OpKind.MOE_COMBINE:
            in_moe = False
        for p in node.params:
            if p.fqn in counted and p.fqn not in seen_params and counted[p.fqn] != name \
                    and p.requires_grad:
                tied[p.fqn] = (counted[p.fqn], p.numel, p.shape[0] if p.shape else 1)
            if p.fqn not in seen_params and p.fqn not in counted:
                seen_params[p.fqn] = p.num_bytes
                counted[p.fqn] = name
                if in_moe:
                    expert += p.numel
                else:
                    dense += p.numel
        if node.kind in _FREE_KINDS:
            continue
        op_index[node.name] = len(ops)
        kernels += 1
        tail_kernels += node.name in tail
        io = node.bytes_read + node.bytes_written
        weights = sum(p.num_bytes for p in node.params)
        fixed = dict(fixed_bytes=_fixed_bytes(node, derived), batch_free=not derived[node.name],
                     kept=node.name in kept)
        if node.name in kept:
            out = kept[node.name]
            if node.kind is OpKind.ATTENTION:
                per_op_attention += out
            elif node.name in residual.row_gemms:
                per_op_partial += out
            else:
                per_op += out
        if node.kind in _GEMM_KINDS:
            vocab = _vocab_sized(node, vocab_dims)
            ops.append(OpCost(kind="gemm", flops_fwd=node.flops_fwd, flops_bwd=node.flops_bwd,
                              bytes_fwd=io, param_bytes=weights, expert=in_moe, vocab=vocab,
                              aligned=_aligned(node), tail=node.name in tail,
                              kv_heads=kv_gemms[node.name].heads if node.name in kv_gemms
                              else 0, kv_cut=node.name in kv_gemms and kv_gemms[node.name].cut,
                              tp_whole=node.name in whole, tp_replicated=node.name in glue,
                              fused_bias=sum(p.numel for p in node.params if p.fqn in fused
                                             and len(p.shape) == 1 and p.requires_grad
                                             and p.fqn in seen_params),
                              fp8_elements=fp8_elements(node, vocab_dims), **fixed))
            if node.name in kv_gemms:
                made = kv_gemms[node.name]
                source, spec = _activation_input(node)
                alone = made.fused and len(gemm_readers.get(source, ())) == 1
                kv_made.append(KvGemm(made.heads, sum(p.numel for p in node.params
                                                      if p.fqn in seen_params),
                                      made.reads, made.read_heads, made.cut,
                                      made.query_bytes,
                                      spec.num_bytes if alone and spec is not None else 0))
            if ops[-1].fp8_elements:
                fp8_delta += int(ops[-1].fp8_elements[0]) - node.saved_bytes
            if node.name in glue:  # its input is the stream's: whole, or a sequence shard
                saved_memory += node.saved_bytes
        elif node.kind is OpKind.ATTENTION and node.attention is not None:
            a = node.attention
            score = a.batch * a.num_heads * a.seq_q * a.seq_kv * node.inputs[0].num_bytes \
                // max(1, node.inputs[0].numel)
            ops.append(OpCost(kind="attention", flops_fwd=node.flops_fwd,
                              flops_bwd=node.flops_bwd, bytes_fwd=io, causal=a.causal,
                              score_bytes=score, seq_kv=a.seq_kv, dropout=a.dropout_p > 0,
                              tail=node.name in tail, **fixed))
            kv += sum(t.num_bytes for t in node.inputs[1:3])
            # Korthikanti et al. 2022: softmax output (2 B/elt), plus the dropout mask (1 B)
            # and output (2 B) when attention dropout is on: 2·a·s²·b or 5·a·s²·b
            scores += int(score * (2.5 if a.dropout_p > 0 else 1.0))
        else:
            loss = is_cross_entropy(node)
            ops.append(OpCost(kind="memory", flops_fwd=0.0, flops_bwd=0.0, bytes_fwd=io,
                              param_bytes=weights, expert=in_moe,
                              tp_sharded=node.name in sharded,
                              vocab=node.kind is OpKind.EMBEDDING
                              and _vocab_sized(node, vocab_dims), tail=node.name in tail,
                              logits=node.inputs[0].numel if loss else 0.0,
                              logit_bytes=node.inputs[0].num_bytes // max(1, node.inputs[0].numel)
                              if loss else 0, scatter_add=node.kind is OpKind.MOE_COMBINE,
                              **fixed))
            if node.name not in sharded:
                saved_memory += node.saved_bytes
        if node.kind is OpKind.NORM:
            act = act or sum(o.num_bytes for o in node.outputs[:1])
        elif node.kind is OpKind.EMBEDDING and not act:
            act = sum(o.num_bytes for o in node.outputs[:1])
    if not act and residual.residual_adds:  # no norm op: the stream's hidden state
        add = next(n for n in nodes if n.name == residual.residual_adds[0])
        act = sum(o.num_bytes for o in add.outputs[:1])
    names = {n.name for n in nodes}
    if not act:  # the hidden state handed on by the unit before
        act = max((t.num_bytes for n in nodes for t, src in zip(n.inputs, n.input_sources)
                   if src not in names and not src.startswith(("param:", "buffer:", "const",
                                                               "input:"))), default=0)
    if not act:  # the hidden state is the largest activation input of the unit
        act = max((t.num_bytes for n in nodes for t, src in zip(n.inputs, n.input_sources)
                   if not src.startswith(("param:", "buffer:", "const"))), default=0)
    syncs, stream = _tp_syncs(nodes, residual, act, vocab_dims, glue, whole)
    broadcast = broadcast_params(nodes, sharded)
    syncs += tuple(("backward", "param", n.outputs[0].num_bytes) for n in broadcast.reduced)
    shared = shared_params(nodes, residual, stream, sharded, whole, seen_params,
                           broadcast.params)
    losses = [n for n in nodes if is_cross_entropy(n)]
    whole_params = {fqn for d in shared for fqn in d}
    subs = tuple(sublayer_of(run, op_index, residual, kept, seen_params, whole_params)
                 for run in sublayers(nodes, residual)) if residual.residual_adds else ()
    return Unit(
        name=name, layer_fqns=fqns, ops=tuple(ops), num_kernels=kernels, num_ops=len(nodes),
        dense_params=dense, expert_params=expert,
        saved_bytes=sum(n.saved_bytes for n in nodes),
        saved_bytes_recompute=sum(n.saved_bytes_recompute for n in nodes),
        saved_bytes_memory_ops=saved_memory, saved_bytes_per_op=per_op,
        saved_bytes_per_op_partial=per_op_partial,
        saved_bytes_per_op_attention=per_op_attention, fp8_saved_bytes_delta=fp8_delta,
        act_bytes=act, tp_syncs=syncs,
        moe_reductions=sum(n.kind is OpKind.MOE_DISPATCH for n in nodes)
        if residual.residual_adds else 0,
        moe_dispatch_bytes=dispatch, attention_kv_bytes=kv, attention_score_bytes=scores,
        param_bytes=sum(seen_params.values()),
        loss_logits=sum(n.inputs[0].numel for n in losses),
        loss_logit_bytes=sum(n.inputs[0].num_bytes for n in losses), tail_kernels=tail_kernels,
        per_op_routed=per_op_routed,
        stream_params=tuple(shared[0].values()), sublayers=subs,
        router_params=tuple(shared[1].values()), head_params=tuple(shared[2].values()),
        tp_shared_params=sum({k: v for d in shared for k, v in d.items()}.values()),
        kv_projections=tuple(kv_made), tied_params=tuple(tied.values()))


def _tp_syncs(nodes: list[Node], residual, act: int, vocab_dims: set[int], glue: set[str],
              whole: dict) -> tuple[tuple[tuple[str, str, float], ...], set[str]]:
    """The unit's tensor-parallel synchronisations under Megatron's layout, per layer, as
    ``(direction, kind, nbytes)`` (`Unit.tp_syncs`), and its sequence-sharded stream's nodes.

    A block (a run with residual adds) reduces the hidden state per partial sum
    (`reduction_points`: row-parallel GEMMs' outputs forward, once per sum they join; the
    column-parallel GEMMs' input gradients backward, once per tensor they read; an MoE
    sub-layer's once each way with its shared expert's) and per output-channel parallel
    convolution each way, and all-reduces each norm statistic over split features each way,
    all-gathering the gradients of the weights scaling them (`split_statistics`, the block's
    low-rank projections ``whole``); its stream is the residual structure's. In the glue
    each op says what it moves: a vocabulary-parallel lookup reduces its output forward (its
    table's gradient needs none); a vocabulary projection's or a convolution's weight is
    split on its outputs, so its input gradient is reduced backward (when the input needs
    one), and its output is gathered forward unless a cross-entropy reads it (its logits stay
    sharded for the parallel loss, which reduces three fp32 values per row forward). Other
    matmuls (``glue``, `whole_glue_gemms`) run whole on the stream, every op but those."""
    if residual.residual_adds:
        fwd, fwd_sp, bwd = (k + sum(n.kind is OpKind.CONV and bool(n.params) for n in nodes)
                            for k in reduction_points(nodes, residual))
        syncs = [("forward", "reduce", act)] * fwd + [("forward", "reduce_sp", act)] * max(
            0, fwd_sp - fwd) + [("backward", "reduce", act)] * bwd
        for stat, scales in split_statistics(nodes, residual, whole):
            n = stat.outputs[0].num_bytes
            syncs += [("forward", "stat", n), ("backward", "stat", n)]
            syncs += [("backward", "weight", p.num_bytes) for p in scales]
        return tuple(syncs), set(residual.stream)
    readers = consumers(nodes)
    syncs: list[tuple[str, str, float]] = []
    stream = set(glue)
    for node in nodes:
        if node.kind is OpKind.EMBEDDING and _vocab_sized(node, vocab_dims):
            syncs.append(("forward", "reduce", node.outputs[0].num_bytes))
        elif node.kind in _GEMM_KINDS and node.params and node.name not in stream:
            source, spec = _activation_input(node)
            if not source.startswith("input:"):  # the input needs its gradient
                syncs.append(("backward", "reduce", spec.num_bytes))
            loss = loss_reader(node.name, readers) if node.kind is OpKind.MATMUL else None
            if loss is None:
                syncs.append(("forward", "gather", node.outputs[0].num_bytes))
            else:
                rows = loss.inputs[0].numel // max(1, loss.inputs[0].shape[-1])
                syncs += [("forward", "loss", rows * LOSS_REDUCTION_BYTES)] * LOSS_REDUCTIONS
        else:
            stream.add(node.name)
    return tuple(syncs), stream


def _activation_input(node: Node) -> tuple[str, Any]:
    """A GEMM's activation input: ``(its source, its tensor)``, or ``("input:", None)``."""
    return next(((src, t) for src, t in zip(node.input_sources, node.inputs)
                 if not src.startswith(("param:", "buffer:", "const"))), ("input:", None))


def units_from_graph(graph: Graph) -> tuple[Unit, ...]:
    """The graph's units in execution order (blocks stand for all their copies)."""
    vocab_dims = vocab_sizes(graph)
    counted: dict[str, str] = {}
    index = {b.representative: b.layer_indices for b in graph.blocks}
    units, last = [], -1.0  # glue sits after the blocks run before it
    for name, nodes, fqns in _segments(graph):
        unit = _make_unit(name, nodes, fqns, vocab_dims, counted, graph.from_inputs,
                          name not in index and bool(index))
        places = tuple(map(float, index.get(name, ()))) or (last + 0.5,)
        last = max(last, *places) if name in index else last
        units.append(replace(unit, positions=places))
    return tuple(units)
