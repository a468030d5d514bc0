"""Random plans run for real: does every plan autopar emits for a tiny zoo model train, on
CPU ranks with gloo, to the same losses as one unsharded process?

Draws (seeded) a world of 2, 4 or 8 ranks, a tiny model (tests/distributed/tiny_models.py:
Llama, wide Llama, GPT, tied-embedding Llama, Llama with math attention, Mixtral) and a
random split of the ranks into tp, pp, cp and dp with ZeRO, schedule, SP, recompute,
micro-batch, (Mixtral) ep and, for about a third of the plans, a random mesh order pinned (the
orders from a random stream of their own, so a seed draws the same other pins as before they
were added); `autopar.compile` on the `cpu-gloo` profile, `autopar
codegen`, then `torchrun` of the generated script for a few steps, against the script's
one-process `--reference` run. A pin combination compile refuses with a reason is counted,
not run. Prints one line per plan and a table of outcomes; exits 1 if any plan failed to run
or trained to other losses (relative difference above 1e-4, the parity tests' tolerance).
About 4-14 s a plan on this 2-core machine.

Run: python benchmarks/runtime_fuzz.py [--seed N] [--count N]
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "distributed"))

import test_parity as parity  # noqa: E402  (the parity tests' script and run helpers)

FACTORIES = ("tiny_llama", "tiny_llama_wide", "tiny_gpt", "tiny_llama_tied", "tiny_llama_math",
             "tiny_mixtral")


def _pins(rng: random.Random, ranks: int, factory: str,
          orders: random.Random | None = None) -> dict:
    pins, left = {}, ranks
    for axis, degrees in (("tp", (1, 2, 4)), ("pp", (1, 2)), ("cp", (1, 2, 4))):
        # the tiny models have 2-4 blocks: pp = 2 already leaves interleaving one per chunk
        degree = rng.choice([d for d in degrees if left % d == 0]) if rng.random() < 0.5 else 1
        pins[axis], left = degree, left // degree
    pins["dp"] = left
    pins["zero_stage"] = rng.choice([0, 1, 2, 3]) if pins["dp"] * pins["cp"] > 1 else 0
    if pins["pp"] > 1:
        pins["pp_schedule"] = rng.choice(["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"])
        if pins["pp_schedule"] == "interleaved-1f1b":
            pins["virtual_stages"] = 2
    if pins["tp"] > 1:
        pins["sequence_parallel"] = rng.random() < 0.5
    # selective recompute drops attention scores, which only a math kernel keeps
    math = factory == "tiny_llama_math"
    pins["recompute"] = rng.choice(["none", "full"] + ["selective"] * math)
    pins["micro_batch_size"] = rng.choice([1, 2])
    if factory == "tiny_mixtral":
        eps = [e for e in (2, 4) if pins["dp"] * pins["cp"] % e == 0]
        if eps and rng.random() < 0.6:
            pins["ep"] = rng.choice(eps)
    if orders is not None and orders.random() < 0.3:  # a stream of its own: the other pins
        pins["mesh_order"] = tuple(orders.sample(["pp", "dp", "cp", "tp"], 4))  # stay as seeded
    return pins


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=40)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    orders = random.Random(args.seed + 10_000)
    references: dict[str, list[float]] = {}
    outcomes: collections.Counter = collections.Counter()
    for _ in range(args.count):
        ranks = rng.choice([2, 4, 4, 8])
        factory = rng.choice(FACTORIES)
        pins = _pins(rng, ranks, factory, orders)
        label = f"{factory} on {ranks} ranks {pins}"
        tmp = Path(tempfile.mkdtemp())
        try:
            script = parity._make_script(tmp, "fuzz", ranks, factory, pins)
        except ValueError as error:  # compile refused the pins, saying why
            outcomes["pins refused with a reason"] += 1
            print(f"refused      {label}: {str(error).split(' GPUs: ', 1)[-1][:160]}")
            continue
        if factory not in references:
            ref = parity._run([parity.PY, str(script), "--reference", "--steps",
                               str(parity.STEPS), "--seed", "0"])
            references[factory] = parity._losses(ref.stdout)
        start = time.perf_counter()
        res = parity._run([parity.TORCHRUN, "--standalone", f"--nproc_per_node={ranks}",
                           str(script), "--steps", str(parity.STEPS), "--seed", "0"])
        got = parity._losses(res.stdout)
        if res.returncode != 0 or len(got) != parity.STEPS:
            why = [line for line in (res.stdout + res.stderr).splitlines()
                   if line.startswith("error:") or "Error" in line][:2]
            outcomes["failed to run"] += 1
            print(f"FAILED   {label}: {' | '.join(why)[:300]}")
            continue
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, references[factory]))
        kind = "same losses" if rel <= parity.TOL else "OTHER LOSSES"
        outcomes[kind] += 1
        print(f"{kind:<12} {rel:.1e} {time.perf_counter() - start:5.1f} s  {label}")
    print(f"\n{args.count} plans, seed {args.seed}, {parity.STEPS} steps each\n")
    for kind, n in sorted(outcomes.items(), key=lambda kv: -kv[1]):
        print(f"{kind:<30} {n:>4}")
    if outcomes["failed to run"] or outcomes["OTHER LOSSES"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
