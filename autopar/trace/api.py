"""``trace``: an ``nn.Module`` (meta or real weights) -> a costed, torch-free ``ir.Graph``.

How it works:

1. ``blocks.find_stacks`` finds containers with repeated children; ``blocks.shrink`` makes a
   shallow copy of the model that keeps one representative per group, so tracing cost does
   not grow with depth.
2. The copy runs forward once under ``torch.func.functional_call`` with meta copies of every
   parameter and buffer (a real-weight model is never computed on) inside a ``Recorder``,
   with forward hooks keeping the module path of every op. The loss (cross entropy on
   logits) is recorded too.
3. If a module fails on data-dependent control flow (an MoE router that loops over experts
   with ``nonzero``/``where``), ``moe.find_moe`` picks the MoE module around the failure and
   the trace is rerun with that module costed as a leaf under the expected routing.
   Any other failure is a ``TraceError`` naming the module path, the op and what to try.
4. A representative whose output shape differs from its input shape cannot stand for a
   chain of copies; its stack is then traced in full (logged).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils import _pytree as pytree

from autopar.errors import TraceError
from autopar.ir import Block, Graph, TensorSpec, dtype_num_bytes
from autopar.trace import blocks, moe
from autopar.trace.recorder import Recorder

log = logging.getLogger(__name__)

__all__ = ["trace"]

_MAX_ATTEMPTS = 16
# fp8 training keeps weights and every tensor between ops in bf16 and casts a Linear's operands
# to fp8 inside its GEMM (costmodels.compute.FP8_CAST_BYTES): its graph is the bf16 one
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}


def trace(
    model: nn.Module,
    *,
    global_batch_size: int | None = None,
    seq_len: int | None = None,
    example_inputs=None,
    dtype: str | None = None,
    moe_capacity_factor: float = 1.0,
) -> Graph:
    """Trace ``model`` into an ``ir.Graph`` without allocating parameter or activation memory.

    Token models: pass ``global_batch_size`` and ``seq_len`` (inputs are ``[batch, seq]``
    token ids; the graph covers that many sequences). Other models: pass ``example_inputs``
    (a tensor, a tuple of them, or a dict of keyword inputs; one micro-batch; meta is fine).
    ``dtype`` ("bf16", "fp16", "fp8", "fp32") costs every floating tensor in that precision
    instead of the model's own (bf16 for "fp8", whose tensors between ops are bf16).
    ``moe_capacity_factor`` scales the tokens each expert gets under uniform top-k routing.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"trace expects an nn.Module, got {type(model).__name__}")
    args, kwargs, batch = _model_inputs(model, global_batch_size, seq_len, example_inputs)
    ir_dtype = _ir_dtype(dtype)
    if moe_capacity_factor <= 0:
        raise ValueError(f"moe_capacity_factor must be > 0, got {moe_capacity_factor}")
    stacks = blocks.find_stacks(model)
    tracing = _Tracing(model=model, stacks=stacks, args=args, kwargs=kwargs,
                       token_model=seq_len is not None, dtype=ir_dtype,
                       capacity_factor=moe_capacity_factor)
    leaves: dict[str, int | None] = {}  # MoE leaves, with the top-k their forward took
    keep_all: set[str] = set()
    for _ in range(_MAX_ATTEMPTS):
        recorder, shapes = _run(tracing, frozenset(keep_all), leaves)
        if isinstance(recorder, _Leaf):
            leaves[recorder.fqn] = recorder.top_k
            continue
        unsafe = _shape_changing_stacks(stacks, keep_all, shapes)
        if unsafe:
            log.info("tracing stacks %s in full: their blocks change the activation shape",
                     sorted(unsafe))
            keep_all |= unsafe
            continue
        graph = _graph(model, recorder, stacks, frozenset(keep_all), args, kwargs, batch, seq_len)
        _report_unknown(recorder)
        log.debug("%s", graph.summary())
        return graph
    raise TraceError("tracing did not converge", hint="report this model to autopar")


# ---------------------------------------------------------------------------- inputs
def _ir_dtype(dtype: str | None) -> str | None:
    if dtype is None:
        return None
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    try:
        dtype_num_bytes(dtype)
    except ValueError:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}") from None
    return dtype


def _model_inputs(model, global_batch_size, seq_len, example_inputs):
    """(args, kwargs, batch) on the meta device, validated."""
    if example_inputs is not None:
        if global_batch_size is not None or seq_len is not None:
            raise ValueError("pass either global_batch_size and seq_len (token models) or "
                             "example_inputs (other models), not both")
        args, kwargs = _normalize_example(example_inputs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors or tensors[0].dim() == 0:
            raise ValueError("example_inputs must contain a tensor whose first dim is the batch")
        return args, kwargs, int(tensors[0].shape[0])
    if global_batch_size is None or seq_len is None:
        raise ValueError("token models need both global_batch_size and seq_len; other models "
                         f"need example_inputs (got global_batch_size={global_batch_size}, "
                         f"seq_len={seq_len})")
    for name, val in (("global_batch_size", global_batch_size), ("seq_len", seq_len)):
        if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    tokens = torch.zeros(global_batch_size, seq_len, dtype=torch.long, device="meta")
    kwargs = {}
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params:  # Hugging Face: no KV cache in training
        kwargs["use_cache"] = False
    return (tokens,), kwargs, global_batch_size


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta") if x.device.type != "meta" else x
    return x


def _normalize_example(example_inputs):
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, dict):
        return (), pytree.tree_map(_to_meta, dict(example_inputs))
    if isinstance(example_inputs, (tuple, list)):
        return tuple(pytree.tree_map(_to_meta, list(example_inputs))), {}
    raise ValueError("example_inputs must be a tensor, a tuple/list of positional inputs or a "
                     f"dict of keyword inputs, got {type(example_inputs).__name__}")


# ---------------------------------------------------------------------------- one run
class _Leaf:
    """Signal from ``_run``: retry with this module costed as an MoE leaf."""

    def __init__(self, fqn: str, top_k: int | None):
        self.fqn, self.top_k = fqn, top_k


def _layer_lookup(stacks):
    index = {}
    for stack in stacks:
        for key in stack.keys:
            index[stack.child_fqn(key)] = stack.layer_index(key)

    def layer_of(path: str) -> int | None:
        parts = path.split(".") if path else []
        for i in range(1, len(parts) + 1):
            hit = index.get(".".join(parts[:i]))
            if hit is not None:
                return hit
        return None

    return layer_of


@dataclass(frozen=True, kw_only=True)
class _Tracing:
    """What every attempt of one `trace` runs: the model, its repeated stacks, the inputs of
    one forward and how tensors are costed."""

    model: nn.Module
    stacks: list  # `blocks.find_stacks` of the model
    args: tuple  # positional inputs, on the meta device
    kwargs: dict  # keyword inputs, on the meta device
    token_model: bool  # the inputs are token ids [batch, seq]
    dtype: str | None  # every floating tensor's IR dtype (None: the model's own)
    capacity_factor: float  # scales the tokens each MoE expert gets


def _run(tracing: _Tracing, keep_all: frozenset[str], leaves: dict[str, int | None]):
    """One attempt, with the stacks of ``keep_all`` traced in full and the MoE ``leaves``
    costed as leaves: (the recorder of the forward, or a `_Leaf` to retry with; the shapes
    the modules saw, `_hooks`)."""
    stacks, token_model = tracing.stacks, tracing.token_model
    clone = blocks.shrink(tracing.model, stacks, keep_all)
    params = dict(clone.named_parameters())
    buffers = dict(clone.named_buffers())
    # fake tensors on the meta device: no memory, and libraries that branch on values see
    # that they are being traced (`_eager_sequences` for the one branch that must not); tensors
    # the forward makes outside the mode (an index from a Python list, as Falcon's attention
    # takes k and v, a table kept as a plain attribute) become fake ones as they enter an op
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    to_fake = fake_mode.from_tensor
    meta_params = {n: to_fake(torch.empty_like(p, device="meta")) for n, p in params.items()}
    meta_buffers = {n: to_fake(torch.empty_like(b, device="meta")) for n, b in buffers.items()}
    args, kwargs = pytree.tree_map(lambda x: to_fake(x) if isinstance(x, torch.Tensor) else x,
                                   (tracing.args, tracing.kwargs))
    recorder = Recorder(
        params={id(t): (n, params[n].requires_grad) for n, t in meta_params.items()},
        buffers={id(t): n for n, t in meta_buffers.items()},
        layer_of=_layer_lookup(stacks), dtype=tracing.dtype)
    shapes: dict[str, tuple] = {}
    handles, patched = [], []
    modules = dict(clone.named_modules())
    try:
        for path, module in modules.items():
            handles += _hooks(module, path, recorder, shapes)
        for fqn in sorted(leaves):
            module = modules[fqn]
            patched.append((module, module.__dict__.get("forward")))
            module.forward = moe.leaf_forward(module, fqn, recorder, tracing.capacity_factor,
                                              top_k=leaves[fqn])
        for i, t in enumerate(pytree.tree_leaves((args, kwargs))):
            if isinstance(t, torch.Tensor):
                recorder.add_input(t, i)
        with torch.no_grad(), _quiet_meta_failures(), _eager_sequences(token_model), \
                fake_mode, recorder.recording():
            out = functional_call(clone, (meta_params, meta_buffers), args, kwargs)
            _record_loss(recorder, out, args, kwargs, token_model)
    except Exception as error:
        failure = recorder.failure
        path = failure.module_path if failure else ""
        op = failure.op if failure else type(error).__name__
        fqn = moe.find_moe(modules, path, leaves)
        if fqn is not None:  # experts fail on meta tensors in many ways: cost them as a leaf
            log.info("costing %s as an MoE leaf under uniform top-k routing (its forward "
                     "cannot run on fake tensors: %s failed in %r: %s)", fqn, op, path, error)
            # the first top-k its forward took before it failed: the layer's routing
            taken = [k for path, ks in recorder.top_k.items()
                     if path == fqn or path.startswith(fqn + ".") or not fqn for k in ks]
            return _Leaf(fqn, taken[0] if taken else None), shapes
        if moe.is_data_dependent(error):
            what = ("a Python value is read from a tensor (.item(), bool(), int(), .tolist())"
                    if "_local_scalar_dense" in op else str(error))
            raise TraceError(
                f"data-dependent control flow cannot be traced on meta tensors: {what}",
                module_path=path, op=op,
                hint="route tokens without Python branches on tensor values (dense or "
                     "capacity-factor gating), or keep experts in a ModuleList / 3-D "
                     "parameters so autopar can cost the module as an MoE leaf") from error
        raise TraceError(f"forward failed on meta tensors: {type(error).__name__}: {error}",
                         module_path=path, op=op,
                         hint="check that the inputs match the model (shapes, dtypes, "
                              "token ids vs features), and that forward uses no real-tensor "
                              "data (.item(), .tolist())") from error
    finally:
        for handle in handles:
            handle.remove()
        for module, original in patched:
            if original is None:
                del module.forward
            else:
                module.forward = original
    return recorder, shapes


class _DropErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


@contextlib.contextmanager
def _eager_sequences(token_model: bool):
    """Hugging Face's mask builder asks the position ids whether sequences are packed, a test
    of their values that answers "packed" on fake tensors: the trace then saw an explicit
    [b, 1, s, s] mask and K/V repeated to every query head (its compile/export path), where
    the eager training run autopar costs, on the same unpacked token rows, passes no mask
    (SDPA's is_causal) and grouped K/V heads (enable_gqa). Token models are traced on one
    sequence per row, so the test is answered as the eager run answers it: not packed."""
    masks = sys.modules.get("transformers.masking_utils")
    original = getattr(masks, "find_packed_sequence_indices", None)
    if not token_model or original is None:
        yield
        return
    masks.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masks.find_packed_sequence_indices = original


@contextlib.contextmanager
def _quiet_meta_failures():
    """Drop FakeTensorMode's ERROR records (with traceback) for ops whose meta kernel raises.

    FakeTensorMode logs every such failure at ERROR before re-raising it, and ``_run`` handles
    every exception of the attempt itself (an MoE leaf, logged at INFO, or a ``TraceError``
    that chains the original), so the record only repeats, as an error, a failure that a
    successful compile works around. Only that logger's ERROR records, and only for the attempt.
    """
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    quiet = _DropErrors()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _hooks(module, path, recorder, shapes):
    def pre(mod, a, kw):
        recorder.module_stack.append(path)

    def post(mod, a, kw, out):
        recorder.module_stack.pop()
        if path not in shapes:
            first_in = next((t for t in pytree.tree_leaves((a, kw)) if isinstance(t, torch.Tensor)),
                            None)
            first_out = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)),
                             None)
            shapes[path] = (None if first_in is None else tuple(first_in.shape),
                            None if first_out is None else tuple(first_out.shape))

    return [module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True, always_call=True)]


def _logits(out):
    """The logits in a model's output: the tensor, its ``logits`` attribute or key (a Hugging
    Face ``ModelOutput``, a dict), or the first element of a tuple or list."""
    if isinstance(out, torch.Tensor):
        return out
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _record_loss(recorder, out, args, kwargs, token_model):
    """Cross entropy on the logits: next-token for token models, class labels for [B, C]."""
    logits = _logits(out)
    if logits is None or not logits.dtype.is_floating_point:
        log.info("no loss recorded: the model output is not a logits tensor")
        return
    with recorder.paused():
        if token_model and logits.dim() == 3:
            labels = torch.zeros(logits.shape[:2], dtype=torch.long, device="meta")
        elif not token_model and logits.dim() == 2:
            labels = torch.zeros(logits.shape[:1], dtype=torch.long, device="meta")
        else:
            labels = None
    if labels is None:
        log.info("no loss recorded: output shape %s is neither [B, S, V] nor [B, C]",
                 tuple(logits.shape))
        return
    recorder.add_input(labels, len(pytree.tree_leaves((args, kwargs))))
    torch.nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten())


def _shape_changing_stacks(stacks, keep_all, shapes) -> set[str]:
    bad = set()
    for stack in stacks:
        if stack.fqn in keep_all:
            continue
        for group in stack.groups:
            if len(group) < 2:
                continue
            seen = shapes.get(stack.child_fqn(group[0]))
            if seen is None or seen[0] != seen[1]:
                bad.add(stack.fqn)
    return bad


# ---------------------------------------------------------------------------- graph
def _graph(model, recorder, stacks, keep_all, args, kwargs, batch, seq_len) -> Graph:
    nodes = tuple(recorder.nodes)
    out_blocks = []
    for stack in stacks:
        groups = stack.groups if stack.fqn not in keep_all else tuple((k,) for k in stack.keys)
        for group in groups:
            rep = stack.child_fqn(group[0])
            prefix = rep + "."
            names = tuple(n.name for n in nodes
                          if n.module_path == rep or n.module_path.startswith(prefix))
            module = model.get_submodule(rep)
            out_blocks.append(Block(
                representative=rep, module_class=type(module).__qualname__,
                layer_fqns=tuple(stack.child_fqn(k) for k in group),
                layer_indices=tuple(stack.layer_index(k) for k in group),
                node_names=names))
    specs = tuple(TensorSpec(shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
                  for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    return Graph(nodes=nodes, blocks=tuple(out_blocks), inputs=specs,
                 model_class=type(model).__qualname__, batch_size=batch, seq_len=seq_len)


def _report_unknown(recorder) -> None:
    if recorder.unknown_ops:
        listed = ", ".join(f"{op} x{n}" for op, n in sorted(recorder.unknown_ops.items()))
        log.warning("ops autopar does not classify were kept as generic nodes (FlopCounterMode "
                    "FLOPs where it has a formula, measured bytes, all inputs saved): %s", listed)
