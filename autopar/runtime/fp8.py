"""Float8 training of a plan's fp8 GEMMs (dtype "fp8"), on the user's unchanged modules.

The plan names the weights whose GEMMs run in fp8 (``plan.training.fp8_weights``, the
ones the estimate costs so: `autopar.estimate.fp8`). Each GEMM of such a weight -- whatever
calls it: ``F.linear`` (``nn.Linear``), ``addmm`` (a Conv1D), ``x @ w`` -- runs as torchao's
default recipe runs a ``Float8Linear``: dynamic tensorwise scaling, the activation and the
weight cast to e4m3 in forward (scale = max / amax, computed each call), the output gradient to
e5m2 in backward, three ``torch._scaled_mm`` per GEMM (`_scaled_mm`), the fp8 copies kept for
backward; a bias is added in 16 bits. A plan costed with ``fp8_recipe="rowwise"`` runs
torchao's rowwise recipe (`_RowwiseFloat8Matmul`). Everything else runs as before, in bf16
under autocast.

How a GEMM is found: a forward pre-hook on each weight's module marks the module running, and
the torch-function mode `Float8Gemms` (entered with the plan's precision) takes a GEMM whose
weight operand is that module's weight at that moment -- the parameter FSDP2 gathered, the
DTensor tensor parallel made. Under tensor parallel each rank scales its own shards
(`float8_linear`): colwise and rowwise layouts run locally, as DTensor would run them in
bf16, with no extra collective.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from autopar.plan.plan import Plan

__all__ = ["Float8Gemms", "float8_linear", "float8_gemms", "quantize", "RECIPES"]

log = logging.getLogger(__name__)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise")  # the scaling recipes it runs (EstimateOptions.fp8_recipe)
_EPS = 1e-12  # torchao's floor on an amax, so that an all-zero tensor gets a finite scale
_ROWS = 16  # _scaled_mm's inner dim must be a multiple of 16: wgrad's (the tokens) is padded


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic scaling: (t · s) cast to `dtype`, s = max(dtype) / amax; returns the fp8
    tensor (row-major) and 1/s, the scale ``_scaled_mm`` multiplies back. Tensorwise (`dim`
    None) one amax, an ``aten.max`` (per-op recompute keeps it: `autopar.config.PER_OP_SAVED`);
    axiswise one per slice along `dim` (kept as a dim of 1), its scale rounded down to a power
    of two (torchao's rowwise recipe)."""
    fmax = torch.finfo(dtype).max
    if dim is None:
        amax = torch.max(t.detach().abs()).float()
        scale = fmax / torch.clamp(amax, min=_EPS)
    else:
        amax = torch.amax(t.detach().abs(), dim=dim, keepdim=True).float()
        scale = torch.exp2(torch.floor(torch.log2(fmax / torch.clamp(amax, min=_EPS))))
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype).contiguous(), scale.reciprocal()


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """(a · sa) @ (b · sb) for fp8 a and b: ``torch._scaled_mm`` on a GPU; elsewhere the same
    product of the fp8 values (exact in fp32) accumulated in fp32, since the CPU's
    ``_scaled_mm`` is a reference kernel (4.6 s for a 512 x 256 x 1,024 GEMM on one core of a
    Xeon, torch 2.13, where the fp32 GEMM takes 32 ms)."""
    if a.device.type == "cuda":
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    return (torch.mm(a.float(), b.float()) * (sa * sb)).to(out_dtype)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _padded_rows(t: torch.Tensor) -> torch.Tensor:
    extra = -t.shape[0] % _ROWS
    return t if not extra else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])


class _Float8Matmul(torch.autograd.Function):
    """y = x wᵀ for x [m, k], w [n, k] in fp8, tensorwise (see the module's docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        xq, sx = quantize(x, E4M3)
        wq, sw = quantize(w, E4M3)
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.dtypes = x.dtype, w.dtype
        return _scaled_mm(xq, wq.t(), sx, sw, out_dtype)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        xq, sx, wq, sw = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        # a pipeline schedule runs backward under the forward's autocast, which takes no fp8
        with torch.autocast(gy.device.type, enabled=False):
            gq, sg = quantize(gy, E5M2)
            gx = _scaled_mm(gq, _column_major(wq), sg, sw, x_dtype)
            gw = _scaled_mm(_padded_rows(gq).t().contiguous(), _column_major(_padded_rows(xq)),
                            sg, sx, w_dtype)
        return gx, gw, None


class _RowwiseFloat8Matmul(torch.autograd.Function):
    """y = x wᵀ as torchao's rowwise recipe runs it: each GEMM's operands scaled per row of
    the left and per column of the right (power-of-two scales), all three in e4m3 (the output
    gradient too); x and w kept in 16 bits and cast again in backward along the other dim."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        xq, sx = quantize(x, E4M3, dim=-1)
        wq, sw = quantize(w, E4M3, dim=-1)
        ctx.save_for_backward(x, w)
        return _scaled_mm(xq, wq.t(), sx, sw.t(), torch.bfloat16).to(out_dtype)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, w = ctx.saved_tensors
        with torch.autocast(gy.device.type, enabled=False):
            gq, sg = quantize(gy, E4M3, dim=-1)  # per row of the output gradient
            wq, sw = quantize(w, E4M3, dim=0)  # per column of w, over its rows
            gx = _scaled_mm(gq, _column_major(wq), sg, sw, torch.bfloat16).to(x.dtype)
            g_rows, x_rows = _padded_rows(gy), _padded_rows(x)
            gtq, sgt = quantize(g_rows.t(), E4M3, dim=-1)  # per column of the gradient
            xq, sxc = quantize(x_rows, E4M3, dim=0)  # per column of x, over the tokens
            gw = _scaled_mm(gtq, _column_major(xq), sgt, sxc, torch.bfloat16).to(w.dtype)
        return gx, gw, None


_MATMULS_BY_RECIPE = {"tensorwise": _Float8Matmul, "rowwise": _RowwiseFloat8Matmul}


def _local_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
                  recipe: str = "tensorwise") -> torch.Tensor:
    if not x.numel():  # no rows (an expert no token reached): nothing to scale
        return F.linear(x.to(out_dtype), w.to(out_dtype))
    out = _MATMULS_BY_RECIPE[recipe].apply(x.reshape(-1, x.shape[-1]), w, out_dtype)
    return out.reshape(*x.shape[:-1], w.shape[0])


def _split_dim(p: Any) -> int | None:
    """The tensor dim a Shard or a _StridedShard (a fused projection's head-aware split)
    splits; None for other placements."""
    return p.dim if p.is_shard() or isinstance(p, _StridedShard) else None


def _moved(p: Any, dim: int) -> Any:
    """A split of `p`'s kind on `dim`."""
    return _StridedShard(dim, split_factor=p.split_factor) if isinstance(p, _StridedShard) \
        else Shard(dim)


def _layouts(x: Any, w: Any, ndim: int, mesh_dims: int):
    """For y = x wᵀ on DTensors: per mesh dim, the layout x must have, the output's, and
    those of x's and w's local gradients; None where the weight's layout is not a Linear's."""
    last = ndim - 1
    px = x.placements if isinstance(x, DTensor) else (Replicate(),) * mesh_dims
    pw = w.placements if isinstance(w, DTensor) else (Replicate(),) * mesh_dims
    want, out, gx, gw = [], [], [], []
    for a, b in zip(px, pw):
        split, rows = _split_dim(b), _split_dim(a)
        if split == 0:  # column-parallel: output features split
            want.append(Replicate()), out.append(_moved(b, last)), gx.append(Partial())
            gw.append(b)
        elif split == 1:  # row-parallel: input features split
            want.append(_moved(b, last)), out.append(Partial()), gx.append(want[-1])
            gw.append(b)
        elif not b.is_replicate():
            return None
        elif rows is not None and rows % ndim != last:  # batch or sequence split
            want.append(a), out.append(_moved(a, rows % ndim)), gx.append(a)
            gw.append(Partial())
        else:
            want.append(Replicate()), out.append(Replicate()), gx.append(Replicate())
            gw.append(b)
    return tuple(want), tuple(out), tuple(gx), tuple(gw)


def float8_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None,
                  recipe: str = "tensorwise") -> torch.Tensor:
    """``F.linear(x, w, bias)`` with its GEMM in fp8, on tensors or DTensors. A DTensor GEMM
    runs on the local shards (each rank scaling its own): x is redistributed to what w's layout
    multiplies locally (replicated for a column-parallel weight, split on its features for a
    row-parallel one), and the output, bias included, is the DTensor DTensor's own linear would
    give. `out_dtype` defaults to autocast's dtype where autocast is on, else x's; `recipe`
    is one of `RECIPES`."""
    if out_dtype is None:
        kind = x.device.type
        out_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) \
            else x.dtype
    if not isinstance(x, DTensor) and not isinstance(w, DTensor):
        out = _local_linear(x, w, out_dtype, recipe)
        return out if bias is None else out + bias.to(out_dtype)
    mesh = (w if isinstance(w, DTensor) else x).device_mesh
    if isinstance(x, DTensor) and isinstance(w, DTensor) and x.device_mesh != w.device_mesh:
        raise NotImplementedError(f"an fp8 GEMM of activations on mesh {x.device_mesh} and a "
                                  f"weight on mesh {w.device_mesh}")
    layouts = _layouts(x, w, x.dim(), mesh.ndim)
    if layouts is None:
        raise NotImplementedError(f"an fp8 GEMM of a weight laid out as {w.placements}")
    want, out_layout, gx, gw = layouts
    replicated = (Replicate(),) * mesh.ndim
    x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, replicated, run_check=False)
    if x.placements != want:
        x = x.redistribute(mesh, want)
    w_local = w.to_local(grad_placements=gw) if isinstance(w, DTensor) else w
    out = _local_linear(x.to_local(grad_placements=gx), w_local, out_dtype, recipe)
    if bias is not None:  # added to the local output: a row-parallel bias once over the sum
        if isinstance(bias, DTensor):  # a replicated bias of split output features: sliced
            aligned = tuple(_moved(o, 0) if _split_dim(o) == x.dim() - 1 and p.is_replicate()
                            else p for o, p in zip(out_layout, bias.placements))
            if aligned != bias.placements:
                bias = bias.redistribute(mesh, aligned)
            bias = bias.to_local(grad_placements=tuple(
                Partial() if o.is_partial() or g.is_partial() else p
                for o, g, p in zip(out_layout, gw, bias.placements)))
        for dim, placement in enumerate(out_layout):
            if placement.is_partial():
                bias = bias / mesh.size(dim)
        out = out + bias.to(out_dtype)
    return DTensor.from_local(out, mesh, out_layout, run_check=False)


_LINEAR = {F.linear}
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
            torch.Tensor.mm}
_ADDMMS = {torch.addmm, torch.Tensor.addmm}
_GEMMS = frozenset(_LINEAR | _MATMULS | _ADDMMS)


class Float8Gemms(TorchFunctionMode):
    """Runs the GEMMs of the plan's fp8 weights in fp8 while their modules run (see the module
    docstring). `seen` and `ran` name the weights whose modules ran and whose GEMMs went to
    fp8, for `check`."""

    def __init__(self, recipe: str = "tensorwise"):
        super().__init__()
        self.recipe = recipe
        self.running: list[tuple[nn.Module, tuple[str, ...], str]] = []
        self.seen: set[str] = set()
        self.ran: set[str] = set()
        self.entered = 0  # how many times the mode is on the stack (forward, recompute)
        self.checked = False

    def __enter__(self):
        self.entered += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self.entered -= 1
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.running and func in _GEMMS:
            out = self._float8(func, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _float8(self, func, args, kwargs):
        module, names, prefix = self.running[-1]
        weights = {id(getattr(module, n)): n for n in names}
        if func in _LINEAR:
            x, w, bias = (*args, None, None)[:3]
            w, bias = kwargs.get("weight", w), kwargs.get("bias", bias)
            name = weights.get(id(w))
            out = None if name is None else float8_linear(x, w, bias, recipe=self.recipe)
        elif func in _MATMULS and len(args) == 2 and not kwargs:
            name = weights.get(id(args[1]))
            out = None if name is None else float8_linear(args[0], args[1].t(),
                                                          recipe=self.recipe)
        elif func in _ADDMMS and len(args) == 3 and not kwargs:
            name = weights.get(id(args[2]))
            out = None if name is None else float8_linear(args[1], args[2].t(), args[0],
                                                          recipe=self.recipe)
        else:
            return None
        if out is not None:
            self.ran.add(prefix + name)
        return out

    def enter(self, module: nn.Module, names: tuple[str, ...], prefix: str) -> None:
        self.running.append((module, names, prefix))
        if self.entered:  # a training forward, not a probe the runtime runs without the mode
            self.seen.update(prefix + n for n in names)

    def exit(self) -> None:
        self.running.pop()

    def check(self) -> None:
        """After each step: say once how many weights' GEMMs ran in fp8, and warn of fp8
        weights whose modules ran but whose GEMMs did not go to fp8 (an op this mode does not
        take, such as ``w @ x`` or an einsum): the plan costed them in fp8."""
        if self.checked or not self.seen:
            return
        self.checked = True
        log.info("fp8: the GEMMs of %d weight(s) ran in fp8", len(self.ran))
        missed = sorted(self.seen - self.ran)
        if missed:
            log.warning("fp8 plan: %d weight(s) ran their GEMMs in bf16, not fp8 as the plan "
                        "costed them (their op is not F.linear, addmm or x @ w): %s",
                        len(missed), ", ".join(missed[:8]) + (" ..." if len(missed) > 8 else ""))


_INSTALLED: weakref.WeakKeyDictionary[nn.Module, Float8Gemms] = weakref.WeakKeyDictionary()


def float8_gemms(model: nn.Module, plan: Plan) -> Float8Gemms:
    """The fp8 mode of `model` under `plan` (an fp8 plan), its module hooks installed on the
    first call: before the runtime copies or shards any module, so pipeline stages (deep
    copies) keep them."""
    if model in _INSTALLED:
        return _INSTALLED[model]
    names = plan.training.fp8_weights
    if names is None:
        raise ValueError("this fp8 plan does not name the weights whose GEMMs run in fp8 "
                         "(plan.training.fp8_weights): it was written by an older autopar; "
                         "re-plan it with autopar.compile")
    recipe = plan.training.options.get("fp8_recipe", "tensorwise")
    if recipe not in RECIPES:
        log.warning("fp8 plan costed with fp8_recipe=%r: this runtime scales %s; it runs "
                    "tensorwise", recipe, " or ".join(RECIPES))
        recipe = "tensorwise"
    mode = Float8Gemms(recipe)
    owners: dict[str, list[str]] = {}
    for fqn in names:
        owner, _, leaf = fqn.rpartition(".")
        owners.setdefault(owner, []).append(leaf)
    for owner, leaves in owners.items():
        module = model.get_submodule(owner)
        prefix, held = f"{owner}." if owner else "", tuple(leaves)

        def enter(mod, args, held=held, prefix=prefix):
            mode.enter(mod, held, prefix)

        def leave(mod, args, out):
            mode.exit()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
    _INSTALLED[model] = mode
    return mode
