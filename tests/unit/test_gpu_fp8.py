"""fp8 training scripts measured on an H100 against today's estimate.

tests/data/h100_fp8_scripts.json was written by benchmarks/gpu_scripts.py on one H100 SXM
(2026-11-26): `autopar codegen` scripts of a hand-written 1.1B-wide Llama (8 layers) in bf16
and in fp8 (its Linear GEMMs through `autopar.runtime.fp8`), with and without per-op recompute,
run side by side on one machine. A change to the cost model that breaks agreement with them
fails here.
"""

import json
from pathlib import Path

import pytest
import torch

import autopar

DATA = json.loads((Path(__file__).parents[1] / "data" / "h100_fp8_scripts.json").read_text())
ROWS = {row["name"]: row for row in DATA["rows"]}
H100 = autopar.Cluster.from_profile("dgx-h100", num_nodes=1, gpus_per_node=1)


def _estimates(factory, rows, global_batch_size: int, seq_len: int):
    with torch.device("meta"):
        model = factory()
    micro = {row["config"]["micro_batch_size"] for row in rows}
    assert len(micro) == 1
    graph = autopar.trace(model, global_batch_size=micro.pop(), seq_len=seq_len, dtype="bf16")
    return {row["name"]: autopar.estimate(graph, H100, autopar.ParallelConfig(**row["config"]),
                                          global_batch_size=global_batch_size,
                                          seq_len=seq_len, dtype=row["dtype"],
                                          software="autopar")
            for row in rows}


@pytest.fixture(scope="module")
def estimates():
    from benchmarks.gpu_models import plain_llama_1b

    return _estimates(plain_llama_1b, DATA["rows"], 8, 1024)


def test_the_gpu_ran_the_runtimes_fp8_gemm_as_the_cpu_emulates_it():
    """torch._scaled_mm on the GPU against the same fp8 operands multiplied in fp32 on the
    CPU: within one bf16 rounding of the outputs (bf16 keeps 8 bits: 2^-8 = 0.0039 of the
    largest value, plus the accumulation order), the fp32 weight gradient within 2e-4."""
    for check in DATA["fp8_gemm_check"].values():
        assert check["y"] <= 2 ** -7 and check["grad_x"] <= 2 ** -7
        assert check["grad_w"] <= 2e-4
    # the rowwise recipe (checked on an H200): every GEMM writes bf16
    for check in DATA["fp8_gemm_check_rowwise"]["rows"].values():
        assert max(check.values()) <= 2 ** -7


@pytest.mark.parametrize("name", ["plain_llama_bf16", "plain_llama_fp8"])
def test_steps_without_recompute_against_todays_estimate(estimates, name):
    """bf16 92.3 ms and fp8 135.7 ms measured (the eager casts cost more than the fp8 GEMMs
    save at these 2,048-5,632-wide GEMMs); today's estimate 92.6 and 133.0 ms. Peak allocated
    17,064 and 15,859 MiB; predicted tensors 17,082 and 16,626 MiB (fp8 keeps 1-byte copies
    of its GEMMs' inputs and weights; the traced graph charges an input that q, k and v share
    once, where autocast's runtime keeps a 16-bit copy per GEMM: 4.8% over in fp8)."""
    row, est = ROWS[name], estimates[name]
    assert est.step_time_s * 1e3 == pytest.approx(row["step_ms"], rel=0.05)
    assert est.tensor_memory_bytes / 2**20 == pytest.approx(row["peak_allocated_mib"], rel=0.06)


@pytest.mark.parametrize("name", ["plain_llama_bf16_per_op", "plain_llama_fp8_per_op"])
def test_steps_under_per_op_recompute_against_todays_estimate(estimates, name):
    """Per-op recompute re-runs what the policy does not keep (in fp8 every GEMM's forward
    casts too) and sends each op of a block through the policy's Python dispatch twice
    (`costmodels.compute.SAC_DISPATCH_S`, measured apart, `sac_dispatch` in the data file):
    121.9 and 200.8 ms measured (228.0 in fp8 on the first machine), 123.3 and 202.2 ms
    predicted. (The peak is over-predicted 14% in both dtypes: 12,842 MiB of tensors planned,
    11,287 and 11,289 allocated.)"""
    assert estimates[name].step_time_s * 1e3 == pytest.approx(ROWS[name]["step_ms"], rel=0.05)


def test_the_policy_dispatch_constant_is_the_measured_one():
    from costmodels.compute import SAC_DISPATCH_S

    rows = DATA["sac_dispatch"]["rows"]
    extra = sorted(row["sac_extra_s_per_op"] for row in rows)
    assert SAC_DISPATCH_S == pytest.approx(extra[len(extra) // 2], rel=0.01)


def test_fp8_over_bf16_step_is_the_measured_ratio(estimates):
    """The fp8 step over the bf16 step, without recompute and under per-op recompute:
    measured 1.47 and 1.65, predicted within 6%."""
    for dense, fp8 in (("plain_llama_bf16", "plain_llama_fp8"),
                       ("plain_llama_bf16_per_op", "plain_llama_fp8_per_op")):
        measured = ROWS[fp8]["step_ms"] / ROWS[dense]["step_ms"]
        predicted = estimates[fp8].step_time_s / estimates[dense].step_time_s
        assert predicted == pytest.approx(measured, rel=0.06)
    assert not any(row["fp8_bf16_warning"] for row in DATA["rows"])


def test_an_8b_wide_model_at_8k_tokens():
    """Llama-3-8B widths (4 layers), 2 sequences of 8,192 tokens in micro-batches of 1: the
    fp8 step over the bf16 step measured 1.186 (469.6 / 395.9 ms), predicted within 6%;
    peak allocated 52,363 and 50,573 MiB, the planned tensors within 5%. (The steps
    themselves are predicted 14-18% slow at this shape in both dtypes: 466 and 537 ms.)"""
    from benchmarks.gpu_models import plain_llama_8b_4l

    rows = {row["name"]: row for row in DATA["rows_8b"]}
    est = _estimates(plain_llama_8b_4l, DATA["rows_8b"], 2, 8192)
    bf16, fp8 = rows["llama8b_4l_bf16"], rows["llama8b_4l_fp8"]
    predicted = est[fp8["name"]].step_time_s / est[bf16["name"]].step_time_s
    assert predicted == pytest.approx(fp8["step_ms"] / bf16["step_ms"], rel=0.06)
    for name, row in rows.items():
        assert est[name].tensor_memory_bytes / 2**20 == pytest.approx(
            row["peak_allocated_mib"], rel=0.05)
        assert not row["fp8_bf16_warning"]
