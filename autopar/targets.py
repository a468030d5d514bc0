"""The engines a plan can be made for, each as one declarative table of what it runs.

`autopar.compile(..., target=NAME)` searches only the configurations the named engine runs, at
the version its table states; costs them with the engine's software preset
(`autopar.SOFTWARE`); and returns a plan whose export to that engine
(`autopar.plan.export.export_plan`) has no notes. The default target, "autopar", is autopar's
own runtime: no rule here (what the runtime cannot run for a given model is read from the
model, `autopar.runtime.capabilities`).

A table (`EngineTarget`) holds:

- `allowed` (`Allowed`): the values the engine takes for a `ParallelConfig` field;
- `requires` (`Requires`): combinations, as predicates over the search's config columns
  (`autopar.search.space.ConfigTable`, one mask per rule), which may read the model's layer
  structure and the software options (`Facts`);
- `settings` (`Setting`): what the engine takes of the precision and the software options,
  checked once before the search;
- how pipelines are searched: the schedules the engine runs with fewer micro-batches than
  pipeline ranks (`few_microbatches`), and whether the stages may be cut unevenly
  (`uneven_stages`: else the even cut of `autopar.estimate.stages` is kept).

Every rule says why (the `reason`) and where it was read (the `source`, a file of the
engine's repository at the stated version). They are the export's notes read the other way
round: each note of `autopar/plan/export.py` that says the engine cannot take a choice is a
rule here, and tests/unit/test_targets.py checks that the plans made for each engine export to
it without a note. A pin, precision or option outside a table is refused at compile time with
the rule, its source and what is allowed (`TargetRuleError`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.config import DEFAULT_MESH_ORDER, FEW_MICROBATCHES, ParallelConfig
from autopar.errors import InvalidConfigError, TargetRuleError
from autopar.estimate.core import EstimateOptions, ModelCosts
from autopar.estimate.stages import layer_sequence, megatron_boundaries
from autopar.estimate.units import Unit
from autopar.plan.export import glue_layout, is_block_entry
from autopar.search.space import ConfigTable, encode

__all__ = ["AUTOPAR", "Allowed", "DEEPSPEED", "EngineTarget", "Facts", "MEGATRON", "Requires",
           "Setting", "TARGETS", "TORCHTITAN", "get_target"]


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What rules read besides a config: the model's layers (its cost units) and token
    sequence, the training precision and the software options the plan is costed with."""

    units: tuple[Unit, ...]
    dtype: str
    options: EstimateOptions
    seq_len: int | None = None
    """Tokens per sequence; None for a model traced from other example inputs."""
    num_kv_heads: int | None = None
    """Key/value heads of the model's attention; None without attention."""

    @classmethod
    def of(cls, costs: ModelCosts, dtype: str, options: EstimateOptions) -> "Facts":
        return cls(units=costs.units, dtype=dtype, options=options, seq_len=costs.seq_len,
                   num_kv_heads=costs.num_kv_heads)

    @functools.cached_property
    def layers(self) -> tuple[str, ...]:
        """Every layer's stage entry, in model order (as `Plan.stages` lists them)."""
        return tuple(fqn for _, fqn in layer_sequence(self.units))

    @functools.cached_property
    def _glue(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return glue_layout(list(self.layers))

    @property
    def middle_glue(self) -> tuple[str, ...]:
        """Glue between the repeated blocks (not before the first or after the last)."""
        return self._glue[0]

    @property
    def glue_parents(self) -> tuple[str, ...]:
        """Glue module names that are a parent module of the blocks."""
        return self._glue[1]

    def even_blocks(self, chunks: int) -> tuple[int, ...]:
        """Blocks per chunk of the even cut into `chunks` (pipeline) chunks, or () when
        there are fewer layers than chunks."""
        if not self.units or chunks > len(self.layers):
            return ()
        try:
            cuts = megatron_boundaries(self.units, chunks)
        except InvalidConfigError:  # fewer blocks than chunks
            return ()
        return tuple(sum(is_block_entry(n) for n in self.layers[a:b]) for a, b in cuts.tolist())

    def even_cut_uniform(self, chunks: int) -> bool:
        """Whether the even cut gives every chunk the same number of blocks (at least one)."""
        counts = self.even_blocks(chunks)
        return bool(counts) and counts[0] > 0 and len(set(counts)) == 1


Mask = Callable[[ConfigTable, Facts], np.ndarray]


@dataclass(frozen=True, kw_only=True, slots=True)
class Allowed:
    """The values an engine takes for one ParallelConfig field."""

    field: str
    values: tuple[Any, ...]
    reason: str
    source: str

    @property
    def name(self) -> str:
        return f"{self.field} in {{{', '.join(map(str, self.values))}}}"

    def mask(self, table: ConfigTable, facts: Facts) -> np.ndarray:
        codes = [encode(self.field, v) for v in self.values]
        return np.isin(table.columns[self.field], codes)


@dataclass(frozen=True, kw_only=True, slots=True)
class Requires:
    """A combination an engine needs: `holds` marks the rows of a config table it takes."""

    name: str
    holds: Mask
    reason: str
    source: str

    def mask(self, table: ConfigTable, facts: Facts) -> np.ndarray:
        return np.broadcast_to(self.holds(table, facts), (len(table),))


@dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """What an engine takes of the precision or the software options."""

    name: str
    holds: Callable[[Facts], bool]
    reason: str
    source: str


Rule = Allowed | Requires


def _describe(rule: Allowed | Requires | Setting) -> str:
    return f"{rule.name}: {rule.reason} (source: {rule.source})"


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineTarget:
    """One engine at a stated version: what it runs, and how plans for it are costed."""

    name: str
    """The target's name, as `compile(target=...)` and the export formats spell it."""
    engine: str
    """The engine and the version its rules were read from."""
    software: str
    """The `autopar.SOFTWARE` preset plans for it are costed with, unless the caller passes
    `software` or `options`."""
    allowed: tuple[Allowed, ...] = ()
    requires: tuple[Requires, ...] = ()
    settings: tuple[Setting, ...] = ()
    few_microbatches: tuple[str, ...] = ("gpipe",)
    """Schedules searched with fewer micro-batches than pipeline ranks (of FEW_MICROBATCHES)."""
    uneven_stages: bool = True
    """The inter-op DP may re-cut the winner's stages unevenly; else the even cut is kept."""
    runtime_limits: bool = False
    """Plans run on autopar's runtime, whose limits for the model apply
    (`autopar.runtime.capabilities`); an engine runs its own implementation of the model."""

    @property
    def rules(self) -> tuple[Rule, ...]:
        return self.allowed + self.requires

    @property
    def restricts(self) -> bool:
        return bool(self.rules)

    def allows(self, table: ConfigTable, facts: Facts) -> np.ndarray:
        """Per row of `table`: whether the engine runs that config (every rule holds)."""
        keep = np.ones(len(table), dtype=bool)
        for rule in self.rules:
            keep &= rule.mask(table, facts)
        return keep

    def violations(self, cfg: ParallelConfig, facts: Facts) -> list[str]:
        """The rules `cfg` breaks, each with its reason and source."""
        table = ConfigTable.of([cfg])
        return [_describe(rule) for rule in self.rules if not rule.mask(table, facts)[0]]

    def check(self, constraints: dict[str, Any], facts: Facts) -> None:
        """Refuse (TargetRuleError) a pin outside an `allowed` rule, and a precision or
        software option outside a `settings` rule, naming the rule, its source and what is
        allowed."""
        for rule in self.allowed:
            if rule.field in constraints and constraints[rule.field] not in rule.values:
                raise TargetRuleError(
                    f"{rule.field}={constraints[rule.field]!r} cannot run on {self.engine} "
                    f"(target={self.name!r}): {rule.reason}; allowed {rule.field}: "
                    f"{', '.join(map(repr, rule.values))} (source: {rule.source})")
        for setting in self.settings:
            if not setting.holds(facts):
                raise TargetRuleError(
                    f"target={self.name!r} ({self.engine}) cannot take this plan's "
                    f"{setting.name}: {setting.reason} (source: {setting.source})")

    def why_empty(self, table: ConfigTable, facts: Facts) -> str:
        """Why no row of `table` (non-empty) is left under the rules: the rules that each
        exclude every row, else all rules that exclude some."""
        binding = [r for r in self.rules if not r.mask(table, facts).any()]
        if not binding:
            binding = [r for r in self.rules if not r.mask(table, facts).all()]
            lead = "no configuration meets these rules together"
        else:
            lead = "every configuration breaks " + ("this rule" if len(binding) == 1 else
                                                    "each of these rules")
        return (f"{self.engine} (target={self.name!r}) runs none of the {len(table):,} "
                f"configurations left by the pins: {lead}: "
                + "; ".join(_describe(r) for r in binding))


# ---------------------------------------------------------------------------------- predicates


def _lays_out_like(table: ConfigTable, other: tuple[str, ...]) -> np.ndarray:
    """Per row: whether the table's mesh order puts the ranks where `other` does (every two
    axes of more than one rank in the same order; `autopar.config.placed_order`)."""
    mine, keep = table.mesh_order, np.ones(len(table), dtype=bool)
    for a, b in itertools.combinations(DEFAULT_MESH_ORDER, 2):
        if (mine.index(a) < mine.index(b)) != (other.index(a) < other.index(b)):
            keep &= (table.columns[a] == 1) | (table.columns[b] == 1)
    return keep


def _default_layout(table: ConfigTable, facts: Facts) -> np.ndarray:
    return _lays_out_like(table, DEFAULT_MESH_ORDER)


def _megatron_layout(table: ConfigTable, facts: Facts) -> np.ndarray:
    c = table.columns
    other = (c["cp"] == 1) & (c["ep"] == 1) & _lays_out_like(table, ("dp", "pp", "cp", "tp"))
    return _default_layout(table, facts) | other


def _no_pp_with_middle_glue(table: ConfigTable, facts: Facts) -> np.ndarray:
    return (table.columns["pp"] == 1) | (not facts.middle_glue)


def _no_pp_with_glue_parents(table: ConfigTable, facts: Facts) -> np.ndarray:
    return (table.columns["pp"] == 1) | (not facts.glue_parents)


def _sp_with_overlapped_tp(table: ConfigTable, facts: Facts) -> np.ndarray:
    c = table.columns
    return (c["tp"] == 1) | (c["sequence_parallel"] == 1) | (not facts.options.overlap_tp_comm)


def _sp_with_tp(table: ConfigTable, facts: Facts) -> np.ndarray:
    c = table.columns
    return (c["tp"] == 1) | (c["sequence_parallel"] == 1)


def _ddp_alone(table: ConfigTable, facts: Facts) -> np.ndarray:
    c = table.columns
    return (c["zero_stage"] != 0) | (c["dp"] == 1) | \
        ((c["tp"] == 1) & (c["pp"] == 1) & (c["cp"] == 1))


def _titan_experts(table: ConfigTable, facts: Facts) -> np.ndarray:
    c = table.columns
    borrowed = np.where(c["zero_stage"] == 3, c["dp"], 1) * c["cp"]
    borrowed *= np.where(c["etp"] == 1, c["tp"], 1)  # folded: tp's ranks too
    within = np.where(c["etp"] == 1, c["tp"], 1) * c["cp"]
    return ((c["ep"] == 1) & (c["etp"] == 0)) | \
        ((c["ep"] % within == 0) & (borrowed % c["ep"] == 0))


def _kv_split_by_head(table: ConfigTable, facts: Facts) -> np.ndarray:
    return facts.num_kv_heads is None or facts.num_kv_heads % table.columns["tp"] == 0


def _pipe_zero1(table: ConfigTable, facts: Facts) -> np.ndarray:
    c = table.columns
    return (c["pp"] == 1) | (c["zero_stage"] <= 1)


def _pipe_checkpoints_all(table: ConfigTable, facts: Facts) -> np.ndarray:
    c = table.columns
    return (c["pp"] == 1) | (c["recompute_every"] == 1)


def _experts_below_zero3(table: ConfigTable, facts: Facts) -> np.ndarray:
    c = table.columns
    return (c["ep"] == 1) | (c["zero_stage"] <= 2)


def _even_uniform_stages(table: ConfigTable, facts: Facts) -> np.ndarray:
    c = table.columns
    chunks = c["pp"] * c["virtual_stages"]
    keep = c["pp"] == 1
    for n in np.unique(chunks[~keep]).tolist():
        if facts.even_cut_uniform(int(n)):
            keep = keep | (chunks == n)
    return keep


# ---------------------------------------------------------------------------------- the tables

_MEGATRON_ARGS = "megatron/training/arguments.py"

MEGATRON = EngineTarget(
    name="megatron", engine="Megatron-LM core_r0.13.0", software="megatron",
    allowed=(
        Allowed(field="zero_stage", values=(0, 1),
                reason="the distributed optimizer (--use-distributed-optimizer) shards the "
                       "optimizer states only (ZeRO-1) and keeps a full gradient buffer on "
                       "every rank; sharded gradients or parameters are Megatron FSDP "
                       "(--use-megatron-fsdp), another data-parallel path than the one the "
                       "export writes",
                source=f"{_MEGATRON_ARGS} (--use-distributed-optimizer, --use-megatron-fsdp, "
                       f"--data-parallel-sharding-strategy)"),
        Allowed(field="pp_schedule", values=("1f1b", "interleaved-1f1b"),
                reason="it runs 1F1B (with fewer micro-batches than stages too: its warm-up "
                       "is capped) and interleaved 1F1B; it has no GPipe and no zero-bubble "
                       "schedule (ZB-H1 lives in the sail-sg/zero-bubble-pipeline-parallelism "
                       "fork)",
                source="megatron/core/pipeline_parallel/schedules.py "
                       "(get_forward_backward_func)"),
        Allowed(field="recompute", values=("none", "selective", "full"),
                reason="--recompute-granularity is full (whole layers) or selective (the "
                       "submodules --recompute-modules names, core_attn by default); it has "
                       "no policy that keeps every other matmul's output (per_op)",
                source=f"{_MEGATRON_ARGS} (--recompute-granularity, --recompute-modules)"),
    ),
    requires=(
        Requires(name="tp > 1 with sequence_parallel while tp communication is overlapped",
                 holds=_sp_with_overlapped_tp,
                 reason="the plan is costed with tp communication under the GEMMs "
                        "(EstimateOptions.overlap_tp_comm), which is --tp-comm-overlap, and "
                        "that flag needs --sequence-parallel",
                 source=f"{_MEGATRON_ARGS} (validate_args: --tp-comm-overlap)"),
        Requires(name="tp divides the key/value heads", holds=_kv_split_by_head,
                 reason="each tp rank holds num_query_groups / tp whole K/V heads; it does not "
                        "replicate K and V where tp exceeds them",
                 source="megatron/core/transformer/attention.py "
                        "(num_query_groups_per_partition = divide(num_query_groups, tp))"),
        Requires(name="mesh order tp-cp-ep-dp-pp (inner first)", holds=_megatron_layout,
                 reason="ranks are laid out tp-cp-ep-dp-pp, inner first, or without cp and "
                        "ep tp-pp-dp (--use-tp-pp-dp-mapping); other mesh orders put the "
                        "groups on other GPUs than planned",
                 source="megatron/training/initialize.py (RankGenerator order)"),
        Requires(name="pp = 1 when modules lie between the transformer layers",
                 holds=_no_pp_with_middle_glue,
                 reason="a pipeline layout places the embedding, the transformer layers and "
                        "the loss; a module between two transformer layers has no place in it",
                 source="megatron/core/transformer/pipeline_parallel_layer_layout.py"),
    ),
    settings=(
        Setting(name="inputs", holds=lambda f: f.seq_len is not None,
                reason="its trainers train on token sequences (--seq-length), and this model "
                       "was traced from other example inputs",
                source=f"{_MEGATRON_ARGS} (--seq-length)"),
        Setting(name="gradient reduction dtype",
                holds=lambda f: f.options.grad_reduce_dtype in ("fp32", "bf16")
                or f.dtype == "fp16",
                reason="gradients are reduced in fp32, or bf16 with --grad-reduce-in-bf16, "
                       "or in fp16 when training in fp16; set EstimateOptions."
                       "grad_reduce_dtype to 'fp32' or 'bf16'",
                source=f"{_MEGATRON_ARGS} (--grad-reduce-in-bf16)"),
        Setting(name="fp8 recipe",
                holds=lambda f: f.dtype != "fp8" or f.options.fp8_recipe in ("delayed",
                                                                             "tensorwise"),
                reason="--fp8-recipe takes delayed, tensorwise, mxfp8 or blockwise, no "
                       "rowwise; set EstimateOptions.fp8_recipe to 'delayed' or 'tensorwise'",
                source=f"{_MEGATRON_ARGS} (--fp8-recipe)"),
    ),
    few_microbatches=("1f1b",))

_TITAN_CONFIG = "torchtitan/config/job_config.py"

TORCHTITAN = EngineTarget(
    name="torchtitan", engine="torchtitan at commit 37e536d (2025-09-30)",
    software="torchtitan",
    allowed=(
        Allowed(field="zero_stage", values=(0, 3),
                reason="it shards with FSDP2 (data_parallel_shard_degree: parameters, "
                       "gradients and optimizer states) or replicates with DDP "
                       "(data_parallel_replicate_degree); it has no optimizer-state-only or "
                       "gradient-only sharding",
                source=f"{_TITAN_CONFIG} ([parallelism] data_parallel_*_degree)"),
        Allowed(field="recompute", values=("none", "per_op", "full"),
                reason="its selective checkpointing is per op (selective_ac_option = \"op\": "
                       "the policy recompute='per_op' costs) or every n-th layer; it has no "
                       "attention-only selective recompute",
                source=f"{_TITAN_CONFIG} ([activation_checkpoint] mode, "
                       f"selective_ac_option)"),
        Allowed(field="pp_schedule", values=("gpipe", "1f1b", "interleaved-1f1b"),
                reason="PyTorch's zero-bubble schedules it takes are multi-stage "
                       "(InterleavedZeroBubble, ZBVZeroBubble), and the plan's zero-bubble "
                       "is ZB-H1 with one stage per rank; its 1F1B needs a micro-batch per "
                       "rank",
                source="torchtitan/distributed/pipeline_parallel.py (get_schedule_class of "
                       "torch.distributed.pipelining.schedules)"),
    ),
    requires=(
        Requires(name="tp > 1 with sequence_parallel", holds=_sp_with_tp,
                 reason="its tensor-parallel plan always shards the norms and residual "
                        "stream on the sequence (SequenceParallel)",
                 source="torchtitan/models/llama3/infra/parallelize.py (apply_tp)"),
        Requires(name="tp divides the key/value heads", holds=_kv_split_by_head,
                 reason="its tensor-parallel plan splits wk and wv column-wise "
                        "(ColwiseParallel) and views each rank's shard as whole heads; it "
                        "does not replicate K and V where tp exceeds them",
                 source="torchtitan/models/llama3/infra/parallelize.py (apply_tp)"),
        Requires(name="ZeRO-0 (DDP) over dp > 1 only as the sole parallelism",
                 holds=_ddp_alone,
                 reason="DDP runs only when data_parallel_replicate_degree spans the world "
                        "(\"DDP has not supported > 1D parallelism\"); with tp, pp or cp use "
                        "ZeRO-3 (FSDP2)",
                 source="torchtitan/models/llama3/infra/parallelize.py (parallelize_llama)"),
        Requires(name="ep within the FSDP-shard x context-parallel (x tp) ranks",
                 holds=_titan_experts,
                 reason="expert parallel borrows its ranks from data_parallel_shard_degree "
                        "x context_parallel_degree: ep % cp == 0 and (dp_shard * cp) % ep == 0, "
                        "with dp_shard = dp under ZeRO-3 and 1 otherwise; with "
                        "expert_tensor_parallel_degree 1 (etp=1) from tp's ranks too: "
                        "ep % (cp * tp) == 0 and (dp_shard * cp * tp) % ep == 0",
                 source="torchtitan/distributed/parallel_dims.py (ParallelDims._validate)"),
        Requires(name="mesh order pp, dp, cp, tp", holds=_default_layout,
                 reason="its mesh is pp, dp_replicate, dp_shard, cp, tp, outer first; other "
                        "mesh orders put the groups on other GPUs than planned",
                 source="torchtitan/distributed/parallel_dims.py (build_mesh)"),
        Requires(name="pp = 1 when modules lie between the transformer layers",
                 holds=_no_pp_with_middle_glue,
                 reason="module_fqns_per_model_part names the glue by its top-level module "
                        "only, which cannot say where a module between two transformer layers "
                        "falls",
                 source=f"{_TITAN_CONFIG} (module_fqns_per_model_part)"),
        Requires(name="pp = 1 when the embedding or the head sit under the layers' parent",
                 holds=_no_pp_with_glue_parents,
                 reason="module_fqns_per_model_part would list the parent module of the "
                        "transformer layers for the embedding and the final norm",
                 source=f"{_TITAN_CONFIG} (module_fqns_per_model_part)"),
    ),
    settings=(
        Setting(name="inputs", holds=lambda f: f.seq_len is not None,
                reason="it trains language models on token sequences ([training] seq_len), "
                       "and this model was traced from other example inputs",
                source=f"{_TITAN_CONFIG} ([training] seq_len)"),
        Setting(name="precision", holds=lambda f: f.dtype != "fp16",
                reason="mixed_precision_param is bfloat16 or float32 (and fp8 through the "
                       "quantize.linear.float8 converter): plan in bf16, fp32 or fp8",
                source=f"{_TITAN_CONFIG} ([training] mixed_precision_param)"),
        Setting(name="gradient reduction dtype",
                holds=lambda f: f.options.grad_reduce_dtype == "fp32",
                reason="gradients are reduced in float32 only (mixed_precision_reduce); set "
                       "EstimateOptions.grad_reduce_dtype to 'fp32'",
                source=f"{_TITAN_CONFIG} ([training] mixed_precision_reduce)"),
        Setting(name="fp8 recipe",
                holds=lambda f: f.dtype != "fp8" or f.options.fp8_recipe in ("tensorwise",
                                                                             "rowwise"),
                reason="its float8 recipes are tensorwise and rowwise (torchao's dynamic "
                       "scaling); there is no delayed scaling: set EstimateOptions.fp8_recipe "
                       "to 'tensorwise' or 'rowwise'",
                source=f"{_TITAN_CONFIG} ([quantize.linear.float8] recipe_name)"),
    ))

_DS_PIPE = "deepspeed/runtime/pipe/engine.py"

DEEPSPEED = EngineTarget(
    name="deepspeed", engine="DeepSpeed 0.16.4", software="deepspeed",
    allowed=(
        Allowed(field="tp", values=(1,),
                reason="its config sets tensor parallelism only as AutoTP "
                       "(tensor_parallel.autotp_size), which picks the column/row split of "
                       "Hugging Face-style linear layers itself, not the plan's placements "
                       "(Megatron-DeepSpeed's tensor parallelism is a flag of its model, "
                       "outside the config)",
                source="deepspeed/runtime/tensor_parallel/config.py, "
                       "deepspeed/module_inject/auto_tp.py"),
        Allowed(field="cp", values=(1,),
                reason="its sequence parallelism is Ulysses (all-to-all over attention "
                       "heads), not the K/V ring the estimate costs",
                source="deepspeed/sequence/layer.py (DistributedAttention)"),
        Allowed(field="recompute", values=("none", "full"),
                reason="it checkpoints whole modules (deepspeed.checkpointing.checkpoint); "
                       "it has no attention-only or per-op selective recompute",
                source="deepspeed/runtime/activation_checkpointing/checkpointing.py"),

        Allowed(field="pp_schedule", values=("1f1b",),
                reason="the pipeline engine runs its own 1F1B-style schedule "
                       "(TrainSchedule, also with fewer micro-batches than stages): no GPipe, "
                       "interleaved or zero-bubble schedule",
                source="deepspeed/runtime/pipe/schedule.py (TrainSchedule)"),
    ),
    requires=(
        Requires(name="recompute_every = 1 with pp > 1", holds=_pipe_checkpoints_all,
                 reason="its pipeline engine checkpoints every layer "
                        "(activation_checkpoint_interval sets how many layers one checkpoint "
                        "spans, not which are skipped); without a pipeline the model wraps the "
                        "layers it checkpoints itself",
                 source="deepspeed/runtime/pipe/module.py (activation_checkpoint_interval)"),
        Requires(name="ZeRO 0 or 1 with pp > 1", holds=_pipe_zero1,
                 reason="the pipeline engine refuses ZeRO-2 and ZeRO-3",
                 source=f"{_DS_PIPE} (\"ZeRO-2 and ZeRO-3 are incompatible with pipeline "
                        f"parallelism\")"),
        Requires(name="pp > 1 only where the even cut gives every stage as many layers",
                 holds=_even_uniform_stages,
                 reason="PipelineModule balances the stages itself (partition_method "
                        "parameters, uniform or type:regex) and cannot take other stage "
                        "boundaries: pp must divide the transformer layers",
                 source="deepspeed/runtime/pipe/module.py (_partition_layers)"),
        Requires(name="ZeRO 0-2 with ep > 1", holds=_experts_below_zero3,
                 reason="its MoE layers refuse ZeRO-3 (\"MoE not supported with Stage 3\")",
                 source="deepspeed/runtime/engine.py (_configure_zero_optimizer)"),
        Requires(name="mesh order pp, dp, tp", holds=_default_layout,
                 reason="ranks are laid out pipe, data, model, outer first; other mesh "
                        "orders put the groups on other GPUs than planned",
                 source="deepspeed/runtime/pipe/topology.py (PipeModelDataParallelTopology)"),
    ),
    few_microbatches=("1f1b",), uneven_stages=False)

AUTOPAR = EngineTarget(name="autopar", engine="autopar's runtime", software="autopar",
                       runtime_limits=True)

TARGETS: dict[str, EngineTarget] = {t.name: t for t in (AUTOPAR, MEGATRON, TORCHTITAN,
                                                        DEEPSPEED)}
assert all(set(t.few_microbatches) <= set(FEW_MICROBATCHES) for t in TARGETS.values())


def get_target(name: str) -> EngineTarget:
    """The target called `name`; ValueError listing the targets otherwise."""
    if name not in TARGETS:
        raise ValueError(f"target={name!r} is not an engine autopar plans for; targets: "
                         f"{', '.join(TARGETS)}")
    return TARGETS[name]
