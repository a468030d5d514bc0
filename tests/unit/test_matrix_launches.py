"""`benchmarks/runtime_matrix.run_cells` trains many cells in one launch: a launch that dies
costs only the cell it died in, even when a rank died before another rank wrote the cell
before it (the launches are faked here; the real ones: tests/distributed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import runtime_matrix as rm  # noqa: E402


def test_a_crash_fails_only_the_cell_it_happened_in(tmp_path, monkeypatch):
    launches = []

    def launch(paths, models, ranks, out_dir, timeout_s):
        launches.append(list(models))
        for i, (path, model) in enumerate(zip(paths, models)):
            if model == "crash":
                # rank 1 died here; rank 0 had not yet written the cell before it
                if i:
                    (out_dir / f"{paths[i - 1].stem}.0.json").unlink()
                return subprocess.CompletedProcess([], 1, "", "RuntimeError: rank 1 died\n===")
            for r in range(ranks):
                (out_dir / f"{path.stem}.{r}.json").write_text(
                    json.dumps({"loss_err": 0.0, "grad_err": 0.0}))
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(rm, "_launch", launch)
    cells = [(rm.Cell(m, "p"), tmp_path / f"{m}.p.json") for m in ("a", "b", "crash", "c", "d")]
    rm.run_cells(cells, 2, tmp_path)
    status = {c.model: c.text() for c, _ in cells}
    assert status == {"a": "ok 0.0e+00/0.0e+00", "b": "ok 0.0e+00/0.0e+00",
                      "crash": "FAIL: worker exited 1: RuntimeError: rank 1 died",
                      "c": "ok 0.0e+00/0.0e+00", "d": "ok 0.0e+00/0.0e+00"}, status
    # all; the cell rank 0 left unwritten, alone; the rest; the crash, alone; the rest
    assert launches == [["a", "b", "crash", "c", "d"], ["b"], ["crash", "c", "d"], ["crash"],
                        ["c", "d"]]
