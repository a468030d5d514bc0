"""Measure one CUDA GPU the way the cost model describes it, and write what was measured.

Run on a machine with a CUDA GPU (never in CI):

    python benchmarks/gpu_calibrate.py --out DIR [--quick]

It writes ``DIR/gpu_measurements.json`` (and prints a summary table) with four sections, each
the median of several CUDA-event-timed repetitions after warm-up, on random data:

- ``gemm``: bf16 ``torch.nn.functional.linear`` shapes of transformer layers (tokens x in x
  out for qkv, attention output, MLP and vocabulary GEMMs over hidden sizes and tp degrees) in
  their three training forms: forward ``y = x Wᵀ``, input gradient ``dx = dy W`` and weight
  gradient ``dW = dyᵀ x``.
- ``attention``: ``scaled_dot_product_attention`` forward and forward+backward per backend
  (flash, cuDNN, memory-efficient) and an unfused bf16 attention (scores materialized), causal
  and not, head dims 64 and 128.
- ``alignment``: GEMMs over GPT-2's unaligned 50,257-token vocabulary and the padded 50,304.
- ``optimizer``: the passes of a mixed-precision optimizer step (AdamW fused, foreach and
  for-loop; master-to-model weight copy; gradient norm and clip scaling; gradient cast) over
  1-8 Llama-3-8B layers' parameters, giving the bandwidth each achieves.
- ``loss``: bytes per logit the eager cross-entropy (fp32 upcast) allocates, forward and backward.
- ``memory``: a device copy, LayerNorm, GELU and an add over activation-sized tensors
  (forward and backward), giving achieved HBM bandwidth.
- ``steps``: training steps of autopar.models transformers on one GPU (bf16 autocast, fp32
  weights, fused AdamW: 16 bytes of state per parameter, like mixed-precision Adam), with the
  median step time, the peak allocated bytes and a profiler summary of kernel time by kind
  (GEMM, attention, optimizer, other) and the idle remainder.
- ``ranking`` (only when named in ``--sections``: about 5 minutes on an H100): for a few
  one-GPU training problems (`RANKING`: model, sequence length, global batch B), every
  candidate autopar.compile chooses among on one GPU -- each micro-batch size mb dividing B,
  recompute none and full -- timed as a whole step of the global batch (B/mb micro-batches of
  gradient accumulation, then one optimizer step; the steps section's "bf16" precision), with
  the median step time, the peak allocated bytes and an ``oom`` flag for a candidate that ran
  out of memory. ("selective" recompute is not a candidate: autopar's selective recompute
  re-runs the attention core, which the fused SDPA kernels of these models already do, so
  compile only searches it for attention that keeps its scores.) benchmarks/gpu_ranking.py
  compares it with the ranking of autopar.compile. ``--dry-run`` runs this section on the CPU
  with a tiny model, to check the harness where there is no GPU.

`tests/data/h100_measurements.json` is such a file; benchmarks/gpu_check.py compares it with the
cost model on any machine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from costmodels.compute import OPTIMIZER_PASS_BYTES  # noqa: E402

HIDDEN = (1024, 2048, 2304, 3072, 4096, 5120, 6144, 8192, 12288)
TOKENS = (2048, 4096, 8192, 16384)
TP = (1, 2, 4, 8)
MAX_GEMM_FLOPS = 3e12  # larger GEMMs sit on the asymptote; timing them only costs lease time


def _time_ms(fn, *, target_ms: float = 30.0, min_reps: int = 5, max_reps: int = 200) -> float:
    """Median milliseconds of one call of `fn`, timed as training issues kernels: several calls
    queued back to back between two CUDA events (so host launch latency overlaps the previous
    kernel, as in an eager training step), after warm-up."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    batch = max(1, min(50, int(1.0 / once)))  # about a millisecond of queued work per sample
    reps = int(min(max_reps, max(min_reps, target_ms / (once * batch))))
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return statistics.median(times)


def gemm_shapes(quick: bool) -> list[tuple[str, int, int, int]]:
    """(kind, tokens, in, out) of bf16 linear layers, deduplicated."""
    shapes = set()
    hidden = HIDDEN[::2] if quick else HIDDEN
    for h in hidden:
        for tp in TP:
            for m in TOKENS:
                for kind, k, n in (("qkv", h, 3 * h // tp), ("proj", h // tp, h),
                                   ("fc1", h, 4 * h // tp), ("fc2", 4 * h // tp, h)):
                    if 2 * m * k * n <= MAX_GEMM_FLOPS:
                        shapes.add((kind, m, k, n))
    for v in (51200, 131072):
        for h in (2048, 4096, 8192):
            for tp in TP:
                if 2 * 4096 * h * v // tp <= MAX_GEMM_FLOPS:
                    shapes.add(("vocab", 4096, h, v // tp))
    return sorted(shapes)


def measure_gemms(quick: bool) -> list[dict]:
    rows = []
    dev, dt = "cuda", torch.bfloat16
    for kind, m, k, n in gemm_shapes(quick):
        x = torch.randn(m, k, device=dev, dtype=dt)
        w = torch.randn(n, k, device=dev, dtype=dt)
        dy = torch.randn(m, n, device=dev, dtype=dt)
        flops = 2.0 * m * k * n
        for form, fn in (("fwd", lambda: F.linear(x, w)),
                         ("dgrad", lambda: dy @ w),
                         ("wgrad", lambda: dy.t() @ x)):
            ms = _time_ms(fn)
            rows.append({"kind": kind, "form": form, "m": m, "k": k, "n": n, "flops": flops,
                         "ms": ms, "tflops": flops / ms / 1e9})
        del x, w, dy
    return rows


def measure_alignment() -> list[dict]:
    """bf16 GEMMs whose output width is GPT-2's 50,257-token vocabulary (not a multiple of 8:
    rows are not 16-byte aligned) next to the same GEMM padded to 50,304, in the three forms."""
    rows = []
    for m in (2048, 8192):
        for k in (1024, 2048, 4096):
            for n in (50257, 50304):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
                flops = 2.0 * m * k * n
                for form, fn in (("fwd", lambda: F.linear(x, w)), ("dgrad", lambda: dy @ w),
                                 ("wgrad", lambda: dy.t() @ x)):
                    ms = _time_ms(fn)
                    rows.append({"form": form, "m": m, "k": k, "n": n, "flops": flops,
                                 "ms": ms, "tflops": flops / ms / 1e9})
                del x, w, dy
    return rows


def measure_loss_memory() -> list[dict]:
    """Bytes per logit (T tokens x V classes) the eager loss of autopar's runtime allocates
    beyond the bf16 logits: ``F.cross_entropy(logits.float(), labels)``, its forward peak, what
    it keeps for backward, and its backward peak (the logits' gradient included)."""
    rows = []
    for tokens in (2048, 8192):
        for vocab in (32000, 50304, 128256):
            torch.cuda.empty_cache()
            logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16,
                                 requires_grad=True)
            labels = torch.randint(0, vocab, (tokens,), device="cuda")
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss = F.cross_entropy(logits.float(), labels)
            fwd_peak = torch.cuda.max_memory_allocated() - base
            kept = torch.cuda.memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            bwd_peak = torch.cuda.max_memory_allocated() - base
            n = tokens * vocab
            rows.append({"tokens": tokens, "vocab": vocab, "fwd_peak_per_logit": fwd_peak / n,
                         "kept_per_logit": kept / n, "bwd_peak_per_logit": bwd_peak / n})
            del logits, labels, loss
    return rows


# One Llama-3-8B layer's parameters (4096 wide, SwiGLU 14336, two norms): 218 M in 9 tensors.
_OPT_LAYER = ((4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096),
              (14336, 4096), (4096, 14336), (4096,), (4096,))
# Bytes each pass must move per parameter at least (fp32 master, m, v and gradient): the cost
# model's for the passes it counts, and the clip's scaling, the gradient cast and a copy
OPT_PASS_BYTES = {"adamw_fused": OPTIMIZER_PASS_BYTES["adam"],
                  "adamw_foreach": OPTIMIZER_PASS_BYTES["adam"],
                  "adamw_forloop": OPTIMIZER_PASS_BYTES["adam"],
                  "master_to_model": OPTIMIZER_PASS_BYTES["master_copy"],
                  "grad_norm": OPTIMIZER_PASS_BYTES["grad_norm"],
                  "clip_scale": 8, "grad_cast": 6, "copy_fp32": 8}


def measure_optimizer(quick: bool) -> list[dict]:
    """The optimizer-step passes of mixed-precision training over the parameters of 1, 4 and 8
    Llama-3-8B layers: an AdamW step (fused, foreach and for-loop) over fp32 weights, gradients
    and states; the copy of the fp32 master weights into the bf16 model weights; the global
    gradient norm of clipping and its scaling; the cast of bf16 gradients to fp32; and a plain
    fp32 copy of the same size for reference. Each row: median ms and the bytes moved at least
    (`OPT_PASS_BYTES` per parameter)."""
    rows = []
    for layers in ((1, 4) if quick else (1, 4, 8)):
        torch.cuda.empty_cache()
        shapes = [s for _ in range(layers) for s in _OPT_LAYER]
        params = [torch.randn(s, device="cuda") for s in shapes]
        grads = [torch.randn_like(p) * 1e-3 for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        numel = sum(p.numel() for p in params)
        model = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
        low_grads = [g.to(torch.bfloat16) for g in grads]
        spare = [torch.empty_like(p) for p in params]
        cases = {
            "master_to_model": lambda: torch._foreach_copy_(model, params),
            "grad_cast": lambda: torch._foreach_copy_(spare, low_grads),
            "copy_fp32": lambda: torch._foreach_copy_(spare, grads),
            "grad_norm": lambda: torch.linalg.vector_norm(
                torch.stack(torch._foreach_norm(grads))),
            "clip_scale": lambda: torch._foreach_mul_(grads, 1.0),
        }
        for impl in ("fused", "foreach", "forloop"):
            flags = {"fused": {"fused": True}, "foreach": {"foreach": True},
                     "forloop": {"foreach": False}}[impl]
            opt = torch.optim.AdamW(params, lr=1e-6, **flags)
            cases[f"adamw_{impl}"] = opt.step
        for name, fn in cases.items():
            ms = _time_ms(fn, target_ms=60.0)
            moved = OPT_PASS_BYTES[name] * numel
            rows.append({"pass": name, "params": numel, "tensors": len(params), "ms": ms,
                         "bytes": moved, "gb_per_s": moved / ms / 1e6})
        del params, grads, model, low_grads, spare, cases, opt
    return rows


def _unfused_attention(q, k, v, is_causal):
    """Attention with a materialized score matrix in bf16, as Megatron-LM before flash
    attention ran it: a scaled batched GEMM, a softmax (with the causal mask), a second GEMM."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if is_causal:
        s = q.shape[-2]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu_(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def measure_attention(quick: bool) -> list[dict]:
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    sdpa = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
    # SDPA's own math backend computes in fp32 for bf16 inputs; "unfused" is the bf16 path
    backends = {**{name: (F.scaled_dot_product_attention, lambda b=b: sdpa_kernel(b))
                   for name, b in sdpa.items()},
                "unfused": (_unfused_attention, contextlib.nullcontext)}
    seqs = (2048, 8192) if quick else (1024, 2048, 4096, 8192)
    for name, (attention, context) in backends.items():
        for d in (64, 128):
            for s in seqs:
                heads = 2048 // d  # 16 heads of 128 or 32 of 64: a 2048-wide tp shard
                b = max(1, 8192 // s)
                q, k, v = (torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))
                go = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16)
                for causal in (True, False):
                    flops_fwd = 4.0 * b * heads * s * s * d  # full square, as the IR counts
                    try:
                        with context():
                            fwd_ms = _time_ms(lambda: attention(q, k, v, is_causal=causal))

                            def fwd_bwd():
                                out = attention(q, k, v, is_causal=causal)
                                out.backward(go)
                            both_ms = _time_ms(fwd_bwd)
                    except RuntimeError as err:  # backend unavailable for this shape
                        rows.append({"backend": name, "d": d, "s": s, "b": b, "heads": heads,
                                     "causal": causal, "error": str(err)[:200]})
                        continue
                    q.grad = k.grad = v.grad = None
                    rows.append({"backend": name, "d": d, "s": s, "b": b, "heads": heads,
                                 "causal": causal, "flops_fwd": flops_fwd, "fwd_ms": fwd_ms,
                                 "bwd_ms": both_ms - fwd_ms})
                del q, k, v, go
    return rows


def measure_memory_ops() -> list[dict]:
    rows = []
    for m, h in ((8192, 2048), (16384, 4096), (8192, 12288)):
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        ln = torch.nn.LayerNorm(h, device="cuda", dtype=torch.bfloat16)
        nbytes = m * h * 2
        out = torch.empty_like(y)
        cases = {
            "copy": (lambda: out.copy_(y), 2 * nbytes),
            "add": (lambda: torch.add(x.detach(), y, out=out), 3 * nbytes),
            "layernorm_fwd": (lambda: ln(x.detach()), 2 * nbytes),
            "gelu_fwd": (lambda: F.gelu(x.detach()), 2 * nbytes),
            "layernorm_fwd_bwd": (lambda: ln(x).backward(y), 6 * nbytes),
            "gelu_fwd_bwd": (lambda: F.gelu(x).backward(y), 5 * nbytes),
        }
        for name, (fn, moved) in cases.items():
            ms = _time_ms(fn)
            rows.append({"op": name, "m": m, "h": h, "bytes": moved, "ms": ms,
                         "gb_per_s": moved / ms / 1e6})
        del x, y, out
    return rows


# Training steps: (id, preset or config overrides, seq_len, micro-batch, recompute)
STEPS = (
    ("gpt3-1.3b-s2048-mb1", "gpt3-1.3b", {}, 2048, 1, "none"),
    ("gpt3-1.3b-s2048-mb4", "gpt3-1.3b", {}, 2048, 4, "none"),
    ("gpt3-1.3b-s2048-mb8", "gpt3-1.3b", {}, 2048, 8, "none"),
    ("gpt3-1.3b-s2048-mb4-full", "gpt3-1.3b", {}, 2048, 4, "full"),
    ("gpt2-medium-s1024-mb8", "gpt2-medium", {}, 1024, 8, "none"),
    # Megatron H100 1.7B row per GPU: h 2304, 24 layers, 131072 vocab, seq 4096, mb 1
    ("mlm-1.7b-s4096-mb1", "gpt", {"dim": 2304, "n_layers": 24, "n_heads": 24,
                                    "vocab_size": 131072, "tie_embeddings": False}, 4096, 1, "none"),
    # MPT-1b per GPU (h 2048, 24 layers, 16 heads, vocab 50368), a smaller micro-batch
    ("mpt-1b-s2048-mb8", "gpt", {"dim": 2048, "n_layers": 24, "n_heads": 16,
                                  "vocab_size": 50368}, 2048, 8, "none"),
    # MPT-13b widths (h 5120, 40 heads) on 4 of its 40 layers, seq 2048, mb 2
    ("mpt-13b-l4-s2048-mb2", "gpt", {"dim": 5120, "n_layers": 4, "n_heads": 40,
                                      "vocab_size": 50368}, 2048, 2, "none"),
    # GPT-3 175B widths on 2 layers, mb 1 (SC21 ZeRO-3 per-GPU shape), full recompute
    ("gpt3-175b-l2-s2048-mb1-full", "gpt", {"dim": 12288, "n_layers": 2, "n_heads": 96,
                                            "vocab_size": 51200}, 2048, 1, "full"),
    # Llama-3-8B widths on 4 layers, seq 8192 (GQA, SwiGLU, RMSNorm, RoPE)
    ("llama3-8b-l4-s8192-mb1", "llama3-8b", {"n_layers": 4}, 8192, 1, "none"),
)


# Ranking problems: (id, preset or config overrides, seq_len, global batch). Each is measured
# for every micro-batch size dividing the global batch, recompute none and full.
RANKING = (
    # GPT-3 1.3B: mb 16 without recompute needs ~86 GiB of tensors (the estimate)
    ("gpt3-1.3b-s2048-b16", "gpt3-1.3b", {}, 2048, 16),
    # Llama-3-8B widths on 4 layers at seq 8192: mb 4 does not fit even with full recompute
    ("llama3-8b-l4-s8192-b8", "llama3-8b", {"n_layers": 4}, 8192, 8),
    # Llama-3-8B widths on 12 layers at seq 4096: no recompute fits at mb 1 only (tightly),
    # full recompute up to mb 2
    ("llama3-8b-l12-s4096-b8", "llama3-8b", {"n_layers": 12}, 4096, 8),
    # GPT-3 2.7B (h 2560, 32 layers): no recompute fits up to mb 4 only, full up to mb 16
    ("gpt3-2.7b-s2048-b16", "gpt", {"dim": 2560, "n_layers": 32, "n_heads": 32,
                                    "vocab_size": 50257}, 2048, 16),
)
# the CPU dry run's problem: a tiny GPT
RANKING_DRY_RUN = (
    ("tiny-gpt-s64-b4", "gpt", {"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 512},
     64, 4),
)


def _build(preset: str, overrides: dict, seq_len: int, device: str = "cuda"):
    from autopar.models import GPTConfig, build

    if preset == "gpt":
        cfg = GPTConfig(max_seq_len=seq_len, **overrides)
        return build(cfg, device=device, dtype=torch.float32)
    extra = {"max_seq_len": seq_len} if preset.startswith("gpt") else {}
    return build(preset, device=device, dtype=torch.float32, **overrides, **extra)


def _kernel_kind(name: str) -> str:
    low = name.lower()
    if low.startswith("triton_"):  # inductor's generated kernels fuse memory-bound ops (their
        return "other"             # names may mention a neighbouring attention or matmul)
    if any(t in low for t in ("flash", "fmha", "cudnn", "attn", "sdpa")):
        return "attention"
    if any(t in low for t in ("gemm", "nvjet", "xmma", "cutlass", "sm90", "sm80", "matmul")):
        return "gemm"
    if any(t in low for t in ("adam", "multi_tensor", "foreach")):
        return "optimizer"
    return "other"


def measure_step(step_id, preset, overrides, seq_len, mb, recompute, *, steps: int,
                 precision: str, accumulation: int = 1, warmup: int = 3, profile: bool = True,
                 top_kernels: int = 60, device: str = "cuda") -> dict:
    """One training step. precision "autocast": fp32 weights under bf16 autocast (norms and the
    residual stream stay fp32, weights are cast per use); "bf16": bf16 weights, activations and
    gradients, fp32 master weights and Adam states (Megatron / FSDP mixed precision);
    "compiled": "bf16" with the forward and the loss under torch.compile, so inductor fuses the
    memory-bound ops the way fused-kernel training software does (GEMMs stay cuBLAS).

    `accumulation` micro-batches of `mb` sequences make one step: each runs forward and
    backward (its loss divided by `accumulation`; autograd adds each micro-batch's gradients
    into the bf16 ``.grad``), then the master gradients are cast once and the optimizer steps
    once. `warmup` untimed steps come first; `profile` adds one profiled step (kernel time by
    kind). `device` "cpu" is for dry runs only (no memory statistics)."""
    from torch.utils.checkpoint import checkpoint

    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = _build(preset, overrides, seq_len, device)
    masters = None
    if precision in ("bf16", "compiled"):
        model.to(torch.bfloat16)
        masters = [p.detach().float() for p in model.parameters()]
    if recompute == "full":
        for block in model.layers:
            block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False,
                                                                  **k))(block.forward)
    params = list(model.parameters())
    opt = torch.optim.AdamW(masters or params, lr=1e-4, fused=True)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (accumulation * mb, seq_len + 1), device=device)
    batches = [(tokens[i * mb:(i + 1) * mb, :-1], tokens[i * mb:(i + 1) * mb, 1:])
               for i in range(accumulation)]

    def forward_loss(x, y):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "autocast"):
            logits = model(x)
        return F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())

    if precision == "compiled":
        forward_loss = torch.compile(forward_loss)

    def step():
        for x, y in batches:
            loss = forward_loss(x, y)
            if accumulation > 1:
                loss = loss / accumulation
            loss.backward()
        if masters is not None:
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
                p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        if masters is not None:
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
        return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    reserved = torch.cuda.max_memory_reserved() if cuda else 0
    # cudaMalloc retries in the timed steps (the allocator freeing its cache to fit a block)
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries if cuda else 0
    numel = sum(p.numel() for p in params)
    row = {"id": step_id, "preset": preset, "overrides": overrides, "seq_len": seq_len,
           "micro_batch": mb, "recompute": recompute, "params": numel, "precision": precision,
           "accumulation": accumulation,
           "step_s": statistics.median(times), "step_s_all": times,
           "peak_allocated_bytes": peak, "peak_reserved_bytes": reserved,
           "alloc_retries": retries}
    if profile:
        from torch.profiler import ProfilerActivity, profile as profiler

        with profiler(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) \
                as prof:
            step()
            sync()
        kinds: dict[str, float] = {}
        kernels = 0
        for ev in prof.key_averages():
            dev_us = getattr(ev, "self_device_time_total", None)
            if dev_us is None:
                dev_us = getattr(ev, "self_cuda_time_total", 0.0)
            if dev_us <= 0:
                continue
            kinds[_kernel_kind(ev.key)] = kinds.get(_kernel_kind(ev.key), 0.0) + dev_us / 1e6
            kernels += ev.count
        top = sorted(((ev.key, (getattr(ev, "self_device_time_total", 0.0) or 0.0) / 1e6,
                       ev.count) for ev in prof.key_averages()), key=lambda t: -t[1])
        row.update(kernel_s_by_kind=kinds, kernels=kernels,
                   top_kernels=[{"name": n[:120], "s": s, "count": c}
                                for n, s, c in top[:top_kernels]])
    del model, opt, params, masters
    return row


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def measure_ranking(problems=RANKING, *, steps: int = 4, warmup: int = 2, profile: bool = False,
                    device: str = "cuda", log=print) -> list[dict]:
    """Every one-GPU candidate of each problem (micro-batch size dividing the global batch,
    recompute none and full) as a whole "bf16" training step of the global batch: the
    measure_step row (median of `steps` timed steps after `warmup`, peak bytes; with `profile`
    one more profiled step's kernel time by kind) plus the problem's id and global batch and
    ``oom`` False, or
    for a candidate that ran out of GPU memory ``oom`` True, the peak allocated bytes reached
    before it did and the allocator's message."""
    import gc

    cuda = device == "cuda"
    rows = []
    for problem, preset, overrides, seq_len, batch in problems:
        for mb in _divisors(batch):
            for recompute in ("none", "full"):
                t0 = time.time()
                head = {"problem": problem, "global_batch": batch}
                try:
                    row = measure_step(f"{problem}-mb{mb}-{recompute}", preset, overrides,
                                       seq_len, mb, recompute, steps=steps, precision="bf16",
                                       accumulation=batch // mb, warmup=warmup,
                                       profile=profile and cuda, top_kernels=12,
                                       device=device)
                    row = {**head, **row, "oom": False}
                except Exception as err:  # noqa: BLE001  (keep the other candidates)
                    # out of memory: the caching allocator's error, or a library's failed
                    # workspace allocation (cuBLAS, cuDNN) near the limit
                    text = f"{type(err).__name__}: {err}"
                    oom = isinstance(err, torch.cuda.OutOfMemoryError) or any(
                        t in text for t in ("out of memory", "ALLOC_FAILED"))
                    row = {**head, "id": f"{problem}-mb{mb}-{recompute}", "preset": preset,
                           "overrides": overrides, "seq_len": seq_len, "micro_batch": mb,
                           "recompute": recompute, "precision": "bf16",
                           "accumulation": batch // mb, "oom": oom,
                           "peak_allocated_bytes": torch.cuda.max_memory_allocated()
                           if cuda else 0, "error": text.splitlines()[0][:300]}
                    del err
                gc.collect()  # the failed step's frames held its tensors
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                rows.append(row)
                log(f"ranking {row['id']}: "
                    + (row["error"][:80] if "error" in row else f"{row['step_s'] * 1e3:.1f} ms")
                    + f", peak {row['peak_allocated_bytes'] / 2**30:.2f} GiB "
                    f"({time.time() - t0:.0f} s)", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="env,memory,alignment,loss,optimizer,attention,gemm,steps",
                    help="comma-separated; 'ranking' (not in the default) times every one-GPU "
                         "candidate of the RANKING problems")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ranking-steps", type=int, default=4,
                    help="timed steps per ranking candidate (after 2 warm-up steps)")
    ap.add_argument("--ranking-profile", action="store_true",
                    help="profile one more step per ranking candidate (kernel time by kind)")
    ap.add_argument("--dry-run", action="store_true",
                    help="run the ranking section on the CPU with a tiny model (no GPU needed)")
    ap.add_argument("--precision", default="bf16,autocast,compiled",
                    help="training precisions of the steps section, comma-separated: bf16, "
                         "autocast, compiled (bf16 under torch.compile; steps without "
                         "recompute only)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.out.mkdir(parents=True, exist_ok=True)
        rows = measure_ranking(RANKING_DRY_RUN, steps=2, warmup=1, device="cpu")
        path = args.out / "gpu_measurements.json"
        path.write_text(json.dumps({"device": "cpu (dry run)", "ranking": rows}, indent=1))
        print(f"wrote {path}")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: this program measures a GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_measurements.json"
    props = torch.cuda.get_device_properties(0)
    result = {"date": time.strftime("%Y-%m-%d"), "device": props.name,
              "sm_count": props.multi_processor_count, "memory_bytes": props.total_memory,
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "cudnn": torch.backends.cudnn.version()}
    sections = args.sections.split(",")
    for name, fn in (("memory", measure_memory_ops), ("alignment", measure_alignment),
                     ("loss", measure_loss_memory),
                     ("optimizer", lambda: measure_optimizer(args.quick)),
                     ("attention", lambda: measure_attention(args.quick)),
                     ("gemm", lambda: measure_gemms(args.quick))):
        if name in sections:
            t0 = time.time()
            result[name] = fn()
            print(f"{name}: {len(result[name])} rows in {time.time() - t0:.0f} s", flush=True)
            path.write_text(json.dumps(result, indent=1))
    if "steps" in sections:
        result["steps"] = []
        for spec, precision in [(s, p) for p in args.precision.split(",") for s in STEPS
                                if p != "compiled" or s[5] == "none"]:
            t0 = time.time()
            try:
                row = measure_step(*spec, steps=args.steps, precision=precision)
            except Exception as err:  # noqa: BLE001  (keep the other measurements)
                row = {"id": spec[0], "precision": precision,
                       "error": f"{type(err).__name__}: {str(err)[:300]}"}
            result["steps"].append(row)
            path.write_text(json.dumps(result, indent=1))
            print(f"step {spec[0]} {precision}: {row.get('step_s', float('nan')) * 1e3:.1f} ms, peak "
                  f"{row.get('peak_allocated_bytes', 0) / 2**30:.2f} GiB, "
                  f"{row.get('kernel_s_by_kind', row.get('error'))} ({time.time() - t0:.0f} s)",
                  flush=True)
    if "ranking" in sections:
        t0 = time.time()
        result["ranking"] = []
        for problem in RANKING:  # written after each problem, so a cut-off run keeps the rest
            result["ranking"] += measure_ranking((problem,), steps=args.ranking_steps,
                                                 profile=args.ranking_profile)
            path.write_text(json.dumps(result, indent=1))
        print(f"ranking: {len(result['ranking'])} rows in {time.time() - t0:.0f} s", flush=True)
    gemm = result.get("gemm", [])
    if gemm:
        best = max(r["tflops"] for r in gemm)
        print(f"gemm: {len(gemm)} timings, best {best:.0f} TFLOP/s, median "
              f"{statistics.median(r['tflops'] for r in gemm):.0f}")
    for r in result.get("optimizer", []):
        print(f"optimizer {r['pass']:16s} {r['params'] / 1e9:5.2f} B params {r['ms']:8.2f} ms "
              f"{r['gb_per_s']:6.0f} GB/s")
    for r in result.get("attention", []):
        if "error" not in r:
            work = r["flops_fwd"] * (0.5 if r["causal"] else 1.0)
            print(f"attn {r['backend']:9s} d={r['d']:3d} s={r['s']:5d} causal={r['causal']!s:5s} "
                  f"fwd {work / r['fwd_ms'] / 1e9:6.0f} bwd {2.5 * work / r['bwd_ms'] / 1e9:6.0f} "
                  f"TFLOP/s")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
