"""Hardware profiles: every shipped profile loads, cites its numbers, and bad files are refused
with a message that names the file, the field and what is allowed."""

from pathlib import Path

import pytest

import hwprofiles
from hwprofiles.schema import FIELDS

SHIPPED = {"dgx-v100", "dgx-a100-40g", "dgx-a100-80g", "dgx-h100", "hgx-h800", "dgx-h200",
           "dgx-b200", "gb200-nvl72", "mi300x-8", "h100-pcie-roce", "cpu-gloo"}
H100_TEXT = (hwprofiles.PROFILE_DIR / "dgx-h100.toml").read_text()


def test_shipped_profile_names_are_exactly_the_design_list():
    assert set(hwprofiles.list_profiles()) == SHIPPED


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_profile_loads_and_cites_every_number(name):
    doc = hwprofiles.read_profile(name)
    assert doc["name"] == name
    sources = doc["sources"]
    for field, spec in FIELDS.items():
        if spec.optional and field not in doc[spec.section]:
            continue
        value = doc[spec.section][field]
        if spec.kind in ("int", "float"):
            assert f"{spec.section}.{field}" in sources
        elif spec.kind.endswith("_table"):
            for key in value:
                path = f"{spec.section}.{field}"
                assert f"{path}.{key}" in sources or path in sources


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "custom.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("old,new,expected", [
    ("nic_gbps = 400.0", "nic_gbps = -400.0", "network.nic_gbps' must be > 0"),
    ("nic_gbps = 400.0", 'nic_gbps = "400"', "network.nic_gbps' must be a number"),
    ("gpus_per_node = 8", "gpus_per_node = 8.5", "node.gpus_per_node' must be an integer"),
    ("nics_per_node = 8\n", "", "network.nics_per_node' is missing"),
    ("oversubscription = 1.0", "oversubscription = 1.0\nnic_speed = 3", "network.nic_speed' is not a known field"),
    ('fabric = "nvswitch"', 'fabric = "infinityband"', "allowed: nvswitch, nvlink_mesh"),
    ("bf16 = 989.4,", "bf17 = 989.4,", "peak_tflops.bf17' is not a known key"),
    ("fabric_efficiency = 0.824", "fabric_efficiency = 1.5", "must be <= 1.0"),
    ('{ ll = 2.7, ll128 = 4.0, simple = 14.0 }', '{ ll = 2.7, simple = 14.0 }', "missing protocols ['ll128']"),
    ('"network.nic_efficiency" = ', '"network.nic_eff" = ', "names no numeric field"),
    ("schema_version = 1", "schema_version = 2", "schema_version' must be 1"),
])
def test_bad_profile_is_refused_naming_file_and_field(tmp_path, old, new, expected):
    assert old in H100_TEXT
    path = _write(tmp_path, H100_TEXT.replace(old, new, 1))
    with pytest.raises(ValueError) as err:
        hwprofiles.read_profile(path)
    assert str(path) in str(err.value)
    assert expected in str(err.value)


def test_a_number_without_a_source_is_refused(tmp_path):
    lines = [ln for ln in H100_TEXT.splitlines() if not ln.startswith('"network.nic_gbps"')]
    path = _write(tmp_path, "\n".join(lines))
    with pytest.raises(ValueError, match=r"network.nic_gbps' has no source"):
        hwprofiles.read_profile(path)


def test_invalid_toml_and_unknown_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not valid TOML"):
        hwprofiles.read_profile(_write(tmp_path, "name = [unclosed"))
    with pytest.raises(ValueError, match="unknown hardware profile 'dgx-h900'.*dgx-h100"):
        hwprofiles.read_profile("dgx-h900")
    with pytest.raises(ValueError, match="does not exist"):
        hwprofiles.read_profile(tmp_path / "absent.toml")


def test_overrides_replace_fields_by_name_and_are_cited_as_overrides():
    doc = hwprofiles.read_profile("dgx-a100-80g")
    out = hwprofiles.apply_overrides(doc, {"nics_per_node": 4, "nic_gbps": 100})
    assert out["network"]["nics_per_node"] == 4 and out["network"]["nic_gbps"] == 100.0
    assert "override" in out["sources"]["network.nic_gbps"]
    assert doc["network"]["nics_per_node"] == 8  # the original is untouched
    with pytest.raises(ValueError, match="cannot override 'nic_speed'.*nic_gbps"):
        hwprofiles.apply_overrides(doc, {"nic_speed": 100})
    with pytest.raises(ValueError, match="nics_per_node. must be >= 0"):
        hwprofiles.apply_overrides(doc, {"nics_per_node": -1})


def test_optional_device_fields_default_to_the_cost_models_constants():
    from costmodels import compute
    from costmodels.hardware import HardwareProfile

    h100 = HardwareProfile.load("dgx-h100").device
    assert h100.gemm_half_efficiency_flops is None and h100.op_overhead_s is None
    assert compute.op_overhead_s(h100) == compute.KERNEL_GAP_S
    cpu = HardwareProfile.load("cpu-gloo").device
    assert cpu.gemm_half_efficiency_flops == pytest.approx(0.000224e9)
    assert compute.op_overhead_s(cpu) == pytest.approx(2.7e-6)
    # a 64^3 fp32 GEMM: the CPU is near its large-GEMM rate, an H100 far from it
    flops = 2 * 64**3
    cpu_eff = flops / compute.peak_flops(cpu, "fp32") / compute.gemm_time_s(cpu, "fp32", flops, 0)
    h100_eff = flops / compute.peak_flops(h100, "bf16") / compute.gemm_time_s(h100, "bf16", flops, 0)
    assert cpu_eff == pytest.approx(flops / (flops + 0.000224e9))
    assert h100_eff == pytest.approx(flops / (flops + compute.GEMM_HALF_EFFICIENCY_FLOPS))


def test_per_collective_factors_scale_that_collectives_latency_and_bandwidth_only(tmp_path):
    """`latency_factor` multiplies a collective's whole latency (call overhead included) and
    `bandwidth_factor` its bus bandwidth; other collectives and absent keys are unchanged."""
    from costmodels.collectives import collective_time
    from costmodels.hardware import HardwareProfile

    text = (hwprofiles.PROFILE_DIR / "cpu-gloo.toml").read_text().replace(
        "call_overhead_us = 269.3\n", "call_overhead_us = 269.3\n"
        "latency_factor = { reduce_scatter = 2.0 }\nbandwidth_factor = { reduce_scatter = 0.25 }\n"
    ).replace("[sources]\n", '[sources]\n"collectives.latency_factor" = "a test value, 2x"\n'
              '"collectives.bandwidth_factor" = "a test value, a quarter"\n')
    base = HardwareProfile.load("cpu-gloo")
    scaled = HardwareProfile.load(_write(tmp_path, text))
    ranks, n = range(4), 4
    for nbytes in (64.0, 2**26):
        lat = 269.3e-6 + 3 * 136.2e-6
        wire = nbytes * (n - 1) / n / 0.776e9
        assert collective_time(base, "reduce_scatter", nbytes, ranks, world_size=8) \
            == pytest.approx(lat + wire)
        assert collective_time(scaled, "reduce_scatter", nbytes, ranks, world_size=8) \
            == pytest.approx(2 * lat + 4 * wire)
        for kind in ("all_reduce", "all_gather", "all_to_all"):
            assert collective_time(scaled, kind, nbytes, ranks, world_size=8) \
                == collective_time(base, kind, nbytes, ranks, world_size=8)
    with pytest.raises(ValueError, match="latency_factor.allreduce' is not a known key"):
        hwprofiles.read_profile(_write(tmp_path, text.replace("{ reduce_scatter = 2.0 }",
                                                              "{ allreduce = 2.0 }")))
