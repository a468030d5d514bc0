"""Context parallel of a model's own forward (its attention does not go through autopar's
hook): the activations are DTensors sharded on the sequence over cp, each rank holding one
contiguous chunk, so positions, tables and masks the model makes from the sequence length are
global, and ``F.scaled_dot_product_attention`` on them runs as ring attention
(`context_parallel.ring_attention`, contiguous layout).

Under tensor parallel as well, the activations lie on the (cp, tp) mesh: sharded on the
sequence over cp, and over tp as `tensor_parallel` lays them (heads, features, the sequence
shard of sequence parallel).  The parameters stay DTensors on the tp mesh, which FSDP2 shards
again over dp × cp.  An op that reads one with (cp, tp) activations reads it lifted to the
(cp, tp) mesh, replicated over cp (`_GradientShare`); its gradient comes back on the tp mesh
as this cp rank's share, and the data-parallel reduction over dp × cp sums the shares.
Attention runs the ring over cp on this rank's heads (`local_attention.local_heads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._pytree import tree_leaves, tree_map

from autopar.ir import SEQUENCE_DIM
from autopar.runtime.context_parallel import ring_attention
from autopar.runtime.local_attention import (
    _VIEWS,
    LocalAttention,
    _replicated_call,
    _view_shape,
    contiguous_stride,
    local_heads,
)
from autopar.runtime.tensor_parallel import tp_placement, with_tp
from autopar.trace.nested import NESTED, run_nested

__all__ = ["RingAttentionMode", "ShardedSequence", "gradient_share"]


# an activation mesh is cp, or (cp, tp) in that order (`apply._activation_mesh`): cp is its
# dim 0, tp its dim 1


def _cp_mesh(mesh: Any) -> Any:
    return mesh["cp"] if mesh.ndim > 1 else mesh


class _GradientShare(torch.autograd.Function):
    """``t`` joining the activations on ``mesh`` replicated over cp: a plain tensor that
    requires grad (a parameter, or a tensor made from parameters only; replicated over tp
    too), or a DTensor on the tp mesh (a parameter under tensor parallel; its tp placement
    kept).  Its gradient comes back as ``t`` is: a plain tensor, or a DTensor on the tp mesh,
    holding this rank's share over cp, so that the shares summed over the cp ranks are the
    gradient (the data-parallel reduction over dp × cp sums them), with no traffic over cp (a
    plain tensor's gradient, a partial sum over tp, is all-reduced over tp)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, mesh: Any) -> DTensor:
        placements = [Replicate()] * mesh.ndim
        ctx.source = t.device_mesh if isinstance(t, DTensor) else None
        shape, stride = t.shape, t.stride()
        if ctx.source is not None:
            placements[1] = t.placements[0]
            t = t.to_local()
        return DTensor.from_local(t, mesh, tuple(placements), run_check=False, shape=shape,
                                  stride=stride)

    @staticmethod
    def backward(ctx, grad: Any):
        if not isinstance(grad, DTensor):
            return grad, None
        if grad.device_mesh.ndim == 1:
            return gradient_share(grad), None
        cp = grad.placements[0]
        tp = tp_placement(grad)
        if ctx.source is not None and cp.is_shard() and tp.is_shard() and cp.dim == tp.dim:
            # split twice on one dim (a position table's rows): the local rows in place, with
            # zeros elsewhere, are this rank's share over cp and a partial sum over tp
            return DTensor.from_local(_in_place(grad), ctx.source, (Partial(),),
                                      run_check=False, shape=grad.shape,
                                      stride=grad.stride()), None
        if ctx.source is None:  # a plain tensor's gradient is whole over tp
            grad = grad.redistribute(grad.device_mesh, with_tp(grad, Replicate()))
            tp = Replicate()
        local = grad.to_local()
        shape = list(local.shape)
        if cp.is_shard():  # the cp view: this rank's tp piece, whole along the cp shard
            shape[cp.dim] = grad.shape[cp.dim]
        cp_view = DTensor.from_local(local, _cp_mesh(grad.device_mesh), (cp,), run_check=False,
                                     shape=torch.Size(shape), stride=contiguous_stride(shape))
        share = gradient_share(cp_view)
        if ctx.source is None:
            return share, None
        return DTensor.from_local(share, ctx.source, (tp,), run_check=False, shape=grad.shape,
                                  stride=grad.stride()), None


def _in_place(grad: DTensor) -> torch.Tensor:
    """A sharded DTensor's local piece in place in a tensor of its global shape, zeros
    elsewhere."""
    local = grad.to_local()
    _, offset = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh,
                                                      grad.placements)
    full = local.new_zeros(grad.shape)
    full[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))] = local
    return full


def gradient_share(grad: Any) -> torch.Tensor:
    """This rank's share of a DTensor gradient on a 1-D mesh, as a plain tensor of the full
    shape: the local partial sum (``Partial``), the local copy over the mesh size
    (``Replicate``), or the local shard in place with zeros elsewhere (``Shard``)."""
    if not isinstance(grad, DTensor):
        return grad
    (placement,), local = grad.placements, grad.to_local()
    if placement.is_partial() and getattr(placement, "reduce_op", "sum") == "sum":
        return local
    if placement.is_replicate():
        return local / grad.device_mesh.size()
    if placement.is_shard() and type(placement) is Shard:
        return _in_place(grad)
    return grad.full_tensor() / grad.device_mesh.size()


def _mixed_in_place(func, args: tuple, kwargs: dict) -> bool:
    """An in-place op on a DTensor whose DTensor operands are laid out differently (a scatter of
    token rows into a sequence-sharded buffer): DTensor may run it on mismatched shards."""
    name = getattr(func, "__name__", "")
    if not (name.endswith("_") and not name.endswith("__") and args
            and isinstance(args[0], DTensor)):
        return False
    return len({t.placements for t in tree_leaves((args, kwargs)) if isinstance(t, DTensor)}) > 1


def _in_place_replicated(func, args: tuple, kwargs: dict) -> DTensor:
    """An in-place op run on replicated copies of its operands, its result copied back into
    the first operand in that operand's layout (differentiably: the copy is recorded); an
    elementwise one whose target is a partial sum (a row-parallel output a sum is added into,
    as Llama 4's MoE does) instead with its other operand laid out as the target."""
    target = args[0]
    other = args[1] if len(args) == 2 and not kwargs else None
    if getattr(func, "__name__", "") in ("add_", "sub_") and isinstance(other, DTensor) and \
            other.shape == target.shape and any(p.is_partial() for p in target.placements) \
            and all(not p.is_partial() or q.is_partial()
                    for p, q in zip(target.placements, other.placements)):
        return func(target, other.redistribute(other.device_mesh, target.placements))
    whole = tree_map(lambda t: t.redistribute(t.device_mesh, (Replicate(),) * t.device_mesh.ndim)
                     if isinstance(t, DTensor) else t, (args, kwargs))
    result = func(*whole[0], **whole[1])
    target.copy_(result.redistribute(target.device_mesh, target.placements))
    return target


def _gemm_on_rows(x: Any, weight: Any, bias: Any, out_dim: int) -> DTensor | None:
    """A GEMM (``F.linear``: the weight's output features on its dim ``out_dim`` 0;
    ``torch.addmm``: 1) on local shards, where DTensor gathers rows flattened from a split
    sequence or cannot flatten rows split twice on one dim.  Over each mesh dim the input is
    split on its rows (tokens: the sequence over cp, and over tp under sequence parallel) by
    replicated weights, or replicated by weights split on their output features, or split on
    its features by weights split on their input features (a partial sum out; the bias, if
    any, added as a share, `_BiasShare`), or replicated with the weights. None for any other
    GEMM, or one replicated over every mesh dim."""
    if not (isinstance(x, DTensor) and isinstance(weight, DTensor)
            and x.device_mesh == weight.device_mesh
            and (bias is None or isinstance(bias, DTensor))):
        return None
    last, in_dim = x.dim() - 1, 1 - out_dim
    out, gx, gw, gb, share = [], [], [], [], 1
    for i, (px, pw) in enumerate(zip(x.placements, weight.placements)):
        pb = Replicate() if bias is None else bias.placements[i]
        split = _split_on(px)
        if split is not None and split % x.dim() < last and pw.is_replicate() and \
                pb.is_replicate():  # rows
            out.append(px), gx.append(px), gw.append(Partial()), gb.append(Partial())
        elif px.is_replicate() and pw.is_replicate() and pb.is_replicate():
            out.append(px), gx.append(px), gw.append(pw), gb.append(pb)
        elif px.is_replicate() and _split_on(pw) == out_dim and \
                (bias is None or pb == _moved(pw, 0)):  # output features
            out.append(_moved(pw, last)), gx.append(Partial()), gw.append(pw), gb.append(pb)
        elif split is not None and split % x.dim() == last and _split_on(pw) == in_dim and \
                px == _moved(pw, split) and pb.is_replicate():  # input features
            out.append(Partial()), gx.append(px), gw.append(pw), gb.append(Replicate())
            share *= x.device_mesh.size(i)
        else:
            return None
    if all(p.is_replicate() for p in out):
        return None  # DTensor's own
    w = weight.to_local(grad_placements=tuple(gw))
    b = None if bias is None else bias.to_local(grad_placements=tuple(gb))
    b = _BiasShare.apply(b, share) if b is not None and share > 1 else b
    rows = x.to_local(grad_placements=tuple(gx))
    local = F.linear(rows, w, b) if out_dim == 0 else \
        (rows @ w if b is None else torch.addmm(b, rows, w))
    shape = (*x.shape[:-1], weight.shape[out_dim])
    return DTensor.from_local(local, x.device_mesh, tuple(out), run_check=False, shape=shape,
                              stride=contiguous_stride(shape))


class _BiasShare(torch.autograd.Function):
    """A bias added to each of ``share`` partial sums of one output, as its share ``b /
    share``: the sum adds it once.  Its gradient is the output gradient's (whole on every
    rank, as a partial sum's is), summed over the rows: the bias's, unscaled."""

    @staticmethod
    def forward(ctx, b: torch.Tensor, share: int) -> torch.Tensor:
        return b / share

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _gemm_operands(func, args: tuple, kwargs: dict) -> tuple | None:
    """``(x, weight, bias, out_dim)`` of an ``F.linear`` or a plain ``torch.addmm`` call."""
    if func is F.linear:
        given = {**dict(zip(("input", "weight", "bias"), args)), **kwargs}
        return given["input"], given["weight"], given.get("bias"), 0
    if func in (torch.addmm, torch.Tensor.addmm) and len(args) == 3 and not kwargs:
        return args[1], args[2], args[0], 1
    return None


def _split_on(p: Any) -> int | None:
    """The tensor dim a placement splits (a shard, plain or strided), or None."""
    return p.dim if isinstance(p, (Shard, _StridedShard)) else None


def _moved(p: Shard, dim: int) -> Shard:
    """Shard placement ``p`` (plain or strided) on tensor dim ``dim``."""
    if isinstance(p, _StridedShard):
        return _StridedShard(dim, split_factor=p.split_factor)
    return Shard(dim)


_SUMS = (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.sub, torch.Tensor.sub,
         torch.Tensor.__sub__)
_ELEMENTWISE = _SUMS + (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.div,
                        torch.Tensor.div, torch.Tensor.__truediv__)


def _alike_strided(func, a: Any, b: Any) -> DTensor | None:
    """An elementwise op of two tensors of one shape laid out alike with flattened tokens split
    (``_StridedShard``: OPT's residual add on ``[batch * seq, ...]``) on the local shards,
    where DTensor gathers both; a partial sum is reduced first where the other operand is
    whole, or where the op is not a sum. None for any other."""
    if not (isinstance(a, DTensor) and isinstance(b, DTensor) and a.shape == b.shape
            and any(isinstance(p, _StridedShard) for p in a.placements)):
        return None
    summing = func in _SUMS  # partial sums add up
    target = tuple(
        pa if pa == pb and (summing or not pa.is_partial())
        else Replicate() if {pa, pb} <= {Replicate(), Partial()} else None
        for pa, pb in zip(a.placements, b.placements))
    if None in target:
        return None
    a, b = (t if t.placements == target else t.redistribute(t.device_mesh, target)
            for t in (a, b))
    return DTensor.from_local(func(a.to_local(), b.to_local()), a.device_mesh, a.placements,
                              run_check=False, shape=a.shape, stride=a.stride())


class _GradAs(torch.autograd.Function):
    """Identity whose backward brings the gradient to the tensor's own placements. A tensor
    of rows unflattened from flattened tokens (``[batch * seq, ...]`` viewed as ``[batch,
    seq, ...]``) whose gradient comes split twice on the sequence (over cp and, by a residual
    add with the sequence-parallel stream, over tp) would have it flattened back, which
    DTensor cannot do; laid out as the tensor is, it can."""

    @staticmethod
    def forward(ctx, t: DTensor) -> DTensor:
        # the gradient of a partial sum is whole
        ctx.placements = tuple(Replicate() if p.is_partial() else p for p in t.placements)
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: Any):
        if isinstance(grad, DTensor) and grad.placements != ctx.placements:
            grad = grad.redistribute(grad.device_mesh, ctx.placements)
        return grad


def _gathered_for_view(func, t: DTensor, args: tuple, kwargs: dict) -> DTensor:
    """``t``, gathered over tp where both cp and tp shard one of its dims (the sequence under
    sequence parallel) and the view merges that dim with another (tokens flattened for a
    GEMM, as Hugging Face's ``Conv1D`` does): DTensor cannot view such a twice-split dim
    back."""
    dims = [d for d in map(_split_on, t.placements) if d is not None]
    twice = {d for d in dims if dims.count(d) > 1}
    shape = _view_shape(func, t, args, kwargs) if twice else None
    if shape is None or all(tuple(shape[:d + 1]) == tuple(t.shape[:d + 1]) for d in twice):
        return t
    return t.redistribute(t.device_mesh, with_tp(t, Replicate()))


class RingAttentionMode(LocalAttention):
    """The step's torch-function mode under context parallel of a model's own forward, its
    activations DTensors on ``mesh`` (cp, or cp and tp; see the module docstring).  An op on
    them runs as DTensor runs it, with plain tensors that require grad and DTensors on the tp
    mesh joining replicated over cp (``_GradientShare``);
    ``F.scaled_dot_product_attention`` on sequence-sharded q/k/v runs as ring attention
    (causal, unmasked or with the model's own mask) on this rank's heads; an op without a
    sharding strategy runs replicated, and ops on the tp mesh alone run as tensor parallel
    runs them (``LocalAttention``)."""

    def __init__(self, mesh: Any):
        super().__init__()
        self.mesh = mesh

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in NESTED:
            return run_nested(self, func, args, kwargs)
        if not any(isinstance(t, DTensor) and t.device_mesh == self.mesh
                   for t in tree_leaves((args, kwargs))):
            return super().__torch_function__(func, types, args, kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        args, kwargs = tree_map(self._join, (args, kwargs))
        gemm = _gemm_operands(func, args, kwargs)
        if gemm is not None:
            out = _gemm_on_rows(*gemm)
            if out is not None:
                return out
        if func in _ELEMENTWISE and len(args) == 2 and not kwargs:
            out = _alike_strided(func, *args)
            if out is not None:
                return out
        if func in _VIEWS and isinstance(args[0], DTensor):
            t = _gathered_for_view(func, args[0], args[1:], kwargs)
            out = super().__torch_function__(func, types, (t, *args[1:]), kwargs)
            if any(isinstance(p, _StridedShard) for p in t.placements) and \
                    isinstance(out, DTensor) and out.requires_grad:
                out = _GradAs.apply(out)  # rows unflattened
            return out
        if _mixed_in_place(func, args, kwargs):
            return _in_place_replicated(func, args, kwargs)
        return super().__torch_function__(func, types, args, kwargs)

    def _join(self, t: Any) -> Any:
        """A DTensor on the tp mesh, or a plain tensor that requires grad, lifted to the
        activations' mesh (replicated over cp)."""
        if isinstance(t, DTensor) and t.device_mesh != self.mesh or \
                type(t) in (torch.Tensor, nn.Parameter) and t.requires_grad and \
                torch.is_grad_enabled():
            return _GradientShare.apply(t, self.mesh)
        return t

    def _sequence_shard(self, t: Any, dim: int) -> DTensor:
        t = self._join(t)
        if not isinstance(t, DTensor):
            t = DTensor.from_local(t, self.mesh, (Replicate(),) * self.mesh.ndim,
                                   run_check=False)
        return t.redistribute(self.mesh, (Shard(dim), *t.placements[1:]))

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):
        if dropout_p:
            raise NotImplementedError(
                f"context parallel runs attention without dropout (dropout_p={dropout_p}); set "
                f"the model's attention dropout to 0 or plan with cp=1")
        if query.dim() != 4:
            return _replicated_call(F.scaled_dot_product_attention,
                                    (query, key, value, attn_mask, dropout_p, is_causal),
                                    {"scale": scale, "enable_gqa": enable_gqa})
        q, k, v = (self._sequence_shard(t, 2) for t in (query, key, value))
        if isinstance(attn_mask, DTensor):
            attn_mask = attn_mask.full_tensor()
        group = _cp_mesh(self.mesh).get_group()
        if self.mesh.ndim == 1:
            out = ring_attention(q.to_local(), k.to_local(), v.to_local(), group, scale,
                                 layout="contiguous", causal=is_causal, mask=attn_mask)
            return DTensor.from_local(out, self.mesh, (Shard(2),), run_check=False)
        ql, kl, vl, wrap = local_heads(*(self._on_tp(t) for t in (q, k, v)))
        out = wrap(ring_attention(ql, kl, vl, group, scale, layout="contiguous",
                                  causal=is_causal, mask=attn_mask))
        shape = (*out.shape[:2], q.shape[2], *out.shape[3:])
        return DTensor.from_local(out.to_local(), self.mesh, (Shard(2), out.placements[0]),
                                  run_check=False, shape=shape,
                                  stride=contiguous_stride(shape))

    def _on_tp(self, t: DTensor) -> DTensor:
        """A (cp, tp) DTensor sharded on its dim 2 over cp as the DTensor of its cp chunk on
        the tp mesh (the heads split over tp as ``t``'s are)."""
        if tp_placement(t).is_shard(2):
            t = t.redistribute(self.mesh, with_tp(t, Replicate()))
        local = t.to_local()
        shape = (*t.shape[:2], local.shape[2], *t.shape[3:])
        return DTensor.from_local(local, self.mesh["tp"], (tp_placement(t),), run_check=False,
                                  shape=shape, stride=contiguous_stride(shape))


@dataclass
class ShardedSequence:
    """This rank's role in context parallel of a model's own forward: the model's inputs join
    as DTensors on ``mesh`` (cp, or (cp, tp) in that order under tensor parallel)
    sharded on the sequence (dim 1) over cp, each rank holding one contiguous chunk; the step
    runs under ``RingAttentionMode`` and ``implicit_replication``; the logits leave as the
    local chunk (on the tp mesh under tensor parallel), which the loss reads with the local
    labels.  Pipeline stages send and receive their local chunk."""

    mesh: Any

    @property
    def size(self) -> int:
        return _cp_mesh(self.mesh).size()

    def _placements(self, dim: int) -> tuple:
        return (Shard(dim), *[Replicate()] * (self.mesh.ndim - 1))

    def split(self, x: torch.Tensor, dim: int = SEQUENCE_DIM) -> torch.Tensor:
        """This rank's contiguous chunk of a ``[batch, seq, ...]`` tensor (tokens, labels)."""
        return x.tensor_split(self.size, dim=dim)[_cp_mesh(self.mesh).get_local_rank()]

    def join(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.dim() >= 2:
            return DTensor.from_local(t, self.mesh, self._placements(SEQUENCE_DIM),
                                      run_check=False)
        return t

    def local(self, t: Any) -> Any:
        """``t`` as this rank's chunk of the sequence: a plain tensor, or under tensor
        parallel a DTensor on the tp mesh laid out over tp as ``t`` is."""
        if not isinstance(t, DTensor) or t.device_mesh != self.mesh:
            return t
        if t.dim() < 2:
            return t.full_tensor()
        if self.mesh.ndim == 1:
            return t.redistribute(self.mesh, self._placements(SEQUENCE_DIM)).to_local()
        tp = tp_placement(t)
        tp = Replicate() if tp.is_shard(SEQUENCE_DIM) or tp.is_partial() else tp
        local = t.redistribute(self.mesh, (Shard(SEQUENCE_DIM), tp)).to_local()
        shape = (t.shape[0], local.shape[1], *t.shape[2:])
        return DTensor.from_local(local, self.mesh["tp"], (tp,), run_check=False, shape=shape,
                                  stride=contiguous_stride(shape))

    def install(self, module: nn.Module, *, last: bool = True) -> None:
        """Inputs of ``module`` (the model, or a pipeline stage) join sequence-sharded; a stage
        that is not the last sends its local chunk."""
        module.register_forward_pre_hook(
            lambda _m, args, kwargs: (tree_map(self.join, args), tree_map(self.join, kwargs)),
            with_kwargs=True)
        if not last:
            module.register_forward_hook(lambda _m, _args, out: tree_map(self.local, out))
