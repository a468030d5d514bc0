"""Test-wide setup: make the repository root importable (benchmarks/ holds shared loaders)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
