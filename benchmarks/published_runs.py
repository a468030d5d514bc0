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

Run: python benchmarks/published_runs.py [--csv PATH] [--group GROUP]
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autopar.cluster import Cluster  # noqa: E402
from autopar.config import ParallelConfig  # noqa: E402
from autopar.models import GPT, GPTConfig, build  # noqa: E402

__all__ = [
    "DEFAULT_CSV", "GROUPS", "GROUP_ASSUMPTIONS", "HELDOUT_CSV", "MEGATRON_MFU_PEAK_TFLOPS",
    "PublishedRun", "interleave_degree", "load_runs", "main", "megatron_model_flops",
    "mosaicml_flops_per_token", "mosaicml_step_time_s", "sc21_iteration_flops", "step_time_from_tflops",
]

DEFAULT_CSV = ROOT / "benchmarks" / "data" / "published_runs_calibration.csv"
# held-out validation rows (same columns, disjoint from DEFAULT_CSV; see the module docstring)
HELDOUT_CSV = ROOT / "benchmarks" / "data" / "llm_foundry_a100_heldout.csv"

# Megatron-LM README "Performance Benchmarking" (r0.8.0): MFU = TFLOP/s / 989 (H100 SXM dense
# BF16 peak), e.g. its 474.4 TFLOP/s row reads 48 % MFU.
MEGATRON_MFU_PEAK_TFLOPS = 989.0

GROUPS = {
    "sc21-t1": "SC21 Table 1: PTD-P weak scaling, Selene DGX A100",
    "sc21-t2-zero3": "SC21 Table 2: DeepSpeed ZeRO-3, no model parallelism",
    "sc21-t2-ptdp": "SC21 Table 2: PTD-P",
    "mlm-h100": "Megatron-LM README: H100 weak scaling",
    "mlm-h100-strong": "Megatron-LM README: H100 strong scaling (MFU endpoints)",
    "mpt-h100": "MosaicML llm-foundry MPT: H100 80GB",
    "mpt-a100": "MosaicML llm-foundry MPT: A100, 1600 Gbps RoCE",
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


# ---------------------------------------------------------------------------------------------
# FLOP counts and metric conversions (pure functions; closed forms tested by hand)

def sc21_iteration_flops(*, batch: int, seq_len: int, num_layers: int, hidden: int,
                         vocab: int) -> float:
    """SC21 eq. (3): FLOPs of one iteration with full recompute (its extra forward counted)."""
    b, s, l, h, v = batch, seq_len, num_layers, hidden, vocab
    return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))


def megatron_model_flops(*, batch: int, seq_len: int, num_layers: int, hidden: int,
                         ffn_hidden: int, num_heads: int, num_kv_heads: int, vocab: int) -> float:
    """Megatron-LM's reported FLOPs per iteration, 2024 form (no recompute, full s×s attention).

    Forward GEMMs per layer per sequence: QKV 2·s·h·(h + 2·h_kv), scores and context
    2·(2·s²·h), output projection 2·s·h², MLP 2·(2·s·h·f); logits 2·s·h·V; backward is twice
    the forward. GELU MLP (no SwiGLU), head dim h/a.
    """
    b, s, l, h, f, v = batch, seq_len, num_layers, hidden, ffn_hidden, vocab
    h_kv = h * num_kv_heads // num_heads
    layer = 2 * s * h * (h + 2 * h_kv) + 4 * s * s * h + 2 * s * h * h + 4 * s * h * f
    return 3.0 * b * (l * layer + 2 * s * h * v)


def step_time_from_tflops(flops: float, n_gpus: int, tflops_per_gpu: float) -> float:
    """Seconds per step when n GPUs each sustain `tflops_per_gpu` on `flops` per step."""
    return flops / (n_gpus * tflops_per_gpu * 1e12)


def mosaicml_step_time_s(*, global_batch: int, seq_len: int, n_gpus: int,
                         tokens_per_s_per_gpu: float) -> float:
    """MosaicML throughput (tokens/s/GPU) -> seconds per optimizer step."""
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

    @property
    def n_gpus(self) -> int:
        return self.config.world_size

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.cluster_overrides)

    def model_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size, max_seq_len=self.seq_len, dim=self.hidden,
                         n_layers=self.num_layers, n_heads=self.num_heads,
                         ffn_mult=self.ffn_hidden // self.hidden,
                         tie_embeddings=self.tie_embeddings, dropout=self.dropout)

    def build_model(self, device: str = "meta") -> GPT:
        """The GPT of this run (meta device by default: no memory)."""
        return build(self.model_config(), device=device)

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
        dropout=0.1 if group.startswith("sc21") else 0.0)


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

def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _summary_line(label: str, errors: list[float]) -> str:
    if not errors:
        return f"  {label:<18} n=0"
    abs_err = [abs(e) for e in errors]
    return (f"  {label:<18} n={len(errors):<3} median |err| {statistics.median(abs_err):6.1f}%  "
            f"p90 |err| {_percentile(abs_err, 90):6.1f}%  mean err {statistics.mean(errors):+6.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", default=None,
                        help=f"published-runs CSV (default: the calibration CSV {DEFAULT_CSV}; "
                             f"held-out rows: {HELDOUT_CSV.relative_to(ROOT)})")
    parser.add_argument("--group", choices=sorted(GROUPS), default=None,
                        help="only the rows of one source group")
    parser.add_argument("--assumptions", action="store_true",
                        help="print each group's documented assumptions first")
    args = parser.parse_args(argv)

    runs = [r for r in load_runs(args.csv) if args.group in (None, r.group)]
    if args.assumptions:
        for group in dict.fromkeys(r.group for r in runs):
            print(f"[{group}] {GROUPS[group]}")
            for text in GROUP_ASSUMPTIONS[group]:
                print(f"  - {text}")
        print()

    from autopar import EstimateOptions, estimate  # lazy: load_runs needs no estimate

    header = (f"{'id':<34} {'model':<26} {'GPUs':>5}  {'config':<50} {'pub s':>9} "
              f"{'pred s':>9} {'err %':>7}  {'fits':<5} {'peak GB':>8}")
    print(header)
    print("-" * len(header))
    errors: dict[str, list[float]] = {}
    failures = 0
    for run in runs:
        try:
            est = estimate(run.build_model(), run.make_cluster(), run.config,
                           global_batch_size=run.global_batch_size, seq_len=run.seq_len,
                           dtype=run.dtype, options=run.options())
        except Exception as exc:  # a benchmark reports every row; one failure is not the table
            failures += 1
            print(f"{run.run_id:<34} {run.model_name[:26]:<26} {run.n_gpus:>5}  "
                  f"{run.config.short():<50} {run.published_step_time_s:9.3f}  "
                  f"FAILED {type(exc).__name__}: {exc}")
            continue
        err = (est.step_time_s / run.published_step_time_s - 1.0) * 100.0
        errors.setdefault(run.group, []).append(err)
        print(f"{run.run_id:<34} {run.model_name[:26]:<26} {run.n_gpus:>5}  "
              f"{run.config.short():<50} {run.published_step_time_s:9.3f} "
              f"{est.step_time_s:9.3f} {err:+7.1f}  {str(bool(est.fits)):<5} "
              f"{est.peak_memory_bytes / 1e9:8.1f}")

    print()
    print("step-time error, predicted vs published:")
    print(_summary_line("all", [e for errs in errors.values() for e in errs]))
    for group, errs in errors.items():
        print(_summary_line(group, errs))
    if failures:
        print(f"  {failures} run(s) failed to estimate")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
