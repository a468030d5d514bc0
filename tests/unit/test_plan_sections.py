"""The typed sections of a Plan (`autopar.plan.sections`): what a compiled plan holds, how each
saves under the plan file's keys and loads back, what an older file without the newer keys
reads as, and that every field says what it is."""

import ast
import dataclasses
import inspect
import json

import pytest
import torch

import autopar
from autopar.config import ParallelConfig
from autopar.estimate import EstimateOptions
from autopar.models.gpt import GPT, GPTConfig
from autopar.plan.sections import PlanCluster, PlanMesh, PlanModel, PlanTraining
from autopar.search.settings import SearchSettings

SECTIONS = (PlanMesh, PlanModel, PlanCluster, PlanTraining)


@pytest.fixture(scope="module")
def plan():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=8192, max_seq_len=1024, dim=512, n_layers=4,
                              n_heads=8))
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
    return autopar.compile(model, cluster, global_batch_size=32, seq_len=1024,
                           constraints={"tp": 2}, target="megatron",
                           settings=SearchSettings(progress=False))


def test_a_compiled_plan_holds_typed_sections_that_agree_with_its_config(plan):
    cfg = plan.config
    assert isinstance(plan.mesh, PlanMesh) and isinstance(plan.model, PlanModel)
    assert isinstance(plan.cluster, PlanCluster) and isinstance(plan.training, PlanTraining)
    assert plan.mesh.axes == cfg.mesh_order
    assert dict(zip(plan.mesh.axes, plan.mesh.sizes)) == \
        {"pp": cfg.pp, "dp": cfg.dp, "cp": cfg.cp, "tp": cfg.tp}
    assert plan.cluster.world_size == 8 and plan.cluster.profile == "dgx-h100"
    assert (plan.training.global_batch_size, plan.training.seq_len) == (32, 1024)
    assert plan.training.constraints == {"tp": 2} and plan.training.target == "megatron"
    assert plan.training.unrestricted["step_time_s"] > 0
    assert plan.model.model_class == "GPT" and plan.model.num_layers >= 4


def test_sections_save_under_the_files_keys_and_load_back_equal(plan, tmp_path):
    data = json.loads(plan.to_json())
    assert data["model"]["class"] == "GPT" and "model_class" not in data["model"]
    assert "input" not in data["training"] and "fp8_weights" not in data["training"]
    assert data["training"]["seq_len"] == 1024 and data["mesh"]["axes"] == ["pp", "dp", "cp", "tp"]
    loaded = autopar.load_plan(plan.save(tmp_path / "plan.json"))
    for name in ("mesh", "model", "cluster"):
        assert getattr(loaded, name) == getattr(plan, name), name
    assert loaded.to_json() == plan.to_json()  # training's floats as saved: 12 digits


def test_a_file_without_the_newer_keys_reads_with_their_defaults(plan):
    old = json.loads(plan.to_json())["training"]
    for key in ("target", "software", "unrestricted", "memory_headroom",
                "memory_headroom_kept", "device_memory_bytes"):
        old.pop(key, None)
    training = PlanTraining.from_dict(old)
    assert training.target == "autopar" and training.unrestricted is None
    assert training.memory_headroom_kept and training.device_memory_bytes is None
    with pytest.raises(KeyError, match="dtype"):
        PlanTraining.from_dict({k: v for k, v in old.items() if k != "dtype"})
    with pytest.raises(TypeError, match=r"no field\(s\) \['typo'\]"):
        PlanTraining.from_dict({**old, "typo": 1})
    mesh = PlanMesh.from_dict({"axes": ["pp", "dp", "cp", "tp"], "sizes": [1, 8, 1, 1]})
    assert (mesh.ep, mesh.ep_within) == (1, "dp*cp") and mesh.sizes == (1, 8, 1, 1)


def test_reading_a_section_by_its_saved_key_still_works(plan):
    assert plan.training["dtype"] == plan.training.dtype
    assert plan.model["class"] == plan.model.model_class
    assert plan.training.get("input", "none") == "none" and "input" not in plan.training
    assert "unrestricted" in plan.training and plan.training.get("nothing") is None
    with pytest.raises(KeyError):
        plan.mesh["model_class"]


def _undocumented(cls) -> list[str]:
    """The fields of dataclass `cls` with no string literal right after them in its source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    documented = {stmt.target.id for stmt, after in zip(body, body[1:] + [None])
                  if isinstance(stmt, ast.AnnAssign) and isinstance(after, ast.Expr)
                  and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}
    return [f.name for f in dataclasses.fields(cls) if f.name not in documented]


@pytest.mark.parametrize("cls", [*SECTIONS, ParallelConfig, EstimateOptions, SearchSettings],
                         ids=lambda c: c.__name__)
def test_every_field_says_what_it_is(cls):
    assert _undocumented(cls) == []
