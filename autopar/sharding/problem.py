"""The sharding problem of one block on one mesh axis: strategies, costs, memory, tensors.

``build_problem`` turns a set of IR nodes into plain tables that both the ILP
(:mod:`autopar.search.intra_op`) and a brute-force oracle read, and ``BlockProblem.evaluate``
is the reference semantics of an assignment (one strategy index per node):

    cost = Σ_v node_units[v][s_v]
         + Σ_tensors Σ_{q ∈ demanded forward placements, q ≠ p}  reshard(p → q)
         + Σ_tensors Σ_{g ∈ produced gradient placements, g ≠ w}  reshard(g → w)

where ``p`` is the placement the producer's strategy gives the tensor and ``w`` the placement
its backward wants the gradient in (``grad_placement(p)`` but for "R~P" strategies). A tensor
demanded in the same placement by several consumers is resharded once; gradients arriving in
the same placement are summed before one reshard. Times are integer nanoseconds (``to_units``) so the
ILP and the oracle add the very same numbers.

Node cost = forward + backward compute (GEMMs and convolutions on the GEMM roofline,
attention on the fused-attention model, everything else memory bound with the estimate's
``BACKWARD_MEMORY_RATIO``; views are free) divided by the strategy's work divisor, plus the
strategy's internal collectives, plus, when the strategy splits the work of a replicated
parameter (its gradient is then partial on the axis), that gradient's share of the one
all-reduce a step that reduces all such gradients together (its bytes' share of that
all-reduce's time beyond an empty one, over ``microbatches``).

Boundary: the hidden state entering the block (a tensor from outside that needs a gradient,
shaped like the block's output) is produced by a pseudo node ``<block-input>`` whose placement
is chosen, and the block's output is consumed by a pseudo node ``<block-output>`` that must
pick the same placement (the next copy of the block starts where this one ends). Other tensors
from outside come from ``<external:NAME>`` pseudo nodes, replicated, and other tensors read
outside go to ``<consumer:NAME>`` pseudo nodes that want them (and return their gradients)
replicated.

Memory of a strategy = parameter elements held × ``bytes_per_param`` (÷ axis size if sharded;
a parameter is charged at its first user) + the node's saved activation bytes scaled by the
sharded fraction of its inputs and outputs. State work of a strategy (``state_units``) =
trainable parameter elements held × ``step_s_per_param``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from autopar.errors import ShardingInfeasibleError
from autopar.estimate.timing import BACKWARD_MEMORY_RATIO
from autopar.ir import Graph, Node, OpKind, TensorSpec, dtype_num_bytes
from autopar.ir.reductions import hands_on_partial_gradients
from autopar.ir.residual import (bottleneck_gemms, fused_splits, parameter_values,
                                 residual_structure, routing_nodes)
from autopar.sharding.placement import (PARTIAL, REPLICATE, is_shard, reshard_collective,
                                        shard, shard_dim)
from autopar.sharding.rules import on_sequence_shard, per_chunk
from autopar.sharding.rules import signature as rule_signature
from autopar.sharding.rules import strategies as rule_strategies
from autopar.sharding.strategy import Collective, Strategy
from autopar.sharding.strided import strided_strategies
from costmodels.compute import (AttentionCall, activation_memory_time_s, attention_time_s,
                                gemm_time_s, op_overhead_s)
from costmodels.collectives import LayoutTimer
from costmodels.memory import weight_bytes

__all__ = ["BLOCK_INPUT", "BLOCK_OUTPUT", "BlockProblem", "BlockSetting", "ParamUse",
           "TensorUse", "build_problem", "pin_params", "to_units"]

BLOCK_INPUT = "<block-input>"
BLOCK_OUTPUT = "<block-output>"
UNITS_PER_S = 1e9  # objective in integer nanoseconds


def to_units(seconds: float) -> int:
    return int(round(seconds * UNITS_PER_S))


@dataclass(frozen=True, kw_only=True)
class TensorUse:
    """One produced tensor and the node inputs that read it."""

    producer: str
    output: int
    nbytes: float
    requires_grad: bool
    consumers: tuple[tuple[str, int], ...]


@dataclass(frozen=True, kw_only=True)
class ParamUse:
    fqn: str
    node: str
    input_index: int
    transposed: bool
    numel: int
    first_use: bool
    broadcast: int = 0  # dims the operand adds before the parameter's own (an expanded weight)


@dataclass(frozen=True, kw_only=True)
class BlockProblem:
    """Plain tables of one block's sharding problem on an axis of ``axis_size`` ranks."""

    axis_size: int
    nodes: tuple[str, ...]
    strategies: Mapping[str, tuple[Strategy, ...]]
    compute_units: Mapping[str, tuple[int, ...]]
    comm_units: Mapping[str, tuple[int, ...]]
    # the step's per-parameter work on the parameters a strategy holds (their share of the
    # data-parallel gradient reduction and the optimizer step), per micro-batch
    state_units: Mapping[str, tuple[int, ...]]
    memory_bytes: Mapping[str, tuple[float, ...]]
    tensors: tuple[TensorUse, ...]
    params: tuple[ParamUse, ...]
    periodic: bool
    grad_bytes_per_elem: int
    collective_units: Callable[[Collective], int]

    def node_units(self, v: str) -> tuple[int, ...]:
        """Per strategy of ``v``: its compute, own collectives and parameter state work."""
        return tuple(map(sum, zip(self.compute_units[v], self.comm_units[v],
                                  self.state_units[v])))

    def out_placement(self, tensor: TensorUse, s: int) -> str:
        return self.strategies[tensor.producer][s].outputs[tensor.output]

    def param_placement(self, use: ParamUse, s: int) -> str:
        """The parameter's own placement ("R" or "S(d)") under strategy ``s`` of its node."""
        p = self.strategies[use.node][s].inputs[use.input_index]
        if p == PARTIAL:
            return REPLICATE
        d = shard_dim(p)
        if d is None:
            return p
        d -= use.broadcast
        if d < 0:  # a dim the weight is expanded along: every rank reads it whole
            return REPLICATE
        return shard(1 - d if use.transposed else d)

    def out_grad_placement(self, tensor: TensorUse, s: int) -> str:
        return self.strategies[tensor.producer][s].grad_outputs[tensor.output]

    def reshards(self, tensor: TensorUse, choice: Mapping[str, int]
                 ) -> tuple[list[Collective], list[Collective]]:
        """Forward and backward reshard collectives of one tensor under ``choice``."""
        made = self.strategies[tensor.producer][choice[tensor.producer]]
        p = made.outputs[tensor.output]
        if len(tensor.consumers) == 1:
            (node, i), = tensor.consumers
            st = self.strategies[node][choice[node]]
            demanded, grads = [st.inputs[i]], [st.input_grads[i]]
        else:
            taken = [self.strategies[node][choice[node]].inputs[i]
                     for node, i in tensor.consumers]
            handed = [self.strategies[node][choice[node]].input_grads[i]
                      for node, i in tensor.consumers]
            demanded, grads = sorted(set(taken)), sorted(set(handed))
        n, nbytes = self.axis_size, tensor.nbytes
        fwd = [c for q in demanded if (c := reshard_collective(p, q, nbytes, n))]
        bwd = []
        if tensor.requires_grad:
            want = made.grad_outputs[tensor.output]
            bwd = [c for g in grads if (c := reshard_collective(g, want, nbytes, n))]
        return fwd, bwd

    def feasible(self, choice: Mapping[str, int]) -> bool:
        """Parameter placements agree across users; the boundary is periodic."""
        seen: dict[str, str] = {}
        for use in self.params:
            pl = self.param_placement(use, choice[use.node])
            if seen.setdefault(use.fqn, pl) != pl:
                return False
        if self.periodic:
            s_in = self.strategies[BLOCK_INPUT][choice[BLOCK_INPUT]]
            s_out = self.strategies[BLOCK_OUTPUT][choice[BLOCK_OUTPUT]]
            return s_in.outputs[0] == s_out.inputs[0]
        return True

    def evaluate(self, choice: Mapping[str, int]) -> int | None:
        """Objective (integer ns) of an assignment, ``None`` if it breaks a hard constraint."""
        if not self.feasible(choice):
            return None
        total = sum(self.node_units(v)[choice[v]] for v in self.nodes)
        for t in self.tensors:
            fwd, bwd = self.reshards(t, choice)
            total += sum(self.collective_units(c) for c in fwd + bwd)
        return total

    def memory(self, choice: Mapping[str, int]) -> float:
        return sum(self.memory_bytes[v][choice[v]] for v in self.nodes)


def _requires_grad(graph: Graph) -> dict[str, bool]:
    """Whether each node's outputs need a gradient (depend on a trainable parameter)."""
    req: dict[str, bool] = {}
    for node in graph.nodes:
        trainable = {p.fqn for p in node.params if p.requires_grad} if node.params else ()
        needs = False
        for src in node.input_sources:
            if req.get(src, False) or (src.startswith("param:") and src[6:] in trainable):
                needs = True
                break
        req[node.name] = needs
    return req


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


def _node_compute_s(node: Node, device, dtype: str, divisor: int) -> float:
    """Forward and backward seconds of one node's kernels on one rank at ``divisor`` shares
    of its work, with the launch cost of each kernel (one forward, two backward; views launch
    none), as the estimate's `unit_compute` charges them."""
    if node.kind is OpKind.VIEW:
        return 0.0
    return _node_work_s(node, device, dtype, divisor) + 3 * op_overhead_s(device)


def _node_work_s(node: Node, device, dtype: str, divisor: int) -> float:
    nbytes = (node.bytes_read + node.bytes_written) / divisor
    if node.kind in (OpKind.MATMUL, OpKind.CONV):
        return (gemm_time_s(device, dtype, node.flops_fwd / divisor, nbytes)
                + gemm_time_s(device, dtype, node.flops_bwd / divisor, 2 * nbytes))
    if node.kind is OpKind.ATTENTION and node.attention is not None and node.flops_fwd:
        a = node.attention
        score = a.batch * a.num_heads * a.seq_q * a.seq_kv * dtype_num_bytes(node.outputs[0].dtype)
        work = dict(io_bytes=nbytes, score_bytes=score / divisor, causal=a.causal,
                    seq_kv=a.seq_kv)
        return sum(attention_time_s(device, dtype, AttentionCall(flops=flops / divisor, **work),
                                    kernel="flash", backward=backward)
                   for flops, backward in ((node.flops_fwd, False), (node.flops_bwd, True)))
    return activation_memory_time_s(device, nbytes) * (1 + BACKWARD_MEMORY_RATIO)


def _activation_shares(node: Node, sts: Sequence[Strategy], n: int) -> list[float]:
    """Fraction of the node's saved activations (non-parameter inputs, then outputs) one rank
    keeps under each strategy."""
    ins = [(i, node.inputs[i].num_bytes) for i, src in enumerate(node.input_sources)
           if not src.startswith("param:")]
    outs = [t.num_bytes for t in node.outputs]
    full = 0.0
    for b in [b for _, b in ins] + outs:
        full += b
    if not full:
        return [1.0] * len(sts)
    # each tensor's bytes on one rank, sharded or whole (b / n and b / 1 as floats)
    split_ins = [(i, b / n, b / 1) for i, b in ins]
    split_outs = [(j, b / n, b / 1) for j, b in enumerate(outs)]
    shares = []
    for st in sts:
        part = 0.0
        for i, sharded, whole in split_ins:
            part += sharded if is_shard(st.inputs[i]) else whole
        for j, sharded, whole in split_outs:
            part += sharded if is_shard(st.outputs[j]) else whole
        shares.append(part / full)
    return shares


_FLAT_MATMULS = ("aten.mm.", "aten.addmm.")
_RESHAPES = ("aten.view.", "aten._unsafe_view.", "aten.reshape.")


def _lift_flattened_matmuls(by_name: dict[str, Node], names: Sequence[str]) -> dict[str, Node]:
    """``by_name`` with each Linear-style GEMM of ``names`` seen on its input's leading dims:
    a 2-D ``mm``/``addmm`` whose activation operand is a view of ``[*L, k]`` flattened to
    ``[prod(L), k]`` (read by nothing else) and whose output only views unflatten back to
    ``[*L, n]`` is costed as ``[*L, k] x [k, n] -> [*L, n]``, its views as identities. A shard
    of any leading dim -- the sequence of ``[batch, seq, hidden]``, which a flattening view
    can carry only as a strided shard -- then passes through the GEMM as DTensor carries it,
    where the flattened view could map only the first. Same elements, FLOPs and bytes."""
    readers: dict[str, list[str]] = {}
    for name in names:
        for src in by_name[name].input_sources:
            readers.setdefault(src, []).append(name)
    out = dict(by_name)
    for name in names:
        node = by_name[name]
        if not node.target.startswith(_FLAT_MATMULS) or not node.params:
            continue
        a = 1 if node.target.startswith("aten.addmm.") else 0
        flat = by_name.get(node.input_sources[a])
        if flat is None or flat.name not in names or not flat.target.startswith(_RESHAPES) \
                or readers.get(flat.name) != [name] or len(node.inputs[a].shape) != 2:
            continue
        lead, k = flat.inputs[0].shape[:-1], node.inputs[a].shape[1]
        if len(lead) < 2 or flat.inputs[0].shape[-1] != k:
            continue
        n = node.outputs[0].shape[-1]
        unflat = [by_name[r] for r in readers.get(name, ())]
        if not unflat or any(not u.target.startswith(_RESHAPES) or u.name not in names
                             or tuple(u.outputs[0].shape) != (*lead, n) for u in unflat):
            continue
        lifted_in = TensorSpec(shape=(*lead, k), dtype=flat.outputs[0].dtype)
        lifted_out = TensorSpec(shape=(*lead, n), dtype=node.outputs[0].dtype)
        out[flat.name] = dataclasses.replace(flat, outputs=(lifted_in,))
        out[name] = dataclasses.replace(node, outputs=(lifted_out,), inputs=tuple(
            lifted_in if i == a else t for i, t in enumerate(node.inputs)))
        for u in unflat:
            out[u.name] = dataclasses.replace(u, inputs=(lifted_out,) + u.inputs[1:])
    return out


def _source_map(by_name: Mapping[str, Node], names: set[str]
                ) -> dict[tuple[str, int], tuple[str, int]]:
    """(consumer, input index) -> (producer, output index) for node-produced inputs."""
    out: dict[tuple[str, int], tuple[str, int]] = {}
    for name in names:
        node = by_name[name]
        seen: dict[str, int] = {}
        for i, src in enumerate(node.input_sources):
            if src == name or ":" in src or src == "const":
                continue
            producer = by_name.get(src)
            if producer is None:
                continue
            if len(producer.outputs) == 1:  # what the shapes below pick among one output
                out[(name, i)] = (src, 0)
                continue
            k = seen.get(src, 0)
            seen[src] = k + 1
            matching = [j for j, t in enumerate(producer.outputs)
                        if t.shape == node.inputs[i].shape]
            out[(name, i)] = (src, matching[k] if k < len(matching) else (matching or [0])[0])
    return out


@dataclass(frozen=True, kw_only=True)
class BlockSetting:
    """What a block's sharding problem is built from beside its graph (`build_problem`): the
    tensor-parallel group it is solved on and what the plan around the block charges each
    choice. The blocks of one plan share it but for ``gradient_buffer_bytes``."""

    tp: int
    """The tensor-parallel degree, the size of the axis the block is sharded on."""
    cluster: Any
    """The `Cluster` the tp group's collectives are timed on."""
    dtype: str
    """The training precision ("bf16", "fp16", "fp8", "fp32")."""
    ranks: Sequence[int] | None = None
    """The tp group's ranks (None: ``range(tp)``)."""
    bytes_per_param: float = 16.0
    """The training state per parameter element a rank holds (16: bf16 weight and gradient,
    fp32 master, Adam m and v -- Rajbhandari et al. 2020, ZeRO §3)."""
    step_s_per_param: float = 0.0
    """Each held element's share of the step's gradient reduction and optimizer step, in
    seconds per micro-batch."""
    boundary: str = "periodic"
    """The hidden state between blocks: "periodic" (placed as the ILP chooses), "replicated"
    (pinned to R) or a shard "S(d)"."""
    sequence_shards: int = 1
    """The context-parallel degree: what derives from the model's inputs (node work, kept
    activations, tensors between nodes, attention as ring attention's share of a rank) is
    costed at 1/sequence_shards; parameters, their gradients' all-reduce and an op's own
    collectives (batch-norm statistics) are not."""
    microbatches: int = 1
    """Micro-batches per step, which share its one all-reduce of partial parameter
    gradients."""
    gradient_buffer_bytes: float | None = None
    """The bytes of that all-reduce in all (None: each gradient's own)."""



def build_problem(graph: Graph, node_names: Sequence[str], setting: BlockSetting
                  ) -> BlockProblem:
    """Tables of the sharding problem of ``node_names`` on one axis of ``setting.tp`` ranks,
    each choice priced as `BlockSetting` says: a replicated weight pays for the memory and the
    per-step work it takes, activations are costed at one rank's share of the sequence."""
    axis_size, cluster, dtype, ranks = setting.tp, setting.cluster, setting.dtype, setting.ranks
    bytes_per_param, step_s_per_param = setting.bytes_per_param, setting.step_s_per_param
    boundary, sequence_shards = setting.boundary, setting.sequence_shards
    microbatches, gradient_buffer_bytes = setting.microbatches, setting.gradient_buffer_bytes
    if not isinstance(sequence_shards, int) or sequence_shards < 1:
        raise ValueError(f"sequence_shards must be an integer >= 1, got {sequence_shards!r}")
    names = [n for n in node_names]
    in_set = set(names)
    device = cluster.hardware.device
    group = tuple(ranks) if ranks is not None else tuple(range(axis_size))
    timer = LayoutTimer(cluster.hardware, cluster.group_layout(group))  # checked once
    grad_bytes = weight_bytes(dtype)
    times: dict[Collective, int] = {}

    def collective_units(c: Collective) -> int:
        if c not in times:
            times[c] = max(1, to_units(timer.time_s(c[0], c[1])))
        return times[c]

    def gradient_units(nbytes: float) -> int:
        """A replicated parameter's partial gradient, all-reduced with the others in one
        buffer once a step: the bytes' share of that all-reduce, per micro-batch."""
        whole = max(nbytes, gradient_buffer_bytes or 0.0)
        beyond = collective_units(("all_reduce", whole)) - collective_units(("all_reduce", 1.0))
        return max(0, round(beyond * nbytes / whole / microbatches))

    by_name = _lift_flattened_matmuls({n.name: n for n in graph.nodes}, names)
    req = _requires_grad(graph)
    tokens = graph.from_inputs

    def shards_of(made_by: str) -> int:  # how many ways cp splits what this node makes
        return sequence_shards if tokens[made_by] else 1
    sources = _source_map(by_name, in_set)
    consumed_outside = {src for n in graph.nodes if n.name not in in_set
                        for src in n.input_sources if src in in_set}
    out_node = next((n for n in reversed(names) if n in consumed_outside), None)
    out_shape = by_name[out_node].outputs[0].shape if out_node else None

    strategies: dict[str, tuple[Strategy, ...]] = {}
    consumers: dict[tuple[str, int], list[tuple[str, int]]] = {}
    meta: dict[tuple[str, int], tuple[TensorSpec, bool]] = {}  # the last reader's view
    origin: dict[tuple[str, int], str] = {}  # the graph node that makes each tensor
    external: dict[str, set[int]] = {}
    hidden_in = None
    shared: dict[tuple, tuple[Strategy, ...]] = {}  # nodes the rules cannot tell apart
    block_nodes = [by_name[n] for n in names]
    fused = fused_splits(block_nodes)
    strided = strided_strategies(block_nodes, axis_size) if axis_size > 1 else {}
    made = parameter_values(block_nodes)  # DTensor reduces their gradients as they run
    residual = residual_structure(block_nodes)
    # the runtime runs an MoE sub-layer on local tensors, its gradients partial sums
    # (`autopar.runtime.tp_moe`): its routing may defer them ("R~P"), the router's weight
    # gradient joining the step's one all-reduce; so may a low-rank projection every rank
    # runs whole and the ops after it, whose partial gradients DTensor hands back to the
    # sub-layer's input (`bottleneck_gemms`)
    routing = routing_nodes(block_nodes, residual)
    routing |= {n for gemm, after in bottleneck_gemms(block_nodes, residual).items()
                for n in (gemm, *after)}
    for name in names:
        node = by_name[name]
        key = (rule_signature(node), name in routing)
        if key not in shared:
            shared[key] = rule_strategies(node, axis_size, defers_gradients=name in routing)
        strategies[name] = shared[key]
        if name in made and not hands_on_partial_gradients(node):
            strategies[name] = tuple(s for s in strategies[name] if s.name != "R~P")
        if name in fused:
            strategies[name] += per_chunk(node, axis_size)
        strategies[name] += strided.get(name, ())
        if is_shard(boundary) and name in residual.stream and node.params:
            strategies[name] = on_sequence_shard(strategies[name], node, boundary)
        for i, spec in enumerate(node.inputs):
            if (name, i) not in sources:
                continue
            src, j = sources[(name, i)]
            grad = req.get(src, False) and _is_float(spec.dtype)
            if src not in in_set:
                if grad and spec.shape == out_shape and hidden_in in (None, src):
                    hidden_in, key = src, (BLOCK_INPUT, 0)
                else:
                    key = (f"<external:{src}>", j)
                    external.setdefault(key[0], set()).add(j)
            else:
                key = (src, j)
                grad = grad and req.get(src, False)
            consumers.setdefault(key, []).append((name, i))
            meta[key] = (spec, grad)
            origin[key] = src

    pseudo: dict[str, tuple[Strategy, ...]] = {}
    periodic = hidden_in is not None and out_node is not None
    if hidden_in is not None:
        shards = [shard(d) for d, s in enumerate(out_shape)
                  if s >= axis_size and s % axis_size == 0 and axis_size > 1]
        choices = [REPLICATE] + shards if boundary == "periodic" else \
            [REPLICATE] if boundary == "replicated" or axis_size == 1 else [boundary]
        if not set(choices) <= {REPLICATE, *shards}:
            raise ValueError(f"the block's hidden state {list(out_shape)} cannot be placed "
                             f"{boundary} on {axis_size} ranks")
        pseudo[BLOCK_INPUT] = tuple(Strategy(name=p, inputs=(), outputs=(p,), input_grads=())
                                    for p in choices)
        if periodic:
            pseudo[BLOCK_OUTPUT] = tuple(Strategy(name=p, inputs=(p,), outputs=(),
                                                  input_grads=(p,)) for p in choices)
            spec = by_name[out_node].outputs[0]
            consumers.setdefault((out_node, 0), []).append((BLOCK_OUTPUT, 0))
            meta.setdefault((out_node, 0), (spec, req.get(out_node, False)))
            origin[out_node, 0] = out_node
    for name in names:  # other tensors leaving the set are taken replicated outside
        if name in consumed_outside and not (periodic and name == out_node):
            sink = f"<consumer:{name}>"
            pseudo[sink] = (Strategy(name="R", inputs=(REPLICATE,), outputs=(),
                                     input_grads=(REPLICATE,)),)
            spec = by_name[name].outputs[0]
            consumers.setdefault((name, 0), []).append((sink, 0))
            meta.setdefault((name, 0), (spec, req.get(name, False) and _is_float(spec.dtype)))
            origin[name, 0] = name
    for ext, outs in sorted(external.items()):
        width = max(outs) + 1
        pseudo[ext] = (Strategy(name="R", inputs=(), outputs=(REPLICATE,) * width,
                                input_grads=()),)

    nodes = tuple(sorted(pseudo)) + tuple(names)
    position = {v: k for k, v in enumerate(nodes)}
    strategies.update(pseudo)
    compute, comm, state, memory = {}, {}, {}, {}
    params: list[ParamUse] = []
    charged: set[str] = set()
    # nodes without parameters that the rules and the cost model cannot tell apart (equal
    # strategies, work, shapes and kept bytes) share their tables
    alike: dict[tuple, tuple[tuple[int, ...], ...]] = {}
    for name in nodes:
        sts = strategies[name]
        if name in pseudo:
            compute[name] = comm[name] = state[name] = tuple(0 for _ in sts)
            memory[name] = tuple(0.0 for _ in sts)
            continue
        node = by_name[name]
        key = None
        if not node.params:
            key = (id(sts), node.kind, node.flops_fwd, node.flops_bwd, node.bytes_read,
                   node.bytes_written, node.attention, node.saved_bytes, node.inputs,
                   node.outputs, tokens[name])
            if key in alike:
                compute[name], comm[name], state[name], memory[name] = alike[key]
                continue
        uses = []
        for i, src in enumerate(node.input_sources):
            if not src.startswith("param:"):
                continue
            spec = next(p for p in node.params if p.fqn == src[6:])
            transposed = node.kind is OpKind.MATMUL and node.reads_transposed(i)
            use = ParamUse(fqn=spec.fqn, node=name, input_index=i, transposed=transposed,
                           numel=spec.numel, first_use=spec.fqn not in charged,
                           broadcast=max(0, len(node.inputs[i].shape) - len(spec.shape)))
            charged.add(spec.fqn)
            uses.append((use, spec.requires_grad))
            params.append(use)
        split = shards_of(name)
        units_by_divisor = {d: to_units(_node_compute_s(node, device, dtype, d * split))
                            for d in {st.work_divisor for st in sts}}
        saved = node.saved_bytes / split
        mem = [saved * share for share in _activation_shares(node, sts, axis_size)] if saved \
            else [0.0] * len(sts)  # most nodes of a block keep nothing of their own
        m_units, s_units = [0] * len(sts), [0] * len(sts)
        for s, st in enumerate(sts):
            if not uses and not st.fwd_collectives and not st.bwd_collectives:
                continue  # no parameter, no collective of its own
            colls = [*st.fwd_collectives, *st.bwd_collectives]
            grads = 0
            for use, trainable in uses:
                if use.first_use:
                    held = use.numel / (axis_size if is_shard(st.inputs[use.input_index])
                                        else 1)
                    mem[s] += held * bytes_per_param
                    s_units[s] += to_units(held * step_s_per_param) if trainable else 0
                if (trainable and st.inputs[use.input_index] == REPLICATE
                        and st.input_grads[use.input_index] == PARTIAL):
                    grads += gradient_units(float(use.numel * grad_bytes))
            m_units[s] = sum(map(collective_units, colls)) + grads
        assert not any(map(math.isnan, mem))
        compute[name] = tuple(units_by_divisor[st.work_divisor] for st in sts)
        comm[name], state[name], memory[name] = tuple(m_units), tuple(s_units), tuple(mem)
        if key is not None:
            alike[key] = compute[name], comm[name], state[name], memory[name]

    tensors = tuple(
        TensorUse(producer=key[0], output=key[1],
                  nbytes=meta[key][0].num_bytes / shards_of(origin[key]),
                  requires_grad=meta[key][1], consumers=tuple(consumers[key]))
        for key in sorted(consumers, key=lambda k: (position[k[0]], k[1])))
    return BlockProblem(axis_size=axis_size, nodes=nodes, strategies=strategies,
                        compute_units=compute, comm_units=comm, state_units=state,
                        memory_bytes=memory,
                        tensors=tensors, params=tuple(params), periodic=periodic,
                        grad_bytes_per_elem=grad_bytes, collective_units=collective_units)


def pin_params(problem: BlockProblem, placements: Mapping[str, str]) -> BlockProblem:
    """The problem with each node's strategies cut to those that place its parameters as
    ``placements`` says (a parameter it does not list stays replicated): the best execution
    of a given parameter layout, e.g. Megatron's. Raises ShardingInfeasibleError naming a node
    that has no such strategy."""
    uses: dict[str, list[ParamUse]] = {}
    for use in problem.params:
        uses.setdefault(use.node, []).append(use)
    keep: dict[str, list[int]] = {}
    for v in problem.nodes:
        keep[v] = [s for s in range(len(problem.strategies[v]))
                   if all(problem.param_placement(u, s) == placements.get(u.fqn, REPLICATE)
                          for u in uses.get(v, ()))]
        if not keep[v]:
            wanted = {u.fqn: placements.get(u.fqn, REPLICATE) for u in uses[v]}
            raise ShardingInfeasibleError(
                f"no strategy of {v} places its parameters as {wanted}", family="pinned_params")

    def cut(table: Mapping[str, tuple]) -> dict[str, tuple]:
        return {v: tuple(table[v][s] for s in keep[v]) for v in problem.nodes}

    return dataclasses.replace(problem, strategies=cut(problem.strategies),
                               compute_units=cut(problem.compute_units),
                               comm_units=cut(problem.comm_units),
                               state_units=cut(problem.state_units),
                               memory_bytes=cut(problem.memory_bytes))
