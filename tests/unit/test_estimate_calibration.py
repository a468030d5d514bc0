"""The fitted constants of the estimate, checked against published runs.

SUSTAINED_COMPUTE_FRACTION is fitted per architecture on every row of benchmarks/data/
published_runs_calibration.csv but the DeepSpeed ZeRO-3 ones (benchmarks/
fit_sustained_fraction.py). This runs `estimate` on all 47 rows (benchmarks/published_runs.py
prints the table) and checks that the constants in use are the protocol's optimum.
The DeepSpeed ZeRO-3 rows of SC21 Table 2 are outside the fit: their steps are DeepSpeed
2021's synchronous per-parameter gathers (EstimateOptions(zero3_gather="sync"), whose
throughput constant comes from another measurement, DeepSpeed issue #1174).
"""

import statistics
from pathlib import Path

import pytest

import autopar
from autopar import estimate
from costmodels.compute import (FUSED_ATTENTION_PEAK_FRACTION, SUSTAINED_COMPUTE_FRACTION,
                                fused_attention_fraction, sustained_fraction)

CSV = Path(__file__).resolve().parents[2] / "benchmarks/data/published_runs_calibration.csv"


@pytest.fixture(scope="module")
def errors():
    from benchmarks.published_runs import load_runs

    out = {}
    for run in load_runs(CSV):
        est = estimate(run.build_model(), run.make_cluster(), run.config,
                       global_batch_size=run.global_batch_size, seq_len=run.seq_len,
                       dtype=run.dtype, options=run.options())
        out[run.run_id] = (run.group, est.step_time_s / run.published_step_time_s - 1, est.fits)
    return out


def _median(errors, groups):
    return statistics.median(abs(e) for g, e, _ in errors.values() if g in groups)


def test_every_published_configuration_is_predicted_to_fit(errors):
    assert [k for k, (_, _, fits) in errors.items() if not fits] == []


def test_every_group_tracks_the_published_step_times(errors):
    assert _median(errors, {"sc21-t1"}) <= 0.05
    assert _median(errors, {"sc21-t2-ptdp"}) <= 0.05
    assert _median(errors, {"mlm-h100-strong"}) <= 0.10
    assert _median(errors, {"mpt-a100"}) <= 0.10
    # the two H100 sources disagree by ~10% in compute speed (fitted on the other source
    # alone, MosaicML's rows would take a sustained fraction of 0.66, Megatron-LM's 0.75); the
    # joint fit sits between them
    assert _median(errors, {"mlm-h100"}) <= 0.07
    assert _median(errors, {"mpt-h100"}) <= 0.08
    assert _median(errors, {"sc21-t2-zero3"}) <= 0.14


@pytest.mark.parametrize("arch", ["ampere", "hopper"])
def test_sustained_fraction_in_use_is_the_fit_protocol_optimum(arch):
    """Neighbouring grid points score no better (least median |error|, ties by the mean)."""
    from benchmarks.fit_sustained_fraction import NOT_MODELED, _errors, _score
    from benchmarks.published_runs import load_runs

    runs = [r for r in load_runs(CSV) if r.group not in NOT_MODELED
            and r.make_cluster().hardware.device.arch == arch]
    graphs: dict = {}
    fitted = SUSTAINED_COMPUTE_FRACTION[arch]
    score = {round(f, 2): _score(list(_errors(runs, graphs, arch, f).values()))
             for f in (fitted - 0.01, fitted, fitted + 0.01)}
    assert score[round(fitted, 2)] <= min(score.values())


def test_all_rows_median_error(errors):
    assert statistics.median(abs(e) for _, e, _ in errors.values()) <= 0.06


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
