"""Probe this host for the `cpu-gloo` profile: GEMM speed, memory bandwidth, gloo collectives.

Run: `python benchmarks/gloo_probe.py` (about 30 s on 2 cores). Prints tables; asserts nothing.
Every process runs with one intra-op thread, as the ranks of a local `torchrun` job on this
profile would (one process per "device").

1. GEMM: median TFLOP/s of `torch.matmul` on n x n matrices (2*n^3 FLOP), per dtype, one
   process; then the same fp32 GEMM in every rank of a 2- and 4-process job at once, to show how
   ranks share the cores.
2. Memory: median GB/s of `dst.copy_(src)` on 256 MiB buffers, counted as read + write
   (STREAM "copy" convention, 2 bytes moved per byte copied).
3. gloo collectives over 127.0.0.1 with `torch.multiprocessing` spawn (2 and 4 processes):
   all_reduce, all_gather, reduce_scatter (skipped where gloo lacks it) and send/recv (each rank
   sends to rank+1 and receives from rank-1), 4 KiB ... 64 MiB of fp32. Each measurement times
   K back-to-back calls (so the ranks pace each other and the barrier skew is amortized, as in
   nccl-tests), R times; the reported time is the median over R of the slowest rank's mean.
   Bus bandwidth follows nccl-tests (doc/PERFORMANCE.md): S = full buffer (for all_gather and
   reduce_scatter S = per-rank count x n), algbw = S/t, busbw = algbw x factor with factor
   2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter, 1 for send/recv.
4. Small GEMMs and eager op overhead (1 process): fp32 n^3 GEMMs for n = 16 ... 128, efficiency
   against the large-GEMM rate, fitted to eff(F) = F / (F + F_half) (profile
   `gemm_half_efficiency_gflop`); the forward and backward time per op of a chain of tiny
   autograd ops (profile `op_overhead_us`).
5. Figures for the profile, per process count n (ring steps: send/recv 1, all_gather and
   reduce_scatter n-1, all_reduce 2(n-1)):
   h, per-step latency = median send/recv time over the 4 and 16 KiB points (one step each);
   c, per-call cost = median over all_reduce/all_gather/reduce_scatter at 4 and 16 KiB of
   (t - steps x h); B, bus bandwidth = median busbw over all ops at 16 and 64 MiB.
   The cpu-gloo profile uses the n = 2 row (one rank per core on the 2-core dev machine).
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
WORLD_SIZES = (2, 4)
OPS = ("all_reduce", "all_gather", "reduce_scatter", "sendrecv")
GEMM_N = 2048


def _fmt_size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _gemm_tflops(n: int, dtype: torch.dtype, runs: int) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.matmul(a, b)  # warm-up (allocations, oneDNN kernel selection)
    t0 = time.perf_counter()
    torch.matmul(a, b)
    first = time.perf_counter() - t0
    if first > 1.0:  # a slow dtype path: do not let it eat the time budget
        runs = 1
    times = [first]
    for _ in range(runs - 1):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e12


def _gemm_half_efficiency_gflop(large_tflops: float) -> tuple[float, list[tuple[int, float]]]:
    """Fit F_half of eff(F) = F / (F + F_half) to small fp32 GEMMs (n^3, 1 thread): least
    squares of F_half over a log grid, efficiency relative to the large-GEMM rate (capped at 1).
    Returns (F_half in GFLOP, [(n, efficiency)])."""
    points = []
    for n in (16, 24, 32, 48, 64, 96, 128):
        a, b = torch.randn(n, n), torch.randn(n, n)
        reps = max(10, 2_000_000 // n**3)
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.matmul(a, b)
            times.append((time.perf_counter() - t0) / reps)
        points.append((n, min(1.0, 2 * n**3 / statistics.median(times) / 1e12 / large_tflops)))
    grid = [10 ** (k / 20) * 1e-6 for k in range(0, 81)]  # 1e-6 ... 1e-2 GFLOP

    def sse(half: float) -> float:
        return sum((e - 2e-9 * n**3 / (2e-9 * n**3 + half)) ** 2 for n, e in points)

    return min(grid, key=sse), points


def _op_overhead_us() -> tuple[float, float]:
    """Eager cost of one tiny op with autograd, 1 thread: a chain of 200 multiplies on a
    one-element tensor, forward and backward timed apart; median of 7. Returns (forward us per
    op, backward us per op)."""
    n = 200
    fwd, bwd = [], []
    for _ in range(8):
        x = torch.ones(1, requires_grad=True)
        t0 = time.perf_counter()
        y = x
        for _ in range(n):
            y = y * 1.0001
        t1 = time.perf_counter()
        y.backward()
        t2 = time.perf_counter()
        fwd.append((t1 - t0) / n)
        bwd.append((t2 - t1) / n)
    return statistics.median(fwd[1:]) * 1e6, statistics.median(bwd[1:]) * 1e6


def _copy_gb_per_s(nbytes: int, runs: int) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: touch the pages
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


def _reps(nbytes: int) -> tuple[int, int]:
    """(K calls timed together, R repeats) for a message size; the same on every rank."""
    if nbytes <= 64 << 10:
        return 20, 9
    if nbytes <= 1 << 20:
        return 10, 7
    if nbytes <= 4 << 20:
        return 4, 5
    if nbytes <= 16 << 20:
        return 2, 3
    return 1, 3


def _make_op(op: str, nbytes: int, rank: int, world: int):
    """Return a callable running one collective on buffers of nbytes total (nccl-tests S)."""
    count = nbytes // 4
    if op == "all_reduce":
        buf = torch.ones(count)
        return lambda: dist.all_reduce(buf)
    if op == "all_gather":
        out, inp = torch.empty(count), torch.ones(count // world)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp)
    if op == "reduce_scatter":
        out, inp = torch.empty(count // world), torch.ones(count)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp)
    send, recv = torch.ones(count), torch.empty(count)
    dst, src = (rank + 1) % world, (rank - 1) % world

    def sendrecv() -> None:
        reqs = [dist.isend(send, dst), dist.irecv(recv, src)]
        for r in reqs:
            r.wait()

    return sendrecv


def _supported(op: str, rank: int, world: int) -> str | None:
    """None if gloo runs the op, else the error text (every rank fails alike, before sending)."""
    try:
        _make_op(op, 4 << 10, rank, world)()
        return None
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        return str(exc).splitlines()[0][:80]


def _worker(rank: int, world: int, port: int, queue) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecated-API notices
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    # every rank's GEMM at once: how the ranks share the cores
    dist.barrier()
    gemm = _gemm_tflops(GEMM_N, torch.float32, runs=3)
    gemms = [None] * world
    dist.all_gather_object(gemms, gemm)
    rows, skipped = [], {}
    for op in OPS:
        why = _supported(op, rank, world)
        if why is not None:
            skipped[op] = why
            dist.barrier()
            continue
        for nbytes in SIZES:
            fn = _make_op(op, nbytes, rank, world)
            k, r = _reps(nbytes)
            fn()  # warm-up
            means = []
            for _ in range(r):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    fn()
                means.append((time.perf_counter() - t0) / k)
            slowest = torch.tensor(means, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            rows.append((op, nbytes, statistics.median(slowest.tolist())))
    if rank == 0:
        queue.put((world, gemms, rows, skipped))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bus_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n, "sendrecv": 1.0}[op]


def _steps(op: str, n: int) -> int:
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1,
            "sendrecv": 1}[op]


def _derive(rows: list[tuple[str, int, float]], world: int) -> tuple[float, float, float]:
    """(h per-step latency s, c per-call cost s, B bus bandwidth GB/s) from one world's rows."""
    small, large = (4 << 10, 16 << 10), (16 << 20, 64 << 20)
    h = statistics.median(t for op, nb, t in rows if op == "sendrecv" and nb in small)
    c = statistics.median(t - _steps(op, world) * h for op, nb, t in rows
                          if op != "sendrecv" and nb in small)
    bw = statistics.median(nb / t / 1e9 * _bus_factor(op, world) for op, nb, t in rows
                           if nb in large)
    return h, c, bw


def main() -> None:
    torch.set_num_threads(1)
    start = time.perf_counter()
    print(f"host: {os.cpu_count()} cores, torch {torch.__version__}, python "
          f"{sys.version.split()[0]}, load average {os.getloadavg()[0]:.2f} at start")

    print(f"\n== GEMM: torch.matmul {GEMM_N}^3, 1 thread, 1 process (median) ==")
    print(f"{'dtype':<8} {'TFLOP/s':>9}")
    large = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                        ("fp16", torch.float16)):
        large[name] = _gemm_tflops(GEMM_N, dtype, runs=7)
        print(f"{name:<8} {large[name]:>9.4f}")

    half, points = _gemm_half_efficiency_gflop(large["fp32"])
    print("\n== Small fp32 GEMMs n^3: efficiency vs the large-GEMM rate, fit F/(F + F_half) ==")
    print("  ".join(f"n={n}: {e:.2f}" for n, e in points))
    print(f"gemm_half_efficiency_gflop = {half:.3g}")
    fwd_us, bwd_us = _op_overhead_us()
    print("\n== Eager op overhead: 200 one-element multiplies with autograd (median) ==")
    print(f"forward {fwd_us:.1f} us per op, backward {bwd_us:.1f} us per op -> op_overhead_us "
          f"= {fwd_us:.1f} (the estimate charges it once forward, twice backward)")

    print("\n== Memory: dst.copy_(src), 256 MiB fp32, 1 thread (read + write, median) ==")
    print(f"{'GB/s':>8}\n{_copy_gb_per_s(256 << 20, runs=7):>8.2f}")

    ctx = mp.get_context("spawn")
    results = []
    for world in WORLD_SIZES:
        queue = ctx.SimpleQueue()
        mp.spawn(_worker, args=(world, _free_port(), queue), nprocs=world, join=True)
        results.append(queue.get())

    print("\n== GEMM fp32 2048^3 run by every rank at once (1 thread each, median) ==")
    print(f"{'ranks':>5} {'TFLOP/s per rank':>36} {'sum':>8}")
    for world, gemms, _, _ in results:
        per = " ".join(f"{g:.4f}" for g in gemms)
        print(f"{world:>5} {per:>36} {sum(gemms):>8.4f}")

    print("\n== gloo collectives over 127.0.0.1 (fp32; median over repeats of the slowest "
          "rank's mean) ==")
    print(f"{'ranks':>5} {'op':<15} {'size':>8} {'time us':>10} {'algbw GB/s':>11} "
          f"{'busbw GB/s':>11}")
    for world, _, rows, skipped in results:
        for op, nbytes, t in rows:
            alg = nbytes / t / 1e9
            print(f"{world:>5} {op:<15} {_fmt_size(nbytes):>8} {t * 1e6:>10.1f} {alg:>11.3f} "
                  f"{alg * _bus_factor(op, world):>11.3f}")
        for op, why in skipped.items():
            print(f"{world:>5} {op:<15} skipped: gloo does not support it ({why})")

    print("\n== Derived (see module docstring): per-step latency h, per-call cost c, busbw B ==")
    print(f"{'ranks':>5} {'h us':>8} {'c us':>8} {'B GB/s':>8}")
    for world, _, rows, _ in results:
        h, c, bw = _derive(rows, world)
        print(f"{world:>5} {h * 1e6:>8.1f} {c * 1e6:>8.1f} {bw:>8.3f}")
    print(f"\ntotal probe time {time.perf_counter() - start:.1f} s, load average "
          f"{os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
