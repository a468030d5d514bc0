"""Plan one-GPU training runs, write their `autopar codegen` scripts, run them, and compare the
measured step time and peak memory with what each plan predicts.

Planning needs OR-Tools (this machine); running needs a CUDA GPU and nothing else but torch
(and transformers for Hugging Face models), so the two halves run apart:

    python benchmarks/gpu_scripts.py plan --out DIR [--profile dgx-h100]    # here
    python benchmarks/gpu_scripts.py run --dir DIR [--steps 10]              # on the GPU

``plan`` compiles each case of `CASES` (benchmarks/gpu_models.py's models, 8 sequences of 1,024
tokens, or 2 of 8,192 for the 8B-wide one, one GPU of the profile) and writes DIR/NAME.json and DIR/NAME.py. ``run`` launches each
script with ``torchrun --nproc_per_node=1 ... --steps N``, parses its step lines and summary,
and writes DIR/gpu_scripts.json (one row per case, after each) and prints a table: the median
step after the first, peak allocated memory, and the plan's predictions beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GLOBAL_BATCH, SEQ_LEN = 8, 1024
BIG = {"global_batch_size": 2, "seq_len": 8192}  # the 8B-wide model's problem
MB1 = {"micro_batch_size": 1}
# (name, model factory, dtype, constraints pinned in compile[, problem])
CASES = [
    ("plain_llama_bf16", "benchmarks.gpu_models:plain_llama_1b", "bf16", {}),
    ("plain_llama_fp8", "benchmarks.gpu_models:plain_llama_1b", "fp8", {}),
    ("plain_llama_fp8_per_op", "benchmarks.gpu_models:plain_llama_1b", "fp8",
     {"recompute": "per_op"}),
    ("plain_llama_bf16_per_op", "benchmarks.gpu_models:plain_llama_1b", "bf16",
     {"recompute": "per_op"}),
    ("hf_llama_bf16", "benchmarks.gpu_models:hf_llama_1b", "bf16", {}),
    ("hf_llama_fp8", "benchmarks.gpu_models:hf_llama_1b", "fp8", {}),
    ("llama8b_4l_bf16", "benchmarks.gpu_models:plain_llama_8b_4l", "bf16", MB1, BIG),
    ("llama8b_4l_fp8", "benchmarks.gpu_models:plain_llama_8b_4l", "fp8", MB1, BIG),
]
STEP = re.compile(r"^step (\d+) loss (\S+) time_ms (\S+) mem_mb (\S+)", re.MULTILINE)


def plan(out: Path, profile: str) -> None:
    import autopar
    from autopar.cli import main as cli_main

    out.mkdir(parents=True, exist_ok=True)
    cluster = autopar.Cluster.from_profile(profile, gpus_per_node=1)
    import torch

    for name, factory, dtype, constraints, *problem in CASES:
        module, _, fn = factory.rpartition(":")
        with torch.device("meta"):  # the plan needs shapes only
            model = getattr(__import__(module, fromlist=[fn]), fn)()
        size = problem[0] if problem else {"global_batch_size": GLOBAL_BATCH,
                                           "seq_len": SEQ_LEN}
        p = autopar.compile(model, cluster, dtype=dtype, constraints={"dp": 1, **constraints},
                            **size)
        path = p.save(out / f"{name}.json")
        assert cli_main(["codegen", str(path), "--model-factory", factory,
                         "-o", str(out / f"{name}.py")]) == 0
        est = p.estimate
        print(f"{name:26s} {p.config.short()} "
              f"predicts {est.step_time_s * 1e3:.1f} ms, "
              f"{est.peak_memory_bytes / 2**20:.0f} MiB", flush=True)


def fp8_gemm_check(recipe: str = "tensorwise") -> dict:
    """autopar.runtime.fp8's GEMM (`recipe`) on the GPU (``torch._scaled_mm``) against the same
    fp8 operands multiplied in fp32 on the CPU: forward, input and weight gradients, with a token
    count that is not a multiple of 16 (the weight gradient's padded inner dim)."""
    import torch

    from autopar.runtime import fp8

    torch.manual_seed(0)
    out = {}
    for m, k, n in ((1000, 2048, 5632), (4096, 4096, 1024)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, k, device="cuda", requires_grad=True)
        y = fp8.float8_linear(x, w, out_dtype=torch.bfloat16, recipe=recipe)
        g = torch.randn_like(y)
        y.backward(g)
        xc, wc = x.detach().cpu().requires_grad_(), w.detach().cpu().requires_grad_()
        yc = fp8.float8_linear(xc, wc, out_dtype=torch.bfloat16, recipe=recipe)
        yc.backward(g.cpu())
        out[f"{m}x{k}x{n}"] = {
            name: float((a.detach().float().cpu() - b.detach().float()).abs().max()
                        / b.detach().float().abs().max())
            for name, a, b in (("y", y, yc), ("grad_x", x.grad, xc.grad),
                               ("grad_w", w.grad, wc.grad))}
    return out


def sac_dispatch(ops: int = 400, reps: int = 15) -> dict:
    """Host time selective activation checkpointing adds per op: a chain of `ops` tiny
    elementwise ops (launch-bound) trained forward and backward plainly and inside a
    non-reentrant checkpoint whose policy saves every op's output (so its recompute re-runs
    nothing and replays every op through the policy's dispatch mode); median seconds per op
    of each, and of their difference."""
    import functools
    import statistics as stats

    import torch
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    x = torch.randn(64, 64, device="cuda", requires_grad=True)

    def chain(t):
        for _ in range(ops // 2):
            t = t * 1.0001 + 0.0001
        return t

    def save_all(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE

    context = functools.partial(create_selective_checkpoint_contexts, save_all)
    forms = {"plain": lambda: chain(x),
             "sac": lambda: checkpoint(chain, x, use_reentrant=False, context_fn=context)}
    out = {"ops": ops}
    for name, fn in forms.items():
        times = []
        for _ in range(reps + 3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn().sum().backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[f"{name}_s_per_op"] = stats.median(times[3:]) / ops
    out["sac_extra_s_per_op"] = out["sac_s_per_op"] - out["plain_s_per_op"]
    return out


def run(folder: Path, steps: int, names: set[str] | None = None) -> None:
    import torch

    check = {recipe: fp8_gemm_check(recipe) for recipe in ("tensorwise", "rowwise")} \
        if not names or any("fp8" in n for n in names) else {}
    print("fp8 GEMM, GPU against CPU (max abs difference / max abs):", check, flush=True)
    (folder / "fp8_gemm_check.json").write_text(json.dumps(check, indent=1) + "\n")
    sac = sac_dispatch()
    print("selective checkpointing's host time per op:", sac, flush=True)
    (folder / "sac_dispatch.json").write_text(json.dumps(sac, indent=1) + "\n")
    rows = []
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=1"]
    for name, factory, dtype, constraints, *_ in CASES:
        if names and name not in names:
            continue
        script = folder / f"{name}.py"
        plan_doc = json.loads((folder / f"{name}.json").read_text())
        start = time.perf_counter()
        res = subprocess.run([*torchrun, str(script), "--steps", str(steps),
                              "--plan", str(folder / f"{name}.json")],
                             capture_output=True, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        steps_seen = STEP.findall(res.stdout)
        est = plan_doc["estimate"]
        row = {"name": name, "model": factory, "dtype": dtype, "constraints": constraints,
               "config": plan_doc["config"],
               "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "returncode": res.returncode, "wall_s": round(time.perf_counter() - start, 1),
               "step_ms_all": [float(s[2]) for s in steps_seen],
               "losses": [float(s[1]) for s in steps_seen],
               "predicted_step_ms": round(est["step_time_s"] * 1e3, 1),
               "predicted_tensor_mib": round(max(
                   m["states"] + m["activations"] + m["zero3_buffers"]
                   for m in est["memory_by_stage"]) / 2**20),
               "predicted_peak_mib": round(est["peak_memory_bytes"] / 2**20),
               "fp8_bf16_warning": "ran their GEMMs in bf16" in res.stderr}
        if steps_seen:
            row["step_ms"] = statistics.median(row["step_ms_all"][1:] or row["step_ms_all"])
            row["peak_allocated_mib"] = float(steps_seen[-1][3])
        if res.returncode:
            row["stderr_tail"] = res.stderr[-3000:]
        rows.append(row)
        (folder / "gpu_scripts.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(f"{name:26s} rc {res.returncode} step {row.get('step_ms', float('nan')):7.1f} ms "
              f"(plan {row['predicted_step_ms']:7.1f})  peak {row.get('peak_allocated_mib', 0):6.0f}"
              f" MiB (plan tensors {row['predicted_tensor_mib']}, peak "
              f"{row['predicted_peak_mib']})", flush=True)
        if res.returncode:
            print(res.stderr[-2000:], flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--profile", default="dgx-h100")
    r = sub.add_parser("run")
    r.add_argument("--dir", type=Path, required=True)
    r.add_argument("--steps", type=int, default=10)
    r.add_argument("--cases", help="comma-separated case names (default: all)")
    args = ap.parse_args(argv)
    if args.cmd == "plan":
        plan(args.out, args.profile)
    else:
        run(args.dir, args.steps, set(args.cases.split(",")) if args.cases else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
