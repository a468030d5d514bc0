"""The ATen op table: which ``OpKind`` an op is, its FLOPs, and which tensors it saves.

This is the only place that knows ATen op names. The rules mirror what PyTorch's autograd
formulas keep for backward (``tools/autograd/derivatives.yaml``): a matmul keeps each operand
whose partner needs a gradient, GELU/SiLU keep their input, softmax/ReLU/exp keep their
output, layer norm keeps its input and statistics, additions keep nothing.
FLOPs come from ``torch.utils.flop_counter``'s formula table, so they follow its conventions.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.flop_counter import FlopCounterMode

from autopar.ir import OpKind

__all__ = ["OpRule", "rule_for", "forward_flops", "MATMUL_OPERANDS"]

# flop formulas keyed by OpOverloadPacket, as FlopCounterMode itself uses them.
_FLOP_FORMULAS = FlopCounterMode(display=False).flop_registry

_VIEW = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze",
    "squeeze", "slice", "select", "split", "split_with_sizes", "unbind", "chunk", "narrow",
    "as_strided", "alias", "unflatten", "flatten", "view_as_real", "view_as_complex",
    "diagonal", "unfold", "expand_as", "_reshape_alias", "contiguous",
}
_PASS_THROUGH = {"detach", "lift_fresh", "alias", "_local_scalar_dense"}
_MATMUL = {"_grouped_mm", "grouped_mm", "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "matmul", "dot", "mv", "addmv"}
_CONV = {"convolution", "_convolution", "conv2d", "conv1d", "conv3d", "_slow_conv2d_forward"}
_NORM = {
    "native_layer_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
    "native_group_norm", "_fused_rms_norm",
}
_SOFTMAX = {"_softmax", "_safe_softmax", "_log_softmax", "softmax", "log_softmax"}
_REDUCE = {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "prod",
           "argmax", "argmin", "norm", "linalg_vector_norm", "logsumexp", "cumsum", "topk", "sort"}
_POOL = {"max_pool2d_with_indices", "avg_pool2d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d",
         "max_pool2d", "avg_pool1d", "adaptive_avg_pool1d", "max_pool1d"}
_EMBEDDING = {"embedding"}
_LOSS = {"nll_loss_forward", "nll_loss2d_forward", "mse_loss", "binary_cross_entropy",
         "binary_cross_entropy_with_logits", "cross_entropy_loss"}
# backward needs the input
_SAVE_INPUT = {"gelu", "silu", "pow", "log", "sin", "cos", "abs", "erf", "mish", "softplus",
               "hardswish", "leaky_relu", "hardtanh", "log1p", "square", "elu", "gelu_", "polar",
               "log2", "log10", "erfc", "atan", "asin", "acos", "asinh", "acosh", "atanh",
               "sinh", "cosh", "tan", "xlogy", "logit", "hardsigmoid", "selu", "celu",
               "softshrink", "hardshrink", "erfinv", "lgamma", "digamma", "sinc", "relu6",
               "threshold", "silu_", "prelu", "_prelu_kernel", "rrelu_with_noise"}
# backward needs the output
_SAVE_OUTPUT = {"relu", "relu_", "sigmoid", "tanh", "exp", "sqrt", "rsqrt", "reciprocal",
                "expm1", "exp2", "sigmoid_", "tanh_", "exp_"}
# backward needs the partner operand
_PRODUCT = {"mul", "mul_", "div", "div_"}
_ELEMENTWISE_NO_SAVE = {
    "add", "add_", "sub", "sub_", "rsub", "neg", "clone", "_to_copy", "copy_", "copy", "cat",
    "stack", "fill_", "zero_", "zeros_like", "ones_like", "empty_like", "full_like", "where",
    "masked_fill", "masked_fill_", "eq", "ne", "lt", "le", "gt", "ge", "logical_not",
    "logical_and", "logical_or", "bitwise_not", "bitwise_and", "bitwise_or", "clamp",
    "clamp_min", "clamp_max", "triu", "tril", "index_select", "gather", "scatter", "index",
    "index_add", "index_add_", "index_put", "index_put_", "one_hot", "repeat", "roll",
    "constant_pad_nd", "pad", "bernoulli_", "bernoulli", "uniform_", "normal_", "arange",
    "scalar_tensor", "type_as", "to", "_assert_tensor_metadata", "lerp", "addcmul",
    "new_zeros", "new_ones", "new_empty", "expand_copy", "floor_divide", "remainder",
    "maximum", "minimum", "sign", "floor", "ceil", "round", "fmod", "any", "all", "isinf",
    "isnan", "nan_to_num", "scatter_add", "masked_select", "bincount", "histc", "scatter_",
    "scatter_add_", "index_fill", "index_fill_", "masked_scatter", "masked_scatter_",
}


@dataclass(frozen=True, kw_only=True)
class OpRule:
    """How one ATen op is costed.

    ``save_inputs``: input positions (over the op's tensor inputs) kept for backward, or
    ``"all"``; ``partner_pairs``: operand pairs where each side is kept when the other needs
    a gradient; ``save_outputs``: output positions kept for backward.
    """

    kind: OpKind
    save_inputs: tuple[int, ...] | str = ()
    partner_pairs: tuple[tuple[int, int], ...] = ()
    save_outputs: tuple[int, ...] = ()
    known: bool = True
    pass_through: bool = False


# positions of the two matrix operands among an op's tensor inputs
MATMUL_OPERANDS = {"mm": (0, 1), "bmm": (0, 1), "matmul": (0, 1), "dot": (0, 1), "mv": (0, 1),
                   "addmm": (1, 2), "baddbmm": (1, 2), "addmv": (1, 2), "_scaled_mm": (0, 1)}


def rule_for(op_name: str, num_inputs: int) -> OpRule:
    """The costing rule of an ATen op, given its packet name (``"mm"``, ``"gelu"``)."""
    if op_name in _PASS_THROUGH:
        return OpRule(kind=OpKind.VIEW, pass_through=True)
    if op_name in _VIEW:
        return OpRule(kind=OpKind.VIEW)
    if op_name in _MATMUL:
        return OpRule(kind=OpKind.MATMUL, partner_pairs=(MATMUL_OPERANDS.get(op_name, (0, 1)),))
    if op_name in _CONV:
        return OpRule(kind=OpKind.CONV, partner_pairs=((0, 1),))
    if op_name in _NORM:
        return OpRule(kind=OpKind.NORM, save_inputs=(0,), save_outputs=(1, 2))
    if op_name in _SOFTMAX:
        return OpRule(kind=OpKind.SOFTMAX, save_outputs=(0,))
    if op_name in _EMBEDDING:
        return OpRule(kind=OpKind.EMBEDDING, save_inputs=(1,))
    if op_name in _POOL:
        outputs = (1,) if op_name.endswith("with_indices") else ()
        inputs = (0,) if op_name.startswith("max") else ()
        return OpRule(kind=OpKind.POOL, save_inputs=inputs, save_outputs=outputs)
    if op_name in _REDUCE:
        keeps = op_name in {"amax", "amin", "max", "min", "var", "std", "norm",
                            "linalg_vector_norm", "logsumexp", "prod"}
        return OpRule(kind=OpKind.REDUCE, save_inputs=(0,) if keeps else ())
    if op_name in _LOSS:
        return OpRule(kind=OpKind.LOSS, save_inputs=tuple(range(num_inputs)))
    if op_name in _SAVE_INPUT:
        return OpRule(kind=OpKind.ELEMENTWISE, save_inputs=(0,))
    if op_name in _SAVE_OUTPUT:
        return OpRule(kind=OpKind.ELEMENTWISE, save_outputs=(0,))
    if op_name in _PRODUCT:
        pairs = ((0, 1),) if num_inputs >= 2 else ()
        return OpRule(kind=OpKind.ELEMENTWISE, partner_pairs=pairs)
    if op_name in _ELEMENTWISE_NO_SAVE:
        return OpRule(kind=OpKind.ELEMENTWISE)
    return OpRule(kind=OpKind.GENERIC, save_inputs="all", known=False)


def _grouped_mm_flops(mat_a, mat_b, *args, **kwargs) -> int:
    """Grouped matmul: every row of ``mat_a`` meets one group's matrix, whatever the routing."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:  # groups split the contraction dim
        return 2 * mat_a.shape[0] * mat_a.shape[1] * mat_b.shape[-1]
    out_rows = mat_a.shape[0] if mat_a.dim() == 2 else mat_a.shape[0] * mat_a.shape[1]
    return 2 * out_rows * mat_a.shape[-1] * mat_b.shape[-1]


def forward_flops(func, args, kwargs, out) -> int:
    """FLOPs of one ATen call by FlopCounterMode's own formula; 0 if it has none."""
    if func.overloadpacket.__name__ in ("_grouped_mm", "grouped_mm"):
        return int(_grouped_mm_flops(*args, **kwargs))
    formula = _FLOP_FORMULAS.get(func.overloadpacket)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def has_flop_formula(func) -> bool:
    name = func.overloadpacket.__name__
    return func.overloadpacket in _FLOP_FORMULAS or name in ("_grouped_mm", "grouped_mm")
