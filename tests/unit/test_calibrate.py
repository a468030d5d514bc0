"""`autopar calibrate`'s fit and profile writing on synthetic measurements: timings made by the
collective and compute models from known profile fields (plus noise) must give those fields
back, and the profile written must load with `Cluster.from_toml` and cite what was measured.
The measuring itself runs under torchrun in tests/distributed/test_calibrate_run.py."""

from __future__ import annotations

import copy
import dataclasses
import math
import random

import numpy as np
import pytest

import autopar
import hwprofiles
from autopar.calibrate.fit import (Knob, fit_collectives, fit_gemms, gemm_time_s,
                                   least_squares, predict_collectives)
from autopar.calibrate.profile import calibrate_profile, profile_toml, with_ranks_per_node
from autopar.calibrate.records import (CollectivePoint, CopyPoint, GemmPoint, Measurements,
                                       held_out_sizes, median_rse, size_grid)
from autopar.calibrate.table import render_table, summary_lines, table_csv, table_rows
from autopar.cli import main as cli_main

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _set(doc: dict, name: str, value: float) -> None:
    Knob(name=name, lower=0.0, upper=math.inf).write(doc, value)


def _read(doc: dict, name: str) -> float:
    return Knob(name=name, lower=0.0, upper=math.inf).read(doc)


def _points(groups: dict[str, tuple[int, ...]], pairs: dict[str, tuple[int, int]],
            sizes: list[int]) -> list[CollectivePoint]:
    held = held_out_sizes(sizes)
    points = [CollectivePoint(kind=kind, group=name, ranks=ranks, nbytes=size, time_s=1.0,
                              held_out=size in held)
              for kind in KINDS for name, ranks in groups.items() for size in sizes]
    points += [CollectivePoint(kind="send_recv", group=name, ranks=ranks, nbytes=size,
                               time_s=1.0, held_out=size in held)
               for name, ranks in pairs.items() for size in sizes]
    return points


def _measured(truth: dict, points: list[CollectivePoint], noise: float, seed: int = 0
              ) -> list[CollectivePoint]:
    """The points timed by the collective model under `truth`, times (1 + N(0, noise))."""
    rng = random.Random(seed)
    return [dataclasses.replace(p, time_s=t * (1.0 + rng.gauss(0.0, noise)))
            for p, t in zip(points, predict_collectives(truth, points))]


def _gloo_node(ranks: int = 4) -> dict:
    return with_ranks_per_node(hwprofiles.read_profile("cpu-gloo"), ranks)


def test_least_squares_finds_a_known_minimum_inside_its_box():
    xs = np.linspace(0.0, 2.0, 20)
    ys = 3.0 * np.exp(-1.5 * xs)
    fit = least_squares(lambda p: p[0] * np.exp(-p[1] * xs) - ys, [1.0, 0.1], [0.0, 0.0],
                        [10.0, 10.0])
    assert fit == pytest.approx([3.0, 1.5], rel=1e-6)
    boxed = least_squares(lambda p: p[0] * np.exp(-p[1] * xs) - ys, [1.0, 0.1], [0.0, 0.0],
                          [2.0, 10.0])
    assert boxed[0] == pytest.approx(2.0)


def test_size_grid_and_held_out_sizes_interleave_inside_the_fitted_range():
    sizes = size_grid(32 << 20, 4)
    assert sizes[0] == 8 and sizes[-1] == 32 << 20 and len(sizes) == 12
    held = held_out_sizes(sizes)
    assert held == {32, 512, 8 << 10, 128 << 10, 2 << 20}
    assert sizes[0] not in held and sizes[-1] not in held
    assert size_grid(1 << 30, 2)[-1] == 1 << 30 and len(size_grid(1 << 30, 2)) == 28


def test_median_standard_error_follows_the_spread_and_the_count():
    assert median_rse([1.0, 1.0, 1.0]) == 0.0  # too few to tell
    even = [float(x) for x in range(1, 10)]  # median 5, IQR 3..7
    assert median_rse(even) == pytest.approx(1.2533 * 4 / 1.349 / 3 / 5)
    assert median_rse(even * 4) == pytest.approx(median_rse(even) / 2, rel=0.05)
    rng = random.Random(5)
    normal = [1.0 + rng.gauss(0.0, 0.1) for _ in range(4000)]
    assert median_rse(normal) == pytest.approx(1.2533 * 0.1 / 4000**0.5, rel=0.1)


def test_fit_recovers_gloo_latency_call_overhead_and_bandwidth():
    """Known shared fields, no per-collective differences: the fit finds the fields (within
    the 2% noise's reach) and leaves every correction near 1."""
    base = _gloo_node()
    truth = copy.deepcopy(base)
    for name, value in (("call_overhead", 500.0), ("fabric_hop", 900.0),
                        ("fabric_bandwidth", 0.35)):
        _set(truth, name, value)
    points = _measured(truth, _points({"intra": (0, 1, 2, 3)}, {"intra": (0, 1)},
                                      size_grid(32 << 20, 4)), noise=0.02)
    fit = fit_collectives(base, points)
    assert _read(fit.doc, "fabric_bandwidth") == pytest.approx(0.35, rel=0.05)
    assert _read(fit.doc, "fabric_hop") == pytest.approx(900.0, rel=0.10)
    assert _read(fit.doc, "call_overhead") == pytest.approx(500.0, rel=0.25)
    for value in fit.values:
        if "factor" in value.name:
            assert value.value == pytest.approx(1.0, abs=0.1), value
    assert fit.fit_error < 0.03 and fit.held_out_error < 0.03
    clean = predict_collectives(truth, points)
    assert max(abs(f / t - 1) for f, t in zip(fit.predicted_s, clean)) < 0.05


def test_fit_recovers_per_collective_corrections():
    """A reduce-scatter four times slower per byte and a send/recv with a fifth of the
    latency, as gloo on this kind of host: the corrections carry the difference."""
    base = _gloo_node()
    truth = copy.deepcopy(base)
    _set(truth, "fabric_bandwidth", 0.4)
    _set(truth, "fabric_hop", 800.0)
    _set(truth, "call_overhead", 300.0)
    truth["collectives"]["latency_factor"] = {"reduce_scatter": 2.0, "send_recv": 0.2}
    truth["collectives"]["bandwidth_factor"] = {"reduce_scatter": 0.25, "send_recv": 3.0}
    points = _measured(truth, _points({"intra": (0, 1, 2, 3)}, {"intra": (0, 1)},
                                      size_grid(32 << 20, 4)), noise=0.02, seed=1)
    fit = fit_collectives(base, points)
    values = {v.name: v.value for v in fit.values}
    assert values["bandwidth_factor.reduce_scatter"] / values["bandwidth_factor.all_reduce"] \
        == pytest.approx(0.25, rel=0.1)
    assert values["latency_factor.send_recv"] < 0.5 < values["latency_factor.reduce_scatter"]
    clean = predict_collectives(truth, points)
    held = [abs(f / t - 1) for p, f, t in zip(points, fit.predicted_s, clean) if p.held_out]
    assert max(held) < 0.05
    base_error = [abs(b / t - 1) for b, t in zip(predict_collectives(base, points), clean)]
    assert min(base_error) > 0.05  # the base profile was far off: the fit did the work


def test_fit_recovers_nccl_fabric_and_network_fields_on_two_dgx_h100_nodes():
    base = hwprofiles.read_profile("dgx-h100")
    truth = copy.deepcopy(base)
    truth["node"]["fabric_efficiency"] = 0.7
    truth["node"]["fabric_hop_latency_us"] = {"ll": 0.9, "ll128": 2.85, "simple": 5.1}
    truth["network"]["nic_efficiency"] = 0.85
    truth["network"]["network_hop_latency_us"] = {"ll": 5.4, "ll128": 8.0, "simple": 28.0}
    truth["collectives"]["call_overhead_us"] = 8.0
    groups = {"intra": tuple(range(8)), "inter": (0, 8), "world": tuple(range(16))}
    points = _measured(truth, _points(groups, {"intra": (0, 1), "inter": (0, 8)},
                                      size_grid(1 << 30, 4)), noise=0.01, seed=2)
    fit = fit_collectives(base, points)
    assert _read(fit.doc, "fabric_bandwidth") == pytest.approx(450 * 0.7, rel=0.05)
    assert _read(fit.doc, "nic_bandwidth") == pytest.approx(400 * 0.85, rel=0.05)
    assert _read(fit.doc, "call_overhead") == pytest.approx(8.0, rel=0.25)
    assert _read(fit.doc, "fabric_hop") == pytest.approx(5.1, rel=0.25)
    assert _read(fit.doc, "network_hop") == pytest.approx(28.0, rel=0.25)
    assert fit.held_out_error < 0.02
    names = {v.name for v in fit.values}
    assert {"nic_bandwidth", "network_hop", "fabric_bandwidth"} <= names


def _gemm_points(rates: dict[str, float], half: float, memory: float,
                 shapes: list[tuple[int, int, int]], noise: float) -> list[GemmPoint]:
    rng = random.Random(3)
    points = []
    for dtype, rate in rates.items():
        for m, k, n in shapes:
            point = GemmPoint(dtype=dtype, m=m, k=k, n=n, time_s=1.0)
            t = gemm_time_s(point, rate, half, memory) * (1 + rng.gauss(0.0, noise))
            points.append(dataclasses.replace(point, time_s=t))
    return points


def test_gemm_fit_recovers_each_dtypes_rate_and_the_half_efficiency_size():
    rates = {"fp32": 60e12, "bf16": 700e12}
    shapes = [(m, h, 4 * h) for h in (1024, 4096, 8192) for m in (256, 4096)]
    points = _gemm_points(rates, 2e9, 3e12, shapes, noise=0.01)
    fit = fit_gemms(points, 3e12, 1e9)
    assert fit.rate_flops["fp32"] == pytest.approx(60e12, rel=0.03)
    assert fit.rate_flops["bf16"] == pytest.approx(700e12, rel=0.03)
    assert fit.half_flops == pytest.approx(2e9, rel=0.15)
    assert max(fit.fit_error.values()) < 0.02
    # GEMMs all far above F_half cannot tell it: the fit says so instead of guessing
    big = _gemm_points(rates, 1e6, 3e12, [(4096, 4096, 16384), (8192, 8192, 8192)], 0.0)
    assert fit_gemms(big, 3e12, 1e9).half_flops is None


def _synthetic_run(truth: dict, points: list[CollectivePoint], ranks_per_node: int
                   ) -> Measurements:
    shapes = [(1024, h, 4 * h) for h in (256, 1024)] + [(16, 256, 1024)]
    gemms = _gemm_points({"fp32": 0.07e12, "fp16": 0.08e12, "bf16": 0.5e12}, 2e5, 4e9,
                         shapes, noise=0.01)
    return Measurements(date="2026-11-26", num_nodes=1, ranks_per_node=ranks_per_node,
                        backend="gloo", device_name="test CPU", torch_version="2.13.0",
                        quick=True, collectives=tuple(points), gemms=tuple(gemms),
                        copies=(CopyPoint(nbytes=64 << 20, time_s=2 * (64 << 20) / 4e9),),
                        memory_bytes=6.3e9, memory_how="host RAM over 4 ranks",
                        op_overhead_s=5e-6)


def test_calibrated_profile_loads_predicts_and_cites_what_was_measured(tmp_path):
    base = hwprofiles.read_profile("cpu-gloo")
    truth = _gloo_node()
    _set(truth, "fabric_bandwidth", 0.3)
    _set(truth, "fabric_hop", 1000.0)
    points = _measured(truth, _points({"intra": (0, 1, 2, 3)}, {"intra": (0, 1)},
                                      size_grid(32 << 20, 4)), noise=0.01, seed=4)
    run = _synthetic_run(truth, points, 4)
    doc = calibrate_profile(base, "cpu-gloo", run, name="mine")
    path = tmp_path / "mine.toml"
    path.write_text(profile_toml(doc, "a calibrated profile\nfor the test"))
    cluster = autopar.Cluster.from_toml(path)
    assert cluster.name == "mine" and cluster.world_size == 4
    assert path.read_text().startswith("# a calibrated profile\n# for the test\n")
    for p in points:
        if p.held_out:
            predicted = cluster.collective_time(p.kind, p.nbytes, p.ranks)
            assert predicted == pytest.approx(p.time_s, rel=0.05), p
    device = cluster.hardware.device
    assert device.peak_flops["bf16"] == pytest.approx(0.5e12, rel=0.03)
    assert device.gemm_efficiency["bf16"] == 1.0  # CPU: the peak is the measured rate
    assert device.memory_bandwidth_bytes_per_s == pytest.approx(4e9, rel=1e-3)
    assert device.memory_bytes == pytest.approx(6.3e9)
    sources = hwprofiles.read_profile(path)["sources"]
    for key in ("node.fabric_gb_per_s", "node.fabric_hop_latency_us.simple",
                "collectives.call_overhead_us", "collectives.bandwidth_factor.reduce_scatter",
                "device.peak_tflops.fp32", "device.memory_bandwidth_gb_per_s",
                "device.device_memory_gb", "device.op_overhead_us", "node.gpus_per_node"):
        assert sources[key].startswith("measured by autopar calibrate on 2026-11-26, 1 node "
                                       "x 4 ranks"), key
    assert "fit error" in sources["node.fabric_gb_per_s"]
    assert "fit error" in sources["device.peak_tflops.bf16"]
    assert sources["network.nic_gbps"].startswith("not measured by autopar calibrate (one "
                                                  "node: no network to measure)")
    assert "F/(F+F_half)" in sources["device.gemm_half_efficiency_gflop"]  # kept: base's own


def test_table_reports_base_and_calibrated_errors_per_row_and_role():
    base = _gloo_node()
    truth = copy.deepcopy(base)
    _set(truth, "fabric_bandwidth", 0.3)
    points = _measured(truth, _points({"intra": (0, 1, 2, 3)}, {"intra": (0, 1)},
                                      size_grid(2 << 20, 4)), noise=0.0)
    run = _synthetic_run(truth, points, 4)
    doc = calibrate_profile(hwprofiles.read_profile("cpu-gloo"), "cpu-gloo", run, name="x")
    rows = table_rows(run, base, doc)
    held = [r for r in rows if r.role == "held-out"]
    assert len(held) == 5 * len(held_out_sizes(size_grid(2 << 20, 4)))
    assert all(abs(r.fitted_error) < 0.01 for r in held)
    assert any(abs(r.base_error) > 0.1 for r in held)
    text = render_table(rows)
    assert text.splitlines()[0].split()[:3] == ["what", "group", "size"]
    assert "held-out" in text and "gemm bf16" in text and "copy" in text
    csv_lines = table_csv(rows).splitlines()
    assert len(csv_lines) == len(rows) + 1 and csv_lines[0].startswith("what,group,size")
    summary = summary_lines(rows)
    assert any(s.startswith("held-out all collectives") for s in summary)


def test_calibrate_outside_torchrun_says_how_to_start_it(monkeypatch, tmp_path, capsys):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert cli_main(["calibrate", "--base", "cpu-gloo", "-o", str(tmp_path / "x.toml")]) == 2
    err = capsys.readouterr().err
    assert "RANK is missing" in err and "torchrun --nproc_per_node" in err
    assert cli_main(["calibrate", "--base", "cpu-glo", "-o", str(tmp_path / "x.toml")]) == 2
    assert "unknown hardware profile 'cpu-glo'" in capsys.readouterr().err
    assert cli_main(["calibrate", "--base", "cpu-gloo", "-o", str(tmp_path / "x.json")]) == 2
    assert "-o must name a .toml file" in capsys.readouterr().err
