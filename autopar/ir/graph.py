"""The torch-free intermediate representation: tensor specs, op nodes, repeated blocks, graphs.

Everything here is a frozen, keyword-only dataclass of plain Python values, so an IR can be
compared, hashed into a fingerprint, saved as JSON and read by code that never imports torch
(the cost models and the search).

Conventions
-----------
* FLOPs follow ``torch.utils.flop_counter``: a matmul of ``[M, K] @ [K, N]`` is ``2·M·N·K``;
  elementwise, norm and softmax ops count 0 FLOPs (they are costed by their bytes); the
  backward of a matmul is the forward times the number of operands that need a gradient
  (2× in the usual case, 1× when one side is an input or frozen); attention is counted
  non-causal (full ``s_q·s_kv``), with ``AttentionSpec.causal`` saying whether a kernel may
  skip half of it; attention backward is 2.5× its forward (the flash-attention recompute).
* ``saved_bytes`` are the bytes a node newly keeps alive for backward (activations only, not
  parameters or buffers; a tensor saved by several nodes is charged to the first one).
  ``saved_bytes_recompute`` is what stays saved when the node's layer runs under selective
  activation recompute (Korthikanti et al. 2022): attention-score sized tensors are dropped.
* A ``Block`` is a run of structurally identical children of a module container (e.g.
  ``layers.0 … layers.125``). Only its representative (the first) is traced; nodes of the
  representative stand for ``count`` copies. ``Graph`` totals already include the copies.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import asdict, dataclass, field
from functools import cached_property

__all__ = [
    "AttentionSpec",
    "Block",
    "Graph",
    "Node",
    "OpKind",
    "ParamSpec",
    "SEQUENCE_DIM",
    "TensorSpec",
    "dtype_num_bytes",
    "op_name",
]

IR_VERSION = 1
SEQUENCE_DIM = 1  # token activations are [batch, seq, ...]: what sequence and context
# parallelism shard

_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}


def op_name(target: str) -> str:
    """A node's op from its target: ``"aten.view.default" -> "view"``,
    ``"F.rms_norm" -> "rms_norm"``."""
    parts = target.split(".")
    return parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[-1]


def dtype_num_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named like ``torch`` names it without the prefix."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


class OpKind(enum.Enum):
    """What an op does, at the granularity the cost model and the sharding rules need."""

    MATMUL = "matmul"
    ATTENTION = "attention"
    NORM = "norm"
    ELEMENTWISE = "elementwise"
    EMBEDDING = "embedding"
    SOFTMAX = "softmax"
    REDUCE = "reduce"
    VIEW = "view"
    CONV = "conv"
    POOL = "pool"
    DROPOUT = "dropout"
    MOE_DISPATCH = "moe_dispatch"
    MOE_COMBINE = "moe_combine"
    LOSS = "loss"
    GENERIC = "generic"


# the target of a fused MoE layer's expert GEMM node (`autopar.trace.moe`): one node per
# ``[num_experts, out, in]`` weight, standing for one matmul per expert
MOE_GROUPED_MM = "moe.grouped_mm"


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """Shape and dtype of one tensor."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def num_bytes(self) -> int:
        return self.numel * dtype_num_bytes(self.dtype)


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """A parameter used by a node, by its fully qualified name in the user's model."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool = True

    @property
    def numel(self) -> int:
        return TensorSpec(shape=self.shape, dtype=self.dtype).numel

    @property
    def num_bytes(self) -> int:
        return TensorSpec(shape=self.shape, dtype=self.dtype).num_bytes


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """Shape facts of a fused attention op, for context/tensor-parallel rules and kernels."""

    batch: int
    num_heads: int
    num_kv_heads: int
    seq_q: int
    seq_kv: int
    head_dim: int
    causal: bool
    dropout_p: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Node:
    """One op of the traced forward pass.

    ``input_sources[i]`` names where ``inputs[i]`` comes from: the producing node's name,
    ``"param:<fqn>"``, ``"buffer:<fqn>"``, ``"input:<i>"`` or ``"const"``. ``transposed``
    lists the inputs that are a 2-D parameter read transposed (``W.T`` of a weight laid out
    ``[out, in]``, as nn.Linear reads it; GPT-2's ``[in, out]`` Conv1D weight is read as it
    is): the one way to tell them apart when the weight is square.
    """

    name: str
    kind: OpKind
    target: str
    inputs: tuple[TensorSpec, ...]
    input_sources: tuple[str, ...]
    outputs: tuple[TensorSpec, ...]
    flops_fwd: int = 0
    flops_bwd: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    params: tuple[ParamSpec, ...] = ()
    saved_bytes: int = 0
    saved_bytes_recompute: int = 0
    # the nodes whose outputs this node keeps for its backward (itself when it keeps its own
    # output or a tensor it makes, e.g. a dropout mask or attention's log-sum-exp)
    saved_from: tuple[str, ...] = ()
    module_path: str = ""
    layer_index: int | None = None
    attention: AttentionSpec | None = None
    transposed: tuple[int, ...] = ()

    def reads_transposed(self, i: int) -> bool:
        """Whether input ``i`` is a 2-D parameter this node reads transposed (expanded along
        leading dims or not): recorded by the trace (``transposed``), or told by its shape when
        the weight is not square (a graph built by hand records nothing)."""
        src = self.input_sources[i]
        spec = next((p for p in self.params if src == f"param:{p.fqn}"), None)
        shape = self.inputs[i].shape[-2:]  # after any dims the weight is expanded along
        if spec is None or len(spec.shape) != 2 or len(shape) != 2 or \
                tuple(reversed(shape)) != tuple(spec.shape):
            return False
        return i in self.transposed or shape[0] != shape[1]


@dataclass(frozen=True, kw_only=True)
class Block:
    """A run of structurally identical module-container children, stored once.

    ``representative`` is the traced child (``layer_fqns[0]``); ``node_names`` are its nodes.
    """

    representative: str
    module_class: str
    layer_fqns: tuple[str, ...]
    layer_indices: tuple[int, ...]
    node_names: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.layer_fqns)


@dataclass(frozen=True, kw_only=True)
class Graph:
    """A traced model: nodes in execution order, repeated blocks, model inputs.

    ``batch_size`` and ``seq_len`` are the leading input dims that were traced (``seq_len``
    is ``None`` for non-token models); all FLOPs and bytes are for that much data.
    """

    nodes: tuple[Node, ...]
    blocks: tuple[Block, ...]
    inputs: tuple[TensorSpec, ...]
    model_class: str
    batch_size: int
    seq_len: int | None = None
    version: int = field(default=IR_VERSION)

    def __post_init__(self) -> None:
        names = [n.name for n in self.nodes]
        assert len(set(names)) == len(names), "node names must be unique"
        owned = [name for b in self.blocks for name in b.node_names]
        assert len(set(owned)) == len(owned), "a node belongs to at most one block"

    @cached_property
    def _multiplicity(self) -> dict[str, int]:
        mult = {n.name: 1 for n in self.nodes}
        for block in self.blocks:
            for name in block.node_names:
                mult[name] = block.count
        return mult

    @cached_property
    def from_inputs(self) -> dict[str, bool]:
        """Whether each node's outputs derive from the model's inputs -- activations, which
        grow with the batch and split along the sequence -- rather than from parameters,
        buffers and constants alone (a rotary table, a mask built from a buffer). Read only."""
        derived: dict[str, bool] = {}
        for node in self.nodes:
            derived[node.name] = any(src.startswith("input:") or derived.get(src, False)
                                     for src in node.input_sources)
        return derived

    def multiplicity(self, node: Node | str) -> int:
        """How many copies of a node the full model runs (its block's count, else 1)."""
        return self._multiplicity[node if isinstance(node, str) else node.name]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def _total(self, attr: str) -> int:
        return sum(getattr(n, attr) * self.multiplicity(n) for n in self.nodes)

    @property
    def flops_fwd(self) -> int:
        return self._total("flops_fwd")

    @property
    def flops_bwd(self) -> int:
        return self._total("flops_bwd")

    @property
    def saved_bytes(self) -> int:
        return self._total("saved_bytes")

    @property
    def saved_bytes_recompute(self) -> int:
        return self._total("saved_bytes_recompute")

    @cached_property
    def params(self) -> dict[str, ParamSpec]:
        """Parameters used by the traced nodes, by FQN (representatives only)."""
        seen: dict[str, ParamSpec] = {}
        for n in self.nodes:
            for p in n.params:
                seen.setdefault(p.fqn, p)
        return seen

    @property
    def num_params(self) -> int:
        """Parameters of the whole model: each used once, block parameters times the count."""
        count_of: dict[str, int] = {}
        for n in self.nodes:
            for p in n.params:
                count_of[p.fqn] = max(count_of.get(p.fqn, 0), self.multiplicity(n))
        return sum(self.params[fqn].numel * c for fqn, c in count_of.items())

    def block_of(self, node: Node | str) -> Block | None:
        name = node if isinstance(node, str) else node.name
        for block in self.blocks:
            if name in block.node_names:
                return block
        return None

    def to_dict(self) -> dict:
        """Plain JSON-able dict (enums as their values)."""
        data = asdict(self)
        for n in data["nodes"]:
            n["kind"] = n["kind"].value
        return data

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON form; equal graphs have equal fingerprints."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def summary(self) -> str:
        """A few lines for logs and reports."""
        lines = [
            f"{self.model_class}: {len(self.nodes)} nodes traced, {self.num_params:,} params, "
            f"fwd {self.flops_fwd:.3e} FLOPs, bwd {self.flops_bwd:.3e} FLOPs "
            f"(batch {self.batch_size}, seq {self.seq_len})",
        ]
        for b in self.blocks:
            if b.count > 1:
                lines.append(f"  block {b.representative} ({b.module_class}) x {b.count}")
        return "\n".join(lines)
