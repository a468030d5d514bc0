"""The fitted constants of the estimate, checked against published runs.

SUSTAINED_COMPUTE_FRACTION was fitted on SC21 Table 1 (A100) and the Megatron-LM H100 weak-
scaling table only; the other groups are held out. This runs `estimate` on all 47 rows of
shared/data/published_runs_calibration.csv (benchmarks/published_runs.py prints the table).
The DeepSpeed ZeRO-3 rows of SC21 Table 2 are reported, not asserted: their step times stop
falling beyond 768 GPUs, i.e. gathers ran at ~20 GB/s per GPU, far below what NCCL reaches on
that fabric, and nothing in the sources explains it (see the issue 4 notes).
"""

import statistics
from pathlib import Path

import pytest

import autopar
from autopar import EstimateOptions, estimate
from costmodels.compute import (FUSED_ATTENTION_PEAK_FRACTION, SUSTAINED_COMPUTE_FRACTION,
                                fused_attention_fraction, sustained_fraction)

CSV = Path(__file__).resolve().parents[3] / "shared" / "data" / "published_runs_calibration.csv"
pytestmark = pytest.mark.skipif(not CSV.is_file(), reason="shared/data not present")


@pytest.fixture(scope="module")
def errors():
    from benchmarks.published_runs import SOFTWARE, load_runs

    out = {}
    for run in load_runs(CSV):
        est = estimate(run.build_model(), run.make_cluster(), run.config,
                       global_batch_size=run.global_batch_size, seq_len=run.seq_len,
                       dtype=run.dtype, options=EstimateOptions(**SOFTWARE[run.group][0]))
        out[run.run_id] = (run.group, est.step_time_s / run.published_step_time_s - 1, est.fits)
    return out


def _median(errors, groups):
    return statistics.median(abs(e) for g, e, _ in errors.values() if g in groups)


def test_every_published_configuration_is_predicted_to_fit(errors):
    assert [k for k, (_, _, fits) in errors.items() if not fits] == []


def test_fitted_groups_and_held_out_groups_track_the_published_step_times(errors):
    assert _median(errors, {"sc21-t1"}) <= 0.05
    assert _median(errors, {"mlm-h100"}) <= 0.05
    # held out: no constant was fitted on these
    assert _median(errors, {"sc21-t2-ptdp"}) <= 0.05
    assert _median(errors, {"mpt-a100"}) <= 0.10
    # 8.9% before memory-bound ops were priced as measured in eager PyTorch (2026-11-22), 12.0%
    # since: llm-foundry's H100 runs are faster than the eager factor implies
    assert _median(errors, {"mpt-h100"}) <= 0.13
    assert _median(errors, {"mlm-h100-strong"}) <= 0.12


def test_all_rows_median_error(errors):
    assert statistics.median(abs(e) for _, e, _ in errors.values()) <= 0.07


def test_sustained_fraction_is_named_per_architecture_and_falls_back_to_the_mean():
    assert set(SUSTAINED_COMPUTE_FRACTION) == {"ampere", "hopper"}
    mean = sum(SUSTAINED_COMPUTE_FRACTION.values()) / 2
    assert sustained_fraction("blackwell") == pytest.approx(mean)
    assert sustained_fraction("cpu") == 1.0


def test_fused_attention_fractions_come_from_the_measured_table():
    h100 = autopar.Cluster.from_profile("dgx-h100").hardware.device
    assert fused_attention_fraction(h100, "cudnn") == FUSED_ATTENTION_PEAK_FRACTION[("cudnn", "hopper")]
    assert fused_attention_fraction(h100, "flash") < fused_attention_fraction(h100, "flash3")
    with pytest.raises(ValueError, match="not a fused kernel"):
        fused_attention_fraction(h100, "math")
