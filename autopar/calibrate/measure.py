"""Measuring a cluster for `autopar calibrate`, on every rank of a torchrun job.

Start-up (`connect`): every rank checks in on the rendezvous store before the process group
starts, so a rank that never comes is named instead of waited for; the process group (gloo on
CPU, nccl on CUDA) and a gloo group for barriers take `timeout_s`; ranks must fill the nodes in
order (rank r on node r // ranks_per_node).

Collectives (`measure_collectives`): all_reduce, all_gather, reduce_scatter and all_to_all on
fp32 buffers over the groups a plan uses -- "intra" (the ranks of one node; every node's group
at once), "inter" (one rank per node; every such rail at once, as data parallelism runs them)
and "world" (all ranks, several nodes only) -- and send/recv between two ranks of a node and
of two nodes (a ping-pong, half the round trip). A size is rounded up to a whole fp32 element
per rank. Each (collective, group, size) is one item; a warm-up pass times one call of each
and sets how many back-to-back calls make a sample (about `sample_s`, the same count on every
rank); then every round times each item once, in an order shuffled anew each round (the same
on every rank, so slow spells and cache state fall on random items, not on neighbouring sizes),
after a barrier. The time of an item is the median over rounds of the slowest rank's mean call
(as benchmarks/gloo_probe.py and nccl-tests' "max over ranks").

Compute (`measure_compute`): every rank at once (the ranks of a node share what they share in
training, a CPU's cores), the median over ranks: GEMMs per dtype at transformer shapes,
a memory copy, the eager cost of a tiny op (CPU), usable memory, and fused attention (CUDA).
"""

from __future__ import annotations

import os
import random
import socket
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from autopar.calibrate.records import (AttentionPoint, CollectivePoint, CopyPoint, GemmPoint,
                                       held_out_sizes)
from autopar.errors import CalibrationError

__all__ = ["World", "Progress", "ComputeRecords", "connect", "checkpoint", "close",
           "measure_collectives", "measure_compute", "device_name", "COLLECTIVE_KINDS",
           "gemm_shapes"]

Progress = Callable[[str, int, int], None]  # (phase, done, total), called on rank 0
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
_MAX_CALLS = 100  # back-to-back calls in one sample at most


@dataclass(frozen=True, kw_only=True, slots=True)
class World:
    rank: int
    world_size: int
    ranks_per_node: int
    num_nodes: int
    backend: str  # "gloo" or "nccl"
    device: torch.device
    store: Any  # the rendezvous store (torch.distributed.Store), keys under our prefix
    control: Any  # a gloo ProcessGroup for barriers and gathers
    timeout_s: float

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    if not value.isdigit():
        raise CalibrationError(
            f"environment variable {name} is {'missing' if not value else repr(value)}: "
            f"autopar calibrate runs under torchrun, e.g. torchrun --nproc_per_node 8 -m "
            f"autopar calibrate --base dgx-h100 -o mine.toml")
    return int(value)


def connect(timeout_s: float) -> World:
    """Join the job torchrun started: check in, start the process groups, check the layout."""
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    per_node = _env_int("LOCAL_WORLD_SIZE")
    if world_size % per_node:
        raise CalibrationError(f"{world_size} ranks do not fill nodes of {per_node}: start the "
                               f"same --nproc_per_node on every node")
    timeout = timedelta(seconds=timeout_s)
    store = _store(rank, world_size, timeout)
    _check_in(store, rank, world_size, timeout_s)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", _env_int("LOCAL_RANK")) if backend == "nccl" else \
        torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world_size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else \
        dist.group.WORLD
    world = World(rank=rank, world_size=world_size, ranks_per_node=per_node,
                  num_nodes=world_size // per_node, backend=backend, device=device, store=store,
                  control=control, timeout_s=timeout_s)
    _check_nodes(world)
    return world


def _store(rank: int, world_size: int, timeout: timedelta) -> Any:
    """The rendezvous TCP store (torchrun's agent hosts it; without the agent, rank 0 does),
    without waiting for the other ranks here: `_check_in` waits and names the missing."""
    host, port = os.environ.get("MASTER_ADDR", ""), _env_int("MASTER_PORT")
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0 and not agent,
                              timeout=timeout, wait_for_workers=False, multi_tenant=not agent)
    except (RuntimeError, ValueError) as err:
        raise CalibrationError(
            f"rank {rank}: cannot reach the rendezvous store at {host}:{port} within "
            f"{timeout.total_seconds():g} s ({_first_line(err)}); check --rdzv_endpoint / "
            f"--master_addr and that the first node started") from None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"autopar-calibrate/{attempt}", store)


def _check_in(store: Any, rank: int, world_size: int, timeout_s: float) -> None:
    store.set(f"joined/{rank}", socket.gethostname())
    keys = [f"joined/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError:
        missing = [r for r in range(world_size) if not store.check([f"joined/{r}"])]
        raise CalibrationError(
            f"rank {rank}: rank(s) {', '.join(map(str, missing))} of {world_size} did not join "
            f"within {timeout_s:g} s; check that every node started torchrun with the same "
            f"--nnodes and --nproc_per_node and that those processes are alive, or raise "
            f"--timeout") from None


def _check_nodes(world: World) -> None:
    hosts: list[Any] = [None] * world.world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=world.control)
    g = world.ranks_per_node
    for node in range(world.num_nodes):
        mine = set(hosts[node * g:(node + 1) * g])
        if len(mine) != 1:
            raise CalibrationError(
                f"ranks {node * g}-{(node + 1) * g - 1} should share node {node} but run on "
                f"{', '.join(sorted(mine))}: the profile puts rank r on node r // "
                f"{g}; use torchrun's static rendezvous (--node_rank) so ranks fill nodes in "
                f"order")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def checkpoint(world: World, what: str) -> None:
    """A barrier that names the ranks that do not reach it within the timeout."""
    try:
        dist.monitored_barrier(world.control, timeout=timedelta(seconds=world.timeout_s),
                               wait_all_ranks=True)
    except RuntimeError as err:
        raise CalibrationError(f"rank {world.rank}: not every rank reached {what} within "
                               f"{world.timeout_s:g} s: {_first_line(err)}") from None


def close(world: World) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# -- collectives ------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class _Group:
    name: str  # "intra", "inter", "world"
    ranks: tuple[int, ...]  # the group holding rank 0: what the records cost
    members: tuple[int, ...]  # this rank's group (every rank is in one)
    pg: Any


@dataclass(frozen=True, kw_only=True, slots=True)
class _Item:
    kind: str
    group: _Group
    size: int  # the grid's size
    nbytes: int  # rounded up to whole fp32 elements per rank


def _groups(world: World) -> list[_Group]:
    g, nodes = world.ranks_per_node, world.num_nodes
    layouts = []
    if g > 1:
        layouts.append(("intra", [list(range(n * g, (n + 1) * g)) for n in range(nodes)]))
    if nodes > 1:
        layouts.append(("inter", [[i + n * g for n in range(nodes)] for i in range(g)]))
        if g > 1:
            layouts.append(("world", [list(range(world.world_size))]))
    groups = []
    for name, lists in layouts:
        if len(lists) == 1:
            pg = dist.group.WORLD
        else:
            pg, _ = dist.new_subgroups_by_enumeration(lists)
        mine = next(tuple(r) for r in lists if world.rank in r)
        groups.append(_Group(name=name, ranks=tuple(lists[0]), members=mine, pg=pg))
    return groups


def _pairs(world: World) -> list[_Group]:
    """send/recv pairs: the first two ranks of node 0, and rank 0 with node 1's first."""
    g = world.ranks_per_node
    pairs = []
    if g > 1:
        pairs.append(_Group(name="intra", ranks=(0, 1), members=(0, 1), pg=None))
    if world.num_nodes > 1:
        pairs.append(_Group(name="inter", ranks=(0, g), members=(0, g), pg=None))
    return pairs


def _items(world: World, sizes: Sequence[int]) -> list[_Item]:
    groups, pairs, items = _groups(world), _pairs(world), []
    for kind in COLLECTIVE_KINDS:
        for group in pairs if kind == "send_recv" else groups:
            n = len(group.ranks)
            for size in sizes:
                count = -(-size // (4 * n)) * n  # whole fp32 elements, a multiple of n
                items.append(_Item(kind=kind, group=group, size=size, nbytes=4 * count))
    return items


def _call(world: World, item: _Item, inp: torch.Tensor, out: torch.Tensor
          ) -> Callable[[], None] | None:
    """One call of the item's collective on this rank (None: this rank takes no part)."""
    if world.rank not in item.group.members:
        return None
    count, n, pg = item.nbytes // 4, len(item.group.members), item.group.pg
    if item.kind == "all_reduce":
        buf = inp[:count]
        return lambda: dist.all_reduce(buf, group=pg)
    if item.kind == "all_gather":
        o, i = out[:count], inp[:count // n]
        return lambda: dist.all_gather_single(o, i, group=pg)
    if item.kind == "reduce_scatter":
        o, i = out[:count // n], inp[:count]
        return lambda: dist.reduce_scatter_single(o, i, group=pg)
    if item.kind == "all_to_all":
        o, i = out[:count], inp[:count]
        return lambda: dist.all_to_all_single(o, i, group=pg)
    first, second = item.group.members
    buf = inp[:count]
    if world.rank == first:
        def ping_pong() -> None:
            dist.send(buf, second)
            dist.recv(buf, second)
        return ping_pong

    def pong_ping() -> None:
        dist.recv(buf, first)
        dist.send(buf, first)
    return pong_ping


def _sample_s(world: World, item: _Item, fn: Callable[[], None], calls: int) -> float:
    """Mean seconds of one call over `calls` back-to-back calls (a send/recv: half a round
    trip), after one untimed call that lines the ranks up after the barrier."""
    fn()
    world.sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    world.sync()
    mean = (time.perf_counter() - start) / calls
    return mean / 2 if item.kind == "send_recv" else mean


def _report_progress(world: World, step: int) -> None:
    world.store.set(f"progress/{world.rank}", str(step))


def _stalled(world: World, step: int) -> str:
    """Which ranks last reported a step before `step` (stopped, crashed or hung)."""
    behind = []
    for r in range(world.world_size):
        key = f"progress/{r}"
        if r != world.rank and (not world.store.check([key])
                                or int(world.store.get(key).decode()) < step):
            behind.append(r)
    if not behind:
        return "every rank had reached this step"
    return f"rank(s) {', '.join(map(str, behind))} never reached this step"


def _run_item(world: World, item: _Item, fn: Callable[[], None], calls: int, step: int
              ) -> float:
    try:
        return _sample_s(world, item, fn, calls)
    except RuntimeError as err:
        raise CalibrationError(
            f"rank {world.rank}: {item.kind} of {item.nbytes} B over ranks "
            f"{list(item.group.members)} failed: {_first_line(err)}; "
            f"{_stalled(world, step)}. Check those processes or nodes (crashed, hung or "
            f"unreachable); raise --timeout if they are only slow") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """How long each collective item is timed: samples of back-to-back calls lasting about
    `sample_s`, as many rounds as fit `item_s` within [min_rounds, max_rounds], spread evenly
    over the run's rounds."""

    sample_s: float
    item_s: float
    min_rounds: int
    max_rounds: int


QUICK = Schedule(sample_s=0.005, item_s=0.25, min_rounds=5, max_rounds=31)
FULL = Schedule(sample_s=0.01, item_s=1.0, min_rounds=7, max_rounds=61)


def measure_collectives(world: World, sizes: Sequence[int], *, schedule: Schedule, seed: int,
                        progress: Progress) -> list[CollectivePoint]:
    """Time every (collective, group, size); rank 0 gets the records, other ranks []."""
    items = _items(world, sizes)
    samples = _timed_rounds(world, items, schedule=schedule, seed=seed, progress=progress)
    if world.rank != 0:
        return []
    held = held_out_sizes(list(sizes))
    return [CollectivePoint(kind=item.kind, group=item.group.name, ranks=item.group.ranks,
                            nbytes=item.nbytes, time_s=statistics.median(samples[j]),
                            held_out=item.size in held)
            for j, item in enumerate(items)]


def _plan_rounds(once: Sequence[float], schedule: Schedule) -> tuple[list[int], list[set[int]]]:
    """(calls per sample, the rounds that time it) per item, from one call's time."""
    calls = [max(1, min(_MAX_CALLS, int(schedule.sample_s / max(t, 1e-9)))) for t in once]
    counts = [max(schedule.min_rounds, min(schedule.max_rounds,
                                           int(schedule.item_s / max(c * t, 1e-9))))
              for c, t in zip(calls, once)]
    total = max(counts)
    return calls, [{i * total // n for i in range(n)} for n in counts]


def _timed_rounds(world: World, items: Sequence[_Item], *, schedule: Schedule, seed: int,
                  progress: Progress) -> list[list[float]]:
    """Per item, the slowest rank's mean call in each round that timed it (see the module
    docstring)."""
    largest = max(item.nbytes for item in items) // 4
    inp = torch.zeros(largest, device=world.device)
    out = torch.zeros(largest, device=world.device)
    calls_fn = [_call(world, item, inp, out) for item in items]
    once = torch.zeros(len(items), dtype=torch.float64)
    checkpoint(world, "the collectives' warm-up")
    for j, (item, fn) in enumerate(zip(items, calls_fn)):
        dist.barrier(group=world.control)
        _report_progress(world, j)
        if fn is not None:  # the untimed call sets up connections and communicators
            once[j] = _run_item(world, item, fn, 1, j)
        _tick(world, progress, "collectives (warm-up)", j + 1, len(items))
    dist.all_reduce(once, op=dist.ReduceOp.MAX, group=world.control)
    calls, timed_in = _plan_rounds(once.tolist(), schedule)
    rounds = max(max(r) for r in timed_in) + 1
    samples = torch.zeros(len(items), rounds, dtype=torch.float64)
    total, step = sum(map(len, timed_in)), 0
    for r in range(rounds):
        checkpoint(world, f"round {r + 1} of the collectives")
        order = [j for j in range(len(items)) if r in timed_in[j]]
        random.Random(seed * 100_003 + r).shuffle(order)
        for j in order:
            dist.barrier(group=world.control)
            _report_progress(world, len(items) + step)
            if calls_fn[j] is not None:
                samples[j, r] = _run_item(world, items[j], calls_fn[j], calls[j],
                                          len(items) + step)
            step += 1
            _tick(world, progress, "collectives", step, total)
    dist.all_reduce(samples, op=dist.ReduceOp.MAX, group=world.control)
    table = samples.tolist()
    return [[table[j][r] for r in sorted(timed_in[j])] for j in range(len(items))]


def _tick(world: World, progress: Progress, phase: str, done: int, total: int) -> None:
    if world.rank == 0:
        progress(phase, done, total)


# -- compute ----------------------------------------------------------------------------------

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


def _gemm_times(world: World, dtypes: Sequence[str], quick: bool, progress: Progress
                ) -> list[tuple[str, int, int, int, float]]:
    shapes = gemm_shapes(world.device.type, quick)
    rows, done = [], 0
    for dtype in dtypes:
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        for m, k, n in shapes:
            a = torch.randn(m, k, device=world.device).to(_TORCH_DTYPES[dtype])
            b = torch.randn(k, n, device=world.device).to(_TORCH_DTYPES[dtype])
            dist.barrier(group=world.control)
            t = _median_time_s(world, lambda: torch.matmul(a, b), reps=3, sample_s=0.02)
            rows.append((dtype, m, k, n, t))
            done += 1
            _tick(world, progress, "compute", done, len(dtypes) * len(shapes) + 3)
    torch.backends.cuda.matmul.allow_tf32 = False
    return rows


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
    free, total = torch.cuda.mem_get_info(world.device)
    try:
        while len(blocks) * block < free:
            blocks.append(torch.empty(block, dtype=torch.uint8, device=world.device))
    except torch.cuda.OutOfMemoryError:
        pass
    usable = len(blocks) * block + torch.cuda.memory_allocated(world.device)
    del blocks
    torch.cuda.empty_cache()
    return usable, (f"allocated in 256 MiB blocks until the allocator refused, of "
                    f"{total / 1e9:.2f} GB on the device")


def _attention_times(world: World) -> list[tuple[int, int, int, int, bool, float]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for batch, seq in ((4, 2048), (1, 8192)):
        q, k, v = (torch.randn(batch, 16, seq, 128, device=world.device, dtype=torch.bfloat16)
                   for _ in range(3))
        dist.barrier(group=world.control)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            t = _median_time_s(world, lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True), reps=5, sample_s=0.02)
        rows.append((batch, 16, seq, 128, True, t))
    return rows


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
    gemms = _gemm_times(world, measurable, quick, progress)
    copy_bytes = (1 << 30) if world.device.type == "cuda" else ((64 << 20) if quick else 256 << 20)
    copy_s = _copy_time_s(world, copy_bytes)
    overhead = _op_overhead_s() if world.device.type == "cpu" else None
    attention = _attention_times(world) if world.device.type == "cuda" else []
    if world.device.type != "cuda":
        notes.append("attention not measured on CPU (no fused kernel; the profile has no "
                     "field for it)")
    mine = (gemms, copy_s, overhead, attention, memory)
    gathered: list[Any] = [None] * world.world_size
    dist.all_gather_object(gathered, mine, group=world.control)
    _tick(world, progress, "compute", 1, 1)
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
