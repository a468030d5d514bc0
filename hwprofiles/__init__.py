"""Hardware profiles: TOML data files (one per system) and a tiny loader that validates them.

`read_profile("dgx-h100")` or `read_profile("/path/to/my.toml")` returns the validated TOML
document as a dict; `list_profiles()` names the shipped ones; `apply_overrides` returns a copy
with fields replaced by name and validated again. The schema is in `hwprofiles.schema` and,
for people, in hwprofiles/README.md. This package imports nothing from autopar or costmodels.
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

from hwprofiles.schema import FIELDS, validate

__all__ = ["PROFILE_DIR", "list_profiles", "read_profile", "apply_overrides"]

PROFILE_DIR = Path(__file__).parent / "profiles"


def list_profiles() -> list[str]:
    """Names of the shipped profiles, sorted."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def _resolve(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml":
        if not path.is_file():
            raise ValueError(f"hardware profile file {path} does not exist")
        return path
    shipped = PROFILE_DIR / f"{name_or_path}.toml"
    if not shipped.is_file():
        raise ValueError(f"unknown hardware profile {str(name_or_path)!r}; shipped profiles: "
                         f"{', '.join(list_profiles())} (or pass a path to a .toml file)")
    return shipped


def read_profile(name_or_path: str | Path) -> dict[str, Any]:
    """Parse and validate a profile by shipped name or by path to a TOML file."""
    path = _resolve(name_or_path)
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    return validate(doc, origin=str(path))


def apply_overrides(doc: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Return a validated copy of `doc` with fields replaced by name (e.g. nic_gbps=100).

    An overridden number keeps no citation of its own: its source becomes "override".
    """
    if not overrides:
        return doc
    out = copy.deepcopy(doc)
    for name, value in sorted(overrides.items()):
        spec = FIELDS.get(name)
        if spec is None:
            raise ValueError(f"cannot override {name!r}: not a profile field; fields: "
                             f"{', '.join(sorted(FIELDS))}")
        if spec.kind == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        out[spec.section][name] = value
        sources = out.setdefault("sources", {})
        path = f"{spec.section}.{name}"
        for key in [k for k in sources if k == path or k.startswith(path + ".")]:
            del sources[key]
        if spec.kind in ("int", "float") or spec.kind.endswith("_table"):
            sources[path] = "override by the caller (what-if)"
    changes = ", ".join(f"{k}={v!r}" for k, v in sorted(overrides.items()))
    out["name"] = f"{doc['name']} ({changes})"
    return validate(out, origin=f"profile {doc['name']!r} with overrides {changes}")
