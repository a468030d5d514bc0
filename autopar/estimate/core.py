"""`autopar.estimate`: predicted step time, its breakdown, and memory per rank of one config.

The flow: trace the model for one micro-batch (or take a traced `Graph`), cut it into units,
time every unit on one rank (compute roofline + TP/CP/EP communication on the real rank
groups), place the layers on pipeline stages as Megatron does (blocks split evenly over
pp x virtual stages, the embedding on the first stage, the head on the last), simulate the
pipeline schedule, then add the data-parallel gradient/parameter communication that the
overlap model leaves exposed and the optimizer step. Memory per stage counts model states by
ZeRO stage, activations times the micro-batches each rank holds in flight (read off the
simulated schedule), ZeRO-3 gathered-layer buffers, communication buffers, the CUDA context and
an allocator reserve.

Overlap assumptions (named, tested): data-parallel gradient reduction overlaps the backward of
the last micro-batch; ZeRO-1/2 parameter all-gathers overlap the next step's first forward;
ZeRO-3 gathers and reduce-scatters overlap each micro-batch's forward and backward except the
first layer's gather; EP communication is not overlapped; CP ring traffic overlaps
attention compute; TP communication is exposed unless the software overlaps it. With `overlap_tp_comm` (Megatron's TP overlap) TP communication hides
behind the unit's GEMMs and only the excess is exposed.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import torch.nn as nn

from autopar.cluster import Cluster
from autopar.config import ParallelConfig, check_config
from autopar.estimate.memory import stage_memory
from autopar.estimate.stages import assign_stages
from autopar.estimate.timing import UnitTimes, rank_groups, unit_times
from autopar.estimate.units import Unit, units_from_graph
from autopar.ir import Graph, OpKind
from costmodels.compute import optimizer_time_s
from costmodels.memory import DTYPE_BYTES
from costmodels.pipeline import PipelineTimeline, simulate_pipeline

log = logging.getLogger(__name__)

__all__ = ["Estimate", "EstimateOptions", "estimate", "estimate_graph"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EstimateOptions:
    """Properties of the training software, not of the model or the hardware."""

    attention_kernel: Literal["flash", "cudnn", "flash3", "math"] = "flash"
    overlap_dp_comm: bool = True
    overlap_tp_comm: bool = False  # Megatron --tp-comm-overlap / TE userbuffers
    grad_reduce_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    # ZeRO-3 gathered-parameter buffers: None = FSDP2 per-block units (the running block and
    # the prefetched next one); a number caps them at that many parameters (DeepSpeed's
    # stage3_max_live_parameters, default 1e9)
    zero3_max_live_params: int | None = None


@dataclass(frozen=True, kw_only=True)
class Estimate:
    config: ParallelConfig
    step_time_s: float
    tokens_per_s: float
    mfu: float
    model_tflops_per_gpu: float
    peak_memory_bytes: float
    usable_memory_bytes: float
    breakdown: dict[str, float]  # exposed seconds per category; they sum to step_time_s
    memory_by_stage: tuple[dict[str, float], ...]  # bytes per category, per pipeline rank
    stage_layers: tuple[tuple[str, ...], ...]  # module paths per (virtual) stage
    num_microbatches: int
    timeline: PipelineTimeline = field(repr=False)

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.usable_memory_bytes


def _num_experts(graph: Graph) -> int | None:
    found = set()
    for node in graph.nodes:
        for p in node.params:
            m = re.search(r"experts\.(\d+)\.", p.fqn)
            if m:
                found.add(int(m.group(1)))
            elif ".experts." in p.fqn or p.fqn.endswith("experts"):
                if len(p.shape) == 3:
                    found.update(range(p.shape[0]))
    return len(found) or None


def _attention_heads(graph: Graph) -> tuple[int | None, int | None]:
    for node in graph.nodes:
        if node.kind is OpKind.ATTENTION and node.attention is not None:
            return node.attention.num_heads, node.attention.num_kv_heads
    return None, None


def _sum_times(parts: list[tuple[Unit, UnitTimes]], attr: str) -> float:
    return sum(getattr(t, attr) for _, t in parts)


def estimate_graph(graph: Graph, cluster: Cluster, config: ParallelConfig, *,
                   global_batch_size: int, dtype: str = "bf16",
                   options: EstimateOptions = EstimateOptions()) -> Estimate:
    """Estimate from a graph traced for one micro-batch (`graph.batch_size` sequences)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is unknown; allowed: {', '.join(DTYPE_BYTES)}")
    if graph.batch_size != config.micro_batch_size:
        raise ValueError(f"the graph was traced for batch {graph.batch_size} but the config's "
                         f"micro_batch_size is {config.micro_batch_size}")
    units = units_from_graph(graph)
    heads, kv_heads = _attention_heads(graph)
    num_layers = sum(u.count for u in units)
    m = check_config(config, world_size=cluster.world_size, global_batch_size=global_batch_size,
                     num_layers=num_layers, num_heads=heads, num_kv_heads=kv_heads,
                     num_experts=_num_experts(graph), seq_len=graph.seq_len)
    groups = rank_groups(config)
    flash = options.attention_kernel != "math"
    times = {u.name: unit_times(u, cluster=cluster, dtype=dtype, cfg=config, groups=groups,
                                attention_kernel=options.attention_kernel,
                                overlap_tp=options.overlap_tp_comm)
             for u in units}
    chunks = assign_stages(units, config.pp * config.virtual_stages)
    fwd = [sum(times[u.name].forward * len(f) for u, f in c) for c in chunks]
    bwd = [sum(times[u.name].backward * len(f) for u, f in c) for c in chunks]
    wgrad = [sum(times[u.name].compute_wgrad * len(f) for u, f in c) for c in chunks]
    act = max(u.act_bytes for u in units) / config.cp / config.tp
    p2p = (cluster.collective_time("send_recv", act, [0, groups.pp_next])
           if groups.pp_next is not None else 0.0)
    timeline = simulate_pipeline(
        schedule=config.pp_schedule, num_stages=config.pp, num_microbatches=m,
        virtual_stages=config.virtual_stages, forward_s=fwd, backward_s=bwd,
        weight_grad_s=wgrad if config.pp_schedule == "zero-bubble" else None, p2p_s=p2p)

    # --- data parallel and optimizer, on the pipeline rank with the most parameters --------
    per_rank = []
    for rank in range(config.pp):
        mine = [(u, len(f)) for i, c in enumerate(chunks) if i % config.pp == rank for u, f in c]
        dense = sum(u.dense_params * n for u, n in mine) / config.tp
        expert = sum(u.expert_params * n for u, n in mine) / (config.tp * config.ep)
        per_rank.append((dense, expert, mine))
    dense, expert, mine = max(per_rank, key=lambda r: r[0] + r[1])
    dp_exposed, dp_total = _dp_comm(cluster, config, groups, dense, expert, mine, times, m,
                                    dtype, options)
    shards = config.dp * config.cp
    master = (dense + expert) / (shards if config.zero_stage >= 1 else 1)
    optimizer = optimizer_time_s(cluster.hardware.device, master)

    step = timeline.step_time_s + dp_exposed + optimizer
    breakdown = _breakdown(timeline, chunks, times, config, m)
    breakdown.update(dp_comm=dp_exposed, optimizer=optimizer, dp_comm_total=dp_total,
                     pp_p2p_per_transfer=p2p)
    peak_dense = cluster.hardware.device.peak_flops.get(dtype, 0.0)
    model_flops = 3.0 * graph.flops_fwd * (global_batch_size / config.micro_batch_size)
    tokens = global_batch_size * (graph.seq_len or 1)
    memory = stage_memory(chunks, config, dtype, timeline, flash, options.zero3_max_live_params)
    peak = max(sum(v for k, v in mem.items() if not k.startswith("_")) for mem in memory)
    usable = cluster.hardware.device.memory_bytes
    return Estimate(
        config=config, step_time_s=step, tokens_per_s=tokens / step,
        mfu=model_flops / (step * cluster.world_size * peak_dense) if peak_dense else 0.0,
        model_tflops_per_gpu=model_flops / (step * cluster.world_size) / 1e12,
        peak_memory_bytes=peak, usable_memory_bytes=usable, breakdown=breakdown,
        memory_by_stage=tuple(memory),
        stage_layers=tuple(tuple(fqn for _, fqns in c for fqn in fqns) for c in chunks),
        num_microbatches=m, timeline=timeline)


def _dp_comm(cluster: Cluster, cfg: ParallelConfig, groups, dense: float, expert: float,
             mine: list[tuple[Unit, int]], times: dict[str, UnitTimes], m: int, dtype: str,
             options: EstimateOptions) -> tuple[float, float]:
    """(exposed, total) seconds of data-parallel communication per step on one rank."""
    if len(groups.dp) == 1:
        return 0.0, 0.0
    grad_b = DTYPE_BYTES[options.grad_reduce_dtype] if dtype != "fp32" else 4
    param_b = DTYPE_BYTES[dtype] if dtype != "fp8" else 2
    expert_group = groups.dp[::cfg.ep] if cfg.ep > 1 else groups.dp

    def both(kind: str, nbytes_per_param: float) -> float:
        t = cluster.collective_time(kind, dense * nbytes_per_param, groups.dp)
        if expert and len(expert_group) > 1:
            t += cluster.collective_time(kind, expert * nbytes_per_param, expert_group)
        return t

    fwd = sum(times[u.name].compute_fwd * n for u, n in mine)
    bwd = sum((times[u.name].compute_bwd + times[u.name].recompute) * n for u, n in mine)
    if cfg.zero_stage == 3:
        gather, scatter = both("all_gather", param_b), both("reduce_scatter", grad_b)
        first = max(mine, key=lambda un: un[0].dense_params)[0]
        share = (first.dense_params / cfg.tp) / max(dense, 1.0)
        exposed_mb = (max(0.0, gather - fwd) + max(0.0, gather + scatter - bwd)
                      + gather * share)
        return m * exposed_mb, m * (2 * gather + scatter)
    if cfg.zero_stage == 0:
        reduce, gather = both("all_reduce", grad_b), 0.0
    else:
        reduce, gather = both("reduce_scatter", grad_b), both("all_gather", param_b)
    if not options.overlap_dp_comm:
        return reduce + gather, reduce + gather
    per_mb_bwd = bwd
    return (max(0.0, reduce - per_mb_bwd) + max(0.0, gather - fwd), reduce + gather)


def _breakdown(timeline: PipelineTimeline, chunks, times: dict[str, UnitTimes],
               cfg: ParallelConfig, m: int) -> dict[str, float]:
    """Exposed seconds of the busiest pipeline rank; idle time is the bubble."""
    rank = max(range(cfg.pp), key=lambda r: timeline.busy_s[r])
    mine = [(u, len(f)) for i, c in enumerate(chunks) if i % cfg.pp == rank for u, f in c]

    def total(attr: str) -> float:
        return m * sum(getattr(times[u.name], attr) * n for u, n in mine)

    parts = {
        "compute": total("compute_fwd") + total("compute_bwd"),
        "recompute": total("recompute"),
        "tp_comm": total("tp_fwd") + total("tp_bwd"),
        "cp_comm": total("cp_fwd") + total("cp_bwd"),
        "ep_comm": total("ep_fwd") + total("ep_bwd"),
    }
    parts["bubble"] = max(0.0, timeline.step_time_s - sum(parts.values()))
    return parts


def estimate(model: nn.Module | Graph, cluster: Cluster, config: ParallelConfig, *,
             global_batch_size: int, seq_len: int | None = None, dtype: str = "bf16",
             example_inputs: Any = None,
             options: EstimateOptions = EstimateOptions()) -> Estimate:
    """Predict step time, breakdown and memory per rank of `config` for `model` on `cluster`.

    Token models take `global_batch_size` (sequences) and `seq_len`; other models take
    `example_inputs` for one micro-batch. `dtype` is the training precision.
    """
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be an autopar.Cluster, got {type(cluster).__name__}")
    if not isinstance(config, ParallelConfig):
        raise ValueError(f"config must be an autopar.ParallelConfig, got {type(config).__name__}")
    if isinstance(model, Graph):
        graph = model
    else:
        from autopar.trace import trace  # torch-heavy import kept off the costing path

        if example_inputs is None:
            graph = trace(model, global_batch_size=config.micro_batch_size, seq_len=seq_len,
                          dtype=dtype)
        else:
            graph = trace(model, example_inputs=example_inputs, dtype=dtype)
    return estimate_graph(graph, cluster, config, global_batch_size=global_batch_size,
                          dtype=dtype, options=options)
