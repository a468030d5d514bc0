"""Published large-run throughputs as runnable `autopar.estimate` setups, and the accuracy table.

This module owns the calibration set: it reads ``benchmarks/data/published_runs_calibration.csv``
(47 rows: Megatron-LM SC21 Tables 1-2, the Megatron-LM README H100 tables, MosaicML's MPT
benchmarks), turns every row into a `PublishedRun` (a GPT built on the meta device, a cluster,
a `ParallelConfig`, the global batch, sequence length and dtype) and converts the row's metric
into the **published step time in seconds**, the number `autopar.estimate` must reproduce.

Metric -> step time (definitions from the sources; benchmarks/data/README.md sums them up):

- SC21 ``tflops_per_gpu`` X (Table 1 and both halves of Table 2): the iteration FLOPs are eq. (3)
  of Narayanan et al., SC21 §5.1, F = 96·B·s·l·h²·(1 + s/6h + V/16lh), which counts the
  recompute forward pass; step = F / (n·X). Table 2's ZeRO-3 rows use the same count: the
  paper's "training time for 300B tokens" column equals (300e9 / (B·s)) · step with this F
  (tested), while the 8TP/nX shortcut of eq. (4) would be 2-3 % off.
- Megatron README H100 ``tflops_per_gpu``: Megatron-LM logs ``num_floating_point_operations``
  (megatron/training/training.py). Its 2024 form (Megatron-Core r0.8 era, when the table was
  made) is 12·B·s·l·h²·[(1 + g/a + s/h)·(q/h) + (f/h)·glu + V/(2lh)]: model FLOPs, no recompute,
  and the full s×s attention square (later versions halve that term for the causal mask).
  For MHA (g = a), q = h and a GELU MLP it is 6·B·s·[l·(4h² + 2h·f + 2s·h) + h·V], i.e.
  72·B·s·l·h²·(1 + s/6h + V/12lh) when f = 4h. step = F / (n·X).
- Megatron README ``mfu`` (strong-scaling endpoints, percent): X = mfu/100 · 989 TFLOP/s (the
  README's MFU is TFLOP/s / 989, e.g. 474.4/989 = 48 %), then as above.
- MosaicML ``tokens_per_sec_per_gpu`` T: step = global_batch · seq_len / (n · T).

Fields the sources leave unstated get one documented choice per group (never tuned per row);
`GROUP_ASSUMPTIONS` says what was chosen and why, and every run lists the ones it uses.

Held-out check: ``benchmarks/data/llm_foundry_a100_heldout.csv`` (`HELDOUT_CSV`) holds 38 more
rows in the same columns, never used for calibration: every A100 80GB, 8-GPU MPT 760m-30b row
of llm-foundry's benchmarking README (commit c90b9b31, the amp_bf16 version of the table) that
the calibration CSV does not already hold. They fall in the ``mpt-a100`` group and run with its
assumptions and SOFTWARE entry:

    python benchmarks/published_runs.py --csv benchmarks/data/llm_foundry_a100_heldout.csv

Validation set: ``benchmarks/data/published_runs_validation.csv`` (`VALIDATION_CSV`, 124 rows,
frozen, never used for fitting or tuning) holds published runs of newer kinds -- the HF
Ultra-Scale Playbook's nanotron heatmap (H100, dense bf16), the MoE Parallel Folding paper's
Megatron-Core MoE runs (H100: bf16, FP8, long-context CP), the Zero Bubble paper's pipeline
schedules (A100), torchao/torchtitan float8 and mxfp8 runs (H100, MI300X, B200, GB200) and the
PyTorch float8 + FSDP2 blog (512 H100). Each source is its own group (`VALIDATION_GROUPS`) with
its SOFTWARE entry, its GROUP_ASSUMPTIONS and its metric conversion:

- nanotron ``mfu``: X = mfu/100 · 989 TFLOP/s (`NANOTRON_MFU_PEAK_TFLOPS`; the playbook does not
  state its peak) over nanotron's get_flops model FLOPs (`nanotron_model_flops`: full s×s
  attention, 3-GEMM SwiGLU, lm-head, no recompute); step = F / (n·X).
- Megatron-Core MoE ``mfu`` (X = mfu/100 · 989.5, `MOE_FOLDING_PEAK_TFLOPS`, the peak the paper
  states) and ``tflops_per_gpu``: Megatron-LM's num_floating_point_operations of the paper's time
  (`megatron_model_flops` with swiglu, top-k experts and the shared expert); step = F / (n·X).
- ``tokens_per_sec_per_gpu`` (Zero Bubble's samples/s/GPU x 1024, torchtitan's per-device tps):
  step = B·s / (n·T) (`step_time_from_tokens_per_gpu`).

Llama-style rows build autopar's Llama, MoE rows autopar's Mixtral-style model (with a shared
expert beside the routed ones where the model has one: `MoEWithSharedExpert`). A row the cost
model cannot express as published (`PublishedRun.refusal`, e.g. fp8 on only part of the Linear
layers) and a configuration the estimate refuses (InvalidConfigError) are printed as refused,
with the reason, and counted apart from the errors.

Run: python benchmarks/published_runs.py [--csv PATH] [--group GROUP] [--assumptions]
     python benchmarks/published_runs.py --validation [--summary-only]
         (calibration and validation tables, then both summaries side by side: per set, per
         group and per kind of run)
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from autopar.cluster import Cluster  # noqa: E402
from autopar.config import ParallelConfig  # noqa: E402
from autopar.errors import InvalidConfigError  # noqa: E402
from autopar.models import GPTConfig, Llama, LlamaConfig, MixtralConfig, build  # noqa: E402
from autopar.models.common import SwiGLU  # noqa: E402
from autopar.models.llama import Block  # noqa: E402
from autopar.models.mixtral import MoE  # noqa: E402

__all__ = [
    "CALIBRATION_GROUPS", "DEFAULT_CSV", "GROUPS", "GROUP_ASSUMPTIONS", "HELDOUT_CSV", "KINDS",
    "MEGATRON_MFU_PEAK_TFLOPS", "MOE_FOLDING_PEAK_TFLOPS", "MixtralWithSharedExpert",
    "MoEWithSharedExpert", "NANOTRON_MFU_PEAK_TFLOPS", "Outcome", "PublishedRun", "SOFTWARE",
    "VALIDATION_CSV", "VALIDATION_GROUPS", "estimate_run", "estimate_runs", "interleave_degree",
    "load_runs", "main", "megatron_model_flops", "mosaicml_flops_per_token",
    "mosaicml_step_time_s", "nanotron_model_flops", "sc21_iteration_flops",
    "step_time_from_tflops", "step_time_from_tokens_per_gpu", "summary_stats",
]

DEFAULT_CSV = ROOT / "benchmarks" / "data" / "published_runs_calibration.csv"
# held-out validation rows (same columns, disjoint from DEFAULT_CSV; see the module docstring)
HELDOUT_CSV = ROOT / "benchmarks" / "data" / "llm_foundry_a100_heldout.csv"
# the frozen validation set (same columns; never used for fitting; see the module docstring)
VALIDATION_CSV = ROOT / "benchmarks" / "data" / "published_runs_validation.csv"

# Megatron-LM README "Performance Benchmarking" (r0.8.0): MFU = TFLOP/s / 989 (H100 SXM dense
# BF16 peak), e.g. its 474.4 TFLOP/s row reads 48 % MFU.
MEGATRON_MFU_PEAK_TFLOPS = 989.0
# HF Ultra-Scale Playbook heatmap MFU: the peak is not stated; H100 SXM dense BF16 (the CSV's
# notes convert with it, e.g. 44.32 % -> 438.3 TFLOP/s)
NANOTRON_MFU_PEAK_TFLOPS = 989.0
# MoE Parallel Folding (arXiv:2504.14960) §4.1 states MFU against 989.5 TFLOP/s
MOE_FOLDING_PEAK_TFLOPS = 989.5

GROUPS = {
    "sc21-t1": "SC21 Table 1: PTD-P weak scaling, Selene DGX A100",
    "sc21-t2-zero3": "SC21 Table 2: DeepSpeed ZeRO-3, no model parallelism",
    "sc21-t2-ptdp": "SC21 Table 2: PTD-P",
    "mlm-h100": "Megatron-LM README: H100 weak scaling",
    "mlm-h100-strong": "Megatron-LM README: H100 strong scaling (MFU endpoints)",
    "mpt-h100": "MosaicML llm-foundry MPT: H100 80GB",
    "mpt-a100": "MosaicML llm-foundry MPT: A100, 1600 Gbps RoCE",
}
CALIBRATION_GROUPS = tuple(GROUPS)
# The validation set's groups (benchmarks/data/published_runs_validation.csv): one per source,
# and per distinct software stack within a source.
_VALIDATION_TITLES = {
    "nanotron-h100": "HF Ultra-Scale Playbook heatmap: nanotron Llama, H100 (best layout per cell)",
    "mcore-moe-t3": "MoE Parallel Folding Table 3: Megatron-Core MoE, H100, bf16",
    "mcore-moe-t2-fp8": "MoE Parallel Folding Table 2: Megatron-Core MoE, H100, TE FP8",
    "mcore-moe-t5-cp": "MoE Parallel Folding Table 5: Megatron-Core MoE, H100, 16K-128K with CP",
    "zb-a100": "Zero Bubble PP (ICLR'24) Table 4: the authors' Megatron-LM fork, A100",
    "torchao-h100": "torchao float8 README: torchtitan Llama3-8B, 8 H100",
    "torchao-mi300x": "torchao float8 README: torchtitan Llama3-8B, 8 MI300X",
    "torchao-b200": "torchao training.md: torchtitan Llama3-8B, 8 B200 (float8, mxfp8)",
    "torchao-moe-b200": "torchao moe_training README: torchtitan Llama4 Scout (2 layers), 4 B200",
    "torchao-moe-gb200": "torchao moe_training README: torchtitan Llama4 Scout, 256 GB200",
    "fp8-blog-h100": "PyTorch blog float8 + FSDP2 Table 3: torchtitan, 512 H100 (IBM Cloud)",
}
GROUPS.update(_VALIDATION_TITLES)
VALIDATION_GROUPS = tuple(_VALIDATION_TITLES)

# Kinds of run the validation summary splits by, read off each row's columns (a row may be of
# several: an FP8 MoE row is fp8 and moe), with the targets (median, p90 |error| %):
# dense runs as the calibration set's, the newer kinds looser.
KINDS = {
    "dense": ("dense bf16/fp16 (no fp8, MoE or CP)", (5.0, 12.0)),
    "dense-a100": ("  of which A100 (A100-era)", (5.0, 12.0)),
    "dense-newer": ("  of which H100, MI300X, B200", (5.0, 12.0)),
    "fp8": ("fp8 / mxfp8 (precision column)", (8.0, 20.0)),
    "moe": ("MoE (moe_experts column)", (8.0, 20.0)),
    "cp": ("long-context CP (cp > 1)", (8.0, 20.0)),
}

_SC21_TABLE1_SCRIPT_NOTE = (
    "micro-batch, interleaving and data-parallel implementation per model size as NVIDIA's "
    "reproduction script for Table 1 sets them (Megatron-LM examples/sc21/run_table_1.sh: "
    "MBS, --num-layers-per-virtual-pipeline-stage, DDP); --DDP-impl torch (PyTorch DDP, the "
    "pp=1 rows) all-reduces gradient buckets during the backward, local (the pipelined rows) "
    "after it")
_INTERLEAVE = (
    "pp>1 -> interleaved-1f1b with virtual_stages = the smallest divisor >= 2 of layers/pp (the "
    "least interleaving Megatron accepts, closest to the 2 chunks per device of SC21 §2.2.2 "
    "Fig. 4); the degree is not published")
_SC21_COMMON = (
    "recompute='full': eq. (3) assumes full activation recomputation and counts its forward "
    "pass (SC21 §5.1)",
    "zero_stage=0: 2021 Megatron-LM data parallelism replicates optimizer state (the "
    "distributed optimizer came later)",
    "sequence_parallel=False: Megatron sequence parallelism is from 2022 (Korthikanti et al.)",
    "dtype='fp16': mixed precision fp16, 312 TFLOP/s peak (SC21 §5)",
    "cluster dgx-a100-80g as shipped: Selene nodes have 8 A100 80GB on NVSwitch and 8 HDR "
    "200 Gb/s IB compute NICs (SC21 §5)",
    "model: Megatron GPT (learned positions, biases, tied embedding/output), P by eq. (2), "
    "with Megatron-LM's default attention and hidden dropout of 0.1 (megatron/arguments.py "
    "--attention-dropout, --hidden-dropout)",
)
_MLM_COMMON = (
    "zero_stage=1: 'distributed optimizer likely'; --overlap-param-gather, listed by the README, "
    "only works with Megatron's distributed optimizer (megatron/training/arguments.py)",
    "micro_batch_size=1: not stated; Megatron-LM's published GPT-3 175B script uses 1 "
    "(examples/gpt3/train_gpt3_175b_distributed.sh)",
    "recompute='none': not stated; Megatron-LM's GPT example scripts pass no --recompute-* "
    "flag, the FLOP count it reports is model FLOPs, and a back-of-envelope activation budget "
    "(34·s·h/tp bytes per layer with flash attention and SP) fits 80 GB for every row",
    "sequence_parallel = tp > 1: Megatron-Core enables SP with TP since 2022",
    "pp>1 -> interleaved-1f1b: the README says PP communication overlap is on by default, and "
    "Megatron disables that overlap for the non-interleaved schedule "
    "(megatron/training/arguments.py validate_args); " + _INTERLEAVE,
    "tie_embeddings=False: the published sizes (1.7B, 7.1B, 16B, ...) match an untied output "
    "layer (tied would be 13 % short at 1.7B)",
    "model: GPT with learned positions and biases, ffn=4h, MHA (the CSV's QUALIFIERS)",
    "dtype='bf16' (MFU = TFLOP/s / 989, BF16 dense peak)",
    "cluster dgx-h100 as shipped (8x NDR 400G IB per node; the README names no cluster)",
)
GROUP_ASSUMPTIONS: dict[str, tuple[str, ...]] = {
    "sc21-t1": (_SC21_TABLE1_SCRIPT_NOTE,) + _SC21_COMMON,
    "sc21-t2-zero3": (
        "ZeRO-3 via DeepSpeed without model parallelism: zero_stage=3, tp=pp=1, dp=n (SC21 §5.2)",
        "micro_batch_size as Table 2 gives it",
        "FLOPs by eq. (3) like the PTD-P rows: the table's 'days for 300B tokens' reproduce "
        "with it",
    ) + _SC21_COMMON,
    "sc21-t2-ptdp": (
        "micro_batch_size=1 as Table 2 gives it; the TP8 x PP split of the model-parallel size "
        "(96 or 280) is the CSV's inference (SC21 uses t=8 throughout)",
        "schedule: not stated for Table 2; the end-to-end runs of §5.1 use the interleaved "
        "schedule, and the 530B rows continue Table 1's trend; " + _INTERLEAVE,
    ) + _SC21_COMMON,
    "mlm-h100": _MLM_COMMON,
    "mlm-h100-strong": (
        "tp=8, pp=6 as the 177B weak-scaling row (the CSV's assumption); dp = n/48",
    ) + _MLM_COMMON,
    "mpt-h100": (
        "FSDP FULL_SHARD -> zero_stage=3, dp=n, tp=pp=1; micro-batch and activation "
        "checkpointing (recompute full/none) as the README gives them",
        "model: GPT with learned positions of seq_len rows, biases and tied head. The released "
        "MPT uses ALiBi and no biases, but the benchmark's NumParams integers (e.g. "
        "6,658,859,008 at 2048, 6,918,905,856 at 65536) equal this GPT's count exactly; ALiBi "
        "would add no parameters and negligible FLOPs; vocab 50368",
        "dtype='bf16' (amp_bf16 or pure bf16)",
        "cluster dgx-h100 as shipped: the README does not state the H100 interconnect",
    ),
    "mpt-a100": (
        "FSDP FULL_SHARD -> zero_stage=3, dp=n, tp=pp=1; micro-batch and activation "
        "checkpointing (recompute full/none) as the README gives them",
        "model: GPT with learned positions of seq_len rows, biases and tied head (see mpt-h100: "
        "NumParams matches exactly; the released MPT uses ALiBi, no biases)",
        "dtype='bf16' (amp_bf16 or pure bf16)",
        "cluster: '1600 Gbps node-node interconnect (RoCE)' -> network_kind='roce', "
        "nics_per_node=8, nic_gbps=200 (8 x 200 = 1600; the per-NIC split is not stated, 8 "
        "NICs is the DGX A100 layout); dgx-a100-40g for A100 40GB rows",
    ),
}


# The validation groups' documented choices for what their sources leave unstated (the row's
# own QUALIFIERS are appended per run). Written from the sources, before any estimate was seen.
_LLAMA_MODEL = (
    "model: autopar's Llama (RMSNorm, rotate-half RoPE, SwiGLU, no biases) with the CSV's "
    "shape; Llama-3 rows GQA with 8 KV heads, vocab 128256, untied")
_MCORE_MOE = (
    "model: autopar's Mixtral-style MoE (the Llama block with its MLP replaced by top-k softmax "
    "routing over SwiGLU experts, GQA, untied head) with the CSV's shapes; capacity factor 1.0 "
    "(token dropping, paper §4.1) is the trace's default (every expert gets its uniform share of "
    "the routed tokens); Qwen2-57B-A14B's always-on shared expert (ffn 20480, sigmoid-gated, "
    "from its HF config in the CSV's QUALIFIERS) is built as a dense SwiGLU with its gate beside "
    "the routed experts (MoEWithSharedExpert: its parameters and FLOPs exactly); Qwen2's q/k/v "
    "biases are left out (under 0.01 % of the parameters); Llama3-8x70B top-2 (the CSV's "
    "assumption)",
    "micro_batch_size=1: not stated; Megatron-LM's Mixtral and GPT-3 175B example scripts "
    "(examples/mixtral/train_mixtral_8x7b_distributed.sh, examples/gpt3/"
    "train_gpt3_175b_distributed.sh) use 1",
    "recompute='none': not stated; those scripts pass no --recompute-* flag",
    "pp>1 -> '1f1b': virtual pipeline (VPP) not stated; Megatron runs its non-interleaved "
    "schedule unless --num-layers-per-virtual-pipeline-stage is given",
    "sequence_parallel = tp > 1: Megatron-Core needs SP for MoE with TP (the Mixtral example "
    "passes --sequence-parallel)",
    "ZeRO by the table's method: 'FSDP' and 'FSDP + EP' -> zero_stage=3 with the TP degree the "
    "table lists; 'TP + EP + DP' -> zero_stage=1 (paper §4.2: 'use ZeRO-1 instead of ZeRO-3'); "
    "'MCore' and 'MCore w/ Folding' -> zero_stage=1 (Megatron-Core's distributed optimizer, "
    "likely; not stated)",
    "ep: a sub-group of DP x CP with expert weights split over TP as well (ETP = TP), "
    "Megatron-Core's layout before folding; the 'MCore w/ Folding' rows run with etp=1 (ETP1, "
    "EP folded over the attention TP x CP x DP ranks: ParallelConfig.etp)",
    "cluster dgx-h100 as shipped: Eos DGX H100, NVLink4 + NVSwitch 450 GB/s and InfiniBand 400 "
    "Gb/s (paper §4.1), 8 NICs per node presumed",
    "metric: MFU x 989.5 TFLOP/s (the peak the paper states, §4.1), or TFLOP/s, over Megatron-"
    "LM's num_floating_point_operations of the paper's time (Megatron-Core, PyTorch 2.5): "
    "12·B·s·l·h²·[(1 + g/a + s/h) + (f/h)·k·3/2 + (f_shared/h)·3/2 + V/(2lh)] -- top-k experts, "
    "SwiGLU, the shared expert, the full s×s attention square and no recompute term; the "
    "unpadded vocabulary (Megatron pads it to a multiple of 128·tp: < 0.1 % here)",
)
_TORCHTITAN_DENSE = (
    _LLAMA_MODEL + " (torchtitan's llama3_8b)",
    "FSDP2 over the node's 8 GPUs -> zero_stage=3, dp=8; local batch 1 -> micro_batch_size=1, "
    "global batch 8, seq 8192 (the source)",
    "per-op selective activation checkpointing (torchtitan's 'selective op' AC) -> "
    "recompute='per_op', the same policy (the outputs of attention and of every other matmul "
    "kept, the rest re-run)",
    "precision per row: bf16; float8 tensorwise -> dtype='fp8', fp8_recipe='tensorwise'; float8 "
    "rowwise -> 'rowwise'; rowwise_with_gw_hp (the weight-gradient GEMM in bf16) -> 'rowwise' "
    "(approximation); mxfp8 (B200) -> 'rowwise' (approximation: the cost model has no MX "
    "recipe; MX block-32 scales, like rowwise ones, run along the reduction axis and need the "
    "backward operands quantised again along the other axis)",
    "FSDP's float8 all-gather (the tensorwise rows) is not modelled: autopar gathers bf16 "
    "parameters (one node, on NVLink/xGMI)",
    "metric: the median of torchtitan's per-device tps -> step = B·s/(n·T)",
)
_TORCHTITAN_SCOUT = (
    "model: Llama4 Scout text shape (h 5120, 40 heads / 8 KV, 16 routed SwiGLU experts of ffn "
    "8192, top-1, vocab 202048, untied) as autopar's Mixtral-style MoE, with Scout's always-on "
    "shared expert (ffn 8192, ungated) built as a dense SwiGLU beside the routed experts "
    "(MoEWithSharedExpert: parameters and FLOPs exactly; 107.76B at 48 layers); the router is "
    "autopar's softmax top-k (Llama4's sigmoid score costs the same); Scout's chunked (iRoPE) "
    "attention equals full causal attention at seq 8192 (the CSV's note)",
    "FSDP2 over all ranks -> zero_stage=3; EP as the source gives it -> ep (a sub-group of dp); "
    "autopar shards the routed experts' states over dp/ep ranks",
    "recompute='none' (AC=none, stated); micro-batch = the local batch (stated); seq 8192",
    "precision per row: bf16; mxfp8 on the Linear layers and the routed experts' grouped GEMMs "
    "-> dtype='fp8', fp8_recipe='rowwise' (approximation: the cost model has no MX recipe); "
    "fp8 on only some of the Linear layers (the 'Linears only' and 'grouped GEMMs only' rows) "
    "is refused: the cost model runs every Linear GEMM in fp8 or none",
    "metric: median tokens/s per device (torchtitan's tps) -> step = B·s/(n·T)",
)
GROUP_ASSUMPTIONS.update({
    "nanotron-h100": (
        "model: nanotron's Llama (RMSNorm, RoPE, SwiGLU, no biases) with MHA, shapes and vocab "
        "131072 from nanotron scripts/scaling_benchmarks.py@e24d248 (the CSV's QUALIFIERS; its "
        "parameter count gives the heatmap's 1.34/3.57/8.86/80.0B); tied embedding and head iff "
        "ffn < 10000 (that script's rule): 1.34B and 3.57B tied, 8.86B and 80B untied",
        "dp, tp, pp, micro-batch and ZeRO stage (0 or 1) as the heatmap cell prints them; the "
        "cell's GAS = 256/(DP·MBS) is the micro-batch count; global batch 256 x 4096 tokens",
        "sequence_parallel = tp > 1: nanotron's TP mode REDUCE_SCATTER",
        "pp>1 -> '1f1b': nanotron's one-forward-one-backward pipeline engine",
        "recompute='none': the sweep's base config sets no recompute_layer (the CSV's "
        "inference)",
        "dtype='bf16' (bfloat16, fp32 gradient accumulation)",
        "cluster dgx-h100 as shipped: Hugging Face's 8x H100 80GB nodes; the interconnect is "
        "not stated",
        "metric: MFU x 989 TFLOP/s (the peak is not stated; H100 SXM dense BF16, as the CSV "
        "converts) over nanotron's get_flops model FLOPs (full s×s attention, 3-GEMM SwiGLU, "
        "lm-head, no recompute term)",
    ),
    "mcore-moe-t3": _MCORE_MOE + ("dtype='bf16' (paper §4.1)",),
    "mcore-moe-t2-fp8": _MCORE_MOE + (
        "dtype='fp8' with fp8_recipe='delayed': Transformer Engine FP8 with delayed scaling "
        "(paper §4.5); the mapping, batch and sequence of Table 3's runs (the CSV's inference: "
        "Table 2's BF16 TFLOP/s equal Table 3's MFU x 989.5)",),
    "mcore-moe-t5-cp": _MCORE_MOE + (
        "dtype='bf16'; context parallel as Megatron-Core runs it: ring attention with causal "
        "load balancing (2·cp chunks), autopar's zigzag CP layout",
        "attention FLOPs in the MFU numerator: the full s×s square (as above); the causal half "
        "would make the published step 1.1x (16K) to 1.5x (128K) shorter -- the paper does not "
        "say which count its Megatron-LM version used",
    ),
    "zb-a100": (
        "model: GPT-3-like GPT (learned positions, biases, LayerNorm, GELU ffn 4h, MHA) with "
        "tied embedding and output, as the fork's example script of the paper's time "
        "(examples/pretrain_zero_bubble.sh@77b9eed, 2023-12-15) builds it: no --untie-"
        "embeddings-and-output-weights, --swiglu or --position-embedding-type; vocab 50257 "
        "(the CSV's assumption); attention and hidden dropout 0.1 (Megatron-LM's defaults; the "
        "script zeroes them only for its exact-numeric-match test)",
        "the first and last stage hold one layer fewer (--allow-padding-num-layers, paper "
        "§5.1): autopar's default split (the remainder to the middle stages) places 22, 30, 46 "
        "and 62 layers exactly so",
        "schedule from the row's 'Schedule column': 1F1B -> '1f1b'; ZB-1p -> 'zero-bubble' "
        "(autopar's ZB-H1, the handcrafted schedule under ZB-1p's memory limit of 1F1B's "
        "activations; the paper's automatically searched ZB-1p may close the bubble a little "
        "more); ZB-2p -> 'zero-bubble' as well, the closest schedule: autopar has none that "
        "holds twice 1F1B's activations to close the bubble, so these rows keep ZB-H1's bubble "
        "(an approximation that leans slow); 1F1B-I -> 'interleaved-1f1b' with the CSV's "
        "virtual_pipeline_stages (one layer per chunk): after the padding the first chunk "
        "holds the embedding alone and the last the head and loss alone, as the estimate's "
        "Megatron split places them when the blocks do not fill the chunks",
        "dp=1, tp=1, zero_stage=0; micro-batch and global batch from Table 3",
        "recompute='none': the paper mentions no recomputation (the CSV's assumption)",
        "dtype='fp16': the example script passes --fp16 (the CSV's assumption)",
        "cluster dgx-a100-80g with network_kind='roce': 'up to 32 A100 SXM 80G across 4 nodes "
        "on RoCE RDMA' (paper §5.1); NIC count and rate not stated (the profile's 8 x 200 Gb/s "
        "kept)",
        "metric: samples/s/GPU x 1024 stored as tokens/s/GPU -> step = B·s/(n·T)",
    ),
    "torchao-h100": _TORCHTITAN_DENSE + (
        "cluster dgx-h100 (one node; the H100 variant is not stated, SXM presumed)",),
    "torchao-mi300x": _TORCHTITAN_DENSE + ("cluster mi300x-8 (one node)",),
    "torchao-b200": _TORCHTITAN_DENSE + (
        "cluster dgx-b200 as shipped (one node): the B200s were 'power limited' to a value not "
        "stated, which the profile (the 1000 W HGX B200) does not model",),
    "torchao-moe-b200": _TORCHTITAN_SCOUT + (
        "2 layers (the source's reduced model), FSDP=4 x EP=4 -> dp=4, ep=4: 4 experts per "
        "rank, expert states not sharded further (torchtitan's default)",
        "cluster dgx-b200 with gpus_per_node=4, nics_per_node=4: the run used 4 of a node's "
        "GPUs (CUDA_VISIBLE_DEVICES=4,5,6,7)",
    ),
    "torchao-moe-gb200": _TORCHTITAN_SCOUT + (
        "256 GPUs: the stated layout ('64 nodes of 4 devices', FSDP=256), not the table's 512 "
        "(the CSV's reading); EP=16 -> ep=16: routed-expert states sharded over 256/16 = 16 "
        "ranks (the source says 64)",
        "cluster gb200-nvl72 with gpus_per_node=64, nics_per_node=64: the NVLink domain is not "
        "stated; NVL72 racks presumed (the CSV), each taken to hold 16 of the job's 4-GPU trays "
        "(64 GPUs, the largest power-of-two share of its 18) -> 4 NVLink domains joined by "
        "InfiniBand, one 400 Gb/s NIC per GPU as shipped",
    ),
    "fp8-blog-h100": (
        _LLAMA_MODEL + " (Llama 3 70B, Llama 3.1 405B)",
        "FSDP2 -> zero_stage=3, dp = 512/tp; TP4 for the 405B model only (the blog names TP "
        "for it alone) with sequence_parallel (torchtitan's TP plan shards the norms on the "
        "sequence)",
        "micro_batch_size=1, global batch = dp (the CSV's assumption: the blog tuned the batch "
        "per run and does not give it); seq 8192",
        "recompute='full': not stated (the blog explored AC schemes per run); torchtitan's "
        "llama3_70b.toml and llama3_405b.toml of the blog's time (2024-11) set "
        "activation_checkpoint mode 'full'",
        "precision per row: bf16; float8 tensorwise -> dtype='fp8', fp8_recipe='tensorwise'. "
        "FSDP's float8 all-gather is not modelled: autopar gathers bf16 parameters",
        "cluster dgx-h100 with network_kind='roce', nics_per_node=8, nic_gbps=400: '3.2 Tbps "
        "RoCE' per node (IBM Cloud); the per-NIC split is not stated (8 x 400 Gb/s, the DGX "
        "layout)",
        "metric: wps = tokens/s per GPU -> step = B·s/(n·T)",
    ),
})

# ---------------------------------------------------------------------------------------------
# FLOP counts and metric conversions (pure functions; closed forms tested by hand)

def sc21_iteration_flops(*, batch: int, seq_len: int, num_layers: int, hidden: int,
                         vocab: int) -> float:
    """SC21 eq. (3): FLOPs of one iteration with full recompute (its extra forward counted)."""
    b, s, l, h, v = batch, seq_len, num_layers, hidden, vocab
    return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))


def megatron_model_flops(*, batch: int, seq_len: int, num_layers: int, hidden: int,
                         ffn_hidden: int, num_heads: int, num_kv_heads: int, vocab: int,
                         swiglu: bool = False, experts_routed_to: int = 1,
                         shared_ffn_hidden: int = 0) -> float:
    """Megatron-LM's reported FLOPs per iteration, 2024 form (no recompute, full s×s attention).

    Forward GEMMs per layer per sequence: QKV 2·s·h·(h + 2·h_kv), scores and context
    2·(2·s²·h), output projection 2·s·h², MLP 2·(2·s·h·f); logits 2·s·h·V; backward is twice
    the forward. Head dim h/a. As megatron/training/training.py's num_floating_point_operations
    counts MoE models: the MLP term times the top-k experts a token is routed to
    (`experts_routed_to`, f the per-expert size) plus an always-on shared expert of
    `shared_ffn_hidden`, each times 3/2 for a gated (SwiGLU) MLP.
    """
    b, s, l, h, f, v = batch, seq_len, num_layers, hidden, ffn_hidden, vocab
    h_kv = h * num_kv_heads // num_heads
    glu = 1.5 if swiglu else 1.0
    mlp = 4 * s * h * (f * experts_routed_to + shared_ffn_hidden) * glu
    layer = 2 * s * h * (h + 2 * h_kv) + 4 * s * s * h + 2 * s * h * h + mlp
    return 3.0 * b * (l * layer + 2 * s * h * v)


def nanotron_model_flops(*, batch: int, seq_len: int, num_layers: int, hidden: int,
                         ffn_hidden: int, num_heads: int, num_kv_heads: int,
                         vocab: int) -> float:
    """nanotron's get_flops model FLOPs per iteration (src/nanotron/models/llama.py), the
    numerator of the Ultra-Scale Playbook's MFU: 3x the forward of the q/k/v projections, the
    full s×s score and context products (no causal halving), the output projection, the
    3-GEMM SwiGLU MLP and the lm-head; no recompute term."""
    b, s, l, h, f, v = batch, seq_len, num_layers, hidden, ffn_hidden, vocab
    a, g = num_heads, num_kv_heads
    d = h // a
    qkv = 2 * l * b * s * h * a * d + 2 * l * b * s * h * 2 * g * d
    scores = 2 * l * b * a * s * d * s
    context = 2 * l * b * a * s * s * d
    out = 2 * l * b * a * s * d * h
    ffn = 4 * l * b * s * h * f + 2 * l * b * s * f * h
    head = 2 * b * s * h * v
    return 3.0 * (qkv + scores + context + out + ffn + head)


def step_time_from_tflops(flops: float, n_gpus: int, tflops_per_gpu: float) -> float:
    """Seconds per step when n GPUs each sustain `tflops_per_gpu` on `flops` per step."""
    return flops / (n_gpus * tflops_per_gpu * 1e12)


def mosaicml_step_time_s(*, global_batch: int, seq_len: int, n_gpus: int,
                         tokens_per_s_per_gpu: float) -> float:
    """MosaicML throughput (tokens/s/GPU) -> seconds per optimizer step."""
    return global_batch * seq_len / (n_gpus * tokens_per_s_per_gpu)


def step_time_from_tokens_per_gpu(*, global_batch: int, seq_len: int, n_gpus: int,
                                  tokens_per_s_per_gpu: float) -> float:
    """Tokens/s per GPU (torchtitan's per-device tps, Zero Bubble's samples/s/GPU x seq) ->
    seconds per optimizer step of `global_batch` sequences."""
    return global_batch * seq_len / (n_gpus * tokens_per_s_per_gpu)


def mosaicml_flops_per_token(*, params: float, num_layers: int, hidden: int,
                             seq_len: int) -> float:
    """MosaicML's MFU numerator per token: 6·N plus attention 3·(4·l·h·s) (llm-foundry
    scripts/train/benchmarking/README.md, 'MFU'); HFU multiplies by 4/3 with checkpointing."""
    return 6.0 * params + 12.0 * num_layers * hidden * seq_len


# NVIDIA's reproduction script for SC21 Table 1 (Megatron-LM examples/sc21/run_table_1.sh),
# keyed by the CSV's params_billion: micro-batch size, layers per virtual pipeline stage
# (None: no --num-layers-per-virtual-pipeline-stage, the plain 1F1B schedule) and --DDP-impl.
SC21_TABLE1_SCRIPT: dict[float, tuple[int, int | None, str]] = {
    1.7: (16, None, "torch"), 3.6: (16, None, "torch"), 7.5: (16, None, "torch"),
    18.4: (8, None, "torch"), 39.1: (4, None, "local"), 76.1: (2, 5, "local"),
    145.6: (2, 5, "local"), 310.1: (1, 3, "local"), 529.6: (1, 1, "local"),
    1008.0: (1, None, "local"),
}


def interleave_degree(num_layers: int, pp: int) -> int:
    """Virtual stages per pipeline rank: the smallest divisor >= 2 of layers per stage."""
    if pp < 2:
        return 1
    per_stage, rem = divmod(num_layers, pp)
    if rem or per_stage < 2:
        raise ValueError(f"{num_layers} layers do not split into {pp} stages of >= 2 layers")
    return next(d for d in range(2, per_stage + 1) if per_stage % d == 0)


# Software each group ran, as the sources state it (EstimateOptions fields). These describe the
# framework of the run, not a fitted correction: they are the same for every row of a group,
# except where a row's own source sets one apart (PublishedRun.option_overrides).
SOFTWARE: dict[str, tuple[dict[str, Any], str]] = {
    "sc21-t1": ({"attention_kernel": "math", "overlap_dp_comm": False,
                 "grad_reduce_dtype": "fp16", "kernels": "fused", "loss_kernel": "megatron",
                 "recompute_early_stop": False},
                "Megatron-LM 2021: fused scale-mask-softmax on materialized scores (flash "
                "attention is 2022); fused bias-GeLU and bias-dropout-add (SC21 §4.2) and apex's "
                "fused LayerNorm; gradients all-reduced after backward by its local DDP "
                "(the pp=1 rows' --DDP-impl torch overlaps them, run_table_1.sh) in fp16 "
                "(--accumulate-allreduce-grads-in-fp32 was an opt-in flag); its own "
                "checkpoint function re-runs each whole layer; its unfused vocab-parallel "
                "cross-entropy on fp32 logits"),
    "sc21-t2-ptdp": ({"attention_kernel": "math", "overlap_dp_comm": False,
                      "grad_reduce_dtype": "fp16", "kernels": "fused", "loss_kernel": "megatron",
                      "recompute_early_stop": False},
                     "same Megatron-LM 2021 software as Table 1"),
    "sc21-t2-zero3": ({"attention_kernel": "math", "overlap_dp_comm": True,
                       "zero3_max_live_params": 10**9, "grad_reduce_dtype": "fp16",
                       "zero3_gather": "sync", "loss_kernel": "megatron",
                       "recompute_early_stop": False},
                      "DeepSpeed ZeRO-3 (2021, before v0.5): materialized attention scores; "
                      "each parameter gathered on its own and waited for in the forward, the "
                      "recompute and the backward (DeepSpeed PR #1188 describes and removes "
                      "this in June 2021), except those kept since a use fewer than "
                      "stage3_max_reuse_distance (default 1e9) elements back -- each block's "
                      "last Linear from its recompute to its backward; gradient reduce-"
                      "scatter overlapped with backward; "
                      "live gathered parameters capped by stage3_max_live_parameters (default "
                      "1e9); fp16 communication; Megatron-style checkpointing re-runs whole "
                      "layers; the GPT model of DeepSpeed's Megatron-LM fork, with Megatron's "
                      "vocab-parallel cross-entropy"),
    "mlm-h100": ({"attention_kernel": "cudnn", "overlap_dp_comm": True, "overlap_tp_comm": True,
                  "kernels": "fused", "grad_reduce_dtype": "bf16", "loss_kernel": "megatron",
                  "recompute_early_stop": False},
                 "Megatron-LM r0.8 with Transformer Engine: cuDNN fused attention, TE's fused "
                 "norm and bias-activation kernels; --overlap-grad-reduce, --overlap-param-"
                 "gather, --tp-comm-overlap (CSV notes); gradients reduced in bf16 "
                 "(--accumulate-allreduce-grads-in-fp32 is still an opt-in flag); the unfused "
                 "vocab-parallel cross-entropy on fp32 logits (--cross-entropy-loss-fusion is "
                 "opt-in, default False in megatron/training/arguments.py)"),
    "mlm-h100-strong": ({"attention_kernel": "cudnn", "overlap_dp_comm": True,
                         "overlap_tp_comm": True, "kernels": "fused", "loss_kernel": "megatron",
                         "grad_reduce_dtype": "bf16", "recompute_early_stop": False},
                        "same software as the weak-scaling rows"),
    "mpt-h100": ({"attention_kernel": "flash", "overlap_dp_comm": True, "loss_kernel": "fused",
                  "recompute_early_stop": True},
                 "llm-foundry: FlashAttention-2 (the H100 tables' benchmark script, the one "
                 "with FP8 runs, installs llm-foundry[gpu-flash2] and defaults --attn_impl to "
                 "'flash'), FSDP with backward prefetch, flash-attn's "
                 "fused cross-entropy (ComposerMPTCausalLM's default loss_fn "
                 "'fused_crossentropy'); activation checkpointing non-reentrant "
                 "(scripts/train/benchmarking/submit_benchmarks.py sets it), on a torch that "
                 "stops recomputing early (>= 2.1: assumed from the same table's FP8 rows, a "
                 "later software stack than the A100 tables')"),
    "mpt-a100": ({"attention_kernel": "triton", "overlap_dp_comm": True, "loss_kernel": "fused",
                  "recompute_early_stop": False},
                 "llm-foundry as the H100 rows but with its Triton attention: the benchmark "
                 "script of these tables (scripts/train/benchmarking/submit_benchmarks.py with "
                 "the mosaicml/pytorch:1.13.1 default image) defaults --attn_impl to 'triton', "
                 "llm-foundry's copy of Tri Dao's Triton FlashAttention-1 kernel "
                 "(FlashAttention-2 came with the later script); on torch 1.13 (that default "
                 "image; the README's tables await 'torch 2.0 after next Composer release'), "
                 "whose non-reentrant checkpoint re-runs the whole block"),
}


# The validation groups' software, as each source describes its framework (same meaning as
# above: the framework of the run, one entry per group, never a per-row correction).
_MCORE_MOE_SOFTWARE = {
    "attention_kernel": "cudnn", "kernels": "fused", "loss_kernel": "megatron",
    "overlap_dp_comm": True, "overlap_tp_comm": False, "grad_reduce_dtype": "bf16",
    "recompute_early_stop": False}
_MCORE_MOE_TEXT = (
    "Megatron-Core with Transformer Engine (paper §4.1: Megatron-Core, PyTorch 2.5, CUDA "
    "12.6): TE's cuDNN fused attention and fused norm/activation kernels; --overlap-grad-reduce "
    "and --overlap-param-gather (Megatron-LM's Mixtral example passes both); --tp-comm-overlap "
    "is not stated and off by default; gradients reduced in bf16 (--accumulate-allreduce-"
    "grads-in-fp32 is opt-in); the unfused vocab-parallel cross-entropy on fp32 logits "
    "(--cross-entropy-loss-fusion is opt-in); all-to-all token dispatch (the paper's "
    "alltoall dispatcher; autopar's default)")
_TORCHTITAN_TEXT = (
    "torchtitan with torch.compile (stated): FSDP2 with bf16 parameters and fp32 gradient "
    "reduce-scatters (torchtitan's mixed_precision_reduce default) overlapped with the "
    "backward, per-block compiled kernels (kernels='fused'), PyTorch SDPA, torchao's float8 "
    "(or MX) Linear for the low-precision rows, non-reentrant checkpointing")
SOFTWARE.update({
    "nanotron-h100": ({"attention_kernel": "flash", "kernels": "eager", "loss_kernel": "megatron",
                       "overlap_dp_comm": True, "overlap_tp_comm": True,
                       "grad_reduce_dtype": "fp32", "pipeline_balance": "gemm_weights"},
                      "nanotron v0.5 (the CSV's notes): flash-attn 2 attention; eager PyTorch "
                      "kernels (no torch.compile; its Triton RMSNorm and fused rotary are the "
                      "only fused ops); the async TP linear communication the bench config "
                      "turns on (tp_linear_async_communication) overlaps the TP collectives with "
                      "their GEMMs; its Megatron-style sharded cross-entropy on fp32 logits; "
                      "DDP with fp32 gradient accumulation whose buckets are reduced in fp32 "
                      "during the backward (nanotron's FP32GradBucketManager hook); pipeline "
                      "stages balanced by the blocks' GEMM weights, the LM head counted "
                      "(build_model in src/nanotron/models/base.py at e24d248)"),
    "mcore-moe-t3": (dict(_MCORE_MOE_SOFTWARE), _MCORE_MOE_TEXT),
    "mcore-moe-t2-fp8": ({**_MCORE_MOE_SOFTWARE, "fp8_recipe": "delayed"},
                         _MCORE_MOE_TEXT + "; FP8 by Transformer Engine's delayed scaling "
                         "(paper §4.5)"),
    "mcore-moe-t5-cp": (dict(_MCORE_MOE_SOFTWARE), _MCORE_MOE_TEXT + "; context parallel by "
                        "Megatron-Core's P2P ring attention"),
    "zb-a100": ({"attention_kernel": "math", "kernels": "fused", "loss_kernel": "megatron",
                 "overlap_dp_comm": False, "grad_reduce_dtype": "fp16",
                 "recompute_early_stop": False},
                "the authors' fork of Megatron-LM (late 2023; sail-sg/zero-bubble-pipeline-"
                "parallelism, examples/pretrain_zero_bubble.sh@77b9eed): the legacy local "
                "transformer (--transformer-impl local, the default then) with Megatron's fused "
                "scale-mask-softmax on materialized scores (the script passes no --use-flash-"
                "attn), fused bias-GeLU and bias-dropout-add and apex's fused LayerNorm, its "
                "vocab-parallel cross-entropy on fp32 logits; fp16 (no data parallelism, so "
                "no gradient reduction)"),
    "torchao-h100": ({"attention_kernel": "flash", "kernels": "fused", "loss_kernel": "eager",
                      "overlap_dp_comm": True, "grad_reduce_dtype": "fp32",
                      "recompute_early_stop": True},
                     _TORCHTITAN_TEXT + "; torchtitan 0.0.2 with PyTorch 2.7.0a0 (2025-03, the "
                     "source): SDPA's flash backend on H100 and the loss not compiled "
                     "(torchtitan compiles the loss since 2025-04, pytorch/torchtitan#1033), "
                     "so the cross-entropy runs on fp32-upcast logits"),
    "torchao-mi300x": ({"attention_kernel": "flash", "kernels": "fused", "loss_kernel": "fused",
                        "overlap_dp_comm": True, "grad_reduce_dtype": "fp32",
                        "recompute_early_stop": True},
                       _TORCHTITAN_TEXT + "; torchtitan 2c8b594 (2025-08) on ROCm 6.4: SDPA's "
                       "flash backend (AOTriton), the loss compiled with the model"),
    "torchao-b200": ({"attention_kernel": "cudnn", "kernels": "fused", "loss_kernel": "fused",
                      "overlap_dp_comm": True, "grad_reduce_dtype": "fp32",
                      "recompute_early_stop": True},
                     _TORCHTITAN_TEXT + "; torchtitan 6fc499f (2025-08): SDPA with the cuDNN "
                     "backend first on compute capability 10.0 (torchtitan/models/attention.py, "
                     "since pytorch/torchtitan#1196), the loss compiled with the model"),
    "torchao-moe-b200": ({"attention_kernel": "cudnn", "kernels": "fused", "loss_kernel": "fused",
                          "overlap_dp_comm": True, "grad_reduce_dtype": "fp32",
                          "recompute_early_stop": True},
                         _TORCHTITAN_TEXT + "; torchtitan's Llama4 (compile=True, stated) after "
                         "2025-05: SDPA with cuDNN first on B200 (the 17bx16e config uses SDPA, "
                         "not flex attention), the loss compiled, all-to-all expert dispatch"),
    "torchao-moe-gb200": ({"attention_kernel": "cudnn", "kernels": "fused",
                           "loss_kernel": "fused", "overlap_dp_comm": True,
                           "grad_reduce_dtype": "fp32", "recompute_early_stop": True},
                          "as torchao-moe-b200: torchtitan's Llama4 with torch.compile on "
                          "GB200 (compute capability 10.0: cuDNN SDPA first)"),
    "fp8-blog-h100": ({"attention_kernel": "flash", "kernels": "fused", "loss_kernel": "eager",
                       "overlap_dp_comm": True, "overlap_tp_comm": False,
                       "grad_reduce_dtype": "fp32", "recompute_early_stop": True},
                      _TORCHTITAN_TEXT + "; torchtitan of 2024-11 (the blog's 'torchtitan entry "
                      "point', FSDP2 + DTensor, torch.compile): SDPA's flash backend on H100, "
                      "the loss not compiled then; async TP is not stated (off)"),
})

# ---------------------------------------------------------------------------------------------
# MoE with a shared expert (Qwen2-MoE, Llama 4): autopar's routed MoE plus a dense SwiGLU


class MoEWithSharedExpert(nn.Module):
    """autopar's top-k MoE (`autopar.models.mixtral.MoE`, costed by the tracer as an MoE leaf)
    plus one always-on SwiGLU expert that every token runs through, optionally scaled by a
    sigmoid gate (Qwen2-MoE's shared_expert_gate; Llama 4's shared expert has none). The shared
    expert is a dense MLP of the block: tensor-parallel and data-parallel like any other."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, shared_ffn: int,
                 gated: bool):
        super().__init__()
        self.routed = MoE(dim, hidden, num_experts, top_k)
        self.shared_expert = SwiGLU(dim, shared_ffn)
        self.shared_gate = nn.Linear(dim, 1, bias=False) if gated else None

    def forward(self, x):
        shared = self.shared_expert(x)
        if self.shared_gate is not None:
            shared = torch.sigmoid(self.shared_gate(x)) * shared
        return self.routed(x) + shared


class MixtralWithSharedExpert(Llama):
    """autopar's Mixtral-style model with `MoEWithSharedExpert` layers."""

    def __init__(self, cfg: MixtralConfig, *, shared_ffn: int, gated: bool):
        def make_block(c):
            return Block(c, MoEWithSharedExpert(c.dim, c.ffn_dim, c.num_experts, c.top_k,
                                                shared_ffn, gated))

        super().__init__(cfg, make_block=make_block)

# ---------------------------------------------------------------------------------------------
# The run description

@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    """One published measurement, ready for `autopar.estimate`."""

    run_id: str
    group: str                      # a key of GROUPS
    source: str                     # the CSV's source label
    model_name: str
    num_layers: int
    hidden: int
    ffn_hidden: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    seq_len: int
    params_billion: float           # as published (the CSV's params_billion)
    tie_embeddings: bool
    profile: str                    # hwprofiles name
    num_nodes: int
    cluster_overrides: tuple[tuple[str, Any], ...]
    config: ParallelConfig
    global_batch_size: int
    dtype: str
    metric: str                     # tflops_per_gpu | mfu | tokens_per_sec_per_gpu
    metric_value: float
    published_step_time_s: float
    step_time_derivation: str
    assumptions: tuple[str, ...]
    notes: str
    # EstimateOptions fields this row's own source sets apart from its group's SOFTWARE
    option_overrides: tuple[tuple[str, Any], ...] = ()
    dropout: float = 0.0            # attention and hidden dropout of the model
    # the model family: "gpt" (autopar's GPT), "llama" (autopar's Llama), "moe" (autopar's
    # Mixtral-style MoE; with `shared_expert_ffn`, MoEWithSharedExpert layers)
    arch: str = "gpt"
    num_experts: int = 0
    top_k: int = 0
    shared_expert_ffn: int = 0      # an always-on SwiGLU expert beside the routed ones
    shared_expert_gated: bool = False  # ... scaled by sigmoid(Linear(h, 1)) (Qwen2-MoE)
    # why the cost model cannot express this row as published (it is reported as refused)
    refusal: str | None = None
    # the kinds of run it is (KINDS keys), read off the row's columns
    kinds: tuple[str, ...] = ()

    @property
    def n_gpus(self) -> int:
        return self.config.world_size

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.cluster_overrides)

    @property
    def set_name(self) -> str:
        """"calibration" or "validation": the set its group belongs to."""
        return "validation" if self.group in VALIDATION_GROUPS else "calibration"

    def model_config(self) -> GPTConfig | LlamaConfig | MixtralConfig:
        if self.arch == "gpt":
            return GPTConfig(vocab_size=self.vocab_size, max_seq_len=self.seq_len,
                             dim=self.hidden, n_layers=self.num_layers, n_heads=self.num_heads,
                             ffn_mult=self.ffn_hidden // self.hidden,
                             tie_embeddings=self.tie_embeddings, dropout=self.dropout)
        shape = dict(vocab_size=self.vocab_size, dim=self.hidden, n_layers=self.num_layers,
                     n_heads=self.num_heads, n_kv_heads=self.num_kv_heads,
                     ffn_dim=self.ffn_hidden, max_seq_len=self.seq_len,
                     tie_embeddings=self.tie_embeddings)
        if self.arch == "llama":
            return LlamaConfig(**shape)
        if self.arch == "moe":
            return MixtralConfig(**shape, num_experts=self.num_experts, top_k=self.top_k)
        raise ValueError(f"{self.run_id}: unknown arch {self.arch!r}")

    def build_model(self, device: str = "meta") -> nn.Module:
        """The model of this run (meta device by default: no memory): autopar's GPT, Llama or
        Mixtral-style MoE, the last with a shared expert where the model has one."""
        cfg = self.model_config()
        if self.shared_expert_ffn:
            with torch.device(device):
                return MixtralWithSharedExpert(cfg, shared_ffn=self.shared_expert_ffn,
                                               gated=self.shared_expert_gated)
        return build(cfg, device=device)

    def make_cluster(self) -> Cluster:
        return Cluster.from_profile(self.profile, self.num_nodes, **self.overrides)

    def options(self):
        """The EstimateOptions of the software this run used (its group's, and the row's)."""
        from autopar.estimate import EstimateOptions

        return EstimateOptions(**{**SOFTWARE[self.group][0], **dict(self.option_overrides)})

    def short(self) -> str:
        return f"{self.run_id}: {self.model_name} on {self.n_gpus} GPUs, {self.config.short()}"


# ---------------------------------------------------------------------------------------------
# CSV -> PublishedRun

def _group_of(row: dict[str, str]) -> str:
    src, gpu = row["source"], row["gpu_type"]
    if src.startswith("Narayanan"):
        if "Table 1" in src:
            return "sc21-t1"
        if "Table 2" in src:
            return "sc21-t2-zero3" if row["zero_stage_or_fsdp"].startswith("ZeRO-3") else \
                "sc21-t2-ptdp"
    elif src.startswith("NVIDIA/Megatron-LM"):
        return "mlm-h100-strong" if "strong-scaling" in src else "mlm-h100"
    elif src.startswith("mosaicml/"):
        if gpu.startswith("H100"):
            return "mpt-h100"
        if gpu.startswith("A100"):
            return "mpt-a100"
    # the validation set's sources
    elif src.startswith("HF Ultra-Scale Playbook"):
        return "nanotron-h100"
    elif src.startswith("Liu, Yan, Yao") and "MoE Parallel Folding" in src:
        for table, group in ((") Table 3", "mcore-moe-t3"), (") Table 2", "mcore-moe-t2-fp8"),
                             (") Table 5", "mcore-moe-t5-cp")):
            if table in src:
                return group
    elif src.startswith("Qi, Wan, Huang, Lin, 'Zero Bubble Pipeline Parallelism'"):
        return "zb-a100"
    elif src.startswith("pytorch/ao "):
        if "moe_training" in src:
            return "torchao-moe-gb200" if gpu.startswith("GB200") else "torchao-moe-b200"
        for prefix, group in (("H100", "torchao-h100"), ("MI300X", "torchao-mi300x"),
                              ("B200", "torchao-b200")):
            if gpu.startswith(prefix):
                return group
    elif src.startswith("PyTorch blog 'Supercharging Training using float8 and FSDP2'"):
        return "fp8-blog-h100"
    raise ValueError(f"unknown source group for row {row['model_name']!r} ({src[:60]!r}, "
                     f"{gpu!r}); known groups: {', '.join(GROUPS)}")


def _int(row: dict[str, str], key: str) -> int:
    text = row[key].strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"column {key!r} of row {row['model_name']!r} must be an integer, "
                         f"got {text!r}") from None


def _dtype(precision: str) -> str:
    text = precision.lower()
    if "bf16" in text:
        return "bf16"
    if "fp16" in text:
        return "fp16"
    raise ValueError(f"unknown precision {precision!r}; expected text naming bf16 or fp16")


def _run_id(group: str, row: dict[str, str]) -> str:
    n, s = row["n_gpus"], row["seq_len"]
    if group.startswith("mpt"):
        size = row["model_name"].split("-")[-1].lower()
        mem = "-40g" if "40GB" in row["gpu_type"] else ""
        return f"{group}{mem}-{size}-s{s}-n{n}"
    return f"{group}-{float(row['params_billion']):g}b-n{n}"


def _config(group: str, row: dict[str, str], num_layers: int
            ) -> tuple[ParallelConfig, list[str], tuple[tuple[str, Any], ...]]:
    """The ParallelConfig of a row under its group's rules, row-level notes on it, and the
    EstimateOptions fields the row's source sets apart from its group's."""
    tp, pp, dp, cp = (_int(row, k) for k in ("tp", "pp", "dp", "cp"))
    extra: list[str] = []
    options: tuple[tuple[str, Any], ...] = ()
    virtual = None  # the groups' interleaving rule unless the row's source gives it
    if group == "sc21-t1":
        size = float(row["params_billion"])
        if size not in SC21_TABLE1_SCRIPT:
            raise ValueError(f"SC21 Table 1 row {row['model_name']!r}: no {size:g}B case in "
                             f"run_table_1.sh; known: {', '.join(map(str, SC21_TABLE1_SCRIPT))}")
        mbs, per_virtual, ddp = SC21_TABLE1_SCRIPT[size]
        virtual = 1 if per_virtual is None else num_layers // (pp * per_virtual)
        zero, recompute, sp = 0, "full", False
        extra.append(f"run_table_1.sh: MBS={mbs}, DDP={ddp}")
        if ddp == "torch":
            options = (("overlap_dp_comm", True),)
    elif group.startswith("sc21"):
        zero = 3 if group == "sc21-t2-zero3" else 0
        mbs = _int(row, "micro_batch")
        recompute, sp = "full", False
    elif group.startswith("mlm"):
        zero, mbs, recompute, sp = 1, 1, "none", tp > 1
    else:  # MosaicML
        zero, mbs = 3, _int(row, "micro_batch")
        recompute = row["recompute"].strip()
        if recompute not in ("full", "none"):
            raise ValueError(f"MosaicML row {row['model_name']!r}: recompute must be 'full' or "
                             f"'none' (activation checkpointing on/off), got {recompute!r}")
        sp = False
    if virtual is None:
        virtual = interleave_degree(num_layers, pp) if pp > 1 else 1
    schedule = "interleaved-1f1b" if virtual > 1 else "1f1b"
    if virtual > 1:
        extra.append(f"virtual_stages={virtual} ({num_layers // (pp * virtual)} layers per "
                     f"virtual stage)")
    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, zero_stage=zero, micro_batch_size=mbs,
                         pp_schedule=schedule, virtual_stages=virtual, sequence_parallel=sp,
                         recompute=recompute)
    return cfg, extra, options


def _published_step(group: str, row: dict[str, str], *, n_gpus: int, num_layers: int,
                    hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int, seq_len: int,
                    global_batch: int) -> tuple[float, str]:
    metric, value = row["measured_metric"].strip(), float(row["measured_value"])
    if metric == "tokens_per_sec_per_gpu" and group.startswith("mpt"):
        step = mosaicml_step_time_s(global_batch=global_batch, seq_len=seq_len, n_gpus=n_gpus,
                                    tokens_per_s_per_gpu=value)
        return step, (f"MosaicML {value:g} tokens/s/GPU: step = B·s/(n·T) = {global_batch}·"
                      f"{seq_len}/({n_gpus}·{value:g}) = {step:.4g} s")
    if metric == "tflops_per_gpu" and group.startswith("sc21"):
        flops = sc21_iteration_flops(batch=global_batch, seq_len=seq_len, num_layers=num_layers,
                                     hidden=hidden, vocab=vocab)
        step = step_time_from_tflops(flops, n_gpus, value)
        return step, (f"SC21 eq.(3) F = 96·B·s·l·h²(1+s/6h+V/16lh) = {flops:.4e} FLOP; step = "
                      f"F/(n·X) = F/({n_gpus}·{value:g} TFLOP/s) = {step:.4g} s")
    if metric in ("tflops_per_gpu", "mfu") and group.startswith("mlm"):
        tflops = value if metric == "tflops_per_gpu" else value / 100.0 * MEGATRON_MFU_PEAK_TFLOPS
        flops = megatron_model_flops(batch=global_batch, seq_len=seq_len, num_layers=num_layers,
                                     hidden=hidden, ffn_hidden=ffn, num_heads=heads,
                                     num_kv_heads=kv_heads, vocab=vocab)
        step = step_time_from_tflops(flops, n_gpus, tflops)
        via = "" if metric == "tflops_per_gpu" else \
            f"MFU {value:g}% · {MEGATRON_MFU_PEAK_TFLOPS:g} = {tflops:.1f} TFLOP/s; "
        return step, (f"{via}Megatron-LM model FLOPs (2024 form) F = {flops:.4e} FLOP; step = "
                      f"F/(n·X) = F/({n_gpus}·{tflops:.1f} TFLOP/s) = {step:.4g} s")
    raise ValueError(f"no conversion for metric {metric!r} in group {group!r} (row "
                     f"{row['model_name']!r}); known: tokens_per_sec_per_gpu (mpt), "
                     f"tflops_per_gpu (sc21, mlm), mfu (mlm)")


def _row_to_run(row: dict[str, str]) -> PublishedRun:
    group = _group_of(row)
    if group in VALIDATION_GROUPS:
        return _validation_row_to_run(row, group)
    layers, hidden, ffn, heads, kv_heads, seq_len, vocab, n_gpus, gpn, global_batch = (
        _int(row, k) for k in ("n_layers", "hidden", "ffn_hidden", "n_heads", "n_kv_heads",
                               "seq_len", "vocab", "n_gpus", "gpus_per_node", "global_batch"))
    name = row["model_name"]
    if kv_heads != heads:
        raise ValueError(f"{name}: {kv_heads} KV heads for {heads} heads; autopar's GPT is MHA "
                         f"only (a GQA row needs a Llama-style model)")
    if ffn % hidden:
        raise ValueError(f"{name}: ffn_hidden {ffn} is not a multiple of hidden {hidden}; "
                         f"GPTConfig.ffn_mult is an integer")
    if n_gpus % gpn:
        raise ValueError(f"{name}: {n_gpus} GPUs do not fill nodes of {gpn}")
    cfg, extra, option_overrides = _config(group, row, layers)
    if cfg.world_size != n_gpus:
        raise ValueError(f"{name}: dp·tp·pp·cp = {cfg.world_size} but the row has {n_gpus} GPUs")
    if group.startswith("sc21"):
        profile, overrides = "dgx-a100-80g", ()
    elif group.startswith("mlm") or group == "mpt-h100":
        profile, overrides = "dgx-h100", ()
    else:
        profile = "dgx-a100-40g" if "40GB" in row["gpu_type"] else "dgx-a100-80g"
        overrides = (("network_kind", "roce"), ("nics_per_node", 8), ("nic_gbps", 200))
    step, derivation = _published_step(
        group, row, n_gpus=n_gpus, num_layers=layers, hidden=hidden, ffn=ffn, heads=heads,
        kv_heads=kv_heads, vocab=vocab, seq_len=seq_len, global_batch=global_batch)
    notes = row["notes"].strip()
    qualifiers = notes.split("QUALIFIERS:", 1)[1].strip() if "QUALIFIERS:" in notes else ""
    assumptions = GROUP_ASSUMPTIONS[group] + tuple(extra) + (
        (f"CSV qualifiers: {qualifiers}",) if qualifiers else ())
    return PublishedRun(
        run_id=_run_id(group, row), group=group, source=row["source"], model_name=name,
        num_layers=layers, hidden=hidden, ffn_hidden=ffn, num_heads=heads,
        num_kv_heads=kv_heads, vocab_size=vocab, seq_len=seq_len,
        params_billion=float(row["params_billion"]),
        tie_embeddings=not group.startswith("mlm"), profile=profile,
        num_nodes=n_gpus // gpn, cluster_overrides=overrides, config=cfg,
        global_batch_size=global_batch, dtype=_dtype(row["precision"]),
        metric=row["measured_metric"].strip(), metric_value=float(row["measured_value"]),
        published_step_time_s=step, step_time_derivation=derivation, assumptions=assumptions,
        notes=notes, option_overrides=option_overrides,
        dropout=0.1 if group.startswith("sc21") else 0.0, kinds=_kinds(row))


# ---------------------------------------------------------------------------------------------
# Validation rows -> PublishedRun (the groups of benchmarks/data/published_runs_validation.csv)

# hardware profile and overrides per validation group (GROUP_ASSUMPTIONS say why)
_VALIDATION_CLUSTERS: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = {
    "nanotron-h100": ("dgx-h100", ()),
    "mcore-moe-t3": ("dgx-h100", ()),
    "mcore-moe-t2-fp8": ("dgx-h100", ()),
    "mcore-moe-t5-cp": ("dgx-h100", ()),
    "zb-a100": ("dgx-a100-80g", (("network_kind", "roce"),)),
    "torchao-h100": ("dgx-h100", ()),
    "torchao-mi300x": ("mi300x-8", ()),
    "torchao-b200": ("dgx-b200", ()),
    "torchao-moe-b200": ("dgx-b200", (("gpus_per_node", 4), ("nics_per_node", 4))),
    "torchao-moe-gb200": ("gb200-nvl72", (("gpus_per_node", 64), ("nics_per_node", 64))),
    "fp8-blog-h100": ("dgx-h100", (("network_kind", "roce"), ("nics_per_node", 8),
                                   ("nic_gbps", 400))),
}

# Zero Bubble Table 4's schedule column -> (autopar schedule, what the mapping is)
_ZB_SCHEDULES = {
    "1F1B": ("1f1b", "Megatron-LM's non-interleaved 1F1B"),
    "1F1B-I": ("interleaved-1f1b", "Megatron-LM's interleaved 1F1B, one layer per chunk"),
    "ZB-1p": ("zero-bubble", "ZB-1p -> autopar's ZB-H1 (the same 1F1B activation memory)"),
    "ZB-2p": ("zero-bubble", "ZB-2p -> autopar's ZB-H1 (approximation: ZB-2p holds twice the "
                             "activations to close the bubble that ZB-H1 keeps; leans slow)"),
}


def _opt_int(row: dict[str, str], key: str, default: int) -> int:
    return _int(row, key) if row[key].strip() else default


def _kinds(row: dict[str, str]) -> tuple[str, ...]:
    """The KINDS a row is of, from its precision, moe_experts and cp columns."""
    kinds = []
    if row["precision"].strip().lower().startswith(("fp8", "mxfp8")):
        kinds.append("fp8")
    if row["moe_experts"].strip():
        kinds.append("moe")
    if _opt_int(row, "cp", 1) > 1:
        kinds.append("cp")
    if kinds:
        return tuple(kinds)
    a100 = row["gpu_type"].strip().startswith("A100")
    return ("dense", "dense-a100" if a100 else "dense-newer")


def _slug(text: str) -> str:
    return "-".join(part for part in "".join(c.lower() if c.isalnum() else " "
                                             for c in text).split())


def _validation_precision(text: str) -> tuple[str, str | None, str | None, str | None]:
    """(dtype, fp8 recipe, a note on the mapping, a refusal) of a validation row's precision
    column (its conventions: the low-precision format first, never 'bf16' in a low-precision
    row's text)."""
    t = text.strip().lower()
    if t.startswith("mxfp8 partial"):
        return "fp8", "rowwise", None, (
            f"precision {text.strip()!r}: fp8 on only part of the Linear layers -- the cost "
            f"model runs every Linear GEMM in fp8 or none")
    if t.startswith("mxfp8"):
        return "fp8", "rowwise", ("mxfp8 -> fp8_recipe='rowwise' (approximation: the cost "
                                  "model has no MX block-scaling recipe)"), None
    if t.startswith("fp8"):
        if "delayed" in t:
            return "fp8", "delayed", None, None
        if "rowwise_with_gw_hp" in t:
            note = ("rowwise_with_gw_hp -> fp8_recipe='rowwise' (approximation: its weight-"
                    "gradient GEMM runs in bf16)")
            return "fp8", "rowwise", note, None
        if "rowwise" in t:
            return "fp8", "rowwise", None, None
        if "tensorwise" in t:
            return "fp8", "tensorwise", None, None
        raise ValueError(f"fp8 precision {text!r} names no scaling recipe (delayed, tensorwise, "
                         f"rowwise)")
    for dtype in ("bf16", "fp16"):
        if t.startswith(dtype):
            return dtype, None, None, None
    raise ValueError(f"unknown precision {text!r}; expected bf16, fp16, fp8 or mxfp8 first")


def _precision_slug(text: str) -> str:
    t = text.strip().lower()
    if t.startswith("mxfp8 partial"):
        return "mxfp8-linears" if "dense linears only" in t else "mxfp8-experts"
    if t.startswith("mxfp8"):
        return "mxfp8-rceil" if "rceil" in t else "mxfp8"
    if t.startswith("fp8"):
        for recipe in ("delayed", "rowwise_with_gw_hp", "rowwise", "tensorwise"):
            if recipe in t:
                return "fp8-" + recipe.replace("_with_", "-").replace("_", "-")
    return t.split()[0]


def _note(notes: str, pattern: str, what: str, row: dict[str, str]) -> str:
    found = re.search(pattern, notes)
    if not found:
        raise ValueError(f"row {row['model_name']!r}: its notes give no {what} "
                         f"(pattern {pattern!r})")
    return found.group(1)


def _validation_config(group: str, row: dict[str, str], notes: str
                       ) -> tuple[ParallelConfig, list[str], str]:
    """The ParallelConfig of a validation row under its group's rules, row-level notes on it,
    and the run-id suffix that tells the row apart within its group."""
    tp, pp, dp, cp = (_int(row, k) for k in ("tp", "pp", "dp", "cp"))
    ep = _opt_int(row, "ep", 1)
    zero_text, rc_text = row["zero_stage_or_fsdp"].strip(), row["recompute"].strip()
    extra: list[str] = []
    schedule, virtual, sp, etp = "1f1b", 1, tp > 1, 0
    if group == "nanotron-h100":
        zero = 1 if zero_text.startswith("ZeRO-1") else 0
        if not zero and "ZeRO-0" not in zero_text:
            raise ValueError(f"nanotron row {row['model_name']!r}: ZeRO column {zero_text!r}")
        mbs, recompute = _int(row, "micro_batch"), "none"
        if tp > _int(row, "gpus_per_node"):
            extra.append(f"tp={tp} spans {tp // _int(row, 'gpus_per_node')} nodes (the heatmap "
                         f"cell as printed)")
        suffix = f"{float(row['params_billion']):g}b-n{row['n_gpus']}"
    elif group.startswith("mcore-moe"):
        method = _note(notes, r"method '([^']+)'", "Table method", row)
        zero = 3 if zero_text.startswith("FSDP") else 1
        mbs, recompute = 1, "none"
        if "MoE Parallel Folding" in notes:
            etp = 1
            extra.append(f"MoE Parallel Folding: ETP1, EP{ep} folded over the attention TP{tp} "
                         f"x CP{cp} x DP{dp} ranks (etp=1)")
        suffix = f"{_slug(row['model_name'])}-{_slug(method.replace('w/', ''))}"
        if group == "mcore-moe-t5-cp":
            suffix += f"-s{_int(row, 'seq_len') // 1024}k"
    elif group == "zb-a100":
        label = _note(notes, r"Schedule column: ([^.|]+?)\.", "schedule", row).strip()
        if label not in _ZB_SCHEDULES:
            raise ValueError(f"Zero Bubble row {row['model_name']!r}: schedule {label!r} is not "
                             f"one of {', '.join(_ZB_SCHEDULES)}")
        schedule, what = _ZB_SCHEDULES[label]
        if schedule == "interleaved-1f1b":
            virtual = _int(row, "virtual_pipeline_stages")
        zero, mbs, recompute, sp = 0, _int(row, "micro_batch"), "none", False
        extra.append(f"schedule {label}: {what}")
        suffix = (f"{float(row['params_billion']):g}b-{_slug(label)}-b{row['global_batch']}")
    else:  # torchtitan: FSDP2
        if not zero_text.startswith("FSDP"):
            raise ValueError(f"torchtitan row {row['model_name']!r}: FSDP expected, got "
                             f"{zero_text!r}")
        zero, mbs = 3, _int(row, "micro_batch")
        if group == "fp8-blog-h100":
            recompute = "full"  # GROUP_ASSUMPTIONS: torchtitan's 70B/405B configs
        elif rc_text.startswith("selective (per-op"):
            recompute = "per_op"
        elif rc_text in ("none", "full", "selective"):
            recompute = rc_text
        else:
            raise ValueError(f"row {row['model_name']!r}: recompute {rc_text!r}")
        suffix = _precision_slug(row["precision"])
        if group == "fp8-blog-h100":
            suffix = f"{_slug(row['model_name'])}-{suffix}"
    if virtual > 1:
        schedule = "interleaved-1f1b"
    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, zero_stage=zero,
                         micro_batch_size=mbs, pp_schedule=schedule, virtual_stages=virtual,
                         sequence_parallel=sp, recompute=recompute)
    return cfg, extra, suffix


def _validation_published_step(group: str, row: dict[str, str], *, n_gpus: int,
                               num_layers: int, hidden: int, ffn: int, heads: int,
                               kv_heads: int, vocab: int, seq_len: int, global_batch: int,
                               top_k: int, shared_ffn: int) -> tuple[float, str]:
    metric, value = row["measured_metric"].strip(), float(row["measured_value"])
    if metric == "tokens_per_sec_per_gpu":
        step = step_time_from_tokens_per_gpu(global_batch=global_batch, seq_len=seq_len,
                                             n_gpus=n_gpus, tokens_per_s_per_gpu=value)
        return step, (f"{value:g} tokens/s/GPU: step = B·s/(n·T) = {global_batch}·{seq_len}/"
                      f"({n_gpus}·{value:g}) = {step:.4g} s")
    if metric == "mfu" and group == "nanotron-h100":
        tflops = value / 100.0 * NANOTRON_MFU_PEAK_TFLOPS
        flops = nanotron_model_flops(batch=global_batch, seq_len=seq_len, num_layers=num_layers,
                                     hidden=hidden, ffn_hidden=ffn, num_heads=heads,
                                     num_kv_heads=kv_heads, vocab=vocab)
        step = step_time_from_tflops(flops, n_gpus, tflops)
        return step, (f"MFU {value:g}% · {NANOTRON_MFU_PEAK_TFLOPS:g} = {tflops:.1f} TFLOP/s; "
                      f"nanotron get_flops F = {flops:.4e} FLOP; step = F/(n·X) = {step:.4g} s")
    if metric in ("mfu", "tflops_per_gpu") and group.startswith("mcore-moe"):
        tflops = value if metric == "tflops_per_gpu" else value / 100.0 * MOE_FOLDING_PEAK_TFLOPS
        flops = megatron_model_flops(batch=global_batch, seq_len=seq_len, num_layers=num_layers,
                                     hidden=hidden, ffn_hidden=ffn, num_heads=heads,
                                     num_kv_heads=kv_heads, vocab=vocab, swiglu=True,
                                     experts_routed_to=top_k, shared_ffn_hidden=shared_ffn)
        step = step_time_from_tflops(flops, n_gpus, tflops)
        via = ("" if metric == "tflops_per_gpu" else
               f"MFU {value:g}% · {MOE_FOLDING_PEAK_TFLOPS:g} = {tflops:.1f} TFLOP/s; ")
        return step, (f"{via}Megatron-LM model FLOPs (SwiGLU, top-{top_k}"
                      f"{f', shared expert {shared_ffn}' if shared_ffn else ''}) F = "
                      f"{flops:.4e} FLOP; step = F/(n·X) = F/({n_gpus}·{tflops:.1f} TFLOP/s) = "
                      f"{step:.4g} s")
    raise ValueError(f"no conversion for metric {metric!r} in group {group!r} (row "
                     f"{row['model_name']!r}); known: tokens_per_sec_per_gpu, mfu (nanotron-h100, "
                     f"mcore-moe-*), tflops_per_gpu (mcore-moe-*)")


def _validation_row_to_run(row: dict[str, str], group: str) -> PublishedRun:
    layers, hidden, ffn, heads, kv_heads, seq_len, vocab, n_gpus, global_batch = (
        _int(row, k) for k in ("n_layers", "hidden", "ffn_hidden", "n_heads", "n_kv_heads",
                               "seq_len", "vocab", "n_gpus", "global_batch"))
    name, notes = row["model_name"], row["notes"].strip()
    experts, top_k = _opt_int(row, "moe_experts", 0), _opt_int(row, "moe_topk", 0)
    if experts:
        arch = "moe"
        shared = re.search(r"shared expert of ffn (\d+)", notes)
        shared_ffn = int(shared.group(1)) if shared else 0
        gated = bool(shared) and "sigmoid gate" in notes
    elif group == "zb-a100":
        arch, shared_ffn, gated = "gpt", 0, False
        if kv_heads != heads or ffn % hidden:
            raise ValueError(f"{name}: the Zero Bubble rows are GPT-3-like (MHA, ffn a multiple "
                             f"of hidden)")
    else:
        arch, shared_ffn, gated = "llama", 0, False
    cfg, extra, suffix = _validation_config(group, row, notes)
    if cfg.world_size != n_gpus:
        raise ValueError(f"{name}: dp·tp·pp·cp = {cfg.world_size} but the row has {n_gpus} GPUs")
    dtype, recipe, precision_note, refusal = _validation_precision(row["precision"])
    options: tuple[tuple[str, Any], ...] = ()
    if recipe is not None and recipe != SOFTWARE[group][0].get("fp8_recipe"):
        options = (("fp8_recipe", recipe),)
    extra += [precision_note] if precision_note else []
    if shared_ffn:
        extra.append(f"shared expert of ffn {shared_ffn}{' (sigmoid-gated)' if gated else ''} "
                     f"built beside the routed experts (MoEWithSharedExpert)")
    profile, overrides = _VALIDATION_CLUSTERS[group]
    gpn = dict(overrides).get("gpus_per_node", _int(row, "gpus_per_node"))
    if n_gpus % gpn:
        raise ValueError(f"{name}: {n_gpus} GPUs do not fill nodes of {gpn}")
    step, derivation = _validation_published_step(
        group, row, n_gpus=n_gpus, num_layers=layers, hidden=hidden, ffn=ffn, heads=heads,
        kv_heads=kv_heads, vocab=vocab, seq_len=seq_len, global_batch=global_batch,
        top_k=top_k, shared_ffn=shared_ffn)
    qualifiers = notes.split("QUALIFIERS:", 1)[1].strip() if "QUALIFIERS:" in notes else ""
    assumptions = GROUP_ASSUMPTIONS[group] + tuple(extra) + (
        (f"CSV qualifiers: {qualifiers}",) if qualifiers else ())
    return PublishedRun(
        run_id=f"{group}-{suffix}", group=group, source=row["source"], model_name=name,
        num_layers=layers, hidden=hidden, ffn_hidden=ffn, num_heads=heads,
        num_kv_heads=kv_heads, vocab_size=vocab, seq_len=seq_len,
        params_billion=float(row["params_billion"]),
        tie_embeddings=(group == "zb-a100" or (group == "nanotron-h100" and ffn < 10000)),
        profile=profile, num_nodes=n_gpus // gpn, cluster_overrides=overrides, config=cfg,
        global_batch_size=global_batch, dtype=dtype, metric=row["measured_metric"].strip(),
        metric_value=float(row["measured_value"]), published_step_time_s=step,
        step_time_derivation=derivation, assumptions=assumptions, notes=notes,
        option_overrides=options, dropout=0.1 if group == "zb-a100" else 0.0, arch=arch,
        num_experts=experts, top_k=top_k, shared_expert_ffn=shared_ffn,
        shared_expert_gated=gated, refusal=refusal, kinds=_kinds(row))


def load_runs(path: str | Path | None = None) -> list[PublishedRun]:
    """Every row of a published-runs CSV (default: the calibration CSV; `HELDOUT_CSV` for the
    held-out rows) as a `PublishedRun`, in file order."""
    csv_path = Path(path) if path is not None else DEFAULT_CSV
    if not csv_path.is_file():
        raise FileNotFoundError(
            f"published-runs CSV not found at {csv_path}; the calibration set is "
            f"benchmarks/data/published_runs_calibration.csv, or pass load_runs(path=...)")
    with csv_path.open(newline="") as fh:
        runs = [_row_to_run(row) for row in csv.DictReader(fh)]
    ids = [r.run_id for r in runs]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"duplicate run ids in {csv_path}: {dupes}")
    return runs


# ---------------------------------------------------------------------------------------------
# The benchmark

@dataclass(frozen=True)
class Outcome:
    """One run's estimate. status: "ok" (`est` holds it), "refused" (the cost model cannot
    express the row as published, or the estimate refuses its configuration with
    InvalidConfigError: `reason` says why) or "failed" (any other error: a bug)."""

    run: PublishedRun
    status: str
    reason: str = ""
    est: Any = None

    @property
    def error_pct(self) -> float:
        """Predicted over published step time, less one, in percent (status "ok" only)."""
        return (self.est.step_time_s / self.run.published_step_time_s - 1.0) * 100.0

    @property
    def fits(self) -> bool:
        return bool(self.est.fits)


def estimate_run(run: PublishedRun) -> Outcome:
    """`autopar.estimate` of one run with its group's software, or why it has none."""
    from autopar import estimate  # lazy: load_runs needs no estimate

    if run.refusal:
        return Outcome(run, "refused", run.refusal)
    try:
        est = estimate(run.build_model(), run.make_cluster(), run.config,
                       global_batch_size=run.global_batch_size, seq_len=run.seq_len,
                       dtype=run.dtype, options=run.options())
    except InvalidConfigError as exc:
        return Outcome(run, "refused", f"the estimate refuses the configuration: {exc}")
    except Exception as exc:  # a benchmark reports every row; one failure is not the table
        return Outcome(run, "failed", f"{type(exc).__name__}: {exc}")
    return Outcome(run, "ok", est=est)


def estimate_runs(runs: list[PublishedRun], *, table: bool = True) -> list[Outcome]:
    """Every run's Outcome, in order; with `table`, each printed as a row as it comes."""
    width = max([34] + [len(r.run_id) for r in runs])
    if table:
        header = (f"{'id':<{width}} {'model':<26} {'GPUs':>5}  {'config':<50} {'pub s':>9} "
                  f"{'pred s':>9} {'err %':>7}  {'fits':<5} {'peak GB':>8}")
        print(header)
        print("-" * len(header))
    outcomes = []
    for run in runs:
        out = estimate_run(run)
        outcomes.append(out)
        if not table:
            continue
        lead = (f"{run.run_id:<{width}} {run.model_name[:26]:<26} {run.n_gpus:>5}  "
                f"{run.config.short():<50} {run.published_step_time_s:9.3f}")
        if out.status == "ok":
            print(f"{lead} {out.est.step_time_s:9.3f} {out.error_pct:+7.1f}  "
                  f"{str(out.fits):<5} {out.est.peak_memory_bytes / 1e9:8.1f}")
        else:
            print(f"{lead}  {out.status.upper()}: {out.reason}")
    return outcomes


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary_stats(outcomes: list[Outcome]) -> dict[str, Any]:
    """n (estimated), median and p90 |error| and mean error (percent; None without estimates),
    refused, failed, and not_fit: configurations that ran but are predicted not to fit."""
    errors = [o.error_pct for o in outcomes if o.status == "ok"]
    abs_err = [abs(e) for e in errors]
    return {
        "n": len(errors),
        "median": statistics.median(abs_err) if errors else None,
        "p90": _percentile(abs_err, 90) if errors else None,
        "mean": statistics.mean(errors) if errors else None,
        "refused": sum(o.status == "refused" for o in outcomes),
        "failed": sum(o.status == "failed" for o in outcomes),
        "not_fit": sum(o.status == "ok" and not o.fits for o in outcomes),
    }


def _summary_line(label: str, outcomes: list[Outcome], width: int = 18) -> str:
    st = summary_stats(outcomes)
    tail = f"  refused {st['refused']:<3} not fit {st['not_fit']}" + (
        f"  FAILED {st['failed']}" if st["failed"] else "")
    if not st["n"]:
        return f"  {label:<{width}} n=0  {'':<64}{tail}"
    return (f"  {label:<{width}} n={st['n']:<3} median |err| {st['median']:6.1f}%  "
            f"p90 |err| {st['p90']:6.1f}%  mean err {st['mean']:+6.1f}%{tail}")


def _kind_lines(outcomes: list[Outcome]) -> list[str]:
    lines = ["by kind of run (a row may be of several; target: median / p90 |err|):"]
    for kind, (label, (med, p90)) in KINDS.items():
        of_kind = [o for o in outcomes if kind in o.run.kinds]
        if not of_kind:
            continue
        st = summary_stats(of_kind)
        met = st["n"] and st["median"] <= med and st["p90"] <= p90 and not st["not_fit"]
        verdict = "met" if met else "missed"
        lines.append(f"{_summary_line(label, of_kind, width=38):<126}  target {med:g}%/"
                     f"{p90:g}%: {verdict}")
    return lines


def _report_set(outcomes: list[Outcome]) -> None:
    """The per-set summary: all rows, each group, each kind (validation rows), refusals and
    configurations predicted not to fit."""
    print()
    print("step-time error, predicted vs published:")
    print(_summary_line("all", outcomes))
    for group in dict.fromkeys(o.run.group for o in outcomes):
        print(_summary_line(group, [o for o in outcomes if o.run.group == group]))
    if any(o.run.set_name == "validation" for o in outcomes):
        print()
        for line in _kind_lines(outcomes):
            print(line)
    refused = [o for o in outcomes if o.status == "refused"]
    if refused:
        print()
        print(f"refused ({len(refused)}):")
        for o in refused:
            print(f"  {o.run.run_id}: {o.reason}")
    not_fit = [o for o in outcomes if o.status == "ok" and not o.fits]
    if not_fit:
        print()
        print(f"ran but predicted not to fit ({len(not_fit)}):")
        for o in not_fit:
            print(f"  {o.run.run_id}: peak {o.est.peak_memory_bytes / 1e9:.2f} GB of "
                  f"{o.est.usable_memory_bytes / 1e9:.2f} GB usable")
    failed = [o for o in outcomes if o.status == "failed"]
    if failed:
        print()
        print(f"{len(failed)} run(s) failed to estimate:")
        for o in failed:
            print(f"  {o.run.run_id}: {o.reason}")


def _side_by_side(sets: dict[str, list[Outcome]]) -> None:
    print()
    print("=" * 100)
    print("calibration and validation side by side (step-time error, predicted vs published)")
    print(f"{'set':<12} {'group':<20} {'n':>4} {'median|err|':>12} {'p90|err|':>9} "
          f"{'mean err':>9} {'refused':>8} {'not fit':>8}")

    def row(set_name: str, label: str, outcomes: list[Outcome]) -> str:
        st = summary_stats(outcomes)
        nums = (f"{st['median']:11.1f}% {st['p90']:8.1f}% {st['mean']:+8.1f}%" if st["n"]
                else f"{'-':>12} {'-':>9} {'-':>9}")
        failed = f"  FAILED {st['failed']}" if st["failed"] else ""
        return (f"{set_name:<12} {label:<20} {st['n']:>4} {nums} {st['refused']:>8} "
                f"{st['not_fit']:>8}{failed}")

    for set_name, outcomes in sets.items():
        print(row(set_name, "(all)", outcomes))
        for group in dict.fromkeys(o.run.group for o in outcomes):
            print(row("", group, [o for o in outcomes if o.run.group == group]))
    validation = sets.get("validation", [])
    if validation:
        print()
        print("validation, " + _kind_lines(validation)[0])
        for line in _kind_lines(validation)[1:]:
            print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", default=None,
                        help=f"published-runs CSV (default: the calibration CSV {DEFAULT_CSV}; "
                             f"held-out rows: {HELDOUT_CSV.relative_to(ROOT)}; validation set: "
                             f"{VALIDATION_CSV.relative_to(ROOT)})")
    parser.add_argument("--validation", action="store_true",
                        help="run the calibration and the validation set: both tables, both "
                             "summaries, then the two side by side (per set, group and kind)")
    parser.add_argument("--summary-only", action="store_true",
                        help="leave the per-row tables out")
    parser.add_argument("--group", choices=sorted(GROUPS), default=None,
                        help="only the rows of one source group")
    parser.add_argument("--assumptions", action="store_true",
                        help="print each group's software and documented assumptions first")
    args = parser.parse_args(argv)
    if args.validation and args.csv:
        parser.error("--validation runs the calibration and validation CSVs; leave out --csv")

    paths = ({"calibration": DEFAULT_CSV, "validation": VALIDATION_CSV} if args.validation
             else {"calibration" if args.csv is None else Path(args.csv).stem:
                   Path(args.csv) if args.csv else DEFAULT_CSV})
    started = time.perf_counter()
    sets: dict[str, list[Outcome]] = {}
    for set_name, path in paths.items():
        runs = [r for r in load_runs(path) if args.group in (None, r.group)]
        if not runs:
            continue
        if args.validation:
            print(f"=== {set_name}: {path.relative_to(ROOT)} ({len(runs)} rows)")
        if args.assumptions:
            for group in dict.fromkeys(r.group for r in runs):
                print(f"[{group}] {GROUPS[group]}")
                print(f"  software: {SOFTWARE[group][1]}")
                for text in GROUP_ASSUMPTIONS[group]:
                    print(f"  - {text}")
            print()
        sets[set_name] = estimate_runs(runs, table=not args.summary_only)
        _report_set(sets[set_name])
        if args.validation:
            print()
    if args.validation:
        _side_by_side(sets)
    n = sum(len(v) for v in sets.values())
    print(f"\n{n} rows in {time.perf_counter() - started:.1f} s")
    return 1 if any(o.status == "failed" for v in sets.values() for o in v) else 0


if __name__ == "__main__":
    sys.exit(main())
