"""The `autopar calibrate` command: its arguments, the run on every rank, and what rank 0
prints and writes (the profile, and the table beside it as NAME.calibration.txt and .csv).

    torchrun --nnodes N --nproc_per_node G -m autopar calibrate --base dgx-h100 -o mine.toml

Sizes: 8 B to --max-size (1 GiB; 16 MiB for --quick on CPU), every factor of 2 (--quick: 8).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import hwprofiles
from autopar.calibrate import compute, measure
from autopar.calibrate.profile import calibrate_profile, profile_toml, with_ranks_per_node
from autopar.calibrate.records import Measurements, held_out_sizes, size_grid
from autopar.calibrate.table import render_table, summary_lines, table_csv, table_rows

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)

_DEFAULT_MAX = 1 << 30
_QUICK_CPU_MAX = 16 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", required=True, help="shipped profile name (e.g. dgx-h100, "
                        "cpu-gloo) or .toml file: where the fit starts, and where the numbers "
                        "it cannot measure come from")
    parser.add_argument("-o", "--output", required=True, help="the calibrated profile (.toml) "
                        "to write; the table goes beside it (.calibration.txt and .csv)")
    parser.add_argument("--name", help="the profile's name (default: the output file's stem)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes (every factor of 8) "
                        "and rounds: under 2 minutes per node")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                        help="how long any rank waits for the others (start-up, each "
                             "collective) before it stops and names the missing ranks")
    parser.add_argument("--max-size", help="largest collective buffer, e.g. 256MiB (default "
                        "1GiB; 16MiB with --quick on CPU)")
    parser.add_argument("--rounds", type=int, help="the fewest timed rounds of any collective "
                        "size (default 7); shorter calls get more, up to a time budget per "
                        "size")
    parser.add_argument("--seed", type=int, default=0, help="seeds the order of the "
                        "measurements within each round")


def _checked(args: argparse.Namespace) -> tuple[dict[str, Any], Path, int]:
    """(base document, output path, largest size), checked before any rank connects."""
    from autopar.cli import _parse_size

    base = hwprofiles.read_profile(args.base)
    out = Path(args.output)
    if out.suffix != ".toml":
        raise ValueError(f"-o must name a .toml file, got {args.output!r}")
    if not out.parent.exists():
        raise ValueError(f"the directory of {args.output!r} does not exist; create it first")
    cpu = not torch.cuda.is_available()
    limit = _parse_size(args.max_size) if args.max_size else \
        (_QUICK_CPU_MAX if args.quick and cpu else _DEFAULT_MAX)
    if limit < 8:
        raise ValueError(f"--max-size must be at least 8 B, got {args.max_size!r}")
    if (args.rounds is not None and args.rounds < 1) or args.timeout <= 0:
        raise ValueError("--rounds and --timeout must be positive")
    return base, out, limit


def _memory_cap(limit: int, ranks_per_node: int) -> tuple[int, str | None]:
    """On CPU the ranks' buffers (2 x the largest, each) share the host's RAM: keep them under
    half of it."""
    if torch.cuda.is_available():
        return limit, None
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cap = ram // 2 // (2 * ranks_per_node)
    if limit <= cap:
        return limit, None
    return cap, (f"collective sizes capped at {cap >> 20} MiB: {ranks_per_node} ranks' "
                 f"buffers must fit half of the host's {ram / 1e9:.1f} GB")


class _Progress:
    """A progress bar on a terminal, else a log line per tenth of each phase (shown: `run`
    gives the calibrate logger a handler where none is set up)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.bar, self.tasks, self.shown = None, {}, {}
        if sys.stdout.isatty():
            from rich.progress import Progress

            self.bar = Progress(transient=False)
            self.bar.start()

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.bar is not None:
            if phase not in self.tasks:
                self.tasks[phase] = self.bar.add_task(phase, total=total)
            self.bar.update(self.tasks[phase], completed=done, total=total)
            return
        tenth = 10 * done // max(total, 1)
        if tenth > self.shown.get(phase, -1):
            self.shown[phase] = tenth
            log.info("calibrate: %s %d%% (%d/%d), %.0f s", phase, 100 * done // max(total, 1),
                     done, total, time.perf_counter() - self.start)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _quiet(phase: str, done: int, total: int) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    """Measure on this rank; on rank 0 fit, print and write. Returns the exit status."""
    base, out, limit = _checked(args)
    world = measure.connect(args.timeout)
    if world.rank == 0 and not logging.getLogger().handlers and not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    progress = _Progress() if world.rank == 0 else _quiet
    start = time.perf_counter()
    try:
        if world.num_nodes > 1 and base["network"]["nics_per_node"] == 0:
            raise ValueError(f"base profile {args.base!r} has no network (network_kind "
                             f"'none') to fit across {world.num_nodes} nodes; start from one "
                             f"that has, e.g. --base dgx-h100, whose network fields the run "
                             f"then fits")
        limit, cap_note = _memory_cap(limit, world.ranks_per_node)
        sizes = size_grid(limit, 8 if args.quick else 2)
        schedule = measure.QUICK if args.quick else measure.FULL
        if args.rounds:
            schedule = dataclasses.replace(schedule, min_rounds=args.rounds,
                                           max_rounds=max(args.rounds, schedule.max_rounds))
        points = measure.measure_collectives(world, sizes, schedule=schedule, seed=args.seed,
                                             progress=progress)
        computed = compute.measure_compute(world, sorted(base["device"]["peak_tflops"]),
                                           quick=args.quick, progress=progress)
        measure.checkpoint(world, "the end of the measurements")
        if world.rank == 0:
            progress.stop()
            notes = ((cap_note,) if cap_note else ()) + computed.notes
            if world.world_size == 1:
                notes += ("one rank: no collective to time; the collective fields are the "
                          "base profile's",)
            record = Measurements(
                date=time.strftime("%Y-%m-%d"), num_nodes=world.num_nodes,
                ranks_per_node=world.ranks_per_node, backend=world.backend,
                device_name=compute.device_name(world), torch_version=torch.__version__,
                quick=args.quick, collectives=tuple(points), gemms=computed.gemms,
                copies=computed.copies, attention=computed.attention,
                memory_bytes=computed.memory_bytes, memory_how=computed.memory_how,
                op_overhead_s=computed.op_overhead_s, notes=notes)
            _finish(args, base, out, record, sizes, time.perf_counter() - start)
    finally:
        if world.rank == 0:
            progress.stop()
        measure.close(world)
    return 0


def _finish(args: argparse.Namespace, base: dict[str, Any], out: Path, run: Measurements,
            sizes: list[int], elapsed_s: float) -> None:
    name = args.name or out.stem
    doc = calibrate_profile(base, args.base, run, name=name)
    rows = table_rows(run, with_ranks_per_node(base, run.ranks_per_node), doc)
    summary = summary_lines(rows)
    held = sorted(held_out_sizes(sizes))
    where = (f"{run.num_nodes} node{'s' if run.num_nodes > 1 else ''} x {run.ranks_per_node} "
             f"ranks")
    lines = [f"autopar calibrate: {where}, "
             f"{run.backend}, {run.device_name}, torch {run.torch_version}, {run.date}; base "
             f"profile {args.base}; measured in {elapsed_s:.0f} s",
             f"held-out sizes (not fitted): {', '.join(_size(s) for s in held) or 'none'}",
             "", render_table(rows), "", *summary]
    if run.memory_bytes is not None:
        lines.append(f"device memory: {run.memory_bytes / 1e9:.3g} GB per rank "
                     f"({run.memory_how}); base profile {base['device']['device_memory_gb']:g} GB")
    lines += [f"note: {note}" for note in run.notes]
    text = "\n".join(lines) + "\n"
    header = "\n".join([
        f"Calibrated by `autopar calibrate{' --quick' if run.quick else ''} --base {args.base}`"
        f" on {run.date}: {where}, {run.backend}, "
        f"{run.device_name}, torch {run.torch_version}.",
        "Numbers it measured cite the run; every other number keeps the base profile's source.",
        f"The measured-against-predicted table: {out.with_suffix('.calibration.txt').name}."])
    out.write_text(profile_toml(doc, header), encoding="utf-8")
    hwprofiles.read_profile(out)  # what Cluster.from_toml will read
    out.with_suffix(".calibration.txt").write_text(text, encoding="utf-8")
    out.with_suffix(".calibration.csv").write_text(table_csv(rows), encoding="utf-8")
    log.info("%s", text.rstrip("\n"))
    log.info("wrote %s (load it with autopar.Cluster.from_toml(%r, num_nodes=...)), %s and %s",
             out, str(out), out.with_suffix(".calibration.txt"),
             out.with_suffix(".calibration.csv"))


def _size(nbytes: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"
