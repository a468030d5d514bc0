"""The torch requirement in pyproject.toml: the range autopar supports, and the torch in use."""

import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

# The oldest torch autopar supports. Every API it imports is older (the newest, FSDP2's
# `fully_shard(ignored_params=...)`, arrived in 2.7: pytorch/pytorch#146631), but its head-aware
# tensor parallelism needs DTensor to compute on and redistribute `_StridedShard` placements:
# tests/distributed fails on 2.10 (no addmm sharding rule for them) and on 2.11 (the
# redistribute planner refuses them). On 2.12.1 it passes but for expert parallelism whose
# groups span a non-contiguous part of the mesh (DeviceMesh cannot slice that before 2.13), so
# 2.13 is the oldest supported.
OLDEST = "2.13.0"
# The newest minor release the range admits; the whole suite passes on 2.15.0.
NEWEST = "2.15.0"
# What the Makefile installs first (`pip install torch==2.13.0`).
PINNED = "2.13.0"


def _torch_requirement() -> Requirement:
    with PYPROJECT.open("rb") as fh:
        dependencies = tomllib.load(fh)["project"]["dependencies"]
    torch = [r for r in map(Requirement, dependencies) if r.name == "torch"]
    assert len(torch) == 1, dependencies
    return torch[0]


def test_torch_range_admits_the_supported_versions():
    spec = _torch_requirement().specifier
    for admitted in (OLDEST, PINNED, NEWEST, "2.15.9"):
        assert spec.contains(admitted), (admitted, str(spec))


def test_torch_range_refuses_older_and_unknown_releases():
    spec = _torch_requirement().specifier
    oldest = Version(OLDEST)
    below = f"{oldest.major}.{oldest.minor - 1}.9"
    for refused in (below, "2.16.0", "3.0.0"):
        assert not spec.contains(refused), (refused, str(spec))


def test_installed_torch_satisfies_the_requirement():
    installed = version("torch")  # e.g. 2.13.0+cpu: local labels match the release
    assert _torch_requirement().specifier.contains(installed), installed
