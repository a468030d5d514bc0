"""Expert parallelism: each rank keeps ``E / ep`` of every MoE layer's experts and exchanges
tokens with the other ranks of its ep group by all-to-all.

Which modules: any module with a ``router`` (``nn.Linear`` with one output per expert), an
``experts`` ``nn.ModuleList`` and a ``top_k`` (or ``num_experts_per_tok``) attribute, whose
forward is softmax → top-k → (optionally renormalised) gates → gate-weighted sum of the chosen
experts' outputs (``autopar.models.mixtral.MoE``).  Before replacing a module its own forward
is compared with that formula on a few random tokens, so a module that routes differently is
refused instead of silently computing something else.  MoE layers written otherwise run on
their own forward with an all-gather dispatch (``autopar.runtime.expert_gather``), in the same
groups and with the same expert gradient reduction.

Groups.  The ``dp·cp`` ranks of one (pp, tp) coordinate, numbered ``i = dp_rank·cp + cp_rank``,
form ``dp·cp / ep`` ep groups of ``ep`` consecutive ranks (``i // ep`` equal); ep rank
``j = i % ep`` owns experts ``j·E/ep … (j+1)·E/ep - 1``.  The ranks with the same ``j`` hold the
same experts: the expert's *replica group* (``i % ep`` equal, ``dp·cp / ep`` ranks).

Forward, per MoE layer, on each rank's local tokens: route locally (the router is a dense,
replicated parameter), sort the (token, slot) pairs by expert, exchange per-expert counts
(all-to-all of ``E`` integers), send the token rows to the experts' owners (autograd
all-to-all with uneven, possibly zero, splits), run the local experts (each is called on every
rank, with zero rows if need be, so sharded experts' collectives stay in step), send the
results back (the reverse all-to-all) and add them up weighted by the gates, as the reference
does.  Parameter names do not change: ``experts`` becomes a ``ModuleDict`` keyed by the
original expert index, so ``layers.0.feed_forward.experts.3.w1.weight`` is still that name.

Gradients.  The reference loss is the mean over the global batch, ``L = (1/D) Σ_r L_r`` with
``D = dp·cp`` and ``L_r`` rank r's local mean.  Each rank's backward starts from its own
``L_r``; the all-to-all backward carries every routed token's gradient to the expert's owner,
so an owner's local expert gradient is ``Σ_{r in its ep group} ∂L_r/∂θ``.  Summed over the
replica group that is ``Σ_{all r} ∂L_r/∂θ``, hence the expert gradient is
``(Σ over the replica group of local gradients) / D`` (not the replica-group mean).  The router
only touches local tokens (its gates multiply the returned expert outputs on the token's home
rank), so its local gradient is ``∂L_r/∂W_router`` and the data-parallel mean over ``D`` is
right: it stays with the dense parameters.

ZeRO.  Expert parameters are left out of the dense data-parallel wrapper (``ignored_params``).
ZeRO-0, or a replica group of one rank: after backward (``sync_expert_gradients``) one flat
all-reduce per dtype over the replica group, then ``/ D``.  ZeRO-1/2/3 with replicas: FSDP2
``fully_shard`` on every local expert over the replica group (``reshard_after_forward`` as for
the dense blocks), gradient divide factor ``D`` with sum-only reductions (gloo has no
``PREMUL_SUM``), applied before the dense wrapper.

Tensor parallel.  The plan shards experts Megatron-style on tp (every expert Linear ``S(0)``
on its output features but one, ``S(1)``, on its input features: w1/w3 column-, w2
row-parallel) and replicates the router; the estimate costs one tp all-reduce of the layer's
hidden state per MoE sub-layer.  That is what runs: every tp rank of a (dp, cp) coordinate has
the same tokens and routes them identically, its ep group is the ranks with its tp coordinate,
its experts compute with their local shards (``DTensor`` parameters, so optimizer, FSDP2 and
checkpoints see tp shards), the combined output is summed over tp once (all-reduce), and in
backward the gradients of the dispatched hidden state and of the gates are summed over tp (the
experts' partial outputs make them partial).  A plan that replicates experts on tp also runs
(experts replicated over tp, logged as a mismatch with the estimate); other tp layouts of
experts are refused.  Sequence parallelism is not applied to MoE blocks (the tensor-parallel
module skips SP when blocks are not Megatron-shaped).
"""

from __future__ import annotations

import copy
import logging
import re
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.runtime.context_parallel import replica_dims
from autopar.runtime.data_parallel import fsdp_precision, reshards_after_forward
from autopar.runtime.local_attention import sum_grad_over_tp

if TYPE_CHECKING:
    from autopar.plan.plan import Plan

__all__ = ["ExpertGroups", "ExpertParallelMoE", "apply_expert_parallel", "check_expert_parallel",
           "expert_groups", "find_moe_modules", "shard_expert_params", "sync_expert_gradients"]

log = logging.getLogger(__name__)

_TOP_K_ATTRS = ("top_k", "num_experts_per_tok")
_SHARD = re.compile(r"^S\((-?\d+)\)$")
# top-level module → the expert gradient reduction to run after its backward (ZeRO-0 path)
_SYNCS: weakref.WeakKeyDictionary[nn.Module, _ExpertGradientSync] = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------------------------------------
# autograd collectives


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``in_splits`` go to the group's ranks in order; the result is
    the rows received, ``out_splits[s]`` from rank s.  Backward sends the gradients home."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _SumOverTP(torch.autograd.Function):
    """Forward sums partial outputs over the tp group; backward is the identity (``g``)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ---------------------------------------------------------------------------------------------
# finding MoE modules and checking what they compute


def _top_k(module: nn.Module) -> int | None:
    for attr in _TOP_K_ATTRS:
        k = getattr(module, attr, None)
        if isinstance(k, int) and k > 0:
            return k
    return None


def _is_moe(module: nn.Module) -> bool:
    experts, router = getattr(module, "experts", None), getattr(module, "router", None)
    return (isinstance(experts, nn.ModuleList) and len(experts) > 0
            and isinstance(router, nn.Linear) and router.out_features == len(experts)
            and _top_k(module) is not None)


def find_moe_modules(module: nn.Module) -> list[str]:
    """FQNs of the MoE modules (router + experts list + top_k) in ``module``, outermost first."""
    return [name for name, m in module.named_modules() if _is_moe(m)]


def _route(logits: torch.Tensor, top_k: int, renormalize: bool):
    """(gates [tokens, k], chosen experts [tokens, k]): softmax then top-k, as the reference."""
    weights, chosen = F.softmax(logits, dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def _dense_formula(moe: nn.Module, flat: torch.Tensor, top_k: int, renormalize: bool):
    weights, chosen = _route(moe.router(flat), top_k, renormalize)
    out = torch.zeros_like(flat)
    for e, expert in enumerate(moe.experts):
        token, slot = torch.where(chosen == e)
        out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
    return out


@torch.no_grad()
def _routing_kind(moe: nn.Module, fqn: str) -> bool:
    """Whether ``moe`` renormalises its top-k gates, read off its own forward on 16 random
    tokens; ValueError when neither formula reproduces it."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    w = moe.router.weight
    x = torch.randn(1, 16, moe.router.in_features, generator=gen).to(w.device, w.dtype)
    got = moe(x)
    got = got[0] if isinstance(got, tuple) else got
    got = got.reshape(-1, x.shape[-1])
    scale = float(got.abs().max()) or 1.0
    tol = 1e-4 if w.dtype == torch.float32 else 2e-2
    for renormalize in (True, False):
        want = _dense_formula(moe, x.reshape(-1, x.shape[-1]), _top_k(moe), renormalize)
        if float((got - want).abs().max()) <= tol * scale:
            return renormalize
    raise ValueError(f"{fqn} ({type(moe).__name__}) has a router and an experts list, but its "
                     f"forward is not softmax → top-{_top_k(moe)} → gate-weighted experts (with "
                     f"or without renormalised gates), the routing expert parallel reproduces; "
                     f"plan with ep=1 for this model")


# ---------------------------------------------------------------------------------------------
# groups


@dataclass
class ExpertGroups:
    """This rank's expert-parallel coordinates and process groups."""

    ep: int
    ep_rank: int
    ep_group: Any  # ProcessGroup of the ep ranks that exchange tokens
    replica_mesh: Any  # 1-D DeviceMesh of the ranks holding the same experts
    num_replicas: int
    dp_cp: int  # D: the expert gradient divisor
    tp: int
    tp_rank: int
    tp_mesh: Any  # DeviceMesh the tp-sharded expert DTensors live on (or None)
    ep_mesh: Any = None  # 1-D DeviceMesh of the ep group (fused expert rows are Shard(0) on it)


def expert_groups(mesh: Any, plan: Plan) -> ExpertGroups:
    """Build the ep and replica groups from the plan's mesh, in its mesh order (collective:
    every rank must call it)."""
    cfg = plan.config
    deg = dict(zip(plan.mesh.axes, (int(s) for s in plan.mesh.sizes)))
    dp, cp, tp, ep = deg.get("dp", 1), deg.get("cp", 1), deg.get("tp", 1), cfg.ep
    d = dp * cp
    if ep < 1 or d % ep:
        raise ValueError(f"ep={ep} must divide dp*cp = {d}; re-plan with an ep in "
                         f"{[k for k in range(1, d + 1) if d % k == 0]}")
    # the (dp, cp) replicas flattened in mesh order, then cut into runs of ep consecutive ones
    flat = mesh[replica_dims(mesh)]._flatten("autopar_ep_dp_cp")
    split = flat._unflatten(0, (d // ep, ep), ("autopar_expert_replica", "autopar_ep"))
    return ExpertGroups(ep=ep, ep_rank=split["autopar_ep"].get_local_rank(),
                        ep_group=split["autopar_ep"].get_group(),
                        replica_mesh=split["autopar_expert_replica"], num_replicas=d // ep,
                        dp_cp=d, tp=tp, tp_rank=mesh["tp"].get_local_rank() if tp > 1 else 0,
                        tp_mesh=mesh["tp"] if tp > 1 else None, ep_mesh=split["autopar_ep"])


# ---------------------------------------------------------------------------------------------
# tensor parallel inside the experts


def _spec_dim(placements: dict[str, dict[str, str]], fqn: str, axis: str) -> int | None:
    spec = placements.get(fqn, {}).get(axis, "R")
    if spec in ("R", "P"):
        return None
    m = _SHARD.match(spec)
    if not m:
        raise ValueError(f"placement {spec!r} of {fqn} on the {axis} axis is not 'R', 'P' or 'S(d)'")
    return int(m.group(1))


def _expert_tp_layout(expert: nn.Module, prefix: str, placements) -> dict[str, int] | None:
    """{Linear name in the expert: weight dim sharded on tp (0 column, 1 row)}, or None when the
    plan replicates the expert on tp.  ValueError for any other layout."""
    linears = {n: m for n, m in expert.named_modules() if isinstance(m, nn.Linear)}
    dims = {n: _spec_dim(placements, f"{prefix}.{n}.weight", "tp") for n in linears}
    if all(d is None for d in dims.values()) and not any(
            _spec_dim(placements, f"{prefix}.{n}", "tp") is not None
            for n, _ in expert.named_parameters()):
        return None
    dims = {n: (d % 2 if d is not None else None) for n, d in dims.items()}
    rows = [n for n, d in dims.items() if d == 1]
    in_linears = {f"{n}.{p}" for n, m in linears.items() for p, _ in m.named_parameters()}
    others = [n for n, _ in expert.named_parameters() if n not in in_linears]
    row_bias = [n for n in rows if linears[n].bias is not None]
    if len(rows) != 1 or any(d is None for d in dims.values()) or others or row_bias:
        raise ValueError(
            f"{prefix}: expert parallel runs tensor-parallel experts only in Megatron's layout "
            f"(every Linear weight S(0) on tp except one S(1), no row-parallel bias, no other "
            f"parameters); the plan has "
            f"{ {n: (f'S({d})' if d is not None else 'R') for n, d in dims.items()} }"
            f"{f', other parameters {others}' if others else ''}; re-plan with tp=1 or ep=1")
    return dims


def _chunk(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    parts = torch.chunk(t, tp, dim=dim)
    if len(parts) != tp:
        raise ValueError(f"cannot shard a dim of size {t.shape[dim]} over tp={tp}")
    return parts[rank]


@torch.no_grad()
def _check_tp_decomposition(expert: nn.Module, dims: dict[str, int], tp: int, prefix: str):
    """Σ over tp shards of the expert's partial outputs must equal its output (true when the
    expert is column-parallel Linears, elementwise ops, one row-parallel Linear)."""
    w = next(expert.parameters())
    gen = torch.Generator(device="cpu").manual_seed(0)
    in_features = next(m for m in expert.modules() if isinstance(m, nn.Linear)).in_features
    x = torch.randn(8, in_features, generator=gen).to(w.device, w.dtype)
    want, total = expert(x), 0
    for t in range(tp):
        part = copy.deepcopy(expert)
        for name, dim in dims.items():
            lin = part.get_submodule(name)
            lin.weight = nn.Parameter(_chunk(lin.weight, dim, tp, t))
            if lin.bias is not None:
                lin.bias = nn.Parameter(_chunk(lin.bias, 0, tp, t))
        total = total + part(x)
    if float((total - want).abs().max()) > 1e-4 * (float(want.abs().max()) or 1.0):
        raise ValueError(f"{prefix}: the plan shards this expert Megatron-style on tp, but the sum "
                         f"of its shards' outputs is not its output (is there a non-elementwise op "
                         f"between its column- and row-parallel Linears?); re-plan with tp=1")


def _local_linear_forward(lin: nn.Linear):
    """A forward for a Linear whose parameters are tp-sharded DTensors: the local shards only
    (a partial sum for a row-parallel one; the MoE layer sums over tp once, after combining)."""

    def forward(x):
        weight, bias = lin.weight, lin.bias
        weight = weight.to_local() if hasattr(weight, "to_local") else weight
        bias = bias.to_local() if bias is not None and hasattr(bias, "to_local") else bias
        return F.linear(x, weight, bias)

    return forward


def _shard_expert_on_tp(expert: nn.Module, dims: dict[str, int], groups: ExpertGroups) -> None:
    for name, dim in dims.items():
        lin = expert.get_submodule(name)
        for pname, d in (("weight", dim), ("bias", 0)):
            p = getattr(lin, pname)
            if p is None:
                continue
            local = _chunk(p.detach(), d, groups.tp, groups.tp_rank).contiguous()
            dt = DTensor.from_local(local, groups.tp_mesh, [Shard(d)], run_check=False,
                                    shape=p.shape, stride=p.stride())
            setattr(lin, pname, nn.Parameter(dt, requires_grad=p.requires_grad))
        lin.forward = _local_linear_forward(lin)


# ---------------------------------------------------------------------------------------------
# the expert-parallel MoE layer


class _KeptLayers(nn.ModuleDict):
    """The experts a rank keeps, keyed by their index in the full layer; iterating yields the
    experts (not the keys) in order, as iterating the full layer's ModuleList does."""

    def __iter__(self):
        return iter(self._modules.values())


class ExpertParallelMoE(nn.Module):
    """One MoE layer under expert parallelism: the same router, this ep rank's experts (keyed
    by their index in the full layer), token dispatch and combine by all-to-all."""

    handles_own_tensor_parallel = True  # tensor_parallel.tp_styles leaves this subtree alone

    def __init__(self, moe: nn.Module, groups: ExpertGroups, *, renormalize: bool,
                 tp_sharded: bool):
        super().__init__()
        num_experts = len(moe.experts)
        if num_experts % groups.ep:
            raise ValueError(f"{num_experts} experts do not split over ep={groups.ep}; "
                             f"re-plan with an ep that divides {num_experts}")
        self.num_experts, self.top_k, self.renormalize = num_experts, _top_k(moe), renormalize
        self.num_local = num_experts // groups.ep
        self.first = groups.ep_rank * self.num_local
        self.router = moe.router
        self.experts = _KeptLayers({str(e): moe.experts[e]
                                    for e in range(self.first, self.first + self.num_local)})
        self.groups, self.tp_sharded = groups, tp_sharded
        self._tp_group = groups.tp_mesh.get_group() if tp_sharded else None

    def extra_repr(self) -> str:
        return (f"experts {self.first}..{self.first + self.num_local - 1} of {self.num_experts}, "
                f"top_k={self.top_k}, ep={self.groups.ep}, tp_sharded={self.tp_sharded}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        k, ep, num_local = self.top_k, self.groups.ep, self.num_local
        weights, chosen = _route(self.router(flat), k, self.renormalize)
        expert_of = chosen.reshape(-1)  # pair p = (token p // k, slot p % k)
        order = torch.argsort(expert_of, stable=True)  # by expert, hence by owner
        token_of = order // k
        gates = weights.reshape(-1)[order]
        source = flat
        if self.tp_sharded:  # partial expert outputs make these gradients partial over tp
            source = sum_grad_over_tp(flat, self._tp_group)
            gates = sum_grad_over_tp(gates, self._tp_group)
        send = source[token_of]
        counts = torch.bincount(expert_of, minlength=self.num_experts)
        if ep > 1:
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=self.groups.ep_group)
            per_source = recv_counts.view(ep, num_local)  # [source rank, local expert]
            send_splits = counts.view(ep, num_local).sum(1).tolist()
            recv_splits = per_source.sum(1).tolist()
            recv = _AllToAll.apply(send, recv_splits, send_splits, self.groups.ep_group)
        else:
            per_source = counts.view(1, num_local)
            recv = send
        # received rows are grouped by source, then by local expert: regroup by expert
        local_of_row = torch.arange(num_local, device=x.device).repeat(per_source.shape[0])
        local_of_row = local_of_row.repeat_interleave(per_source.reshape(-1))
        by_expert = torch.argsort(local_of_row, stable=True)
        chunks = recv[by_expert].split(per_source.sum(0).tolist())
        outs = torch.cat([expert(rows) for expert, rows in zip(self.experts, chunks)])
        results = torch.empty_like(outs).index_copy(0, by_expert, outs)
        if ep > 1:
            results = _AllToAll.apply(results, send_splits, recv_splits, self.groups.ep_group)
        out = torch.zeros_like(flat).index_add(0, token_of, results * gates[:, None])
        if self.tp_sharded:
            out = _SumOverTP.apply(out, self._tp_group)
        return out.view_as(x)


# ---------------------------------------------------------------------------------------------
# applying it to a model and reducing the expert gradients


def apply_expert_parallel(modules: list[nn.Module], plan: Plan, groups: ExpertGroups
                          ) -> list[nn.Parameter]:
    """Replace every MoE layer of ``modules`` (the rank's model or pipeline stage modules, FQNs
    as in the plan) by an ``ExpertParallelMoE`` holding this rank's experts, sharded on tp as
    the plan says.  Returns the expert parameters this rank holds (for ``ignored_params``)."""
    expert_params: list[nn.Parameter] = []
    found = 0
    for module in modules:
        for fqn in find_moe_modules(module):
            moe = module.get_submodule(fqn)
            if any(isinstance(m, ExpertParallelMoE) for m in moe.modules()):
                continue
            found += 1
            _check_ep_placements(moe, fqn, plan.placements)
            renormalize = _routing_kind(moe, fqn)
            layouts = [_expert_tp_layout(moe.experts[e], f"{fqn}.experts.{e}", plan.placements)
                       if groups.tp > 1 else None for e in range(len(moe.experts))]
            sharded = [lay is not None for lay in layouts]
            if any(sharded) and not all(sharded):
                raise ValueError(f"{fqn}: the plan shards some experts on tp and replicates "
                                 f"others; expert parallel needs one layout for all")
            if sharded[0]:
                _check_tp_decomposition(moe.experts[0], layouts[0], groups.tp, f"{fqn}.experts.0")
            elif groups.tp > 1:
                log.warning("%s: the plan replicates the experts on tp=%d: running them "
                            "replicated (the estimate assumes tp-sharded experts: it under-counts "
                            "their memory and compute per rank)", fqn, groups.tp)
            ep_moe = ExpertParallelMoE(moe, groups, renormalize=renormalize,
                                       tp_sharded=sharded[0])
            if sharded[0]:
                for e in range(ep_moe.first, ep_moe.first + ep_moe.num_local):
                    _shard_expert_on_tp(ep_moe.experts[str(e)], layouts[e], groups)
            parent, _, name = fqn.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, name, ep_moe)
            expert_params += list(ep_moe.experts.parameters())
    log.info("expert parallel: ep=%d (rank %d of its ep group, %d replicas per expert, D=%d), "
             "%d MoE layers on this rank", groups.ep, groups.ep_rank, groups.num_replicas,
             groups.dp_cp, found)
    return expert_params


def check_expert_parallel(model: nn.Module, plan: Plan) -> None:
    """ValueError unless ``plan``'s ep can run on ``model`` (no process group needed): it has
    MoE layers this runtime recognises, ep divides their expert count and dp·cp."""
    ep = plan.config.ep
    deg = dict(zip(plan.mesh.axes, (int(s) for s in plan.mesh.sizes)))
    d = deg.get("dp", 1) * deg.get("cp", 1)
    if d % ep:
        raise ValueError(f"ep={ep} must divide dp*cp = {d}; re-plan with an ep in "
                         f"{[k for k in range(1, d + 1) if d % k == 0]}")
    from autopar.runtime.expert_gather import gathered_moe_modules
    from autopar.trace.moe import moe_experts

    counts = {fqn: len(model.get_submodule(fqn).experts) for fqn in find_moe_modules(model)}
    if not counts:
        counts = {fqn: moe_experts(model.get_submodule(fqn))[2]
                  for fqn in gathered_moe_modules(model)}
    if not counts:
        raise ValueError(f"the plan has ep={ep} but the model has no MoE layer this runtime "
                         f"recognises (a list of alike experts with a router or a top-k, or "
                         f"parameters with a leading expert dim); re-plan with ep=1")
    for fqn, n in counts.items():
        if n % ep:
            raise ValueError(f"{fqn} has {n} experts, which do not split over ep={ep}; re-plan "
                             f"with an ep dividing {n}")


def _check_ep_placements(moe: nn.Module, fqn: str, placements) -> None:
    """The plan must shard the experts over ep and replicate the router (what runs)."""
    for name, _ in moe.experts.named_parameters():
        full = f"{fqn}.experts.{name}"
        if full in placements and placements[full].get("ep", "S(0)") != "S(0)":
            raise ValueError(f"the plan places {full} as {placements[full]['ep']!r} on ep; expert "
                             f"parallel splits the experts list over ep ('S(0)')")
    for name, _ in moe.router.named_parameters():
        full = f"{fqn}.router.{name}"
        if full in placements and placements[full].get("ep", "R") != "R":
            raise ValueError(f"the plan places the router {full} as {placements[full]['ep']!r} "
                             f"on ep; the router is replicated ('R')")


class _ExpertGradientSync:
    """Expert gradients ← (Σ over the replica group of local gradients) / D."""

    def __init__(self, params: list[nn.Parameter], groups: ExpertGroups):
        self.params, self.groups = params, groups

    def __call__(self) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.params:
            if p.grad is None:
                raise RuntimeError("an expert parameter got no gradient; every local expert runs "
                                   "each step (with zero tokens if need be), so its layer was not "
                                   "used in this step's forward")
            g = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
            by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            if self.groups.num_replicas > 1:
                dist.all_reduce(flat, group=self.groups.replica_mesh.get_group())
            flat.div_(self.groups.dp_cp)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def shard_expert_params(module: nn.Module, plan: Plan, groups: ExpertGroups) -> None:
    """Set up the expert gradient reduction of ``module`` (a top-level module the runtime
    steps): FSDP2 over the replica group under ZeRO ≥ 1 with replicas, else the manual
    all-reduce run by ``sync_expert_gradients``.  Call before the dense data-parallel wrapper."""
    from autopar.runtime.expert_gather import expert_holders

    layers = [m for m in module.modules() if isinstance(m, ExpertParallelMoE)]
    holders = expert_holders(module)  # layers run by all-gather dispatch
    params = [p for m in layers for p in m.experts.parameters()] + \
        [p for _, ps in holders for p in ps]
    if not params:
        return
    zero = plan.config.zero_stage
    if zero == 0 or groups.num_replicas == 1:
        _SYNCS[module] = _ExpertGradientSync(params, groups)
        return
    from torch.distributed.fsdp import fully_shard

    policy = fsdp_precision(plan)
    reshard = reshards_after_forward(plan)
    for layer in layers:
        for expert in layer.experts:
            fully_shard(expert, mesh=groups.replica_mesh, reshard_after_forward=reshard,
                        mp_policy=policy)
            expert.set_gradient_divide_factor(float(groups.dp_cp))
            expert.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    for holder, mine in holders:
        others = set(holder.parameters()) - set(mine)
        fully_shard(holder, mesh=groups.replica_mesh, reshard_after_forward=reshard,
                    ignored_params=others or None, mp_policy=policy,
                    shard_placement_fn=_unsplit_dim)
        holder.set_gradient_divide_factor(float(groups.dp_cp))
        holder.set_force_sum_reduction_for_comms(True)
    log.info("experts: FSDP2 over %d replicas (ZeRO-%d), gradients divided by D=%d",
             groups.num_replicas, zero, groups.dp_cp)


def _unsplit_dim(param: nn.Parameter) -> Shard | None:
    """Where FSDP2 shards a fused expert weight over its replicas: its largest dim that
    expert and tensor parallel leave whole (a dim split twice, once by a ``_StridedShard``
    of gate and up, is a layout DTensor cannot gather in torch 2.13); None: dim 0."""
    if not isinstance(param, DTensor):
        return None
    split = {pl.dim for pl in param.placements if isinstance(pl, (Shard, _StridedShard))}
    whole = [d for d in range(param.dim()) if d not in split]
    return Shard(max(whole, key=lambda d: param.shape[d])) if whole else None


def sync_expert_gradients(modules: list[nn.Module]) -> None:
    """After backward: reduce the expert gradients of each module that has a manual reduction."""
    for m in modules:
        sync = _SYNCS.get(m)
        if sync is not None:
            sync()
