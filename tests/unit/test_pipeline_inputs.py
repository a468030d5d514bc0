"""Pipeline parallel of models that take one input tensor other than token ids (a ViT on
images): compile records the input's per-sample shape and dtype, which the runtime's probe
forward is built from; a model taking several inputs is refused pipeline parallel, saying why."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import autopar
from autopar.api import _input_spec
from autopar.runtime.apply import _example_microbatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corpus  # noqa: E402


def test_input_spec_is_one_sample_of_one_tensor():
    images = torch.zeros(4, 3, 16, 16)
    assert _input_spec(images) == {"shape": [3, 16, 16], "dtype": "float32"}
    assert _input_spec((images,)) == _input_spec(images)
    assert _input_spec((images, images)) is None
    assert _input_spec(None) is None


def test_an_image_model_plans_pipeline_stages_from_its_example_input():
    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=2)
    images = torch.zeros(4, *corpus.IMAGE_SHAPE)
    plan = autopar.compile(corpus.vit_encoder(), cluster, global_batch_size=8,
                           example_inputs=images, dtype="fp32", constraints={"pp": 2})
    assert plan.config.pp == 2
    assert plan.training.input == {"shape": list(corpus.IMAGE_SHAPE), "dtype": "float32"}
    probe = _example_microbatch(plan, 1)
    assert probe.shape == (plan.config.micro_batch_size, *corpus.IMAGE_SHAPE)
    assert probe.dtype == torch.float32 and not probe.any()


def test_a_plan_without_an_input_shape_cannot_be_probed():
    plan = SimpleNamespace(training=SimpleNamespace(seq_len=None, input=None),
                           config=SimpleNamespace(micro_batch_size=1))
    with pytest.raises(ValueError, match="records no input shape"):
        _example_microbatch(plan, 1)
