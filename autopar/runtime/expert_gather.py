"""Expert parallelism of MoE layers written any way, on the layer's own forward: tokens are
all-gathered over the ep group, each rank runs the layer with its experts only, and the
outputs are reduce-scattered back (Megatron-core's all-gather token dispatcher).

Which layers: the modules the trace costs as MoE layers (``autopar.trace.moe.moe_experts``: a
``ModuleList`` of alike experts with a router or a top-k, or parameters with a leading expert
dim ``[E, ...]``, as Hugging Face's fused ``MixtralExperts``), except autopar's own
router/experts/top-k layers, which ``expert_parallel.ExpertParallelMoE`` runs with all-to-all.

Ep rank ``j`` keeps experts ``j·E/ep … (j+1)·E/ep − 1`` (the groups of
``expert_parallel.expert_groups``).  The others are absent: in a list, an ``_AbsentExpert``
returns zeros shaped like an expert's output and holds no parameters; fused parameters keep
their own rows and the layer's forward sees them placed in zeros of the full ``[E, ...]``
shape (a transient tensor: its memory and the zero experts' FLOPs in a batched-GEMM forward
are not in the estimate).  The layer's tensor inputs whose dim 0 matches the first one's
(tokens, or batch) are all-gathered on dim 0 over the ep group; its tensor outputs are
reduce-scattered on dim 0; backward is the reverse.

This is exact when the layer's outputs are the sum over experts of their contributions: before
a layer is changed, ``check_sum_of_experts`` compares its output on random inputs of the
shapes it is called with against the sum, over the ep ranks, of its output with only that
rank's experts, and refuses the layer otherwise (a shared expert, a bias added outside the
experts, an output that is not a sum of expert terms).

Gradients: an expert parameter's local gradient sums the contributions of every ep rank's
tokens routed to it, so experts are reduced as ``ExpertParallelMoE``'s (over their replicas,
divided by dp·cp); the router runs on every ep rank's tokens but its gradient on a rank holds
only the terms of that rank's experts, so the dense data-parallel mean is right for it.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_leaves, tree_map

from autopar.trace.moe import moe_experts

__all__ = ["apply_gathered_experts", "check_sum_of_experts", "expert_holders",
           "gathered_moe_modules", "split_rows_over_tp", "sum_of_parts_errors"]

log = logging.getLogger(__name__)

# module -> the names of its expert parameters (a local expert of a list: all of them; a fused
# layer: its [E, ...] parameters)
_HOLDERS: weakref.WeakKeyDictionary[nn.Module, tuple[str, ...]] = weakref.WeakKeyDictionary()


def gathered_moe_modules(model: nn.Module) -> list[str]:
    """FQNs of the MoE layers this module runs (outermost first; none inside another)."""
    found: list[str] = []
    for name, m in model.named_modules():
        if any(name.startswith(f + ".") for f in found):
            continue
        if moe_experts(m) is not None:
            found.append(name)
    return found


def expert_holders(module: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(holder, its expert parameters) for each module under ``module`` that holds expert
    parameters of a gathered layer (each local expert of a list; a fused layer)."""
    out = []
    for m in module.modules():
        names = _HOLDERS.get(m)
        if names is not None:
            out.append((m, [p for n, p in m.named_parameters() if not names or n in names]))
    return out


class _GatherRows(torch.autograd.Function):
    """All-gather on dim 0 over ``group``; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group, size: int):
        ctx.group, ctx.size = group, size
        out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // ctx.size,) + tuple(grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None, None


class _ScatterRows(torch.autograd.Function):
    """Reduce-scatter (sum) on dim 0 over ``group``; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group, size: int):
        ctx.group, ctx.size = group, size
        out = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((ctx.size * grad.shape[0],) + tuple(grad.shape[1:]))
        dist.all_gather_into_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None, None


class _AbsentExpert(nn.Module):
    """An expert another ep rank holds: zeros shaped like an expert's output."""

    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return x.new_zeros(tuple(x.shape[:-1]) + (self.out_features,))


def _expert_range(num_experts: int, ep: int, rank: int, fqn: str) -> range:
    if num_experts % ep:
        raise ValueError(f"{fqn} has {num_experts} experts, which do not split over ep={ep}; "
                         f"re-plan with an ep dividing {num_experts}")
    per = num_experts // ep
    return range(rank * per, (rank + 1) * per)


class _OnlyExperts:
    """Within this context ``layer`` computes with the experts in ``keep`` only."""

    def __init__(self, layer: nn.Module, keep: range, out_features: int | None):
        self.layer, self.keep, self.out_features = layer, keep, out_features
        self.layout = moe_experts(layer)
        self.saved: dict = {}

    def __enter__(self):
        kind, names, num = self.layout
        if kind == "list":
            experts = getattr(self.layer, names[0])
            for e in range(num):
                if e not in self.keep:
                    self.saved[e] = experts[e]
                    experts[e] = _AbsentExpert(self.out_features)
        else:
            for name in names:
                p = self.layer._parameters[name]
                self.saved[name] = p
                mask = torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)
                mask[self.keep.start:self.keep.stop] = 1
                self.layer._parameters[name] = p * mask.view(-1, *[1] * (p.dim() - 1))
        return self

    def __exit__(self, *exc):
        kind, names, _ = self.layout
        for key, value in self.saved.items():
            if kind == "list":
                getattr(self.layer, names[0])[key] = value
            else:
                self.layer._parameters[key] = value


def _expert_out_features(layer: nn.Module, inputs: tuple) -> int | None:
    """A list expert's output width, from calling one expert on one row of the layer's
    hidden width; None for a fused layer."""
    kind, names, _ = moe_experts(layer)
    if kind != "list":
        return None
    hidden = next(t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)
                  and t.is_floating_point())
    expert = getattr(layer, names[0])[0]
    w = next(expert.parameters())
    with torch.no_grad():
        return int(expert(torch.zeros(1, hidden.shape[-1], dtype=w.dtype,
                                      device=w.device)).shape[-1])


def _random_like(inputs: tuple, num_experts: int, gen: torch.Generator) -> tuple:
    """The layer's inputs with random values: floats normal, expert indices (integer tensors
    ``[..., k]`` below E) distinct random experts per row."""

    def fill(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, generator=gen).to(t.device, t.dtype)
        if t.dim() >= 1 and t.numel() and int(t.max()) < num_experts \
                and t.shape[-1] <= num_experts:
            rows = t.reshape(-1, t.shape[-1]).shape[0]
            picks = torch.stack([torch.randperm(num_experts, generator=gen)[:t.shape[-1]]
                                 for _ in range(rows)])
            return picks.reshape(t.shape).to(t.device, t.dtype)
        return t

    return tree_map(fill, inputs)


@torch.no_grad()
def check_sum_of_experts(layer: nn.Module, fqn: str, inputs: tuple, ep: int) -> int | None:
    """ValueError unless ``layer``'s outputs on random ``inputs`` (args, kwargs of a real call)
    equal the sum over the ``ep`` expert groups of its outputs with only that group's experts.
    Returns a list expert's output width (None for a fused layer)."""
    _, _, num = moe_experts(layer)
    out_features = _expert_out_features(layer, inputs)
    parts = (_OnlyExperts(layer, _expert_range(num, ep, rank, fqn), out_features)
             for rank in range(ep))
    for dtype, error in sum_of_parts_errors(layer, inputs, num, parts):
        if error > (1e-4 if dtype == torch.float32 else 2e-2):
            raise ValueError(
                f"{fqn} ({type(layer).__name__}): its output is not the sum of its experts' "
                f"contributions (a shared expert, or a term outside the experts), so expert "
                f"parallel cannot split it over ep={ep}; plan with ep=1 for this model")
    return out_features


def sum_of_parts_errors(layer: nn.Module, inputs: tuple, num_experts: int, parts
                        ) -> list[tuple[torch.dtype, float]]:
    """Per floating-point output of ``layer`` on random ``inputs`` (`_random_like`): its dtype
    and its largest difference, relative to its largest value, from the sum of the layer's
    outputs within each context of ``parts`` (a part of its experts or of their weights)."""
    args, kwargs = _random_like(inputs, num_experts, torch.Generator().manual_seed(0))
    want = layer(*args, **kwargs)
    total = None
    for part in parts:
        with part:
            out = layer(*args, **kwargs)
        total = out if total is None else tree_map(torch.add, total, out)
    return [(w.dtype, float((w - t).abs().max()) / (float(w.abs().max()) or 1.0))
            for w, t in zip(tree_leaves(want), tree_leaves(total))
            if isinstance(w, torch.Tensor) and w.is_floating_point()]


def _capture_inputs(model: nn.Module, fqns: list[str], example: torch.Tensor) -> dict[str, tuple]:
    """The (args, kwargs) of the first call of each layer in ``fqns`` during one forward of
    ``model`` on ``example`` (no gradients)."""
    seen: dict[str, tuple] = {}
    handles = []
    for fqn in fqns:
        def grab(_m, args, kwargs, fqn=fqn):
            seen.setdefault(fqn, (tree_map(_detached, args), tree_map(_detached, kwargs)))
        handles.append(model.get_submodule(fqn).register_forward_pre_hook(grab, with_kwargs=True))
    try:
        with torch.no_grad():
            model(example)
    finally:
        for h in handles:
            h.remove()
    return seen


def _detached(t: Any) -> Any:
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def _same_rows(t: Any, rows: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == rows


def _in_zeros(rows: torch.Tensor, keep: range, num: int) -> torch.Tensor:
    """A fused expert weight's rows ``keep`` (this ep rank's experts: a DTensor ``Shard(0)``
    on the ep mesh or, split over tp too, on the (ep, tp) mesh, or its local tensor) placed in
    zeros of all ``num`` experts' shape."""
    if isinstance(rows, DTensor):
        rows = rows.to_local()
    return torch.cat([rows.new_zeros((keep.start,) + tuple(rows.shape[1:])), rows,
                      rows.new_zeros((num - keep.stop,) + tuple(rows.shape[1:]))])


def split_rows_over_tp(rows: DTensor, tp_mesh: Any, placement: tuple) -> DTensor:
    """A fused expert weight's rows (`_install`: ``Shard(0)`` on the ep mesh) split further
    over the tensor-parallel ``tp_mesh`` by ``placement`` (on a feature dim): a DTensor on the
    (ep, tp) mesh, of the weight's global shape."""
    from torch.distributed.device_mesh import DeviceMesh

    from autopar.runtime.tp_moe import local_shard

    local = local_shard(rows.to_local().detach(), placement[0], tp_mesh.size(),
                        tp_mesh.get_local_rank())
    both = DeviceMesh._concatenate([rows.device_mesh, tp_mesh])
    return DTensor.from_local(local.clone(), both, (*rows.placements, *placement),
                              run_check=False, shape=rows.shape, stride=rows.stride())


def _install(layer: nn.Module, keep: range, out_features: int | None, groups: Any) -> None:
    """Make ``layer`` run with the experts in ``keep`` on every ep rank's inputs; fused expert
    parameters keep their rows as DTensors ``Shard(0)`` on the ep mesh."""
    kind, names, num = moe_experts(layer)
    group, ep = groups.ep_group, groups.ep
    if kind == "list":
        experts = getattr(layer, names[0])
        for e in range(num):
            if e not in keep:
                experts[e] = _AbsentExpert(out_features)
            else:
                _HOLDERS[experts[e]] = ()
    else:
        for name in names:
            p = layer._parameters[name]
            rows = DTensor.from_local(p.detach()[keep.start:keep.stop].clone(), groups.ep_mesh,
                                      (Shard(0),), run_check=False, shape=p.shape,
                                      stride=p.stride())
            layer._parameters[name] = nn.Parameter(rows, requires_grad=p.requires_grad)
        _HOLDERS[layer] = tuple(names)
    forward = type(layer).forward

    def gathered_forward(*args, **kwargs):
        first = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        rows = first.shape[0]

        def gather(t: Any) -> Any:
            return _GatherRows.apply(t, group, ep) if _same_rows(t, rows) else t

        args, kwargs = tree_map(gather, args), tree_map(gather, kwargs)
        saved = {}
        if kind == "fused":  # this rank's rows in place, zeros for the other ranks' experts
            for name in names:
                saved[name] = layer._parameters[name]
                layer._parameters[name] = _in_zeros(saved[name], keep, num)
        try:
            out = forward(layer, *args, **kwargs)
        finally:
            layer._parameters.update(saved)
        return tree_map(lambda t: _ScatterRows.apply(t, group, ep)
                        if _same_rows(t, rows * ep) and t.is_floating_point() else t, out)

    layer.forward = gathered_forward


def apply_gathered_experts(modules: list[nn.Module], model: nn.Module, groups: Any,
                           example: torch.Tensor) -> list[nn.Parameter]:
    """Run every MoE layer of ``modules`` (the rank's model or stage modules, cut from
    ``model``) with this ep rank's experts on all-gathered tokens; ``example`` is one
    micro-batch of the model's inputs, for the check of each kind of layer.  Returns the
    expert parameters this rank holds.  ValueError, before any collective, for a layer whose
    output is not a sum over its experts."""
    ep, rank = groups.ep, groups.ep_rank
    fqns = gathered_moe_modules(model)
    inputs = _capture_inputs(model, fqns, example)
    checked: dict[type, int | None] = {}
    for fqn in fqns:
        layer = model.get_submodule(fqn)
        if type(layer) not in checked and fqn in inputs:
            checked[type(layer)] = check_sum_of_experts(layer, fqn, inputs[fqn], ep)
    params: list[nn.Parameter] = []
    layers = 0
    for module in modules:
        for fqn in gathered_moe_modules(module):
            layer = module.get_submodule(fqn)
            if type(layer) not in checked:
                raise ValueError(f"{fqn} ({type(layer).__name__}) did not run in a forward of "
                                 f"the model, so expert parallel cannot check it; plan with ep=1")
            _, _, num = moe_experts(layer)
            keep = _expert_range(num, ep, rank, fqn)
            _install(layer, keep, checked[type(layer)], groups)
            params += [p for _, ps in expert_holders(layer) for p in ps]
            layers += 1
    log.info("expert parallel (all-gather dispatch): ep=%d, ep rank %d, %d MoE layers on this "
             "rank", ep, rank, layers)
    return params
