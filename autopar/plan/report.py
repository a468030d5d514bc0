"""The human-readable report of a `Plan`: why this configuration, what it costs, what it assumes.

`render_report(plan, fmt)` lays the plan out in sections -- model, cluster and batch; the
chosen configuration with the engine it was made for and what keeping to that engine's rules
costs; the prediction; the step-time breakdown; memory per pipeline rank by
category against device memory; layers per stage; tensor/data-parallel placements summarised
per module kind; the next candidates and what made each slower; the assumptions (software
options, the named cost-model constants with their values, the overlap rules, the hardware
profile and its cited efficiencies). Sections are plain data rendered by
`autopar.plan.render`, which `explain.py` reuses for its difference tables.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import pandas as pd

from autopar.config import ParallelConfig
from costmodels import collectives as _collectives
from costmodels import compute as _compute
from costmodels import memory as _memory
from costmodels import nccl_constants as _nccl
from autopar.plan.render import (Format, Section, Table, fmt_bytes_gb, fmt_count, fmt_bytes,
                                 fmt_seconds, fmt_signed_seconds, fmt_value, render_sections)

if TYPE_CHECKING:
    from autopar.plan.plan import Plan

__all__ = ["BREAKDOWN_TERMS", "compress_modules", "next_candidates", "overlap_rules",
           "render_report", "slower_because"]

# Exposed seconds per step on the busiest pipeline rank; they sum to the step time.
BREAKDOWN_TERMS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "bubble",
                   "pp_comm", "dp_comm", "optimizer")
_TERM_MEANING = {
    "compute": "forward and backward kernels of the busiest pipeline rank",
    "recompute": "activation recomputation in the backward",
    "tp_comm": "tensor/sequence-parallel collectives not hidden by GEMMs",
    "cp_comm": "context-parallel K/V traffic not hidden by attention",
    "ep_comm": "expert-parallel all-to-all (never overlapped)",
    "bubble": "idle time of that rank in the pipeline schedule (incl. p2p waits)",
    "pp_comm": "gradient sums of weights tied across pipeline stages, after the drain",
    "dp_comm": "data-parallel gradient/parameter traffic left exposed",
    "optimizer": "optimizer step on the local shard of the master weights",
}
_MEMORY_CATEGORIES = (("states", "states"), ("activations", "activations"),
                      ("zero3_buffers", "ZeRO-3 buffers"), ("comm_buffers", "comm buffers"),
                      ("cuda_context", "CUDA context"), ("allocator_reserve", "alloc. reserve"))
_NEXT_CANDIDATES = 5


# -- formatting ------------------------------------------------------------------------------

def slower_because(deltas: dict[str, float], *, top: int = 3) -> str:
    """What made a candidate slower: the largest positive term differences, then the largest
    negative one that offsets them, e.g. '+0.31 s dp_comm, +0.12 s bubble (offset by -0.05 s
    compute)'."""
    meaningful = {k: v for k, v in deltas.items() if abs(v) >= 1e-9}
    worse = sorted(((k, v) for k, v in meaningful.items() if v > 0),
                   key=lambda kv: (-kv[1], kv[0]))[:top]
    better = sorted(((k, v) for k, v in meaningful.items() if v < 0),
                    key=lambda kv: (kv[1], kv[0]))[:1]
    if not worse and not better:
        return "no term differs (a tie; the simpler config wins the tie-break)"
    text = ", ".join(f"{fmt_signed_seconds(v)} {k}" for k, v in worse) or "no term is larger"
    if better:
        text += f" (offset by {fmt_signed_seconds(better[0][1])} {better[0][0]})"
    return text


# -- the sections -------------------------------------------------------------------------------

def _overview(plan: Plan, device_model: str | None) -> Section:
    model, cluster, training = plan.model, plan.cluster, plan.training
    seq, batch = training.seq_len, training.global_batch_size
    tokens = f"{batch} sequences x {seq} tokens = {batch * seq:,} tokens per step" if seq else \
        f"{batch} samples per step"
    gpus = f"{cluster.world_size} x {device_model}" if device_model else \
        f"{cluster.world_size} GPUs"
    return Section(title="Model, cluster, batch", lines=(
        (f"model    {model.model_class}: {fmt_count(model.num_params)} parameters, "
         f"{model.num_layers} layers (blocks plus embedding/head glue)"),
        f"cluster  {cluster.num_nodes} x {cluster.profile} ({gpus})",
        f"batch    {tokens}, {training.dtype}",
    ))


def _configuration(plan: Plan) -> Section:
    cfg, est = plan.config, plan.estimate
    # the mesh row below lists the axes in that order; one block in k is said when k > 1,
    # experts folded over tp when they are
    rows = [(name, fmt_value(value)) for name, value in cfg.to_dict().items()
            if name != "mesh_order" and (name != "recompute_every" or value > 1)
            and (name != "etp" or cfg.folded)]
    rows.append(("micro-batches per step", str(est.num_microbatches)))
    mesh = plan.mesh
    rows.append(("mesh", " x ".join(f"{a}={s}" for a, s in zip(mesh.axes, mesh.sizes))
                 + (f" (ep={mesh.ep} within {mesh.ep_within})" if mesh.ep > 1 else "")))
    return Section(title="Chosen configuration", lines=(cfg.short(), *_target_lines(plan)),
                   tables=(Table(columns=("field", "value"), rows=tuple(rows)),))


def _target_lines(plan: Plan) -> tuple[str, ...]:
    """The engine the plan was made for and, for an engine other than autopar's runtime, what
    keeping to its rules costs: the best plan for autopar's runtime (same pins and software)
    against the plan. Plans saved before targets existed record none."""
    from autopar.targets import TARGETS

    name = plan.training.target
    if name is None:
        return ()
    if name == "autopar":
        return ("target   autopar: autopar's runtime, every configuration it runs for this "
                "model",)
    engine = TARGETS[name].engine if name in TARGETS else name
    free = plan.training.unrestricted or {}
    software = plan.training.software
    lines = [f"target   {name}: only what {engine} runs (autopar.targets), costed with "
             + (f"the {software} software preset" if software else "the options below")]
    mine, theirs = free.get("step_time_s"), plan.estimate.step_time_s
    if mine is None:
        lines.append("restriction cost: no plan for autopar's runtime to compare with ("
                     + free.get("reason", "none recorded") + ")")
    else:
        lines.append(f"restriction cost {100 * (theirs / mine - 1):+.1f}%: best for autopar's "
                     f"runtime {fmt_seconds(mine)} vs best for {name} {fmt_seconds(theirs)}")
        lines.append(f"         (autopar's runtime: {free.get('config', '?')}, same pins and "
                     f"software)")
    return tuple(lines)


# Above this share of device memory the report says how far the estimate's memory has erred
# (SearchSettings.memory_headroom's measurements)
_TIGHT_MEMORY_SHARE = 0.9


def _prediction(plan: Plan) -> Section:
    est = plan.estimate
    return Section(title="Prediction", lines=(
        f"step time    {fmt_seconds(est.step_time_s)}",
        f"throughput   {est.tokens_per_s:,.0f} tokens/s",
        f"MFU          {100 * est.mfu:.1f}% ({est.model_tflops_per_gpu:.1f} model TFLOP/s per GPU)",
        *_memory_lines(plan)))


def _memory_lines(plan: Plan) -> tuple[str, ...]:
    """The peak against the device and the headroom the plan keeps (plans saved before the
    headroom existed record none: their usable memory is the device's)."""
    est, training = plan.estimate, plan.training
    device = training.device_memory_bytes or est.usable_memory_bytes
    share = est.peak_memory_bytes / device if device else 0.0
    headroom = training.memory_headroom
    if not est.fits:
        verdict = "DOES NOT FIT"
    elif training.memory_headroom_kept:
        verdict = f"fits with {100 * headroom:g}% of device memory kept free" if headroom \
            else "fits"
    else:
        verdict = (f"fits the device but not the {100 * headroom:g}% headroom the search keeps "
                   f"(SearchSettings.memory_headroom): no plan fits within it")
    lines = [f"peak memory  {fmt_bytes_gb(est.peak_memory_bytes)} of {fmt_bytes_gb(device)} "
             f"GB ({100 * share:.1f}%), {verdict}"]
    if est.fits and share > _TIGHT_MEMORY_SHARE:
        lines.append(f"             at {100 * share:.0f}% of the device: the estimate's tensor "
                     f"memory was within 0.2% of measured peaks without recompute, up to 12% "
                     f"under with full recompute (benchmarks/memory_error.py)")
    return tuple(lines)


def _breakdown(plan: Plan) -> Section:
    est = plan.estimate
    step = est.step_time_s or 1.0
    rows = [(term, fmt_seconds(est.breakdown.get(term, 0.0)),
             f"{100 * est.breakdown.get(term, 0.0) / step:.1f}%", _TERM_MEANING[term])
            for term in BREAKDOWN_TERMS]
    rows.append(("step", fmt_seconds(est.step_time_s), "100.0%", "sum of the terms above"))
    after = []
    if "dp_comm_total" in est.breakdown:
        after.append(f"data-parallel traffic in total (hidden and exposed): "
                     f"{fmt_seconds(est.breakdown['dp_comm_total'])}")
    if plan.config.pp > 1 and "pp_p2p_per_transfer" in est.breakdown:
        after.append(f"pipeline send of one activation between stages: "
                     f"{fmt_seconds(est.breakdown['pp_p2p_per_transfer'])}")
    return Section(title="Step-time breakdown (exposed time per step)", tables=(
        Table(columns=("term", "time", "% of step", "what it is"), rows=tuple(rows),
              right=frozenset({1, 2})),), after=tuple(after))


def _memory_section(plan: Plan) -> Section:
    est = plan.estimate
    if not est.memory_by_stage:
        return Section(title="Memory per pipeline stage", lines=(
            "no per-stage memory in this estimate (closed-form estimates keep only the peak)",))
    rows, device = [], plan.training.device_memory_bytes or est.usable_memory_bytes
    for rank, mem in enumerate(est.memory_by_stage):
        total = sum(float(v) for k, v in mem.items() if not k.startswith("_"))
        rows.append((str(rank), *(fmt_bytes_gb(mem.get(key, 0.0)) for key, _ in _MEMORY_CATEGORIES),
                     fmt_bytes_gb(total), f"{100 * total / device:.1f}%"))
    columns = ("rank", *(label for _, label in _MEMORY_CATEGORIES), "total", "of device")
    return Section(title="Memory per pipeline stage (GB)", tables=(
        Table(columns=columns, rows=tuple(rows), right=frozenset(range(1, len(columns)))),),
        after=((f"device memory {fmt_bytes_gb(device)} GB per GPU, {fmt_bytes_gb(est.usable_memory_bytes)} GB of it for the plan; the "
               f"peak is {fmt_bytes_gb(est.peak_memory_bytes)} GB"),))


def compress_modules(paths: list[str]) -> str:
    """['emb', 'layers.0', 'layers.1', 'layers.2', 'norm'] -> 'emb, layers.0-2, norm'."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None
    for path in paths:
        match = re.fullmatch(r"(.*\.)(\d+)", path)
        if match and run and run[0] == match.group(1) and int(match.group(2)) == run[2] + 1:
            run = (run[0], run[1], run[2] + 1)
            continue
        if run:
            out.append(f"{run[0]}{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
            run = None
        if match:
            run = (match.group(1), int(match.group(2)), int(match.group(2)))
        else:
            out.append(path)
    if run:
        out.append(f"{run[0]}{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
    return ", ".join(out)


def _stages(plan: Plan) -> Section:
    pp = plan.config.pp
    rows = []
    for index, modules in enumerate(plan.stages):
        rank, chunk = index % pp, index // pp
        rows.append((str(index), str(rank), str(chunk), str(len(modules)),
                     compress_modules(list(modules))))
    return Section(title="Layers per stage", lines=(
        (f"{len(plan.stages)} stage(s) over pp={pp} rank(s); stage s runs on rank s mod pp "
         f"(chunk s div pp); glue modules joined by '+' count as one layer"),),
        tables=(Table(columns=("stage", "rank", "chunk", "layers", "modules"), rows=tuple(rows),
                      right=frozenset({0, 1, 2, 3})),))


_VOCAB_NAME = re.compile(r"(emb|wte|wpe|lm_head|output|head|vocab)", re.IGNORECASE)


def _tp_role(pattern: str, placement: str) -> str:
    if placement == "R":
        return "replicated"
    if placement == "P":
        return "partial"
    if placement == "S(0)":
        in_block = "*" in pattern
        return "vocab-parallel" if not in_block and _VOCAB_NAME.search(pattern) \
            else "column-parallel"
    if placement == "S(1)":
        return "row-parallel"
    return f"sharded {placement}"


def _leaf_order(leaf: str) -> tuple[bool, str]:
    return (leaf != "weight", leaf)


def _placements(plan: Plan) -> Section:
    groups: dict[str, dict[str, Any]] = {}
    for fqn, axes in sorted(plan.placements.items()):
        parts = fqn.split(".")
        pattern = ".".join("*" if p.isdigit() else p for p in parts[:-1]) or "(root)"
        group = groups.setdefault(pattern, {"instances": set(), "tensors": 0, "axes": {}})
        group["instances"].add(tuple(p for p in parts[:-1] if p.isdigit()))
        group["tensors"] += 1
        for axis, placement in axes.items():
            group["axes"].setdefault(axis, {}).setdefault(placement, set()).add(parts[-1])
    axis_names = sorted({a for g in groups.values() for a in g["axes"]},
                        key=lambda a: ("tp", "dp", "cp", "ep").index(a)
                        if a in ("tp", "dp", "cp", "ep") else 9)
    roles: dict[str, int] = {}
    dp_sharded = 0
    rows = []
    for pattern, group in groups.items():
        cells = []
        for axis in axis_names:
            by_placement = group["axes"].get(axis, {})
            if len(by_placement) == 1:
                (placement,) = by_placement
                text = placement
                if axis == "tp":
                    text += f" ({_tp_role(pattern, placement)})"
            else:
                parts = sorted(((min(leaves, key=_leaf_order), sorted(leaves, key=_leaf_order), pl)
                                for pl, leaves in by_placement.items()),
                               key=lambda t: _leaf_order(t[0]))
                text = ", ".join(f"{'/'.join(leaves)} {pl}"
                                 + (f" ({_tp_role(pattern, pl)})" if axis == "tp" else "")
                                 for _, leaves, pl in parts)
            cells.append(text)
        tensors_per = group["tensors"] // max(1, len(group["instances"]))
        rows.append((pattern, str(len(group["instances"])), str(tensors_per), *cells))
    for fqn, axes in plan.placements.items():
        pattern = ".".join("*" if p.isdigit() else p for p in fqn.split(".")[:-1]) or "(root)"
        role = _tp_role(pattern, axes.get("tp", "R"))
        roles[role] = roles.get(role, 0) + 1
        dp_sharded += axes.get("dp", "R").startswith("S")
    total = len(plan.placements)
    lines = (f"{total} parameter tensors; on tp: " +
             ", ".join(f"{n} {role}" for role, n in sorted(roles.items(), key=lambda kv: -kv[1]))
             + f"; on dp: {dp_sharded} sharded (ZeRO-3), {total - dp_sharded} replicated",
             ("R = replicated, S(d) = sharded on tensor dim d, P = partial sum; 'instances' "
              "counts the repeated layers sharing one pattern"))
    after = []
    for block, info in sorted(plan.intra_op.items()):
        same = info.get("matches_estimate_layout")
        cp = info.get("cp", 1)
        share = f", cp={cp} (one rank's share of the sequence)" if cp > 1 else ""
        after.append(f"intra-op ILP for {block} at tp={info.get('tp')}{share}: "
                     f"{'optimal' if info.get('optimal') else 'not proven optimal'}, comm "
                     f"{fmt_seconds(info.get('comm_s', 0.0))} per layer; "
                     + _taken(info) + ("" if same else "; " + _ilp_advice(info)))
    return Section(title="Placements per module kind", lines=lines, tables=(
        Table(columns=("module", "instances", "tensors", *axis_names), rows=tuple(rows),
              right=frozenset({1, 2})),), after=tuple(after))


def _taken(info: dict[str, Any]) -> str:
    """The layout the plan runs and its estimate costs (`tp_layout`)."""
    subs = info.get("replicated_sublayers")
    kv = info.get("replicated_kv")
    kv = (f" and the K/V projections ({', '.join(kv)}) replicated: tp exceeds their "
          f"heads" if kv else "")
    if subs:
        return (f"the plan runs Megatron's layout with sub-layer{'s' if len(subs) > 1 else ''} "
                f"{', '.join(map(str, subs))} replicated on the sequence shard{kv}, as the "
                f"estimate costs it")
    return f"the plan runs Megatron's layout{kv}, as the estimate costs it"


def _ilp_advice(info: dict[str, Any]) -> str:
    """What the block's unconstrained ILP optimum, a layout the runtime does not run as the
    ILP prices it, would trade (`tp_layout`)."""
    where = "(intra_op 'ilp_placements')"
    if "ilp_objective_s" not in info or "memory_bytes" not in info:
        return f"the ILP's own optimum is another layout {where}"
    taken = info.get("compute_s", 0.0) + info.get("comm_s", 0.0) + info.get("state_s", 0.0)
    more = info["ilp_memory_bytes"] - info["memory_bytes"]
    trade = (f"{fmt_seconds(taken - info['ilp_objective_s'])} faster per layer" +
             (f", holding {fmt_bytes_gb(more)} GB more per rank" if more > 0 else ""))
    return f"the ILP's own optimum is another layout {where}: {trade}"


def next_candidates(plan: Plan, count: int = _NEXT_CANDIDATES) -> list[pd.Series]:
    """The fitting candidates after the plan: simulated ones first (comparable with the plan's
    simulated estimate), then closed-form ones, each by step time; the plan's config excluded."""
    table = plan.candidates
    if table is None or table.empty or "fits" not in table:
        return []
    rows = [row for _, row in table.iterrows()
            if bool(row["fits"]) and ParallelConfig.from_record(row) != plan.config]
    exact = "exact" in table
    rows.sort(key=lambda r: (0 if exact and bool(r["exact"]) else 1, float(r["step_time_s"])))
    return rows[:count]


def _candidate_label(row: pd.Series) -> str:
    return ParallelConfig.from_record(row).short()


def _candidates(plan: Plan) -> Section:
    picked = next_candidates(plan)
    if not picked:
        return Section(title="Next candidates", lines=(
            "no other fitting candidate was evaluated (the constraints left one configuration)",))
    est = plan.estimate
    rows = []
    for rank, row in enumerate(picked, start=2):
        deltas = {t: float(row.get(f"t_{t}", 0.0)) - est.breakdown.get(t, 0.0)
                  for t in BREAKDOWN_TERMS}
        delta = float(row["step_time_s"]) - est.step_time_s
        fidelity = "simulated" if bool(row.get("exact", False)) else "closed form"
        rows.append((str(rank), _candidate_label(row), fmt_seconds(row["step_time_s"]),
                     fmt_signed_seconds(delta), f"{float(row['peak_memory_gb']):.2f}", fidelity,
                     slower_because(deltas)))
    return Section(
        title="Next candidates and what made each slower",
        lines=((f"{len(plan.candidates)} candidates in the table; the plan is #1 at "
               f"{fmt_seconds(est.step_time_s)}; term differences are candidate minus plan"
                + ("; the candidates are costed in Megatron-LM's tensor-parallel layout, the "
                   "plan in the ILP's" if any(info.get("replicated_sublayers")
                                             for info in plan.intra_op.values()) else "")),),
        tables=(Table(columns=("#", "config", "step", "vs plan", "peak GB", "estimate",
                               "largest term differences"), rows=tuple(rows),
                      right=frozenset({0, 2, 3, 4})),),
        after=(("'closed form' rows were ranked by the search's pipeline bound and not "
               "simulated; 'simulated' rows are comparable with the plan"),)
        if any(row[5] == "closed form" for row in rows) else ())


def overlap_rules(options: dict[str, Any]) -> tuple[str, ...]:
    """The overlap assumptions of the estimate, one line each, as the options set them."""
    dp = "hidden behind the backward of the last micro-batch; only the excess is exposed" \
        if options.get("overlap_dp_comm", True) else "not overlapped (overlap_dp_comm=False)"
    tp = "hidden behind the unit's GEMMs; only the excess is exposed" \
        if options.get("overlap_tp_comm", False) else "exposed (overlap_tp_comm=False)"
    zero3 = ("ZeRO-3 gathers and reduce-scatters: hidden behind each micro-batch's forward and "
             "backward, except the first layer's gather")
    if options.get("zero3_gather", "prefetch") == "sync":
        zero3 = ("ZeRO-3 gathers: one per parameter tensor, waited for, in every forward, "
                 "recompute and backward pass (zero3_gather='sync'); reduce-scatters hidden "
                 "behind the backward")
    return (
        f"dp gradient reduction (DDP all-reduce, ZeRO-1/2 reduce-scatter): {dp}",
        "ZeRO-1/2 parameter all-gather: hidden behind the next step's first forward",
        zero3,
        f"tp communication: {tp}",
        "cp ring exchange: overlapped with attention compute",
        "ep all-to-all: never overlapped",
        "pipeline p2p sends: asynchronous; they delay the receiving stage and occupy no rank",
    )


def _load_profile(plan: Plan):
    from autopar.cluster import Cluster

    try:
        return Cluster.from_profile(plan.cluster.profile, num_nodes=plan.cluster.num_nodes)
    except (ValueError, OSError, KeyError):
        return None


def _constants(hardware, dtype: str, options: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    arch = hardware.device.arch if hardware is not None else None
    if arch is not None:
        rows.append((f"SUSTAINED_COMPUTE_FRACTION[{arch}]",
                     f"{_compute.sustained_fraction(arch):.3g}",
                     "fitted (published runs)" if arch in _compute.SUSTAINED_COMPUTE_FRACTION
                     else "assumed (mean of fitted archs)"))
    device = hardware.device if hardware is not None else None
    if device is not None and device.gemm_half_efficiency_flops is not None:
        rows.append(("device.gemm_half_efficiency_gflop",
                     f"{device.gemm_half_efficiency_flops / 1e9:g} GFLOP", "profile"))
    else:
        rows.append(("GEMM_HALF_EFFICIENCY_FLOPS",
                     f"{_compute.GEMM_HALF_EFFICIENCY_FLOPS / 1e9:g} GFLOP",
                     "fitted (H100 matmul sweep)"))
    kernel = options.get("attention_kernel", "flash")
    if kernel == "math":
        style = options.get("kernels", "eager")
        passes = _compute.MATH_ATTENTION_SCORE_PASSES
        rows.append((f"MATH_ATTENTION_SCORE_PASSES[{style}] fwd/bwd",
                     f"{passes[(style, True, 'fwd')]:g}/{passes[(style, True, 'bwd')]:g} causal",
                     "measured (H100)" if style == "eager" else "assumed (kernel analysis)"))
    elif hardware is not None:
        known = (kernel, arch) in _compute.FUSED_ATTENTION_PEAK_FRACTION
        rows.append((f"FUSED_ATTENTION_PEAK_FRACTION[{kernel}, {arch}]",
                     f"{_compute.fused_attention_fraction(hardware.device, kernel):.3g}",
                     "measured (papers)" if known else "assumed (scaled from Ampere)"))
    if device is not None and device.op_overhead_s is not None:
        rows.append(("device.op_overhead_us", fmt_seconds(device.op_overhead_s), "profile"))
    else:
        rows.append(("KERNEL_GAP_S", fmt_seconds(_compute.KERNEL_GAP_S), "assumed"))
    rows.append(("optimizer bytes per parameter", f"{_compute.optimizer_bytes_per_param(dtype):g}",
                 "derived (AdamW, norm, copy)"))
    if arch != "cpu":
        rows.append(("OPTIMIZER_BANDWIDTH_FRACTION", f"{_compute.OPTIMIZER_BANDWIDTH_FRACTION:g}",
                     "measured (H100)"))
    rows += [("CUDA_CONTEXT_BYTES", fmt_bytes(_memory.CUDA_CONTEXT_BYTES), "assumed"),
             ("COMM_BUFFER_BYTES", fmt_bytes(_memory.COMM_BUFFER_BYTES), "assumed (DDP + NCCL)"),
             ("ALLOCATOR_RESERVE_FRACTION", f"{_memory.ALLOCATOR_RESERVE_FRACTION:g}", "assumed")]
    if arch in _nccl.NVLS_ALGBW_EFFICIENCY:
        rows.append((f"NVLS_ALGBW_EFFICIENCY[{arch}]",
                     f"{_nccl.NVLS_ALGBW_EFFICIENCY[arch]:.3g}", "fitted (nccl-tests)"))
    rows += [("ALLTOALL_FABRIC_EFFICIENCY", f"{_nccl.ALLTOALL_FABRIC_EFFICIENCY:g}",
              "fitted (nccl-tests)"),
             ("PIPELINE_RAMP_BYTES", ", ".join(f"{k}={fmt_bytes(v)}" for k, v in
                                               _nccl.PIPELINE_RAMP_BYTES.items()),
              "fitted (nccl-tests scans)"),
             ("RING_SIMPLE_MULTINODE_LATENCY_FACTOR",
              f"{_nccl.RING_SIMPLE_MULTINODE_LATENCY_FACTOR:g}", "NCCL tuning model")]
    if options.get("zero3_gather", "prefetch") == "sync":
        rows.append(("ZERO3_SYNC_GATHER_BYTES_PER_S",
                     f"{_collectives.ZERO3_SYNC_GATHER_BYTES_PER_S / 1e9:g} GB/s",
                     "measured (DeepSpeed issue #1174)"))
    return rows


def _profile_rows(cluster, dtype: str) -> list[tuple[str, str, str]]:
    hw = cluster.hardware
    sources = hw.document.get("sources", {})
    picks = [(f"device.gemm_efficiency.{dtype}", hw.device.gemm_efficiency.get(dtype)),
             ("device.memory_efficiency", hw.device.memory_efficiency),
             ("node.fabric_efficiency", hw.node.fabric_efficiency)]
    if cluster.num_nodes > 1:
        picks.append(("network.nic_efficiency", hw.network.nic_efficiency))
    return [(name, f"{value:g}", str(sources.get(name, "(no source given)")))
            for name, value in picks if value is not None]


def _assumptions(plan: Plan, cluster) -> Section:
    options = dict(plan.training.options)
    dtype = plan.training.dtype
    hardware = cluster.hardware if cluster is not None else None
    lines = [(f"profile  {plan.cluster.profile} x {plan.cluster.num_nodes} node(s), "
             f"fingerprint {plan.cluster.fingerprint}")]
    software = plan.training.software
    if software is not None:
        from autopar.estimate.software import SOFTWARE

        preset = SOFTWARE.get(software)
        lines.append(f"software {software}" + (f": {preset.description}" if preset else ""))
    else:
        lines.append("software: the options below, set one by one (no preset)")
    if cluster is None:
        lines.append("the profile is not a shipped one: its values are not shown")
    elif cluster.fingerprint() != plan.cluster.fingerprint:
        lines.append(f"the plan was made with overridden profile fields (shipped fingerprint "
                     f"{cluster.fingerprint()}); the values below are the shipped profile's")
    tables = [Table(title="software options", columns=("option", "value"),
                    rows=tuple((k, fmt_value(v)) for k, v in sorted(options.items()))),
              Table(title="cost-model constants (costmodels/compute.py, memory.py, "
                          "nccl_constants.py)", columns=("constant", "value", "basis"),
                    rows=tuple(_constants(hardware, dtype, options)))]
    if cluster is not None:
        tables.append(Table(title=f"efficiencies of profile {plan.cluster.profile}",
                            columns=("field", "value", "source"),
                            rows=tuple(_profile_rows(cluster, dtype))))
    return Section(title="Assumptions", lines=tuple(lines), tables=tuple(tables),
                   after=tuple(f"overlap: {rule}" for rule in overlap_rules(options)))


def render_report(plan: Plan, fmt: Format = "text") -> str:
    """The full report of `plan` as plain text (rich tables) or GitHub markdown (`fmt="md"`)."""
    if fmt not in ("text", "md"):
        raise ValueError(f"fmt must be 'text' or 'md', got {fmt!r}")
    cluster = _load_profile(plan)
    device = cluster.hardware.device.model if cluster is not None else None
    sections = [_overview(plan, device), _configuration(plan), _prediction(plan),
                _breakdown(plan), _memory_section(plan), _stages(plan), _placements(plan),
                _candidates(plan), _assumptions(plan, cluster)]
    return render_sections(sections, fmt, title=f"autopar plan: {plan.config.short()}")
