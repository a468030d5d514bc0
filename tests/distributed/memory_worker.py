"""torchrun worker for test_memory.py: applies each saved plan given on the command line (all
made for this world size) to its model, trains one step while counting the model-state bytes
this rank holds, and writes them to ``OUT_DIR/<plan stem>.<rank>.json``."""

import json
import sys
from pathlib import Path

import torch

import tiny_models
from autopar import runtime
from autopar.plan import load_plan
from autopar.runtime.memory import WeightWatcher, grad_bytes, optimizer_bytes


def main(out_dir: str, specs: list[str]) -> None:
    rank, _, device = runtime.init_distributed(timeout_s=60)
    for spec in specs:  # PLAN_PATH:FACTORY
        path, factory = spec.rsplit(":", 1)
        torch.manual_seed(0)
        model = getattr(tiny_models, factory)()
        plan = load_plan(path, model=model)
        rt = runtime.apply_plan(model, plan, device=device)
        opt = runtime.make_optimizer(rt.parameters())
        watcher = WeightWatcher(rt.modules)
        x, y = tiny_models.batch(factory, model, plan)
        rt.train_step(x, y)
        grads = grad_bytes(rt.modules)
        opt.step()
        watcher.remove()
        pp_rank = rt.mesh["pp"].get_local_rank() if plan.config.pp > 1 else 0
        record = {"rank": rank, "pp_rank": pp_rank, "weights": watcher.peak, "weights_at_rest": watcher.rest, "grads": grads,
                  "optimizer": optimizer_bytes(opt)}
        Path(out_dir, f"{Path(path).stem}.{rank}.json").write_text(json.dumps(record))
    runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
