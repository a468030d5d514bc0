"""Single-process checks of the runtime's plan-reading pieces (no process group): tensor-parallel
styles from placements (GPT's fused qkv split by head, its tied head, ResNet's output-channel
parallel convolutions, the parameters no style runs), pipeline stage modules that keep the
reference FQNs and compose to the full model (GPT's stages skip the embeddings and hold the tied
matrix), and the clear refusals (conv layouts that do not run, uneven context-parallel chunks,
wrong world size).  Expert
parallel's single-process pieces are in test_expert_parallel.py."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import autopar
from autopar.runtime import apply_plan, check_world_size
from autopar.runtime.context_parallel import check_context_parallel
from autopar.runtime.pipeline import (
    TiedCopy,
    _TiedHolder,
    build_stage_modules,
    stage_ids_for_rank,
)
from autopar.runtime.tensor_parallel import _unhandled, apply_tensor_parallel, tp_styles

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_models  # noqa: E402


def _plan(factory, ranks, **constraints):
    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=ranks)
    return autopar.compile(factory(), cluster, global_batch_size=8, dtype="fp32",
                           constraints=constraints, **tiny_models.shape_args(factory.__name__))


def test_tp_styles_follow_megatron_placements():
    plan = _plan(tiny_models.tiny_llama_wide, 2, tp=2)
    styles = tp_styles(tiny_models.tiny_llama_wide(), plan.placements)
    assert styles["tok_embeddings"] == "vocab"
    for name, kind in styles.items():
        if name.endswith((".wq", ".wk", ".wv", ".w1", ".w3")) or name == "output":
            assert kind == "colwise", name
        if name.endswith((".wo", ".w2")):
            assert kind == "rowwise", name


def test_resnet_convolutions_run_output_channel_parallel():
    """A ResNet plan with tp=2 shards every convolution's output channels (S(0)) and the fc
    head; each convolution maps to the output-channel parallel style, the head to colwise,
    and nothing the plan shards is left replicated."""
    plan = _plan(tiny_models.tiny_resnet, 2, tp=2)
    model = tiny_models.tiny_resnet()
    styles = tp_styles(model, plan.placements)
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert all(plan.placements[f"{n}.weight"]["tp"] == "S(0)" for n in convs)
    assert styles == {**{n: "channels" for n in convs}, "fc": "colwise"}
    assert _unhandled(model, plan.placements, styles) == []


def test_parameters_the_plan_shards_but_no_style_runs_are_named():
    """A parameter the plan shards on tp whose module no style runs (here a batch norm's
    weight) is listed: apply_tensor_parallel warns that it runs replicated."""
    model = tiny_models.tiny_resnet()
    placements = {"conv1.weight": {"tp": "S(0)"}, "fc.weight": {"tp": "S(0)"},
                  "fc.bias": {"tp": "S(0)"}, "bn1.weight": {"tp": "S(0)"}}
    styles = tp_styles(model, placements)
    assert styles == {"conv1": "channels", "fc": "colwise"}
    assert _unhandled(model, placements, styles) == ["bn1.weight"]


def test_a_tied_head_on_a_later_pipeline_stage_is_not_listed_as_replicated():
    """GPT's last stage holds the tied matrix first under ``tok_embeddings`` (a holder, not an
    embedding); the column-parallel head shards it, so nothing is listed."""
    plan = _plan(tiny_models.tiny_gpt, 4, tp=2, pp=2, micro_batch_size=2)
    for stage in build_stage_modules(tiny_models.tiny_gpt(), plan.stages, [0, 1]):
        assert _unhandled(stage, plan.placements, tp_styles(stage, plan.placements)) == []


class _Net(nn.Module):
    def __init__(self, conv: nn.Module):
        super().__init__()
        self.features = nn.Sequential(conv)


@pytest.mark.parametrize("conv,spec,match", [
    (nn.Conv2d(4, 8, 3), "S(1)", r"features\.0: .*dim 1 \(input channels\).*S\(0\).*tp=1"),
    (nn.Conv2d(4, 8, 3, groups=2), "S(0)", r"features\.0: a grouped conv.*\(groups=2\).*tp=1"),
    (type("MyConv", (nn.Conv2d,), {})(4, 8, 3), "S(0)", r"features\.0: .*MyConv.*tp=1"),
])
def test_conv_layouts_that_do_not_run_are_refused_naming_the_module(conv, spec, match):
    with pytest.raises(ValueError, match=match):
        tp_styles(_Net(conv), {"features.0.weight": {"tp": spec}})


def test_conv_channels_not_divisible_by_tp_are_refused_before_any_collective():
    model = _Net(nn.Conv2d(4, 6, 3))
    plan = SimpleNamespace(placements={"features.0.weight": {"tp": "S(0)"},
                                       "features.0.bias": {"tp": "S(0)"}})
    with pytest.raises(ValueError, match=r"features\.0: .*6 output channels over tp=4"):
        apply_tensor_parallel(model, plan, SimpleNamespace(size=lambda: 4))


@pytest.mark.parametrize("pp,virtual", [(2, 1), (2, 2)])
def test_stage_modules_keep_fqns_and_compose(pp, virtual):
    extra = {"pp_schedule": "interleaved-1f1b", "virtual_stages": virtual} if virtual > 1 else {}
    plan = _plan(tiny_models.tiny_llama, pp, pp=pp, micro_batch_size=2, **extra)
    model = tiny_models.tiny_llama()
    n = len(plan.stages)
    assert n == pp * virtual
    mods = build_stage_modules(model, plan.stages, list(range(n)))
    full = dict(model.named_parameters())
    names = [k for m in mods for k, _ in m.named_parameters()]
    assert sorted(names) == sorted(full)  # every parameter on exactly one stage, same FQN
    for m in mods:
        for k, p in m.named_parameters():
            assert torch.equal(p, full[k])
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    h = tokens
    for m in mods:
        h = m(h)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=1e-6)
    assert stage_ids_for_rank(1, pp, n) == list(range(1, n, pp))


def test_tp_styles_split_gpt_qkv_by_head_and_follow_the_tied_head():
    plan = _plan(tiny_models.tiny_gpt, 2, tp=2)
    styles = tp_styles(tiny_models.tiny_gpt(), plan.placements)
    assert "output.weight" not in plan.placements  # tied: the plan keys tok_embeddings.weight
    assert styles["tok_embeddings"] == "vocab" and styles["output"] == "colwise"
    assert "pos_embeddings" not in styles  # replicated
    for i in range(2):
        assert styles[f"layers.{i}.attention.qkv"] == "heads"
        assert styles[f"layers.{i}.attention.wo"] == "rowwise"
        assert styles[f"layers.{i}.feed_forward.w1"] == "colwise"


def test_gpt_stage_modules_skip_the_embeddings_and_hold_the_tied_head():
    """Stages after the first take the hidden state (GPT.forward skips the token and position
    embeddings on a floating input); the last stage holds the tied embedding matrix under its
    reference name, as a pass-through, and both stages know they share it."""
    plan = _plan(tiny_models.tiny_gpt, 2, pp=2, micro_batch_size=2)
    model = tiny_models.tiny_gpt()
    first, last = build_stage_modules(model, plan.stages, [0, 1])
    assert isinstance(last.tok_embeddings, _TiedHolder) and isinstance(last.pos_embeddings, nn.Identity)
    assert last.output.weight is last.tok_embeddings.weight
    names = [k for m in (first, last) for k, _ in m.named_parameters()]
    assert names.count("tok_embeddings.weight") == 2
    assert sorted(set(names)) == sorted(k for k, _ in model.named_parameters())
    from autopar.runtime.pipeline import _TIED

    assert _TIED[first] == _TIED[last] == [TiedCopy("tok_embeddings.weight", (0, 1))]
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(last(first(tokens)), model(tokens), rtol=0, atol=1e-6)


def test_pipelining_a_model_whose_forward_cannot_skip_its_inputs_is_refused():
    from autopar.models.gpt import GPT

    plan = _plan(tiny_models.tiny_gpt, 2, pp=2, micro_batch_size=2)
    model = tiny_models.tiny_gpt()
    model.__class__ = type("PlainGPT", (GPT,), {"accepts_hidden_states": False})
    with pytest.raises(ValueError, match=r"several input modules \(pos_embeddings, "
                                         r"tok_embeddings\).*accepts_hidden_states"):
        build_stage_modules(model, plan.stages, [1])


def test_context_parallel_plan_is_checked_before_any_collective():
    """cp > 1 runs (tests/distributed/test_context_parallel.py); a plan whose sequence does not
    cut into 2*cp equal zigzag chunks is refused by apply_plan before it needs a process group."""
    plan = _plan(tiny_models.tiny_llama, 2, cp=2)
    check_context_parallel(plan)
    bad = SimpleNamespace(config=plan.config, mesh=plan.mesh, cluster=plan.cluster,
                          training={**plan.training, "seq_len": 62})
    with pytest.raises(ValueError, match="seq_len=62 is not divisible by 4"):
        apply_plan(tiny_models.tiny_llama(), bad)


def test_a_model_without_weights_is_refused_before_any_collective():
    """A factory that returns a meta-device model (autopar.models.build's default) gets an
    error naming the fix, not PyTorch's "Cannot copy out of meta tensor" from deep inside."""
    plan = _plan(tiny_models.tiny_llama, 2, dp=2)
    with torch.device("meta"):
        model = tiny_models.tiny_llama()
    with pytest.raises(ValueError, match=r"meta device \(.* more tensors have no data\).*"
                                         r"device='cpu'"):
        apply_plan(model, plan)


def test_world_size_check():
    plan = _plan(tiny_models.tiny_llama, 2, dp=2)
    check_world_size(plan, 2)
    with pytest.raises(ValueError, match="needs 2 processes"):
        check_world_size(plan, 4)
