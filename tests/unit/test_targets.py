"""Compile targets (`autopar.targets`): a plan made for an engine is one the engine takes.

Per engine, random problems in the style of benchmarks/compile_fuzz.py (zoo models, shipped
clusters, batch and sequence sizes, precisions, pins drawn from what the engine takes) compile
to plans whose export to that engine has no note, or end in an error naming the rule. The rule
tables are also checked against the exports from the other side: over plans made for autopar's
runtime, a config breaks an engine's rules exactly when its export to that engine has notes.
"""

import functools
import random

import pytest
import torch

import autopar
from autopar.config import ParallelConfig
from autopar.errors import TargetRuleError
from autopar.estimate.core import ModelCosts
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.registry import build, preset
from autopar.plan.export import EXPORT_FORMATS, export_plan
from autopar.plan.render import fmt_seconds
from autopar.targets import TARGETS, Facts, get_target
from autopar.trace import trace

ENGINES = ("megatron", "torchtitan", "deepspeed")
MODELS = ("gpt2", "gpt2-medium", "gpt3-1.3b", "llama3-8b", "llama2-7b", "mixtral-8x7b",
          "vit-b-16")
PROFILES = ("dgx-a100-80g", "dgx-h100", "dgx-h200", "dgx-b200", "h100-pcie-roce", "mi300x-8")
SETTINGS = autopar.SearchSettings(progress=False)


@functools.cache
def _model(name: str):
    return build(name)


def _pins(rng: random.Random, engine: str) -> dict:
    """Pins on a few fields, drawn from the values the engine takes."""
    allowed = {rule.field: rule.values for rule in TARGETS[engine].allowed}
    choices = {"tp": [1, 2, 4, 8], "pp": [1, 2, 4], "cp": [1, 2], "zero_stage": [0, 1, 2, 3],
               "recompute": ["none", "selective", "full"], "micro_batch_size": [1, 2],
               "pp_schedule": ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]}
    return {f: rng.choice([v for v in values if v in allowed.get(f, values)])
            for f, values in choices.items() if rng.random() < 0.12}


def _problem(rng: random.Random, engine: str):
    name = rng.choice(MODELS)
    cluster = autopar.Cluster.from_profile(rng.choice(PROFILES),
                                           num_nodes=rng.choice([1, 2, 4, 8]))
    dtype = rng.choice(["bf16", "bf16", "fp32", "fp8"])
    if name.startswith("vit"):
        shape = dict(global_batch_size=rng.choice([64, 256, 1024]),
                     example_inputs=torch.empty(1, 3, 224, 224, device="meta"))
    else:
        shape = dict(global_batch_size=rng.choice([16, 32, 64, 128, 256, 512]),
                     seq_len=min(preset(name).max_seq_len, rng.choice([1024, 2048, 4096])))
    return name, cluster, dtype, shape, _pins(rng, engine)


def _facts(model, dtype: str, shape: dict, options) -> Facts:
    if "example_inputs" in shape:
        graph = trace(model, example_inputs=shape["example_inputs"], dtype=dtype)
    else:
        graph = trace(model, global_batch_size=1, seq_len=shape["seq_len"], dtype=dtype)
    return Facts.of(ModelCosts.from_graph(graph), dtype, options)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_plan_made_for_an_engine_exports_to_it_without_notes(engine):
    rng = random.Random(f"targets-{engine}")
    plans, refused = 0, []
    for _ in range(20):
        name, cluster, dtype, shape, pins = _problem(rng, engine)
        try:
            plan = autopar.compile(_model(name), cluster, dtype=dtype, constraints=pins,
                                   target=engine, settings=SETTINGS, **shape)
        except ValueError as error:  # the library's user errors
            refused.append(str(error))
            continue
        plans += 1
        label = f"{name} on {cluster.name} x{cluster.num_nodes} {dtype} {shape} pins {pins}"
        assert export_plan(plan, engine).notes == (), label
        assert plan.training.target == engine
        assert plan.training.software == TARGETS[engine].software
        assert all(getattr(plan.config, f) == v for f, v in pins.items()), label
        assert plan.estimate.fits
        facts = _facts(_model(name), dtype, shape, autopar.SOFTWARE[engine].options)
        assert TARGETS[engine].violations(plan.config, facts) == [], label
    assert plans >= 12, refused  # the problems mostly have plans: the check is not vacuous
    for message in refused:  # an engine's refusal names its engine
        assert "target=" in message or "no plan fits" in message or \
            "no configuration satisfies" in message or "has no" in message, message


@functools.cache
def _autopar_plans() -> list[tuple]:
    """Plans for autopar's runtime under random pins on every field the rules read."""
    rng = random.Random("targets-rules")
    out = []
    fields = {"tp": [1, 2, 4], "pp": [1, 2, 4], "cp": [1, 2], "ep": [1, 2],
              "zero_stage": [0, 1, 2, 3], "recompute": ["none", "selective", "full"],
              "pp_schedule": ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"],
              "sequence_parallel": [False, True],
              "mesh_order": ["pp,dp,cp,tp", "dp,pp,cp,tp", "tp,cp,dp,pp"]}
    while len(out) < 18:
        name = rng.choice(("gpt2", "llama3-8b", "mixtral-8x7b", "vit-b-16"))
        dtype = rng.choice(["bf16", "fp16", "fp8"])
        shape = (dict(global_batch_size=256,
                      example_inputs=torch.empty(1, 3, 224, 224, device="meta"))
                 if name.startswith("vit") else dict(global_batch_size=64, seq_len=2048))
        pins = {f: rng.choice(v) for f, v in fields.items() if rng.random() < 0.35}
        cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=rng.choice([1, 2, 4]))
        try:
            plan = autopar.compile(_model(name), cluster, dtype=dtype, constraints=pins,
                                   settings=SETTINGS, **shape)
        except ValueError:
            continue
        out.append((plan, _facts(_model(name), dtype, shape, autopar.EstimateOptions())))
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_a_config_breaks_an_engines_rules_exactly_when_its_export_has_notes(engine):
    target, broken = TARGETS[engine], 0
    for plan, facts in _autopar_plans():
        settings_hold = all(s.holds(facts) for s in target.settings)
        # every engine splits each sub-layer as Megatron-LM does: a plan whose layout
        # replicates some (the intra-op ILP's, for autopar's runtime) breaks that rule too
        megatron_layout = not any(e.get("replicated_sublayers") for e in plan.intra_op.values())
        rules_hold = settings_hold and megatron_layout \
            and not target.violations(plan.config, facts)
        notes = export_plan(plan, engine).notes
        label = f"{plan.config.short()} {plan.training.dtype}: {notes}"
        if plan.search["stage_cut"] == "even (Megatron)":
            assert rules_hold == (notes == ()), label
        else:  # stages re-cut unevenly: the rules speak of the even cut
            assert rules_hold or notes, label
        broken += not rules_hold
    assert 0 < broken < len(_autopar_plans())


def test_a_pin_outside_the_engines_table_is_refused_with_rule_source_and_allowed_values():
    model = _model("gpt2")
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
    with pytest.raises(TargetRuleError, match=r"zero_stage=3 cannot run on Megatron-LM "
                       r"core_r0\.13\.0 \(target='megatron'\): the distributed optimizer .* "
                       r"allowed zero_stage: 0, 1 \(source: megatron/training/arguments\.py"):
        autopar.compile(model, cluster, global_batch_size=64, seq_len=1024, target="megatron",
                        constraints={"zero_stage": 3})
    with pytest.raises(TargetRuleError, match=r"cp=2 cannot run on DeepSpeed 0\.16\.4 .*Ulysses"
                       r".*allowed cp: 1 \(source: deepspeed/sequence/layer\.py"):
        autopar.compile(model, cluster, global_batch_size=64, seq_len=1024, target="deepspeed",
                        constraints={"cp": 2})
    with pytest.raises(TargetRuleError, match=r"target='torchtitan' .*cannot take this plan's "
                       r"precision: mixed_precision_param is bfloat16 or float32"):
        autopar.compile(model, cluster, global_batch_size=64, seq_len=1024, dtype="fp16",
                        target="torchtitan")
    with pytest.raises(ValueError, match=r"target='nemo' is not an engine autopar plans for; "
                       r"targets: autopar, megatron, torchtitan, deepspeed"):
        get_target("nemo")


def test_pins_each_allowed_but_not_together_name_the_combination_rule():
    with pytest.raises(ValueError, match=r"torchtitan .* runs none of the .* configurations "
                       r"left by the pins: every configuration breaks this rule: ZeRO-0 \(DDP\) "
                       r"over dp > 1 only as the sole parallelism"):
        autopar.compile(_model("gpt2"), autopar.Cluster.from_profile("dgx-h100", num_nodes=1),
                        global_batch_size=64, seq_len=1024, target="torchtitan",
                        constraints={"zero_stage": 0, "tp": 2, "dp": 4})


def test_the_restriction_cost_is_the_best_plan_for_autopars_runtime_with_the_same_software():
    model, cluster = _model("gpt3-1.3b"), autopar.Cluster.from_profile("dgx-h100", num_nodes=2)
    kw = dict(global_batch_size=64, seq_len=2048, settings=SETTINGS)
    plan = autopar.compile(model, cluster, target="deepspeed", **kw)
    free = autopar.compile(model, cluster, software="deepspeed", **kw)
    assert plan.training.unrestricted == {"step_time_s": free.estimate.step_time_s,
                                             "config": free.config.short()}
    assert free.training.target == "autopar" and "unrestricted" not in free.training
    report = plan.report()
    assert "target   deepspeed: only what DeepSpeed 0.16.4 runs" in report
    cost = 100 * (plan.estimate.step_time_s / free.estimate.step_time_s - 1)
    assert (f"restriction cost {cost:+.1f}%: best for autopar's runtime "
            f"{fmt_seconds(free.estimate.step_time_s)} vs best for deepspeed "
            f"{fmt_seconds(plan.estimate.step_time_s)}") in report
    assert f"(autopar's runtime: {free.config.short()}, same pins and software)" in report
    # software chosen by the caller costs the plan; the target still restricts it
    mine = autopar.compile(model, cluster, target="deepspeed", software="autopar", **kw)
    assert mine.training.software == "autopar" and mine.config.tp == mine.config.cp == 1


def test_deepspeed_keeps_the_even_stage_cut_and_megatron_runs_1f1b_with_few_microbatches():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=8192, max_seq_len=1024, dim=1024, n_layers=8,
                              n_heads=16))
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
    pins = {"pp": 4, "tp": 1, "cp": 1}  # dp = 2, 4 sequences: fewer micro-batches than stages
    for engine in ("megatron", "deepspeed"):
        plan = autopar.compile(model, cluster, global_batch_size=4, seq_len=1024,
                               constraints=pins, target=engine, settings=SETTINGS)
        assert plan.config.pp_schedule == "1f1b"
        assert plan.estimate.num_microbatches < plan.config.pp
        assert export_plan(plan, engine).notes == ()
    counts = [sum(n.startswith("layers.") for n in s) for s in plan.stages]
    assert counts == [2, 2, 2, 2] and plan.search["stage_cut"] == "even (Megatron)"
    runtime = autopar.compile(model, cluster, global_batch_size=4, seq_len=1024,
                              constraints=pins, settings=SETTINGS)
    assert runtime.config.pp_schedule == "gpipe"  # autopar's 1F1B needs one per rank


def test_the_mesh_order_rules_follow_each_engines_rank_layout():
    facts = _facts(_model("gpt2"), "bf16", dict(seq_len=1024), autopar.EstimateOptions())
    swapped = ParallelConfig(dp=4, tp=2, pp=2, zero_stage=1, sequence_parallel=True,
                             mesh_order="dp,pp,cp,tp")
    assert TARGETS["megatron"].violations(swapped, facts) == []  # --use-tp-pp-dp-mapping
    for engine in ("torchtitan", "deepspeed"):
        assert any(v.startswith("mesh order") for v in
                   TARGETS[engine].violations(swapped, facts))
    # an axis of one rank sits anywhere
    lone = ParallelConfig(dp=16, tp=1, pp=1, zero_stage=3, mesh_order="tp,cp,dp,pp")
    assert not any(v.startswith("mesh order") for v in
                   TARGETS["torchtitan"].violations(lone, facts))
    plan = autopar.compile(_model("gpt2"), autopar.Cluster.from_profile("dgx-h100",
                                                                        num_nodes=4),
                           global_batch_size=256, seq_len=1024, target="megatron",
                           constraints={"tp": 2, "pp": 2},
                           settings=autopar.SearchSettings(progress=False, mesh_orders="all"))
    assert export_plan(plan, "megatron").notes == ()


def test_the_autopar_target_restricts_nothing_and_exports_are_named_alike():
    assert set(EXPORT_FORMATS) == set(ENGINES) == set(TARGETS) - {"autopar"}
    assert not TARGETS["autopar"].restricts and TARGETS["autopar"].runtime_limits
    for engine in ENGINES:
        assert TARGETS[engine].software in autopar.SOFTWARE
        for rule in TARGETS[engine].rules + TARGETS[engine].settings:
            assert rule.reason and rule.source


def test_explain_re_plans_for_the_plans_own_engine():
    model, cluster = _model("gpt2"), autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
    plan = autopar.compile(model, cluster, global_batch_size=64, seq_len=1024,
                           target="torchtitan", software="torchtitan-compile",
                           settings=SETTINGS)
    why = plan.explain(model, cluster, tp=2)
    assert why.alternative.training.target == "torchtitan"
    assert why.alternative.training.software == "torchtitan-compile"
    assert export_plan(why.alternative, "torchtitan").notes == ()
    refused = plan.explain(model, cluster, zero_stage=1)
    assert refused.alternative is None and "zero_stage=1 cannot run on torchtitan" in \
        refused.reason
