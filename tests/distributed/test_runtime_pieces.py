"""Single-process checks of the runtime's plan-reading pieces (no process group): the tensor
dims each parameter is sharded on over tp (GPT's tied head on a later pipeline stage, ResNet's
output-channel parallel convolutions), pipeline stage modules that keep the reference FQNs and
compose to the full model (GPT's first and last stages hold the tied matrix; models written
elsewhere, Hugging Face's included, split by structure), and the clear refusals (conv layouts that do not run, uneven context-parallel chunks,
wrong world size).  Expert
parallel's single-process pieces are in test_expert_parallel.py."""

from __future__ import annotations

import dataclasses

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
    build_stage_modules,
    install_stage_io,
    probe_layout,
    set_stage_tokens,
    stage_ids_for_rank,
)
from autopar.runtime.tensor_parallel import apply_tensor_parallel, tp_dims

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corpus  # noqa: E402
import tiny_models  # noqa: E402


def _plan(factory, ranks, **constraints):
    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=ranks)
    return autopar.compile(factory(), cluster, global_batch_size=8, dtype="fp32",
                           constraints=constraints, **tiny_models.shape_args(factory.__name__))


def test_tp_dims_follow_megatron_placements():
    plan = _plan(tiny_models.tiny_llama_wide, 2, tp=2)
    dims = tp_dims(tiny_models.tiny_llama_wide(), plan.placements)
    assert dims["tok_embeddings.weight"] == 0
    for name, p in tiny_models.tiny_llama_wide().named_parameters():
        if name.endswith((".wq.weight", ".wk.weight", ".wv.weight", ".w1.weight", ".w3.weight")) \
                or name in ("output.weight", "tok_embeddings.weight"):
            assert dims[name] == 0, name
        elif name.endswith((".wo.weight", ".w2.weight")):
            assert dims[name] == 1, name
        else:
            assert name not in dims, name  # norms stay replicated


def test_resnet_plan_shards_every_convolution_on_its_output_channels():
    plan = _plan(tiny_models.tiny_resnet, 2, tp=2)
    model = tiny_models.tiny_resnet()
    dims = tp_dims(model, plan.placements)
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert all(dims[f"{n}.weight"] == 0 for n in convs)
    assert dims["fc.weight"] == 0


def test_a_tied_head_follows_the_placement_of_its_first_name_on_every_stage():
    """GPT's first and last stages both hold the tied matrix (the embedding and the head);
    on each, both names carry the plan's vocab-parallel placement."""
    plan = _plan(tiny_models.tiny_gpt, 4, tp=2, pp=2, micro_batch_size=2)
    stages = build_stage_modules(tiny_models.tiny_gpt(), plan.stages, [0, 1], _tokens(2))
    for stage in stages:
        dims = tp_dims(stage, plan.placements)
        assert dims["output.weight"] == dims["tok_embeddings.weight"] == 0


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
    plan = SimpleNamespace(placements={"features.0.weight": {"tp": spec}})
    with pytest.raises(ValueError, match=match):
        apply_tensor_parallel(_Net(conv), plan, SimpleNamespace(size=lambda: 2))


def test_conv_channels_not_divisible_by_tp_are_refused_before_any_collective():
    model = _Net(nn.Conv2d(4, 6, 3))
    plan = SimpleNamespace(placements={"features.0.weight": {"tp": "S(0)"},
                                       "features.0.bias": {"tp": "S(0)"}})
    with pytest.raises(ValueError, match=r"features\.0: .*6 output channels over tp=4"):
        apply_tensor_parallel(model, plan, SimpleNamespace(size=lambda: 4))


def _tokens(batch: int, seq: int = 16, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def _run_stages(mods: list[nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    """The stage modules run one after another in this process, as the schedule chains them."""
    for m in mods:
        install_stage_io(m)
    set_stage_tokens(mods, tokens, 1)
    h = tokens
    for m in mods:
        h = m(h)
    return h


@pytest.mark.parametrize("pp,virtual", [(2, 1), (2, 2)])
def test_stage_modules_keep_fqns_and_compose(pp, virtual):
    extra = {"pp_schedule": "interleaved-1f1b", "virtual_stages": virtual} if virtual > 1 else {}
    plan = _plan(tiny_models.tiny_llama, pp, pp=pp, micro_batch_size=2, **extra)
    model = tiny_models.tiny_llama()
    n = len(plan.stages)
    assert n == pp * virtual
    mods = build_stage_modules(model, plan.stages, list(range(n)), _tokens(2))
    full = dict(model.named_parameters())
    names = [k for m in mods for k, _ in m.named_parameters()]
    assert sorted(names) == sorted(full)  # every parameter on exactly one stage, same FQN
    for m in mods:
        for k, p in m.named_parameters():
            assert torch.equal(p, full[k])
    tokens = _tokens(2)
    torch.testing.assert_close(_run_stages(mods, tokens), model(tokens), rtol=0, atol=1e-6)
    assert stage_ids_for_rank(1, pp, n) == list(range(1, n, pp))


def test_gpt_stages_hold_the_tied_matrix_on_the_first_and_last_stage():
    """The token embedding and the head share one matrix: the first stage reads it before the
    blocks, the last after them, so both hold a copy under the same names and know they share
    it; a later stage's embeddings run on zeros, its hidden input comes from the stage before."""
    plan = _plan(tiny_models.tiny_gpt, 2, pp=2, micro_batch_size=2)
    model = tiny_models.tiny_gpt()
    first, last = build_stage_modules(model, plan.stages, [0, 1], _tokens(2))
    assert last.output.weight is last.tok_embeddings.weight
    assert isinstance(last.tok_embeddings, nn.Embedding)
    assert "pos_embeddings.weight" not in dict(last.named_parameters())
    names = [k for m in (first, last) for k, _ in m.named_parameters()]
    assert names.count("tok_embeddings.weight") == 2
    assert sorted(set(names)) == sorted(k for k, _ in model.named_parameters())
    from autopar.runtime.pipeline import _TIED

    assert _TIED[first] == _TIED[last] == [TiedCopy("tok_embeddings.weight", (0, 1))]
    tokens = _tokens(2)
    torch.testing.assert_close(_run_stages([first, last], tokens), model(tokens), rtol=0,
                               atol=1e-6)


@pytest.mark.parametrize("factory", ["nano_gpt", "hf_llama", "hf_gpt2", "litgpt_style"])
def test_stages_of_models_written_elsewhere_compose_to_the_model(factory):
    """Nested block lists (``transformer.h``, ``model.layers``), positions, masks and rotary
    tables computed in the model's own forward, tuple and ModelOutput outputs: the stages of a
    pp=2 plan chained in one process give the model's logits."""
    model = getattr(corpus, factory)()
    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=2)
    with torch.device("meta"):
        meta = getattr(corpus, factory)()
    plan = autopar.compile(meta, cluster, global_batch_size=8, seq_len=16, dtype="fp32",
                           constraints={"pp": 2, "micro_batch_size": 2})
    tokens = _tokens(2, vocab=corpus.VOCAB)
    mods = build_stage_modules(model, plan.stages, [0, 1], tokens)
    torch.testing.assert_close(_run_stages(mods, tokens), corpus.logits_of(model(tokens)),
                               rtol=0, atol=1e-6)


def test_a_parameter_read_between_blocks_is_refused_for_pipelining():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.scale = nn.Parameter(torch.ones(8))
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, tokens):
            x = self.emb(tokens)
            for block in self.blocks:
                x = block(x) * self.scale
            return x

    with pytest.raises(ValueError, match=r"parameter scale is read between blocks.0 and the next"):
        probe_layout(Shared(), torch.zeros(2, 4, dtype=torch.long))


def test_a_model_without_a_block_list_is_refused_for_pipelining():
    with pytest.raises(ValueError, match=r"Sequential has no block list.*pp=1"):
        probe_layout(nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8)),
                     torch.zeros(2, 4, dtype=torch.long))


def test_context_parallel_plan_is_checked_before_any_collective():
    """cp > 1 runs (tests/distributed/test_context_parallel.py); a plan whose sequence does not
    cut into 2*cp equal zigzag chunks (cp contiguous ones) is refused by apply_plan before it
    needs a process group (the contiguous layout with tp or ep runs: test_runtime_matrix.py).
    """
    plan = _plan(tiny_models.tiny_llama, 2, cp=2)
    check_context_parallel(plan)
    bad = SimpleNamespace(config=plan.config, mesh=plan.mesh, cluster=plan.cluster,
                          model=plan.model,
                          training=dataclasses.replace(plan.training, seq_len=62))
    with pytest.raises(ValueError, match="seq_len=62 is not divisible by 4"):
        apply_plan(tiny_models.tiny_llama(), bad)
    contiguous = dataclasses.replace(plan.model, cp_layout="contiguous")
    odd = SimpleNamespace(config=plan.config, model=contiguous,
                          training=dataclasses.replace(plan.training, seq_len=63))
    with pytest.raises(ValueError, match="seq_len=63 is not divisible by 2"):
        check_context_parallel(odd)
    with_tp = SimpleNamespace(config=dataclasses.replace(plan.config, tp=2), model=contiguous,
                              training=plan.training)
    check_context_parallel(with_tp)
    with_ep = SimpleNamespace(config=dataclasses.replace(plan.config, ep=2), model=contiguous,
                              training=plan.training)
    check_context_parallel(with_ep)


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
