"""torchrun worker of ``benchmarks/runtime_matrix.py``: for each ``PLAN.json:FACTORY`` given,
builds the corpus model, applies the plan with ``autopar.runtime.apply_plan`` and trains it for
the given number of AdamW steps next to a one-process reference (a deep copy of the same model,
the same global batches); writes ``<out>/<plan stem>.<rank>.json`` with the largest relative
loss difference over the steps, the largest gradient difference after the first backward
(relative to the largest reference gradient, over the parameters this rank holds; for an fp8
plan also the same two differences between its fp8 reference and a bf16 one, `_Bf16`), the
collectives of the second step by kind (``CommDebugMode``) and each with its bytes in
``Cluster.collective_time``'s convention (``_CollectiveLog``; plans without a pipeline), or the
error this rank raised.

    torchrun --standalone --nproc_per_node=N runtime_matrix_worker.py OUT_DIR STEPS PLAN.json:FACTORY ...
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import corpus
import torch
from runtime_matrix import factory
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from autopar import runtime
from autopar.plan import load_plan
from autopar.runtime.train import make_optimizer, synthetic_batch, synthetic_images, vocab_size

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def _clean(fqn: str) -> str:
    for w in _WRAPPERS:
        fqn = fqn.replace(w, "")
    return fqn


def _batch(model_name: str, model, plan, step: int):
    size = plan.training.global_batch_size
    if model_name in corpus.IMAGE_MODELS:
        return synthetic_images(step, 0, size, corpus.IMAGE_SHAPE, corpus.NUM_CLASSES)
    return synthetic_batch(step, 0, size, plan.training.seq_len, vocab_size(model))


# collective ops (functional, as DTensor issues them, and c10d's) -> (kind, the tensor that
# gives its bytes: "in" the local input, "out" the gathered output)
_COLLECTIVES = {
    "all_reduce": ("all_reduce", "in"), "allreduce_": ("all_reduce", "in"),
    "all_gather_into_tensor": ("all_gather", "out"), "_allgather_base_": ("all_gather", "out"),
    "reduce_scatter_tensor": ("reduce_scatter", "in"),
    "_reduce_scatter_base_": ("reduce_scatter", "in"),
    "all_to_all_single": ("all_to_all", "in"), "alltoall_base_": ("all_to_all", "in"),
    "broadcast_": ("broadcast", "in"),
    "send": ("send_recv", "in"),  # a ring's hop: counted once, by its sender
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(map(_nbytes, x)) if isinstance(x, (list, tuple)) else 0


class _CollectiveLog(TorchDispatchMode):
    """Every collective a rank issues, as ``[kind, nbytes]`` in ``Cluster.collective_time``'s
    convention (all-gather: the gathered size; reduce-scatter: the input; all-to-all: what a
    rank sends), and how many of each op (functional ``all_reduce`` as DTensor issues it,
    c10d's ``allreduce_``, ...)."""

    def __init__(self):
        super().__init__()
        self.log: list[list] = []
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first lowers the op to local ops and collectives
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        namespace, _, op = name.partition("::")
        if namespace in ("_c10d_functional", "_c10d_functional_autograd", "c10d") \
                and op in _COLLECTIVES:
            kind, which = _COLLECTIVES[op]
            if namespace == "c10d":  # (output, input, ...) or (tensors, ...)
                tensor = args[0] if which == "out" or op in ("allreduce_", "broadcast_", "send") \
                    else args[1]
            else:
                tensor = out if which == "out" else args[0]
            self.log.append([kind, _nbytes(tensor)])
            self.counts[op] = self.counts.get(op, 0) + 1
        return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _Bf16:
    """An fp8 plan's reference trained in bf16 beside it: how far fp8 rounding alone moves the
    losses and first gradients, the scale an fp8 cell's differences are judged on."""

    def __init__(self, model, plan):
        self.model = copy.deepcopy(model)
        self.opt = make_optimizer(self.model.parameters())
        self.plan = SimpleNamespace(training=dataclasses.replace(plan.training, dtype="bf16"))
        self.loss_gap = self.grad_gap = 0.0

    def step(self, x, y, want: float, ref_grads: dict | None, scale: float) -> None:
        with runtime.precision(self.plan, "cpu"):
            loss = runtime.lm_loss(self.model(x), y)
        loss.backward()
        self.loss_gap = max(self.loss_gap, abs(float(loss) - want) / max(abs(want), 1e-12))
        if ref_grads is not None:
            for name, p in self.model.named_parameters():
                if p.grad is not None and ref_grads.get(name) is not None:
                    self.grad_gap = max(self.grad_gap,
                                        float((p.grad - ref_grads[name]).abs().max()) / scale)
        self.opt.step()
        self.opt.zero_grad()


def _run(plan_path: str, model_name: str, steps: int) -> dict:
    torch.manual_seed(0)
    model = factory(model_name)()
    plan = load_plan(plan_path)  # compiled from this factory (a generated script checks it)
    ref = copy.deepcopy(model)
    ref_opt = make_optimizer(ref.parameters())
    bf16 = _Bf16(model, plan) if plan.training.dtype == "fp8" else None
    sharded = runtime.apply_plan(model, plan)
    opt = make_optimizer(sharded.parameters())
    loss_err = grad_err = 0.0
    log = _CollectiveLog()
    for step in range(1, steps + 1):
        x, y = _batch(model_name, ref, plan, step)
        with runtime.precision(plan, "cpu", ref):  # an fp8 plan's reference runs in fp8
            want = runtime.lm_loss(ref(x), y)
        want.backward()
        if bf16 is not None:
            grads = {n: p.grad for n, p in ref.named_parameters()} if step == 1 else None
            bf16.step(x, y, float(want), grads, max(
                float(g.abs().max()) for g in grads.values() if g is not None) if grads else 1.0)
        # not counted under zero-bubble pipelines: the dispatch mode upsets their split backward
        count = step == 2 and (plan.config.pp == 1 or plan.config.pp_schedule != "zero-bubble")
        with log if count else contextlib.nullcontext():
            got = sharded.train_step(x, y)
        loss_err = max(loss_err, abs(got - float(want)) / max(abs(float(want)), 1e-12))
        if step == 1:
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
            scale = max(float(g.abs().max()) for g in ref_grads.values() if g is not None)
            for module in sharded.modules:
                for name, p in module.named_parameters():
                    w = ref_grads[_clean(name)]
                    if w is None and p.grad is None:
                        continue  # an expert that no token reached
                    if p.grad is None:
                        raise RuntimeError(f"{name} got no gradient")
                    diff = float((_full(p.grad) - w).abs().max())
                    grad_err = max(grad_err, diff / scale)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    gaps = {"fp8_loss_gap": bf16.loss_gap, "fp8_grad_gap": bf16.grad_gap} if bf16 else {}
    return {"loss_err": loss_err, "grad_err": grad_err, **gaps,
            "loss_parallel": sharded.loss_parallel, "collective_bytes": log.log,
            "collectives": dict(sorted(log.counts.items()))}


def main() -> None:
    out_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    rank, _, _ = runtime.init_distributed(timeout_s=60)
    for spec in sys.argv[3:]:
        plan_path, model_name = spec.rsplit(":", 1)
        try:
            result = _run(plan_path, model_name, steps)
        except Exception as exc:  # recorded per cell; the launch goes on to the next one
            last = traceback.format_exc().strip().splitlines()[-1]
            if os.environ.get("AUTOPAR_MATRIX_TRACEBACK"):
                traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else last}"}
        (out_dir / f"{Path(plan_path).stem}.{rank}.json").write_text(json.dumps(result))
    runtime.shutdown()
    sys.stdout.flush()
    os._exit(0)  # gloo's worker threads can abort the interpreter's finalization


if __name__ == "__main__":
    main()
