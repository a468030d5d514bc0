"""Timing compute for `autopar calibrate` on every rank at once (the ranks of a node share what
they share in training, a CPU's cores), the median over ranks: GEMMs per dtype at transformer
shapes (`gemm_shapes`), a memory copy, the eager cost of a tiny op (CPU), usable memory (CUDA:
what the allocator hands out after the context and communicators; CPU: the host's RAM over the
node's ranks) and fused flash attention (CUDA).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from autopar.calibrate.measure import Progress, World, checkpoint, tick
from autopar.calibrate.records import AttentionPoint, CopyPoint, GemmPoint

__all__ = ["ComputeRecords", "measure_compute", "gemm_shapes", "device_name"]


_TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
                 "bf16": torch.bfloat16}


def gemm_shapes(device_type: str, quick: bool) -> list[tuple[int, int, int]]:
    """(m, k, n) of a transformer layer's GEMMs -- q/k/v, attention output, MLP up and down
    -- at `tokens` rows for a few hidden sizes, plus the MLP's up projection at a few rows
    (decode-like), where GEMMs run below their large-size rate."""
    if device_type == "cuda":
        hidden, tokens, few = ((1024, 8192) if quick else (1024, 4096, 8192)), 4096, 256
    else:
        hidden, tokens, few = ((256, 512) if quick else (256, 1024, 2048)), 1024, 16
    shapes = set()
    for h in hidden:
        shapes |= {(tokens, h, 3 * h), (tokens, h, h), (tokens, h, 4 * h), (tokens, 4 * h, h),
                   (few, h, 4 * h)}
    return sorted(shapes)


def _median_time_s(world: World, fn: Callable[[], Any], *, reps: int, sample_s: float) -> float:
    fn()
    world.sync()
    start = time.perf_counter()
    fn()
    world.sync()
    calls = max(1, min(1000, int(sample_s / max(time.perf_counter() - start, 1e-9))))
    times = []
    for _ in range(reps):
        world.sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        world.sync()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


# --quick times a dtype's GEMMs up to the shape whose call the rate measured so far says
# would take longer than this (16-bit GEMMs emulated on a CPU run ~100x slower than fp32)
QUICK_GEMM_CALL_S = 0.5


def _gemm_times(world: World, dtypes: Sequence[str], quick: bool, progress: Progress
                ) -> tuple[list[tuple[str, int, int, int, float]], list[str]]:
    """(dtype, m, k, n, seconds) per GEMM timed, smallest first, and notes. With `quick`, a
    dtype stops at the first shape its best rate so far says would take longer than
    QUICK_GEMM_CALL_S a call on the slowest rank (at least two shapes timed; the ranks decide
    together, so they time the same shapes)."""
    shapes = sorted(gemm_shapes(world.device.type, quick), key=lambda s: (s[0] * s[1] * s[2], s))
    rows, notes, done = [], [], 0
    for dtype in dtypes:
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        for i, (m, k, n) in enumerate(shapes):
            if quick and i >= 2:
                rate = max(2.0 * a * b * c / t for d, a, b, c, t in rows if d == dtype)
                slow = torch.tensor([2.0 * m * k * n / rate])
                dist.all_reduce(slow, op=dist.ReduceOp.MAX, group=world.control)
                if float(slow) > QUICK_GEMM_CALL_S:
                    notes.append(f"{dtype} GEMMs from {m}x{k}x{n} up not timed (--quick: a "
                                 f"call would take about {float(slow):.1f} s)")
                    break
            a = torch.randn(m, k, device=world.device).to(_TORCH_DTYPES[dtype])
            b = torch.randn(k, n, device=world.device).to(_TORCH_DTYPES[dtype])
            dist.barrier(group=world.control)
            t = _median_time_s(world, lambda: torch.matmul(a, b), reps=3, sample_s=0.02)
            rows.append((dtype, m, k, n, t))
            done += 1
            tick(world, progress, "compute", done, len(dtypes) * len(shapes) + 3)
    torch.backends.cuda.matmul.allow_tf32 = False
    return rows, notes


def _copy_time_s(world: World, nbytes: int) -> float:
    src = torch.ones(nbytes // 4, device=world.device)
    dst = torch.empty_like(src)
    dist.barrier(group=world.control)
    return _median_time_s(world, lambda: dst.copy_(src), reps=5, sample_s=0.05)


def _op_overhead_s() -> float:
    """Eager forward cost of one tiny autograd op: a chain of 200 one-element multiplies,
    median of 7 (as benchmarks/gloo_probe.py measures the cpu-gloo figure)."""
    times = []
    for _ in range(8):
        x = torch.ones(1, requires_grad=True)
        start = time.perf_counter()
        y = x
        for _ in range(200):
            y = y * 1.0001
        times.append((time.perf_counter() - start) / 200)
    return statistics.median(times[1:])


def _usable_memory(world: World) -> tuple[float, str]:
    """Usable memory of one device: on CUDA what the allocator can hand out after the CUDA
    context and the communicators took theirs (allocated in 256 MiB blocks until it fails);
    on CPU the host's RAM over the ranks of this node."""
    if world.device.type != "cuda":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return ram / world.ranks_per_node, (f"host RAM {ram / 1e9:.2f} GB (sysconf) over the "
                                            f"{world.ranks_per_node} ranks of a node")
    block, blocks = 256 << 20, []
    torch.cuda.empty_cache()  # the collectives' buffers, cached: usable too
    free, total = torch.cuda.mem_get_info(world.device)
    try:
        while len(blocks) * block < free:
            blocks.append(torch.empty(block, dtype=torch.uint8, device=world.device))
    except torch.cuda.OutOfMemoryError:
        pass
    usable = torch.cuda.memory_allocated(world.device)  # the blocks and what was held before
    del blocks
    torch.cuda.empty_cache()
    return usable, (f"allocated in 256 MiB blocks until the allocator refused, of "
                    f"{total / 1e9:.2f} GB on the device")


def _attention_times(world: World) -> tuple[list[tuple[int, int, int, int, bool, float]],
                                             str | None]:
    """Causal bf16 flash attention forward at two shapes (16 heads of 128), or why not."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for batch, seq in ((4, 2048), (1, 8192)):
        q, k, v = (torch.randn(batch, 16, seq, 128, device=world.device, dtype=torch.bfloat16)
                   for _ in range(3))
        dist.barrier(group=world.control)
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                t = _median_time_s(world, lambda: torch.nn.functional.
                                   scaled_dot_product_attention(q, k, v, is_causal=True),
                                   reps=5, sample_s=0.02)
        except RuntimeError as err:  # no flash kernel for this device
            return [], f"flash attention not measured: {str(err).splitlines()[0][:120]}"
        rows.append((batch, 16, seq, 128, True, t))
    return rows, None


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeRecords:
    gemms: tuple[GemmPoint, ...]
    copies: tuple[CopyPoint, ...]
    attention: tuple[AttentionPoint, ...]
    memory_bytes: float
    memory_how: str
    op_overhead_s: float | None
    notes: tuple[str, ...]


def measure_compute(world: World, dtypes: Sequence[str], *, quick: bool, progress: Progress
                    ) -> ComputeRecords | None:
    """Time compute on every rank at once; rank 0 gets the medians over ranks, others None."""
    checkpoint(world, "the compute measurements")
    notes = []
    measurable = [d for d in dtypes if d in _TORCH_DTYPES
                  and (d != "tf32" or world.device.type == "cuda")]
    notes += [f"{d} GEMMs not measured (kept from the base profile)" for d in dtypes
              if d not in measurable]
    memory, memory_how = _usable_memory(world)
    gemms, skipped = _gemm_times(world, measurable, quick, progress)
    notes += skipped
    copy_bytes = (1 << 30) if world.device.type == "cuda" else ((64 << 20) if quick else 256 << 20)
    copy_s = _copy_time_s(world, copy_bytes)
    overhead = _op_overhead_s() if world.device.type == "cpu" else None
    attention, why = _attention_times(world) if world.device.type == "cuda" else \
        ([], "attention not measured on CPU (no fused kernel to time)")
    if why:
        notes.append(why)
    mine = (gemms, copy_s, overhead, attention, memory)
    gathered: list[Any] = [None] * world.world_size
    dist.all_gather_object(gathered, mine, group=world.control)
    tick(world, progress, "compute", 1, 1)
    if world.rank != 0:
        return None

    def median_of(get: Callable[[Any], float]) -> float:
        return statistics.median(get(g) for g in gathered)

    return ComputeRecords(
        gemms=tuple(GemmPoint(dtype=d, m=m, k=k, n=n, time_s=median_of(lambda g: g[0][i][4]))
                    for i, (d, m, k, n, _) in enumerate(gemms)),
        copies=(CopyPoint(nbytes=copy_bytes, time_s=median_of(lambda g: g[1])),),
        attention=tuple(AttentionPoint(batch=b, heads=h, seq_len=s, head_dim=d, causal=c,
                                       time_s=median_of(lambda g: g[3][i][5]))
                        for i, (b, h, s, d, c, _) in enumerate(attention)),
        memory_bytes=min(g[4] for g in gathered), memory_how=memory_how,
        op_overhead_s=median_of(lambda g: g[2]) if overhead is not None else None,
        notes=tuple(notes))


def device_name(world: World) -> str:
    if world.device.type == "cuda":
        return torch.cuda.get_device_name(world.device)
    model = "CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            model = next((line.split(":", 1)[1].strip() for line in info
                          if line.startswith("model name")), model)
    except OSError:
        pass
    threads = torch.get_num_threads()
    return f"{model}, {threads} thread{'s' if threads > 1 else ''} per rank"
