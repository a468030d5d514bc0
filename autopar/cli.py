"""The `autopar` command line: `plan`, `report`, `explain`, `export`, `codegen`, `profiles`,
`collective` and `calibrate` (under torchrun; `python -m autopar calibrate` works too).

User mistakes end as one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import re
import sys

from rich.console import Console
from rich.table import Table

import hwprofiles
from autopar.cluster import Cluster

__all__ = ["main"]

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _parse_size(text: str) -> int:
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read size {text!r}; write e.g. 1024, 64MiB, 1GiB or 2GB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])


def _parse_ranks(text: str, world_size: int) -> list[int]:
    if text == "all":
        return list(range(world_size))
    ranks: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        step_hi, _, step = hi.partition(":")
        if not lo.strip().isdigit() or (hi and not step_hi.strip().isdigit()):
            raise ValueError(f"cannot read ranks {text!r}; write e.g. all, 0-7, 0,8,16 or 0-63:8")
        start, stop = int(lo), int(step_hi or lo)
        ranks += range(start, stop + 1, int(step or 1))
    return ranks


def _profiles(console: Console) -> None:
    table = Table(title="shipped hardware profiles (hwprofiles/)")
    for col in ("name", "device", "GPUs/node", "scale-up", "GB/s/dev", "network",
                "bf16 TFLOP/s", "memory GB"):
        table.add_column(col, justify="right" if col[0].isupper() or col[0] in "bm" else "left")
    for name in hwprofiles.list_profiles():
        hw = Cluster.from_profile(name).hardware
        net = hw.network
        network = (f"{net.nics_per_node}x{net.nic_bytes_per_s * 8e-9:g}G {net.kind}"
                   if net.nics_per_node else "-")
        bf16 = hw.device.peak_flops.get("bf16", hw.device.peak_flops.get("fp16", 0.0))
        table.add_row(name, hw.device.model, str(hw.node.gpus_per_node),
                      hw.node.fabric.value + (" +NVLS" if hw.node.in_switch_reduction else ""),
                      f"{hw.node.fabric_bytes_per_s / 1e9:g}", network, f"{bf16 / 1e12:g}",
                      f"{hw.device.memory_bytes / 1e9:g}")
    console.print(table)


def _cluster(args: argparse.Namespace) -> Cluster:
    """The --cluster profile on --nodes nodes with the --set FIELD=VALUE overrides."""
    overrides = {}
    for item in args.set or []:
        key, _, value = item.partition("=")
        try:
            overrides[key] = int(value) if value.isdigit() else float(value)
        except ValueError:
            overrides[key] = {"true": True, "false": False}.get(value.lower(), value)
    return Cluster.from_profile(args.cluster, num_nodes=args.nodes, **overrides)


def _collective(console: Console, args: argparse.Namespace) -> None:
    cluster = _cluster(args)
    ranks = _parse_ranks(args.ranks, cluster.world_size)
    table = Table(title=f"{args.kind} over {len(ranks)} ranks of {cluster.describe()}")
    for col in ("size", "time", "bus bandwidth", "algorithm"):
        table.add_column(col, justify="right" if col != "algorithm" else "left")
    for text in args.size:
        est = cluster.collective_estimate(args.kind, _parse_size(text), ranks)
        table.add_row(text, f"{est.time_s * 1e6:,.1f} us", f"{est.busbw_bytes_per_s / 1e9:.1f} GB/s",
                      f"{est.algorithm}/{est.protocol.value}")
    console.print(table)


def _parse_pins(items: list[str] | None) -> dict:
    pins = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"cannot read pin {item!r}; write FIELD=VALUE, e.g. tp=8")
        lowered = value.lower()
        pins[key] = (int(value) if value.isdigit() else
                     {"true": True, "false": False}.get(lowered, value))
    return pins


def _load_model(spec: str):
    """A preset name of autopar.models, or MODULE:FN calling FN() for the model. MODULE is
    looked up from the working directory first, as ``python -m`` does."""
    import importlib
    import os
    import sys

    import autopar

    if ":" in spec:
        module_name, _, fn_name = spec.partition(":")
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load model factory {spec!r}: {exc}; write MODULE:FN with "
                             f"MODULE importable from {os.getcwd()} or on PYTHONPATH") from None
        return fn()
    if spec not in autopar.models.list_presets():
        raise ValueError(f"unknown model preset {spec!r}; presets: "
                         f"{', '.join(autopar.models.list_presets())} (or MODULE:FN)")
    return autopar.models.build(spec)


def _plan(console: Console, args: argparse.Namespace) -> None:
    import autopar

    model = _load_model(args.model)
    cluster = _cluster(args)
    plan = autopar.compile(model, cluster, global_batch_size=args.global_batch,
                           seq_len=args.seq_len, dtype=args.dtype,
                           constraints=_parse_pins(args.pin), software=args.software,
                           target=args.target,
                           settings=autopar.SearchSettings(mesh_orders=args.mesh_orders))
    phases = plan.search["phase_seconds"]
    console.print(f"autopar plan: {args.model} on {cluster.describe()} "
                  f"({plan.search['num_considered']:,} configs; compiled in "
                  f"{sum(phases.values()):.2f} s: "
                  + ", ".join(f"{name} {t:.2f}" for name, t in phases.items()) + ")",
                  markup=False, highlight=False)
    sys.stdout.write(plan.report() + "\n")
    if args.output:
        print(f"saved {plan.save(args.output)}")
    if args.plots:
        from autopar.plan.plots import plot_plan

        for name, path in sorted(plot_plan(plan, args.plots).items()):
            print(f"wrote {path}")


def _report(args: argparse.Namespace) -> None:
    from autopar.plan import load_plan

    sys.stdout.write(load_plan(args.plan).report(fmt=args.format) + "\n")


def _explain(args: argparse.Namespace) -> None:
    from autopar.plan import load_plan

    plan = load_plan(args.plan)
    cluster = Cluster.from_profile(plan.cluster.profile, num_nodes=plan.cluster.num_nodes)
    result = plan.explain(_load_model(args.model), cluster, **_parse_pins(args.pin))
    sys.stdout.write(result.render(args.format) + "\n")


def _export(args: argparse.Namespace) -> None:
    from autopar.plan import load_plan
    from autopar.plan.export import export_plan

    plan = load_plan(args.plan)
    result = export_plan(plan, args.format)
    sys.stdout.write(result.text if result.text.endswith("\n") else result.text + "\n")
    for step in result.setup:
        print(f"setup: {step}", file=sys.stderr)
    target = plan.training.target
    if result.notes and target != args.format:
        print(f"note: this plan was made for target {target}, not {args.format}: the notes "
              f"below name the choices {args.format} cannot take as planned; re-plan with "
              f"`autopar plan --target {args.format}` for a plan it runs as is",
              file=sys.stderr)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="autopar: parallelization "
                                     "planner for PyTorch training")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("profiles", help="list the shipped hardware profiles")
    plan = sub.add_parser("plan", help="find the fastest plan for a model preset on a cluster")
    plan.add_argument("--model", required=True, help="a preset of autopar.models (e.g. "
                      "llama3-70b) or MODULE:FN returning the model (meta device is fine)")
    plan.add_argument("--cluster", required=True, help="shipped profile name, e.g. dgx-h100")
    plan.add_argument("--nodes", type=int, default=1)
    plan.add_argument("--set", action="append", metavar="FIELD=VALUE",
                      help="override a profile field, e.g. --set gpus_per_node=4")
    plan.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    plan.add_argument("--seq-len", type=int, required=True)
    plan.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp8", "fp32"))
    plan.add_argument("--target", default="autopar",
                      choices=("autopar", "megatron", "torchtitan", "deepspeed"),
                      help="the engine that will run the plan: search only what it runs "
                           "(autopar.targets), cost with its software preset, and report what "
                           "the restriction costs against autopar's runtime; default: autopar's "
                           "runtime")
    plan.add_argument("--software", default=None,
                      choices=("autopar", "megatron", "torchtitan", "torchtitan-compile",
                               "deepspeed"),
                      help="cost with this engine's software preset (autopar.SOFTWARE); "
                           "default: the target's preset")
    plan.add_argument("--pin", action="append", metavar="FIELD=VALUE",
                      help="pin a ParallelConfig field, e.g. --pin tp=8 or --pin "
                           "mesh_order=dp,pp,cp,tp")
    plan.add_argument("--mesh-orders", default="default", choices=("default", "all"),
                      help="search the default mesh order (pp, dp, cp, tp; tp innermost) or "
                           "every order of the four axes (several times the search time)")
    plan.add_argument("-o", "--output", help="write the plan JSON here")
    plan.add_argument("--plots", metavar="DIR", help="write timeline/memory/candidates/"
                      "breakdown PNGs here")
    report = sub.add_parser("report", help="the report of a saved plan")
    report.add_argument("plan")
    report.add_argument("--format", default="text", choices=("text", "md"))
    explain = sub.add_parser("explain", help="why not another degree: re-plan a saved plan "
                             "under extra pins and compare term by term")
    explain.add_argument("plan")
    explain.add_argument("--model", required=True, help="the model (preset or MODULE:FN) the "
                         "plan was made for")
    explain.add_argument("--pin", action="append", required=True, metavar="FIELD=VALUE")
    explain.add_argument("--format", default="text", choices=("text", "md"))
    export = sub.add_parser("export", help="a saved plan as Megatron-LM flags, a torchtitan "
                            "job config or a DeepSpeed config")
    export.add_argument("plan", help="plan JSON written by `autopar plan -o`")
    export.add_argument("--format", required=True, choices=("megatron", "torchtitan",
                                                            "deepspeed"))
    codegen = sub.add_parser("codegen", help="write a torchrun training script that runs a "
                             "saved plan (and its --reference single-process run)")
    from autopar.codegen import add_arguments as add_codegen_arguments

    add_codegen_arguments(codegen)
    calibrate = sub.add_parser("calibrate", help="under torchrun: measure this cluster's "
                               "collectives, GEMMs and memory and write a fitted profile")
    from autopar.calibrate.command import add_arguments as add_calibrate_arguments

    add_calibrate_arguments(calibrate)
    coll = sub.add_parser("collective", help="predicted time of one collective on a cluster")
    coll.add_argument("--cluster", default="dgx-h100", help="shipped profile name")
    coll.add_argument("--nodes", type=int, default=1)
    coll.add_argument("--kind", default="all_reduce")
    coll.add_argument("--ranks", default="all", help="all, 0-7, 0,8,16 or 0-63:8")
    coll.add_argument("--size", nargs="+", default=["1MiB", "64MiB", "1GiB"])
    coll.add_argument("--set", action="append", metavar="FIELD=VALUE",
                      help="override a profile field, e.g. --set nic_gbps=200")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 150)
    try:
        if args.command == "profiles":
            _profiles(console)
        elif args.command == "plan":
            _plan(console, args)
        elif args.command == "export":
            _export(args)
        elif args.command == "report":
            _report(args)
        elif args.command == "explain":
            _explain(args)
        elif args.command == "codegen":
            from autopar.codegen import run as run_codegen
            from autopar.plan import load_plan

            out = run_codegen(args)
            n = load_plan(args.plan).cluster.world_size
            print(f"wrote {out}; run it with: torchrun --nproc_per_node={n} {out} --steps 10 "
                  f"(and python {out} --reference for the single-process reference)")
        elif args.command == "collective":
            _collective(console, args)
        elif args.command == "calibrate":
            from autopar.calibrate.command import run as run_calibrate

            return run_calibrate(args)
    except ValueError as exc:
        print(f"autopar: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
