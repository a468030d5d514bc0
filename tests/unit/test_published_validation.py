"""The frozen validation set (benchmarks/data/published_runs_validation.csv) as runnable setups.

Every row loads into one of the validation groups of benchmarks/published_runs.py, with that
group's SOFTWARE entry and documented assumptions, a model of the published size and a positive
published step time; its metric converts as the row's own notes do; and a row either estimates
or is refused with a stated reason. The full table (124 estimates, about a minute) is
`python benchmarks/published_runs.py --validation`; here one row per group is estimated, plus the
three ways a row is refused. Nothing here checks the size of an error: the validation set is
never used to fit or tune the cost model.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from types import SimpleNamespace

import pytest

from benchmarks import published_runs as pr

RUNS = pr.load_runs(pr.VALIDATION_CSV)
BY_ID = {run.run_id: run for run in RUNS}


def test_every_row_loads_into_a_validation_group():
    assert len(RUNS) == 124
    assert len(BY_ID) == 124, "run ids must be unique"
    assert Counter(run.group for run in RUNS) == {
        "nanotron-h100": 26, "mcore-moe-t3": 18, "mcore-moe-t2-fp8": 2, "mcore-moe-t5-cp": 8,
        "zb-a100": 48, "torchao-h100": 3, "torchao-mi300x": 4, "torchao-b200": 5,
        "torchao-moe-b200": 4, "torchao-moe-gb200": 2, "fp8-blog-h100": 4}
    assert not set(pr.VALIDATION_GROUPS) & set(pr.CALIBRATION_GROUPS)
    for run in RUNS:
        assert run.set_name == "validation"
        options, text = pr.SOFTWARE[run.group]
        assert options and text
        assert {k: getattr(run.options(), k) for k in options} == options, run.run_id
        assert run.assumptions[:len(pr.GROUP_ASSUMPTIONS[run.group])] == \
            pr.GROUP_ASSUMPTIONS[run.group]
        assert run.published_step_time_s > 0 and run.step_time_derivation
        cluster = run.make_cluster()
        assert cluster.world_size == run.n_gpus == run.num_nodes * cluster.gpus_per_node
        assert run.kinds and set(run.kinds) <= set(pr.KINDS)
        assert run.global_batch_size % (run.config.dp * run.config.micro_batch_size) == 0


def test_calibration_rows_stay_in_the_calibration_set():
    assert {run.set_name for run in pr.load_runs()} == {"calibration"}
    assert {run.set_name for run in pr.load_runs(pr.HELDOUT_CSV)} == {"calibration"}


def test_kinds_follow_the_columns():
    kinds = Counter(k for run in RUNS for k in run.kinds)
    # benchmarks/data/README.md: 17 fp8 or mxfp8 rows, 34 MoE, 8 long-context CP, 79 dense
    assert (kinds["fp8"], kinds["moe"], kinds["cp"], kinds["dense"]) == (17, 34, 8, 79)
    assert kinds["dense-a100"] == 48 and kinds["dense-a100"] + kinds["dense-newer"] == 79


def test_refusals_at_load_are_the_partial_fp8_rows():
    refused = {run.run_id: run.refusal for run in RUNS if run.refusal}
    assert set(refused) == {"torchao-moe-b200-mxfp8-linears", "torchao-moe-b200-mxfp8-experts"}
    assert all("only part of the Linear layers" in why for why in refused.values())


def test_group_rules():
    for run in RUNS:
        cfg, group = run.config, run.group
        if group == "nanotron-h100":
            assert run.arch == "llama" and run.num_kv_heads == run.num_heads
            assert run.tie_embeddings == (run.ffn_hidden < 10000)
            assert cfg.sequence_parallel == (cfg.tp > 1) and cfg.recompute == "none"
            assert cfg.zero_stage == (1 if "ZeRO-1" in run.notes.split("'")[1] else 0)
            assert run.profile == "dgx-h100" and run.dtype == "bf16"
        elif group.startswith("mcore-moe"):
            assert run.arch == "moe" and not run.tie_embeddings
            assert (cfg.micro_batch_size, cfg.recompute, cfg.virtual_stages) == (1, "none", 1)
            assert cfg.zero_stage == (3 if "method 'FSDP" in run.notes else 1)
            assert cfg.sequence_parallel == (cfg.tp > 1)
            assert run.shared_expert_ffn == (20480 if run.model_name.startswith("Qwen2") else 0)
            assert run.shared_expert_gated == run.model_name.startswith("Qwen2")
            assert run.dtype == ("fp8" if group == "mcore-moe-t2-fp8" else "bf16")
            if run.dtype == "fp8":
                assert run.options().fp8_recipe == "delayed"
            # the 'MCore w/ Folding' rows run as folded (ETP1); the others split experts on tp
            assert cfg.folded == ("MoE Parallel Folding" in run.notes and cfg.tp > 1), run.run_id
        elif group == "zb-a100":
            assert run.arch == "gpt" and run.tie_embeddings and run.dropout == 0.1
            assert run.dtype == "fp16" and (cfg.dp, cfg.tp, cfg.zero_stage) == (1, 1, 0)
            label = re.search(r"Schedule column: ([^.]+)\.", run.notes).group(1)
            assert cfg.pp_schedule == {"1F1B": "1f1b", "1F1B-I": "interleaved-1f1b",
                                       "ZB-1p": "zero-bubble", "ZB-2p": "zero-bubble"}[label]
            assert (cfg.virtual_stages > 1) == (label == "1F1B-I")
            assert run.overrides == {"network_kind": "roce"}
        else:  # torchtitan
            assert cfg.zero_stage == 3 and cfg.pp == 1
            assert run.arch == ("moe" if group.startswith("torchao-moe") else "llama")
            assert cfg.recompute == {"fp8-blog-h100": "full", "torchao-moe-b200": "none",
                                     "torchao-moe-gb200": "none"}.get(group, "per_op")
            assert run.dtype in ("bf16", "fp8")
            if run.arch == "moe":
                assert (run.shared_expert_ffn, run.shared_expert_gated, run.top_k) == \
                    (8192, False, 1)
    recipes = {run.run_id: run.options().fp8_recipe for run in RUNS if run.dtype == "fp8"}
    assert recipes["torchao-h100-fp8-tensorwise"] == "tensorwise"
    assert recipes["torchao-h100-fp8-rowwise"] == "rowwise"
    assert recipes["torchao-mi300x-fp8-rowwise-gw-hp"] == "rowwise"
    assert recipes["torchao-b200-mxfp8"] == recipes["torchao-b200-mxfp8-rceil"] == "rowwise"
    assert recipes["fp8-blog-h100-llama3-70b-fp8-tensorwise"] == "tensorwise"
    assert {BY_ID[i].profile for i in ("torchao-mi300x-bf16", "torchao-b200-bf16",
                                       "torchao-moe-gb200-bf16")} == \
        {"mi300x-8", "dgx-b200", "gb200-nvl72"}
    assert BY_ID["torchao-moe-gb200-bf16"].make_cluster().gpus_per_node == 64
    assert BY_ID["torchao-moe-b200-bf16"].make_cluster().gpus_per_node == 4
    assert BY_ID["fp8-blog-h100-llama3-70b-bf16"].overrides == {
        "network_kind": "roce", "nics_per_node": 8, "nic_gbps": 400}


def test_models_have_the_published_sizes():
    counts: dict = {}
    for run in RUNS:
        key = (run.model_config(), run.shared_expert_ffn, run.shared_expert_gated)
        if key not in counts:
            model = run.build_model()
            assert next(model.parameters()).device.type == "meta"
            counts[key] = sum(p.numel() for p in model.parameters())
        # the Zero Bubble 1.5B is published to two figures (our GPT: 1.52B)
        assert counts[key] / (run.params_billion * 1e9) == pytest.approx(1, abs=0.015), run.run_id


def test_metric_conversions_agree_with_the_notes():
    for run in RUNS:
        if run.metric == "mfu":
            peak = (pr.NANOTRON_MFU_PEAK_TFLOPS if run.group == "nanotron-h100"
                    else pr.MOE_FOLDING_PEAK_TFLOPS)
            noted = re.search(r"(?:this MFU is|=) ([\d.]+) TFLOP/s/GPU", run.notes).group(1)
            assert run.metric_value / 100 * peak == pytest.approx(float(noted), abs=0.051)
        noted = re.search(r"step = \d+ samples / \(\d+ x [\d.]+\) = ([\d.]+) s", run.notes)
        if noted:  # Zero Bubble: samples/s/GPU x 1024 stored as tokens/s/GPU
            assert run.published_step_time_s == pytest.approx(float(noted.group(1)), abs=1e-3)


def test_flop_counts_by_hand():
    # nanotron's get_flops equals Megatron's count for an MHA SwiGLU model (both 3x forward,
    # full s x s attention): 12·B·s·l·h²·[(1 + 1 + s/h) + (f/h)·3/2 + V/(2lh)]
    b, s, l, h, f, v = 256, 4096, 16, 2048, 8192, 131072
    nano = pr.nanotron_model_flops(batch=b, seq_len=s, num_layers=l, hidden=h, ffn_hidden=f,
                                   num_heads=32, num_kv_heads=32, vocab=v)
    assert nano == pytest.approx(12 * b * s * l * h * h * (2 + s / h + 1.5 * f / h
                                                           + v / (2 * l * h)), rel=1e-12)
    assert nano == pytest.approx(pr.megatron_model_flops(
        batch=b, seq_len=s, num_layers=l, hidden=h, ffn_hidden=f, num_heads=32, num_kv_heads=32,
        vocab=v, swiglu=True), rel=1e-12)
    run = BY_ID["nanotron-h100-1.34b-n8"]  # 44.32 % MFU on 8 GPUs
    assert run.published_step_time_s == pytest.approx(nano / (8 * 0.4432 * 989e12), rel=1e-9)
    # Qwen2-57B-A14B: top-8 of ffn 2560 plus the shared expert of 20480, GQA 28/4 heads
    q = BY_ID["mcore-moe-t3-qwen2-57b-a14b-mcore"]
    b, s, l, h = 256, 4096, 28, 3584
    megatron = 12 * b * s * l * h * h * ((1 + 4 / 28 + s / h) + 2560 / h * 8 * 1.5
                                         + 20480 / h * 1.5 + 151936 / (2 * l * h))
    assert q.published_step_time_s == pytest.approx(megatron / (64 * 0.353 * 989.5e12),
                                                    rel=1e-9)
    # tokens/s/GPU: torchtitan's per-device tps
    t = BY_ID["torchao-h100-bf16"]
    assert t.published_step_time_s == pytest.approx(8 * 8192 / (8 * 6150), rel=1e-12)


# one row per group, and the three ways a row is refused
SAMPLES = [next(run.run_id for run in RUNS if run.group == g) for g in pr.VALIDATION_GROUPS]
SAMPLES.append("zb-a100-1.5b-1f1b-i-b144")  # 24 chunks: the embedding and the head alone
SAMPLES.append("mcore-moe-t3-llama3-8x70b-mcore-folding")  # ep 8 > dp*cp 2: folded over tp8
REFUSED = {
    "torchao-moe-b200-mxfp8-linears": "only part of the Linear layers",  # partial fp8
}


@pytest.mark.parametrize("run_id", SAMPLES + list(REFUSED))
def test_row_estimates_or_is_refused_with_a_reason(run_id):
    out = pr.estimate_run(BY_ID[run_id])
    assert out.status in ("ok", "refused"), out.reason
    if run_id in REFUSED:
        assert out.status == "refused" and REFUSED[run_id] in out.reason
    elif out.status == "ok":
        assert out.est.step_time_s > 0 and math.isfinite(out.error_pct)
        assert out.est.num_microbatches == BY_ID[run_id].global_batch_size // (
            BY_ID[run_id].config.dp * BY_ID[run_id].config.micro_batch_size)
    else:
        assert out.reason


def test_summary_counts_refusals_and_configurations_that_do_not_fit():
    def outcome(status, pred=None, fits=True):
        run = SimpleNamespace(published_step_time_s=2.0)
        est = SimpleNamespace(step_time_s=pred, fits=fits) if pred is not None else None
        return pr.Outcome(run, status, "why" if status != "ok" else "", est)

    stats = pr.summary_stats([outcome("ok", 2.2), outcome("ok", 1.8, fits=False),
                              outcome("ok", 2.0), outcome("refused"), outcome("failed")])
    assert (stats["n"], stats["refused"], stats["failed"], stats["not_fit"]) == (3, 1, 1, 1)
    assert stats["median"] == pytest.approx(10.0) and stats["mean"] == pytest.approx(0.0)
    assert stats["p90"] == pytest.approx(10.0)
    assert pr.summary_stats([outcome("refused")])["median"] is None
