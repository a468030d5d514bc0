"""Mixture-of-experts modules as leaves costed under the expected routing.

Token routing is data-dependent (``topk`` then ``nonzero``/``where`` per expert), so it
cannot run on meta tensors; library expert kernels may also refuse meta inputs (a grouped
matmul that wants bf16). When a forward fails inside a module, ``find_moe`` walks up from the
failing module to the nearest module that holds experts, in one of two layouts:

* ``list``: a child ``ModuleList`` of structurally identical expert modules, plus an
  optional router (a child ``nn.Linear`` with one output per expert);
* ``fused``: 3-D parameters ``[num_experts, out, in]`` (Hugging Face ``MixtralExperts``,
  torchtitan ``GroupedExperts``), each applied once to every routed token.

The leaf forward records: the router (if the module owns one), one MOE_DISPATCH node
(tokens -> ``ceil(T·k·capacity_factor)`` routed rows), the experts on their share of the rows
(uniform routing: each expert gets ``rows / num_experts``, every expert's parameters appear),
and one MOE_COMBINE node back to the input shape. ``k`` comes from an integer top-k index
input if the module is given one, else from the first ``torch.topk`` its own forward took
before it failed on meta tensors, else from an attribute (``top_k``, ``num_experts_per_tok``).
The leaf returns one tensor shaped like its hidden-state input.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopar.errors import TraceError
from autopar.ir import MOE_GROUPED_MM, OpKind
from autopar.trace.blocks import all_alike

__all__ = ["find_moe", "is_data_dependent", "leaf_forward", "moe_experts"]

_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "topk", "k", "experts_per_token")


def is_data_dependent(error: BaseException) -> bool:
    """Whether an exception comes from needing tensor values on the meta device."""
    text = str(error)
    if type(error).__name__ in ("DynamicOutputShapeException", "DataDependentOutputException",
                                "GuardOnDataDependentSymNode"):
        return True
    return ("nonzero" in text or "data-dependent" in text.lower()
            or ("meta tensors" in text and "item" in text)
            or "Cannot access data pointer" in text)


def _expert_list(module: nn.Module) -> tuple[str, nn.ModuleList] | None:
    for name, child in module.named_children():
        if isinstance(child, nn.ModuleList) and len(child) >= 2:
            if all_alike(list(child)):
                return name, child
    return None


def _fused_params(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    if isinstance(module, nn.modules.conv._ConvNd):  # [out, in / groups, kernel], no experts
        return []
    params = [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
    if params and len({p.shape[0] for _, p in params}) == 1 and params[0][1].shape[0] >= 2:
        return params
    return []


def _routes_over_list(module: nn.Module) -> bool:
    listed = _expert_list(module)
    if listed is None:
        return False
    has_router = any(isinstance(m, nn.Linear) and m.out_features == len(listed[1])
                     for m in module.children())
    return has_router or any(isinstance(getattr(module, a, None), int) for a in _TOP_K_ATTRS)


def moe_experts(module: nn.Module) -> tuple[str, list[str], int] | None:
    """How ``module`` holds its experts, if it is an MoE layer in one of the two layouts:
    ``("list", [name of the expert ModuleList], E)`` or ``("fused", [names of its parameters
    with leading dim E], E)``; None otherwise."""
    if _routes_over_list(module):
        name, experts = _expert_list(module)
        return "list", [name], len(experts)
    fused = _fused_params(module)
    if fused:
        e = fused[0][1].shape[0]
        names = [n for n, p in module.named_parameters(recurse=False)
                 if p.dim() >= 2 and p.shape[0] == e]
        return "fused", names, e
    return None


def find_moe(modules: dict[str, nn.Module], path: str, leaves: set[str]) -> str | None:
    """The FQN of the innermost module at or above ``path`` that holds experts."""
    parts = path.split(".") if path else []
    for i in range(len(parts), -1, -1):
        fqn = ".".join(parts[:i])
        module = modules.get(fqn)
        if module is None or fqn in leaves:
            continue
        if _fused_params(module) or _routes_over_list(module):
            return fqn
    return None


def _top_k(module: nn.Module, int_inputs: list[torch.Tensor], fqn: str,
           taken: int | None) -> int:
    for t in int_inputs:
        if t.dim() >= 2:
            return int(t.shape[-1])
    if taken:
        return taken
    for m in [module, *module.children()]:
        for attr in _TOP_K_ATTRS:
            val = getattr(m, attr, None)
            if isinstance(val, int) and not isinstance(val, bool) and val > 0:
                return val
    raise TraceError("cannot tell how many experts each token is routed to", module_path=fqn,
                     op="moe routing", hint=f"route with torch.topk in the module's forward, "
                     f"pass it the chosen experts' indices, or give it one of {_TOP_K_ATTRS}")


def leaf_forward(module: nn.Module, fqn: str, recorder, capacity_factor: float, *,
                 top_k: int | None = None):
    """A replacement ``forward`` that records the module's expected-routing cost; ``top_k``
    the k of the first top-k the module's own forward took (None if it took none)."""

    def forward(*args, **kwargs):
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        floats = [t for t in tensors if t.dtype.is_floating_point]
        if not floats:
            raise TraceError("MoE leaf got no hidden-state tensor", module_path=fqn, op="forward")
        hidden = floats[0]
        width = hidden.shape[-1]
        tokens = hidden.numel() // width
        k = _top_k(module, [t for t in tensors if not t.dtype.is_floating_point], fqn, top_k)
        rows = math.ceil(tokens * k * capacity_factor)
        flat = hidden.reshape(tokens, width)
        listed = _expert_list(module)
        dispatch_in = [flat]
        if listed is not None:
            num_experts = len(listed[1])
            router = next((m for m in module.children()
                           if isinstance(m, nn.Linear) and m.out_features == num_experts), None)
            if router is not None:
                dispatch_in.append(router(flat))
        else:
            num_experts = _fused_params(module)[0][1].shape[0]
        with recorder.paused():
            routed = torch.empty(rows, width, dtype=hidden.dtype, device=hidden.device)
        recorder.emit(kind=OpKind.MOE_DISPATCH, target="moe.dispatch", short="moe_dispatch",
                      path=fqn, in_tensors=dispatch_in, out_tensors=[routed])
        if listed is not None:
            outs = _run_expert_list(listed[1], routed, num_experts)
        else:
            outs = [_run_fused(module, fqn, recorder, routed)]
        gates = [t for t in floats[1:] if t.dim() >= 1]
        with recorder.paused():
            out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        recorder.emit(kind=OpKind.MOE_COMBINE, target="moe.combine", short="moe_combine",
                      path=fqn, in_tensors=outs + gates[:1], out_tensors=[out], save=outs)
        return out

    return forward


def _run_expert_list(experts: nn.ModuleList, routed: torch.Tensor, num_experts: int):
    share = math.ceil(routed.shape[0] / num_experts)
    outs = []
    for e, expert in enumerate(experts):
        lo = min(e * share, routed.shape[0])
        hi = min(lo + share, routed.shape[0])
        outs.append(expert(routed[lo:hi]))
    return outs


def _activation(recorder, fqn: str, x: torch.Tensor, width: int) -> torch.Tensor:
    """The experts' activation between two GEMMs, as eager code runs it: ``act(x)``, or, when
    ``x`` is twice the next GEMM's input (the SwiGLU gate_up -> down shape), ``act(gate) * up``
    on its halves, which keeps ``x`` and ``act(gate)`` for backward."""
    rows = x.shape[0]
    with recorder.paused():
        act = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    recorder.emit(kind=OpKind.ELEMENTWISE, target="moe.expert_activation", short="expert_act",
                  path=fqn, in_tensors=[x], out_tensors=[act], save=[x])
    if x.shape[-1] != 2 * width:
        return act
    with recorder.paused():
        gated = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    recorder.emit(kind=OpKind.ELEMENTWISE, target="moe.expert_gate", short="expert_gate",
                  path=fqn, in_tensors=[act, x], out_tensors=[gated], save=[act])
    return gated


def _run_fused(module: nn.Module, fqn: str, recorder, routed: torch.Tensor) -> torch.Tensor:
    """Each 3-D weight [E, out, in] applied to every routed row, consecutive GEMMs joined by
    the experts' activation (`_activation`)."""
    x = routed
    rows = routed.shape[0]
    for i, (name, weight) in enumerate(_fused_params(module)):
        weight = getattr(module, name)  # the meta copy functional_call put in place
        _, out_dim, in_dim = weight.shape
        if i:
            x = _activation(recorder, fqn, x, in_dim)
        with recorder.paused():
            y = torch.empty(rows, out_dim, dtype=x.dtype, device=x.device)
        flops = 2 * rows * out_dim * in_dim
        grads = recorder.needs_grad(x) + recorder.needs_grad(weight)
        recorder.emit(kind=OpKind.MATMUL, target=MOE_GROUPED_MM, short=f"grouped_mm_{name}",
                      path=f"{fqn}", in_tensors=[x, weight], out_tensors=[y], flops_fwd=flops,
                      flops_bwd=flops * grads, save=[x])
        x = y
    return x
