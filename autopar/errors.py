"""Error classes shared across autopar. All user-facing errors are ``ValueError`` subclasses.

The search catches `PlanningError` alone, the inputs having no plan; any other error (a bad
argument, a bug) propagates, so it never reads as "nothing fits" or "infeasible"."""

from __future__ import annotations

__all__ = ["InvalidConfigError", "NoPlanFitsError", "PlanningError", "TraceError"]


class PlanningError(ValueError):
    """These inputs have no plan here: no configuration satisfies the pins on this cluster
    (`InvalidConfigError`), nothing fits in memory (`NoPlanFitsError`), the target engine or
    autopar's runtime cannot run what is pinned (`TargetRuleError`, `RuntimeLimitError`). The
    search moves on to another region, mesh order or alternative on these alone."""


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


class InvalidConfigError(PlanningError):
    """A parallel configuration that cannot run this model on this cluster: a degree that
    does not divide what it splits (heads, experts, the world, the batch, the sequence), more
    pipeline stages than layers, a schedule's micro-batch count. The message says what is
    allowed. The search skips such configurations by this class alone, so an unrelated
    ValueError is never mistaken for one."""


class NoPlanFitsError(PlanningError):
    """No configuration fits in device memory; the message gives the smallest footprint found,
    the configuration that reaches it, the device's memory, and what to try."""


class StageMemoryError(ValueError):
    """No cut of the layers into pipeline stages fits the per-rank memory budget.

    The message gives the budget, the smallest peak any cut reaches and the stage (with its
    layer range, states and activations) that binds; the numbers are kept as attributes. With
    interleaved stages `min_peak_bytes` is a lower bound (a rank sums several chunks).
    """

    def __init__(self, message: str, *, budget_bytes: float, min_peak_bytes: float,
                 stage: int | None = None, layers: tuple[int, int] | None = None):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes
        self.stage = stage
        self.layers = layers


__all__ += ["StageMemoryError"]


class ShardingInfeasibleError(ValueError):
    """The intra-op sharding ILP has no solution; ``family`` names the constraint family that
    binds (e.g. ``"memory_budget"``, or ``"pinned_params"`` where no strategy of a node places
    its parameters as pinned), ``smallest_bytes`` the least memory any plan needs when it is
    the memory budget."""

    def __init__(self, message: str, *, family: str, smallest_bytes: float | None = None):
        super().__init__(message)
        self.family = family
        self.smallest_bytes = smallest_bytes


__all__ += ["ShardingInfeasibleError"]


class TargetRuleError(PlanningError):
    """A pin, precision or software option the compile target (an engine at a stated version,
    `autopar.targets`) cannot run; the message names the rule, its source and what is
    allowed."""


__all__ += ["TargetRuleError"]


class RuntimeLimitError(PlanningError):
    """A pin autopar's runtime cannot run for this model: an axis it cannot shard the model
    on, or two axes it cannot combine on it (`autopar.runtime.capabilities`); the message
    names the reason and what to pin instead."""


__all__ += ["RuntimeLimitError"]


class CalibrationError(ValueError):
    """`autopar calibrate` cannot measure: it was not started under torchrun, a rank did not
    join or stopped answering (the message names the ranks), or the ranks do not fill the
    nodes evenly. The message says what to check or change."""


__all__ += ["CalibrationError"]
