"""Why this plan and not another: `explain` ("why not tp=16?") and `diff` of two plans.

`explain(plan, model, cluster, tp=16)` re-runs the search for the plan's own training shape
(global batch, sequence length, dtype), software options and target engine under the plan's
recorded pins merged with the new ones, and compares the best plan found with the original
term by term. A plan file holds no model and no cluster object, only their fingerprints, so
both must be passed again; they are checked against the plan's fingerprints. The pins a plan
was compiled with are read from `plan.training.constraints` when the plan records them; a
plan without that entry is treated as unpinned. When no plan exists under the pins (a degree that does not
divide the world, nothing fits in memory) the explanation carries the search's own message.

`diff(plan_a, plan_b)` renders the same comparison for any two plans: step time, tokens/s,
MFU, every breakdown term, peak memory, and the configuration fields and settings that
differ. Numbers are B minus A.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autopar.errors import PlanningError
from autopar.plan.render import (Format, Section, Table, fmt_bytes_gb, fmt_seconds,
                                 fmt_signed_seconds, render_sections)
from autopar.plan.report import BREAKDOWN_TERMS, slower_because

if TYPE_CHECKING:
    from autopar.cluster import Cluster
    from autopar.plan.plan import Plan
    from autopar.search.outer import SearchSettings

__all__ = ["Comparison", "Explanation", "compare", "diff", "explain"]

_SETTINGS = (("profile", lambda p: p.cluster.profile),
             ("num_nodes", lambda p: p.cluster.num_nodes),
             ("global_batch_size", lambda p: p.training.global_batch_size),
             ("seq_len", lambda p: p.training.seq_len),
             ("dtype", lambda p: p.training.dtype),
             ("model", lambda p: p.model.model_class))


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Plan B against plan A, as numbers (B minus A) and as rows for a table."""

    step_time_delta_s: float
    term_deltas_s: dict[str, float]
    peak_memory_delta_bytes: float
    config_changes: dict[str, tuple[Any, Any]]  # field: (A's value, B's value)
    setting_changes: dict[str, tuple[Any, Any]]  # cluster / training shape / model
    rows: tuple[tuple[str, str, str, str], ...]  # term, A, B, B - A

    @property
    def identical(self) -> bool:
        return (not self.config_changes and not self.setting_changes
                and self.step_time_delta_s == 0.0 and self.peak_memory_delta_bytes == 0.0
                and all(v == 0.0 for v in self.term_deltas_s.values()))

    def reasons(self) -> str:
        """The largest term differences in words, e.g. '+0.31 s dp_comm, +0.12 s bubble'."""
        return slower_because(self.term_deltas_s)


def _signed(value: float, pattern: str) -> str:
    """A signed difference, or "0" when it rounds to zero in `pattern`."""
    text = pattern.format(value)
    number = text.split()[0]
    return "0" if all(ch in "+-0.," for ch in number) else text


def compare(plan_a: Plan, plan_b: Plan) -> Comparison:
    """Term-by-term comparison of two plans (B minus A)."""
    a, b = plan_a.estimate, plan_b.estimate
    terms = {t: b.breakdown.get(t, 0.0) - a.breakdown.get(t, 0.0) for t in BREAKDOWN_TERMS}
    rows = [("step time", fmt_seconds(a.step_time_s), fmt_seconds(b.step_time_s),
             fmt_signed_seconds(b.step_time_s - a.step_time_s)),
            ("tokens/s", f"{a.tokens_per_s:,.0f}", f"{b.tokens_per_s:,.0f}",
             _signed(b.tokens_per_s - a.tokens_per_s, "{:+,.0f}")),
            ("MFU", f"{100 * a.mfu:.1f}%", f"{100 * b.mfu:.1f}%",
             _signed(100 * (b.mfu - a.mfu), "{:+.1f} pt"))]
    rows += [(t, fmt_seconds(a.breakdown.get(t, 0.0)), fmt_seconds(b.breakdown.get(t, 0.0)),
              fmt_signed_seconds(terms[t])) for t in BREAKDOWN_TERMS]
    mem_delta = b.peak_memory_bytes - a.peak_memory_bytes
    rows.append(("peak memory (GB)", fmt_bytes_gb(a.peak_memory_bytes),
                 fmt_bytes_gb(b.peak_memory_bytes), _signed(mem_delta / 1e9, "{:+.2f}")))
    rows.append(("micro-batches", str(a.num_microbatches), str(b.num_microbatches),
                 _signed(b.num_microbatches - a.num_microbatches, "{:+d}")))
    cfg_a, cfg_b = plan_a.config.to_dict(), plan_b.config.to_dict()
    changes = {k: (cfg_a[k], cfg_b[k]) for k in cfg_a if cfg_a[k] != cfg_b[k]}
    rows += [(f"config.{k}", str(va), str(vb), "changed") for k, (va, vb) in changes.items()]
    settings = {name: (get(plan_a), get(plan_b)) for name, get in _SETTINGS
                if get(plan_a) != get(plan_b)}
    rows += [(name, str(va), str(vb), "changed") for name, (va, vb) in settings.items()]
    return Comparison(step_time_delta_s=b.step_time_s - a.step_time_s, term_deltas_s=terms,
                      peak_memory_delta_bytes=mem_delta, config_changes=changes,
                      setting_changes=settings, rows=tuple(rows))


def _comparison_section(comparison: Comparison, title: str, label_a: str, label_b: str,
                        headline: str) -> Section:
    if comparison.config_changes or comparison.setting_changes:
        note = "fields that differ: " + ", ".join(
            list(comparison.config_changes) + list(comparison.setting_changes))
    else:
        note = "no configuration field or setting differs"
    return Section(title=title, lines=(headline,), tables=(
        Table(columns=("term", label_a, label_b, "B - A"), rows=comparison.rows,
              right=frozenset({1, 2, 3})),), after=(note,))


def _headline(comparison: Comparison, plan_a: Plan, plan_b: Plan, subject: str) -> str:
    delta = comparison.step_time_delta_s
    if comparison.identical:
        return f"{subject} is the same plan: zero difference in every term"
    base = plan_a.estimate.step_time_s or 1.0
    if delta == 0.0:
        return f"{subject} takes the same step time ({fmt_seconds(plan_b.estimate.step_time_s)})"
    way = "slower" if delta > 0 else "faster"
    return (f"{subject} is {fmt_seconds(abs(delta))} {way} per step ({100 * delta / base:+.1f}%): "
            f"{comparison.reasons()}")


def diff(plan_a: Plan, plan_b: Plan, fmt: Format = "text") -> str:
    """The term-by-term difference of two plans (B minus A), as text or markdown."""
    comparison = compare(plan_a, plan_b)
    headline = _headline(comparison, plan_a, plan_b,
                         f"B ({plan_b.config.short()}) against A ({plan_a.config.short()})")
    section = _comparison_section(comparison, "Difference, B minus A",
                                  "A", "B", headline)
    return render_sections([section], fmt)


@dataclass(frozen=True, kw_only=True)
class Explanation:
    """The answer to "why not these pins?": the best plan under them, or why there is none."""

    plan: Plan
    pins: dict[str, Any]  # what was asked about
    constraints: dict[str, Any]  # the plan's recorded pins merged with `pins`
    alternative: Plan | None  # None when no plan exists under the constraints
    reason: str | None = None  # the search's message when there is no plan
    comparison: Comparison | None = field(default=None, repr=False)

    @property
    def feasible(self) -> bool:
        return self.alternative is not None

    @property
    def question(self) -> str:
        return "why not " + " ".join(f"{k}={v}" for k, v in self.pins.items()) + "?"

    def summary(self) -> str:
        """One line: how much slower (or faster) the best plan under the pins is, and why."""
        pinned = ", ".join(f"{k}={v}" for k, v in self.constraints.items())
        if self.alternative is None:
            asked = ", ".join(f"{k}={v}" for k, v in self.pins.items())
            kept = ", ".join(f"{k}={v}" for k, v in self.constraints.items()
                             if k not in self.pins)
            return (f"no plan exists with {asked}"
                    + (f" (keeping the plan's own pins {kept})" if kept else "")
                    + f": {self.reason}")
        return _headline(self.comparison, self.plan, self.alternative,
                         f"the best plan with {pinned} ({self.alternative.config.short()})")

    def render(self, fmt: Format = "text") -> str:
        """The explanation as text (rich tables) or markdown, with the difference table."""
        if self.alternative is None:
            section = Section(title=self.question, lines=(self.summary(),), after=(
                (f"the plan stays {self.plan.config.short()} at "
                 f"{fmt_seconds(self.plan.estimate.step_time_s)} per step"),))
        else:
            section = _comparison_section(self.comparison, self.question, "plan", "pinned",
                                          self.summary())
        return render_sections([section], fmt)

    def __str__(self) -> str:
        return self.render("text")


_DEGREES = ("tp", "pp", "cp")


def _recorded_pins(plan: Plan, new: dict[str, Any]) -> dict[str, Any]:
    """The plan's own pins that still apply next to `new`: a new pin replaces an old one, and
    a new tp, pp or cp releases an old dp pin (dp is what the world size leaves over)."""
    pins = dict(plan.training.constraints or plan.search.get("constraints") or {})
    if any(k in new for k in _DEGREES) and "dp" not in new:
        pins.pop("dp", None)
    return pins


def explain(plan: Plan, model: Any, cluster: Cluster, *, example_inputs: Any = None,
            settings: SearchSettings | None = None, **pins: Any) -> Explanation:
    """The best plan for `model` on `cluster` under `pins` (e.g. ``tp=16``) at the plan's
    training shape and options, compared with `plan` term by term.

    The model and the cluster must be the ones the plan was made for (a plan keeps only their
    fingerprints); models traced from `example_inputs` need them again. Unknown pin names and
    another model or cluster raise ValueError; a pin no plan satisfies gives an Explanation
    with `alternative=None` and the reason.
    """
    from autopar.api import compile as compile_plan
    from autopar.estimate.software import SOFTWARE
    from autopar.plan.plan import check_plan
    from autopar.search.outer import CONFIG_FIELDS, SearchSettings

    if not pins:
        raise ValueError(f"explain needs at least one pin, e.g. tp=8; pins are ParallelConfig "
                         f"fields: {', '.join(CONFIG_FIELDS)}")
    unknown = sorted(set(pins) - set(CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"unknown pin(s) {unknown}; pins are ParallelConfig fields: "
                         f"{', '.join(CONFIG_FIELDS)}")
    check_plan(plan, cluster=cluster)
    constraints = {**_recorded_pins(plan, pins), **pins}
    training = plan.training
    options = training.estimate_options
    # the plan's preset by name, so that a target's own preset does not replace it
    software = training.software
    costs = ({"software": software} if software in SOFTWARE
             and SOFTWARE[software].options == options else {"options": options})
    try:
        alternative = compile_plan(
            model, cluster, global_batch_size=training.global_batch_size,
            seq_len=None if example_inputs is not None else training.seq_len,
            example_inputs=example_inputs, dtype=training.dtype, constraints=constraints,
            settings=settings or SearchSettings(progress=False), target=training.target,
            **costs)
    except PlanningError as exc:
        check_plan(plan, model=model)  # another model would be the real reason
        return Explanation(plan=plan, pins=dict(pins), constraints=constraints,
                           alternative=None, reason=str(exc))
    if alternative.model.fingerprint != plan.model.fingerprint:
        raise ValueError(f"this plan was made for another model ({plan.model.model_class}, "
                         f"{plan.model.num_params / 1e9:.2f} B parameters); pass the "
                         f"model the plan was compiled for")
    return Explanation(plan=plan, pins=dict(pins), constraints=constraints,
                       alternative=alternative, comparison=compare(plan, alternative))
