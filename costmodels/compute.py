"""Compute time of one op on one device: a roofline with achievable efficiencies.

    t = max(flops / (peak[dtype] · gemm_efficiency[dtype] · size_efficiency(flops) · kernel_eff),
            bytes / (memory_bandwidth · memory_efficiency))

- GEMMs (and convolutions) reach the profile's measured large-GEMM efficiency, less for small
  GEMMs: `size_efficiency(F) = F / (F + F_half)`, F_half the profile's
  `gemm_half_efficiency_gflop` or else `GEMM_HALF_EFFICIENCY_FLOPS` (an H100 figure).
- Every launched op also costs the profile's `op_overhead_us` (else `KERNEL_GAP_S`).
- A fused attention kernel (FlashAttention-2, cuDNN, FlashAttention-3, FlashAttention-1 in
  Triton) runs at a measured or published fraction of dense peak that depends on the kernel
  and the architecture (`FUSED_ATTENTION_PEAK_FRACTION`), less on short keys/values
  (`ATTENTION_SEQ_HALF`, forward and backward apart), and skips the masked half of a causal
  score matrix; an unfused ("math") kernel runs two batched GEMMs and moves the score matrix
  through memory `MATH_ATTENTION_SCORE_PASSES` times.
- Everything else (norms, elementwise, softmax, embedding lookups) is bound by memory
  bandwidth, at `MEMORY_OP_TRAFFIC_FACTOR` times its minimum traffic (what eager PyTorch moves);
  a cross-entropy loss at the bytes per logit its software's kernels move (`loss_traffic_bytes`).
- The optimizer step moves `OPTIMIZER_PASS_BYTES` per parameter (AdamW, the clipping norm, the
  master-to-model weight copy) at `OPTIMIZER_BANDWIDTH_FRACTION` of the memory bandwidth.
The constants are named here with their sources; the published-runs benchmark checks them.
No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodels.hardware import DeviceSpec

__all__ = [
    "GEMM_HALF_EFFICIENCY_FLOPS", "FUSED_ATTENTION_PEAK_FRACTION", "ATTENTION_KERNELS",
    "MATH_ATTENTION_SCORE_PASSES", "MATH_ATTENTION_DROPOUT_PASSES",
    "KERNEL_GAP_S", "OPTIMIZER_PASS_BYTES", "OPTIMIZER_BANDWIDTH_FRACTION",
    "optimizer_bytes_per_param", "SUSTAINED_COMPUTE_FRACTION", "sustained_fraction",
    "op_overhead_s", "peak_flops", "gemm_time_s", "memory_time_s", "AttentionCall",
    "attention_time_s", "optimizer_time_s",
    "fused_attention_fraction", "ATTENTION_SEQ_HALF", "ATTENTION_CALL_FLOOR_S", "MEMORY_OP_TRAFFIC_FACTOR", "KERNEL_STYLES",
    "UNALIGNED_GEMM_FRACTION", "unaligned_gemm_slowdown", "activation_memory_time_s",
    "LOSS_KERNELS", "loss_traffic_bytes", "loss_time_s",
    "FP8_RECIPES", "FP8_CAST_BYTES", "FP8_CAST_TRAFFIC_FACTOR", "fp8_cast_time_s",
    "SCATTER_ADD_TRAFFIC_FACTOR",
]

# Size at which a GEMM reaches half the large-GEMM efficiency. From H100 SXM torch.matmul bf16:
# 4096^3 (137 GFLOP) runs at 788.7 and 8192^3 (1.1 TFLOP) at 797.5 TFLOP/s (zzc0721/torch-
# performance-test-data#79); F/(F+F_half) matches that 0.989 ratio with F_half = 1.7 GFLOP.
GEMM_HALF_EFFICIENCY_FLOPS = 1.7e9

ATTENTION_KERNELS = ("flash", "cudnn", "flash3", "triton", "math")

# Fraction of dense 16-bit peak a fused attention kernel reaches on long sequences (causal
# work, head dim 128); shorter sequences reach less, see ATTENTION_SEQ_HALF. Hopper flash and
# cuDNN: measured through torch 2.11 SDPA on an H100 SXM (tests/data/h100_measurements.json,
# 2026-11-22; least-squares fit of f·s/(s + s_half) to s = 1k-8k, forward and backward agree
# on f within 3%). FlashAttention-3: Shah et al. 2024, forward, head dim 128, H100, causal,
# 521-579 TFLOP/s of 989 (no backward figure; the cuDNN curves are assumed). Ampere: Dao 2023
# (FlashAttention-2) reaches 50-73% of A100 peak; 0.63 is that range's middle. Triton: the
# FlashAttention-1 algorithm in Tri Dao's Triton kernel (flash-attention's flash_attn/
# flash_attn_triton.py, which llm-foundry's 2023 attn_impl "triton" copies); its docstring
# finds its forward + backward slightly slower than the FlashAttention-1 CUDA kernel, which
# Dao 2023 (FlashAttention-2, abstract) puts at 25-40% of A100 peak. 0.40, the top of that
# range, as the long-key plateau: no sequence curve is known for this kernel (no
# ATTENTION_SEQ_HALF entry), so shorter keys get the plateau too. Cross-check on the held-out
# rows with 32k-64k keys (benchmarks/data/llm_foundry_a100_heldout.csv, 760m-13b): the six with
# activation checkpointing -3.0% to +5.2% at 0.40, +15% to +18% at the range's middle (0.325);
# the two without, -9% at 0.40 and +7% at 0.325. Other architectures scale a kernel's Ampere
# figure by their GEMM efficiency (an assumption until measured).
FUSED_ATTENTION_PEAK_FRACTION = {
    ("flash", "ampere"): 0.63,
    ("triton", "ampere"): 0.40,
    ("flash", "hopper"): 0.29,
    ("cudnn", "hopper"): 0.59,
    ("flash3", "hopper"): 0.56,
}

# A fused attention call takes at least this long however little it computes: its kernels'
# launch and prologue, and the host's dispatch of the call when the device outruns it (ring
# attention under context parallelism makes several calls per layer on short chunks). Forward:
# measured on an H200 (tests/data/h200_kernels.json, "cp_attention", 2026-11-26: flash
# attention through SDPA, head dim 128, one sequence, the calls with the least work -- 8 heads
# on 256-1024 tokens and 32 heads on 256-512 -- took 30-51 us, median 47 us, where the plateau
# rate would take 1-11 us). Backward: twice that (an assumption: flash's backward launches two
# kernels more, the dot(dO, O) pre-pass and the dQ conversion; the measured 0.2-0.5 ms of the
# smallest fwd+bwd less fwd include autograd's start of each backward call, which a ring's
# backward, calling the kernel inside one autograd node, does not pay per call).
ATTENTION_CALL_FLOOR_S = {"fwd": 47e-6, "bwd": 94e-6}

# Key/value length at which a fused kernel reaches half its long-sequence fraction, forward and
# backward (the backward pipelines five GEMMs per tile and needs longer rows to fill the
# machine). Fitted with FUSED_ATTENTION_PEAK_FRACTION on the same H100 measurements (largest
# deviation of the fit from a measured point: 3.2%; the backward timings less the q/k/v
# gradient accumulation the timing loop added, 9 passes of a q-sized tensor at 2.8 TB/s);
# flash3 uses cuDNN's (an assumption).
ATTENTION_SEQ_HALF = {
    ("flash", "fwd"): 480, ("flash", "bwd"): 980,
    ("cudnn", "fwd"): 840, ("cudnn", "bwd"): 1500,
    ("flash3", "fwd"): 840, ("flash3", "bwd"): 1500,
}

# Memory-bound work in an eager training step moves more than each op's minimum traffic (one
# read of every input, one write of every output): the q/k/v gradients are concatenated, heads
# are transposed into contiguous copies around attention, every biased GEMM reduces its output
# gradient for the bias gradient, norms reduce their parameter gradients in a second kernel,
# and many kernels run below copy bandwidth. Measured on an H100 SXM
# (tests/data/h100_measurements.json, 2026-11-22): in 10 bf16 training steps of GPT and Llama
# shapes (0.35-175B widths, 1k-8k tokens) the time of every kernel that is not a GEMM, attention,
# the optimizer or the cross-entropy (timed on its own, LOSS_KERNELS) is this many times the
# IR's memory-bound bytes at the profile's bandwidth (median 2.0; the steps range 1.4-2.8x,
# benchmarks/gpu_check.py prints them). Training software that fuses the memory-bound ops with
# their neighbours (Megatron-LM's fused bias-GELU, bias-dropout-add and scale-mask-softmax,
# Transformer Engine, torch.compile) moves less: the same steps with the forward and the loss
# under torch.compile (inductor's fused kernels, 8 recompute-free steps, same GPU and day) take
# 1.4x the IR's bytes (median; range 1.0-1.9x).
MEMORY_OP_TRAFFIC_FACTOR = {"eager": 2.0, "fused": 1.4}

# Cross-entropy over the vocabulary is memory-bound on logits far larger than any activation
# (8k tokens x 128k vocabulary = 1G logits), and how many times it moves them depends on the
# software, so its traffic is counted per kernel pass instead of scaled by the factor above.
# Bytes per logit (forward, backward) for logits of `e` bytes (2 in bf16/fp16):
#   "eager"    F.cross_entropy(logits.float()) (autopar's runtime, Hugging Face): the upcast
#              reads e and writes 4; log_softmax over a row too long for shared memory reads
#              it three times (max, sum of exp, output) and writes 4; backward: nll_loss fills
#              a zero fp32 gradient (4), log_softmax_backward reads gradient and output (three
#              reads) and writes 4, the downcast reads 4 and writes e.          22 / 26 at e=2
#   "megatron" Megatron-LM's vocab-parallel cross-entropy (2021 through Megatron-Core r0.8,
#              without --cross-entropy-loss-fusion): upcast (e+4), max (4), in-place subtract
#              (8), in-place exp (8), sum (4), in-place divide to the softmax it saves (8);
#              backward: the in-place multiply by the loss gradient (8), downcast (4+e). 38 / 14
#   "fused"    one fused kernel each way (torch.compile's online softmax, flash-attn's
#              CrossEntropyLoss): the forward reads the logits (two passes, as inductor's
#              kernel measured), the backward reads them and writes their gradient.  4 / 4
# On fp32 logits the casts are no-ops. Measured on an H100 SXM (tests/data/
# h100_measurements.json, llama3-8b-l4-s8192 step, 1.05G logits): the eager log_softmax
# forward and backward kernels take 14.9 and 15.3 B/logit at the profile's bandwidth (counted:
# 16, 16); inductor's fused forward and backward 3.8 and 4.1 (counted: 4, 4).
LOSS_KERNELS = ("eager", "megatron", "fused")
KERNEL_STYLES = tuple(MEMORY_OP_TRAFFIC_FACTOR)

# A GEMM with an operand whose rows are not a multiple of 16 bytes (GPT-2's 50,257-token
# vocabulary) cannot use the aligned tensor-core kernels; cuBLAS runs a slower fallback at this
# fraction of the aligned GEMM's throughput. Measured on an H100 SXM (tests/data/
# h100_measurements.json, "alignment", 2026-11-22): bf16, 2k-8k tokens x 1k-4k hidden x 50,257
# against 50,304 columns, median of 6 shapes; forward 0.13 (0.128-0.148), input and weight
# gradients 0.20 (0.177-0.228). Tensor-core dtypes on GPUs only: CPU BLAS has no such cliff,
# and fp32 GEMMs (CUDA cores, TF32 off) showed none: a generated script training GPT-2 medium
# (vocabulary 50,257) in fp32 on an H100 (2026-11-23, 8 x 1,024 tokens) stepped in 445 ms,
# under the 508 ms the model predicts at boost clocks with the head priced as aligned (747 ms
# with this penalty).
UNALIGNED_GEMM_FRACTION = {"fwd": 0.13, "bwd": 0.20}

# Passes of the b·a·s² score matrix through memory in an unfused attention, by software,
# causal mask and direction. "fused" (Megatron-LM's scaled GEMM and fused scale-mask-softmax):
# write the scores, read them and write the probabilities, read those for the PV GEMM (4
# forward); backward reads probabilities and their gradient and writes the score gradient
# twice over (6) -- kernel analysis, the mask applied inside the softmax. "eager" (a bf16
# matmul, a scale, a masked_fill for the causal mask, softmax, matmul; autograd backward):
# measured on an H100 (tests/data/h100_measurements.json, "unfused" attention, head dims
# 64/128, s = 1k-8k; the time left after the two GEMMs at their modelled speed, median of 8
# shapes each: 7.5 / 10.9 without a mask, 14.7 / 16.8 with it).
# Dropout on the attention probabilities (Megatron-LM's default --attention-dropout 0.1) is a
# kernel of its own in an unfused attention, each way: forward reads the probabilities, writes
# the dropped ones and a one-byte mask (half a pass of 16-bit elements); backward reads the
# gradient and the mask and writes the gradient. A fused kernel applies it in place.
MATH_ATTENTION_DROPOUT_PASSES = 2.5
MATH_ATTENTION_SCORE_PASSES = {
    ("fused", False, "fwd"): 4, ("fused", False, "bwd"): 6,
    ("fused", True, "fwd"): 4, ("fused", True, "bwd"): 6,
    ("eager", False, "fwd"): 7.5, ("eager", False, "bwd"): 10.9,
    ("eager", True, "fwd"): 14.7, ("eager", True, "bwd"): 16.8,
}

# Sustained fraction of microbenchmark throughput reached inside long training runs: the
# profiles' GEMM efficiencies are short max-achievable-matmul sweeps, while training keeps the
# GPU at its power limit for hours and runs at lower clocks (ml-engineering: H100's ~813
# TFLOP/s is reached "only with a cold GPU ... not sustainable"). Fitted per architecture by
# benchmarks/fit_sustained_fraction.py on every row of benchmarks/data/published_runs_
# calibration.csv of that architecture except DeepSpeed-2021 ZeRO-3's (their steps are
# DeepSpeed's parameter gathers, not compute): grid 0.60-1.00 in steps of 0.01, least median
# |error|. A100: 23 rows (SC21 Tables 1-2, MosaicML), and each group fitted on the others alone
# lands within 0.82-0.83. H100: 18 rows (Megatron-LM README, MosaicML); the sources disagree --
# the MosaicML rows fitted on the Megatron-LM ones alone would take 0.66, the Megatron-LM weak-
# scaling rows on the others 0.73 -- so the joint value carries a ~10% uncertainty on H100.
# Architectures without a fit use the mean of the fitted values (an assumption). The fit has
# the cross-entropy timed by its software's kernel passes (LOSS_KERNELS), the eager memory-bound
# factor measured without it, the memory-bound ops on tensor-parallel-split features split
# over tp without sequence parallel too (`OpCost.tp_sharded`), and the SC21 Table 1 rows at NVIDIA's reproduction script's
# micro-batches (with attention dropout); a short single-GPU step runs its GEMMs at the full
# measured efficiency (benchmarks/gpu_check.py divides this out).
SUSTAINED_COMPUTE_FRACTION = {"ampere": 0.83, "hopper": 0.70}


def sustained_fraction(arch: str) -> float:
    if arch == "cpu":
        return 1.0  # cpu-gloo peaks are themselves sustained measurements
    fitted = SUSTAINED_COMPUTE_FRACTION
    return fitted.get(arch, sum(fitted.values()) / len(fitted))


# Idle time between two dependent kernels on the GPU (launch latency not hidden by the queue):
# ~2 us per kernel, the order of CUDA kernel launch latency on H100/A100 measured by NVIDIA's
# Nsight guidance ("launch overhead of a few microseconds").
KERNEL_GAP_S = 2e-6

# Host time selective activation checkpointing (torch.utils.checkpoint with a policy: autopar's
# and torchtitan's per-op mode) adds per op an eager block dispatches: each op passes through
# the policy's Python dispatch mode in forward and is replayed through it in the recompute.
# Measured by benchmarks/gpu_scripts.py's sac_dispatch on an H200 host (torch 2.11.0+cu130,
# 2026-11-26): 17.7, 19.1 and 23.0 us per op over chains of 200, 400 and 800 launch-bound ops
# trained forward and backward, beside 19-21.5 us per op without checkpointing.
SAC_DISPATCH_S = 19.1e-6
# aten ops an eager GEMM of a parameter weight dispatches besides its traced node, by how it
# runs (counted with a TorchDispatchMode, torch 2.13, a 3-D input): fp32 a transpose and two
# views; under autocast also the casts of input and weight; an fp8 GEMM of
# autopar.runtime.fp8 10 ops per operand cast (absolute value, max, clamp, scale, multiply,
# saturate, cast, reciprocals), the transpose, the views and the scaled GEMM
EAGER_GEMM_EXTRA_OPS = {"fp32": 3, "bf16": 5, "fp8": 23}

# The optimizer step's passes over each parameter (fp32 master weights, gradients and Adam
# moments), as Megatron-LM, torchtitan and llm-foundry run them by default:
# - "adam": the AdamW update reads master, gradient, m and v (16 B), writes master, m, v (12 B);
# - "grad_norm": gradient clipping's global norm reads every gradient once. Its scaling pass
#   (8 B more) is not counted: Megatron-LM runs it only when the norm exceeds the threshold
#   (PyTorch's clip_grad_norm_, torchtitan's, runs it every step);
# - "master_copy": with 16- or 8-bit weights, the master weights are copied into the model's
#   (4 B read, 2 B written); fp32 training updates the model's weights in place.
OPTIMIZER_PASS_BYTES = {"adam": 28.0, "grad_norm": 4.0, "master_copy": 6.0}
# Bandwidth those multi-tensor passes reach, as a fraction of the profile's (memory bandwidth x
# memory efficiency). Measured on an H100 (tests/data/h100_measurements.json, "optimizer",
# 2026-11-23): fused AdamW, the master copy and the gradient norm over the parameters of 1, 4
# and 8 Llama-3-8B layers (0.2-1.7 B) reach 2.26-2.63 TB/s, median 2.52 = 0.89 of 3.35 x 0.84
# TB/s; PyTorch's foreach and for-loop AdamW reach 0.9-1.0 TB/s (more passes). GPU
# architectures only: CPU profiles' bandwidths are their own measurements.
OPTIMIZER_BANDWIDTH_FRACTION = 0.89


# FP8 training (Transformer Engine's fp8 autocast, torchao's float8 Linear) runs the GEMMs of
# the model's Linear layers in float8 -- e4m3 inputs and weights, e5m2 (or e4m3) output
# gradients, bf16 results -- and everything else in bf16: attention, norms, elementwise ops, the
# loss, the vocabulary projection (excluded by Megatron-Core and by torchtitan's float8
# converter), and every tensor handed between ops. Each fp8 GEMM first quantises its operands:
# a memory-bound pass over each bf16 tensor per micro-batch. Bytes moved per element of each
# operand by scaling recipe, (forward input, forward weight, backward input, backward weight,
# backward output gradient):
# - "delayed" (Transformer Engine's DelayedScaling, Megatron-Core's --fp8-recipe delayed): the
#   scale comes from earlier steps' amax history, so one fused cast-transpose kernel reads the
#   bf16 tensor (2 B) and writes it in fp8 and transposed in fp8 for the other GEMM (2 x 1 B);
#   backward reuses the saved transposes;
# - "tensorwise" (dynamic current scaling: torchao's default, TE's Float8CurrentScaling): an
#   amax reduction pass (2 B read) before the cast-transpose (4 B);
# - "rowwise" (torchao's rowwise, per-row scales): the amax of a row fuses into its cast (3 B),
#   and backward quantises the saved bf16 input and the weight again along the other axis (3 B
#   each) and the output gradient along both (6 B).
FP8_RECIPES = ("delayed", "tensorwise", "rowwise")
FP8_CAST_BYTES = {"delayed": (4.0, 4.0, 0.0, 0.0, 4.0),
                  "tensorwise": (6.0, 6.0, 0.0, 0.0, 6.0),
                  "rowwise": (3.0, 3.0, 3.0, 3.0, 6.0)}
# Time those passes take over the time their bytes take at the memory bandwidth. "eager"
# (PyTorch ops one by one: abs, amax, scale, clamp, cast -- each its own pass) is measured on an
# H200 (tests/data/h200_kernels.json, "fp8_cast", 2026-11-26: dynamic per-tensor e4m3 casts of
# 8192x4096, 16384x8192 and 8192x14336 bf16 tensors, with and without the transposed copy,
# against a bf16 copy of the same tensor): 8.6-9.7x, median 9.1. A cast compiled alone
# (torch.compile: a split amax reduction, then one cast kernel) took 1.5-3.5x, but in fused-
# kernel software the casts fuse into the ops producing their operands (the norm before a
# projection, the activation before the down projection, the elementwise backward before a
# gradient's cast; Transformer Engine's LayerNormLinear likewise): "fused" is from the same
# file's "fp8_step" (four Llama-3-8B-wide blocks, 8192 tokens, forward and backward under
# torch.compile: bf16 73.6 ms, fp8 55.5 ms): the fp8 step less the bf16 step scaled by this
# model's fp8/bf16 ratio without casts (0.702), over the casts' time per unit of the factor
# (5.3 ms), is 0.72. The eager steps of that file (77.4 and 100.7 ms) check the "eager" factor:
# this model gives their ratio as 1.27, measured 1.30.
FP8_CAST_TRAFFIC_FACTOR = {"eager": 9.1, "fused": 0.72}


# An eager MoE layer combines its experts' outputs by adding each routed row into its token's
# row by index (index_add_ / scatter_add: atomic adds, several rows onto one token under top-k
# routing), far below the memory bandwidth. Time over the IR's bytes (routed rows read, token
# rows written) at the profile's bandwidth, measured on an H200 (tests/data/h200_kernels.json,
# "moe", 2026-11-26, index_add_ of bf16 rows): top-2 over 16,384 tokens of 4,096 (32,768 rows)
# 12.2x, top-8 over 16,384 of 7,168 (131,072 rows) 15.2x; 13.6 is their geometric mean,
# within 12% of both. Fused-kernel software (Megatron-Core's and Transformer Engine's unpermute) gathers the
# rows and sums them per token instead, at the fused memory-bound rate.
SCATTER_ADD_TRAFFIC_FACTOR = 13.6


def fp8_cast_time_s(device: DeviceSpec, recipe: str, kernels: str, *, inputs: float,
                    weights: float, outputs: float) -> tuple[float, float]:
    """(forward, backward) seconds quantising the operands of one fp8 GEMM over `inputs`,
    `weights` and `outputs` elements (its activation input, weight and output) per micro-batch
    (FP8_CAST_BYTES, FP8_CAST_TRAFFIC_FACTOR)."""
    if recipe not in FP8_CAST_BYTES:
        raise ValueError(f"fp8_recipe={recipe!r} is not known; use one of {', '.join(FP8_RECIPES)}")
    if kernels not in FP8_CAST_TRAFFIC_FACTOR:
        raise ValueError(f"kernels={kernels!r} is not known; use one of "
                         f"{', '.join(FP8_CAST_TRAFFIC_FACTOR)}")
    f_in, f_w, b_in, b_w, b_out = FP8_CAST_BYTES[recipe]
    factor = FP8_CAST_TRAFFIC_FACTOR[kernels]
    return (memory_time_s(device, factor * (f_in * inputs + f_w * weights)),
            memory_time_s(device, factor * (b_in * inputs + b_w * weights + b_out * outputs)))


def peak_flops(device: DeviceSpec, dtype: str) -> float:
    """Dense peak FLOP/s x achievable GEMM efficiency x sustained fraction for `dtype`."""
    if dtype not in device.peak_flops:
        have = ", ".join(device.peak_flops)
        raise ValueError(f"{device.model} has no {dtype} compute (profile lists {have}); pick "
                         f"one of those dtypes")
    return device.peak_flops[dtype] * device.gemm_efficiency[dtype] * sustained_fraction(device.arch)


def memory_time_s(device: DeviceSpec, num_bytes: float) -> float:
    return num_bytes / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)


def loss_traffic_bytes(loss_kernel: str, logit_bytes: float) -> tuple[float, float]:
    """(forward, backward) bytes moved per logit by a cross-entropy of `loss_kernel` software
    on logits of `logit_bytes` bytes each (the LOSS_KERNELS comment counts the passes)."""
    cast = 0.0 if logit_bytes >= 4 else logit_bytes + 4  # fp32 upcast, and the downcast back
    if loss_kernel == "eager":
        return cast + 16, 20 + cast
    if loss_kernel == "megatron":
        return cast + 32, 8 + cast
    if loss_kernel == "fused":
        return 2 * logit_bytes, 2 * logit_bytes
    raise ValueError(f"loss_kernel={loss_kernel!r} is not known; use one of "
                     f"{', '.join(LOSS_KERNELS)}")


def loss_time_s(device: DeviceSpec, logits: float, logit_bytes: float,
                loss_kernel: str) -> tuple[float, float]:
    """(forward, backward) seconds of a cross-entropy over `logits` elements."""
    fwd, bwd = loss_traffic_bytes(loss_kernel, logit_bytes)
    return memory_time_s(device, logits * fwd), memory_time_s(device, logits * bwd)


def activation_memory_time_s(device: DeviceSpec, num_bytes: float,
                             kernels: str = "eager") -> float:
    """A memory-bound op of the model (norm, elementwise, softmax, lookup; the cross-entropy
    is `loss_time_s`) whose minimum traffic is `num_bytes`, as eager or fused-kernel training
    software runs it (MEMORY_OP_TRAFFIC_FACTOR)."""
    factor = MEMORY_OP_TRAFFIC_FACTOR.get(kernels)
    if factor is None:
        raise ValueError(f"kernels={kernels!r} is not known; use one of "
                         f"{', '.join(KERNEL_STYLES)}")
    return memory_time_s(device, num_bytes * factor)


def gemm_time_s(device: DeviceSpec, dtype: str, flops: float, num_bytes: float) -> float:
    if flops <= 0:
        return memory_time_s(device, num_bytes)
    half = device.gemm_half_efficiency_flops or GEMM_HALF_EFFICIENCY_FLOPS
    if dtype == "fp8" and "bf16" in device.peak_flops:  # the same small-GEMM time floor: at a
        half *= peak_flops(device, "fp8") / peak_flops(device, "bf16")  # higher rate, more FLOPs
    rate = peak_flops(device, dtype) * flops / (flops + half)
    return max(flops / rate, memory_time_s(device, num_bytes))


def unaligned_gemm_slowdown(device: DeviceSpec, dtype: str, *, backward: bool) -> float:
    """How many times longer a GEMM over unaligned rows takes than an aligned one."""
    if device.arch == "cpu" or dtype == "fp32":
        return 1.0
    return 1.0 / UNALIGNED_GEMM_FRACTION["bwd" if backward else "fwd"]


def op_overhead_s(device: DeviceSpec) -> float:
    """Time one launched op costs besides its work on this device (profile field
    ``op_overhead_us``; default ``KERNEL_GAP_S``, a GPU figure)."""
    return KERNEL_GAP_S if device.op_overhead_s is None else device.op_overhead_s


def fused_attention_fraction(device: DeviceSpec, kernel: str) -> float:
    """Fraction of dense peak a fused attention kernel reaches on this device."""
    if kernel not in ATTENTION_KERNELS or kernel == "math":
        raise ValueError(f"attention kernel {kernel!r} is not a fused kernel; fused kernels: "
                         f"{', '.join(k for k in ATTENTION_KERNELS if k != 'math')}")
    known = FUSED_ATTENTION_PEAK_FRACTION.get((kernel, device.arch))
    if known is not None:
        return known
    ampere = FUSED_ATTENTION_PEAK_FRACTION.get((kernel, "ampere"),
                                               FUSED_ATTENTION_PEAK_FRACTION[("flash", "ampere")])
    return ampere * device.gemm_efficiency.get("bf16", 0.8) / 0.869  # A100 bf16 MAMF fraction


@dataclass(frozen=True, slots=True)
class AttentionCall:
    """One attention op's work in one direction on one rank (`attention_time_s`)."""

    flops: float  # the full (non-causal) score matrix's, as the IR counts them
    io_bytes: float = 0.0  # q, k, v and the output
    score_bytes: float = 0.0  # the b·a·s_q·s_kv matrix in the compute dtype
    causal: bool = False
    seq_kv: float = 0.0  # the key/value length one kernel call sees (0: at the plateau)
    dropout: bool = False  # on the probabilities: its own kernel unless attention is fused
    # the fused kernel calls the work is split over (a context-parallel ring's blocks), each
    # taking at least ATTENTION_CALL_FLOOR_S
    calls: int = 1


def attention_time_s(device: DeviceSpec, dtype: str, call: AttentionCall, *, kernel: str,
                     backward: bool, kernels: str = "eager") -> float:
    """Seconds of one attention ``call`` by a fused ``kernel`` (FUSED_ATTENTION_PEAK_FRACTION)
    or unfused ("math": two GEMMs and the score matrix's passes by ``kernels`` software)."""
    direction = "bwd" if backward else "fwd"
    if kernel != "math":
        frac = fused_attention_fraction(device, kernel)
        half = ATTENTION_SEQ_HALF.get((kernel, direction), 0)
        if call.seq_kv > 0 and half:
            frac *= call.seq_kv / (call.seq_kv + half)
        rate = device.peak_flops[dtype if dtype in device.peak_flops else "bf16"] \
            * frac * sustained_fraction(device.arch)
        floor = ATTENTION_CALL_FLOOR_S[direction] if device.arch != "cpu" else 0.0
        work = call.flops * (0.5 if call.causal else 1.0)
        return max(work / rate, memory_time_s(device, call.io_bytes), call.calls * floor)
    passes = MATH_ATTENTION_SCORE_PASSES[(kernels, call.causal, direction)]
    if call.dropout:
        passes += MATH_ATTENTION_DROPOUT_PASSES
    return gemm_time_s(device, dtype, call.flops, call.io_bytes) \
        + memory_time_s(device, passes * call.score_bytes)


def optimizer_bytes_per_param(dtype: str, *, grad_clip: bool = True) -> float:
    """Bytes the optimizer step moves per parameter (`OPTIMIZER_PASS_BYTES`) when training
    in `dtype`, with or without gradient clipping's norm."""
    passes = OPTIMIZER_PASS_BYTES
    return (passes["adam"] + (passes["grad_norm"] if grad_clip else 0.0)
            + (0.0 if dtype == "fp32" else passes["master_copy"]))


def optimizer_time_s(device: DeviceSpec, num_params: float, dtype: str, *,
                     grad_clip: bool = True) -> float:
    """One optimizer step over `num_params` parameters: its passes' bytes at the bandwidth
    multi-tensor kernels reach (`OPTIMIZER_BANDWIDTH_FRACTION` on GPUs)."""
    fraction = 1.0 if device.arch == "cpu" else OPTIMIZER_BANDWIDTH_FRACTION
    moved = num_params * optimizer_bytes_per_param(dtype, grad_clip=grad_clip)
    return memory_time_s(device, moved) / fraction
