"""Code a newcomer can read: no product file over 600 lines, no private function with more
than 8 parameters and no public one with more than 10 (``self``/``cls`` not counted), but
``autopar.compile``, whose 11 are each named by the documented API (model, cluster, the
training shape, dtype, constraints, options, settings, software, target)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("autopar", "costmodels", "hwprofiles")
DOCUMENTED = {("autopar/api.py", "compile"): 11}
FILES = sorted(f for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py"))


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return len(names) - (names[:1] in (["self"], ["cls"]))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_files_and_parameter_lists_stay_short(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 600, f"{path.name}: split it"
    long = [(fn.name, n) for fn in ast.walk(ast.parse(text))
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (n := _parameters(fn)) > DOCUMENTED.get(
                (str(path.relative_to(ROOT)), fn.name), 8 if fn.name.startswith("_") else 10)]
    assert not long, f"{path.name}: {long} (pass a context or a dataclass)"


def test_the_check_sees_the_product():
    assert len(FILES) > 100 and any(f.name == "api.py" for f in FILES)
