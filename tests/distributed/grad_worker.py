"""torchrun worker for the gradient checks (tests/distributed/test_gradients.py,
test_context_parallel.py): applies each given plan with
``autopar.runtime.apply_plan``, runs one ``train_step`` on a synthetic batch and compares the
loss and every gradient this rank holds (DTensor gradients gathered with ``full_tensor()``)
with a one-process reference step of the same model (token models get causal-LM tokens, image
models images and class labels: ``tiny_models.batch``).  Under dp > 1 a model with batch norm
normalises each rank's slice by its own statistics (as DDP and FSDP do), so its reference is the
mean of the per-slice losses.  AdamW hides a uniform gradient scale,
so loss parity over a few optimizer steps alone would not catch a wrong gradient averaging.
Writes ``<out>/<name>.<rank>.json``: ``{"loss_err", "grad_err", "grad_max", "n_grads",
"loss_parallel", "local_numel"}`` (whether this rank computed the loss on vocab-sharded
logits; the elements of each parameter it holds).
A spec prefixed ``refuse:`` instead runs the plan on a model whose attention bypasses
``autopar.models.common.attention`` and records the error every rank must raise.

    torchrun --standalone --nproc_per_node=4 grad_worker.py OUT_DIR [refuse:]PLAN.json:FACTORY ...
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import tiny_models
import torch
import torch.nn.functional as F
from torch import nn

import autopar.models.llama
from autopar import runtime
from autopar.plan import load_plan

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")  # longest first


def _clean(fqn: str) -> str:
    for w in _WRAPPERS:
        fqn = fqn.replace(w, "")
    return fqn


def _reference_loss(ref: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batch: int
                    ) -> torch.Tensor:
    """The reference of what the plan computes: the loss on the whole batch, or, for a model
    with batch norm, the mean of the losses of its micro-batches (each normalised by its own
    batch statistics, as each data-parallel rank runs its micro-batches one by one)."""
    n = x.shape[0] // micro_batch
    if n == 1 or not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in ref.modules()):
        return runtime.lm_loss(ref(x), y)
    return torch.stack([runtime.lm_loss(ref(xs), ys)
                        for xs, ys in zip(x.chunk(n), y.chunk(n))]).mean()


def _check(plan_path: str, factory: str) -> dict[str, float]:
    model = getattr(tiny_models, factory)()
    plan = load_plan(plan_path, model=model)
    ref = copy.deepcopy(model)
    x, y = tiny_models.batch(factory, model, plan)
    ref_loss = _reference_loss(ref, x, y, plan.config.micro_batch_size)
    ref_loss.backward()
    want = {name: p.grad for name, p in ref.named_parameters()}
    batches: list[int] = []  # the sequences of each forward of the whole model
    if plan.config.pp == 1:
        model.register_forward_pre_hook(lambda _, args: batches.append(args[0].shape[0]))
    sharded = runtime.apply_plan(model, plan)
    loss = sharded.train_step(x, y)
    grad_err, grad_max, n = 0.0, 0.0, 0
    local_numel: dict[str, int] = {}
    for module in sharded.modules:
        for name, p in module.named_parameters():
            local_numel[_clean(name)] = (p.to_local() if hasattr(p, "to_local") else p).numel()
            g = p.grad
            if g is None:
                raise RuntimeError(f"{name} got no gradient")
            if hasattr(g, "full_tensor"):
                g = g.full_tensor()
            w = want[_clean(name)]
            grad_err = max(grad_err, float((g - w).abs().max()))
            grad_max = max(grad_max, float(w.abs().max()))
            n += 1
    return {"loss_err": abs(loss - float(ref_loss)), "grad_err": grad_err, "grad_max": grad_max,
            "n_grads": n, "loss_parallel": sharded.loss_parallel, "local_numel": local_numel,
            "forward_batches": batches}


def _own_attention(q, k, v, **_):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=k.shape[1] != q.shape[1])


def _refusal(plan_path: str, factory: str) -> dict[str, str]:
    """The error a model that computes attention itself gets under cp (on every rank)."""
    model = getattr(tiny_models, factory)()
    plan = load_plan(plan_path, model=model)
    x, y = tiny_models.batch(factory, model, plan)
    sharded = runtime.apply_plan(model, plan)
    saved, autopar.models.llama.attention = autopar.models.llama.attention, _own_attention
    try:
        sharded.train_step(x, y)
    except NotImplementedError as exc:
        return {"error": str(exc)}
    finally:
        autopar.models.llama.attention = saved
    return {"error": ""}


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    rank, _, _ = runtime.init_distributed(timeout_s=60)
    for spec in sys.argv[2:]:
        refuse = spec.startswith("refuse:")
        plan_path, factory = spec.removeprefix("refuse:").rsplit(":", 1)
        result = _refusal(plan_path, factory) if refuse else _check(plan_path, factory)
        (out_dir / f"{Path(plan_path).stem}.{rank}.json").write_text(json.dumps(result))
    runtime.shutdown()


if __name__ == "__main__":
    main()
