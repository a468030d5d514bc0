"""House rules: imports flow autopar -> costmodels -> hwprofiles; costmodels and
hwprofiles never import torch; only autopar/runtime (and calibrate) touch torch.distributed."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _files(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, package
    return files


def test_costmodels_and_hwprofiles_stay_torch_free_and_below_autopar():
    forbidden = {"costmodels": ("torch", "autopar"), "hwprofiles": ("torch", "autopar", "costmodels")}
    for package, roots in forbidden.items():
        for path in _files(package):
            bad = {m for m in _imports(path) if m.split(".")[0] in roots}
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_only_the_runtime_touches_torch_distributed():
    for path in _files("autopar"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("autopar/runtime/", "autopar/calibrate/")):
            continue
        bad = {m for m in _imports(path) if m.startswith("torch.distributed")}
        assert not bad, f"{rel} imports {sorted(bad)}"
