"""Memory of each pipeline rank: model states, activations in flight, buffers, reserve.

Activations per micro-batch come from the traced graph's saved bytes (all of them, the
selective-recompute remainder, or only each layer's input under full recompute plus one
layer's working set), sharded over tp x cp for what GEMMs and attention keep and over cp (and
tp only with sequence parallelism) for what norms and elementwise ops keep. The number held at
once is read off the simulated schedule: a (stage, micro-batch) pair holds its activations from
its forward until its last backward op (B, or W for zero-bubble).
"""

from __future__ import annotations

from autopar.config import ParallelConfig
from autopar.estimate.stages import Chunk
from autopar.estimate.units import Unit
from costmodels.memory import (ALLOCATOR_RESERVE_FRACTION, COMM_BUFFER_BYTES,
                               CUDA_CONTEXT_BYTES, state_bytes_per_param)
from costmodels.pipeline import PipelineTimeline

__all__ = ["stage_memory", "activation_bytes"]


def activation_bytes(unit: Unit, cfg: ParallelConfig, flash: bool) -> tuple[float, float]:
    """(kept per layer per micro-batch, working set of one layer while it runs) on one rank.

    A fused attention node keeps no score matrix; with an unfused kernel (`flash` False) the
    scores it would keep are added. Selective recompute drops the score-sized tensors.
    """
    tp, cp = cfg.tp, cfg.cp
    mem_split = cp * (tp if cfg.sequence_parallel else 1)
    scores = 0.0 if flash else unit.attention_score_bytes / (tp * cp)
    full = (unit.saved_bytes - unit.saved_bytes_memory_ops) / (tp * cp) \
        + unit.saved_bytes_memory_ops / mem_split + scores
    if cfg.recompute == "full":
        return unit.act_bytes / mem_split, full
    if cfg.recompute == "selective":
        dropped = (unit.saved_bytes - unit.saved_bytes_recompute) / (tp * cp) + scores
        return max(0.0, full - dropped), 0.0
    return full, 0.0


def _peak_inflight_bytes(timeline: PipelineTimeline, rank: int, per_stage: dict[int, float]
                         ) -> float:
    last_use: dict[tuple[int, int], float] = {}
    for op in timeline.ops[rank]:
        if op.kind.value != "F":
            key = (op.stage, op.microbatch)
            last_use[key] = max(last_use.get(key, 0.0), op.end_s)
    events = []
    for op in timeline.ops[rank]:
        if op.kind.value == "F":
            size = per_stage[op.stage]
            events.append((op.start_s, 1, size))
            events.append((last_use[(op.stage, op.microbatch)], 0, -size))
    live = peak = 0.0
    for _, _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak


def stage_memory(chunks: list[Chunk], cfg: ParallelConfig, dtype: str,
                 timeline: PipelineTimeline, flash: bool,
                 zero3_max_live_params: int | None = None) -> list[dict[str, float]]:
    per_stage = {}
    working = {}
    for s, chunk in enumerate(chunks):
        kept = [(activation_bytes(u, cfg, flash), len(f)) for u, f in chunk]
        per_stage[s] = sum(k * n for (k, _), n in kept)
        working[s] = max((w for (_, w), _ in kept), default=0.0)
    shards = cfg.dp * cfg.cp
    out = []
    for rank in range(cfg.pp):
        mine = [(u, len(f)) for s, c in enumerate(chunks) if s % cfg.pp == rank for u, f in c]
        dense = sum(u.dense_params * n for u, n in mine) / cfg.tp
        expert = sum(u.expert_params * n for u, n in mine) / (cfg.tp * cfg.ep)
        states = dense * state_bytes_per_param(dtype, cfg.zero_stage, shards) + \
            expert * state_bytes_per_param(dtype, cfg.zero_stage, max(1, shards // cfg.ep))
        activations = _peak_inflight_bytes(timeline, rank, per_stage) + max(
            working[s] for s in range(len(chunks)) if s % cfg.pp == rank)
        gathered = 0.0
        if cfg.zero_stage == 3:  # the running unit and the prefetched next one, unsharded
            gathered = 2 * max(u.param_bytes for u, _ in mine) / cfg.tp
            if zero3_max_live_params is not None:
                per_param = max(u.param_bytes / max(1, u.dense_params + u.expert_params)
                                for u, _ in mine)
                gathered = min(gathered, zero3_max_live_params * per_param)
        mem = {"states": states, "activations": activations, "zero3_buffers": gathered,
               "comm_buffers": float(COMM_BUFFER_BYTES), "cuda_context": CUDA_CONTEXT_BYTES}
        mem["allocator_reserve"] = ALLOCATOR_RESERVE_FRACTION * (states + activations + gathered)
        mem["_params"] = dense + expert
        out.append(mem)
    return out
