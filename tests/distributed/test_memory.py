"""The model-state bytes each rank really holds under a plan (weights, gradients, AdamW
moments, counted from its tensors during one training step on gloo, at their peak) equal the
plan's Estimate for that rank (``memory_by_stage[pp_rank]``); under ZeRO-3 without a pipeline
the units gathered at once stay within the Estimate's ``zero3_buffers``.  bf16 plans hold fp32 parameters, gradients and
AdamW moments (``EstimateOptions.fp32_params``, the "autopar" preset), FSDP2 gathering bf16
parameters.  Several plans of one world size share one torchrun launch (start-up dominates
the cost on CPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import autopar
from autopar.estimate.memory import held_zero_stage

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_parity import TORCHRUN, _run  # noqa: E402
import tiny_models  # noqa: E402

# world size → [(id, factory, constraints)]
PLANS = {
    2: [("dp_zero0", "tiny_llama", {"dp": 2, "zero_stage": 0}),
        ("dp_zero2", "tiny_llama", {"dp": 2, "zero_stage": 2}),
        ("dp_zero3", "tiny_llama", {"dp": 2, "zero_stage": 3}),
        ("tp", "tiny_llama_wide", {"tp": 2, "sequence_parallel": False}),
        # the intra-op ILP's layout: the MLP whole on each rank's sequence shard
        ("tp_sp_replicated_mlp", "tiny_llama_wide", {"tp": 2, "sequence_parallel": True,
                                                     "micro_batch_size": 1}),
        ("pp", "tiny_llama", {"pp": 2, "pp_schedule": "1f1b", "micro_batch_size": 2}),
        ("resnet_tp", "tiny_resnet", {"tp": 2}),
        # bf16: fp32 parameters, gradients and moments; FSDP2 gathers bf16 parameters
        ("bf16_dp_zero0", "tiny_llama", {"dp": 2, "zero_stage": 0}, "bf16"),
        ("bf16_dp_zero2", "tiny_llama", {"dp": 2, "zero_stage": 2}, "bf16")],
    4: [("tp_dp_zero0", "tiny_llama_wide", {"dp": 2, "tp": 2, "zero_stage": 0,
                                             "sequence_parallel": True}),
        ("tp_dp_zero3", "tiny_llama_wide", {"dp": 2, "tp": 2, "zero_stage": 3,
                                             "sequence_parallel": False}),
        # in a pipeline FSDP2 keeps each stage's parameters gathered and its gradients whole
        # through the step's micro-batches: ZeRO-2 and -3 hold ZeRO-1's states at their peak
        ("pp_dp_zero2", "tiny_llama", {"dp": 2, "pp": 2, "zero_stage": 2, "pp_schedule": "1f1b",
                                       "micro_batch_size": 2}),
        ("pp_dp_zero3", "tiny_llama", {"dp": 2, "pp": 2, "zero_stage": 3, "pp_schedule": "1f1b",
                                       "micro_batch_size": 2}),
        # on 2 ranks a gathered bf16 unit (2 B) weighs what its fp32 shards (4 B / 2) did
        ("bf16_dp_zero3", "tiny_llama", {"dp": 4, "zero_stage": 3}, "bf16")],
}
REL = 0.02  # FSDP pads a dim that does not split evenly; everything else is exact


@pytest.mark.parametrize("world", sorted(PLANS))
def test_state_bytes_per_rank_match_the_estimate(tmp_path, world):
    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=world)
    plans, specs = {}, []
    for name, factory, constraints, *dtype in PLANS[world]:
        plan = autopar.compile(getattr(tiny_models, factory)(), cluster, global_batch_size=8,
                               dtype=dtype[0] if dtype else "fp32", constraints=constraints,
                               **tiny_models.shape_args(factory))
        plans[name] = plan
        if "replicated" in name:
            assert [e.get("replicated_sublayers") for e in plan.intra_op.values()] == [[1]]
        specs.append(f"{plan.save(tmp_path / f'{name}.json')}:{factory}")
    res = _run([TORCHRUN, "--standalone", f"--nproc_per_node={world}",
                str(HERE / "memory_worker.py"), str(tmp_path), *specs])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    failures = []
    for name, plan in plans.items():
        for rank in range(world):
            got = json.loads((tmp_path / f"{name}.{rank}.json").read_text())
            want = plan.estimate.memory_by_stage[got["pp_rank"]]
            held = held_zero_stage(plan.config, plan.training.estimate_options.fsdp2)
            if plan.training.dtype == "bf16" and held in (1, 2):
                # FSDP2 keeps the fp32 shard (at rest, the registered parameter) as the master
                # copy, which the estimate counts with the AdamW moments
                got["optimizer"] += got["weights_at_rest"]
            got["grads"] = got["grads_peak"]  # whole until the last micro-batch in a pipeline
            if held == 3:  # shards at rest; gathered units on top, bounded
                gathered = got["weights"] - got["weights_at_rest"]
                print(f"{name} rank {rank} gathered: {gathered} B, bound {want['zero3_buffers']:.0f}")
                if not 0 < gathered <= want["zero3_buffers"]:
                    failures.append(f"{name} rank {rank}: gathered {gathered} B, outside "
                                    f"(0, {want['zero3_buffers']:.0f}]")
                got["weights"] = got["weights_at_rest"]
            for key in ("weights", "grads", "optimizer"):
                pred = want[f"_{key}"]
                print(f"{name} rank {rank} {key}: held {got[key]} B, predicted {pred:.0f} B")
                if abs(got[key] - pred) > REL * pred:
                    failures.append(f"{name} rank {rank} {key}: held {got[key]}, "
                                    f"predicted {pred:.0f}")
    assert not failures, "\n".join(failures)
