"""PNG pictures of a `Plan`: pipeline timeline, memory per stage, candidates, step breakdown.

`plot_plan(plan, out_dir)` writes four files with fixed names and returns their paths:

- ``timeline.png``: one lane per pipeline rank; forward, backward and weight-grad ops of each
  micro-batch over time, idle time as bubble, then the exposed data-parallel communication
  and the optimizer step that close the step. The schedule is the plan's simulated one, or
  re-simulated from the stored per-stage times when the plan was loaded from a file.
- ``memory.png``: memory per pipeline rank stacked by category, with the device memory line.
- ``candidates.png``: every candidate of the search as step time against peak memory, the
  Pareto front of the fitting ones (no other candidate is both faster and smaller) and the
  chosen plan.
- ``breakdown.png``: the exposed step-time terms as bars with their share of the step.

Figures are built with matplotlib's object API on the Agg canvas (no pyplot, no global
backend or rc change), so importing this module and calling it has no side effects.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from autopar.plan.render import fmt_seconds
from autopar.plan.report import BREAKDOWN_TERMS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from autopar.plan.plan import Plan
    from costmodels.pipeline import PipelineTimeline

__all__ = ["PLOT_FILES", "pareto_front", "plot_plan"]

PLOT_FILES = ("timeline", "memory", "candidates", "breakdown")
_DPI = 110
_OP_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
_OP_NAMES = {"F": "forward", "B": "backward", "W": "weight grad"}
_IDLE_COLOR = "#E5E5E5"
_TAIL_COLORS = {"dp_comm": "#8172B3", "optimizer": "#937860"}
_MEMORY_COLORS = {"states": "#4C72B0", "activations": "#DD8452", "zero3_buffers": "#55A868",
                  "comm_buffers": "#C44E52", "cuda_context": "#8172B3",
                  "allocator_reserve": "#937860"}
_TERM_COLORS = {"compute": "#4C72B0", "recompute": "#64B5CD", "tp_comm": "#DD8452",
                "cp_comm": "#DA8BC3", "ep_comm": "#CCB974", "bubble": "#8C8C8C",
                "pp_comm": "#55A868",
                "dp_comm": "#8172B3", "optimizer": "#937860"}
_MAX_LABELLED_OPS = 48  # per rank; more and the micro-batch numbers become unreadable


def _figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    # no date/software metadata: the same plan gives the same bytes
    fig.savefig(path, format="png", metadata={"Software": None})
    return path


def _timeline_of(plan: Plan) -> PipelineTimeline | None:
    from costmodels.pipeline import simulate_pipeline

    est, cfg = plan.estimate, plan.config
    if est.timeline is not None:
        return est.timeline
    if not est.stage_forward_s or not est.stage_backward_s:
        return None
    return simulate_pipeline(
        schedule=cfg.pp_schedule, num_stages=cfg.pp, num_microbatches=est.num_microbatches,
        virtual_stages=cfg.virtual_stages, forward_s=list(est.stage_forward_s),
        backward_s=list(est.stage_backward_s),
        weight_grad_s=list(est.stage_wgrad_s) if cfg.pp_schedule == "zero-bubble" else None,
        p2p_s=est.p2p_s)


def _plot_timeline(plan: Plan, path: Path) -> Path:
    from matplotlib.patches import Patch

    timeline = _timeline_of(plan)
    pp = plan.config.pp
    fig = _figure(12, 1.4 + 0.55 * pp)
    ax = fig.add_subplot()
    if timeline is None:
        ax.text(0.5, 0.5, "this plan holds no per-stage times to simulate", ha="center",
                va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return _save(fig, path)
    scale, unit = (1e3, "ms") if timeline.step_time_s < 1.0 else (1.0, "s")
    tail = [(k, plan.estimate.breakdown.get(k, 0.0)) for k in ("dp_comm", "optimizer")]
    end = timeline.step_time_s + sum(v for _, v in tail)
    for rank in range(timeline.num_stages):
        y = timeline.num_stages - 1 - rank
        ax.broken_barh([(0.0, timeline.step_time_s * scale)], (y - 0.4, 0.8),
                       facecolors=_IDLE_COLOR, hatch="//", edgecolor="#BBBBBB", linewidth=0)
        ops = timeline.ops[rank]
        edge = 0.5 if len(ops) <= 4 * _MAX_LABELLED_OPS else 0.0  # dense: solid blocks
        for op in ops:
            kind = str(op.kind.value if hasattr(op.kind, "value") else op.kind)
            width = (op.end_s - op.start_s) * scale
            ax.broken_barh([(op.start_s * scale, width)], (y - 0.4, 0.8),
                           facecolors=_OP_COLORS.get(kind, "#999999"), edgecolor="white",
                           linewidth=edge)
            if len(ops) <= _MAX_LABELLED_OPS and width > 0:
                label = str(op.microbatch) if timeline.virtual_stages == 1 else \
                    f"{op.microbatch}.{op.stage // pp}"
                ax.text(op.start_s * scale + width / 2, y, label, ha="center", va="center",
                        fontsize=7, color="white", clip_on=True)
        start = timeline.step_time_s
        for name, seconds in tail:
            if seconds > 0:
                ax.broken_barh([(start * scale, seconds * scale)], (y - 0.4, 0.8),
                               facecolors=_TAIL_COLORS[name], linewidth=0)
                start += seconds
    ax.set_yticks(range(pp), [f"rank {r}" for r in reversed(range(pp))])
    ax.set_xlim(0, end * scale * 1.01)
    ax.set_ylim(-0.6, pp - 0.4)
    ax.set_xlabel(f"time in the step ({unit})")
    kinds = ["F", "B"] + (["W"] if plan.config.pp_schedule == "zero-bubble" else [])
    handles = [Patch(facecolor=_OP_COLORS[k], label=_OP_NAMES[k]) for k in kinds]
    handles.append(Patch(facecolor=_IDLE_COLOR, hatch="//", edgecolor="#BBBBBB",
                         label="bubble (idle)"))
    handles += [Patch(facecolor=_TAIL_COLORS[k], label=f"{k} (exposed)")
                for k, v in tail if v > 0]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8,
               frameon=False)
    cfg = plan.config
    ax.set_title(f"pipeline timeline: {cfg.pp_schedule}"
                 + (f" x{cfg.virtual_stages}" if cfg.virtual_stages > 1 else "")
                 + f", pp={cfg.pp}, {timeline.num_microbatches} micro-batches, step "
                 f"{fmt_seconds(plan.estimate.step_time_s)} (TP/CP/EP time is inside the ops;"
                 f" labels: micro-batch{'.chunk' if cfg.virtual_stages > 1 else ''})",
                 fontsize=9)
    return _save(fig, path)


def _plot_memory(plan: Plan, path: Path) -> Path:
    est = plan.estimate
    fig = _figure(max(6.0, 3.2 + 0.6 * plan.config.pp), 4.5)
    ax = fig.add_subplot()
    device_gb = est.usable_memory_bytes / 1e9
    if est.memory_by_stage:
        ranks = list(range(len(est.memory_by_stage)))
        bottom = [0.0] * len(ranks)
        for key, color in _MEMORY_COLORS.items():
            values = [float(mem.get(key, 0.0)) / 1e9 for mem in est.memory_by_stage]
            ax.bar(ranks, values, bottom=bottom, color=color, label=key.replace("_", " "),
                   width=0.7)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(ranks, [str(r) for r in ranks])
        top = max(bottom)
    else:
        top = est.peak_memory_bytes / 1e9
        ax.bar([0], [top], color="#999999", label="peak (no per-stage detail)")
        ax.set_xticks([0], ["all"])
    if est.memory_by_stage:
        for rank, total in zip(ranks, bottom):
            ax.text(rank, total, f"{total:.2f} GB\n{100 * total / device_gb:.1f}%", ha="center",
                    va="bottom", fontsize=7,
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
    if device_gb <= 3 * top:
        ax.axhline(device_gb, color="#C44E52", linestyle="--", linewidth=1.2,
                   label=f"device memory {device_gb:.0f} GB")
        ax.set_ylim(0, max(device_gb, top) * 1.12)
    else:  # the line would flatten the bars: keep the bars readable and say where it is
        ax.set_ylim(0, top * 1.3)
        ax.annotate(f"device memory {device_gb:.0f} GB (off the scale)", xy=(0.5, 1.0),
                    xycoords="axes fraction", xytext=(0, -4), textcoords="offset points",
                    ha="center", va="top", fontsize=8, color="#C44E52")
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("GB per GPU")
    ax.set_title(f"memory per pipeline rank (peak {est.peak_memory_bytes / 1e9:.2f} GB)",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return _save(fig, path)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (step time, memory) that no other point beats in both, sorted
    by step time; among equal points the first is kept."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1], i))
    front, best_memory = [], float("inf")
    for i in order:
        if points[i][1] < best_memory:
            front.append(i)
            best_memory = points[i][1]
    return front


def _plot_candidates(plan: Plan, path: Path) -> Path:
    table = plan.candidates
    fig = _figure(9.5, 5.0)
    ax = fig.add_subplot()
    step = plan.estimate.step_time_s
    scale, unit = (1e3, "ms") if step < 1.0 else (1.0, "s")
    if table is not None and not table.empty:
        fits = table["fits"].astype(bool)
        exact = table["exact"].astype(bool) if "exact" in table else fits & False
        for mask, label, style in (
                (~fits, "does not fit", {"c": "#C44E52", "marker": "x", "s": 14}),
                (fits & ~exact, "fits (closed form)", {"c": "#4C72B0", "marker": "o", "s": 14}),
                (fits & exact, "fits (simulated)", {"c": "#55A868", "marker": "D", "s": 22})):
            part = table[mask]
            if len(part):
                ax.scatter(part["step_time_s"] * scale, part["peak_memory_gb"], label=label,
                           alpha=0.7, **style)
        fitting = table[fits]
        points = list(zip(fitting["step_time_s"].astype(float),
                          fitting["peak_memory_gb"].astype(float)))
        front = [points[i] for i in pareto_front(points)]
        if front:
            ax.step([p[0] * scale for p in front], [p[1] for p in front], where="post",
                    color="black", linewidth=1.2, label="Pareto front (fitting)")
    ax.scatter([step * scale], [plan.estimate.peak_memory_bytes / 1e9], marker="*", s=260,
               c="gold", edgecolors="black", zorder=5, label=f"plan: {plan.config.short()}")
    device_gb = plan.estimate.usable_memory_bytes / 1e9
    highest = max([plan.estimate.peak_memory_bytes / 1e9] + (
        [] if table is None or table.empty else list(table["peak_memory_gb"].astype(float))))
    lowest = min([plan.estimate.peak_memory_bytes / 1e9] + (
        [] if table is None or table.empty else list(table["peak_memory_gb"].astype(float))))
    if highest > 20 * max(lowest, 1e-9):  # non-fitting configs far above: a log axis
        ax.set_yscale("log")
        ax.axhline(device_gb, color="#C44E52", linestyle="--", linewidth=1.0,
                   label=f"device memory {device_gb:.0f} GB")
    elif device_gb <= 1.5 * highest:  # else the line would squash the points to the bottom
        ax.axhline(device_gb, color="#C44E52", linestyle="--", linewidth=1.0,
                   label=f"device memory {device_gb:.0f} GB")
        ax.set_ylim(0, max(device_gb, highest) * 1.08)
    else:
        ax.set_ylim(0, highest * 1.15)
    ax.set_xlabel(f"step time ({unit})")
    ax.set_ylabel("peak memory per GPU (GB)" + (", log scale" if ax.get_yscale() == "log"
                                                 else ""))
    ax.set_title(f"{0 if table is None else len(table)} candidates: step time vs memory "
                 f"(device memory {device_gb:.0f} GB)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return _save(fig, path)


def _plot_breakdown(plan: Plan, path: Path) -> Path:
    est = plan.estimate
    step = est.step_time_s or 1.0
    scale, unit = (1e3, "ms") if step < 1.0 else (1.0, "s")
    terms = list(BREAKDOWN_TERMS)
    values = [est.breakdown.get(t, 0.0) for t in terms]
    fig = _figure(8.0, 4.2)
    ax = fig.add_subplot()
    positions = list(range(len(terms)))[::-1]
    ax.barh(positions, [v * scale for v in values],
            color=[_TERM_COLORS[t] for t in terms], height=0.65)
    for y, value in zip(positions, values):
        ax.text(value * scale, y, f"  {fmt_seconds(value)} ({100 * value / step:.1f}%)",
                va="center", fontsize=8)
    ax.set_yticks(positions, terms)
    ax.set_xlim(0, max(values + [0.0]) * scale * 1.35 or 1.0)
    ax.set_xlabel(f"exposed time per step ({unit})")
    ax.set_title(f"step-time breakdown: {fmt_seconds(est.step_time_s)} per step "
                 f"({plan.config.short()})", fontsize=10)
    return _save(fig, path)


def plot_plan(plan: Plan, out_dir: str | Path) -> dict[str, Path]:
    """Write timeline.png, memory.png, candidates.png and breakdown.png into `out_dir`
    (created if missing); returns {name: path}."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"plot directory {str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    writers = {"timeline": _plot_timeline, "memory": _plot_memory,
               "candidates": _plot_candidates, "breakdown": _plot_breakdown}
    return {name: writers[name](plan, out / f"{name}.png") for name in PLOT_FILES}
