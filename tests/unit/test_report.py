"""Plan report, explain/diff and plots on small real plans (GPT, 8 layers, dgx-h100).

The golden report is tests/data/report_golden.txt, rendered from a plan with every
ParallelConfig field pinned except zero_stage (so the next-candidates section has rows: the
three other ZeRO stages). It changes whenever a cost-model constant or the report layout
changes; regenerate it with

    AUTOPAR_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_report.py -k golden

read the diff by eye, and commit it with the change that caused it.
"""

import os
import random
from pathlib import Path

import pytest
import torch

import autopar
from autopar.config import ParallelConfig
from autopar.models.gpt import GPT, GPTConfig
from autopar.plan.explain import compare, diff, explain
from autopar.plan.plots import PLOT_FILES, pareto_front, plot_plan
from autopar.plan.report import (
    compress_modules,
    next_candidates,
    render_report,
    slower_because,
)

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "report_golden.txt"
GOLDEN_PINS = {"dp": 2, "tp": 2, "pp": 2, "cp": 1, "ep": 1, "micro_batch_size": 2,
               "pp_schedule": "1f1b", "virtual_stages": 1, "sequence_parallel": True,
               "recompute": "none"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model():
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=8192, max_seq_len=1024, dim=1024, n_layers=8,
                             n_heads=16))


@pytest.fixture(scope="module")
def cluster():
    return autopar.Cluster.from_profile("dgx-h100", num_nodes=1)


@pytest.fixture(scope="module")
def golden_plan(model, cluster):
    return autopar.compile(model, cluster, global_batch_size=16, seq_len=1024,
                           constraints=GOLDEN_PINS)


@pytest.fixture(scope="module")
def open_plan(model, cluster):
    """A plan with many candidates (only tp and pp pinned)."""
    return autopar.compile(model, cluster, global_batch_size=32, seq_len=1024,
                           constraints={"tp": 2, "pp": 2})


def test_golden_text_report(golden_plan):
    text = render_report(golden_plan)
    if os.environ.get("AUTOPAR_REGEN_GOLDEN"):
        GOLDEN.write_text(text, encoding="utf-8")
    assert text == GOLDEN.read_text(encoding="utf-8"), (
        "the report changed; if intended, regenerate (see this module's docstring)")


def test_plan_report_method_renders_the_full_report(golden_plan):
    assert golden_plan.report() == render_report(golden_plan, "text")
    assert golden_plan.report(fmt="md") == render_report(golden_plan, "md")
    with pytest.raises(ValueError, match="fmt must be 'text' or 'md'"):
        golden_plan.report(fmt="html")


def test_report_shows_every_section_with_the_plan_numbers(golden_plan):
    text = golden_plan.report()
    est = golden_plan.estimate
    for heading in ("Model, cluster, batch", "Chosen configuration", "Prediction",
                    "Step-time breakdown", "Memory per pipeline stage", "Layers per stage",
                    "Placements per module kind", "Next candidates", "Assumptions"):
        assert heading in text
    assert golden_plan.config.short() in text
    assert f"{est.tokens_per_s:,.0f} tokens/s" in text
    assert "SUSTAINED_COMPUTE_FRACTION[hopper]" in text and "ALLOCATOR_RESERVE_FRACTION" in text
    assert "overlap: ep all-to-all: never overlapped" in text
    assert "\x1b[" not in text  # no colour codes


def test_markdown_report_has_github_tables(golden_plan):
    md = golden_plan.report(fmt="md")
    assert md.startswith("# autopar plan: ")
    assert "## Step-time breakdown (exposed time per step)" in md
    assert "| term | time | % of step | what it is |" in md
    assert "|---|---:|---:|---|" in md
    assert "| rank | states | activations |" in md
    lines = md.splitlines()
    header = lines.index("| rank | states | activations | ZeRO-3 buffers | comm buffers | "
                         "CUDA context | alloc. reserve | total | of device |")
    memory_rows = [line for line in lines[header + 2:header + 2 + golden_plan.config.pp]]
    assert all(line.startswith("| ") and line.count("|") == 10 for line in memory_rows)


def test_report_is_the_same_after_save_and_load(golden_plan, tmp_path):
    loaded = autopar.load_plan(golden_plan.save(tmp_path / "plan.json"))
    assert loaded.estimate.timeline is None
    assert loaded.report() == golden_plan.report()


def test_next_five_candidates_name_real_fitting_configs(open_plan):
    picked = next_candidates(open_plan)
    assert len(picked) == 5
    table = open_plan.candidates
    labels = {ParallelConfig(**{f: _py(row[f]) for f in ParallelConfig.__dataclass_fields__}
                             ).short()
              for _, row in table[table["fits"]].iterrows()}
    md = open_plan.report(fmt="md")
    section = md[md.index("## Next candidates"):md.index("## Assumptions")]
    for row in picked:
        cfg = ParallelConfig(**{f: _py(row[f]) for f in ParallelConfig.__dataclass_fields__})
        assert cfg != open_plan.config and cfg.short() in labels
        assert f"| {cfg.short()} |" in section
    assert [bool(r["exact"]) for r in picked] == sorted((bool(r["exact"]) for r in picked),
                                                        reverse=True)
    assert all(float(r["step_time_s"]) >= open_plan.estimate.step_time_s - 1e-12
               for r in picked if bool(r["exact"]))


def _py(value):
    return value.item() if hasattr(value, "item") else value


def test_slower_because_names_the_largest_terms():
    assert slower_because({"dp_comm": 0.31, "bubble": 0.12, "compute": -0.05, "tp_comm": 0.0}) \
        == "+310.00 ms dp_comm, +120.00 ms bubble (offset by -50.00 ms compute)"
    assert slower_because({"bubble": 1.5}) == "+1.500 s bubble"
    assert "tie" in slower_because({"bubble": 0.0})


def test_compress_modules_joins_consecutive_layers():
    assert compress_modules(["emb", "layers.0", "layers.1", "layers.2", "layers.5", "norm"]) \
        == "emb, layers.0-2, layers.5, norm"


def test_explain_pins_a_degree_and_differences_each_term(golden_plan, model, cluster):
    why = explain(golden_plan, model, cluster, tp=4)
    assert why.feasible and why.alternative.config.tp == 4
    assert why.constraints["tp"] == 4
    assert why.comparison.config_changes["tp"] == (2, 4)
    assert why.comparison.step_time_delta_s == pytest.approx(
        why.alternative.estimate.step_time_s - golden_plan.estimate.step_time_s)
    text = str(why)
    assert text.startswith("why not tp=4?")
    for term in ("step time", "tp_comm", "bubble", "dp_comm", "peak memory (GB)", "config.tp"):
        assert term in text
    assert "| term | plan | pinned | B - A |" in why.render("md")


def test_a_plan_made_here_explains_and_diffs_without_its_model_again(golden_plan, tmp_path):
    """`compile` leaves the model and cluster with the plan (not in its file): explain needs
    only the pins; a loaded plan asks for them."""
    why = golden_plan.explain(tp=4)
    assert why.feasible and why.alternative.config.tp == 4
    assert golden_plan.diff(why.alternative) == diff(golden_plan, why.alternative)
    loaded = autopar.load_plan(golden_plan.save(tmp_path / "plan.json"))
    assert loaded.config == golden_plan.config and not loaded.origin
    with pytest.raises(ValueError, match="pass them, e.g. plan.explain"):
        loaded.explain(tp=4)
    again = loaded.explain(golden_plan.origin["model"], golden_plan.origin["cluster"], tp=4)
    assert again.alternative.config == why.alternative.config


def test_explain_an_infeasible_pin_says_why(golden_plan, model, cluster):
    why = explain(golden_plan, model, cluster, tp=16)
    assert not why.feasible and why.alternative is None
    assert "no configuration satisfies the constraints" in why.reason
    assert "no plan exists with tp=16" in str(why)
    with pytest.raises(ValueError, match=r"unknown pin\(s\) \['tensor_parallel'\]"):
        explain(golden_plan, model, cluster, tensor_parallel=4)
    other = autopar.Cluster.from_profile("dgx-h100", num_nodes=2)
    with pytest.raises(ValueError, match="this plan was made for dgx-h100 x 1"):
        explain(golden_plan, model, other, tp=4)


def test_explain_passes_on_an_error_that_is_not_about_planning(golden_plan, model, cluster,
                                                               monkeypatch):
    """Only a PlanningError means "no plan with these pins": a bug inside the search must
    surface, not read as a reason."""
    import autopar.api

    def broken(*args, **kwargs):
        raise ValueError("a bug inside the search")

    monkeypatch.setattr(autopar.api, "compile", broken)
    with pytest.raises(ValueError, match="a bug inside the search"):
        explain(golden_plan, model, cluster, tp=4)

    def refused(*args, **kwargs):
        raise autopar.errors.TargetRuleError("the engine cannot run tp=4")

    monkeypatch.setattr(autopar.api, "compile", refused)
    assert explain(golden_plan, model, cluster, tp=4).reason == "the engine cannot run tp=4"


def test_diff_of_a_plan_with_itself_is_zero(golden_plan, open_plan):
    same = compare(golden_plan, golden_plan)
    assert same.identical and not same.config_changes
    assert all(v == 0.0 for v in same.term_deltas_s.values())
    text = diff(golden_plan, golden_plan)
    assert "is the same plan: zero difference in every term" in " ".join(text.split())
    table = text[text.index("step time"):text.index("no configuration field")]
    assert all(line.split()[-1] == "0" for line in table.strip().splitlines())
    other = diff(golden_plan, open_plan, fmt="md")
    assert "| global_batch_size | 16 | 32 | changed |" in other


def test_plots_write_four_readable_pngs(golden_plan, tmp_path):
    paths = plot_plan(golden_plan, tmp_path / "plots")
    assert sorted(paths) == sorted(PLOT_FILES)
    for name, path in paths.items():
        assert path == tmp_path / "plots" / f"{name}.png"
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 10_000, name
    # a loaded plan has no timeline object: it is re-simulated from the stored stage times
    loaded = autopar.load_plan(golden_plan.save(tmp_path / "plan.json"))
    again = plot_plan(loaded, tmp_path / "loaded")
    assert again["timeline"].read_bytes() == paths["timeline"].read_bytes()


def test_pareto_front_matches_brute_force():
    rng = random.Random(0)
    points = [(rng.randint(0, 20), rng.randint(0, 20)) for _ in range(60)]
    front = pareto_front(points)
    dominated = {i for i, (t, m) in enumerate(points)
                 if any((t2 <= t and m2 <= m) and (t2, m2) != (t, m) for t2, m2 in points)}
    assert {points[i] for i in front} == {p for i, p in enumerate(points) if i not in dominated}
    assert [points[i][0] for i in front] == sorted(points[i][0] for i in front)
