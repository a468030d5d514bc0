"""Export a `Plan` to the settings of other trainers: Megatron-LM, torchtitan and DeepSpeed.

`export_plan(plan, fmt)` returns an `ExportResult` whose `text` is what the user passes to the
target (command-line flags, a TOML job config, a JSON config), whose `notes` name, one per
line, each thing in the plan the target cannot express exactly, with what to do instead, and
whose `setup` lists what the engine needs besides the text (how to launch it, what to build in
the model) for choices it does take. A plan compiled for the engine (`compile(...,
target=fmt)`, `autopar.targets`) exports with no notes.
Every value comes from the plan: degrees, batch shape, precision, schedule, recompute policy,
stage boundaries, the software options the estimate assumed (`plan.training.options`).

Stage boundaries. `plan.stages` lists module paths per (virtual) stage in model order; a
repeated block appears under its own path (``layers.3``), the glue around the blocks under its
top-level module names joined by ``+`` (``pos_embeddings+tok_embeddings``, ``norm+output``).
Megatron counts decoder layers per stage, torchtitan takes module names per stage, DeepSpeed
balances stages itself.

Option names, with the files they were read from (names and semantics only):

- Megatron-LM, NVIDIA/Megatron-LM ``megatron/training/arguments.py``: --tensor-model-parallel-size,
  --pipeline-model-parallel-size, --context-parallel-size, --expert-model-parallel-size and
  --expert-tensor-parallel-size (``_add_moe_args``; MoE parallel folding), --num-layers,
  --num-layers-per-virtual-pipeline-stage, --decoder-first-pipeline-num-layers,
  --decoder-last-pipeline-num-layers, --pipeline-model-parallel-layout, --sequence-parallel,
  --use-distributed-optimizer, --use-megatron-fsdp, --data-parallel-sharding-strategy (no_shard,
  optim, optim_grads, optim_grads_params), --use-torch-fsdp2, --micro-batch-size,
  --global-batch-size, --seq-length, --bf16, --fp16, --fp8-format, --grad-reduce-in-bf16,
  --recompute-granularity, --recompute-method, --recompute-num-layers, --overlap-grad-reduce,
  --overlap-param-gather, --tp-comm-overlap, --use-tp-pp-dp-mapping
  (``megatron/training/initialize.py``: ranks in the order tp-cp-ep-dp-pp, inner first, or tp-pp-dp
  with the flag, which the export writes only without cp and ep), --fp8-recipe, --attention-backend
  (values from ``megatron/core/transformer/enums.py`` AttnBackend). The layout grammar (E embedding,
  t decoder layer, L loss, ``|`` between stages, ``x*n`` repeats) is from
  ``megatron/core/transformer/pipeline_parallel_layer_layout.py``. Megatron-LM itself has no
  zero-bubble schedule (sail-sg/zero-bubble-pipeline-parallelism is a fork of it).
- torchtitan, pytorch/torchtitan ``torchtitan/config/job_config.py``: [training] local_batch_size,
  global_batch_size, seq_len, mixed_precision_param, mixed_precision_reduce, compile; [parallelism]
  data_parallel_replicate_degree, data_parallel_shard_degree, fsdp_reshard_after_forward ("default"
  | "always" | "never"), tensor_parallel_degree, enable_async_tensor_parallel,
  pipeline_parallel_degree, module_fqns_per_model_part (older releases:
  pipeline_parallel_split_points), pipeline_parallel_schedule, pipeline_parallel_microbatch_size,
  context_parallel_degree, context_parallel_rotate_method, expert_parallel_degree,
  expert_tensor_parallel_degree (1 or tp); [activation_checkpoint] mode, selective_ac_option;
  [model] converters ("quantize.linear.float8"), [quantize.linear.float8] recipe_name (the release
  of 2025-09-30, commit 37e536d, that `autopar.targets` states). Schedule names are PyTorch's
  ``torch.distributed.pipelining.schedules`` ``get_schedule_class`` keys (GPipe, 1F1B,
  Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble).
  ``torchtitan/config/configs/parallelism.py`` (newer) has enable_sequence_parallel.
- DeepSpeed, deepspeedai/DeepSpeed ``deepspeed/runtime/constants.py``: train_batch_size,
  train_micro_batch_size_per_gpu, gradient_accumulation_steps, bf16.enabled, fp16.enabled,
  communication_data_type; ``deepspeed/runtime/zero/config.py``: zero_optimization.stage,
  overlap_comm, stage3_max_live_parameters, stage3_max_reuse_distance;
  activation_checkpointing.partition_activations and number_checkpoints;
  ``deepspeed/runtime/tensor_parallel/config.py``: tensor_parallel.autotp_size, tp_overlap_comm
  (AutoTP training covers ZeRO stages 0-2, deepspeed.ai/tutorials/autotp-training);
  ``deepspeed/runtime/pipe/engine.py`` refuses ZeRO-2/3 with pipeline parallelism.
  Megatron-DeepSpeed (deepspeedai/Megatron-DeepSpeed ``megatron/arguments.py``):
  --ds-sequence-parallel-size (Ulysses), --enable-zbh1-pipeline (its pull request #396).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.config import DEFAULT_MESH_ORDER, placed_order

if TYPE_CHECKING:
    from autopar.plan.plan import Plan

__all__ = ["EXPORT_FORMATS", "ExportResult", "export_plan"]

EXPORT_FORMATS = ("megatron", "torchtitan", "deepspeed")

_BLOCK = re.compile(r"(?:.+\.)?\d+")  # a repeated block's path ends in its index
_SYNTHETIC_GLUE = re.compile(r"pre|post|glue\d+")  # glue that owns no module
_DTYPE_FLAGS = {"bf16": [["--bf16"]], "fp16": [["--fp16"]],
                "fp8": [["--bf16"], ["--fp8-format", "hybrid"]], "fp32": []}
_MEGATRON_ATTENTION = {"flash": "flash", "flash3": "flash", "cudnn": "fused", "math": "unfused"}
_TITAN_SCHEDULE = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
                   "zero-bubble": "InterleavedZeroBubble"}


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportResult:
    format: str
    text: str  # the flags / file content
    notes: tuple[str, ...] = ()  # one per thing the target cannot express exactly
    setup: tuple[str, ...] = ()  # what the engine needs besides `text` for choices it takes


def export_plan(plan: Plan, fmt: str) -> ExportResult:
    """The plan as `fmt` ("megatron", "torchtitan" or "deepspeed") settings, with notes and
    set-up steps."""
    exporters: dict[str, Callable[[Any], tuple[str, list[str], list[str]]]] = {
        "megatron": _megatron, "torchtitan": _torchtitan, "deepspeed": _deepspeed}
    if fmt not in exporters:
        raise ValueError(f"unknown export format {fmt!r}; allowed: {', '.join(EXPORT_FORMATS)}")
    text, notes, setup = exporters[fmt](plan)
    replicated = sorted(block for block, info in getattr(plan, "intra_op", {}).items()
                        if info.get("replicated_sublayers"))
    if replicated:
        notes.append(f"tensor-parallel layout: the plan runs sub-layers of {', '.join(replicated)} "
                     f"replicated on the sequence shard (the intra-op ILP's layout, which "
                     f"autopar's runtime runs); {fmt} splits every sub-layer as Megatron-LM "
                     f"does, so its step is not the plan's: compile with target=\"{fmt}\" for a "
                     f"plan costed in its layout")
    kv = sorted(block for block, info in getattr(plan, "intra_op", {}).items()
                if info.get("replicated_kv"))
    if kv and fmt in ("megatron", "torchtitan"):
        notes.append(f"tensor-parallel layout: tp={plan.config.tp} exceeds the key/value heads "
                     f"of {', '.join(kv)}, whose K/V projections the plan replicates; {fmt} "
                     f"splits K and V by head and needs tp to divide them: compile with "
                     f"target=\"{fmt}\" for a plan it runs")
    return ExportResult(format=fmt, text=text, notes=tuple(notes), setup=tuple(setup))


# ---------------------------------------------------------------------------------- the plan


@dataclass(frozen=True, kw_only=True, slots=True)
class _Shape:
    """What every exporter reads from a plan, derived once."""

    world_size: int
    global_batch_size: int
    seq_len: int | None  # None: a model traced from example inputs (no token sequence)
    dtype: str
    num_microbatches: int
    layers_per_stage: tuple[int, ...]  # repeated blocks per (virtual) stage, in model order
    modules_per_stage: tuple[tuple[str, ...], ...]  # real module paths per stage
    middle_glue: tuple[str, ...]  # glue between blocks (not before the first / after the last)
    glue_parents: tuple[str, ...]  # glue names that are a parent module of the blocks
    options: dict[str, Any]

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_stage)

    @property
    def uniform(self) -> bool:
        return len(set(self.layers_per_stage)) == 1 and self.layers_per_stage[0] > 0


def is_block_entry(name: str) -> bool:
    """Whether a stage entry of `Plan.stages` is a repeated block (not glue)."""
    return "+" not in name and _BLOCK.fullmatch(name) is not None


_is_block = is_block_entry


def _glue_modules(entry: str) -> list[str]:
    """The module paths a glue entry names (none for glue that owns no module)."""
    return [m for m in entry.split("+") if not _SYNTHETIC_GLUE.fullmatch(m)]


def glue_layout(layers: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Of a model's stage entries in order (`Plan.stages` flattened): the glue between the
    blocks (not before the first or after the last), and the glue module names that are a
    parent module of the blocks, sorted."""
    blocks = [i for i, name in enumerate(layers) if is_block_entry(name)]
    first, last = (blocks[0], blocks[-1]) if blocks else (len(layers), -1)
    middle = tuple(name for i, name in enumerate(layers)
                   if first < i < last and not is_block_entry(name))
    parents = {module for name in layers if not is_block_entry(name)
               for module in _glue_modules(name)
               if any(layers[i].startswith(module + ".") for i in blocks)}
    return middle, tuple(sorted(parents))


def _shape(plan: Plan) -> _Shape:
    cfg, training = plan.config, plan.training
    flat = [name for stage in plan.stages for name in stage]
    middle, parents = glue_layout(flat)
    modules = [tuple(m for entry in stage
                     for m in ([entry] if _is_block(entry) else _glue_modules(entry)))
               for stage in plan.stages]
    seq, batch = training.seq_len, int(training.global_batch_size)
    return _Shape(
        world_size=int(plan.cluster.world_size), global_batch_size=batch,
        seq_len=None if seq is None else int(seq), dtype=str(training.dtype),
        num_microbatches=batch // (cfg.dp * cfg.micro_batch_size),
        layers_per_stage=tuple(sum(_is_block(n) for n in stage) for stage in plan.stages),
        modules_per_stage=tuple(modules), middle_glue=middle, glue_parents=parents,
        options=dict(training.options))


# ---------------------------------------------------------------------------------- Megatron


def _same_layout(cfg: Any, order: tuple[str, ...]) -> bool:
    """Whether `order` puts the ranks where `cfg.mesh_order` does."""
    sizes = {a: getattr(cfg, a) for a in DEFAULT_MESH_ORDER}
    return placed_order(tuple(cfg.mesh_order), sizes) == placed_order(order, sizes)


def _order_note(cfg: Any, theirs: str) -> str:
    return (f"mesh order {','.join(cfg.mesh_order)} (outer first): {theirs}, so its groups "
            f"land on other GPUs than planned and the plan's communication times do not hold "
            f"there; run the plan with autopar's runtime (autopar codegen), or re-plan with "
            f"constraints={{'mesh_order': {DEFAULT_MESH_ORDER}}} (--pin "
            f"mesh_order={','.join(DEFAULT_MESH_ORDER)})")


def _megatron(plan: Plan) -> tuple[str, list[str], list[str]]:
    cfg, shape = plan.config, _shape(plan)
    opts, notes = shape.options, []
    flags: list[list[str]] = [
        ["--tensor-model-parallel-size", str(cfg.tp)],
        ["--pipeline-model-parallel-size", str(cfg.pp)],
        ["--context-parallel-size", str(cfg.cp)],
        ["--expert-model-parallel-size", str(cfg.ep)],
    ]
    if cfg.ep > 1 or cfg.folded:  # experts split over tp (its default) or whole (folded)
        flags.append(["--expert-tensor-parallel-size", str(cfg.expert_tp)])
    if shape.num_layers:
        flags.append(["--num-layers", str(shape.num_layers)])
    flags += _megatron_stages(cfg, shape, notes)
    if cfg.sequence_parallel:
        flags.append(["--sequence-parallel"])
    if cfg.zero_stage >= 1:
        flags.append(["--use-distributed-optimizer"])
    flags += [["--micro-batch-size", str(cfg.micro_batch_size)],
              ["--global-batch-size", str(shape.global_batch_size)]]
    if shape.seq_len is not None:
        flags.append(["--seq-length", str(shape.seq_len)])
    else:
        notes.append("no token sequence: Megatron-LM's trainers train on token sequences "
                     "(--seq-length); this model takes other inputs")
    flags += _DTYPE_FLAGS.get(shape.dtype, [])
    if shape.dtype == "fp8":
        recipe = opts.get("fp8_recipe", "delayed")
        if recipe in ("delayed", "tensorwise"):
            flags.append(["--fp8-recipe", recipe])
        else:
            notes.append(f"fp8_recipe {recipe}: Megatron-LM's --fp8-recipe is tensorwise, "
                         f"delayed, mxfp8 or blockwise, with no {recipe} scaling; its default "
                         f"(delayed) is left to run")
    if cfg.recompute == "full" and cfg.recompute_every == 1:
        flags += [["--recompute-granularity", "full"], ["--recompute-method", "uniform"],
                  ["--recompute-num-layers", "1"]]
    elif cfg.recompute == "full":  # the first 1/k of each chunk's layers
        chunk = min((n for n in shape.layers_per_stage if n), default=cfg.recompute_every)
        flags += [["--recompute-granularity", "full"], ["--recompute-method", "block"],
                  ["--recompute-num-layers", str(max(1, chunk // cfg.recompute_every))]]
        if not shape.uniform or chunk % cfg.recompute_every:
            notes.append(f"recompute_every {cfg.recompute_every}: Megatron-LM's block method "
                         f"recomputes the first --recompute-num-layers layers of every stage; "
                         f"with {sorted(set(shape.layers_per_stage))} layers per stage that is "
                         f"not one in {cfg.recompute_every} on every stage")
    elif cfg.recompute == "selective":
        flags.append(["--recompute-granularity", "selective"])
    elif cfg.recompute == "per_op":
        notes.append("recompute per_op: Megatron-LM has no policy that keeps every other "
                     "matmul's output; its selective recompute (--recompute-granularity "
                     "selective --recompute-modules ...) re-runs whole submodules")
    flags += _megatron_options(cfg, shape, opts, notes)
    if not _same_layout(cfg, DEFAULT_MESH_ORDER):
        if cfg.cp == 1 and cfg.ep == 1 and _same_layout(cfg, ("dp", "pp", "cp", "tp")):
            flags.append(["--use-tp-pp-dp-mapping"])  # its other order, inner first
        else:
            notes.append(_order_note(cfg, "Megatron-LM lays the ranks out tp-cp-ep-dp-pp, inner "
                                          "first (tp-pp-dp with --use-tp-pp-dp-mapping, which "
                                          "takes neither cp nor ep)"))
    setup = [f"data parallelism is not a flag: Megatron-LM derives dp = world size / "
             f"(tp*pp*cp) = {shape.world_size} / ({cfg.tp}*{cfg.pp}*{cfg.cp}) = {cfg.dp}, "
             f"so launch on {shape.world_size} GPUs"]
    notes += _megatron_zero_notes(cfg)
    if cfg.pp > 1 and cfg.pp_schedule == "gpipe":
        notes.append("pp_schedule gpipe: Megatron-LM has no GPipe schedule and runs 1F1B, which "
                     "has the same bubble and keeps fewer micro-batches of activations")
    if cfg.pp > 1 and cfg.pp_schedule == "zero-bubble":
        notes.append("pp_schedule zero-bubble: Megatron-LM has no zero-bubble flag and runs 1F1B "
                     "(a larger bubble than planned); the ZB-H1 schedule lives in the "
                     "sail-sg/zero-bubble-pipeline-parallelism fork of Megatron-LM")
    return "\n".join(shlex.join(f) for f in flags) + "\n", notes, setup


def _megatron_stages(cfg: Any, shape: _Shape, notes: list[str]) -> list[list[str]]:
    """Layers per stage: an even split, the first/last-stage counts, or an explicit layout."""
    counts, v = shape.layers_per_stage, cfg.virtual_stages
    if cfg.pp == 1 or not shape.num_layers:
        return []
    if shape.middle_glue:
        notes.append(f"modules between the transformer layers ({', '.join(shape.middle_glue)}) "
                     f"have no place in a Megatron-LM pipeline layout; they are left out of it")
    if shape.uniform:
        return [["--num-layers-per-virtual-pipeline-stage", str(counts[0])]] if v > 1 else []
    middle = counts[1:-1]
    if v == 1 and min(counts) > 0 and len(set(middle)) <= 1:
        return [["--decoder-first-pipeline-num-layers", str(counts[0])],
                ["--decoder-last-pipeline-num-layers", str(counts[-1])]]
    parts = [f"t*{n}" if n > 1 else "t" * n for n in counts]
    parts[0], parts[-1] = "E" + parts[0], parts[-1] + "L"
    return [["--pipeline-model-parallel-layout", "|".join(parts)]]


def _megatron_options(cfg: Any, shape: _Shape, opts: dict[str, Any],
                      notes: list[str]) -> list[list[str]]:
    flags: list[list[str]] = []
    if opts.get("overlap_dp_comm") and cfg.dp * cfg.cp > 1:
        flags.append(["--overlap-grad-reduce"])
        if cfg.zero_stage >= 1:
            flags.append(["--overlap-param-gather"])
    if opts.get("overlap_tp_comm") and cfg.tp > 1:
        if cfg.sequence_parallel:
            flags.append(["--tp-comm-overlap"])
        else:
            notes.append("overlap_tp_comm: Megatron-LM's --tp-comm-overlap needs "
                         "--sequence-parallel, which the plan does not use; the flag is left out")
    reduce = opts.get("grad_reduce_dtype", "fp32")
    if reduce == "bf16":
        flags.append(["--grad-reduce-in-bf16"])
    elif reduce == "fp16" and shape.dtype != "fp16":
        notes.append("grad_reduce_dtype fp16: Megatron-LM reduces gradients in fp32 or bf16 "
                     "(--grad-reduce-in-bf16), not fp16")
    kernel = opts.get("attention_kernel")
    if kernel in _MEGATRON_ATTENTION:
        flags.append(["--attention-backend", _MEGATRON_ATTENTION[kernel]])
    return flags


def _megatron_zero_notes(cfg: Any) -> list[str]:
    if cfg.zero_stage == 2:
        return [("zero_stage 2: Megatron-LM's distributed optimizer shards optimizer states but "
                 "keeps a full gradient buffer on every rank (ZeRO-1 memory); for sharded "
                 "gradients use Megatron FSDP instead: --use-megatron-fsdp "
                 "--data-parallel-sharding-strategy optim_grads")]
    if cfg.zero_stage == 3:
        return [("zero_stage 3: the classic Megatron-LM trainer does not shard parameters "
                 "(--use-distributed-optimizer is ZeRO-1); use Megatron FSDP instead "
                 "(--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params) "
                 "or --use-torch-fsdp2")]
    return []


# ---------------------------------------------------------------------------------- torchtitan


def _toml_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, (bool, int)):  # TOML's true and false are JSON's
        return json.dumps(value)
    return json.dumps(str(value))


def _toml(sections: dict[str, dict[str, Any]], comments: dict[str, list[str]]) -> str:
    lines: list[str] = []
    for name, fields in sections.items():
        lines.append(f"[{name}]")
        lines += [f"# {c}" for c in comments.get(name, [])]
        lines += [f"{key} = {_toml_value(value)}" for key, value in fields.items()]
        lines.append("")
    return "\n".join(lines)


def _torchtitan(plan: Plan) -> tuple[str, list[str], list[str]]:
    cfg, shape = plan.config, _shape(plan)
    opts, notes = shape.options, []
    sharded = cfg.zero_stage == 3
    async_tp = bool(opts.get("overlap_tp_comm")) and cfg.tp > 1
    training: dict[str, Any] = {
        "local_batch_size": (shape.global_batch_size // cfg.dp if cfg.pp > 1
                             else cfg.micro_batch_size),
        "global_batch_size": shape.global_batch_size,
        **({"seq_len": shape.seq_len} if shape.seq_len is not None else {}),
        "mixed_precision_param": "float32" if shape.dtype == "fp32" else "bfloat16",
        "mixed_precision_reduce": "float32",
    }
    if async_tp:
        training["compile"] = True  # torchtitan's async TP works only under torch.compile
    parallelism: dict[str, Any] = {
        "data_parallel_replicate_degree": 1 if sharded else cfg.dp,
        "data_parallel_shard_degree": cfg.dp if sharded else 1,
        # resharded after each forward without a pipeline, kept gathered under one: as costed
        # (EstimateOptions.fsdp2)
        "fsdp_reshard_after_forward": "default",
        "tensor_parallel_degree": cfg.tp, "enable_async_tensor_parallel": async_tp,
        "pipeline_parallel_degree": cfg.pp,
        "context_parallel_degree": cfg.cp, "expert_parallel_degree": cfg.ep,
    }
    if cfg.cp > 1:  # K/V gathered once a pass, as the torchtitan preset costs
        parallelism["context_parallel_rotate_method"] = "allgather"
    if cfg.ep > 1 or cfg.folded:  # 1 (folded) or tp
        parallelism["expert_tensor_parallel_degree"] = cfg.expert_tp
    comments: dict[str, list[str]] = {}
    if cfg.pp > 1:
        schedule = cfg.pp_schedule if cfg.virtual_stages > 1 or \
            cfg.pp_schedule != "interleaved-1f1b" else "1f1b"
        parallelism["pipeline_parallel_schedule"] = _TITAN_SCHEDULE[schedule]
        parallelism["pipeline_parallel_microbatch_size"] = cfg.micro_batch_size
        parallelism["module_fqns_per_model_part"] = [list(s) for s in shape.modules_per_stage]
        splits = [s[0] for s in shape.modules_per_stage[1:] if s]
        comments["parallelism"] = [("releases without module_fqns_per_model_part take "
                                    f"pipeline_parallel_split_points = {_toml_value(splits)}")]
    checkpoint: dict[str, Any] = {"mode": cfg.recompute}
    if cfg.recompute in ("selective", "per_op"):
        checkpoint = {"mode": "selective", "selective_ac_option": "op"}
    elif cfg.recompute == "full" and cfg.recompute_every > 1:  # every k-th block, full
        checkpoint = {"mode": "selective", "selective_ac_option": str(cfg.recompute_every)}
    sections = {"training": training, "parallelism": parallelism,
                "activation_checkpoint": checkpoint}
    setup = []
    if shape.dtype == "fp8":
        sections["model"] = {"converters": ["quantize.linear.float8"]}
        recipe = opts.get("fp8_recipe", "tensorwise")
        if recipe in ("tensorwise", "rowwise"):
            sections["quantize.linear.float8"] = {"recipe_name": recipe}
        setup.append("dtype fp8: the quantize.linear.float8 converter swaps the Linear layers "
                     "for torchao's Float8Linear (install torchao)")
    notes += _torchtitan_notes(cfg, shape, opts)
    if not _same_layout(cfg, DEFAULT_MESH_ORDER):
        notes.append(_order_note(cfg, "torchtitan builds its mesh as pp, dp_replicate, dp_shard, "
                                      "cp, tp, outer first"))
    return _toml(sections, comments), notes, setup


def _torchtitan_notes(cfg: Any, shape: _Shape, opts: dict[str, Any]) -> list[str]:
    notes = []
    if shape.seq_len is None:
        notes.append("no token sequence: torchtitan trains language models on token sequences "
                     "([training] seq_len); this model takes other inputs")
    if cfg.zero_stage in (1, 2) and cfg.cp == 1 and cfg.dp > 1:
        notes.append(f"zero_stage {cfg.zero_stage}: torchtitan has no optimizer-state-only or "
                     f"gradient-only sharding; the config uses DDP (data_parallel_replicate_degree"
                     f" = {cfg.dp}), which keeps full optimizer states on every rank (more memory"
                     f" than planned). The nearest sharded setting is data_parallel_shard_degree "
                     f"= {cfg.dp} with fsdp_reshard_after_forward = \"never\" (FSDP2 in ZeRO-2 "
                     f"style: parameters stay gathered from forward to backward)")
    elif cfg.zero_stage == 0 and cfg.cp == 1 and cfg.dp > 1 and (cfg.tp > 1 or cfg.pp > 1):
        notes.append(f"zero_stage 0 with tp or pp: torchtitan runs DDP (data_parallel_replicate"
                     f"_degree = {cfg.dp}) only as the sole parallelism (\"DDP has not supported "
                     f"> 1D parallelism\"); the nearest setting is data_parallel_shard_degree = "
                     f"{cfg.dp} (FSDP2, ZeRO-3)")
    elif cfg.zero_stage < 3 and cfg.cp > 1:
        notes.append(f"zero_stage {cfg.zero_stage}: with context_parallel_degree = {cfg.cp} "
                     f"torchtitan applies FSDP over the context-parallel ranks, so parameters, "
                     f"gradients and optimizer states are sharded {cfg.cp} ways (ZeRO-3 within "
                     f"each cp group, replicated over data_parallel_replicate_degree = {cfg.dp}) "
                     f"where the plan has ZeRO-{cfg.zero_stage} over dp*cp = {cfg.dp * cfg.cp}")
    if cfg.tp > 1 and not cfg.sequence_parallel:
        notes.append("sequence_parallel off: torchtitan always pairs tensor parallelism with "
                     "sequence parallelism (newer releases: [parallelism] "
                     "enable_sequence_parallel = false)")
    if shape.dtype == "fp16":
        notes.append("dtype fp16: torchtitan's mixed_precision_param is bfloat16 or float32; "
                     "bfloat16 is set")
    if shape.dtype == "fp8" and opts.get("fp8_recipe", "tensorwise") not in ("tensorwise",
                                                                              "rowwise"):
        notes.append(f"fp8_recipe {opts['fp8_recipe']}: torchtitan's float8 recipes (torchao's "
                     f"dynamic scaling) are tensorwise and rowwise; none set, it runs tensorwise")
    if opts.get("grad_reduce_dtype", "fp32") != "fp32":
        notes.append(f"grad_reduce_dtype {opts['grad_reduce_dtype']}: torchtitan reduces "
                     f"gradients in float32 (mixed_precision_reduce)")
    if cfg.recompute == "selective":
        notes.append("recompute selective: torchtitan's op-level checkpointing (selective_ac_option"
                     " = \"op\") keeps other activations than the attention-only recompute costed")
    if cfg.pp > 1 and cfg.pp_schedule == "zero-bubble":
        notes.append(f"pp_schedule zero-bubble: the plan is ZB-H1, one stage a rank; PyTorch's "
                     f"zero-bubble schedules take 2+ stages a rank (InterleavedZeroBubble; "
                     f"ZBVZeroBubble exactly 2): split each rank's layers in two ({2 * cfg.pp} "
                     f"parts on {cfg.pp} ranks) for ZBVZeroBubble, or use 1F1B")
    if cfg.cp > 1 and (rotate := opts.get("cp_rotate", "p2p")) != "all_gather":
        notes.append(f"context parallel: torchtitan all-gathers the K/V shards (context_parallel_"
                     f"rotate_method = \"allgather\"); the plan costed cp_rotate={rotate!r}")
    within = cfg.cp * (cfg.tp if cfg.folded else 1)  # folded: tp's ranks too
    shard_ranks = (cfg.dp if cfg.zero_stage == 3 else 1) * within
    if cfg.ep > 1 and (cfg.ep % within or shard_ranks % cfg.ep):
        ranks = "context-parallel x tp" if cfg.folded else "context-parallel"
        notes.append(f"expert parallel {cfg.ep}: torchtitan takes expert-parallel ranks from "
                     f"the FSDP-shard x {ranks} ranks (ep a multiple of {within} and a "
                     f"divisor of {shard_ranks} here)"
                     + (f"; with ZeRO {cfg.zero_stage} mapped to replication that does not "
                        f"hold: use data_parallel_shard_degree = {cfg.dp} (ZeRO-3)"
                        if cfg.zero_stage < 3 else ""))
    if shape.glue_parents:
        notes.append(f"module_fqns_per_model_part lists {', '.join(shape.glue_parents)}, a parent"
                     f" of the transformer layers (the plan groups the embedding and the final "
                     f"norm under it); replace it with the embedding and norm module paths")
    if shape.middle_glue:
        notes.append(f"modules between the transformer layers ({', '.join(shape.middle_glue)}) "
                     f"are listed by top-level name only; check the stage they fall in")
    return notes


# ---------------------------------------------------------------------------------- DeepSpeed


def _deepspeed(plan: Plan) -> tuple[str, list[str], list[str]]:
    cfg, shape = plan.config, _shape(plan)
    opts, notes, setup = shape.options, [], []
    zero: dict[str, Any] = {"stage": cfg.zero_stage,
                            "overlap_comm": bool(opts.get("overlap_dp_comm", False))}
    if cfg.zero_stage == 3 and opts.get("zero3_max_live_params") is not None:
        zero["stage3_max_live_parameters"] = int(opts["zero3_max_live_params"])
    if cfg.zero_stage == 3 and opts.get("zero3_gather") == "sync":  # the estimate's reuse rule
        zero["stage3_max_reuse_distance"] = int(opts.get("zero3_max_reuse_distance", 10**9))
    config: dict[str, Any] = {
        "train_batch_size": shape.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": shape.num_microbatches,
        "bf16": {"enabled": shape.dtype in ("bf16", "fp8")},
        "fp16": {"enabled": shape.dtype == "fp16"},
        "zero_optimization": zero,
        "communication_data_type": opts.get("grad_reduce_dtype", "fp32"),
    }
    if cfg.tp > 1:
        config["tensor_parallel"] = {"autotp_size": cfg.tp,
                                     "tp_overlap_comm": bool(opts.get("overlap_tp_comm", False))}
    if cfg.recompute == "full":
        config["activation_checkpointing"] = {"partition_activations": False,
                                              "number_checkpoints": max(shape.layers_per_stage)}
    notes += _deepspeed_model_notes(cfg, shape, setup)
    notes += _deepspeed_pipeline_notes(cfg, shape, setup)
    if not _same_layout(cfg, DEFAULT_MESH_ORDER):
        notes.append(_order_note(cfg, "DeepSpeed lays the ranks out as pipe, data, model, outer "
                                      "first"))
    return json.dumps(config, indent=2) + "\n", notes, setup


def _deepspeed_model_notes(cfg: Any, shape: _Shape, setup: list[str]) -> list[str]:
    notes = []
    if cfg.tp > 1:
        notes.append(f"tensor parallel {cfg.tp}: set as tensor_parallel.autotp_size (DeepSpeed "
                     f"AutoTP training, which chooses the column/row split of Hugging Face-style "
                     f"linear layers itself, not the plan's placements); with Megatron-DeepSpeed "
                     f"use --tensor-model-parallel-size {cfg.tp} instead")
        if cfg.zero_stage == 3:
            notes.append("zero_stage 3 with tensor parallelism: AutoTP training supports ZeRO "
                         "stages 0-2 only; use Megatron-DeepSpeed's tensor parallelism with "
                         "ZeRO-3, or ZeRO-2")
        if cfg.sequence_parallel:
            notes.append("sequence_parallel: Megatron-style sequence parallelism has no "
                         "DeepSpeed config key; Megatron-DeepSpeed enables it with "
                         "--sequence-parallel")
    if cfg.cp > 1:
        notes.append(f"context parallel {cfg.cp}: DeepSpeed's sequence parallelism is Ulysses "
                     f"(all-to-all over attention heads, not the planned K/V ring): "
                     f"Megatron-DeepSpeed --ds-sequence-parallel-size {cfg.cp}, or "
                     f"deepspeed.sequence.layer.DistributedAttention on a {cfg.cp}-rank group")
    if cfg.ep > 1:
        setup.append(f"expert parallel {cfg.ep}: not a config key; build the MoE layers as "
                     f"deepspeed.moe.layer.MoE(..., ep_size={cfg.ep})")
        if cfg.zero_stage == 3:
            notes.append("expert parallel with zero_stage 3: DeepSpeed's MoE layers refuse "
                         "ZeRO-3 (\"MoE not supported with Stage 3\"); use ZeRO-2")
    if cfg.recompute == "full":
        setup.append("recompute full: the config only tunes checkpointing; the model must wrap "
                     + ("each layer in deepspeed.checkpointing.checkpoint (with PipelineModule: "
                        "activation_checkpoint_interval=1)" if cfg.recompute_every == 1 else
                        f"one layer in {cfg.recompute_every} in "
                        f"deepspeed.checkpointing.checkpoint"))
        if cfg.recompute_every > 1 and cfg.pp > 1:
            notes.append(f"recompute_every {cfg.recompute_every}: DeepSpeed's pipeline "
                         f"checkpoints every layer (activation_checkpoint_interval groups "
                         f"layers, it skips none)")
    elif cfg.recompute in ("selective", "per_op"):
        notes.append(f"recompute {cfg.recompute}: DeepSpeed has no selective (attention-only "
                     f"or per-op) recompute; deepspeed.checkpointing.checkpoint checkpoints "
                     f"whole modules")
    if shape.dtype == "fp8":
        setup.append("dtype fp8: DeepSpeed has no fp8 precision key; bf16 is set, fp8 GEMMs "
                     "need Transformer Engine layers in the model")
    return notes


def _deepspeed_pipeline_notes(cfg: Any, shape: _Shape, setup: list[str]) -> list[str]:
    if cfg.pp == 1:
        return []
    counts = list(shape.layers_per_stage)
    setup.append(f"pipeline parallel {cfg.pp}: not a config key; build the model as "
                 f"deepspeed.pipe.PipelineModule(layers=..., num_stages={cfg.pp}, "
                 f"partition_method=\"type:<transformer layer class>\", which gives each "
                 f"stage as many of those layers); gradient_accumulation_steps = "
                 f"{shape.num_microbatches} micro-batches flow through the pipeline per step")
    notes = []
    if cfg.virtual_stages == 1 and not shape.uniform:
        notes.append(f"stage boundaries: the plan puts {counts} transformer layers on the "
                     f"stages; DeepSpeed's partition methods (parameters, uniform, type:regex) "
                     f"balance stages themselves and cannot take these boundaries")
    if cfg.zero_stage >= 2:
        notes.append(f"zero_stage {cfg.zero_stage}: DeepSpeed's pipeline engine refuses ZeRO "
                     f"stages 2 and 3; use stage 1 with pipeline parallelism")
    if cfg.pp_schedule == "gpipe":
        notes.append("pp_schedule gpipe: DeepSpeed's pipeline engine runs its own 1F1B-style "
                     "schedule (same bubble, fewer activations kept)")
    elif cfg.pp_schedule == "interleaved-1f1b" and cfg.virtual_stages > 1:
        notes.append(f"pp_schedule interleaved-1f1b with {cfg.virtual_stages} virtual stages: "
                     f"DeepSpeed's pipeline engine has no interleaved schedule and runs one "
                     f"stage per rank ({counts} layers per virtual stage in the plan)")
    elif cfg.pp_schedule == "zero-bubble":
        notes.append("pp_schedule zero-bubble: DeepSpeed's pipeline engine runs 1F1B; "
                     "Megatron-DeepSpeed adds ZB-H1 with --enable-zbh1-pipeline")
    return notes
