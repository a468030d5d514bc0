"""Error classes shared across autopar. All user-facing errors are ``ValueError`` subclasses."""

from __future__ import annotations

__all__ = ["TraceError"]


class TraceError(ValueError):
    """A model or its inputs cannot be traced.

    The message names the module path, the op that failed and what to try; the same facts
    are kept as attributes for programmatic use.
    """

    def __init__(self, message: str, *, module_path: str = "", op: str = "", hint: str = ""):
        parts = [message]
        if module_path or op:
            parts.append(f"(module {module_path or '<root>'!r}, op {op or '?'})")
        if hint:
            parts.append(f"-- try: {hint}")
        super().__init__(" ".join(parts))
        self.module_path = module_path
        self.op = op
        self.hint = hint
