"""Torch functions written in Python that call other torch functions in their body, run so that
the torch-function mode handling them sees those calls too.

A ``TorchFunctionMode`` is off while it handles a call, so the calls a Python-level function
makes inside (``F.multi_head_attention_forward``, behind every ``nn.MultiheadAttention`` and
``nn.Transformer*`` layer, calls ``F.scaled_dot_product_attention``) pass it by: the trace
would record the attention as the meta device decomposes it, and the runtime's modes would not
split it. `run_nested` runs such a function with the mode active inside, skipping only the
function's own first check for torch-function handlers (which would hand the call back to the
mode, and so on forever).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

__all__ = ["NESTED", "run_nested"]

# Python functions that start with ``if has_torch_function(...)`` (the name in their module)
NESTED = frozenset({F.multi_head_attention_forward})


def run_nested(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` (one of `NESTED`) with ``mode`` active in its body."""
    scope = func.__globals__
    check = scope["has_torch_function"]
    outer = [True]

    def first_skipped(ops: Any) -> bool:
        if outer:
            outer.pop()
            return False
        return check(ops)

    scope["has_torch_function"] = first_skipped
    try:
        with mode:
            return func(*args, **kwargs)
    finally:
        scope["has_torch_function"] = check
