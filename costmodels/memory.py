"""Memory per rank: model states by ZeRO stage, and the fixed costs of a training process.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, §3.1): mixed-precision Adam keeps
the weights and gradients in the training dtype (2 B each in bf16/fp16) plus an fp32 master copy
and two fp32 moments (K = 12 B); fp32 training keeps 4 B weights, 4 B gradients and 8 B of
moments. ZeRO-1 shards the optimizer states over the data-parallel ranks, ZeRO-2 also the
gradients, ZeRO-3 also the weights. fp8 training keeps bf16 weights (Transformer Engine keeps
the high-precision copy and casts per GEMM). Activations are counted by the estimate from the
traced graph; the constants below are what every process pays besides.
No torch import.
"""

from __future__ import annotations

__all__ = ["DTYPE_BYTES", "state_bytes_per_param", "state_bytes_split", "CUDA_CONTEXT_BYTES",
           "COMM_BUFFER_BYTES", "ALLOCATOR_RESERVE_FRACTION", "RANK_FIXED_BYTES", "reserved_bytes",
           "live_bytes_budget", "weight_bytes", "LOSS_KEPT_BYTES_PER_LOGIT",
           "LOSS_BACKWARD_PEAK_BYTES_PER_LOGIT"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

# CUDA context, cuBLAS/cuDNN workspaces and kernels loaded by one training process. Assumption:
# ~1 GB is what torch.cuda.mem_get_info shows taken before the first allocation on A100/H100
# processes with NCCL initialised; measure on your system and override through a profile later.
CUDA_CONTEXT_BYTES = 1.0e9

# Communication buffers: PyTorch DDP's two 25 MiB gradient buckets (bucket_cap_mb default) and
# NCCL's per-communicator buffers (4 MiB Simple buffer per channel and peer, NCCL
# DEFAULT_BUFFSIZE; ~64 MiB for a communicator on 16 channels), for ~4 communicators.
COMM_BUFFER_BYTES = 2 * 25 * 2**20 + 4 * 64 * 2**20

# The caching allocator keeps freed blocks and splits large ones, so reserved memory exceeds
# the live tensors. Assumption: 5% of live bytes, the low end of the reserved/allocated ratio
# seen in large-model training logs; a measured value will replace it (issue calibration).
ALLOCATOR_RESERVE_FRACTION = 0.05



def weight_bytes(dtype: str) -> int:
    """Bytes of one weight or gradient element in a run at precision `dtype`: FP8 runs keep
    bf16 weights and gradients (the GEMMs cast their inputs to FP8)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPE_BYTES)}")
    return 2 if dtype == "fp8" else DTYPE_BYTES[dtype]


# What a rank holds whatever its plan: the CUDA context and the communication buffers.
RANK_FIXED_BYTES = CUDA_CONTEXT_BYTES + COMM_BUFFER_BYTES


def reserved_bytes(live):
    """Device memory a rank takes to hold `live` bytes of tensors (a float or a numpy array):
    the caching allocator's reserve over them, the communication buffers and the CUDA
    context. The one formula of a rank's peak; `live_bytes_budget` is its inverse."""
    return live * (1 + ALLOCATOR_RESERVE_FRACTION) + COMM_BUFFER_BYTES + CUDA_CONTEXT_BYTES


def live_bytes_budget(device_bytes: float) -> float:
    """The most live tensor bytes a rank of `device_bytes` holds: `reserved_bytes`' inverse."""
    return (device_bytes - RANK_FIXED_BYTES) / (1 + ALLOCATOR_RESERVE_FRACTION)

# Cross-entropy over the logits as autopar's runtime computes it (log-probabilities in fp32:
# runtime.lm_loss upcasts the logits; Hugging Face causal LMs do the same): the forward keeps 4
# bytes per logit for the backward, and the backward's peak holds 12 bytes per logit beyond the
# low-precision logits (the kept log-probabilities and two fp32 gradient buffers). Measured on
# an H100 with torch 2.11 (tests/data/h100_measurements.json, "loss": 2k-8k tokens x 32k-128k
# classes, every case exact to 0.03 bytes).
LOSS_KEPT_BYTES_PER_LOGIT = 4
LOSS_BACKWARD_PEAK_BYTES_PER_LOGIT = 12


def state_bytes_split(dtype: str, zero_stage: int, shards: int,
                      fp32_params: bool = False) -> tuple[float, float, float]:
    """Bytes of (weights, gradients, optimizer states) per parameter on one rank; the optimizer
    states include the fp32 master copy of mixed-precision training.

    `fp32_params`: a 16-bit run keeps fp32 parameters, gradients and moments (autocast, or
    FSDP2 gathering 16-bit copies: PyTorch's mixed precision) instead of 16-bit weights and
    gradients with an fp32 master copy (Megatron-LM, DeepSpeed): without ZeRO 4 + 4 + 8 bytes;
    under ZeRO-1/2 as FSDP2 runs them, the 16-bit weights gathered from forward to backward
    (2), the fp32 shard as the master copy with the moments (12 / shards) and the gradients
    (4 / shards); under ZeRO-3 every state sharded (4 + 4 + 8) / shards."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPE_BYTES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if dtype == "fp32":
        weights, grads, optim = 4.0, 4.0, 8.0
    elif fp32_params:
        if zero_stage == 0:
            return 4.0, 4.0, 8.0
        if zero_stage == 3:
            return 4.0 / shards, 4.0 / shards, 8.0 / shards
        return 2.0, 4.0 / shards, 12.0 / shards
    else:
        weights = grads = 2.0
        optim = 12.0
    return (weights / shards if zero_stage >= 3 else weights,
            grads / shards if zero_stage >= 2 else grads,
            optim / shards if zero_stage >= 1 else optim)


def state_bytes_per_param(dtype: str, zero_stage: int, shards: int,
                          fp32_params: bool = False) -> float:
    """Bytes of weights, gradients and Adam states per parameter on one rank."""
    return sum(state_bytes_split(dtype, zero_stage, shards, fp32_params))
