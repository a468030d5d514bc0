"""Tracing time vs depth for a Llama-3-405B-shaped model (dim 16384, 128 heads, 8 KV heads,
FFN 53248, vocab 128256), batch 1 x seq 8192, built on the meta device.

Prints one row per depth: median seconds over the repeats (models built beforehand, all
depths measured side by side in one process, interleaved), and the ratio 128 / 8 layers.
The first trace in the process (one-time PyTorch warm-up) is reported separately. As
``timeit`` does, the garbage collector is paused while a trace is timed (``--gc`` keeps it on).

    .venv/bin/python benchmarks/trace_speed.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from autopar import models
from autopar.trace import trace

DEPTHS = (8, 16, 32, 64, 126, 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--gc", action="store_true", help="leave the garbage collector on")
    args = parser.parse_args()

    built = {n: models.build("llama3-405b", n_layers=n) for n in DEPTHS}
    start = time.perf_counter()
    trace(built[126], global_batch_size=1, seq_len=args.seq_len)
    cold = time.perf_counter() - start

    times: dict[int, list[float]] = {n: [] for n in DEPTHS}
    for _ in range(args.repeats):
        for n in DEPTHS:
            gc.collect()
            if not args.gc:
                gc.disable()
            start = time.perf_counter()
            graph = trace(built[n], global_batch_size=1, seq_len=args.seq_len)
            times[n].append(time.perf_counter() - start)
            gc.enable()
            assert graph.blocks[0].count == n

    print(f"trace(llama3-405b shape, batch 1, seq {args.seq_len}); {args.repeats} repeats; "
          f"gc {'on' if args.gc else 'paused while timing'}")
    print(f"first trace in process (126 layers, cold): {cold:.3f} s")
    print(f"{'layers':>6} | {'median s':>9} | {'min s':>7} | {'max s':>7}")
    print("-" * 39)
    for n in DEPTHS:
        t = times[n]
        print(f"{n:>6} | {statistics.median(t):>9.4f} | {min(t):>7.4f} | {max(t):>7.4f}")
    ratio = statistics.median(times[128]) / statistics.median(times[8])
    print(f"ratio median(128 layers) / median(8 layers) = {ratio:.2f}  (goal <= 1.3)")


if __name__ == "__main__":
    main()
