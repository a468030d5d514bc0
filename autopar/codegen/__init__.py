"""autopar.codegen: writes a standalone, readable training script for a plan.
``autopar codegen PLAN --model-factory MODULE:FN -o train.py`` is ``codegen_main``."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from autopar.codegen.script import generate_script

__all__ = ["add_arguments", "codegen_main", "generate_script", "run"]

log = logging.getLogger(__name__)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``autopar codegen`` options (shared by the CLI and ``codegen_main``)."""
    ap.add_argument("plan", help="plan JSON written by plan.save / autopar plan -o")
    ap.add_argument("--model-factory", required=True, metavar="MODULE:FN",
                    help="function returning the model with its weights")
    ap.add_argument("--loss", default=None, metavar="MODULE:FN",
                    help="loss(logits, labels); default: next-token cross entropy")
    ap.add_argument("-o", "--output", default="train.py")


def run(args: argparse.Namespace) -> Path:
    """Write the script ``args`` describe; returns its path."""
    plan_path = Path(args.plan).resolve()
    out = Path(args.output)
    text = generate_script(plan_path, args.model_factory, args.loss, plan_path=plan_path,
                           script_name=out.name)
    out.write_text(text, encoding="utf-8")
    log.info("wrote %s", out)
    return out


def codegen_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="autopar codegen",
                                 description="write a torchrun training script for a saved plan")
    add_arguments(ap)
    run(ap.parse_args(argv))
    return 0
