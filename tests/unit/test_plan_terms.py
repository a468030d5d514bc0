"""What a plan is costed with and kept within: software presets, the memory headroom, and
pipelines with fewer micro-batches than ranks."""

import dataclasses
import logging

import pytest
import torch

import autopar
from autopar.models.gpt import GPT, GPTConfig


def small_gpt(n_layers=8, dim=1024):
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=8192, max_seq_len=1024, dim=dim, n_layers=n_layers,
                             n_heads=16))


H100 = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
DP8 = autopar.ParallelConfig(dp=8, micro_batch_size=2)


@pytest.mark.parametrize("name", list(autopar.SOFTWARE))
def test_a_software_preset_costs_as_its_options(name):
    preset = autopar.SOFTWARE[name]
    by_name = autopar.estimate(small_gpt(), H100, DP8, global_batch_size=64, seq_len=1024,
                               software=name)
    by_options = autopar.estimate(small_gpt(), H100, DP8, global_batch_size=64, seq_len=1024,
                                  options=preset.options)
    assert by_name.step_time_s == by_options.step_time_s
    assert preset.description


def test_presets_differ_where_their_engines_do():
    """Megatron-LM's fused kernels and overlapped tp collectives, torchtitan's compiled kernels:
    faster than eager PyTorch on the same config."""
    cfg = autopar.ParallelConfig(dp=2, tp=4, micro_batch_size=2)
    times = {name: autopar.estimate(small_gpt(), H100, cfg, global_batch_size=64, seq_len=1024,
                                    software=name).step_time_s for name in autopar.SOFTWARE}
    assert times["megatron"] < times["torchtitan"]
    assert times["torchtitan-compile"] < times["torchtitan"]


def test_a_preset_and_options_together_are_refused_with_the_way_to_change_one_field():
    with pytest.raises(ValueError, match=r"software='megatron' or options=.*dataclasses.replace"):
        autopar.estimate(small_gpt(), H100, DP8, global_batch_size=64, seq_len=1024,
                         software="megatron",
                         options=autopar.EstimateOptions(attention_kernel="math"))
    with pytest.raises(ValueError, match=r"software='nemo' is not a preset; presets: autopar, "
                                         r"megatron"):
        autopar.compile(small_gpt(), H100, global_batch_size=64, seq_len=1024, software="nemo")


def test_a_plan_names_its_software_and_costs_with_it():
    plan = autopar.compile(small_gpt(), H100, global_batch_size=64, seq_len=1024,
                           software="megatron", settings=autopar.SearchSettings(progress=False))
    assert plan.training.software == "megatron"
    assert plan.training.options == dataclasses.asdict(autopar.SOFTWARE["megatron"].options)
    again = autopar.estimate(small_gpt(), H100, plan.config, global_batch_size=64,
                             seq_len=1024, software="megatron")
    assert again.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-9)
    assert "software megatron: Megatron-LM (Megatron-Core) with Transformer Engine" in \
        plan.report()


def test_plans_keep_the_memory_headroom_and_say_so():
    plan = autopar.compile(small_gpt(), H100, global_batch_size=64, seq_len=1024,
                           settings=autopar.SearchSettings(progress=False))
    device = H100.hardware.device.memory_bytes
    assert plan.training.memory_headroom == 0.02 and plan.training.memory_headroom_kept
    assert plan.estimate.usable_memory_bytes == pytest.approx(0.98 * device)
    assert "fits with 2% of device memory kept free" in plan.report()


def test_where_nothing_fits_within_the_headroom_the_plan_says_it_does_not_keep_it(caplog):
    """A 24B-parameter GPT on 8 GPUs: its training states alone take 48 GB per GPU however they
    are sharded, so with 40% of the device held back nothing fits. compile returns the best
    plan that fits the whole device, warns, and its report says the headroom was not kept."""
    big = small_gpt(n_layers=30, dim=8192)
    settings = autopar.SearchSettings(progress=False, memory_headroom=0.4)
    with pytest.raises(autopar.NoPlanFitsError):  # the premise: nothing fits in 60%
        autopar.compile(big, H100.with_memory_headroom(0.4), global_batch_size=64,
                        seq_len=1024, settings=dataclasses.replace(settings, memory_headroom=0))
    unbounded = autopar.compile(big, H100, global_batch_size=64, seq_len=1024,
                                settings=dataclasses.replace(settings, memory_headroom=0.0))
    with caplog.at_level(logging.WARNING, logger="autopar.api"):
        plan = autopar.compile(big, H100, global_batch_size=64, seq_len=1024,
                               settings=settings)
    assert "no plan fits within the 40% memory headroom" in caplog.text
    assert plan.training.memory_headroom_kept is False
    assert plan.config == unbounded.config and plan.estimate.fits
    assert "fits the device but not the 40% headroom" in plan.report()


def test_memory_headroom_must_be_a_fraction():
    with pytest.raises(ValueError, match=r"memory headroom must be a fraction in \[0, 1\), "
                                         r"got 1\.5"):
        H100.with_memory_headroom(1.5)


def test_fewer_micro_batches_than_pipeline_ranks_plan_gpipe():
    """pp=4 pinned with a global batch of 2 sequences: 2 micro-batches at most, which GPipe
    runs (1F1B in PyTorch needs one per rank); the bubble is costed."""
    plan = autopar.compile(small_gpt(), H100, global_batch_size=2, seq_len=1024,
                           constraints={"pp": 4, "tp": 2},
                           settings=autopar.SearchSettings(progress=False))
    assert plan.config.pp_schedule == "gpipe" and plan.estimate.num_microbatches < 4
    assert plan.estimate.breakdown["bubble"] > 0
    with pytest.raises(ValueError, match=r"pp_schedule=zero-bubble with pp=4 needs at least 4 "
                                         r"micro-batches"):
        autopar.estimate(small_gpt(), H100, autopar.ParallelConfig(
            pp=4, tp=2, micro_batch_size=1, pp_schedule="zero-bubble"),
            global_batch_size=2, seq_len=1024)
