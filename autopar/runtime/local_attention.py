"""Attention and the functions DTensor has no strategy for, under tensor parallel.

Scaled-dot-product attention has no DTensor strategy on CPU: ``LocalAttention`` (a
``TorchFunctionMode`` the step runs under) runs ``F.scaled_dot_product_attention`` on the local
shards when q, k and v are sharded on the heads dim, slicing replicated k/v to the kv heads the
local query heads read (multi-query or grouped-query attention with fewer kv heads than tp,
whose projections the plan replicates: the gradient of those k/v, a partial sum over tp, is
all-reduced at the attention's input) and replicated q to this rank's heads (a fused q/k/v
projection the plan replicates), and gathers them otherwise.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from autopar.ir import SEQUENCE_DIM
from autopar.runtime.tensor_parallel import (
    _to_local_replicated,
    on_sequence_view,
    tp_axis,
    tp_placement,
    with_tp,
)
from autopar.sharding.strided import refinement
from autopar.trace.nested import NESTED, run_nested

__all__ = ["LocalAttention", "contiguous_stride", "local_heads", "sum_grad_over_tp"]

log = logging.getLogger(__name__)


def sum_grad_over_tp(x: torch.Tensor, group) -> torch.Tensor:
    """``x``, whose gradient is summed over the tp ``group`` in backward (Megatron's ``f``)."""
    return _SumGradOverTP.apply(x, group)


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tp group (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _OwnHeads(torch.autograd.Function):
    """This tp rank's heads (dim 1) of a replicated ``[batch, heads, seq, head_dim]`` tensor;
    backward all-gathers the ranks' gradients into the whole tensor's."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        per_rank = x.shape[1] // mesh.size()
        return x.narrow(1, mesh.get_local_rank() * per_rank, per_rank).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_gather_tensor(grad.contiguous(), gather_dim=1, group=ctx.mesh), None


class LocalAttention(TorchFunctionMode):
    """The step's torch-function mode under tensor parallel.  Runs
    ``F.scaled_dot_product_attention`` on DTensor q/k/v as local attention over this rank's
    heads (dim 1 of ``[batch, heads, seq, head_dim]``): q sharded on the heads, k/v sharded
    likewise or replicated (then sliced to the kv heads the local query heads read); any other
    layout is gathered and attention runs replicated.  A fused projection's output, sharded
    within each of its k chunks, split into the chunks or viewed as ``(k, heads, head_dim)``,
    is cut locally (``_split_chunks``, ``_view_chunks``: sharded on the features or the heads,
    where DTensor would gather it).  A function DTensor has no sharding strategy for
    (``adaptive_avg_pool2d``), or a view it cannot keep sharded, runs on gathered local
    tensors, replicated (an op without a strategy is remembered, so its later calls in the
    step go there directly; one refused for its operands' layout is remembered with the
    layout, so that a block's recompute runs the ops its forward ran, which per-op
    checkpointing replays call by call).
    Beside these it keeps split what DTensor would gather: a partial sum added to a sequence
    shard is reduce-scattered (`_settled_on_shard`), a product over batch and heads flattened
    runs on each rank's rows (`_bmm_on_local_rows`), a tensor made from a split one with
    ``new_empty`` is split alike (`_new_like_shard`).
    The numbers are the reference's; the layout costs the gathers."""

    def __init__(self):
        super().__init__()
        self._replicated: set = set()  # functions that had no sharding strategy
        self._refused: set = set()  # (function, operand layouts) DTensor refused

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in NESTED:
            return run_nested(self, func, args, kwargs)
        if func in _PASSED or not any(isinstance(t, DTensor)
                                      for t in (*args, *kwargs.values())):
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return _local_sdpa(func, *args, **kwargs)
        if func is F.linear:
            return _ContiguousGrad.apply(func(*args, **kwargs))
        if func is torch.Tensor.contiguous and isinstance(args[0], DTensor) \
                and not args[0].to_local().is_contiguous():
            # a DTensor that calls itself contiguous over a strided shard: copy the shard
            t = args[0]
            return DTensor.from_local(t.to_local().contiguous(), t.device_mesh, t.placements,
                                      run_check=False, shape=t.shape,
                                      stride=contiguous_stride(t.shape))
        if func in _MEANS:
            mean = _split_mean(*args, **kwargs)
            if mean is not None:
                return mean
        if func in _MULS and len(args) == 2 and not kwargs:
            scaled = _scaled_partial(*args)
            if scaled is not None:
                return scaled
        if func in _ADDS and len(args) == 2:
            args = _settled_on_shard(*args, in_place=func in _IN_PLACE)
        if func in _BMMS:
            product = _bmm_on_local_rows(func, *args, **kwargs)
            if product is not None:
                return product
        if func in _NEW and isinstance(args[0], DTensor):
            made = _new_like_shard(func, args[0], args[1:], kwargs)
            if made is not None:
                return made
        if func in _SPLITS and isinstance(args[0], DTensor):
            pieces = _split_chunks(func, *args, **kwargs)
            if pieces is not None:
                return pieces
        if func in _VIEWS and isinstance(args[0], DTensor):
            shape = _view_shape(func, args[0], args[1:], kwargs)
            viewed = None if shape is None else _view_chunks(args[0], shape)
            if viewed is None and shape is not None:
                viewed = _view_in_steps(args[0], shape, copy=func is torch.Tensor.reshape)
            if viewed is not None:
                return viewed
        if func in self._replicated or (
                self._refused and _layout_key(func, args, kwargs) in self._refused):
            return _replicated_call(func, args, kwargs)
        try:
            return func(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as exc:
            if not _no_strategy(exc) or getattr(func, "__name__", "").endswith("_"):
                raise  # an in-place op cannot run on a gathered copy of its operand
            log.info("%s: %s; it runs on replicated tensors", getattr(func, "__name__", func),
                     str(exc).splitlines()[0])
            if isinstance(exc, NotImplementedError):  # the op, not this layout
                self._replicated.add(func)
            else:
                self._refused.add(_layout_key(func, args, kwargs))
            return _replicated_call(func, args, kwargs)


_MULS = (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__)
_MEANS = (torch.mean, torch.Tensor.mean)
_IN_PLACE = (torch.Tensor.add_, torch.Tensor.__iadd__)
_ADDS = (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, *_IN_PLACE)
_NEW = (torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones,
        torch.Tensor.new_full)
_BMMS = (torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm)


def _bmm_on_local_rows(func, *args, **kwargs) -> DTensor | None:
    """A batched product over the batch and heads flattened (``[batch * heads, q, d]``, as
    BLOOM and Megatron-LM's unfused attention write it) of operands both split on their
    heads (``_StridedShard(0, batch)``): each rank multiplies its own rows, an added term
    (BLOOM's ALiBi bias, replicated) cut to them, where DTensor, with no strategy for that
    layout, would gather the operands. None for any other product."""
    names = ("input", "batch1", "batch2") if func in (torch.baddbmm, torch.Tensor.baddbmm) \
        else ("input", "mat2")
    given = {**dict(zip(names, args)), **kwargs}
    if set(given) - {*names, "beta", "alpha"} or not set(names) <= set(given):
        return None
    added, a, b = (None, given["input"], given["mat2"]) if len(names) == 2 else \
        (given["input"], given["batch1"], given["batch2"])
    beta, alpha = given.get("beta", 1), given.get("alpha", 1)
    if not all(isinstance(t, DTensor) and len(t.placements) == 1 for t in (a, b)):
        return None
    (pa,), (pb,) = a.placements, b.placements
    if not isinstance(pa, _StridedShard) or pa != pb or pa.dim != 0:
        return None
    local_a, local_b = a.to_local(), b.to_local()
    out = torch.bmm(local_a, local_b)
    if added is not None:
        if isinstance(added, DTensor):
            if added.placements != (Replicate(),):
                return None
            added = added.to_local()
        rows, mesh = a.shape[0], a.device_mesh
        batch, ranks = pa.split_factor, mesh.size()
        heads = rows // batch
        if added.shape[0] != rows or heads % ranks:
            return None
        mine = heads // ranks * mesh.get_local_rank()
        added = added.view(batch, heads, *added.shape[1:])[:, mine:mine + heads // ranks]
        out = beta * added.reshape(-1, *added.shape[2:]) + alpha * out
    shape = (a.shape[0], a.shape[1], b.shape[2])
    return DTensor.from_local(out, a.device_mesh, a.placements, run_check=False, shape=shape,
                              stride=contiguous_stride(shape))


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    if not shape:
        return ()
    return tuple(itertools.accumulate(reversed(shape[1:]), operator.mul, initial=1))[::-1]


def _new_like_shard(func, t: DTensor, args: tuple, kwargs: dict) -> DTensor | None:
    """A new tensor made from a tensor sharded on one dim, of the same rank and size on that
    dim (DeepSeek-V3's keys assembled in ``k.new_empty(...)`` from the heads tp splits):
    made sharded alike, each rank its block, where DTensor would make it replicated and
    gather what is copied into it. None for any other."""
    size = args[0] if len(args) >= 1 and isinstance(args[0], (tuple, list, torch.Size)) \
        else args[:t.dim()] if func is not torch.Tensor.new_full else None
    if size is None or len(t.placements) != 1 or not t.placements[0].is_shard():
        return None
    size, dim = [int(n) for n in size], t.placements[0].dim
    ranks = t.device_mesh.size()
    if len(size) != t.dim() or size[dim] != t.shape[dim] or size[dim] % ranks:
        return None
    local = list(size)
    local[dim] //= ranks
    rest = args[1:] if func is torch.Tensor.new_full else ()
    made = func(t.to_local(), local, *rest, **kwargs)
    return DTensor.from_local(made, t.device_mesh, t.placements, run_check=False)


def _settled_on_shard(a: Any, b: Any, *, in_place: bool) -> tuple[Any, Any]:
    """A partial sum added to a sharded tensor (row-parallel outputs summed before their one
    reduction, meeting the stream's sequence shard under sequence parallel): the partial
    operand reduce-scattered to the shard by a redistribute of its own, whose backward
    gathers the gradient once; DTensor would reduce it inside the add, whose backward hands
    the sharded gradient on to each summand's GEMM. An in-place add's target stays. On a (cp,
    tp) mesh, for operands laid out alike over cp."""
    def beside_tp(t: DTensor) -> tuple:
        return tuple(p for i, p in enumerate(t.placements) if i != tp_axis(t))

    if not (isinstance(a, DTensor) and isinstance(b, DTensor)) or \
            a.device_mesh != b.device_mesh or beside_tp(a) != beside_tp(b):
        return a, b
    if not in_place:  # a gathered sub-layer input added to a shard: the shard it came from
        a, b = (_shard_of(x, other) for x, other in ((a, b), (b, a)))
    pa, pb = tp_placement(a), tp_placement(b)
    if pa.is_partial("sum") and _sharded(pb) and not in_place:
        return _scattered(a, pb), b
    if pb.is_partial("sum") and _sharded(pa):
        return a, _scattered(b, pa)
    return a, b


def _shard_of(t: DTensor, other: DTensor) -> DTensor:
    """``t``, or where ``t`` is a sub-layer's input gathered from the sequence shard
    (``gathered_from``, `tensor_parallel._gather_sequence`) and ``other`` a tensor laid out
    as that shard, the shard itself: a residual add inside the sub-layer (BERT's post-norm
    ``norm(out + input)``) then sends its gradient to the shard, and the gathered input's
    readers sum theirs as partial sums, reduce-scattered once (DTensor would reduce each to
    the shard apart)."""
    shard = getattr(t, "gathered_from", None)
    if shard is not None and shard.placements == other.placements and \
            shard.shape == other.shape:
        return shard
    return t


def _sharded(p: Any) -> bool:
    return p.is_shard() or isinstance(p, _StridedShard) and p.dim == 0


def _scattered(t: DTensor, to: Any) -> DTensor:
    """Partial sum ``t`` reduce-scattered to placement ``to``: a shard, or the stream's
    sequence shard with batch and sequence flattened (``_StridedShard(0, batch)``: OPT's
    MLP), which DTensor would all-reduce into; scattered on the sequence of its unflattened
    view."""
    if not isinstance(to, _StridedShard):
        return t.redistribute(t.device_mesh, with_tp(t, to))
    if t.device_mesh.ndim > 1:
        return t  # DTensor's own
    return on_sequence_view(t, to.split_factor, Shard(SEQUENCE_DIM))


def _split_mean(x: Any, dim: Any = None, keepdim: bool = False, *, dtype=None) -> Any:
    """The mean over the last dim of a tensor tp shards on it (a norm's statistic over the
    features a column-parallel GEMM split: OLMo 2's q/k norms over the whole projections):
    each rank's share summed locally and the ``[..., 1]`` result all-reduced, replicated.
    Its gradient, a partial sum over the ranks' features, is all-reduced by DTensor where
    the statistic meets the sharded features. DTensor would instead reduce-scatter the whole
    input's gradient. None for any other mean."""
    if not isinstance(x, DTensor) or len(x.placements) != 1 or dtype is not None or \
            not keepdim or x.dim() < 2:
        return None
    last, placement = x.dim() - 1, x.placements[0]
    dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    if type(placement) is not Shard or placement.dim % x.dim() != last or \
            [d % x.dim() for d in dims if d is not None] != [last]:
        return None
    local = x.to_local().sum(-1, keepdim=True) / x.shape[-1]
    whole = _SumForward.apply(local, x.device_mesh)
    return DTensor.from_local(whole, x.device_mesh, (Replicate(),), run_check=False)


class _SumForward(torch.autograd.Function):
    """The sum over the tp ranks forward; the gradient passes as it is (DTensor reduces it
    where the result is used)."""

    @staticmethod
    def forward(ctx, x, mesh):
        return funcol.all_reduce(x.contiguous(), "sum", group=mesh)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _scaled_partial(a: Any, b: Any) -> DTensor | None:
    """A partial sum times a number or a one-element tensor (an embedding scaled inside its
    module, by a buffer as Gemma's or a float as BioGPT's and XGLM's), kept a partial sum:
    scaling is linear, where DTensor would all-reduce it first and the module's reduction (a
    reduce-scatter under sequence parallel) would find nothing to reduce. None for any other
    product."""
    for x, c in ((a, b), (b, a)):
        number = isinstance(c, (int, float)) and not isinstance(c, bool)
        if isinstance(x, DTensor) and tp_placement(x).is_partial("sum") and (
                number or isinstance(c, torch.Tensor) and c.numel() == 1
                and not c.requires_grad
                and (not isinstance(c, DTensor) or all(p.is_replicate() for p in c.placements))):
            scale = c.to_local() if isinstance(c, DTensor) else c
            local = x.to_local(grad_placements=with_tp(x, Replicate())) * scale
            return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False)
    return None


# run as they are: an error inside backward is the backward's, never a missing strategy
_PASSED = (torch.Tensor.backward, torch.autograd.backward)
_SPLITS = (torch.Tensor.split, torch.split, torch.Tensor.chunk, torch.chunk)


def _split_chunks(func, t: DTensor, size_or_chunks=None, dim: int = 0, **named) -> tuple | None:
    """A fused projection's output (``_StridedShard(d, k)``: k chunks, each sharded over tp)
    split into its k chunks along d: each chunk is this rank's local piece, sharded ``Shard(d)``
    (DTensor would gather the whole output first).  None for any other split."""
    placement, dim = tp_placement(t), dim % t.dim()
    if not isinstance(placement, _StridedShard) or _split_elsewhere(t, dim):
        return None
    if size_or_chunks is None:  # given by name
        size_or_chunks = next(iter(named.values()), None)
    k = placement.split_factor
    if placement.dim != dim:
        return None
    chunk = t.shape[dim] // k
    by_size = func in (torch.Tensor.split, torch.split)
    if (by_size and size_or_chunks not in (chunk, [chunk] * k)) or \
            (not by_size and size_or_chunks != k):
        return None
    return tuple(DTensor.from_local(piece, t.device_mesh, with_tp(t, Shard(dim)),
                                    run_check=False)
                 for piece in t.to_local().chunk(k, dim=dim))


def _split_elsewhere(t: DTensor, dim: int) -> bool:
    """Whether a mesh dim other than tp (cp) shards ``t`` on ``dim`` too."""
    axis = tp_axis(t)
    return any(p.is_shard(dim) for i, p in enumerate(t.placements) if i != axis)


_VIEWS = (torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.unflatten)


def _view_shape(func, t: DTensor, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    """The shape a ``view``, ``reshape`` or ``unflatten`` call gives ``t`` (a -1 resolved), or
    None for a call of another form."""
    if func is torch.Tensor.unflatten:
        given = {**dict(zip(("dim", "sizes"), args)), **kwargs}
        if set(given) != {"dim", "sizes"}:
            return None
        dim = given["dim"] % t.dim()
        shape = (*t.shape[:dim], *given["sizes"], *t.shape[dim + 1:])
    elif kwargs:
        return None
    else:
        shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) \
            else args
    if not all(isinstance(n, int) for n in shape) or list(shape).count(-1) > 1:
        return None
    known = math.prod(n for n in shape if n != -1)
    if -1 in shape:
        if not known or t.numel() % known:
            return None
        shape = tuple(t.numel() // known if n == -1 else n for n in shape)
    return tuple(shape)


def _view_chunks(t: DTensor, shape: tuple[int, ...]) -> DTensor | None:
    """A fused projection's output (``_StridedShard`` of its last dim into k chunks) viewed as
    ``(..., k, heads, head_dim)`` or ``(..., k, features)``: this rank's piece viewed as
    ``(..., k, heads / tp, head_dim)`` or ``(..., k, features / tp)``, sharded on the heads or
    the features (DTensor would gather the whole output first).  None for any other view."""
    placement, last = tp_placement(t), t.dim() - 1
    if not isinstance(placement, _StridedShard) or _split_elsewhere(t, last):
        return None
    k, inner, tp = placement.split_factor, shape[last + 1:], t.device_mesh.size(tp_axis(t))
    if placement.dim != last or len(shape) not in (t.dim() + 1, t.dim() + 2) or \
            tuple(shape[:last]) != tuple(t.shape[:last]) or shape[last] != k or \
            k * math.prod(inner) != t.shape[last] or inner[0] % tp:
        return None
    local = t.to_local()
    local = local.view(*local.shape[:last], k, inner[0] // tp, *inner[1:])
    return DTensor.from_local(local, t.device_mesh, with_tp(t, Shard(last + 1)), run_check=False,
                              shape=shape, stride=contiguous_stride(shape))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous. A Linear's output is a view of
    its GEMM's rows; when the model transposes it next (a convolution over the sequence), its
    gradient can come back with a transposed local shard under a DTensor that calls itself
    contiguous, and DTensor runs the view's backward as a view of that shard, which fails."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor) or grad.to_local().is_contiguous():
            return grad
        return DTensor.from_local(grad.to_local().contiguous(), grad.device_mesh,
                                  grad.placements, run_check=False, shape=grad.shape,
                                  stride=contiguous_stride(grad.shape))


def _view_in_steps(t: DTensor, shape: tuple[int, ...], *, copy: bool = False
                   ) -> DTensor | None:
    """A view of a sharded tensor that both splits and merges dims (``[s, b, heads · d]`` as
    ``[s, b · heads, d]``, as ``nn.MultiheadAttention`` writes it), run as the split and then
    the merge: DTensor keeps each of those sharded (a merge of a sharded inner dim as a
    ``_StridedShard``), where it gathers the tensor for the view in one step. With ``copy``
    (a ``reshape``) a tensor whose local shard cannot be viewed so (a slice of a wider
    projection's output) is made contiguous first, as ``reshape`` would copy it. None for a
    view that only splits or only merges dims, or of a tensor not sharded."""
    if not any(p.is_shard() for p in t.placements):
        return None
    finest = refinement(tuple(t.shape), shape)
    if finest is None or finest in (tuple(t.shape), shape):
        return None
    if copy:
        return t.contiguous().view(finest).reshape(shape)
    return t.view(finest).view(shape)


def _layout_key(func, args: tuple, kwargs: dict) -> tuple:
    """A call's function with the shape and placements of its DTensor operands."""
    return (func,) + tuple((tuple(t.shape), t.placements) for t in (*args, *kwargs.values())
                           if isinstance(t, DTensor))


def _no_strategy(exc: Exception) -> bool:
    """Whether DTensor refused an op for its layout (no strategy, or a view it cannot keep
    sharded), rather than the op failing for another reason."""
    text = str(exc)
    return "sharding strategy" in text or "Sharding propagation failed" in text or \
        "unevenly sharded" in text


def _replicated_call(func, args: tuple, kwargs: dict) -> Any:
    """``func`` on the full local tensors of its DTensor arguments; tensor results rejoin as
    replicated DTensors (every rank computes the same numbers)."""
    mesh = next(t.device_mesh for t in (*args, *kwargs.values()) if isinstance(t, DTensor))
    out = func(*tree_map(_to_local_replicated, args), **tree_map(_to_local_replicated, kwargs))
    whole = (Replicate(),) * mesh.ndim
    return tree_map(lambda t: DTensor.from_local(t, mesh, whole, run_check=False)
                    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t, out)


def _replicated(t: Any) -> bool:
    return isinstance(t, DTensor) and t.placements == (Replicate(),)


def _heads_sharded(t: Any) -> bool:
    return isinstance(t, DTensor) and t.placements == (Shard(1),)


def local_heads(query: Any, key: Any, value: Any, *, slice_query: bool = True) -> tuple:
    """``(q, k, v, wrap)``: plain local tensors of attention inputs that may be DTensors, and the
    function that turns the local attention output back into a DTensor.  With q sharded on the
    heads (dim 1), each rank keeps its query heads and the kv heads they read (sliced from
    replicated k/v when the kv heads do not shard alike, e.g. fewer kv heads than tp ranks);
    replicated q, k and v (a fused projection the plan runs whole) are sliced likewise, if
    ``slice_query``; otherwise everything is gathered and attention runs replicated."""
    mesh = next(t.device_mesh for t in (query, key, value) if isinstance(t, DTensor))
    tp, rank = mesh.size(), mesh.get_local_rank()
    # a fused q/k/v projection the plan runs whole: each rank slices its query heads
    sliced = slice_query and _replicated(query) and query.dim() == 4 and \
        query.shape[1] % tp == 0 and all(_replicated(t) for t in (key, value))
    if (sliced or _heads_sharded(query)) and query.shape[1] % tp == 0:
        per_rank = query.shape[1] // tp
        kv = []
        for t in (key, value):
            if _heads_sharded(t) and t.shape[1] % tp == 0 and \
                    (t.shape[1] // tp) * (query.shape[1] // t.shape[1]) == per_rank:
                kv.append(t.to_local())
                continue
            if isinstance(t, DTensor) and t.shape[1] % tp == 0 and \
                    (t.shape[1] // tp) * (query.shape[1] // t.shape[1]) == per_rank:
                # K/V repeated to heads tp divides: each rank's are a slice, whose
                # gradients are all-gathered (as the estimate charges them)
                kv.append(_OwnHeads.apply(t.redistribute(mesh, (Replicate(),)).to_local(),
                                          mesh))
                continue
            # each rank reads some kv heads: their gradients are partial sums over tp, summed
            # here, at the attention's input, as the estimate charges it
            full = sum_grad_over_tp(t.redistribute(mesh, (Replicate(),)).to_local(),
                                    mesh.get_group()) if isinstance(t, DTensor) else t
            group = query.shape[1] // full.shape[1]  # query heads per kv head
            lo, hi = rank * per_rank // group, ((rank + 1) * per_rank - 1) // group + 1
            kv.append(full[:, lo:hi])
        placement = (Shard(1),)
        q = _OwnHeads.apply(query.to_local(), mesh) if sliced else query.to_local()
    else:
        q, *kv = (t.redistribute(mesh, (Replicate(),)).to_local() if isinstance(t, DTensor)
                  else t for t in (query, key, value))
        placement = (Replicate(),)
    return (q, kv[0], kv[1],
            lambda out: DTensor.from_local(out, mesh, placement, run_check=False))


def _local_sdpa(func, query, key, value, attn_mask=None, *args, enable_gqa=False, **kwargs):
    if isinstance(attn_mask, DTensor):
        attn_mask = attn_mask.redistribute(attn_mask.device_mesh, (Replicate(),)).to_local()
    per_head = attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] > 1
    if per_head and _heads_sharded(query):  # a per-head mask: run on all heads
        query = query.redistribute(query.device_mesh, (Replicate(),))
    q, k, v, wrap = local_heads(query, key, value, slice_query=not per_head)
    return wrap(func(q, k, v, attn_mask, *args, enable_gqa=enable_gqa or k.shape[1] != q.shape[1],
                     **kwargs))
