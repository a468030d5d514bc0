"""Pipeline stages and schedules from a plan, on ``torch.distributed.pipelining``, for any model
whose repeated blocks sit in a block list (``structure.block_slots``: ``layers``,
``transformer.h``, ``model.layers``, ``blocks``, at any depth).

``plan.stages`` lists, per (virtual) stage in order, the blocks it owns by module path
(``transformer.h.3``), and names the rest of the model by the modules that hold it.  Which
parameter runs where is read from one probe forward of the model (``probe_layout``; no gradient,
on the real or the meta device): a parameter read before the first block belongs to the first
stage, one read after the last block to the last stage, one read in a block to that block's
stage; a parameter read both before and after the blocks (an LM head tied to the token
embedding) belongs to both, and a parameter read in several blocks or in a block and outside is
refused, since no stage split can hold it once.

Each stage runs the model's own ``forward`` on a trimmed deep copy (parameter FQNs are those of
the reference model, so the plan's placements, FSDP and checkpoints apply unchanged):

* blocks the stage does not own are replaced by pass-through modules that return their hidden
  input in the block's output structure;
* modules outside the blocks whose parameters the stage does not own return zeros shaped like
  their output in the probe (an expanded scalar: no memory, no compute), and parameters held
  directly by a container the stage does not own (a ViT's class token) become expanded zeros;
* on a stage after the first, the hidden state received from the previous stage replaces the
  input of the stage's first block (so whatever the model computes before its blocks from the
  token ids, positions, masks and rotary tables, runs as written on every stage);
* on a stage before the last, the stage's output is its last block's hidden output.

Every stage needs the token ids of its micro-batch (for masks and positions): the runtime hands
each stage module the rank's micro-batches before a schedule step, and the stage is told which
micro-batch it runs (``ChunkedPipelineStage``).

Tied parameters across stages (GPT's LM head reusing the token embedding) are handled as
Megatron-LM does: the first and last stage each hold a copy, and after every schedule step the
gradients of the copies are summed between the pipeline ranks that hold them, so the copies
take identical optimizer steps and stay equal (they start equal: deep copies of one model).

Virtual stages are placed looped: rank r holds stages r, r + pp, r + 2·pp, ….
"""

from __future__ import annotations

import copy
import logging
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from autopar.config import FEW_MICROBATCHES
from autopar.runtime.stand_ins import PassBlock, ZeroOutput, hidden_arg
from autopar.runtime.structure import block_slots

if TYPE_CHECKING:
    from autopar.plan.plan import Plan

__all__ = ["SCHEDULES", "ModelLayout", "build_stage_modules", "install_stage_io",
           "make_pipeline_stages", "make_schedule", "probe_layout", "set_stage_tokens",
           "stage_ids_for_rank", "tied_parameters"]

log = logging.getLogger(__name__)

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved-1f1b": "ScheduleInterleaved1F1B",
             "zero-bubble": "ScheduleInterleavedZeroBubble"}
MULTI_STAGE = ("interleaved-1f1b", "zero-bubble")  # schedules that take a list of stages


@dataclass(frozen=True)
class TiedCopy:
    """One parameter (reference FQN ``fqn``) of which the stages ``stage_ids`` each hold a copy."""

    fqn: str
    stage_ids: tuple[int, ...]


@dataclass
class ModelLayout:
    """What a probe forward tells about a model's structure (``probe_layout``)."""

    blocks: list[str]  # block FQNs in call order
    # parameter FQN (first name) -> "pre" | "post" | "pre+post" | a block FQN
    param_owner: dict[str, str]
    # non-block module FQN -> its output as a pytree of (shape, dtype), from the probe
    outputs: dict[str, Any]
    hidden_index: int | None = None  # where a block's output tuple holds the hidden state


# stage module → the tied parameters of which it holds one copy (set by build_stage_modules)
_TIED: weakref.WeakKeyDictionary[nn.Module, list[TiedCopy]] = weakref.WeakKeyDictionary()


@dataclass
class _StageIO:
    """How one stage module runs: its first and last owned block slots, and per step the
    token micro-batches and the hidden state received for the micro-batch being run."""

    first_slot: tuple[nn.Module, str] | None
    last_slot: tuple[nn.Module, str] | None
    is_first: bool
    is_last: bool
    hidden_index: int | None
    forward: Any = None  # the model class's forward
    tokens: tuple = ()
    chunk: int = 0
    received: Any = None
    captured: Any = None
    active: bool = False
    hooks: list = field(default_factory=list)


_IO: weakref.WeakKeyDictionary[nn.Module, _StageIO] = weakref.WeakKeyDictionary()


def stage_ids_for_rank(pp_rank: int, pp: int, num_stages: int) -> list[int]:
    return list(range(pp_rank, num_stages, pp))


def _owned(stage: list[str]) -> set[str]:
    names: set[str] = set()
    for entry in stage:
        names.update(part.strip() for part in entry.split("+"))
    return names


def tied_parameters(module: nn.Module) -> list[list[str]]:
    """Groups of FQNs that name one shared parameter, each in registration order (the first is
    the name ``named_parameters`` and state dicts of the optimizer use)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _spec(out: Any) -> Any:
    return tree_map(lambda t: (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t,
                    out)


def probe_layout(model: nn.Module, example: torch.Tensor) -> ModelLayout:
    """Run ``model(example)`` once without gradients (RNG state restored) and read which
    parameters each phase of the forward reads, the order of the blocks and the outputs of the
    modules outside them.  ValueError when the model has no block list or a parameter no stage
    split can hold."""
    from torch.overrides import TorchFunctionMode

    slots = block_slots(model)
    if not slots:
        raise ValueError(f"{type(model).__name__} has no block list (a ModuleList, Sequential or "
                         f"ModuleDict of two or more modules of one class) to split into "
                         f"pipeline stages; plan it with pp=1")
    block_fqn = {}
    prefix = {id(m): n for n, m in model.named_modules()}
    for container, key in slots:
        block = container.get_submodule(key)
        block_fqn[id(block)] = prefix[id(block)]
    first_name = {id(p): n for n, p in model.named_parameters()}
    block_of_param = {}
    for n, p in model.named_parameters():
        for b in block_fqn.values():
            if n.startswith(b + "."):
                block_of_param[n] = b
    state = {"phase": "pre", "order": [], "index": None}
    uses: dict[str, set[str]] = {}

    class _Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            for t in (*args, *(kwargs or {}).values()):
                name = first_name.get(id(t)) if isinstance(t, nn.Parameter) else None
                if name is not None:
                    uses.setdefault(name, set()).add(state["phase"])
            return func(*args, **(kwargs or {}))

    def enter(mod, args, kwargs):
        state["phase"] = block_fqn[id(mod)]
        state["order"].append(block_fqn[id(mod)])
        state["hidden_shape"] = hidden_arg(args, kwargs).shape

    def leave(mod, args, kwargs, out):
        state["phase"] = "after " + block_fqn[id(mod)]
        if isinstance(out, (tuple, list)):
            shape = state["hidden_shape"]
            hits = [i for i, t in enumerate(out) if isinstance(t, torch.Tensor) and t.shape == shape]
            state["index"] = hits[0] if hits else 0

    outputs = {}
    handles = []
    for container, key in slots:
        block = container.get_submodule(key)
        handles.append(block.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(block.register_forward_hook(leave, with_kwargs=True))
    for name, mod in model.named_modules():
        if id(mod) in block_fqn or any(name.startswith(b + ".") for b in block_fqn.values()):
            continue
        if name and any(True for _ in mod.parameters(recurse=False)) and not list(mod.children()):
            def record(m, args, out, name=name):
                outputs[name] = _spec(out)
            handles.append(mod.register_forward_hook(record))
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), _Reads():
            model(example)
    finally:
        for h in handles:
            h.remove()
    if not state["order"]:
        raise ValueError(f"{type(model).__name__}'s forward called none of its blocks; plan it "
                         f"with pp=1")
    post = "after " + state["order"][-1]

    def resolve(ph: str, what: str) -> str:
        if ph == post:
            return "post"
        if ph.startswith("after "):
            raise ValueError(f"{what} is read between {ph[6:]} and the next block: only blocks "
                             f"may run between the first and the last block for a pipeline "
                             f"split; plan with pp=1")
        return ph

    uses = {name: {resolve(ph, f"parameter {name}") for ph in phases}
            for name, phases in uses.items()}
    owner = {}
    for name, phases in sorted(uses.items()):
        blocks_read = {ph for ph in phases if ph not in ("pre", "post")}
        if blocks_read:
            home = block_of_param.get(name)
            if phases != {home}:
                raise ValueError(f"parameter {name} is read in {sorted(phases)}: a parameter "
                                 f"shared between blocks, or between a block and the rest of "
                                 f"the model, cannot be split into pipeline stages; plan with "
                                 f"pp=1")
            owner[name] = home
        else:
            owner[name] = "+".join(sorted(phases))
    return ModelLayout(blocks=state["order"], param_owner=owner, outputs=outputs,
                       hidden_index=state["index"])


def _stage_owner(layout: ModelLayout, stages: list[list[str]]) -> dict[str, set[int]]:
    """parameter FQN -> the stages that hold it."""
    block_stage = {}
    for sid, stage in enumerate(stages):
        for name in _owned(stage):
            block_stage[name] = sid
    missing = [b for b in layout.blocks if b not in block_stage]
    if missing:
        raise ValueError(f"plan stages do not cover block {missing[0]}; re-plan for this model")
    ranks = [block_stage[b] for b in layout.blocks]
    if ranks != sorted(ranks):
        at = next(i for i in range(1, len(ranks)) if ranks[i] < ranks[i - 1])
        raise ValueError(f"plan stages are not in the order the model runs its blocks: "
                         f"{layout.blocks[at]} (stage {ranks[at]}) runs after "
                         f"{layout.blocks[at - 1]} (stage {ranks[at - 1]}); re-plan for this "
                         f"model")
    last = len(stages) - 1
    out: dict[str, set[int]] = {}
    for name, owner in layout.param_owner.items():
        phases = set(owner.split("+"))
        if phases <= {"pre", "post"}:
            out[name] = ({0} if "pre" in phases else set()) | ({last} if "post" in phases else set())
        else:
            out[name] = {block_stage[owner]}
    return out


def build_stage_modules(model: nn.Module, stages: list[list[str]], ids: list[int],
                        example: torch.Tensor) -> list[nn.Module]:
    """One module per stage id in ``ids``, each a trimmed deep copy of ``model`` (see the module
    docstring); ``example`` is one micro-batch of the model's input, for the probe."""
    layout = probe_layout(model, example)
    holders = _stage_owner(layout, stages)
    unread = [n for n, _ in model.named_parameters() if n not in holders]
    if unread:
        log.info("parameters the forward never reads stay on the first stage: %s",
                 ", ".join(unread[:4]))
        for n in unread:
            holders[n] = {0}
    tied = [TiedCopy(fqn=name, stage_ids=tuple(sorted(sids)))
            for name, sids in sorted(holders.items()) if len(sids) > 1]
    out = []
    for sid in ids:
        mod = copy.deepcopy(model)
        _trim(mod, layout, {n for n, sids in holders.items() if sid in sids})
        owned = [b for b in layout.blocks if b in _owned(stages[sid])]
        _IO[mod] = _StageIO(first_slot=_slot(mod, owned[0]) if owned else None,
                            last_slot=_slot(mod, owned[-1]) if owned else None,
                            is_first=sid == 0, is_last=sid == len(stages) - 1,
                            hidden_index=layout.hidden_index, forward=type(model).forward)
        mine = [t for t in tied if sid in t.stage_ids]
        if mine:
            _TIED[mod] = mine
        out.append(mod)
    if tied:
        log.info("tied parameters across pipeline stages (gradients summed after each step): %s",
                 ", ".join(f"{t.fqn} on stages {list(t.stage_ids)}" for t in tied))
    return out


def _slot(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    parent, _, key = fqn.rpartition(".")
    return model.get_submodule(parent), key


def _trim(mod: nn.Module, layout: ModelLayout, keep: set[str]) -> None:
    """Replace in ``mod`` what this stage does not run: blocks without a kept parameter by pass
    blocks, modules outside the blocks without one by zero outputs, and other parameters it
    does not keep by expanded zeros."""
    by_id = {}
    for name, p in mod.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    first = {name: names[0] for names in by_id.values() for name in names}
    for block in layout.blocks:
        if not any(first[n] in keep for n, _ in mod.get_submodule(block).named_parameters(
                prefix=block, remove_duplicate=False)):
            setattr(*_slot(mod, block), PassBlock(layout.hidden_index,
                                                   mod.get_submodule(block)))
    for name, spec in layout.outputs.items():
        module = mod.get_submodule(name)
        if not any(first[f"{name}.{k}"] in keep for k, _ in module.named_parameters(recurse=False)):
            setattr(*_slot(mod, name), ZeroOutput(spec, module))
    for name, p in list(mod.named_parameters(remove_duplicate=False)):
        if first[name] not in keep:
            owner, _, pname = name.rpartition(".")
            holder = mod.get_submodule(owner)
            del holder._parameters[pname]
            holder.register_buffer(pname, torch.zeros((), dtype=p.dtype, device=p.device)
                                   .expand(p.shape), persistent=False)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the gradient of a stage's
    input is sent to the stage before as it is laid out (a sequence-first encoder's blocks
    leave it transposed), and a transposed tensor cannot be sent."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def install_stage_io(module: nn.Module) -> None:
    """Hook the stage's first and last owned block slots (as they are now: after recompute
    wrapping, before data-parallel wrapping) and make ``module``'s forward run the stage."""
    io = _IO[module]
    for h in io.hooks:
        h.remove()
    io.hooks.clear()

    def inject(_m, args, kwargs):
        if not io.active or io.received is None:
            return None
        if args:
            return (io.received, *args[1:]), kwargs
        key = next(k for k, v in kwargs.items()
                   if isinstance(v, torch.Tensor) and v.is_floating_point())
        return args, {**kwargs, key: io.received}

    def capture(_m, _args, out):
        if io.active:
            io.captured = out if io.hidden_index is None or not isinstance(out, (tuple, list)) \
                else out[io.hidden_index]

    if not io.is_first and io.first_slot is not None:
        io.hooks.append(io.first_slot[0].get_submodule(io.first_slot[1])
                        .register_forward_pre_hook(inject, with_kwargs=True))
    if not io.is_last and io.last_slot is not None:
        io.hooks.append(io.last_slot[0].get_submodule(io.last_slot[1])
                        .register_forward_hook(capture))

    def forward(*args):
        from autopar.runtime.apply import model_logits

        if io.is_first:
            tokens, io.received = args[0], None
        else:
            io.received = _ContiguousGrad.apply(args[0])
            tokens = io.tokens[io.chunk] if io.tokens else None
            if tokens is None:
                raise RuntimeError("a later pipeline stage ran without its token micro-batches "
                                   "(set_stage_tokens)")
            tokens = tokens.to(args[0].device)
        io.active, io.captured = True, None
        try:
            out = io.forward(module, tokens)
        finally:
            io.active = False
        if io.is_last:
            return model_logits(out)
        if io.captured is None:
            raise RuntimeError("the stage's last block did not run")
        return io.captured.contiguous()  # sent as laid out: a transposed view is not

    module.forward = forward


def set_stage_tokens(modules: list[nn.Module], tokens: torch.Tensor, n_microbatches: int) -> None:
    """Give each stage module this step's token micro-batches (every stage reads them)."""
    chunks = tuple(torch.tensor_split(tokens, n_microbatches))
    for m in modules:
        io = _IO.get(m)
        if io is not None:
            io.tokens, io.chunk = chunks, 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class _TiedGradientSum:
    """After a schedule step: each tied parameter's gradient becomes the sum of the gradients of
    all its copies (on this rank, and on the one other pipeline rank that holds copies).  Both
    ranks add the same two numbers (IEEE addition commutes), so the copies stay bitwise equal."""

    def __init__(self, stages: list[Any]):
        self.group = stages[0].group
        pp_rank, pp = stages[0].group_rank, stages[0].group_size
        by_fqn: dict[str, tuple[TiedCopy, list[nn.Module]]] = {}
        for stage in stages:
            for t in _TIED.get(stage.submod, []):
                by_fqn.setdefault(t.fqn, (t, []))[1].append(stage.submod)
        self.entries: list[tuple[str, list[nn.Module], int | None]] = []
        for fqn, (t, mods) in sorted(by_fqn.items()):
            peers = sorted({sid % pp for sid in t.stage_ids} - {pp_rank})
            if len(peers) > 1:
                raise NotImplementedError(f"{fqn} is tied across {len(peers) + 1} pipeline ranks; "
                                          f"this runtime sums tied gradients between two ranks "
                                          f"only.  Untie it or use fewer pipeline ranks")
            self.entries.append((fqn, mods, peers[0] if peers else None))

    def __call__(self) -> None:
        import torch.distributed as dist

        for fqn, mods, peer in self.entries:
            grads = []
            for m in mods:  # looked up now: FSDP swaps the registered parameter objects
                p = dict(m.named_parameters())[fqn]
                if p.grad is None:
                    raise RuntimeError(f"tied parameter {fqn} got no gradient on this stage")
                if hasattr(p.grad, "placements") and p.grad.placements != p.placements:
                    # e.g. a vocab-parallel embedding's gradient comes back Replicate
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
                grads.append(_local(p.grad))
            total = grads[0].clone()
            for g in grads[1:]:
                total += g
            if peer is not None:
                theirs = torch.empty_like(total)
                for req in dist.batch_isend_irecv([
                        dist.P2POp(dist.isend, total, group=self.group, group_peer=peer),
                        dist.P2POp(dist.irecv, theirs, group=self.group, group_peer=peer)]):
                    req.wait()
                total += theirs
            for g in grads:
                g.copy_(total)


class _ScheduleWithTiedSum:
    """The plan's schedule, followed on every ``step`` by the tied-gradient sum."""

    def __init__(self, schedule: Any, tied_sum: _TiedGradientSum):
        self._schedule, self._tied_sum = schedule, tied_sum

    def step(self, *args: Any, **kwargs: Any) -> Any:
        out = self._schedule.step(*args, **kwargs)
        self._tied_sum()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._schedule, name)


def make_schedule(plan: Plan, stages: list[Any], n_microbatches: int, loss_fn: Any):
    """The ``torch.distributed.pipelining`` schedule for ``plan.config.pp_schedule`` (with the
    tied-gradient sum after each step when this rank holds a tied parameter's copy)."""
    from torch.distributed.pipelining import schedules

    name = plan.config.pp_schedule
    if name not in SCHEDULES:
        raise NotImplementedError(f"pipeline schedule {name!r} is not in this runtime yet "
                                  f"(runs: {', '.join(SCHEDULES)}); pin pp_schedule when compiling")
    if n_microbatches < plan.config.pp:
        if name not in FEW_MICROBATCHES:
            raise ValueError(f"{n_microbatches} micro-batches is fewer than the "
                             f"{plan.config.pp} pipeline ranks, which {name} cannot run; lower "
                             f"micro_batch_size")
        # PyTorch's Schedule1F1B refuses it; 1F1B with its warm-up capped at the
        # micro-batches differs from GPipe's order on the last ranks alone
        name = "gpipe"
    cls = getattr(schedules, SCHEDULES[name])
    if name in MULTI_STAGE:
        schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    elif len(stages) != 1:
        raise ValueError(f"schedule {name!r} runs one stage per rank, this rank has {len(stages)}")
    else:
        schedule = cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    if any(_TIED.get(s.submod) for s in stages):
        return _ScheduleWithTiedSum(schedule, _TiedGradientSum(stages))
    return schedule


def make_pipeline_stages(modules: list[nn.Module], ids: list[int], num_stages: int,
                         device: torch.device, group: Any) -> list[Any]:
    """``PipelineStage``s that tell their stage module which micro-batch it runs."""
    from torch.distributed.pipelining import PipelineStage

    class ChunkedPipelineStage(PipelineStage):
        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            io = _IO.get(self.submod)
            if io is not None:
                io.chunk = fwd_chunk_id
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def _to_tensor(self, arg):
            # The shape inference runs the stage on tensors made from metadata; zeros rather
            # than uninitialised memory, so a forward whose collectives depend on the values
            # (MoE routing under tensor parallel) runs alike on every rank of a group.
            t = super()._to_tensor(arg)
            if isinstance(arg, torch.Tensor):
                return t
            with torch.no_grad():
                (t._local_tensor if hasattr(t, "_local_tensor") else t).zero_()
            return t

    return [ChunkedPipelineStage(m, sid, num_stages, device, group=group)
            for m, sid in zip(modules, ids)]
