"""`ParallelConfig`: one point of the 5-D search space, and the checks that make it runnable.

A config fixes the degrees (dp·tp·pp·cp = world size; ep divides dp·cp, or tp·cp·dp when
folded over tp (`etp` = 1), and takes no extra ranks), the ZeRO stage, the micro-batch size,
the pipeline schedule and its virtual stages, Megatron sequence parallelism on the tp axis,
the activation-recompute policy, and the mesh order: how the (pp, dp, cp, tp) mesh lies on
the global ranks. Outer axis first, as PyTorch's DeviceMesh takes its dimensions; the last
axis is innermost (its groups are consecutive ranks, on one node as far as they fit), and
global rank r lives on node r // gpus_per_node. The default, pp, dp, cp, tp, is Megatron-LM's
and torchtitan's layout.
`check_config` says what is wrong and which values would work.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

from autopar.errors import InvalidConfigError

__all__ = ["ParallelConfig", "check_config", "divisors", "placed_order", "tp_splits_heads",
           "DEFAULT_MESH_ORDER",
           "PP_SCHEDULES", "RECOMPUTE_POLICIES", "PER_OP_ALTERNATED", "PER_OP_SAVED"]

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
RECOMPUTE_POLICIES = ("none", "selective", "per_op", "full")
# recompute="per_op", torchtitan's per-op selective checkpointing (selective_ac_option = "op",
# torchtitan/distributed/activation_checkpoint.py): inside each checkpointed block the outputs
# of these ops are kept for backward and everything else is re-run, except that every second
# matmul (`PER_OP_ALTERNATED`, counted together in forward order per block) is re-run too. A
# grouped GEMM (all experts of an MoE layer in one call) counts as one matmul, as does the
# forward GEMM of an fp8 weight (`autopar.runtime.fp8`). Biased Linear layers run `aten.addmm`,
# which the policy re-runs.
PER_OP_ALTERNATED = frozenset({"aten.mm.default", "aten._grouped_mm.default",
                               "aten._scaled_mm.default"})
PER_OP_SAVED = frozenset({
    *PER_OP_ALTERNATED,
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "aten.max.default",  # an amax of fp8 scaling
})
DEFAULT_MESH_ORDER = ("pp", "dp", "cp", "tp")  # outer first; tp innermost
_MESH_ORDERS = frozenset(itertools.permutations(DEFAULT_MESH_ORDER))


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """One way to parallelize a training step: the degree of each axis (their product is the
    world size) and how each is run."""

    dp: int = 1
    """Data-parallel replicas: each trains on its slice of the global batch."""
    tp: int = 1
    """Tensor-parallel ranks (within a node): each holds a slice of every sharded weight."""
    pp: int = 1
    """Pipeline stages: each rank group holds a contiguous run of layers."""
    cp: int = 1
    """Context-parallel ranks: each holds a share of every sequence; attention runs as a ring."""
    ep: int = 1
    """Expert-parallel ranks: each holds 1/ep of every MoE layer's experts. Drawn from dp x cp,
    or with `etp` = 1 from tp x cp x dp."""
    etp: int = 0
    """Tensor-parallel ranks that split each expert: 0 (the default; tp reads the same) means
    tp; 1 folds expert parallel over the tensor-parallel ranks (MoE parallel folding:
    Megatron-Core's --expert-tensor-parallel-size 1, torchtitan's
    expert_tensor_parallel_degree 1). Each expert is then whole on its rank, each tp rank
    dispatches its own sequence shard, and an ep group is ep consecutive ranks of the
    stage's (dp, cp, tp) ranks in mesh order."""
    zero_stage: int = 0
    """0: replicated states (DDP); 1: optimizer states sharded over dp x cp; 2: gradients too;
    3: parameters too, gathered per block (FSDP)."""
    micro_batch_size: int = 1
    """Sequences (or samples) per micro-batch; global batch / (dp x this) micro-batches a step."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"] = "1f1b"
    """The pipeline schedule (ignored at pp=1)."""
    virtual_stages: int = 1
    """Stages per pipeline rank (interleaved-1f1b only)."""
    sequence_parallel: bool = False
    """Under tp, the activations between sub-layers (norms, dropout, residual adds) are split
    on the sequence: reduce-scatter and all-gather replace tp's all-reduces."""
    recompute: Literal["none", "selective", "per_op", "full"] = "none"
    """Activation recompute: "selective" re-runs the attention core (Korthikanti et al.),
    "per_op" keeps only the outputs of attention and of every other matmul of each block
    (`PER_OP_SAVED`), "full" keeps each block's input alone."""
    recompute_every: int = 1
    """With recompute="full": one block in every `recompute_every` is checkpointed, the others
    keep their activations (torchtitan's selective_ac_option = k; Megatron-LM's block method
    with a 1/k share of each stage's layers)."""
    mesh_order: tuple[str, ...] = DEFAULT_MESH_ORDER
    """How the axes are laid over the ranks, outer first (also given as "dp,pp,cp,tp"); by
    default tp innermost, within a node."""

    def __post_init__(self) -> None:
        if type(self.mesh_order) is not tuple or self.mesh_order not in _MESH_ORDERS:
            self._read_mesh_order()  # a list, a string, or wrong
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch_size", "virtual_stages",
                     "recompute_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be an integer >= 1, got {value!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"ParallelConfig.zero_stage must be 0 (DDP), 1, 2 or 3 (FSDP), "
                             f"got {self.zero_stage!r}")
        if self.etp == self.tp and not isinstance(self.etp, bool):  # one layout, one spelling
            object.__setattr__(self, "etp", 0)
        if self.etp not in (0, 1) or isinstance(self.etp, bool):
            raise ValueError(f"ParallelConfig.etp must be 0 or tp (experts split over tp) or 1 "
                             f"(experts whole, ep folded over tp), got {self.etp!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"ParallelConfig.pp_schedule {self.pp_schedule!r} is unknown; "
                             f"allowed: {', '.join(PP_SCHEDULES)}")
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(f"ParallelConfig.recompute {self.recompute!r} is unknown; "
                             f"allowed: {', '.join(RECOMPUTE_POLICIES)}")
        if self.recompute_every > 1 and self.recompute != "full":
            raise ValueError(f"recompute_every={self.recompute_every} needs recompute='full' "
                             f"(got {self.recompute!r}): it says which blocks full recompute "
                             f"checkpoints")
        if self.virtual_stages > 1 and self.pp_schedule != "interleaved-1f1b":
            raise ValueError(f"virtual_stages={self.virtual_stages} needs "
                             f"pp_schedule='interleaved-1f1b' (got {self.pp_schedule!r})")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError("ParallelConfig.sequence_parallel must be True or False")

    def _read_mesh_order(self) -> None:
        order = self.mesh_order
        if isinstance(order, str):
            order = tuple(part.strip() for part in re.split(r"[,\s]+", order.strip()) if part)
        elif isinstance(order, list):
            order = tuple(order)
        if not (isinstance(order, tuple) and all(isinstance(a, str) for a in order)
                and order in _MESH_ORDERS):
            raise ValueError(f"ParallelConfig.mesh_order must name each of the mesh axes "
                             f"{', '.join(DEFAULT_MESH_ORDER)} once, outer first (e.g. "
                             f"{','.join(DEFAULT_MESH_ORDER)}, tp innermost), got "
                             f"{self.mesh_order!r}")
        object.__setattr__(self, "mesh_order", order)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def folded(self) -> bool:
        """Expert parallel folded over the tensor-parallel ranks (`etp` = 1 under tp > 1)."""
        return self.etp == 1 and self.tp > 1

    @property
    def expert_tp(self) -> int:
        """The ranks that split each expert's weights: tp, or 1 when `folded`."""
        return 1 if self.folded else self.tp

    @property
    def expert_dp(self) -> int:
        """Ranks of a pipeline stage holding the same expert weights (they reduce those
        gradients and shard their ZeRO states): dp x cp x tp over ep x `expert_tp`."""
        return self.dp * self.cp * self.tp // (self.ep * self.expert_tp)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: Any) -> "ParallelConfig":
        """The config of a candidate-table row or a saved dict: numpy scalars as Python
        values, a JSON list (the mesh order) as a tuple, a field the record lacks (a plan
        saved before it existed) at its default."""
        values = {}
        for name in cls.__dataclass_fields__:
            if name in record:
                value = record[name]
                values[name] = value.item() if hasattr(value, "item") else \
                    tuple(value) if isinstance(value, list) else value
        return cls(**values)

    def short(self) -> str:
        """A compact label, e.g. 'dp8 tp8 pp16 z1 mb1 1f1b sp rc=selective' ('rc=full/2': one
        block in two checkpointed; and 'mesh=dp,pp,cp,tp' when the mesh order is not the
        default)."""
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += ["etp1"] if self.folded else []
        parts += [f"z{self.zero_stage}", f"mb{self.micro_batch_size}"]
        if self.pp > 1:
            parts.append(self.pp_schedule + (f"x{self.virtual_stages}" if self.virtual_stages > 1
                                             else ""))
        parts += ["sp"] if self.sequence_parallel else []
        parts.append(f"rc={self.recompute}" + (f"/{self.recompute_every}"
                                               if self.recompute_every > 1 else ""))
        if self.mesh_order != DEFAULT_MESH_ORDER:
            parts.append("mesh=" + ",".join(self.mesh_order))
        return " ".join(parts)


def placed_order(order: tuple[str, ...], sizes) -> tuple[str, ...]:
    """The axes of mesh order `order` with more than one rank (`sizes[axis]`): two orders lay
    a config's ranks out alike exactly when these agree (an axis of one rank sits anywhere)."""
    return tuple(a for a in order if sizes[a] > 1)


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending (pairs d, n // d up to sqrt(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


# Schedules that run with fewer micro-batches than pipeline ranks: GPipe (every rank runs all
# forwards, then all backwards; PyTorch's ScheduleGPipe takes any number) and 1F1B as
# Megatron-LM and DeepSpeed run it (the warm-up capped at the micro-batches; PyTorch's
# Schedule1F1B refuses it, so autopar's runtime runs such a plan in GPipe's order and the
# search offers GPipe there)
FEW_MICROBATCHES = ("gpipe", "1f1b")


def tp_splits_heads(tp: int, num_heads: int | None, num_kv_heads: int | None) -> bool:
    """Whether tensor parallel over ``tp`` ranks splits attention of these heads: tp divides
    the query heads, and divides the key/value heads or is a multiple of them: each rank then
    computes K and V whole (with Q where one GEMM makes all three) and reads the kv heads its
    query heads use (`autopar.estimate.kv.kv_whole`). Megatron-LM and torchtitan split K
    and V by head and need tp to divide them (`autopar.targets`)."""
    if num_heads is not None and num_heads % tp:
        return False
    return num_kv_heads is None or num_kv_heads % tp == 0 or tp % num_kv_heads == 0


def _check_folded(cfg: ParallelConfig) -> None:
    """What MoE parallel folding (`ParallelConfig.etp` = 1) needs besides the rest."""
    pool = cfg.tp * cfg.cp * cfg.dp
    if pool % cfg.ep:
        raise InvalidConfigError(f"ep={cfg.ep} folded over tp x cp x dp must divide "
                                 f"{cfg.tp}*{cfg.cp}*{cfg.dp} = {pool}; allowed ep: "
                                 f"{divisors(pool)}")
    if not cfg.sequence_parallel:
        raise InvalidConfigError(
            f"etp=1 with tp={cfg.tp} needs sequence_parallel=True: each tp rank dispatches its "
            f"own sequence shard to the experts (Megatron-Core requires sequence parallel for "
            f"MoE under tp); set sequence_parallel=True or use etp=0")


def check_config(cfg: ParallelConfig, *, world_size: int, global_batch_size: int,
                 num_layers: int, num_heads: int | None = None,
                 num_kv_heads: int | None = None, num_experts: int | None = None,
                 seq_len: int | None = None) -> int:
    """Raise InvalidConfigError when `cfg` cannot run; return the number of micro-batches per
    step."""
    if cfg.world_size != world_size:
        rest = cfg.tp * cfg.pp * cfg.cp
        hint = (f"dp={world_size // rest} would match" if world_size % rest == 0 else
                f"tp*pp*cp = {rest} must divide it (divisors: {divisors(world_size)})")
        raise InvalidConfigError(
            f"dp*tp*pp*cp = {cfg.dp}*{cfg.tp}*{cfg.pp}*{cfg.cp} = {cfg.world_size}, "
            f"but the cluster has {world_size} GPUs; {hint}")
    if num_heads is not None and num_heads % cfg.tp:
        raise InvalidConfigError(
            f"tp={cfg.tp} must divide the {num_heads} attention heads; allowed tp: "
            f"{[d for d in divisors(num_heads) if world_size % d == 0]}")
    if not tp_splits_heads(cfg.tp, num_heads, num_kv_heads):
        # a rank cannot hold part of a head
        allowed = [d for d in divisors(num_heads or num_kv_heads) if world_size % d == 0
                   and tp_splits_heads(d, num_heads, num_kv_heads)]
        raise InvalidConfigError(
            f"tp={cfg.tp} must divide the {num_kv_heads} key/value heads (K and V are split "
            f"by head) or be a multiple of them (K and V are then replicated); allowed tp: "
            f"{allowed}")
    if cfg.folded:
        _check_folded(cfg)
    elif (cfg.dp * cfg.cp) % cfg.ep:
        fold = (f", or etp=1 to fold ep over tp x cp x dp = {cfg.tp * cfg.cp * cfg.dp}"
                if cfg.tp > 1 and (cfg.tp * cfg.cp * cfg.dp) % cfg.ep == 0 else "")
        raise InvalidConfigError(f"ep={cfg.ep} must divide dp*cp = {cfg.dp * cfg.cp}; allowed ep: "
                                 f"{divisors(cfg.dp * cfg.cp)}{fold}")
    if cfg.ep > 1 and cfg.dp > 1 and cfg.cp > 1 and not cfg.folded:
        # ep groups are runs of ep replicas, the (dp, cp) ranks flattened outer first; with an
        # axis between dp and cp, a run that crosses the inner axis is no strided slice
        i, j = sorted((cfg.mesh_order.index("dp"), cfg.mesh_order.index("cp")))
        between = [a for a in cfg.mesh_order[i + 1:j] if getattr(cfg, a) > 1]
        inner, n = cfg.mesh_order[j], getattr(cfg, cfg.mesh_order[j])
        if between and n % cfg.ep and cfg.ep % n:
            raise InvalidConfigError(f"ep={cfg.ep} groups would cross {inner}={n} in mesh_order "
                             f"{','.join(cfg.mesh_order)}, where {','.join(between)} lies "
                             f"between dp and cp (no DeviceMesh slice holds them): use an ep "
                             f"that divides {n} or is a multiple of it, or put dp next to cp")
    if num_experts is not None and cfg.ep > 1 and num_experts % cfg.ep:
        pool = cfg.dp * cfg.cp * (cfg.tp if cfg.folded else 1)
        raise InvalidConfigError(f"ep={cfg.ep} must divide the {num_experts} experts; allowed ep: "
                                 f"{[d for d in divisors(num_experts) if pool % d == 0]}")
    if cfg.ep > 1 and not num_experts:
        raise InvalidConfigError(
            f"ep={cfg.ep} needs a model with experts (MoE); this model has none")
    if cfg.folded and not num_experts:
        raise InvalidConfigError("etp=1 (experts whole, ep folded over tp) needs a model with "
                                 "experts (MoE); this model has none: use etp=0")
    if cfg.sequence_parallel and cfg.tp > 1 and seq_len is not None \
            and seq_len % (cfg.tp * cfg.cp):
        raise InvalidConfigError(
            f"sequence_parallel with tp={cfg.tp} splits each context-parallel rank's "
            f"{seq_len} / cp={cfg.cp} tokens over tp, which must divide them; use a tp that "
            f"divides {seq_len // cfg.cp if seq_len % cfg.cp == 0 else seq_len}, or "
            f"sequence_parallel=False")
    if seq_len is not None and seq_len % (2 * cfg.cp) and cfg.cp > 1:
        raise InvalidConfigError(
            f"cp={cfg.cp} needs seq_len divisible by 2*cp = {2 * cfg.cp} (causal "
            f"load balancing splits the sequence in 2*cp chunks); seq_len={seq_len}")
    per_replica = cfg.dp * cfg.micro_batch_size
    if global_batch_size % per_replica:
        ok = divisors(global_batch_size // cfg.dp) if global_batch_size % cfg.dp == 0 else []
        raise InvalidConfigError(
            f"global_batch_size={global_batch_size} is not a multiple of dp*micro_batch_size = "
            f"{cfg.dp}*{cfg.micro_batch_size}" + (f"; micro_batch_size could be one of {ok}" if ok
                                                   else f"; dp must divide {global_batch_size}"))
    num_microbatches = global_batch_size // per_replica
    stages = cfg.pp * cfg.virtual_stages
    if stages > num_layers:
        raise InvalidConfigError(
            f"pp*virtual_stages = {stages} stages for {num_layers} layers: every "
            f"stage needs at least one layer")
    if cfg.pp > 1 and num_microbatches < cfg.pp and cfg.pp_schedule not in FEW_MICROBATCHES:
        raise InvalidConfigError(
            f"pp_schedule={cfg.pp_schedule} with pp={cfg.pp} needs at least {cfg.pp} "
            f"micro-batches per step, one per pipeline rank; global_batch_size / "
            f"(dp*micro_batch_size) = {global_batch_size} / ({cfg.dp}*{cfg.micro_batch_size}) "
            f"= {num_microbatches}: lower micro_batch_size, dp or pp, or use "
            f"{' or '.join(FEW_MICROBATCHES)} (they run fewer micro-batches than ranks, "
            f"with a larger bubble)")
    if cfg.pp_schedule == "interleaved-1f1b" and cfg.pp > 1 and num_microbatches % cfg.pp:
        raise InvalidConfigError(
            f"interleaved-1f1b needs the {num_microbatches} micro-batches to be a "
            f"multiple of pp={cfg.pp}")
    return num_microbatches
