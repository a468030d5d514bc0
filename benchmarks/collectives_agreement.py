"""Does the estimate charge the collectives the runtime issues?  For each corpus model
(``tests/corpus.py``) under plans of ``benchmarks/runtime_matrix.py`` (tp and tp + sequence
parallel on 2 gloo ranks by default; ZeRO plans, pipelines, context and expert parallel and
their combinations too), the plan is compiled, trained for 3 steps next to the
one-process reference, and the collectives rank 0 issued in one training step are compared
with the estimate's for rank 0's pipeline stage in the plan's layout
(`autopar.estimate.tp_comm.tp_step_collectives`, `cp_step_collectives`,
`ep_step_collectives`, `autopar.estimate.pipeline_comm.pp_step_collectives`,
`autopar.estimate.data_parallel.dp_step_collectives`): each kind with its bytes, a cp ring's
hops and a pipeline's transfers as ``send_recv`` of what the rank sends, less the scalar
all-reduce of the reported loss and DDP's one-off broadcasts when it rebuilds its buckets in
its second step. Each block's collectives in the plan (`plan.intra_op`, the ILP's execution
of the layout) are compared with the estimate's per layer, as reduce-scatters and
all-gathers (`primitive_collectives`).

A row says whether the numbers matched the reference ("ok"), whether the runtime's collectives
are the estimate's ("same") or which (kind, bytes) x count only one side has, and whether the
ILP's per-layer collectives are the estimate's.

    python benchmarks/collectives_agreement.py [--models hf_llama,hf_qwen3] [--plans tp,zero3_pp]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import runtime_matrix as rm  # noqa: E402


def _difference(issued: Counter, charged: Counter) -> str:
    def text(c: Counter) -> str:
        return ", ".join(f"{kind} {n} B x{k}" for (kind, n), k in sorted(c.items())) or "-"

    return f"runtime only: {text(issued - charged)}; estimate only: {text(charged - issued)}"


@dataclass(frozen=True)
class Comparison:
    """One trained cell's tensor-parallel collectives: ``issued`` (rank 0's in a step, less
    the scalar all-reduce of the reported loss) and ``charged`` (the estimate's for the plan's
    layout) as {(kind, bytes): count}, and per block of the plan's ILP report its per-layer
    collectives and the estimate's, as reduce-scatters and all-gathers."""

    plan: Any
    issued: Counter
    charged: Counter
    blocks: dict[str, tuple[list, list]]

    @property
    def same(self) -> bool:
        return self.issued == self.charged

    @property
    def ilp_same(self) -> bool:
        return all(ilp == est for ilp, est in self.blocks.values())


def compare(cell, plan_dir: Path) -> Comparison:
    """`Comparison` of a cell that trained (`runtime_matrix.run_matrix` into ``plan_dir``)."""
    import torch

    import autopar
    from autopar.estimate.core import costs_of_layout
    from autopar.estimate.data_parallel import dp_step_collectives
    from autopar.estimate.pipeline_comm import pp_step_collectives
    from autopar.estimate.stages import layer_sequence
    from autopar.estimate.timing import tp_collectives
    from autopar.estimate.tp_comm import (cp_step_collectives, ep_step_collectives,
                                          primitive_collectives, tp_step_collectives)
    from autopar.plan import load_plan

    corpus = rm._corpus()
    plan = load_plan(plan_dir / f"{cell.model}.{cell.plan}.json")
    with torch.device("meta"):
        model = rm.factory(cell.model)()
    if cell.model in corpus.IMAGE_MODELS:
        shape = {"example_inputs": (torch.empty(plan.config.micro_batch_size,
                                                *corpus.IMAGE_SHAPE, device="meta"),)}
    else:
        shape = {"global_batch_size": plan.config.micro_batch_size,
                 "seq_len": plan.training.seq_len}
    costs = costs_of_layout(autopar.trace(model, dtype=plan.training.dtype, **shape),
                            plan.config, plan.tp_placements)
    costs = costs.with_ep_dispatch(plan.model.ep_dispatch)
    cfg = plan.config
    issued = Counter((kind, int(n)) for kind, n in cell.detail["collective_bytes"]
                     if kind != "broadcast" or cfg.zero_stage)  # DDP's bucket rebuild
    if not issued[("all_reduce", 4)]:
        raise ValueError(f"{cell.model} {cell.plan}: no all-reduce of the reported loss")
    issued[("all_reduce", 4)] -= 1  # the reported loss, summed over the ranks
    fqns = [f for _, f in layer_sequence(costs.units)]
    start = [fqns.index(stage[0]) for stage in plan.stages]
    cut = tuple((a, a + len(stage)) for a, stage in zip(start, plan.stages))
    where = {"global_batch_size": plan.training.global_batch_size, "boundaries": cut,
             "dtype": plan.training.dtype}
    options = plan.training.estimate_options
    charged = Counter((kind, round(n)) for kind, n in
                      tp_step_collectives(costs, cfg, options=options, **where)
                      + cp_step_collectives(costs, cfg, options=options, **where)
                      + ep_step_collectives(costs, cfg, boundaries=cut,
                                            global_batch_size=plan.training.global_batch_size)
                      + pp_step_collectives(costs, cfg, options=options, **where)
                      + dp_step_collectives(costs, cfg, options, **where))
    units = {u.name: u for u in costs.units}
    blocks = {block: (primitive_collectives(entry["forward_collectives"]
                                            + entry["backward_collectives"]),
                      primitive_collectives(sum(tp_collectives(units[block], plan.config), [])))
              for block, entry in plan.intra_op.items()}
    return Comparison(plan=plan, issued=+issued, charged=+charged, blocks=blocks)


def main(argv: list[str] | None = None) -> None:
    corpus = rm._corpus()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(corpus.TOKEN_MODELS + corpus.IMAGE_MODELS))
    ap.add_argument("--plans", default="tp,tp_sp")
    args = ap.parse_args(argv)
    models, plans = args.models.split(","), args.plans.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        cells = rm.run_matrix(models, plans, Path(tmp))
        rows = []
        for cell in cells:
            if cell.loss_err is None:
                rows.append((cell.model, cell.plan, cell.text()[:60], "", ""))
                continue
            got = compare(cell, Path(tmp))
            rows.append((cell.model, cell.plan, cell.text().split(" ")[0],
                         "same" if got.same else _difference(got.issued, got.charged),
                         "same" if got.ilp_same else "differs"))
    print("| model | plan | numerics | runtime vs estimate | ILP per layer vs estimate |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    ran = [r for r in rows if r[3]]
    print(f"\n{sum(r[3] == 'same' for r in ran)} of {len(ran)} cells that ran: the runtime "
          f"issued the collectives the estimate charges; {len(rows) - len(ran)} did not run")


if __name__ == "__main__":
    main()
