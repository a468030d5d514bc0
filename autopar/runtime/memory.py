"""What one rank really holds of the model states, counted from the tensors themselves, to set
next to the plan's prediction (``Estimate.memory_by_stage[pp_rank]`` ``_weights`` / ``_grads``
/ ``_optimizer``).

* weights: the parameter bytes registered on this rank's modules at rest (``rest``) and the
  most at the end of any module forward (``peak``).  FSDP2 swaps its sharded parameters for
  the gathered ones while they are unsharded, so under ZeRO-1/2 ``peak`` is the full weights
  (kept from forward to backward), and under ZeRO-3 ``rest`` is the shard and ``peak - rest``
  the units gathered at once (the plan's ``zero3_buffers`` bounds it);
* gradients: the local gradient bytes after backward and the gradient reduction, before the
  optimizer step (sharded under FSDP2);
* optimizer: the bytes of the optimizer's per-parameter state tensors (AdamW's two moments;
  its scalar step counters are not model states and are left out).
DTensors count their local shard.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from autopar.plan.plan import Plan

__all__ = ["StateBytes", "StateCounter", "WeightWatcher", "grad_bytes", "local_bytes",
           "optimizer_bytes", "param_bytes"]


@dataclass(frozen=True)
class StateBytes:
    weights: float
    grads: float
    optimizer: float


def local_bytes(t: torch.Tensor | None) -> int:
    """Bytes of a tensor on this rank (a DTensor's local shard); 0 for None."""
    if t is None:
        return 0
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.numel() * local.element_size()


def _unique_params(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for m in modules:
        for p in m.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def param_bytes(modules: Iterable[nn.Module]) -> int:
    return sum(local_bytes(p) for p in _unique_params(modules))


def grad_bytes(modules: Iterable[nn.Module]) -> int:
    return sum(local_bytes(p.grad) for p in _unique_params(modules))


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                total += local_bytes(value)
    return total


class WeightWatcher:
    """``param_bytes(modules)`` now (``rest``) and its peak over the forward passes of
    ``modules`` and their submodules (``peak``); ``remove()`` detaches the hooks."""

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules
        self.rest = self.peak = param_bytes(modules)
        self._hooks = [sub.register_forward_hook(self._seen)
                       for m in modules for sub in m.modules()]

    def _seen(self, *_args) -> None:
        self.peak = max(self.peak, param_bytes(self.modules))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


class StateCounter:
    """Counts what this rank holds of the model states during one training step, for the
    generated script's report: create it before the step, call ``after_backward()`` and
    ``after_step(optimizer)``, then ``line(plan)`` sets the counts next to the plan's
    prediction for this rank's pipeline stage (``pp_rank``)."""

    def __init__(self, modules: list[nn.Module], pp_rank: int = 0):
        self.pp_rank = pp_rank
        self._watcher = WeightWatcher(modules)
        self._modules = modules
        self.grads = self.optimizer = 0

    def after_backward(self) -> None:
        self.grads = grad_bytes(self._modules)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer_bytes(optimizer)
        self._watcher.remove()

    def held(self, zero_stage: int) -> StateBytes:
        """Weights as the plan counts them: the shard at rest under ZeRO-3, the peak
        otherwise."""
        w = self._watcher
        return StateBytes(w.rest if zero_stage == 3 else w.peak, self.grads, self.optimizer)

    def line(self, plan: Plan | None = None) -> str:
        if plan is None:
            held = self.held(0)
            return (f"model states held: weights {_mib(held.weights)}, grads "
                    f"{_mib(held.grads)}, optimizer {_mib(held.optimizer)}")
        held = self.held(plan.config.zero_stage)
        want = plan.estimate.memory_by_stage[self.pp_rank]
        parts = [f"{name} {_mib(got)} (plan {_mib(want['_' + name])})"
                 for name, got in (("weights", held.weights), ("grads", held.grads),
                                   ("optimizer", held.optimizer))]
        return f"model states held on pipeline rank {self.pp_rank}: " + ", ".join(parts)
