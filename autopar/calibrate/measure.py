"""Timing collectives for `autopar calibrate`, on every rank of a torchrun job (compute is
`autopar.calibrate.compute`).

Start-up (`connect`): every rank checks in on the rendezvous store before the process group
starts, so a rank that never comes is named instead of waited for; the process group (gloo on
CPU, nccl on CUDA) and a gloo group for barriers take `timeout_s`; ranks must fill the nodes in
order (rank r on node r // ranks_per_node).

Collectives (`measure_collectives`): all_reduce, all_gather, reduce_scatter and all_to_all on
fp32 buffers over the groups a plan uses -- "intra" (the ranks of one node; every node's group
at once), "inter" (one rank per node; every such rail at once, as data parallelism runs them)
and "world" (all ranks, several nodes only) -- and send/recv between two ranks of a node and
of two nodes (a ping-pong, half the round trip). A size is rounded up to whole fp32 elements
per rank, at least `_MIN_ELEMENTS`: with one element per rank gloo's all-reduce and
reduce-scatter run a shorter path than at any larger size (4 ranks: 16 B in 1-3 ms, 32-512 B
in 4-7 ms), which would pull the fitted latency below every size a plan sends. Each
(collective, group, size) is one item. A warm-up pass times one call of each (after an
untimed one that sets up connections and communicators); from it each item gets the
back-to-back calls that make a sample of about `Schedule.sample_s` (at most `_MAX_CALLS`, the
same count on every rank) and the rounds that fit its time budget `Schedule.item_s` (within
`min_rounds` .. `max_rounds`, spread evenly over the run). Every round times its items once,
each after a barrier (and, for calls under `_LEAD_IN_S`, after one untimed call that lines the
ranks up), in an order shuffled anew each round and the same on every rank, so slow spells
and cache state fall on random items rather than on neighbouring sizes. The time of an item is
the median over its rounds of the slowest rank's mean call (benchmarks/gloo_probe.py's and
nccl-tests' "max over ranks"); its relative standard error (`median_rse`) is kept with it: on
a host whose ranks outnumber its cores a small message waits on the scheduler, and the error
says how far a repeat may land.
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

from autopar.calibrate.records import CollectivePoint, held_out_sizes, median_rse
from autopar.errors import CalibrationError

__all__ = ["World", "Progress", "Schedule", "QUICK", "FULL", "connect", "checkpoint", "close",
           "tick", "measure_collectives", "COLLECTIVE_KINDS"]

Progress = Callable[[str, int, int], None]  # (phase, done, total), called on rank 0
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
_MAX_CALLS = 10  # back-to-back calls in one sample at most
_LEAD_IN_S = 0.01  # calls shorter than this are timed after an untimed one
_MIN_ELEMENTS = 2  # fp32 elements per rank in the smallest buffer


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
                count = max(_MIN_ELEMENTS, -(-size // (4 * n))) * n
                if items and (items[-1].kind, items[-1].group, items[-1].nbytes) == \
                        (kind, group, 4 * count):
                    continue  # a smaller grid size rounded up to this one already
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


def _sample_s(world: World, item: _Item, fn: Callable[[], None], calls: int,
              lead_in: bool) -> float:
    """Mean seconds of one call over `calls` back-to-back calls (a send/recv: half a round
    trip); with `lead_in`, after one untimed call that lines the ranks up after the barrier
    (short calls, which the ranks' skew leaving the barrier would distort)."""
    if lead_in:
        fn()
    world.sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    world.sync()
    mean = (time.perf_counter() - start) / calls
    return mean / 2 if item.kind == "send_recv" else mean


_CHECK = "Check those processes or nodes; raise --timeout if they are only slow"
_REPORT_WAIT_S = 0.25  # how long a failing rank waits for the others to report failing too


def _silent_ranks(world: World) -> str:
    """Report this rank's failure on the store and name the ranks that do not report one
    within `_REPORT_WAIT_S`: a peer that hangs never does, while the others time out together.
    (A peer that dies is named by torchrun, which stops the others at once.)"""
    world.store.set(f"failed/{world.rank}", socket.gethostname())
    deadline = time.monotonic() + _REPORT_WAIT_S
    while True:
        silent = [r for r in range(world.world_size)
                  if not world.store.check([f"failed/{r}"])]
        if not silent or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not silent:
        return "every rank saw it fail"
    return (f"rank(s) {', '.join(map(str, silent))} did not report the failure within "
            f"{_REPORT_WAIT_S:g} s: they stopped, crashed, hang or cannot be reached")


def _barrier(world: World) -> None:
    try:
        dist.barrier(group=world.control)
    except RuntimeError as err:
        raise CalibrationError(f"rank {world.rank}: a barrier between measurements failed: "
                               f"{_first_line(err)}; {_silent_ranks(world)}. {_CHECK}") from None


def _run_item(world: World, item: _Item, fn: Callable[[], None], calls: int,
              lead_in: bool = True) -> float:
    try:
        return _sample_s(world, item, fn, calls, lead_in)
    except RuntimeError as err:
        raise CalibrationError(
            f"rank {world.rank}: {item.kind} of {item.nbytes} B over ranks "
            f"{list(item.group.members)} failed: {_first_line(err)}; {_silent_ranks(world)}. "
            f"{_CHECK}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """How long each collective item is timed: samples of back-to-back calls lasting about
    `sample_s`, as many rounds as fit `item_s` within [min_rounds, max_rounds], spread evenly
    over the run's rounds."""

    sample_s: float
    item_s: float
    min_rounds: int
    max_rounds: int


QUICK = Schedule(sample_s=0.03, item_s=0.9, min_rounds=7, max_rounds=31)
FULL = Schedule(sample_s=0.05, item_s=2.0, min_rounds=7, max_rounds=41)


def measure_collectives(world: World, sizes: Sequence[int], *, schedule: Schedule, seed: int,
                        progress: Progress) -> list[CollectivePoint]:
    """Time every (collective, group, size); rank 0 gets the records, other ranks []."""
    items = _items(world, sizes)
    if not items:  # one rank: no group to time
        return []
    samples = _timed_rounds(world, items, schedule=schedule, seed=seed, progress=progress)
    if world.rank != 0:
        return []
    held = held_out_sizes(list(sizes))
    return [CollectivePoint(kind=item.kind, group=item.group.name, ranks=item.group.ranks,
                            nbytes=item.nbytes, time_s=statistics.median(samples[j]),
                            held_out=item.size in held, rse=median_rse(samples[j]))
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
        _barrier(world)
        if fn is not None:  # the untimed call sets up connections and communicators
            once[j] = _run_item(world, item, fn, 1)
        tick(world, progress, "collectives (warm-up)", j + 1, len(items))
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
            _barrier(world)
            if calls_fn[j] is not None:
                samples[j, r] = _run_item(world, items[j], calls_fn[j], calls[j],
                                          lead_in=once[j] < _LEAD_IN_S)
            step += 1
            tick(world, progress, "collectives", step, total)
    dist.all_reduce(samples, op=dist.ReduceOp.MAX, group=world.control)
    table = samples.tolist()
    return [[table[j][r] for r in sorted(timed_in[j])] for j in range(len(items))]


def tick(world: World, progress: Progress, phase: str, done: int, total: int) -> None:
    if world.rank == 0:
        progress(phase, done, total)
