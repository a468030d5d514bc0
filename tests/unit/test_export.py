"""Exports of a plan to Megatron-LM flags, a torchtitan TOML and a DeepSpeed JSON, parsed back.

Each export is read back the way its target reads it (argparse with Megatron-LM's option
names, `tomllib`, `json`) and every value is checked against the plan; the notes must name
exactly what the target cannot express.
"""

import argparse
import dataclasses
import json
import re
import shlex
import tomllib

import pytest
import torch

import autopar
from autopar.estimate.core import EstimateOptions
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.mixtral import Mixtral, MixtralConfig
from autopar.plan.export import EXPORT_FORMATS, ExportResult, export_plan

CLUSTER = autopar.Cluster.from_profile("dgx-h100", num_nodes=2)  # 16 GPUs

# name: (model, dtype, pinned config, estimate options)
PINS = {
    "tp2_pp4_interleaved_zero3_full": (
        "gpt", "bf16", {"tp": 2, "pp": 4, "pp_schedule": "interleaved-1f1b", "virtual_stages": 2,
                        "zero_stage": 3, "recompute": "full", "sequence_parallel": True}, {}),
    "tp4_pp2_cp2_zero1_selective": (
        "gpt", "bf16", {"tp": 4, "pp": 2, "cp": 2, "pp_schedule": "1f1b", "zero_stage": 1,
                        "recompute": "selective", "sequence_parallel": True},
        {"attention_kernel": "math", "overlap_tp_comm": True, "grad_reduce_dtype": "bf16"}),
    "dp8_cp2_fp16": (
        "gpt", "fp16", {"tp": 1, "pp": 1, "cp": 2, "zero_stage": 0, "recompute": "none"}, {}),
    "tp2_pp4_zero_bubble_zero2_no_sp": (
        "gpt", "bf16", {"tp": 2, "pp": 4, "pp_schedule": "zero-bubble", "zero_stage": 2,
                        "sequence_parallel": False}, {"overlap_tp_comm": True}),
    "pp2_gpipe_zero3": (
        "gpt", "bf16", {"tp": 1, "pp": 2, "pp_schedule": "gpipe", "zero_stage": 3}, {}),
    "moe_ep4_cp2_zero1": (
        "moe", "bf16", {"tp": 1, "pp": 1, "cp": 2, "ep": 4, "zero_stage": 1}, {}),
    "dp16_zero3_per_op": (
        "gpt", "bf16", {"tp": 1, "pp": 1, "cp": 1, "zero_stage": 3, "recompute": "per_op"}, {}),
    "tp2_pp2_full_every2": (
        "gpt", "bf16", {"tp": 2, "pp": 2, "pp_schedule": "1f1b", "zero_stage": 1,
                        "recompute": "full", "recompute_every": 2, "sequence_parallel": True},
        {}),
}


def _model(kind: str):
    with torch.device("meta"):
        if kind == "moe":
            return Mixtral(MixtralConfig(vocab_size=8192, dim=512, n_layers=4, n_heads=8,
                                         n_kv_heads=4, ffn_dim=1024, max_seq_len=1024,
                                         num_experts=8, top_k=2))
        return GPT(GPTConfig(vocab_size=8192, max_seq_len=1024, dim=1024, n_layers=8,
                             n_heads=16))


@pytest.fixture(scope="module")
def plans():
    out = {}
    for name, (kind, dtype, pins, options) in PINS.items():
        # Megatron-LM's tensor-parallel layout: these plans check the engines' rules on the
        # config (a plan that replicates sub-layers adds one note, tests/unit/test_compile.py)
        out[name] = autopar.compile(_model(kind), CLUSTER, global_batch_size=64, seq_len=1024,
                                    dtype=dtype, constraints=pins,
                                    options=EstimateOptions(**options),
                                    settings=autopar.SearchSettings(tp_layouts="megatron"))
        assert {k: getattr(out[name].config, k) for k in pins} == pins
    return out


def _is_block(name: str) -> bool:
    return re.fullmatch(r"layers\.\d+", name) is not None


def _layers_per_stage(plan) -> list[int]:
    return [sum(_is_block(n) for n in stage) for stage in plan.stages]


def _expected_modules(stage: list[str]) -> list[str]:
    return [m for entry in stage for m in ([entry] if _is_block(entry) else entry.split("+"))]


def _topics(notes) -> list[str]:
    """What each note is about: its text up to the first colon."""
    return sorted(n.split(":", 1)[0] for n in notes)


# ---------------------------------------------------------------------------------- Megatron


def _megatron_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for name in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--context-parallel-size", "--expert-model-parallel-size",
                 "--expert-tensor-parallel-size", "--num-layers",
                 "--num-layers-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers",
                 "--decoder-last-pipeline-num-layers", "--micro-batch-size",
                 "--global-batch-size", "--seq-length", "--recompute-num-layers"):
        parser.add_argument(name, type=int, default=None)
    parser.add_argument("--pipeline-model-parallel-layout", type=str, default=None)
    for name in ("--sequence-parallel", "--use-distributed-optimizer", "--bf16", "--fp16",
                 "--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap",
                 "--grad-reduce-in-bf16"):
        parser.add_argument(name, action="store_true")
    parser.add_argument("--recompute-granularity", choices=["full", "selective"])
    parser.add_argument("--recompute-method", choices=["uniform", "block"])
    parser.add_argument("--fp8-format", choices=["e4m3", "hybrid"])
    parser.add_argument("--fp8-recipe", choices=["tensorwise", "delayed", "mxfp8", "blockwise"])
    parser.add_argument("--attention-backend",
                        choices=["flash", "fused", "unfused", "local", "auto"])
    return parser


def _parse_megatron(text: str) -> argparse.Namespace:
    return _megatron_parser().parse_args(shlex.split(text))


def _layout_counts(layout: str) -> list[str]:
    """Megatron's layout grammar: '|' between stages, 'x*n' repeats x."""
    unrolled = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout)
    return unrolled.split("|")


def _megatron_stage_counts(args: argparse.Namespace, num_stages: int) -> list[int]:
    pp, total = args.pipeline_model_parallel_size, args.num_layers
    if args.pipeline_model_parallel_layout:
        stages = _layout_counts(args.pipeline_model_parallel_layout)
        assert stages[0].startswith("E") and stages[-1].endswith("L")
        return [s.count("t") for s in stages]
    if args.decoder_first_pipeline_num_layers is not None:
        first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
        middle = (total - first - last) // (pp - 2) if pp > 2 else 0
        assert first + last + middle * (pp - 2) == total
        return [first] + [middle] * (pp - 2) + [last]
    per = args.num_layers_per_virtual_pipeline_stage or total // pp
    assert per * num_stages == total
    return [per] * num_stages


def _check_megatron(plan, args: argparse.Namespace) -> None:
    cfg, training = plan.config, plan.training
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.context_parallel_size, args.expert_model_parallel_size) == \
        (cfg.tp, cfg.pp, cfg.cp, cfg.ep)
    # unset: Megatron splits experts over tp (its default); given, as the plan does
    assert args.expert_tensor_parallel_size in ((None,) if cfg.ep == 1 and not cfg.folded
                                                else (cfg.expert_tp,))
    assert args.num_layers == sum(_layers_per_stage(plan))
    assert (args.micro_batch_size, args.global_batch_size, args.seq_length) == \
        (cfg.micro_batch_size, training.global_batch_size, training.seq_len)
    assert args.bf16 == (training.dtype in ("bf16", "fp8"))
    assert args.fp16 == (training.dtype == "fp16")
    assert args.sequence_parallel == cfg.sequence_parallel
    assert args.use_distributed_optimizer == (cfg.zero_stage >= 1)
    expected_recompute = {"none": (None, None, None), "selective": ("selective", None, None),
                          "full": ("full", "uniform", 1),
                          "per_op": (None, None, None)}[cfg.recompute]  # per_op: a note
    if cfg.recompute_every > 1:  # Megatron's block method: the first 1/k of each chunk
        chunk = min(n for n in _layers_per_stage(plan) if n)
        expected_recompute = ("full", "block", chunk // cfg.recompute_every)
    assert (args.recompute_granularity, args.recompute_method,
            args.recompute_num_layers) == expected_recompute
    if cfg.pp > 1:
        assert _megatron_stage_counts(args, cfg.pp * cfg.virtual_stages) == \
            _layers_per_stage(plan)
    if cfg.virtual_stages > 1 and len(set(_layers_per_stage(plan))) == 1:
        assert args.num_layers_per_virtual_pipeline_stage == \
            args.num_layers // (cfg.pp * cfg.virtual_stages)
    options = plan.training.options
    assert args.overlap_grad_reduce == options["overlap_dp_comm"]
    assert args.overlap_param_gather == (options["overlap_dp_comm"] and cfg.zero_stage >= 1)
    assert args.tp_comm_overlap == (options["overlap_tp_comm"] and cfg.tp > 1
                                    and cfg.sequence_parallel)
    assert args.grad_reduce_in_bf16 == (options["grad_reduce_dtype"] == "bf16")


@pytest.mark.parametrize("name", sorted(PINS))
def test_megatron_flags_parse_back_to_the_plan(plans, name):
    plan = plans[name]
    result = export_plan(plan, "megatron")
    assert isinstance(result, ExportResult) and result.format == "megatron"
    _check_megatron(plan, _parse_megatron(result.text))


MEGATRON_NOTES = {
    "tp2_pp4_interleaved_zero3_full": ["zero_stage 3"],
    "tp4_pp2_cp2_zero1_selective": [],
    "dp8_cp2_fp16": [],
    "tp2_pp4_zero_bubble_zero2_no_sp": ["overlap_tp_comm", "pp_schedule zero-bubble",
                                        "zero_stage 2"],
    "pp2_gpipe_zero3": ["pp_schedule gpipe", "zero_stage 3"],
    "moe_ep4_cp2_zero1": [],
    "dp16_zero3_per_op": ["recompute per_op", "zero_stage 3"],
    "tp2_pp2_full_every2": [],
}


@pytest.mark.parametrize("name", sorted(PINS))
def test_megatron_notes_name_exactly_what_it_cannot_express(plans, name):
    result = export_plan(plans[name], "megatron")
    assert _topics(result.notes) == MEGATRON_NOTES[name]
    if plans[name].config.zero_stage == 3:
        assert any("--use-megatron-fsdp" in n for n in result.notes)
    assert _topics(result.setup) == ["data parallelism is not a flag"]
    assert "dp = world size / (tp*pp*cp) = 16 / " in result.setup[0]


def _with_stages(plan, counts: list[int]):
    """The plan with its transformer layers re-cut into stages of `counts` layers."""
    names = [n for stage in plan.stages for n in stage if _is_block(n)]
    first_glue = [n for n in plan.stages[0] if not _is_block(n)]
    last_glue = [n for n in plan.stages[-1] if not _is_block(n)]
    assert sum(counts) == len(names) and len(counts) == len(plan.stages)
    stages, start = [], 0
    for n in counts:
        stages.append(names[start:start + n])
        start += n
    stages[0], stages[-1] = first_glue + stages[0], stages[-1] + last_glue
    return dataclasses.replace(plan, stages=stages)


@pytest.mark.parametrize("name,counts,flag", [
    ("pp2_gpipe_zero3", [3, 5], "--decoder-first-pipeline-num-layers"),
    ("tp2_pp4_zero_bubble_zero2_no_sp", [1, 3, 3, 1], "--decoder-first-pipeline-num-layers"),
    ("tp2_pp4_zero_bubble_zero2_no_sp", [1, 3, 2, 2], "--pipeline-model-parallel-layout"),
    ("tp2_pp4_zero_bubble_zero2_no_sp", [0, 3, 3, 2], "--pipeline-model-parallel-layout"),
    ("tp2_pp4_interleaved_zero3_full", [2, 1, 1, 1, 1, 1, 1, 0],
     "--pipeline-model-parallel-layout"),
])
def test_non_uniform_stages_reach_megatron_exactly(plans, name, counts, flag):
    plan = _with_stages(plans[name], counts)
    result = export_plan(plan, "megatron")
    assert flag in result.text
    args = _parse_megatron(result.text)
    _check_megatron(plan, args)
    assert args.num_layers_per_virtual_pipeline_stage is None
    assert _topics(result.notes) == _topics(export_plan(plans[name], "megatron").notes)
    toml = tomllib.loads(export_plan(plan, "torchtitan").text)
    assert toml["parallelism"]["module_fqns_per_model_part"] == \
        [_expected_modules(s) for s in plan.stages]
    ds_topics = _topics(export_plan(plan, "deepspeed").notes)
    assert ("stage boundaries" in ds_topics) == (plan.config.virtual_stages == 1)


# ---------------------------------------------------------------------------------- torchtitan


@pytest.mark.parametrize("name", sorted(PINS))
def test_torchtitan_toml_parses_back_to_the_plan(plans, name):
    plan = plans[name]
    cfg, training = plan.config, plan.training
    toml = tomllib.loads(export_plan(plan, "torchtitan").text)
    par, train = toml["parallelism"], toml["training"]
    degrees = (par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
               * par["context_parallel_degree"] * par["tensor_parallel_degree"]
               * par["pipeline_parallel_degree"])
    assert degrees == plan.cluster.world_size == CLUSTER.world_size
    assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"],
            par["context_parallel_degree"], par["expert_parallel_degree"]) == \
        (cfg.tp, cfg.pp, cfg.cp, cfg.ep)
    assert par.get("expert_tensor_parallel_degree") == (
        None if cfg.ep == 1 and not cfg.folded else cfg.expert_tp)
    sharded = (par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"])
    assert sharded == ((cfg.dp, 1) if cfg.zero_stage == 3 else (1, cfg.dp))
    assert (train["global_batch_size"], train["seq_len"]) == \
        (training.global_batch_size, training.seq_len)
    dp = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
    microbatches = training.global_batch_size // (cfg.dp * cfg.micro_batch_size)
    if cfg.pp > 1:
        assert train["local_batch_size"] * dp == training.global_batch_size
        assert train["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == \
            microbatches
        schedule = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
                    "zero-bubble": "InterleavedZeroBubble"}[cfg.pp_schedule]
        assert par["pipeline_parallel_schedule"] == schedule
        parts = par["module_fqns_per_model_part"]
        assert len(parts) == cfg.pp * cfg.virtual_stages
        assert parts == [_expected_modules(s) for s in plan.stages]
    else:
        assert train["local_batch_size"] == cfg.micro_batch_size
        assert training.global_batch_size // (train["local_batch_size"] * dp) == microbatches
        assert "pipeline_parallel_schedule" not in par
    checkpoint = toml["activation_checkpoint"]
    if cfg.recompute in ("selective", "per_op"):  # its per-op policy
        assert checkpoint == {"mode": "selective", "selective_ac_option": "op"}
    elif cfg.recompute == "full" and cfg.recompute_every > 1:  # every k-th layer
        assert checkpoint == {"mode": "selective",
                              "selective_ac_option": str(cfg.recompute_every)}
    else:
        assert checkpoint == {"mode": cfg.recompute}
    # torchtitan's default: resharded after forward without a pipeline, kept under one, as the
    # "torchtitan" preset costs it (EstimateOptions.fsdp2)
    assert par["fsdp_reshard_after_forward"] == "default"
    assert train["mixed_precision_param"] == "bfloat16"
    assert par["enable_async_tensor_parallel"] == \
        (plan.training.options["overlap_tp_comm"] and cfg.tp > 1)


TORCHTITAN_NOTES = {
    "tp2_pp4_interleaved_zero3_full": [],
    "tp4_pp2_cp2_zero1_selective": ["context parallel", "grad_reduce_dtype bf16",
                                    "recompute selective", "zero_stage 1"],
    "dp8_cp2_fp16": ["context parallel", "dtype fp16", "zero_stage 0"],
    "tp2_pp4_zero_bubble_zero2_no_sp": ["pp_schedule zero-bubble", "sequence_parallel off",
                                        "zero_stage 2"],
    "pp2_gpipe_zero3": [],
    "moe_ep4_cp2_zero1": ["context parallel", "expert parallel 4", "zero_stage 1"],
    "dp16_zero3_per_op": [],
    "tp2_pp2_full_every2": ["zero_stage 1"],
}


@pytest.mark.parametrize("name", sorted(PINS))
def test_torchtitan_notes_name_exactly_what_it_cannot_express(plans, name):
    assert _topics(export_plan(plans[name], "torchtitan").notes) == TORCHTITAN_NOTES[name]


# ---------------------------------------------------------------------------------- DeepSpeed


@pytest.mark.parametrize("name", sorted(PINS))
def test_deepspeed_json_parses_back_to_the_plan(plans, name):
    plan = plans[name]
    cfg = plan.config
    ds = json.loads(export_plan(plan, "deepspeed").text)
    assert ds["train_batch_size"] == plan.training.global_batch_size
    assert ds["train_batch_size"] == \
        ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * cfg.dp
    assert ds["train_micro_batch_size_per_gpu"] == cfg.micro_batch_size
    assert ds["zero_optimization"]["stage"] == cfg.zero_stage
    assert ds["bf16"]["enabled"] == (plan.training.dtype == "bf16")
    assert ds["fp16"]["enabled"] == (plan.training.dtype == "fp16")
    assert ds["communication_data_type"] == plan.training.options["grad_reduce_dtype"]
    assert ("tensor_parallel" in ds) == (cfg.tp > 1)
    if cfg.tp > 1:
        assert ds["tensor_parallel"]["autotp_size"] == cfg.tp
    assert ("activation_checkpointing" in ds) == (cfg.recompute == "full")


DEEPSPEED_NOTES = {
    "tp2_pp4_interleaved_zero3_full": [
        "pp_schedule interleaved-1f1b with 2 virtual stages", "sequence_parallel",
        "tensor parallel 2", "zero_stage 3", "zero_stage 3 with tensor parallelism"],
    "tp4_pp2_cp2_zero1_selective": ["context parallel 2", "recompute selective",
                                    "sequence_parallel", "tensor parallel 4"],
    "dp8_cp2_fp16": ["context parallel 2"],
    "tp2_pp4_zero_bubble_zero2_no_sp": ["pp_schedule zero-bubble", "tensor parallel 2",
                                        "zero_stage 2"],
    "pp2_gpipe_zero3": ["pp_schedule gpipe", "zero_stage 3"],
    "moe_ep4_cp2_zero1": ["context parallel 2"],
    "dp16_zero3_per_op": ["recompute per_op"],
    "tp2_pp2_full_every2": ["recompute_every 2", "sequence_parallel", "tensor parallel 2"],
}
DEEPSPEED_SETUP = {
    "tp2_pp4_interleaved_zero3_full": ["pipeline parallel 4", "recompute full"],
    "tp4_pp2_cp2_zero1_selective": ["pipeline parallel 2"],
    "dp8_cp2_fp16": [],
    "tp2_pp4_zero_bubble_zero2_no_sp": ["pipeline parallel 4"],
    "pp2_gpipe_zero3": ["pipeline parallel 2"],
    "moe_ep4_cp2_zero1": ["expert parallel 4"],
    "dp16_zero3_per_op": [],
    "tp2_pp2_full_every2": ["pipeline parallel 2", "recompute full"],
}


@pytest.mark.parametrize("name", sorted(PINS))
def test_deepspeed_notes_name_exactly_what_it_cannot_express(plans, name):
    result = export_plan(plans[name], "deepspeed")
    assert _topics(result.notes) == DEEPSPEED_NOTES[name]
    assert _topics(result.setup) == DEEPSPEED_SETUP[name]
    if plans[name].config.pp > 1:
        assert any(f"num_stages={plans[name].config.pp}" in n for n in result.setup)


# ---------------------------------------------------------------------------------- common


@pytest.mark.parametrize("dtype,megatron,titan,ds", [
    ("fp32", [], "float32", (False, False)),
    ("fp8", ["--bf16", "--fp8-format hybrid"], "bfloat16", (True, False)),
])
def test_precision_maps_to_each_target(plans, dtype, megatron, titan, ds):
    base = plans["pp2_gpipe_zero3"]
    plan = dataclasses.replace(base, training=dataclasses.replace(base.training, dtype=dtype))
    flags = export_plan(plan, "megatron").text
    assert all(f in flags for f in megatron) and ("--bf16" in flags) == bool(megatron)
    assert "--fp16" not in flags
    toml = tomllib.loads(export_plan(plan, "torchtitan").text)
    assert toml["training"]["mixed_precision_param"] == titan
    assert ("model" in toml) == (dtype == "fp8")
    config = json.loads(export_plan(plan, "deepspeed").text)
    assert (config["bf16"]["enabled"], config["fp16"]["enabled"]) == ds


def test_deepspeed_zero3_gather_settings_reach_the_json(plans):
    base = plans["pp2_gpipe_zero3"]
    zero = json.loads(export_plan(base, "deepspeed").text)["zero_optimization"]
    assert "stage3_max_reuse_distance" not in zero  # FSDP-style prefetch: not a DeepSpeed rule
    options = {**base.training.options, "zero3_gather": "sync",
               "zero3_max_reuse_distance": 5 * 10**8, "zero3_max_live_params": 10**9}
    plan = dataclasses.replace(base, training=dataclasses.replace(base.training,
                                                                  options=options))
    zero = json.loads(export_plan(plan, "deepspeed").text)["zero_optimization"]
    assert zero["stage3_max_reuse_distance"] == 5 * 10**8
    assert zero["stage3_max_live_parameters"] == 10**9


def test_exports_of_a_saved_plan_match_the_original(plans, tmp_path):
    plan = plans["tp4_pp2_cp2_zero1_selective"]
    loaded = autopar.load_plan(plan.save(tmp_path / "plan.json"))
    for fmt in EXPORT_FORMATS:
        assert export_plan(loaded, fmt) == export_plan(plan, fmt)


def test_unknown_format_is_refused_naming_the_allowed_ones(plans):
    with pytest.raises(ValueError, match="'nemo'.*allowed: megatron, torchtitan, deepspeed"):
        export_plan(plans["dp8_cp2_fp16"], "nemo")


def _with_config(plan, **fields):
    return dataclasses.replace(plan, config=dataclasses.replace(plan.config, **fields))


def test_torchtitan_runs_ddp_only_as_the_sole_parallelism(plans):
    base = plans["tp2_pp4_interleaved_zero3_full"]  # dp=2 under tp=2, pp=4
    assert "zero_stage 0 with tp or pp" in _topics(
        export_plan(_with_config(base, zero_stage=0), "torchtitan").notes)
    alone = plans["dp8_cp2_fp16"]
    ddp = _with_config(alone, cp=1, dp=16)  # DDP over every rank: no note on it
    assert not [n for n in export_plan(ddp, "torchtitan").notes if n.startswith("zero_stage")]


@pytest.mark.parametrize("recipe,titan,megatron", [
    ("tensorwise", "tensorwise", "tensorwise"), ("rowwise", "rowwise", None),
    ("delayed", None, "delayed")])
def test_fp8_recipes_reach_the_engines_that_have_them(plans, recipe, titan, megatron):
    base = plans["pp2_gpipe_zero3"]
    plan = dataclasses.replace(base, training=dataclasses.replace(
        base.training, dtype="fp8", options={**base.training.options, "fp8_recipe": recipe}))
    titan_export = export_plan(plan, "torchtitan")
    toml = tomllib.loads(titan_export.text)
    assert toml["model"]["converters"] == ["quantize.linear.float8"]
    assert toml.get("quantize", {}).get("linear", {}).get("float8", {}).get("recipe_name") == titan
    assert (f"fp8_recipe {recipe}" in _topics(titan_export.notes)) == (titan is None)
    megatron_export = export_plan(plan, "megatron")
    flags = shlex.split(megatron_export.text)
    assert ("--fp8-recipe" in flags) == (megatron is not None)
    if megatron:
        assert flags[flags.index("--fp8-recipe") + 1] == megatron
    assert (f"fp8_recipe {recipe}" in _topics(megatron_export.notes)) == (megatron is None)


def test_deepspeed_moe_layers_refuse_zero3(plans):
    moe = plans["moe_ep4_cp2_zero1"]
    topics = _topics(export_plan(_with_config(moe, zero_stage=3), "deepspeed").notes)
    assert "expert parallel with zero_stage 3" in topics
    assert "expert parallel with zero_stage 3" not in _topics(
        export_plan(moe, "deepspeed").notes)
