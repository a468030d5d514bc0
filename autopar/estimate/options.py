"""`EstimateOptions`: what the estimate assumes of the training software (kernels, overlap,
precision recipes, checkpointing, pipeline cuts), one documented field each; the named presets
of the engines people run are `autopar.estimate.software.SOFTWARE`."""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["EstimateOptions"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EstimateOptions:
    """Properties of the training software, not of the model or the hardware. A field with
    named choices refuses any other value."""

    attention_kernel: Literal["flash", "cudnn", "flash3", "triton", "math"] = "flash"
    """The attention kernel; "math" keeps the score matrix (unfused SDPA)."""
    overlap_dp_comm: bool = True
    """The data-parallel gradient reduction hides behind backward compute and the parameter
    all-gathers (ZeRO >= 1) behind forward compute, up to their length; False: all exposed."""
    overlap_tp_comm: bool = False
    """tp collectives overlap their GEMMs (Megatron --tp-comm-overlap, TE userbuffers)."""
    kernels: Literal["eager", "fused"] = "eager"
    """"eager": one kernel per op and GEMMs over the model's own sizes, as PyTorch eager and
    autopar's generated code run; "fused": fused-kernel software (Megatron-LM, Transformer
    Engine, torch.compile) fuses norms, activations, bias, dropout and residual adds with their
    neighbours and pads GEMM widths to aligned sizes (Megatron's vocabulary padding, inductor's
    pad_mm)."""
    loss_kernel: Literal["eager", "megatron", "fused"] = "eager"
    """Cross-entropy: "eager" upcasts the logits to fp32 (autopar's runtime, Hugging Face);
    "megatron" is Megatron-LM's unfused vocab-parallel loss on fp32 logits (memory as "eager",
    more passes); "fused" is a fused kernel (flash-attn's CrossEntropyLoss, llm-foundry's
    default; torch.compile). Time: costmodels.compute.loss_traffic_bytes."""
    grad_reduce_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """The dtype gradients are reduced in over the data-parallel ranks (fp32 runs: fp32)."""
    zero3_max_live_params: int | None = None
    """ZeRO-3 gathered-parameter buffers: None = FSDP2 per-block units (the running block and
    the prefetched next one); a number caps them at that many parameters (DeepSpeed's
    stage3_max_live_parameters, default 1e9)."""
    zero3_gather: Literal["prefetch", "sync"] = "prefetch"
    """ZeRO-3 parameter gathers: "prefetch" = one all-gather per block, the next block's
    prefetched under the running one's compute (FSDP2, DeepSpeed >= 0.5); "sync" = one
    all-gather per parameter tensor, waited for and copied out, in every forward, recompute and
    backward pass (DeepSpeed before 0.5, 2021: see
    costmodels.collectives.ZERO3_SYNC_GATHER_BYTES_PER_S)."""
    zero3_max_reuse_distance: int = 10**9
    """With zero3_gather="sync": a gathered tensor whose next use in the micro-batch's forward
    and backward comes after fewer than this many parameter elements of other uses is kept, not
    released and gathered again (DeepSpeed's stage3_max_reuse_distance, default 1e9; with full
    recompute it keeps a block's last tensors from its recompute to its backward)."""
    fp8_recipe: Literal["delayed", "tensorwise", "rowwise"] = "tensorwise"
    """How fp8 training scales the operands of its fp8 GEMMs (dtype "fp8" only): "delayed"
    (Transformer Engine's amax history), "tensorwise" (dynamic per-tensor scales: torchao's
    default, TE's current scaling) or "rowwise" (torchao's per-row scales). Costed by
    costmodels.compute.fp8_cast_time_s."""
    fp32_params: bool = False
    """The 16-bit forward runs on fp32 parameters (autopar's runtime, torchtitan): without
    ZeRO under autocast, which casts each GEMM's weight per micro-batch and keeps the copy for
    that GEMM's backward (2 bytes per GEMM weight element of each layer not checkpointed, per
    micro-batch in flight); under FSDP2, whose param_dtype gathers them in 16 bits. Their
    gradients and AdamW moments are fp32 too: 4 + 4 + 8 bytes a parameter
    (`costmodels.memory.state_bytes_split`). False: 16-bit weights and gradients with the fp32
    master copy in the optimizer (Megatron-LM, DeepSpeed)."""
    recompute_early_stop: bool = True
    """Full recompute re-runs a block only until every tensor its backward saved is back, not
    its last GEMM and residual add: torch.utils.checkpoint non-reentrant (torch >= 2.1, as
    autopar's runtime runs it; measured in tests/unit/test_trace.py). False: the whole block
    (Megatron's and DeepSpeed's checkpointing, reentrant torch checkpoint)."""
    fsdp2: bool = False
    """Data parallel with ZeRO runs as torch's FSDP2: ``fully_shard`` on each block and at the
    root (autopar's runtime, torchtitan), under a pipeline inside torch.distributed.pipelining's
    stages. Without a pipeline FSDP2 reshards the parameters after every backward, so each
    micro-batch's forward gathers every unit again, and ZeRO-2 reduce-scatters each
    micro-batch's gradients (ZeRO-1 only the last's). Under a pipeline a stage keeps its
    parameters gathered (ZeRO-3 without reshard-after-forward, torchtitan's default there) and
    its gradients whole and unreduced from the first micro-batch to its last backward: one
    all-gather and one reduce-scatter per unit a step, and at its peak a rank holds what ZeRO-1
    holds, whatever the stage. False: the whole rank's parameters gathered and gradients
    reduce-scattered once a step (Megatron's distributed optimizer), ZeRO-3 per unit and
    micro-batch. `autopar.estimate.data_parallel.dp_comm`, `memory.held_zero_stage`."""
    cp_rotate: Literal["p2p", "ring", "all_gather"] = "p2p"
    """How context-parallel attention moves K/V and their gradients between the cp ranks
    (`autopar.estimate.timing.cp_collectives`): "p2p", each K/V chunk passed rank to rank
    cp-1 times a forward and, with its dK/dV in the same buffer and dtype, a backward
    (Transformer Engine's AttnFuncWithCPAndKVP2P, Megatron-Core); "ring", K/V passed cp-1
    times a pass and fp32 dK/dV accumulators cp times, one step behind (autopar's runtime,
    autopar.runtime.context_parallel); "all_gather", K/V all-gathered once a pass and the fp32
    dK/dV rotated cp times (PyTorch's context_parallel with its default rotate method
    "allgather" and convert_to_f32, as torchtitan runs it). Each transfer hides behind the
    attention blocks that can run before it is needed."""
    pipeline_balance: Literal["layers", "gemm_weights"] = "layers"
    """How the engine cuts the layers into pipeline stages when no cut is given: "layers",
    equal numbers of blocks, the embedding with the first and the head with the last
    (Megatron-LM; `autopar.estimate.stages`); "gemm_weights", contiguous layers balanced by
    their GEMM weights, the head included (nanotron, `stages.weight_balanced_boundaries`).
    A plan carries its own cut."""

    def __post_init__(self) -> None:
        for name, allowed in _choices().items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"EstimateOptions.{name}={value!r} is not one of "
                                 f"{', '.join(map(repr, allowed))}")


@functools.cache
def _choices() -> dict[str, tuple[Any, ...]]:
    """{field: its allowed values} for the EstimateOptions fields typed as a Literal."""
    hints = typing.get_type_hints(EstimateOptions)
    return {name: typing.get_args(hint) for name, hint in hints.items()
            if typing.get_origin(hint) is Literal}
