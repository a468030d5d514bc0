"""fp8 plans on gloo ranks: the fp8 GEMM on DTensor shards against a per-shard oracle
(`fp8_worker.py`), and generated scripts of fp8 plans -- FSDP2 with tensor and sequence
parallel and per-op recompute, a pipeline (stage copies of the model), a Hugging Face GPT-2
(Conv1D's addmm, a fused qkv projection split head-aware) -- training like their one-process
fp8 reference, with every weight the plan names running its GEMMs in fp8 on every rank.

The plans are made for dgx-h100 (the CPU profile has no fp8 rate) and run on CPU ranks, where
the fp8 GEMM is the product of the same fp8 operands in fp32 (`autopar.runtime.fp8`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from test_parity import PY, STEPS, TORCHRUN, _losses, _make_script, _run

HERE = Path(__file__).resolve().parent
# each rank scales what it holds (its batch slice, its weight shards): the rounding differs
# from the one-process run's, as it does between any two fp8 runs of other layouts
FP8_TOL = 1e-3
RAN = re.compile(r"fp8: the GEMMs of (\d+) weight\(s\) ran in fp8")


def test_fp8_gemms_on_dtensor_shards_match_a_per_shard_oracle(tmp_path):
    res = _run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(HERE / "fp8_worker.py"),
                str(tmp_path)], timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for rank in range(2):
        errors = json.loads((tmp_path / f"fp8.{rank}.json").read_text())
        assert sorted(errors) == ["colwise", "rows", "rowwise", "strided"]
        worst = max(e for case in errors.values() for e in case.values())
        assert worst <= 1e-6, errors


FP8 = [
    ("zero3_tp_sp_per_op", 4, "tiny_llama_wide", {"dp": 2, "tp": 2, "zero_stage": 3,
                                                  "sequence_parallel": True,
                                                  "recompute": "per_op"}),
    ("pp_1f1b", 2, "tiny_llama_wide", {"pp": 2, "pp_schedule": "1f1b", "micro_batch_size": 2}),
    ("hf_gpt2_zero3_tp", 4, "corpus:hf_gpt2", {"dp": 2, "tp": 2, "zero_stage": 3}),
]


@pytest.mark.parametrize("name,ranks,factory,constraints", FP8, ids=[c[0] for c in FP8])
def test_fp8_plans_train_like_their_reference(tmp_path, monkeypatch, name, ranks, factory,
                                              constraints):
    script = _make_script(tmp_path, name, ranks, factory, constraints, dtype="fp8",
                          profile="dgx-h100")
    names = json.loads(script.with_suffix(".json").read_text())["training"]["fp8_weights"]
    ref = _run([PY, str(script), "--reference", "--steps", str(STEPS), "--seed", "0"])
    assert ref.returncode == 0, ref.stdout + ref.stderr
    monkeypatch.setenv("AUTOPAR_LOG_LEVEL", "INFO")
    res = _run([TORCHRUN, "--standalone", f"--nproc_per_node={ranks}", str(script),
                "--steps", str(STEPS), "--seed", "0"])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got, want = _losses(res.stdout), _losses(ref.stdout)
    assert len(got) == STEPS == len(want)
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"fp8 {name}: max relative loss difference {rel:.2e}")
    assert rel <= FP8_TOL, (got, want)
    assert "in bf16, not fp8" not in res.stderr
    counts = [int(n) for n in RAN.findall(res.stderr)]
    assert len(counts) == ranks, res.stderr[-3000:]
    stages = constraints.get("pp", 1)
    assert sum(counts) == len(names) * ranks // stages, (counts, len(names))
