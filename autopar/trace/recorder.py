"""Op recording: run a forward on meta tensors and turn every op into an ``ir.Node``.

A ``Recorder`` owns two modes that run together while the model's forward executes on meta
tensors (no memory is allocated):

* a ``TorchFunctionMode`` that records a few fused functions as single ops before PyTorch
  decomposes them on the meta device (``scaled_dot_product_attention`` -> one ATTENTION node,
  ``rms_norm``, ``dropout``, ``cross_entropy``, ``matmul`` of batched operands) and remembers
  where a forward failed;
* a ``TorchDispatchMode`` that records every other ATen op.

Tensors are followed by identity: each gets a value record with its storage base (views
alias their base), its producer, whether it needs a gradient, and whether it is an
attention-score tensor (what selective recompute drops). Module paths come from a stack the
tracer's forward hooks maintain (the same information as export's ``nn_module_stack``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.ir import AttentionSpec, Node, OpKind, ParamSpec, TensorSpec
from autopar.trace import ops
from autopar.trace.nested import NESTED, run_nested

log = logging.getLogger(__name__)

__all__ = ["Recorder", "Failure", "OpTraits"]


@dataclass
class _Value:
    spec: TensorSpec
    base: int  # id of the tensor that owns the storage
    base_bytes: int
    source: str
    needs_grad: bool
    state: bool  # a parameter or a buffer: never charged as an activation
    score: bool  # attention-score shaped (dropped under selective recompute)
    layer: int | None
    param: ParamSpec | None = None


@dataclass(frozen=True, kw_only=True)
class Failure:
    """Where the forward raised: innermost module path and the op being run."""

    module_path: str
    op: str
    error: BaseException


@dataclass(frozen=True, kw_only=True)
class OpTraits:
    """What a recorded op is beyond its tensors and FLOPs (`Recorder.emit`); most ops have
    none of it."""

    extra_saved_bytes: int = 0
    """Bytes kept for backward that are no tensor of the op (attention's log-sum-exp, a
    dropout mask, log-probabilities)."""
    score_out: bool = False
    """The outputs are attention scores (and the extra bytes theirs): selective recompute
    drops them."""
    alias_out: bool = False
    """The outputs are views of the first input, sharing its storage."""
    attention: AttentionSpec | None = None
    """The shape of the attention the op computes."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Recorder:
    """Collects nodes while a forward runs; see the module docstring."""

    def __init__(
        self,
        *,
        params: dict[int, tuple[str, bool]],
        buffers: dict[int, str],
        layer_of: Callable[[str], int | None],
        dtype: str | None = None,
    ):
        self._params = params
        self._buffers = buffers
        self._layer_of = layer_of
        self._dtype = dtype
        self._values: dict[int, _Value] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids unique while recording
        self._saved_bases: set[int] = set()
        self._name_counts: collections.Counter[str] = collections.Counter()
        self._paused = 0
        # per custom autograd Function running (innermost last): what it saves for backward
        self._custom: list[list[torch.Tensor]] = []
        self.module_stack: list[str] = [""]
        self.nodes: list[Node] = []
        self.unknown_ops: collections.Counter[str] = collections.Counter()
        self.failure: Failure | None = None
        # the k of each top-k the forward takes, by module path, first call first (an MoE
        # layer's routing: the experts each token goes to)
        self.top_k: dict[str, list[int]] = collections.defaultdict(list)
        self.fused: dict[Callable, Callable] = {
            F.scaled_dot_product_attention: self._sdpa,
            F.rms_norm: self._rms_norm,
            F.dropout: self._dropout,
            F.cross_entropy: self._cross_entropy,
            torch.matmul: self._matmul,
            torch.Tensor.matmul: self._matmul,
            torch.Tensor.__matmul__: self._matmul,
        }

    # ------------------------------------------------------------------ context
    @contextlib.contextmanager
    def recording(self):
        with _FunctionMode(self), _DispatchMode(self), _custom_functions(self):
            yield self

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def is_paused(self) -> bool:
        return self._paused > 0

    def note_failure(self, op: str, error: BaseException) -> None:
        if self.failure is None:
            self.failure = Failure(module_path=self.module_stack[-1], op=op, error=error)

    # ------------------------------------------------------------------ values
    def _spec(self, t: torch.Tensor) -> TensorSpec:
        dtype = _dtype_name(t.dtype)
        if self._dtype is not None and t.dtype.is_floating_point:
            dtype = self._dtype
        return TensorSpec(shape=tuple(int(d) for d in t.shape), dtype=dtype)

    def _new_value(self, t, *, source, needs_grad, state=False, score=False, base=None):
        spec = self._spec(t)
        if base is None:
            base_id, base_bytes = id(t), spec.num_bytes
        else:
            base_id, base_bytes = base.base, base.base_bytes
        layer = self._layer_of(self.module_stack[-1])
        value = _Value(spec=spec, base=base_id, base_bytes=base_bytes, source=source,
                       needs_grad=needs_grad, state=state, score=score, layer=layer)
        self._values[id(t)] = value
        self._alive.append(t)
        return value

    def value(self, t: torch.Tensor) -> _Value:
        """The record of a tensor, creating one for tensors first seen (params, inputs, consts)."""
        found = self._values.get(id(t))
        if found is not None:
            return found
        if id(t) in self._params:
            fqn, requires_grad = self._params[id(t)]
            value = self._new_value(t, source=f"param:{fqn}", needs_grad=requires_grad,
                                    state=True)
            value.param = ParamSpec(fqn=fqn, shape=value.spec.shape, dtype=value.spec.dtype,
                                    requires_grad=requires_grad)
            return value
        if id(t) in self._buffers:
            return self._new_value(t, source=f"buffer:{self._buffers[id(t)]}", needs_grad=False,
                                   state=True)
        return self._new_value(t, source="const", needs_grad=False)

    def add_input(self, t: torch.Tensor, index: int) -> None:
        self._new_value(t, source=f"input:{index}", needs_grad=False)

    def needs_grad(self, t: torch.Tensor) -> bool:
        return self.value(t).needs_grad

    # ------------------------------------------------------------------ nodes
    def _node_name(self, path: str, short: str) -> str:
        stem = f"{path or 'root'}/{short}"
        self._name_counts[stem] += 1
        n = self._name_counts[stem]
        return stem if n == 1 else f"{stem}#{n}"

    def _charge(self, values: list[_Value], layer: int | None) -> tuple[int, int]:
        """Bytes newly saved by a node (all, and what remains under selective recompute)."""
        saved = kept = 0
        for v in values:
            if v.state or v.base in self._saved_bases:
                continue
            # a grad-free tensor made outside this layer (mask, RoPE table) is shared by
            # every layer; it is not charged to a repeated block.
            if layer is not None and not v.needs_grad and v.layer != layer:
                continue
            self._saved_bases.add(v.base)
            saved += v.base_bytes
            kept += 0 if v.score else v.base_bytes
        return saved, kept

    def emit(
        self,
        *,
        kind: OpKind,
        target: str,
        short: str,
        in_tensors: list[torch.Tensor],
        out_tensors: list[torch.Tensor],
        flops_fwd: int = 0,
        flops_bwd: int = 0,
        save: list[torch.Tensor] = (),
        path: str | None = None,
        traits: OpTraits = OpTraits(),
    ) -> Node:
        """Record one node; ``save`` lists the tensors it keeps for backward, ``traits`` what
        else it is (`OpTraits`)."""
        extra_saved_bytes, score_out = traits.extra_saved_bytes, traits.score_out
        alias_out = traits.alias_out
        path = self.module_stack[-1] if path is None else path
        layer = self._layer_of(path)
        ins = [self.value(t) for t in in_tensors]
        sources = tuple(v.source for v in ins)  # before an in-place result renames its value
        grad = any(v.needs_grad for v in ins)
        name = self._node_name(path, short)
        outs = []
        for t in out_tensors:
            if id(t) in self._values and not alias_out:  # in-place result
                v = self._values[id(t)]
                v.source = name
                v.needs_grad = v.needs_grad or (grad and t.dtype.is_floating_point)
                outs.append(v)
                continue
            base = ins[0] if (alias_out and ins) else None
            outs.append(self._new_value(
                t, source=name, needs_grad=grad and t.dtype.is_floating_point,
                score=score_out, base=base))
        # inside a custom autograd Function autograd keeps what it saves, not its ops' inputs
        saved_values = [self.value(t) for t in save] if not self._custom else []
        saved, kept = self._charge(saved_values, layer) if grad else (0, 0)
        if grad and extra_saved_bytes:
            saved += extra_saved_bytes
            kept += 0 if score_out else extra_saved_bytes
        saved_from = tuple(sorted({v.source for v in saved_values if not v.state}
                                  | ({name} if extra_saved_bytes else set()))) if grad else ()
        params = tuple(v.param for v in ins if v.param is not None)
        transposed = tuple(i for i, (t, v) in enumerate(zip(in_tensors, ins))
                           if v.param is not None and t.dim() >= 2 and t.shape[-2] > 1
                           and t.stride()[-2:] == (1, t.shape[-2])
                           and not any(t.stride()[:-2]))  # W.T of a contiguous W, expanded
        moves = kind is not OpKind.VIEW
        node = Node(
            name=name, kind=kind, target=target,
            inputs=tuple(v.spec for v in ins), input_sources=sources,
            outputs=tuple(v.spec for v in outs),
            flops_fwd=int(flops_fwd), flops_bwd=int(flops_bwd) if grad else 0,
            bytes_read=sum(v.spec.num_bytes for v in ins) if moves else 0,
            bytes_written=sum(v.spec.num_bytes for v in outs) if moves else 0,
            params=params, saved_bytes=saved, saved_bytes_recompute=kept,
            saved_from=saved_from, module_path=path, layer_index=layer,
            attention=traits.attention, transposed=transposed,
        )
        self.nodes.append(node)
        return node

    def charge_custom(self, first: int, tensors: list[torch.Tensor], out) -> None:
        """Charge what a custom autograd Function passed to ``ctx.save_for_backward`` to the
        last node its forward recorded (nodes ``first`` on), if an output (``out``) needs a
        gradient."""
        outs = [self._values.get(id(o)) for o in pytree.tree_leaves(out)
                if isinstance(o, torch.Tensor)]
        if first >= len(self.nodes) or not any(v is not None and v.needs_grad for v in outs):
            return
        node = self.nodes[-1]
        values = [self.value(t) for t in tensors]
        saved, kept = self._charge(values, node.layer_index)
        self.nodes[-1] = replace(
            node, saved_bytes=node.saved_bytes + saved,
            saved_bytes_recompute=node.saved_bytes_recompute + kept,
            saved_from=tuple(sorted(set(node.saved_from)
                                    | {v.source for v in values if not v.state})))

    # ------------------------------------------------------------------ aten ops
    def on_aten(self, func, args, kwargs, out) -> None:
        name = func.overloadpacket.__name__
        if name == "topk" and len(args) > 1 and isinstance(args[1], int):
            self.top_k[self.module_stack[-1]].append(args[1])
        ins = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if not outs:
            return
        if not ins:  # factory op: its outputs are constants
            for t in outs:
                self._new_value(t, source="const", needs_grad=False)
            return
        rule = ops.rule_for(name, len(ins))
        if rule.pass_through:
            for t in outs:
                if id(t) not in self._values:
                    self._values[id(t)] = self.value(ins[0])
                    self._alive.append(t)
            return
        if not rule.known:
            self.unknown_ops[str(func)] += 1
        vals = [self.value(t) for t in ins]
        if rule.kind is OpKind.VIEW and all(v.state for v in vals):
            self._alias_state(vals[0], outs)  # e.g. a weight's transpose: still the weight
            return
        save = [ins[i] for i in self._saved_positions(rule, vals)]
        save += [outs[i] for i in rule.save_outputs if i < len(outs)]
        flops = ops.forward_flops(func, args, kwargs, out) if ops.has_flop_formula(func) else 0
        flops_bwd = self._backward_flops(rule, vals, flops)
        schema_returns = func._schema.returns
        alias = bool(schema_returns) and schema_returns[0].alias_info is not None \
            and not schema_returns[0].alias_info.is_write
        score = self._is_score(rule.kind, vals, outs)
        self.emit(kind=rule.kind, target=str(func), short=name, in_tensors=ins,
                  out_tensors=outs, flops_fwd=flops, flops_bwd=flops_bwd, save=save,
                  traits=OpTraits(score_out=score, alias_out=alias))

    def _alias_state(self, value: _Value, outs: list[torch.Tensor]) -> None:
        for t in outs:
            self._values[id(t)] = _Value(
                spec=self._spec(t), base=value.base, base_bytes=value.base_bytes,
                source=value.source, needs_grad=value.needs_grad, state=True, score=False,
                layer=value.layer, param=value.param)
            self._alive.append(t)

    @staticmethod
    def _saved_positions(rule: ops.OpRule, vals: list[_Value]) -> list[int]:
        if rule.save_inputs == "all":
            return [i for i, v in enumerate(vals) if not v.state]
        positions = [i for i in rule.save_inputs if i < len(vals)]
        for a, b in rule.partner_pairs:
            if b < len(vals):
                if vals[b].needs_grad:
                    positions.append(a)
                if vals[a].needs_grad:
                    positions.append(b)
        return positions

    @staticmethod
    def _backward_flops(rule: ops.OpRule, vals: list[_Value], flops: int) -> int:
        if not flops:
            return 0
        if rule.partner_pairs and rule.kind in (OpKind.MATMUL, OpKind.CONV):
            a, b = rule.partner_pairs[0]
            return flops * sum(vals[i].needs_grad for i in (a, b) if i < len(vals))
        return 2 * flops  # generic op with a formula: assume grads for both operands

    @staticmethod
    def _is_score(kind: OpKind, vals: list[_Value], outs: list[torch.Tensor]) -> bool:
        """Attention scores: a product of two activations with a square trailing block,
        and whatever elementwise ops make of it at the same size."""
        out = outs[0]
        if kind is OpKind.MATMUL:
            acts = [v for v in vals if not v.state]
            return (len(acts) >= 2 and not any(v.score for v in acts) and out.dim() >= 3
                    and out.shape[-1] == out.shape[-2] and out.shape[-1] > 1)
        if kind in (OpKind.ELEMENTWISE, OpKind.SOFTMAX, OpKind.DROPOUT, OpKind.VIEW,
                    OpKind.GENERIC):
            return any(v.score and v.spec.numel == out.numel() for v in vals)
        return False

    # ------------------------------------------------------------------ fused functions
    def _empty(self, shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
        with self.paused():
            return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
              scale=None, enable_gqa=False):
        *batch, hq, sq, d = query.shape
        hkv, skv, dv = key.shape[-3], key.shape[-2], value.shape[-1]
        b = math.prod(batch)
        with self.paused():  # flash kernels write [b, s, h, d] and return a transposed view
            out = torch.empty(*batch, sq, hq, dv, dtype=query.dtype,
                              device=query.device).transpose(-2, -3)
        fwd = 2 * b * hq * sq * skv * (d + dv)
        bwd = 2 * b * hq * sq * skv * (3 * d + 2 * dv)
        ins = [query, key, value] + ([attn_mask] if isinstance(attn_mask, torch.Tensor) else [])
        spec = AttentionSpec(batch=b, num_heads=hq, num_kv_heads=hkv, seq_q=sq, seq_kv=skv,
                             head_dim=d, causal=bool(is_causal), dropout_p=float(dropout_p))
        lse_bytes = b * hq * sq * 4  # fp32 log-sum-exp per query row
        self.emit(kind=OpKind.ATTENTION, target="F.scaled_dot_product_attention", short="sdpa",
                  in_tensors=ins, out_tensors=[out], flops_fwd=fwd, flops_bwd=bwd,
                  save=ins + [out], traits=OpTraits(extra_saved_bytes=lse_bytes, attention=spec))
        return out

    def _matmul(self, input, other, *, out=None):
        """A product of two batched operands (``q @ k.transpose(-2, -1)`` on ``[b, h, s, d]``)
        as one node with its batch dims apart: ATen runs it as a ``bmm`` over the batch dims
        flattened, where a shard of an inner batch dim (the heads) is no block of the merged
        dim. Other products (``x @ W``, vectors) are recorded as the ATen ops they run."""
        if out is not None or not isinstance(other, torch.Tensor) or input.dim() < 3 \
                or other.dim() < 3:
            return torch.matmul(input, other, out=out)
        with self.paused():
            result = torch.matmul(input, other)
        flops = 2 * result.numel() * input.shape[-1]
        vals = [self.value(input), self.value(other)]
        save = [t for t, partner in ((input, vals[1]), (other, vals[0])) if partner.needs_grad]
        self.emit(kind=OpKind.MATMUL, target="torch.matmul", short="matmul",
                  in_tensors=[input, other], out_tensors=[result], flops_fwd=flops,
                  flops_bwd=flops * sum(v.needs_grad for v in vals), save=save,
                  traits=OpTraits(score_out=self._is_score(OpKind.MATMUL, vals, [result])))
        return result

    def _rms_norm(self, input, normalized_shape, weight=None, eps=None):
        out = self._empty(input.shape, input)
        ins = [input] + ([weight] if weight is not None else [])
        rows = input.numel() // max(1, math.prod(normalized_shape))
        self.emit(kind=OpKind.NORM, target="F.rms_norm", short="rms_norm", in_tensors=ins,
                  out_tensors=[out], save=[input], traits=OpTraits(extra_saved_bytes=rows * 4))
        return out

    def _dropout(self, input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return input
        out = self._empty(input.shape, input)
        score = self.value(input).score
        self.emit(kind=OpKind.DROPOUT, target="F.dropout", short="dropout", in_tensors=[input],
                  out_tensors=[out],
                  traits=OpTraits(extra_saved_bytes=input.numel(),  # 1-byte mask
                                  score_out=score))
        return out

    def _cross_entropy(self, input, target, weight=None, size_average=None, ignore_index=-100,
                       reduce=None, reduction="mean", label_smoothing=0.0):
        shape = () if reduction != "none" else tuple(target.shape)
        out = self._empty(shape, input)
        self.emit(kind=OpKind.LOSS, target="F.cross_entropy", short="cross_entropy",
                  in_tensors=[input, target], out_tensors=[out], save=[target],
                  traits=OpTraits(extra_saved_bytes=self._spec(input).num_bytes))  # log-probs
        return out


@contextlib.contextmanager
def _custom_functions(recorder: Recorder):
    """While recording, every custom autograd Function (a ``torch.autograd.Function``
    subclass, as BLOOM's GELU) is charged what its forward passes to ``ctx.save_for_backward``
    -- all autograd keeps of it -- rather than what its ops would save (`Recorder.emit`)."""
    apply = torch.autograd.Function.__dict__["apply"]
    save = FunctionCtx.save_for_backward

    def recorded_apply(cls, *args, **kwargs):
        recorder._custom.append([])
        first = len(recorder.nodes)
        try:
            out = apply.__func__(cls, *args, **kwargs)
        finally:
            saved = recorder._custom.pop()
        recorder.charge_custom(first, saved, out)
        return out

    def recorded_save(ctx, *tensors):
        if recorder._custom:
            recorder._custom[-1].extend(t for t in tensors if isinstance(t, torch.Tensor))
        return save(ctx, *tensors)

    torch.autograd.Function.apply = classmethod(recorded_apply)
    FunctionCtx.save_for_backward = recorded_save
    try:
        yield
    finally:
        torch.autograd.Function.apply = apply
        FunctionCtx.save_for_backward = save


class _FunctionMode(TorchFunctionMode):
    def __init__(self, recorder: Recorder):
        super().__init__()
        self._rec = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = self._rec.fused.get(func)
        try:
            if handler is not None and not self._rec.is_paused:
                return handler(*args, **kwargs)
            if func in NESTED:
                return run_nested(self, func, args, kwargs)
            return func(*args, **kwargs)
        except Exception as error:
            self._rec.note_failure(getattr(func, "__name__", str(func)), error)
            raise


class _DispatchMode(TorchDispatchMode):
    def __init__(self, recorder: Recorder):
        super().__init__()
        self._rec = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except Exception as error:
            self._rec.note_failure(str(func), error)
            raise
        if not self._rec.is_paused:
            self._rec.on_aten(func, args, kwargs, out)
        return out
