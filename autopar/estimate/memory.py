"""Memory of each pipeline rank: model states, activations in flight, buffers, reserve.

Activations per micro-batch come from the traced graph's saved bytes (all of them, the
selective-recompute remainder, each layer's input and the outputs per-op recompute keeps, or
only each layer's input under full recompute; the last two plus one layer's working set),
sharded over tp x cp for what GEMMs and attention keep and over cp (and tp only with
sequence parallelism) for what norms and elementwise ops keep. The number held at
once is read off the simulated schedule: a (stage, micro-batch) pair holds its activations from
its forward until its last backward op (B, or W for zero-bubble).
"""

from __future__ import annotations

from autopar.config import ParallelConfig
from autopar.estimate.units import Unit
from costmodels.compute import LOSS_KERNELS
from costmodels.memory import (ALLOCATOR_RESERVE_FRACTION, COMM_BUFFER_BYTES,
                               CUDA_CONTEXT_BYTES, LOSS_BACKWARD_PEAK_BYTES_PER_LOGIT,
                               LOSS_KEPT_BYTES_PER_LOGIT, state_bytes_split)
from costmodels.pipeline import PipelineTimeline

__all__ = ["stage_memory", "activation_bytes", "held_zero_stage", "keeps_fp8_copies",
           "keeps_weight_copies", "loss_bytes", "peak_inflight_bytes"]


def loss_bytes(unit: Unit, loss_kernel: str) -> tuple[float, float]:
    """(kept beyond the traced log-probabilities, held only while its backward runs) of the
    unit's cross-entropy losses, whole (before any sharding).

    The trace keeps log-probabilities the size of the logits in their dtype. The eager loss
    (``F.cross_entropy(logits.float(), ...)``, autopar's runtime) keeps them in fp32 and its
    backward holds two more fp32 buffers (measured: LOSS_KEPT_BYTES_PER_LOGIT,
    LOSS_BACKWARD_PEAK_BYTES_PER_LOGIT). Megatron-LM's loss also keeps an fp32 softmax, but
    its backward works in place on it: only the downcast gradient is new. A fused kernel
    (flash-attn's CrossEntropyLoss, llm-foundry's default) keeps the logits and per-row
    statistics and writes one gradient of the logits' size.
    """
    if loss_kernel == "fused":
        return 0.0, float(unit.loss_logit_bytes)
    if loss_kernel not in LOSS_KERNELS:
        raise ValueError(f"loss_kernel={loss_kernel!r} is not known; use one of "
                         f"{', '.join(LOSS_KERNELS)}")
    kept = unit.loss_logits * LOSS_KEPT_BYTES_PER_LOGIT
    if loss_kernel == "megatron":
        return kept - unit.loss_logit_bytes, float(unit.loss_logit_bytes)
    return (kept - unit.loss_logit_bytes,
            unit.loss_logits * (LOSS_BACKWARD_PEAK_BYTES_PER_LOGIT - LOSS_KEPT_BYTES_PER_LOGIT))


def keeps_weight_copies(cfg: ParallelConfig, dtype: str, fp32_params: bool) -> bool:
    """Whether the forward keeps autocast's 16-bit copies of the GEMM weights
    (`EstimateOptions.fp32_params`): a 16-bit run without ZeRO (FSDP2 gathers the
    parameters in 16 bits)."""
    return fp32_params and dtype in ("bf16", "fp8") and cfg.zero_stage == 0


def held_zero_stage(cfg: ParallelConfig, fsdp2: bool) -> int:
    """The ZeRO stage whose model states a rank holds at its peak: under FSDP2 in a pipeline
    (`EstimateOptions.fsdp2`) ZeRO-2 and -3 hold what ZeRO-1 holds, the stage keeping every
    unit's parameters gathered and its gradients whole from its first backward to its last;
    otherwise the plan's."""
    return 1 if fsdp2 and cfg.pp > 1 and cfg.zero_stage > 1 else cfg.zero_stage


def keeps_fp8_copies(dtype: str, fp32_params: bool, fp8_recipe: str) -> bool:
    """Whether each fp8 GEMM keeps 1-byte copies of its input and weight for backward: fp8
    training with tensorwise scaling by software that casts each forward's operands
    (`EstimateOptions.fp32_params`: measured for autopar's runtime, `autopar.runtime.fp8`;
    other software under autocast over fp32 parameters is taken to keep them alike). Rowwise
    scaling keeps the 16-bit operands and casts them again along the other dim in backward."""
    return dtype == "fp8" and fp32_params and fp8_recipe == "tensorwise"


def activation_bytes(unit: Unit, cfg: ParallelConfig, flash: bool,
                     loss_kernel: str = "eager", *,
                     weight_copies: bool = False, fp8: bool = False) -> tuple[float, float]:
    """(kept per layer per micro-batch, working set of one layer while it runs) on one rank.

    A fused attention node keeps no score matrix; with an unfused kernel (`flash` False) the
    scores it would keep are added. Full recompute keeps a block's input only (the glue is not
    checkpointed; with `recompute_every` k, per layer on average, 1/k of that and (k-1)/k of
    what no recompute keeps); per-op recompute keeps it and the outputs
    `Unit.saved_bytes_per_op*` name (with sequence parallel also the reduce-scatters' outputs,
    `PER_OP_SAVED`); selective recompute drops the score-sized tensors. A cross-entropy keeps
    and briefly holds what `loss_bytes` says, its logits sharded over tp (vocabulary-parallel)
    and cp. With `weight_copies` (autocast over fp32 parameters, `keeps_weight_copies`) a layer
    that is not checkpointed also keeps the 16-bit copy of each GEMM's weight (its share over
    tp, and ep for experts); a checkpointed one casts them again in its recompute. With `fp8`
    (fp8 training by software that casts each forward's operands and keeps the casts for
    backward, `keeps_fp8_copies`) a layer that is not
    checkpointed keeps, for each fp8 GEMM, 1-byte copies of its input and its weight, whatever
    the ZeRO stage (`Unit.fp8_saved_bytes_delta`).
    """
    tp, cp = cfg.tp, cfg.cp
    loss_kept, loss = (b / (tp * cp) for b in loss_bytes(unit, loss_kernel))
    mem_split = cp * (tp if cfg.sequence_parallel else 1)
    scores = 0.0 if flash else unit.attention_score_bytes / (tp * cp)
    full = (unit.saved_bytes - unit.saved_bytes_memory_ops) / (tp * cp) \
        + unit.saved_bytes_memory_ops / mem_split + scores + loss_kept
    if weight_copies or fp8:
        full += sum((op.fp8_elements[1] if fp8 and op.fp8_elements else
                     op.param_bytes if weight_copies else 0.0)
                    / (cfg.expert_tp * cfg.ep if op.expert else
                       1 if op.whole_on_tp(tp) else tp)
                    for op in unit.ops if op.kind == "gemm")
    if fp8:
        full += unit.fp8_saved_bytes_delta / (tp * cp)
    if cfg.recompute == "full" and unit.is_block:  # the glue is not checkpointed
        # one layer in `recompute_every` keeps its input only, the others all they save
        share = 1.0 / cfg.recompute_every
        return share * unit.act_bytes / mem_split + (1.0 - share) * full, full + loss
    if cfg.recompute == "per_op" and unit.is_block:
        kept = (unit.saved_bytes_per_op / (tp * cp) + unit.saved_bytes_per_op_partial / cp
                + (unit.saved_bytes_per_op_attention / (tp * cp) if flash else 0.0))
        if cfg.sequence_parallel and tp > 1:
            kept += unit.tp_reductions[0] * unit.act_bytes / (tp * cp)
        kept += unit.act_bytes / mem_split
        # its backward re-makes the rest, reusing what was kept
        return kept, max(0.0, full - kept) + loss
    if cfg.recompute == "selective":
        dropped = (unit.saved_bytes - unit.saved_bytes_recompute) / (tp * cp) + scores
        return max(0.0, full - dropped), loss
    return full, loss


def peak_inflight_bytes(timeline: PipelineTimeline, rank: int, per_stage: list[float]
                        ) -> float:
    """Most activation bytes `rank` holds at once, read off a timeline's recorded ops. The
    estimate takes the same sweep from the simulator (`activation_bytes=`, which needs no op
    list); this form is its reference in the tests."""
    last_use: dict[tuple[int, int], float] = {}
    for op in timeline.ops[rank]:
        if op.kind.value != "F":
            key = (op.stage, op.microbatch)
            last_use[key] = max(last_use.get(key, 0.0), op.end_s)
    events = []
    for op in timeline.ops[rank]:
        if op.kind.value == "F":
            size = per_stage[op.stage]
            events.append((op.start_s, 1, size))
            events.append((last_use[(op.stage, op.microbatch)], 0, -size))
    live = peak = 0.0
    for _, _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak


def stage_memory(cfg: ParallelConfig, dtype: str, dense: list[float], expert: list[float],
                 max_param_bytes: list[float], bytes_per_param: list[float],
                 inflight: list[float], working: list[float],
                 zero3_max_live_params: int | None = None,
                 fp32_params: bool = False) -> list[dict[str, float]]:
    """Bytes per category for each pipeline rank, from its parameters on one GPU (dense,
    expert), its largest unit's parameter bytes, the peak activation bytes it holds across
    micro-batches (`inflight`) and one layer's working set (`working`)."""
    shards = cfg.dp * cfg.cp
    dense_split = state_bytes_split(dtype, cfg.zero_stage, shards, fp32_params)
    expert_split = state_bytes_split(dtype, cfg.zero_stage, cfg.expert_dp, fp32_params)
    out = []
    for rank in range(cfg.pp):
        split = [dense[rank] * d + expert[rank] * e for d, e in zip(dense_split, expert_split)]
        states = sum(split)
        activations = inflight[rank] + working[rank]
        gathered = 0.0
        if cfg.zero_stage == 3:  # the running unit and the prefetched next one, unsharded
            gathered = 2 * max_param_bytes[rank]
            if zero3_max_live_params is not None:
                gathered = min(gathered, zero3_max_live_params * bytes_per_param[rank])
        mem = {"states": states, "activations": activations, "zero3_buffers": gathered,
               "comm_buffers": float(COMM_BUFFER_BYTES), "cuda_context": CUDA_CONTEXT_BYTES}
        mem["allocator_reserve"] = ALLOCATOR_RESERVE_FRACTION * (states + activations + gathered)
        mem["_params"] = dense[rank] + expert[rank]
        mem["_weights"], mem["_grads"], mem["_optimizer"] = split  # the parts of "states"
        out.append(mem)
    return out
