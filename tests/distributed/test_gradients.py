"""Gradient parity: after one ``train_step`` under a plan, the loss and every gradient each rank
holds equal a one-process reference step (DTensor and FSDP-sharded gradients gathered).  Loss
parity over a few AdamW steps (test_parity.py) cannot see a gradient that is off by a constant
factor (Adam normalises it away), nor a gradient that is wrong for only some parameters for a
step or two; this can.  One torchrun launch per world size runs all its plans."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import autopar

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_parity import TORCHRUN, _run  # noqa: E402
import tiny_models  # noqa: E402

MB2 = {"micro_batch_size": 2}
PLANS = {
    2: [("ddp", "tiny_llama", {"dp": 2, "zero_stage": 0}),
        ("zero1", "tiny_llama", {"dp": 2, "zero_stage": 1}),
        ("zero2_recompute", "tiny_llama", {"dp": 2, "zero_stage": 2, "recompute": "full"}),
        ("zero3", "tiny_llama", {"dp": 2, "zero_stage": 3}),
        ("tp", "tiny_llama", {"tp": 2, "sequence_parallel": False}),
        ("tp_sp", "tiny_llama_wide", {"tp": 2, "sequence_parallel": True}),
        ("pp_1f1b", "tiny_llama", {"pp": 2, "pp_schedule": "1f1b", **MB2}),
        ("pp_gpipe", "tiny_llama", {"pp": 2, "pp_schedule": "gpipe", **MB2}),
        ("pp_interleaved", "tiny_llama", {"pp": 2, "pp_schedule": "interleaved-1f1b",
                                          "virtual_stages": 2, **MB2}),
        ("pp_zero_bubble", "tiny_llama", {"pp": 2, "pp_schedule": "zero-bubble", **MB2}),
        ("tp_sp_per_op", "tiny_llama_wide", {"tp": 2, "sequence_parallel": True,
                                             "recompute": "per_op"}),
        ("tp_sp_full", "tiny_llama_wide", {"tp": 2, "sequence_parallel": True,
                                           "recompute": "full"}),
        ("zero3_per_op", "tiny_llama", {"dp": 2, "zero_stage": 3, "recompute": "per_op"}),
        ("pp_full_every2", "tiny_llama", {"pp": 2, "pp_schedule": "1f1b", "recompute": "full",
                                          "recompute_every": 2, **MB2}),
        ("tp_selective_math", "tiny_llama_math", {"tp": 2, "recompute": "selective",
                                                  "sequence_parallel": False}),
        ("resnet_tp", "tiny_resnet", {"tp": 2}),
        # no pipeline, micro-batches under the rank's slice: gradient accumulation
        ("ddp_accumulate", "tiny_llama", {"dp": 2, "zero_stage": 0, "micro_batch_size": 1}),
        ("zero1_accumulate", "tiny_llama", {"dp": 2, "zero_stage": 1, "micro_batch_size": 1}),
        ("zero3_accumulate", "tiny_llama", {"dp": 2, "zero_stage": 3, "micro_batch_size": 2}),
        ("tp_accumulate", "tiny_llama", {"tp": 2, "sequence_parallel": False, **MB2}),
        ("resnet_dp_accumulate", "tiny_resnet", {"dp": 2, "micro_batch_size": 2}),
        ("vit_tp", "tiny_vit", {"tp": 2, "sequence_parallel": False})],
    4: [("dp_tp_sp_zero0", "tiny_llama_wide", {"dp": 2, "tp": 2, "zero_stage": 0,
                                                "sequence_parallel": True}),
        ("dp_tp_sp_zero3", "tiny_llama_wide", {"dp": 2, "tp": 2, "zero_stage": 3,
                                                "sequence_parallel": True}),
        ("dp_pp_zero0", "tiny_llama", {"dp": 2, "pp": 2, "zero_stage": 0,
                                       "pp_schedule": "gpipe", **MB2}),
        ("dp_pp_zero_bubble_zero3", "tiny_llama", {"dp": 2, "pp": 2, "zero_stage": 3,
                                                   "pp_schedule": "zero-bubble", **MB2}),
        ("tp_pp", "tiny_llama_wide", {"tp": 2, "pp": 2, "pp_schedule": "1f1b",
                                      "sequence_parallel": False, **MB2}),
        ("tp_pp_per_op", "tiny_llama_wide", {"tp": 2, "pp": 2, "pp_schedule": "1f1b",
                                             "sequence_parallel": False, "recompute": "per_op",
                                             **MB2}),
        ("resnet_dp_tp_zero3", "tiny_resnet", {"dp": 2, "tp": 2, "zero_stage": 3})],
}


def run_gradient_plans(tmp_path: Path, world: int, plans: list[tuple[str, str, dict]]
                       ) -> dict[str, list[dict]]:
    """Compile each (name, factory, constraints) for ``world`` cpu-gloo ranks, run them all in
    one torchrun launch of grad_worker.py and assert the loss and every gradient are within
    1e-5 of the reference, and that the loss ran on vocab-sharded logits exactly when tp > 1.
    Returns each plan's per-rank worker results."""
    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=world)
    specs = []
    for name, factory, constraints in plans:
        plan = autopar.compile(getattr(tiny_models, factory)(), cluster, global_batch_size=8,
                               dtype="fp32", constraints=constraints,
                               **tiny_models.shape_args(factory))
        for key, value in constraints.items():
            assert getattr(plan.config, key) == value, (name, key, plan.config)
        specs.append(f"{plan.save(tmp_path / f'{name}.json')}:{factory}")
    res = _run([TORCHRUN, "--standalone", f"--nproc_per_node={world}",
                str(HERE / "grad_worker.py"), str(tmp_path), *specs], timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    bad, results = [], {}
    for name, _, constraints in plans:
        got = [json.loads((tmp_path / f"{name}.{r}.json").read_text()) for r in range(world)]
        results[name] = got
        loss_err = max(g["loss_err"] for g in got)
        grad_err = max(g["grad_err"] for g in got)
        print(f"{name}: loss error {loss_err:.1e}, max grad error {grad_err:.1e} "
              f"(max |grad| {got[0]['grad_max']:.1e}, {sum(g['n_grads'] for g in got)} grads)")
        if not (loss_err <= 1e-5 and grad_err <= 1e-5 and all(g["n_grads"] for g in got)):
            bad.append((name, loss_err, grad_err))
        # the tp plans shard the LM head, so the loss runs on vocab-sharded logits (the ranks
        # of the last pipeline stage); the others have no tp head and gather nothing
        vocab_sharded = any(g.get("loss_parallel") for g in got)
        if vocab_sharded != (constraints.get("tp", 1) > 1):
            bad.append((name, "loss_parallel", vocab_sharded))
    assert not bad, bad
    return results


@pytest.mark.parametrize("world", sorted(PLANS))
def test_gradients_match_the_reference(tmp_path, world):
    results = run_gradient_plans(tmp_path, world, PLANS[world])
    # without a pipeline each rank runs its slice of the global batch (8) in micro-batches
    # of the plan's size, one forward each
    for name, _, constraints in PLANS[world]:
        if constraints.get("pp", 1) == 1:
            mb, dp = constraints.get("micro_batch_size"), constraints.get("dp", 1)
            for got in results[name]:
                want = [mb] * (8 // (dp * mb)) if mb else [8 // dp]
                assert got["forward_batches"] == want, (name, got["forward_batches"])
    # the ResNet plans run their convolutions output-channel parallel, not replicated: each
    # rank holds 1/tp of a conv weight, and 1/(tp·dp) under ZeRO-3
    full = tiny_models.tiny_resnet().get_parameter("layer1.0.conv2.weight").numel()
    for name, parts in (("resnet_tp", 2), ("resnet_dp_tp_zero3", 4)):
        if name in results:
            held = [g["local_numel"]["layer1.0.conv2.weight"] for g in results[name]]
            assert held == [full // parts] * world, (name, held, full)
