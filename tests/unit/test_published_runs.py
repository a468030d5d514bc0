"""The published-runs calibration set: every row is a runnable setup, and every metric converts
to the step time its source implies (hand-computed examples, and cross-checks against the other
numbers each source prints: SC21's training-day estimates, Megatron's MFU, MosaicML's MFU/HFU).
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from autopar.config import check_config
from benchmarks import published_runs as pr

RUNS = pr.load_runs()
BY_ID = {run.run_id: run for run in RUNS}

# Parameter counts may differ from the published size by at most 4 %: the smallest models are
# published to two significant figures (SC21 "1.7" for eq. (2)'s 1.652B is -2.8 %; Megatron
# "1.7B" for the untied 1.754B is +3.2 %), and conventions (learned position table, biases,
# LayerNorm) move counts by < 1 % otherwise. A learned table of 65536 positions adds 4 % to a
# 7B model; see test_mosaicml_params_are_the_2048_context_count for that row.
PARAM_TOLERANCE = 0.04


@pytest.fixture(scope="module")
def param_counts() -> dict[str, int]:
    return {run.run_id: sum(p.numel() for p in run.build_model().parameters()) for run in RUNS}


def test_every_row_loads_into_its_group():
    assert len(RUNS) == 47
    assert len(BY_ID) == 47, "run ids must be unique"
    assert Counter(run.group for run in RUNS) == {
        "sc21-t1": 10, "sc21-t2-zero3": 6, "sc21-t2-ptdp": 6, "mlm-h100": 9,
        "mlm-h100-strong": 2, "mpt-h100": 7, "mpt-a100": 7}
    for run in RUNS:
        assert run.assumptions and run.step_time_derivation
        assert run.dtype == ("fp16" if run.group.startswith("sc21") else "bf16")


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.run_id)
def test_row_is_a_valid_setup(run, param_counts):
    cfg = run.config
    assert cfg.dp * cfg.tp * cfg.pp * cfg.cp == run.n_gpus
    cluster = run.make_cluster()
    assert cluster.world_size == run.n_gpus == run.num_nodes * cluster.gpus_per_node
    assert run.global_batch_size % (cfg.dp * cfg.micro_batch_size) == 0
    check_config(cfg, world_size=cluster.world_size, global_batch_size=run.global_batch_size,
                 num_layers=run.num_layers, num_heads=run.num_heads,
                 num_kv_heads=run.num_kv_heads, seq_len=run.seq_len)
    assert run.num_layers % (cfg.pp * cfg.virtual_stages) == 0  # Megatron's layer split
    assert run.published_step_time_s > 0

    model = run.build_model()
    assert next(model.parameters()).device.type == "meta"
    count = param_counts[run.run_id]
    assert abs(count / (run.params_billion * 1e9) - 1) <= PARAM_TOLERANCE, (
        f"{run.run_id}: {count / 1e9:.3f}B parameters vs published {run.params_billion}B")


def test_group_rules():
    for run in RUNS:
        cfg = run.config
        if run.group.startswith("sc21"):
            assert cfg.recompute == "full" and not cfg.sequence_parallel
            assert cfg.zero_stage == (3 if run.group == "sc21-t2-zero3" else 0)
        if run.group == "sc21-t2-ptdp":
            assert cfg.micro_batch_size == 1
        if run.group.startswith("sc21"):
            assert run.dropout == 0.1  # Megatron-LM's default attention and hidden dropout
        if run.group == "sc21-t2-zero3":
            assert cfg.tp == cfg.pp == 1 and cfg.dp == run.n_gpus
        if run.group.startswith("mlm"):
            assert (cfg.zero_stage, cfg.micro_batch_size, cfg.recompute) == (1, 1, "none")
            assert cfg.sequence_parallel == (cfg.tp > 1)
            assert not run.tie_embeddings
        if run.group.startswith("mpt"):
            assert cfg.zero_stage == 3 and cfg.tp == cfg.pp == 1 and cfg.dp == run.n_gpus
        if cfg.pp > 1 and run.group != "sc21-t1":
            assert cfg.pp_schedule == "interleaved-1f1b" and cfg.virtual_stages >= 2
    a100 = BY_ID["mpt-a100-70b-s2048-n64"]
    assert a100.overrides == {"network_kind": "roce", "nics_per_node": 8, "nic_gbps": 200}
    cluster = a100.make_cluster()
    assert cluster.hardware.network.nics_per_node * 200 == 1600
    assert BY_ID["mpt-a100-40g-13b-s2048-n128"].profile == "dgx-a100-40g"


def test_sc21_table1_rows_take_nvidias_reproduction_script():
    """Megatron-LM examples/sc21/run_table_1.sh: MBS, layers per virtual stage, DDP impl."""
    def row(size):
        return BY_ID[next(i for i in BY_ID if i.startswith(f"sc21-t1-{size}b-"))]

    r = row("18.4")
    assert r.config.micro_batch_size == 8 and r.config.pp_schedule == "1f1b"
    assert r.options().overlap_dp_comm  # --DDP-impl torch overlaps the gradient all-reduce
    r = row("39.1")
    assert (r.config.micro_batch_size, r.config.pp_schedule) == (4, "1f1b")
    assert not r.options().overlap_dp_comm  # local DDP reduces after the backward
    r = row("76.1")  # 60 layers / 4 stages, 5 layers per virtual stage
    assert (r.config.micro_batch_size, r.config.virtual_stages) == (2, 3)
    r = row("529.6")  # 105 / 35 = 3 layers per stage, one per virtual stage
    assert (r.config.micro_batch_size, r.config.virtual_stages) == (1, 3)
    assert row("1008").config.pp_schedule == "1f1b"
    assert {round(r.params_billion, 1) for r in RUNS if r.group == "sc21-t1"} == \
        set(pr.SC21_TABLE1_SCRIPT)


def test_interleave_degree():
    assert pr.interleave_degree(96, 1) == 1
    assert pr.interleave_degree(48, 2) == 2     # 24 layers per stage
    assert pr.interleave_degree(60, 4) == 3     # 15
    assert pr.interleave_degree(105, 35) == 3   # 3
    assert pr.interleave_degree(92, 4) == 23    # 23 is prime: one layer per virtual stage
    with pytest.raises(ValueError):
        pr.interleave_degree(64, 64)


# ------------------------------------------------------------------ metric conversions by hand

def test_sc21_eq3_by_hand():
    # GPT-1.7B, Table 1: B=512, s=2048, l=24, h=2304, V=51200, n=32, X=137 TFLOP/s.
    # 96·512·2048·24·2304² = 1.28247e16; 1 + 2048/13824 + 51200/884736 = 1.206019
    f = pr.sc21_iteration_flops(batch=512, seq_len=2048, num_layers=24, hidden=2304, vocab=51200)
    assert f == pytest.approx(1.28247e16 * 1.206019, rel=1e-5)
    run = BY_ID["sc21-t1-1.7b-n32"]
    assert run.published_step_time_s == pytest.approx(1.54668e16 / (32 * 137e12), rel=1e-4)
    assert run.published_step_time_s == pytest.approx(3.528, abs=1e-3)


def test_sc21_table2_training_days_reproduce_with_eq3():
    # Table 2 prints "training time for 300B tokens (days)" for ZeRO-3 and PTD-P alike; it
    # equals (300e9 / (B·s)) iterations x our step time, so eq. (3) is the count behind both.
    rows = [run for run in RUNS if run.group.startswith("sc21-t2")]
    assert len(rows) == 12
    for run in rows:
        published = int(re.search(r"est\. (\d+) days", run.notes).group(1))
        days = 300e9 / (run.global_batch_size * run.seq_len) * run.published_step_time_s / 86400
        assert days == pytest.approx(published, rel=0.015), run.run_id


def test_megatron_flops_by_hand():
    # GPT-177B H100 row: B=1152, s=4096, l=96, h=12288, V=131072, n=2304, X=432.8 TFLOP/s.
    b, s, l, h, v = 1152, 4096, 96, 12288, 131072
    f = pr.megatron_model_flops(batch=b, seq_len=s, num_layers=l, hidden=h, ffn_hidden=4 * h,
                                num_heads=96, num_kv_heads=96, vocab=v)
    # Megatron's 2024 expression for MHA, ffn=4h, no SwiGLU: 12·B·s·l·h²·(1 + 1 + s/h + 4 + V/2lh)
    assert f == pytest.approx(12 * b * s * l * h**2 * (6 + s / h + v / (2 * l * h)), rel=1e-12)
    # ... = 72·B·s·l·h²·(1 + s/6h + V/12lh) = 4.92468e18 · 1.064815
    assert f == pytest.approx(4.92468e18 * 1.064815, rel=1e-5)
    # and it is 3/4 of SC21's eq. (3) on the transformer part (no recompute forward)
    assert pr.megatron_model_flops(batch=1, seq_len=s, num_layers=l, hidden=h, ffn_hidden=4 * h,
                                   num_heads=96, num_kv_heads=96, vocab=0) == pytest.approx(
        0.75 * pr.sc21_iteration_flops(batch=1, seq_len=s, num_layers=l, hidden=h, vocab=0))
    run = BY_ID["mlm-h100-177b-n2304"]
    assert run.published_step_time_s == pytest.approx(f / (2304 * 432.8e12), rel=1e-9)
    assert run.published_step_time_s == pytest.approx(5.259, abs=1e-3)


def test_megatron_strong_scaling_mfu_conversion():
    run = BY_ID["mlm-h100-strong-177b-n96"]
    f = pr.megatron_model_flops(batch=1152, seq_len=4096, num_layers=96, hidden=12288,
                                ffn_hidden=49152, num_heads=96, num_kv_heads=96, vocab=131072)
    assert run.published_step_time_s == pytest.approx(f / (96 * 0.47 * 989e12), rel=1e-9)
    end = BY_ID["mlm-h100-strong-177b-n4608"]
    # same batch, 48x the GPUs at 42/47 of the per-GPU rate
    assert run.published_step_time_s / end.published_step_time_s == pytest.approx(48 * 42 / 47)


def test_megatron_mfu_column_is_tflops_over_989():
    for run in RUNS:
        if run.group == "mlm-h100":
            printed = int(re.search(r"MFU (\d+)%", run.notes).group(1))
            assert abs(run.metric_value / pr.MEGATRON_MFU_PEAK_TFLOPS * 100 - printed) <= 0.55


def test_mosaicml_conversion_by_hand():
    # MPT-70b on 64 H100: 2048 sequences x 2048 tokens at 1039 tokens/s/GPU
    run = BY_ID["mpt-h100-70b-s2048-n64"]
    assert run.published_step_time_s == pytest.approx(2048 * 2048 / (64 * 1039), rel=1e-12)
    assert run.published_step_time_s == pytest.approx(63.076, abs=1e-3)
    assert pr.mosaicml_step_time_s(global_batch=16, seq_len=65536, n_gpus=8,
                                   tokens_per_s_per_gpu=1013) == pytest.approx(129.390, abs=1e-3)


def test_mosaicml_mfu_hfu_and_grad_accum_agree_with_the_model(param_counts):
    # MFU = T·(6N + 12·l·h·s) / peak with N our GPT's count (H100 989, A100 312 TFLOP/s);
    # HFU = 4/3·MFU exactly when activation checkpointing is on; grad accum = B/(n·mbs).
    for run in (r for r in RUNS if r.group.startswith("mpt")):
        mfu, hfu = (float(x) for x in re.search(r"MFU ([\d.]+)% HFU ([\d.]+)%", run.notes).groups())
        peak = 989e12 if run.group == "mpt-h100" else 312e12
        per_token = pr.mosaicml_flops_per_token(params=param_counts[run.run_id],
                                                num_layers=run.num_layers, hidden=run.hidden,
                                                seq_len=run.seq_len)
        assert run.metric_value * per_token / peak * 100 == pytest.approx(mfu, abs=0.1), run.run_id
        assert hfu / mfu == pytest.approx(4 / 3 if run.config.recompute == "full" else 1.0,
                                          abs=2e-3), run.run_id
        accum = int(re.search(r"grad accum (\d+)", run.notes).group(1))
        cfg = run.config
        assert run.global_batch_size == accum * cfg.dp * cfg.micro_batch_size, run.run_id


def test_mosaicml_params_are_the_2048_context_count(param_counts):
    # llm-foundry's NumParams includes a learned position table of seq_len rows; the CSV gives
    # the 2048-context count for every MPT row (the 65536-token row says 6.66B where the
    # benchmark table prints 6,918,905,856). Our GPT reproduces the NumParams integers exactly.
    # The CSV prints billions to two decimals, so agreement is to half of 0.01B.
    assert param_counts["mpt-a100-7b-s65536-n8"] == 6_918_905_856
    assert param_counts["mpt-h100-70b-s2048-n64"] == 64_862_437_376
    for run in (r for r in RUNS if r.group.startswith("mpt")):
        at_2048 = param_counts[run.run_id] - (run.seq_len - 2048) * run.hidden
        assert at_2048 == pytest.approx(run.params_billion * 1e9, abs=5e6), run.run_id


def test_sc21_param_counts_follow_eq2(param_counts):
    # eq. (2): P = 12lh²(1 + 13/12h + (V+s)/12lh); our GPT adds the final LayerNorm (2h)
    for run in (r for r in RUNS if r.group.startswith("sc21")):
        l, h = run.num_layers, run.hidden
        eq2 = 12 * l * h * h * (1 + 13 / (12 * h) + (run.vocab_size + run.seq_len) / (12 * l * h))
        assert param_counts[run.run_id] == pytest.approx(eq2 + 2 * h, rel=1e-9)


def test_load_runs_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="published-runs CSV not found"):
        pr.load_runs(tmp_path / "nope.csv")


def test_unknown_metric_is_rejected(tmp_path):
    text = pr.DEFAULT_CSV.read_text().splitlines()
    header, first = text[0], text[1]
    bad = tmp_path / "bad.csv"
    bad.write_text(header + "\n" + first.replace(",tflops_per_gpu,", ",samples_per_s,") + "\n")
    with pytest.raises(ValueError, match="no conversion for metric 'samples_per_s'"):
        pr.load_runs(bad)


# ---------------------------------------------------------------------------------------------
# The held-out rows (benchmarks/data/llm_foundry_a100_heldout.csv): loaded, never estimated here

HELDOUT = pr.load_runs(pr.HELDOUT_CSV)


def _setup_key(run):
    # same model, sequence, GPUs, micro-batch, global batch and hardware (profile): the same
    # measurement; an H100 row of the same shape is a different one
    return (run.model_name, run.seq_len, run.n_gpus, run.config.micro_batch_size,
            run.global_batch_size, run.profile)


def test_heldout_rows_load_disjoint_from_calibration():
    assert len(HELDOUT) >= 30
    calibration = {_setup_key(run) for run in RUNS}
    assert not [run.run_id for run in HELDOUT if _setup_key(run) in calibration]
    assert not {run.run_id for run in HELDOUT} & set(BY_ID)
    assert len({_setup_key(run) for run in HELDOUT}) == len(HELDOUT)


def test_heldout_rows_are_mpt_a100_setups():
    software = pr.SOFTWARE["mpt-a100"][0]
    for run in HELDOUT:
        assert run.group == "mpt-a100", run.run_id
        assert run.assumptions[:len(pr.GROUP_ASSUMPTIONS["mpt-a100"])] == \
            pr.GROUP_ASSUMPTIONS["mpt-a100"]
        assert {k: getattr(run.options(), k) for k in software} == software
        assert run.profile == "dgx-a100-80g" and run.dtype == "bf16" and run.n_gpus == 8
        cfg = run.config
        assert (cfg.dp, cfg.zero_stage, cfg.recompute in ("full", "none")) == (8, 3, True)
        check_config(cfg, world_size=8, global_batch_size=run.global_batch_size,
                     num_layers=run.num_layers, num_heads=run.num_heads,
                     num_kv_heads=run.num_kv_heads, seq_len=run.seq_len)
        assert "held-out" in run.notes


def test_heldout_figures_agree_with_the_model():
    # the README's own figures cross-check each row: NumParams is our GPT's count exactly (a
    # learned position table of seq_len rows), MFU = T·(6N + 12·l·h·s) / 312 TFLOP/s, HFU is
    # 4/3 of it with activation checkpointing, and global batch = grad accum · 8 · micro-batch
    for run in HELDOUT:
        count = sum(p.numel() for p in run.build_model().parameters())
        assert count == int(re.search(r"NumParams column (\d+)", run.notes).group(1)), run.run_id
        at_2048 = count - (run.seq_len - 2048) * run.hidden
        assert at_2048 == pytest.approx(run.params_billion * 1e9, abs=5e6), run.run_id
        mfu, hfu = (float(x) for x in re.search(r"MFU ([\d.]+)% HFU ([\d.]+)%", run.notes).groups())
        per_token = pr.mosaicml_flops_per_token(params=count, num_layers=run.num_layers,
                                                hidden=run.hidden, seq_len=run.seq_len)
        assert run.metric_value * per_token / 312e12 * 100 == pytest.approx(mfu, abs=0.1), \
            run.run_id
        assert hfu / mfu == pytest.approx(4 / 3 if run.config.recompute == "full" else 1.0,
                                          abs=2e-3), run.run_id
        accum = int(re.search(r"grad accum (\d+)", run.notes).group(1))
        assert run.global_batch_size == accum * 8 * run.config.micro_batch_size, run.run_id
