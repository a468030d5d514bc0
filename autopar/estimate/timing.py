"""Time of one copy of a unit, for one micro-batch, on one rank of a parallel configuration.

Sharding follows Megatron-LM for transformer-shaped units (the search's ILP may choose other
layouts later): GEMMs and attention are split over tp (column->row pairs, heads) and cp
(tokens); vocabulary GEMMs and lookups are vocab-parallel over tp; memory-bound ops are split
over cp, and over tp only with sequence parallelism. Communication goes through
`Cluster.collective_time` on the rank groups of the mesh, each axis's slowest
(`autopar.estimate.groups.slowest_groups`: a step waits for its slowest rank), so the topology
decides its cost:

- TP: per reduction of the hidden state an all-reduce (with SP a reduce-scatter, and an
  all-gather the other way), a vocabulary-parallel loss's per-token reductions
  (`tp_collectives`); exposed, or hidden behind the unit's GEMMs up to their duration when
  the software overlaps it.
- CP: the K/V transfers of the engine's ring or all-gather (`cp_collectives`), each hidden
  behind the attention blocks that can run while it is in flight; only the excess is exposed.
- EP: all-to-all dispatch and combine of the routed tokens, forward and backward.
Recompute: "full" re-runs the unit's forward (compute and TP communication) in backward (one
layer in `recompute_every`: per layer, that share of it); "per_op" re-runs the ops whose
outputs it does not keep (`OpCost.kept`) and the TP collectives they need; "selective"
re-runs the attention core, which flash kernels already do by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.estimate.groups import RankGroups
from autopar.estimate.units import FIXED_SYNCS, OpCost, Unit
from costmodels.compute import (EAGER_GEMM_EXTRA_OPS, SAC_DISPATCH_S, AttentionCall,
                                SCATTER_ADD_TRAFFIC_FACTOR, activation_memory_time_s,
                                attention_time_s, fp8_cast_time_s, gemm_time_s, loss_time_s,
                                memory_time_s, op_overhead_s, unaligned_gemm_slowdown)

if TYPE_CHECKING:
    from autopar.estimate.core import EstimateOptions

__all__ = ["BACKWARD_MEMORY_RATIO", "UnitCompute", "UnitTimes", "cp_attention_blocks",
           "cp_collectives", "op_times", "selective_checkpoint_time_s", "tp_collectives",
           "unit_compute", "unit_times"]

# A memory-bound op's backward reads the output gradient and the saved input and writes the
# input gradient: about twice the forward's traffic (read input, write output).
BACKWARD_MEMORY_RATIO = 2.0


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitTimes:
    """Seconds for one copy of a unit, one micro-batch, on one rank."""

    compute_fwd: float
    compute_bwd: float  # input and weight gradients
    compute_wgrad: float  # the weight-gradient share of compute_bwd (zero-bubble's W)
    recompute: float  # extra forward work in backward (compute and its TP communication)
    tp_fwd: float
    tp_bwd: float
    cp_fwd: float
    cp_bwd: float
    ep_fwd: float
    ep_bwd: float

    @property
    def forward(self) -> float:
        return self.compute_fwd + self.tp_fwd + self.cp_fwd + self.ep_fwd

    @property
    def backward(self) -> float:
        return self.compute_bwd + self.recompute + self.tp_bwd + self.cp_bwd + self.ep_bwd


def cp_attention_load(cp: int, *, causal: bool, balanced: bool) -> float:
    """The busiest cp rank's share of one attention's work, over an even share (1/cp).  With
    one contiguous chunk per rank a causal mask gives the last rank its chunk's queries against
    every earlier key: (cp - 1/2) of the cp²/2 chunk pairs, 2 - 1/cp times an even share;
    zigzag chunks (and masks that are not causal) share the work evenly."""
    return 1.0 if balanced or not causal or cp == 1 else 2.0 - 1.0 / cp


def cp_attention_blocks(cp: int, seq_kv: float, *, balanced: bool, causal: bool
                        ) -> tuple[int, float]:
    """(kernel calls, key length of each) of one attention on the busiest rank of a cp ring
    (autopar.runtime.context_parallel's blocks). Zigzag chunks (two of seq/(2cp) per rank): a
    causal mask leaves three of the four blocks of the first step and two of every later one,
    2cp + 1 calls; without a mask all four, 4cp. One contiguous chunk per rank: one block per
    step, cp calls on the last rank under a causal mask."""
    if cp == 1:
        return 1, seq_kv
    if balanced:
        return (2 * cp + 1 if causal else 4 * cp), seq_kv / (2 * cp)
    return cp, seq_kv / cp


def fp8_casts(op: OpCost, cluster: Cluster, cfg: ParallelConfig, fp8_recipe: str,
              kernels: str) -> tuple[float, float]:
    """Seconds of an fp8 GEMM's operand casts on one rank, forward and backward."""
    inputs, weights, outputs = op.fp8_elements
    scale = cfg.cp * op.tp_rows(cfg.tp, cfg.sequence_parallel)
    return fp8_cast_time_s(cluster.hardware.device, fp8_recipe, kernels,
                           inputs=inputs / scale,
                           weights=weights / (1 if op.whole_on_tp(cfg.tp) else cfg.tp),
                           outputs=outputs / scale)


def selective_checkpoint_time_s(unit: Unit, dtype: str) -> float:
    """Host seconds per-op selective checkpointing adds to one layer of `unit` in eager
    PyTorch: every op the layer dispatches (its traced nodes and what each GEMM dispatches
    besides, `EAGER_GEMM_EXTRA_OPS`) passes through the policy's Python mode in forward and in
    the recompute (`SAC_DISPATCH_S`)."""
    def extra(op: OpCost) -> int:
        if dtype == "fp8" and op.fp8_elements:
            return EAGER_GEMM_EXTRA_OPS["fp8"]
        return EAGER_GEMM_EXTRA_OPS["fp32" if dtype == "fp32" else "bf16"]

    gemms = sum(extra(op) for op in unit.ops if op.kind == "gemm")
    return SAC_DISPATCH_S * (unit.num_ops + gemms)


def op_times(op: OpCost, cluster: Cluster, dtype: str, cfg: ParallelConfig,
             kernel: str, kernels: str = "eager", loss_kernel: str = "eager",
             fp8_recipe: str = "tensorwise") -> tuple[float, float, float]:
    """(forward, backward, weight-grad part of backward) seconds of one op on one rank. A
    cross-entropy runs on logits sharded over tp (vocabulary-parallel) and cp. Under fp8
    training only the Linear layers' GEMMs (`OpCost.fp8_elements`) run in fp8, with their
    operands' casts by `fp8_recipe`; every other op runs in bf16."""
    device = cluster.hardware.device
    tp, cp = cfg.tp, cfg.cp
    fp8 = dtype == "fp8" and op.kind == "gemm" and bool(op.fp8_elements)
    if dtype == "fp8" and not fp8:
        dtype = "bf16"
    if op.kind == "gemm":
        scale = cp * op.tp_rows(tp, cfg.sequence_parallel)
        nbytes = op.bytes_fwd / scale
        if op.whole_on_tp(tp):  # the rows it runs times the whole weight
            nbytes = (op.bytes_fwd - op.param_bytes) / scale + op.param_bytes
        fwd = gemm_time_s(device, dtype, op.flops_fwd / scale, nbytes)
        bwd = gemm_time_s(device, dtype, op.flops_bwd / scale, 2 * nbytes)
        if not op.aligned and kernels == "eager":  # fused-kernel software pads the sizes
            fwd *= unaligned_gemm_slowdown(device, dtype, backward=False)
            bwd *= unaligned_gemm_slowdown(device, dtype, backward=True)
        wgrad = bwd / 2 if op.flops_bwd >= 2 * op.flops_fwd else 0.0
        if fp8:
            cast_fwd, cast_bwd = fp8_casts(op, cluster, cfg, fp8_recipe, kernels)
            fwd, bwd = fwd + cast_fwd, bwd + cast_bwd
        return fwd, bwd, wgrad
    if op.kind == "attention":
        scale = tp * cp / cp_attention_load(cp, causal=op.causal, balanced=op.cp_balanced)
        calls, block = cp_attention_blocks(cp, op.seq_kv, balanced=op.cp_balanced,
                                           causal=op.causal)
        work = dict(io_bytes=op.bytes_fwd / scale, score_bytes=op.score_bytes / scale,
                    causal=op.causal, seq_kv=block, dropout=op.dropout, calls=calls)
        return tuple(attention_time_s(device, dtype, AttentionCall(flops=flops / scale, **work),
                                      kernel=kernel, kernels=kernels, backward=backward)
                     for flops, backward in ((op.flops_fwd, False), (op.flops_bwd, True))) \
            + (0.0,)
    if op.logits:
        fwd, bwd = loss_time_s(device, op.logits / (tp * cp), op.logit_bytes, loss_kernel)
        return fwd, bwd, 0.0
    split = cp * (tp if cfg.sequence_parallel or op.vocab or op.expert or op.tp_sharded
                  else 1)
    fwd = activation_memory_time_s(device, op.bytes_fwd / split, kernels)
    bwd = BACKWARD_MEMORY_RATIO * fwd  # a scatter-add's backward gathers: no atomics
    if op.scatter_add and kernels == "eager":
        fwd = memory_time_s(device, op.bytes_fwd / split * SCATTER_ADD_TRAFFIC_FACTOR)
    return fwd, bwd, 0.0


def tp_collectives(unit: Unit, cfg: ParallelConfig
                   ) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """The tensor-parallel collectives of one layer of `unit` per micro-batch on one rank,
    forward and backward, as ``(kind, nbytes)`` in `Cluster.collective_time`'s convention,
    from its synchronisations (`Unit.tp_syncs`, each over one rank's share of the sequence
    under cp): a partial sum is all-reduced, or under sequence parallel reduce-scattered with
    an all-gather of the same tensor the other way (the sequence shard gathered for the next
    sub-layer, or its gradient); a split output is all-gathered; a parallel loss's per-row
    values are all-reduced. A K/V projection every rank runs whole adds what its gradients
    move backward and may spare its sub-layer's input reduction (`KvGemm.backward`). With
    expert parallel folded over tp (`ParallelConfig.folded`) the MoE sub-layers reduce
    nothing over tp: each rank routes its own sequence shard to whole experts."""
    fwd: list[tuple[str, float]] = []
    bwd: list[tuple[str, float]] = []
    if cfg.tp == 1:
        return fwd, bwd
    skip = dict.fromkeys(("forward", "backward"), unit.moe_reductions if cfg.folded else 0)
    for direction, kind, nbytes in unit.tp_syncs:
        if kind == "reduce_sp":  # a partial sum meeting the stream's sequence shard
            if not cfg.sequence_parallel:
                continue
            kind = "reduce"
        if kind == "reduce" and skip[direction]:
            skip[direction] -= 1
            continue
        here, other = (fwd, bwd) if direction == "forward" else (bwd, fwd)
        n = nbytes if kind in FIXED_SYNCS else nbytes / cfg.cp
        if kind == "reduce" and cfg.sequence_parallel:
            here.append(("reduce_scatter", n))
            other.append(("all_gather", n))
        else:
            here.append(("all_gather" if kind in ("gather", "weight") else "all_reduce", n))
    for kv in unit.kv_projections:
        added, spared = kv.backward(cfg)
        bwd += added
        if spared in bwd:
            bwd.remove(spared)
    return fwd, bwd


def _tp_times(unit: Unit, cluster: Cluster, cfg: ParallelConfig, groups: RankGroups
              ) -> tuple[float, float]:
    """Seconds of `tp_collectives` on the tp group, forward and backward."""
    fwd, bwd = tp_collectives(unit, cfg)
    return (sum(cluster.collective_time(kind, n, groups.tp) for kind, n in fwd),
            sum(cluster.collective_time(kind, n, groups.tp) for kind, n in bwd))


@dataclass(frozen=True, slots=True)
class UnitCompute:
    """The kernels of one layer of a unit, one micro-batch, on one rank: what its times are
    besides communication, the same wherever the rank's groups lie (any mesh order)."""

    fwd: float  # every op's forward and the launch gaps
    bwd: float
    wgrad: float
    attn_fwd: float
    attn_bwd: float
    gemm_fwd: float
    gemm_bwd: float
    tail_fwd: float  # the ops after early-stopped recompute's last one (`OpCost.tail`)
    tail_gemms: int
    # what per-op recompute re-runs (the ops not `OpCost.kept`, with their launch gaps), before
    # the tail and in it
    per_op_fwd: float = 0.0
    per_op_tail_fwd: float = 0.0


def unit_compute(unit: Unit, *, cluster: Cluster, dtype: str, cfg: ParallelConfig,
                 attention_kernel: str, kernels: str = "eager", loss_kernel: str = "eager",
                 fp8_recipe: str = "tensorwise") -> UnitCompute:
    """`UnitCompute` of `unit` (it depends on the micro-batch, tp, cp, SP, dtype and kernels,
    not on where the groups lie)."""
    fwd = bwd = wgrad = attn_fwd = attn_bwd = gemm_fwd = gemm_bwd = tail_fwd = 0.0
    tail_gemms = 0
    gap = op_overhead_s(cluster.hardware.device)
    rerun = [0.0, 0.0]  # per-op recompute, before the tail and in it
    for op in unit.ops:
        f, b, w = op_times(op, cluster, dtype, cfg, attention_kernel, kernels, loss_kernel,
                           fp8_recipe)
        fwd, bwd, wgrad = fwd + f, bwd + b, wgrad + w
        if op.tail:
            tail_fwd += f
            tail_gemms += op.kind == "gemm"
        if not op.kept or (op.kind == "attention" and attention_kernel == "math"):
            rerun[op.tail] += f + gap
        elif dtype == "fp8" and op.kind == "gemm" and op.fp8_elements:
            # a kept fp8 GEMM's output is not re-run, but the casts of its operands are: its
            # backward needs them, and they are ops of their own
            rerun[op.tail] += fp8_casts(op, cluster, cfg, fp8_recipe, kernels)[0]
        if op.kind == "attention":
            attn_fwd, attn_bwd = attn_fwd + f, attn_bwd + b
        elif op.kind == "gemm":
            gemm_fwd, gemm_bwd = gemm_fwd + f, gemm_bwd + b
    if kernels == "eager" and unit.is_block:  # the policy's dispatch, forward and recompute
        rerun[0] += selective_checkpoint_time_s(unit, dtype)
    return UnitCompute(fwd=fwd + unit.num_kernels * gap, bwd=bwd + 2 * unit.num_kernels * gap,
                       wgrad=wgrad, attn_fwd=attn_fwd, attn_bwd=attn_bwd, gemm_fwd=gemm_fwd,
                       gemm_bwd=gemm_bwd, tail_fwd=tail_fwd, tail_gemms=tail_gemms,
                       per_op_fwd=rerun[0], per_op_tail_fwd=rerun[1])


def cp_collectives(unit: Unit, cfg: ParallelConfig, options: EstimateOptions, dtype: str
                   ) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """(forward, backward) transfers, as (kind, bytes a rank sends), of one layer of `unit`'s
    attention on a cp rank for one micro-batch, in the way ``options.cp_rotate`` says. A rank
    holds 1/cp of the K/V's tokens and the heads its query heads read: 1/tp of them, or one
    where the attention reads fewer K/V heads than tp (`KvGemm.read_heads`); the fp32 dK/dV
    accumulators of "ring" and "all_gather" are that share in 4-byte elements."""
    if cfg.cp == 1 or not unit.attention_kv_bytes:
        return [], []
    cp = cfg.cp
    kv, dkv = _cp_shares(unit, cfg, dtype)
    if options.cp_rotate == "p2p":
        return [("send_recv", kv)] * (cp - 1), [("send_recv", kv)] * (2 * (cp - 1))
    if options.cp_rotate == "ring":
        hops = [("send_recv", kv)] * (cp - 1)
        return hops, hops + [("send_recv", dkv)] * cp
    gather = [("all_gather", kv * cp)]
    return gather, gather + [("all_to_all", dkv)] * cp


def ep_collectives(unit: Unit, cfg: ParallelConfig
                   ) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """(forward, backward) expert-parallel collectives of one layer of `unit` on an ep rank
    for one micro-batch, as (kind, bytes): all-to-all dispatch and combine of the rank's
    routed tokens (1/cp of the sequence, and 1/tp of it under sequence parallel), or, where
    the MoE layer runs on its own forward (``ep_dispatch`` "all_gather"), its input gathered
    over the ep group and its output reduce-scattered back, by each tp rank (the MoE
    sub-layer's input is whole there, as it runs on local shards); backward the reverse."""
    if cfg.ep == 1 or not unit.moe_dispatch_bytes:
        return [], []
    if unit.ep_dispatch == "all_gather":
        gathered = unit.act_bytes * cfg.ep / cfg.cp
        return ([("all_gather", gathered), ("reduce_scatter", gathered)],
                [("reduce_scatter", gathered), ("all_gather", gathered)])
    split = cfg.cp * (cfg.tp if cfg.sequence_parallel else 1)
    return [("all_to_all", unit.moe_dispatch_bytes / split)] * 2, \
        [("all_to_all", unit.moe_dispatch_bytes / split)] * 2


def _cp_shares(unit: Unit, cfg: ParallelConfig, dtype: str) -> tuple[float, float]:
    """(bytes of a cp rank's K/V share, of its fp32 dK/dV accumulators) (`cp_collectives`)."""
    heads = min((kv.read_heads for kv in unit.kv_projections), default=cfg.tp)
    kv = unit.attention_kv_bytes / (cfg.cp * min(cfg.tp, max(1, heads)))
    return kv, kv * 4 / (4 if dtype == "fp32" else 2)  # attention runs in bf16 under fp8


def _cp_times(unit: Unit, cluster: Cluster, cfg: ParallelConfig, groups: RankGroups | None,
              options: EstimateOptions, dtype: str, attn_fwd: float, attn_bwd: float
              ) -> tuple[float, float]:
    """Exposed (forward, backward) seconds of `cp_collectives`. A transfer hides behind the
    attention blocks that run while it is in flight: the K/V hops behind the whole pass's
    blocks, an all-gather behind the first step's (1/cp of them), each dK/dV hop but the last
    behind the next step's; the last dK/dV hop waits for all of them."""
    if cfg.cp == 1 or not unit.attention_kv_bytes or groups is None:
        return 0.0, 0.0
    cp, ring = cfg.cp, groups.cp

    def hop(nbytes: float) -> float:
        # a ring is as slow as its slowest link: the wrap-around pair crosses nodes whenever
        # the group spans nodes (a dK/dV rotation by all-to-all sends to one peer, as a hop)
        return max(cluster.collective_time("send_recv", nbytes, ring[:2]),
                   cluster.collective_time("send_recv", nbytes, (ring[-1], ring[0])))

    kv, dkv = _cp_shares(unit, cfg, dtype)
    if options.cp_rotate == "p2p":
        ring_time = (cp - 1) * hop(kv)
        return max(0.0, ring_time - attn_fwd), max(0.0, 2 * ring_time - attn_bwd)
    last = hop(dkv)
    if options.cp_rotate == "ring":
        return (max(0.0, (cp - 1) * hop(kv) - attn_fwd),
                max(0.0, (cp - 1) * (hop(kv) + last) - attn_bwd) + last)
    gather = cluster.collective_time("all_gather", kv * cp, ring)
    return (max(0.0, gather - attn_fwd / cp),
            max(0.0, gather - attn_bwd / cp)
            + max(0.0, (cp - 1) * (last - attn_bwd / cp)) + last)


def unit_times(unit: Unit, *, cluster: Cluster, dtype: str, cfg: ParallelConfig,
               groups: RankGroups | None, options: EstimateOptions,
               compute: UnitCompute | None = None) -> UnitTimes:
    """Per micro-batch seconds of one layer of `unit` in the software ``options`` says. Full
    recompute re-runs a block's forward and its TP and CP communication (not the glue's); with
    ``options.recompute_early_stop`` (torch's non-reentrant checkpoint) it stops before the
    unit's tail (`OpCost.tail`: a block's last GEMM and what follows) and that GEMM's
    row-parallel reduction. ``compute``: the unit's `unit_compute` for this config if the
    caller has it. Without ``groups`` the times leave communication out (a bound)."""
    c = compute or unit_compute(unit, cluster=cluster, dtype=dtype, cfg=cfg,
                                attention_kernel=options.attention_kernel,
                                kernels=options.kernels, loss_kernel=options.loss_kernel,
                                fp8_recipe=options.fp8_recipe)
    fwd, bwd, attn_fwd, attn_bwd = c.fwd, c.bwd, c.attn_fwd, c.attn_bwd
    gap = op_overhead_s(cluster.hardware.device)
    tp_fwd, tp_bwd = _tp_times(unit, cluster, cfg, groups) if groups is not None else (0.0, 0.0)
    if options.overlap_tp_comm:
        tp_fwd, tp_bwd = max(0.0, tp_fwd - c.gemm_fwd), max(0.0, tp_bwd - c.gemm_bwd)

    cp_fwd, cp_bwd = _cp_times(unit, cluster, cfg, groups, options, dtype, attn_fwd, attn_bwd)

    ep = sum(cluster.collective_time(kind, nbytes, groups.ep)
             for kind, nbytes in ep_collectives(unit, cfg)[0]) if groups is not None else 0.0

    if cfg.recompute in ("full", "per_op") and not unit.is_block:
        recompute = 0.0  # checkpointing wraps the blocks (Megatron's layers, the runtime's)
    elif cfg.recompute == "full" and options.recompute_early_stop:
        points = unit.tp_reductions[0]
        kept = (points - min(c.tail_gemms, points)) / points if points else 1.0
        recompute = fwd - c.tail_fwd - unit.tail_kernels * gap + tp_fwd * kept + cp_fwd + ep
    elif cfg.recompute == "full":
        recompute = fwd + tp_fwd + cp_fwd + ep
    elif cfg.recompute == "per_op":
        points = unit.tp_reductions[0]
        if cfg.sequence_parallel:  # the reduce-scatters' outputs are kept, the gathers re-run
            tp_rerun = tp_fwd / 2
        elif options.recompute_early_stop and points:  # the tail's reduction: not again
            tp_rerun = tp_fwd * (points - min(c.tail_gemms, points)) / points
        else:
            tp_rerun = tp_fwd
        recompute = c.per_op_fwd + tp_rerun + (
            0.0 if options.recompute_early_stop else c.per_op_tail_fwd)
    elif cfg.recompute == "selective" and options.attention_kernel == "math":
        recompute = attn_fwd
    else:
        recompute = 0.0
    if cfg.recompute == "full":  # one block in `recompute_every`, per layer on average
        recompute /= cfg.recompute_every
    return UnitTimes(compute_fwd=fwd, compute_bwd=bwd, compute_wgrad=c.wgrad, recompute=recompute,
                     tp_fwd=tp_fwd, tp_bwd=tp_bwd, cp_fwd=cp_fwd, cp_bwd=cp_bwd, ep_fwd=ep,
                     ep_bwd=ep)
