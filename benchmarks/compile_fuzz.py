"""Random `autopar.compile` problems: does every one end in a plan or in an error a user can act
on, and does each plan predict what `autopar.estimate` predicts for its config?

Draws (seeded) a zoo preset, a shipped cluster profile and node count, a precision, a global
batch, a sequence length (token models; at most the model's positions) or an image batch, and
pins on up to every ParallelConfig field, then compiles. Checks on every plan: it fits, the
pins hold, and -- when its stages are Megatron's even cut -- `autopar.estimate` of its config
(traced at the plan's micro-batch) gives the plan's step time. Prints a table of outcomes
(plans, explained errors by kind, anything else with its message), the largest relative
plan-vs-estimate difference per model family and the slowest compile. With --target ENGINE the
plans are made for that engine (`autopar.targets`), and a plan whose export to it has a note
counts as an other outcome.

Run: python benchmarks/compile_fuzz.py [--seed N] [--count N] [--pin-rate P] [--target ENGINE]
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import autopar  # noqa: E402
from autopar.errors import (NoPlanFitsError, RuntimeLimitError, TargetRuleError,  # noqa: E402
                            TraceError)
from autopar.models.registry import build, list_presets, preset  # noqa: E402
from autopar.plan.export import export_plan  # noqa: E402
from autopar.targets import TARGETS  # noqa: E402

PROFILES = ("dgx-a100-40g", "dgx-a100-80g", "dgx-b200", "dgx-h100", "dgx-h200", "dgx-v100",
            "gb200-nvl72", "h100-pcie-roce", "hgx-h800", "mi300x-8")
PINS = {"tp": [1, 2, 4, 8], "pp": [1, 2, 4], "dp": [1, 2, 8, 16], "cp": [1, 2, 4],
        "ep": [1, 2, 4, 8], "zero_stage": [0, 1, 2, 3], "micro_batch_size": [1, 2, 3, 4, 8],
        "pp_schedule": ["gpipe", "1f1b", "zero-bubble", "interleaved-1f1b"],
        "virtual_stages": [1, 2, 3, 4], "sequence_parallel": [False, True],
        "recompute": ["none", "selective", "per_op", "full"], "recompute_every": [1, 2, 4],
        "mesh_order": [("dp", "pp", "cp", "tp"), ("pp", "cp", "dp", "tp"),
                       ("pp", "tp", "cp", "dp"), ("tp", "cp", "dp", "pp")]}
IMAGE = ("resnet", "wide-resnet", "vit")


def _problem(rng: random.Random) -> tuple[str, autopar.Cluster, str, dict]:
    name = rng.choice(list_presets())
    profile = rng.choice(PROFILES)
    nodes = rng.choice([1, 2, 4]) if profile == "gb200-nvl72" else \
        rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 32, 64])
    cluster = autopar.Cluster.from_profile(profile, num_nodes=nodes)
    dtype = rng.choice(["bf16", "bf16", "fp16", "fp32", "fp8"])
    if name.startswith(IMAGE):
        shape = dict(global_batch_size=rng.choice([32, 64, 256, 1024, 2048]),
                     example_inputs=torch.empty(1, 3, 224, 224, device="meta"))
    else:
        longest = getattr(preset(name), "max_seq_len", 8192)
        shape = dict(global_batch_size=rng.choice([8, 16, 24, 32, 64, 96, 128, 256, 512, 1024,
                                                   1536, 2048]),
                     seq_len=min(longest, rng.choice([512, 1024, 2048, 4096, 8192])))
    return name, cluster, dtype, shape


def _kind(error: Exception) -> str:
    text = str(error)
    if isinstance(error, NoPlanFitsError):
        return "no plan fits (smallest footprint named)"
    if "compute (profile lists" in text:
        return "precision the device lacks"
    if isinstance(error, TargetRuleError) or "(target=" in text:
        return "the target engine's rule named"
    if "no configuration satisfies" in text and any(
            why in text for why in (": no ", "each pin", "must equal")):
        return "empty space (binding pin or limit named)"
    if "no configuration satisfies" in text and "first rejection: " in text:
        return "every config rejected (first reason named)"
    if isinstance(error, TraceError):
        return "trace error with a hint"
    if isinstance(error, RuntimeLimitError):
        return "a pin the runtime cannot run for the model (reason named)"
    return f"OTHER {type(error).__name__}: {text[:160]}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--pin-rate", type=float, default=0.08,
                        help="chance that each ParallelConfig field is pinned")
    parser.add_argument("--target", default="autopar", choices=tuple(TARGETS))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    settings = autopar.SearchSettings(progress=False)
    outcomes: collections.Counter = collections.Counter()
    apart: dict[str, tuple[float, str]] = {}
    replicating = 0
    slowest = (0.0, "")
    for _ in range(args.count):
        name, cluster, dtype, shape = _problem(rng)
        pins = {f: rng.choice(v) for f, v in PINS.items() if rng.random() < args.pin_rate}
        label = (f"{name} on {cluster.name} x{cluster.num_nodes} {dtype} "
                 f"gbs {shape['global_batch_size']} seq {shape.get('seq_len')} pins {pins}")
        model = build(name)
        start = time.perf_counter()
        try:
            plan = autopar.compile(model, cluster, dtype=dtype, constraints=pins or None,
                                   settings=settings, target=args.target, **shape)
        except ValueError as error:  # the library's errors are ValueErrors
            outcomes[_kind(error)] += 1
            continue
        seconds = time.perf_counter() - start
        slowest = max(slowest, (seconds, label))
        cfg = plan.config
        bad = [f for f, v in pins.items() if getattr(cfg, f) != v]
        if bad or not plan.estimate.fits:
            outcomes[f"OTHER plan breaks pins {bad} or does not fit: {label}"] += 1
            continue
        notes = export_plan(plan, args.target).notes if args.target != "autopar" else ()
        if notes:
            outcomes[f"OTHER export to {args.target} has notes {notes}: {label}"] += 1
            continue
        outcomes["plan"] += 1
        replicating += any(e.get("replicated_sublayers") for e in plan.intra_op.values())
        if plan.search["stage_cut"] != "even (Megatron)":
            continue
        traced = dict(shape)
        if "example_inputs" in traced:
            traced["example_inputs"] = torch.empty(cfg.micro_batch_size, 3, 224, 224,
                                                   device="meta")
        est = autopar.estimate(model, cluster, cfg, dtype=dtype,
                               software=TARGETS[args.target].software,
                               tp_placements=plan.tp_placements, **traced)
        gap = abs(est.step_time_s / plan.estimate.step_time_s - 1)
        family = name.split("-")[0]
        if gap >= apart.get(family, (-1.0, ""))[0]:
            apart[family] = (gap, f"{label}: {cfg.short()}")
    print(f"{args.count} problems, seed {args.seed}, pin rate {args.pin_rate}, target "
          f"{args.target}\n")
    print(f"{'outcome':<60} {'count':>6}")
    for kind, n in sorted(outcomes.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"{kind:<60} {n:>6}")
    print(f"\n{'family':<10} {'plan vs estimate(), largest':>28}  where")
    for family, (gap, where) in sorted(apart.items()):
        print(f"{family:<10} {100 * gap:>27.4f}%  {where}")
    if slowest[1]:
        print(f"\nslowest compile: {slowest[0]:.2f} s ({slowest[1]})")
    others = sum(n for k, n in outcomes.items() if k.startswith("OTHER"))
    print(f"\nplans whose tensor-parallel layout replicates sub-layers (the intra-op ILP's): "
          f"{replicating}")
    print(f"\nplans {outcomes['plan']}, explained errors "
          f"{args.count - outcomes['plan'] - others}, other outcomes {others}")
    if others or not math.isfinite(sum(g for g, _ in apart.values())):
        sys.exit(1)


if __name__ == "__main__":
    main()
