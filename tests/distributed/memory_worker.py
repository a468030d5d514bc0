"""torchrun worker for test_memory.py: applies each saved plan given on the command line (all
made for this world size) to its model, trains one step while counting the model-state bytes
this rank holds, and writes them to ``OUT_DIR/<plan stem>.<rank>.json``.  Gradients are
counted after the step's backward and, under FSDP2, also after every unit's post-backward,
where a pipeline stage holds each unit's whole gradients until its last micro-batch
(``grads_peak``; FSDP2's internals: the unsharded parameters' gradients and the accumulated
ones it keeps in the reduce dtype)."""

import json
import sys
from pathlib import Path

import torch

import tiny_models
from autopar import runtime
from autopar.plan import load_plan
from autopar.runtime.memory import WeightWatcher, grad_bytes, local_bytes, optimizer_bytes


def _fsdp_gradient_bytes(modules) -> int:
    """The gradient bytes every FSDP2 unit of ``modules`` holds now: whole (unsharded, or
    accumulated in the reduce dtype) and sharded."""
    from torch.distributed.fsdp import FSDPModule

    total = 0
    for module in {id(s): s for m in modules for s in m.modules()
                   if isinstance(s, FSDPModule)}.values():
        group = module._get_fsdp_state()._fsdp_param_group
        for fp in group.fsdp_params if group is not None else ():
            unsharded = getattr(fp, "_unsharded_param", None)
            total += local_bytes(fp.unsharded_accumulated_grad) \
                + local_bytes(fp.sharded_param.grad) \
                + local_bytes(unsharded.grad if unsharded is not None else None)
    return total


class _GradientPeak:
    """The most gradient bytes FSDP2's units hold after any unit's post-backward."""

    def __init__(self, modules):
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        self.peak, self._cls, self._orig = 0, FSDPParamGroup, FSDPParamGroup.post_backward
        watcher = self

        def post_backward(group, *args, **kwargs):
            out = watcher._orig(group, *args, **kwargs)
            watcher.peak = max(watcher.peak, _fsdp_gradient_bytes(modules))
            return out

        FSDPParamGroup.post_backward = post_backward

    def remove(self) -> None:
        self._cls.post_backward = self._orig


def main(out_dir: str, specs: list[str]) -> None:
    rank, _, device = runtime.init_distributed(timeout_s=60)
    for spec in specs:  # PLAN_PATH:FACTORY
        path, factory = spec.rsplit(":", 1)
        torch.manual_seed(0)
        model = getattr(tiny_models, factory)()
        plan = load_plan(path, model=model)
        rt = runtime.apply_plan(model, plan, device=device)
        opt = runtime.make_optimizer(rt.parameters())
        watcher, grad_peak = WeightWatcher(rt.modules), _GradientPeak(rt.modules)
        x, y = tiny_models.batch(factory, model, plan)
        rt.train_step(x, y)
        grads = grad_bytes(rt.modules)
        opt.step()
        watcher.remove()
        grad_peak.remove()
        pp_rank = rt.mesh["pp"].get_local_rank() if plan.config.pp > 1 else 0
        record = {"rank": rank, "pp_rank": pp_rank, "weights": watcher.peak,
                  "weights_at_rest": watcher.rest, "grads": grads,
                  "grads_peak": max(grads, grad_peak.peak),
                  "optimizer": optimizer_bytes(opt)}
        Path(out_dir, f"{Path(path).stem}.{rank}.json").write_text(json.dumps(record))
    runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
