"""Measure on one CUDA GPU the kernels whose cost the estimate models beyond a bf16 GEMM, and
write what was measured.

Run on a machine with a CUDA GPU (never in CI):

    python benchmarks/gpu_kernels.py --out DIR [--sections fp8_gemm,fp8_cast,...]

It writes ``DIR/gpu_kernels.json`` after each section (a run cut short keeps what it measured),
each timing the median of CUDA-event-timed repetitions after warm-up, on random data:

- ``fp8_gemm``: transformer-layer GEMMs (Llama-3 8B and 70B widths at tp 1, 4 and 8) in bf16
  and through ``torch._scaled_mm`` in float8 e4m3 with a per-tensor scale and with row-wise
  scales, and the backward's e5m2 x e4m3 form.
- ``fp8_cast``: quantising a bf16 tensor to e4m3 with a dynamic per-tensor scale (absolute
  maximum, scale, cast), eager (three passes) and under ``torch.compile`` (fused), with the
  transposed copy the backward needs; bytes moved per element follow from the times.
- ``fp8_step``: forward and backward of a stack of Llama-3-8B-wide blocks (RMSNorm, q/k/v/o
  projections, causal SDPA with 8 kv heads, SwiGLU MLP) with bf16 Linears and with Float8
  Linears (``autopar.runtime.fp8``'s: dynamic tensorwise scaling, input and weight cast to e4m3
  in forward, the output gradient to e5m2 in backward, the float8 copies saved for backward),
  eager and compiled:
  step time and the activation memory saved for backward.
- ``cp_attention``: flash attention (SDPA) forward and backward on the chunk lengths context
  parallelism gives each ring step (a chunk's queries against a chunk's keys, causal on the
  diagonal and full off it), 256 to 32K tokens.
- ``moe``: an expert MLP's GEMMs over E experts with T tokens per expert, as one grouped GEMM
  (``torch._grouped_mm``) and as a loop of per-expert GEMMs, against one dense GEMM of the same
  FLOPs; the permutation of routed tokens (gather and scatter-add of their rows) and the router
  (GEMM, softmax, top-k).
- ``recompute``: autopar's Llama-3-8B-wide model (4 layers, 8K tokens, bf16 weights) trained
  with recompute none, full (each block checkpointed) and per-op selective (torchtitan's
  policy: a block's matmul outputs saved except every second one, attention outputs saved):
  activation bytes held after the forward, peak bytes over the step above the weights and
  gradients, and step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.gpu_calibrate import _build, _time_ms  # noqa: E402
from autopar.runtime.fp8 import float8_linear, quantize  # noqa: E402

BF16 = torch.bfloat16


def _tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


# ------------------------------------------------------------------------------------------ fp8

def _fp8_shapes() -> list[tuple[str, int, int, int]]:
    """(name, tokens, in, out): Llama-3-8B (h 4096, kv 1024, ffn 14336) and 70B (h 8192, kv
    1024, ffn 28672) layer GEMMs at tp 1, 4 and 8, over 4K and 16K tokens."""
    shapes = []
    for model, h, kv, ffn in (("8b", 4096, 1024, 14336), ("70b", 8192, 1024, 28672)):
        for tp in (1, 4, 8):
            for m in (4096, 16384):
                for kind, k, n in (("qkv", h, (h + 2 * kv) // tp), ("o", h // tp, h),
                                   ("gate_up", h, 2 * ffn // tp), ("down", ffn // tp, h)):
                    if 2 * m * k * n <= 4e12:
                        shapes.append((f"{model}-tp{tp}-{kind}", m, k, n))
    return shapes


def measure_fp8_gemm() -> list[dict]:
    rows = []
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    one = torch.ones((), device="cuda")
    for name, m, k, n in _fp8_shapes():
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        w = torch.randn(n, k, device="cuda", dtype=BF16)
        dy = torch.randn(m, n, device="cuda", dtype=BF16)
        xq, wq, gq = x.to(e4m3), w.to(e4m3), dy.to(e5m2)
        wq_t = wq.t().contiguous().t()  # (n, k) column-major: the dgrad's right operand
        row_a = torch.ones(m, 1, device="cuda")
        row_b = torch.ones(1, n, device="cuda")
        flops = 2.0 * m * k * n
        row = {"name": name, "m": m, "k": k, "n": n, "flops": flops,
               "bf16_ms": _time_ms(lambda: F.linear(x, w))}
        forms = {
            "fp8_tensorwise_ms": lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                          out_dtype=BF16),
            "fp8_rowwise_ms": lambda: torch._scaled_mm(xq, wq.t(), scale_a=row_a,
                                                       scale_b=row_b, out_dtype=BF16),
            "fp8_dgrad_e5m2_ms": lambda: torch._scaled_mm(gq, wq_t, scale_a=one, scale_b=one,
                                                          out_dtype=BF16),
            "bf16_dgrad_ms": lambda: dy @ w,
        }
        for key, fn in forms.items():
            try:
                row[key] = _time_ms(fn)
            except RuntimeError as err:
                row[key.replace("_ms", "_error")] = str(err)[:200]
        rows.append(row)
        print(f"fp8_gemm {name:18s} m={m:5d} bf16 {_tflops(flops, row['bf16_ms']):5.0f} "
              f"fp8 {_tflops(flops, row.get('fp8_tensorwise_ms', float('nan'))):5.0f} "
              f"rowwise {_tflops(flops, row.get('fp8_rowwise_ms', float('nan'))):5.0f} TFLOP/s",
              flush=True)
    return rows


def measure_fp8_cast() -> list[dict]:
    rows = []
    e4m3 = torch.float8_e4m3fn

    def cast_t(x):  # the cast and its transposed copy, as a backward's wgrad needs it
        q, s = quantize(x, e4m3)
        return q, q.t().contiguous(), s

    compiled = torch.compile(lambda x: quantize(x, e4m3))
    compiled_t = torch.compile(cast_t)
    for m, k in ((8192, 4096), (16384, 8192), (8192, 14336)):
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        row = {"m": m, "k": k, "elements": m * k,
               "eager_ms": _time_ms(lambda: quantize(x, e4m3)),
               "eager_with_transpose_ms": _time_ms(lambda: cast_t(x)),
               "copy_bf16_ms": _time_ms(lambda: x.clone())}
        try:
            row["compiled_ms"] = _time_ms(lambda: compiled(x))
            row["compiled_with_transpose_ms"] = _time_ms(lambda: compiled_t(x))
        except Exception as err:  # noqa: BLE001  (inductor unavailable: keep the eager rows)
            row["compiled_error"] = f"{type(err).__name__}: {str(err)[:200]}"
        rows.append(row)
        gbs = 2 * 2 * m * k / row["copy_bf16_ms"] / 1e6
        print(f"fp8_cast {m}x{k}: eager {row['eager_ms']:.3f} ms, compiled "
              f"{row.get('compiled_ms', float('nan')):.3f} ms, bf16 copy {row['copy_bf16_ms']:.3f} "
              f"ms ({gbs:.0f} GB/s)", flush=True)
    return rows


class _Linear(torch.nn.Module):
    def __init__(self, k, n, fp8):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k, device="cuda", dtype=BF16) * k ** -0.5)
        self.fp8 = fp8

    def forward(self, x):
        if not self.fp8:
            return F.linear(x, self.weight)
        return float8_linear(x, self.weight, out_dtype=BF16)


class _Block(torch.nn.Module):
    def __init__(self, h, heads, kv_heads, ffn, fp8):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, h // heads
        self.qkv = _Linear(h, h + 2 * kv_heads * self.hd, fp8)
        self.o = _Linear(h, h, fp8)
        self.gate_up = _Linear(h, 2 * ffn, fp8)
        self.down = _Linear(ffn, h, fp8)
        self.n1 = torch.nn.RMSNorm(h, device="cuda", dtype=BF16)
        self.n2 = torch.nn.RMSNorm(h, device="cuda", dtype=BF16)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.n1(x)).split(
            [h, self.kv_heads * self.hd, self.kv_heads * self.hd], -1)
        q = q.view(b, s, self.heads, self.hd).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.n2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


def _timed_steps(step, count: int) -> tuple[float, int, int]:
    """(median ms of `count` CUDA-event-timed calls of `step` after two untimed ones, bytes
    allocated before them -- weights and, once a backward has run, gradients -- and the peak
    allocated above that over the timed calls)."""
    step()
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(count):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), base, torch.cuda.max_memory_allocated() - base


def measure_fp8_step(*, layers: int = 4, batch: int = 2, seq: int = 4096) -> list[dict]:
    rows = []
    for mode in ("bf16", "fp8", "bf16-compiled", "fp8-compiled"):
        torch.manual_seed(0)
        torch.cuda.empty_cache()
        fp8 = mode.startswith("fp8")
        model = torch.nn.Sequential(*[_Block(4096, 32, 8, 14336, fp8) for _ in range(layers)])
        x = torch.randn(batch, seq, 4096, device="cuda", dtype=BF16, requires_grad=True)
        fwd = torch.compile(model) if mode.endswith("compiled") else model
        saved = {}

        def step():
            before = torch.cuda.memory_allocated()
            y = fwd(x)
            saved["bytes"] = torch.cuda.memory_allocated() - before
            y.float().square().mean().backward()

        row = {"mode": mode, "layers": layers, "tokens": batch * seq}
        t0 = time.time()
        try:
            step_ms, _, peak = _timed_steps(step, 6)
            row.update(step_ms=step_ms, saved_bytes=saved["bytes"], peak_above_base_bytes=peak)
        except Exception as err:  # noqa: BLE001  (keep the other modes)
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        rows.append(row)
        print(f"fp8_step {mode:14s} {row.get('step_ms', float('nan')):8.2f} ms, saved "
              f"{row.get('saved_bytes', 0) / 2**30:.2f} GiB ({time.time() - t0:.0f} s) "
              f"{row.get('error', '')}", flush=True)
    return rows


# --------------------------------------------------------------------------------- cp attention

def measure_cp_attention() -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for heads in (32, 8):
        for c in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768):
            q, k, v = (torch.randn(1, heads, c, 128, device="cuda", dtype=BF16,
                                   requires_grad=True) for _ in range(3))
            go = torch.randn(1, heads, c, 128, device="cuda", dtype=BF16)
            for causal in (True, False):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    fwd_ms = _time_ms(lambda: F.scaled_dot_product_attention(
                        q, k, v, is_causal=causal))

                    def fwd_bwd():
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(go)
                    both_ms = _time_ms(fwd_bwd)
                flops = 4.0 * heads * c * c * 128 * (0.5 if causal else 1.0)
                rows.append({"heads": heads, "d": 128, "chunk": c, "causal": causal,
                             "flops_fwd": flops, "fwd_ms": fwd_ms, "bwd_ms": both_ms - fwd_ms})
                q.grad = k.grad = v.grad = None
            print(f"cp_attention heads={heads} chunk={c:6d}: full fwd "
                  f"{_tflops(rows[-1]['flops_fwd'], rows[-1]['fwd_ms']):5.0f} bwd "
                  f"{_tflops(2.5 * rows[-1]['flops_fwd'], rows[-1]['bwd_ms']):5.0f} TFLOP/s",
                  flush=True)
    return rows


# ------------------------------------------------------------------------------------------ moe

def measure_moe() -> list[dict]:
    rows = []
    grouped = getattr(torch, "_grouped_mm", None)
    for label, experts, h, f in (("mixtral", 8, 4096, 14336), ("fine", 64, 7168, 2048)):
        for per_expert in (64, 128, 256, 512, 1024, 2048, 4096):
            tokens = experts * per_expert
            if 2.0 * tokens * h * f > 3e12:
                continue
            x = torch.randn(tokens, h, device="cuda", dtype=BF16)
            w = torch.randn(experts, h, f, device="cuda", dtype=BF16)
            offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * per_expert
            xs = list(x.split(per_expert))
            dense_w = torch.randn(h, f, device="cuda", dtype=BF16)
            flops = 2.0 * tokens * h * f
            row = {"layer": label, "experts": experts, "h": h, "f": f,
                   "tokens_per_expert": per_expert, "flops": flops,
                   "loop_ms": _time_ms(lambda: [a @ w[i] for i, a in enumerate(xs)]),
                   "dense_ms": _time_ms(lambda: x @ dense_w)}
            if grouped is not None:  # the weights as stored (E, h, f), else (E, f, h)ᵀ
                w_t = w.transpose(-2, -1).contiguous().transpose(-2, -1)
                for layout, b in (("row", w), ("column", w_t)):
                    try:
                        row["grouped_ms"] = _time_ms(lambda: grouped(x, b, offs=offs,
                                                                     out_dtype=BF16))
                        row["grouped_layout"] = layout
                        break
                    except RuntimeError as err:
                        row[f"grouped_{layout}_error"] = str(err)[:200]
            rows.append(row)
            print(f"moe {label} E={experts} T/E={per_expert:5d}: dense "
                  f"{_tflops(flops, row['dense_ms']):5.0f} grouped "
                  f"{_tflops(flops, row.get('grouped_ms', float('nan'))):5.0f} loop "
                  f"{_tflops(flops, row['loop_ms']):5.0f} TFLOP/s", flush=True)
    # permutation and router over 16K tokens of top-2 (Mixtral) and top-8 (fine-grained)
    for label, experts, h, top_k in (("mixtral", 8, 4096, 2), ("fine", 64, 7168, 8)):
        tokens = 16384
        x = torch.randn(tokens, h, device="cuda", dtype=BF16)
        router = torch.randn(experts, h, device="cuda", dtype=BF16)
        index = torch.randint(0, tokens, (tokens * top_k,), device="cuda")
        routed = torch.randn(tokens * top_k, h, device="cuda", dtype=BF16)

        def route():
            probs = torch.softmax(F.linear(x, router).float(), -1)
            return torch.topk(probs, top_k, -1)

        rows.append({"layer": label, "op": "permute", "tokens": tokens, "top_k": top_k, "h": h,
                     "rows_moved": tokens * top_k,
                     "gather_ms": _time_ms(lambda: x.index_select(0, index)),
                     "scatter_add_ms": _time_ms(
                         lambda: torch.zeros_like(x).index_add_(0, index, routed)),
                     "router_ms": _time_ms(route)})
        print(f"moe {label} permute {tokens}x{top_k}: gather {rows[-1]['gather_ms']:.3f} ms, "
              f"scatter-add {rows[-1]['scatter_add_ms']:.3f} ms, router "
              f"{rows[-1]['router_ms']:.3f} ms", flush=True)
    return rows


# ------------------------------------------------------------------------------------ recompute

def _op_sac_context():
    """torchtitan's per-op selective checkpointing policy: save the outputs of matmuls (all but
    every second one) and of attention; recompute everything else."""
    from functools import partial

    from torch.utils.checkpoint import (CheckpointPolicy,
                                        create_selective_checkpoint_contexts)

    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        key = f"{mode}_mm_count"
        if func == aten.mm.default:
            policy.meta[key] = policy.meta.get(key, 0) + 1
        keep = func in save and not (func == aten.mm.default and policy.meta.get(key, 0) % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    def contexts():
        policy.meta = {}
        return create_selective_checkpoint_contexts(policy)

    return partial(contexts)


def measure_recompute(*, layers: int = 4, seq: int = 8192, mb: int = 1) -> list[dict]:
    from torch.utils.checkpoint import checkpoint

    rows = []
    for mode in ("none", "full", "op"):
        torch.manual_seed(0)
        torch.cuda.empty_cache()
        model = _build("llama3-8b", {"n_layers": layers}, seq).to(BF16)
        if mode != "none":
            kwargs = {"context_fn": _op_sac_context()} if mode == "op" else {}
            for block in model.layers:
                block.forward = (lambda f: lambda *a, **k: checkpoint(
                    f, *a, use_reentrant=False, **kwargs, **k))(block.forward)
        tokens = torch.randint(0, model.config.vocab_size, (mb, seq + 1), device="cuda")
        x, y = tokens[:, :-1], tokens[:, 1:]
        held = {}

        def step():
            before = torch.cuda.memory_allocated()
            logits = model(x)
            held["bytes"] = torch.cuda.memory_allocated() - before
            F.cross_entropy(logits.flatten(0, -2).float(), y.flatten()).backward()

        row = {"mode": mode, "preset": "llama3-8b", "n_layers": layers, "seq_len": seq,
               "micro_batch": mb}
        t0 = time.time()
        try:
            step_ms, base, peak = _timed_steps(step, 4)
            row.update(step_ms=step_ms, held_after_forward_bytes=held["bytes"],
                       peak_above_base_bytes=peak, base_bytes=base)
        except Exception as err:  # noqa: BLE001  (keep the other modes)
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        rows.append(row)
        print(f"recompute {mode:5s} {row.get('step_ms', float('nan')):8.2f} ms, held "
              f"{row.get('held_after_forward_bytes', 0) / 2**30:.2f} GiB, peak above base "
              f"{row.get('peak_above_base_bytes', 0) / 2**30:.2f} GiB ({time.time() - t0:.0f} s) "
              f"{row.get('error', '')}", flush=True)
    return rows


SECTIONS = {"fp8_gemm": measure_fp8_gemm, "fp8_cast": measure_fp8_cast,
            "cp_attention": measure_cp_attention, "moe": measure_moe,
            "recompute": measure_recompute, "fp8_step": measure_fp8_step}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this program measures a GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_kernels.json"
    props = torch.cuda.get_device_properties(0)
    result = {"date": time.strftime("%Y-%m-%d"), "device": props.name,
              "sm_count": props.multi_processor_count, "memory_bytes": props.total_memory,
              "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in args.sections.split(","):
        t0 = time.time()
        try:
            result[name] = SECTIONS[name]()
        except Exception as err:  # noqa: BLE001  (keep the other sections)
            result[name] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
        print(f"{name}: done in {time.time() - t0:.0f} s", flush=True)
        path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
