"""Context parallelism (``autopar.runtime.context_parallel``): the zigzag layout and causal block
masks (one process), ring attention against full-sequence SDPA on 4 gloo ranks (cp = 4 on the
default group, cp = 2 on the ``cp`` axis of a (2, 2) mesh; with grouped-query attention), the
models' sequence-shard hook, and one-step gradients of compiled cp plans under torchrun (their
losses over several steps: tests/distributed/test_runtime_matrix.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autopar.models.common import sequence_shard, token_positions
from autopar.runtime.context_parallel import (
    block_kind,
    block_mask,
    zigzag_chunks,
    zigzag_merge,
    zigzag_positions,
    zigzag_split,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_models
from test_parity import TORCHRUN, _run

# ------------------------------------------------------------------ pure pieces, one process


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_split_and_merge_are_inverse(cp):
    seq = 4 * cp
    x = torch.arange(2 * seq).view(2, seq)
    parts = [zigzag_split(x, r, cp) for r in range(cp)]
    assert all(p.shape == (2, seq // cp) for p in parts)
    torch.testing.assert_close(zigzag_merge(parts), x)
    for r, part in enumerate(parts):  # the positions are those of the tokens the rank holds
        torch.testing.assert_close(part[0], zigzag_positions(seq, r, cp))
    covered = torch.cat([zigzag_positions(seq, r, cp) for r in range(cp)]).sort().values
    torch.testing.assert_close(covered, torch.arange(seq))


def test_zigzag_layout_and_errors():
    assert [zigzag_chunks(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    torch.testing.assert_close(zigzag_positions(8, 1, 2), torch.tensor([2, 3, 4, 5]))
    with pytest.raises(ValueError, match="not divisible by 4"):
        zigzag_positions(10, 0, 2)
    with pytest.raises(ValueError, match="outside"):
        zigzag_chunks(2, 2)
    x = torch.zeros(1, 3, 8)  # another sequence dim
    assert zigzag_split(x, 0, 2, dim=2).shape == (1, 3, 4)


def test_block_kinds_and_masks():
    assert block_kind(8, 4, 12, 4) == "skip"
    assert block_kind(8, 4, 0, 4) == "full"
    assert block_kind(8, 4, 4, 5) == "full"  # last key at the first query: still all visible
    assert block_kind(8, 4, 8, 4) == "partial"
    assert block_kind(8, 4, 11, 4) == "partial"
    torch.testing.assert_close(block_mask(4, 4, 4, 4), torch.ones(4, 4, dtype=torch.bool).tril())
    assert block_mask(8, 4, 0, 4).all() and not block_mask(8, 4, 12, 4).any()


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_balances_causal_work(cp):
    """Every rank attends over the same number of (query, key) pairs, and every ring step
    after the first computes exactly two full chunk blocks on every rank."""
    c = 4
    pairs = []
    for r in range(cp):
        pos = zigzag_positions(2 * cp * c, r, cp)
        pairs.append(int((pos[:, None] >= torch.arange(2 * cp * c)[None, :]).sum()))
        for i in range(1, cp):
            src = (r - i) % cp
            kinds = [block_kind(q * c, c, k * c, c)
                     for q in zigzag_chunks(r, cp) for k in zigzag_chunks(src, cp)]
            assert sorted(kinds) == ["full", "full", "skip", "skip"], (r, i, kinds)
    assert len(set(pairs)) == 1, pairs


class _FakeShard:
    """A sequence shard that runs full attention on its tokens and reports fixed positions."""

    def __init__(self, positions):
        self.pos, self.calls = positions, 0

    def positions(self, local_len, device):
        assert local_len == len(self.pos)
        return self.pos.to(device)

    def attention(self, q, k, v):
        self.calls += 1
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=k.shape[1] != q.shape[1])


def test_models_follow_the_sequence_shard_hook():
    """Under a shard whose positions are 0..S-1 and whose attention is SDPA, the models compute
    exactly what they compute without it; the positions reach RoPE / the position embedding."""
    from autopar.models.gpt import GPT, GPTConfig

    llama = tiny_models.tiny_llama()
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=128, max_seq_len=32, dim=32, n_layers=1, n_heads=4))
    tokens = torch.randint(0, 128, (2, 16))
    for model in (llama, gpt):
        plain = model(tokens)
        shard = _FakeShard(torch.arange(16))
        with sequence_shard(shard):
            hooked = model(tokens)
            assert token_positions(16, "cpu").tolist() == list(range(16))
        assert shard.calls == len(model.layers)
        torch.testing.assert_close(hooked, plain, rtol=0, atol=0)
        shifted = _FakeShard(torch.arange(16) + 8)  # other positions: other output
        with sequence_shard(shifted):
            assert not torch.allclose(model(tokens), plain)
    assert token_positions(5, "cpu").tolist() == list(range(5))  # hook restored on exit


def test_attention_dropout_is_refused_under_a_shard():
    from autopar.models.common import AttentionImpl, attention

    q = torch.zeros(1, 2, 4, 8)
    with sequence_shard(_FakeShard(torch.arange(4))), \
            pytest.raises(NotImplementedError, match="dropout"):
        attention(q, q, q, impl=AttentionImpl.SDPA, dropout=0.1, training=True)


# ------------------------------------------------------------------ ring attention, 4 ranks


def test_ring_attention_matches_sdpa(tmp_path):
    res = _run([TORCHRUN, "--standalone", "--nproc_per_node=4", str(HERE / "cp_ring_worker.py"),
                str(tmp_path)], timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    worst: dict[str, float] = {}
    for rank in range(4):
        for case, errors in json.loads((tmp_path / f"ring.{rank}.json").read_text()).items():
            worst[case] = max(worst.get(case, 0.0), *errors.values())
    # 3 shapes (MHA, GQA 2:1, GQA 3:1) x (cp4 world in 5 layouts and masks, cp2 sub-mesh)
    assert len(worst) == 18, worst
    print("ring attention max abs error (out, dq, dk, dv):",
          ", ".join(f"{k}: {v:.1e}" for k, v in worst.items()))
    assert max(worst.values()) <= 1e-5, worst


# (id, factory, constraints): 4-rank cp plans whose one-step gradients are checked
GRAD_PLANS = [
    ("cp4_ddp", "tiny_llama", {"cp": 4, "zero_stage": 0}),
    ("dp2_cp2_zero3", "tiny_llama", {"dp": 2, "cp": 2, "zero_stage": 3}),
    ("cp2_tp2_sp", "tiny_llama_wide", {"cp": 2, "tp": 2, "sequence_parallel": True}),
    ("cp2_pp2", "tiny_llama", {"cp": 2, "pp": 2, "pp_schedule": "1f1b", "micro_batch_size": 2}),
    ("gpt_dp2_cp2_zero2_recompute", "tiny_gpt", {"dp": 2, "cp": 2, "zero_stage": 2,
                                                 "recompute": "full"}),
]


def test_context_parallel_gradients(tmp_path):
    """Loss and every gradient after one step equal the one-process reference, for cp alone
    (DDP over cp), with dp and ZeRO-3 (FSDP over dp × cp), with tp + sequence parallel, with a
    1F1B pipeline, and GPT (learned positions) with ZeRO-2 and full recompute (one shared
    4-rank launch); and a model that computes attention
    itself, not through the hook, is stopped after its first step instead of training wrong."""
    import autopar

    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=4)
    specs = []
    for name, factory, constraints in GRAD_PLANS:
        plan = autopar.compile(getattr(tiny_models, factory)(), cluster, global_batch_size=8,
                               seq_len=64, dtype="fp32", constraints=constraints)
        for key, value in constraints.items():
            assert getattr(plan.config, key) == value, (key, plan.config)
        specs.append(f"{plan.save(tmp_path / f'{name}.json')}:{factory}")
    refuse = specs[0].replace(".json:", "_refused.json:")  # the cp4 plan, own attention
    Path(refuse.split(":")[0]).write_text(Path(specs[0].split(":")[0]).read_text())
    res = _run([TORCHRUN, "--standalone", "--nproc_per_node=4", str(HERE / "grad_worker.py"),
                str(tmp_path), *specs, f"refuse:{refuse}"], timeout=150)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for name, _, _ in GRAD_PLANS:
        got = [json.loads((tmp_path / f"{name}.{r}.json").read_text()) for r in range(4)]
        loss_err = max(g["loss_err"] for g in got)
        grad_err = max(g["grad_err"] for g in got)
        print(f"{name}: loss error {loss_err:.1e}, max grad error {grad_err:.1e} "
              f"(max |grad| {got[0]['grad_max']:.1e}, {sum(g['n_grads'] for g in got)} grads)")
        assert loss_err <= 1e-5 and grad_err <= 1e-5, (name, got)
    for r in range(4):  # a model whose attention bypasses the hook is stopped, on every rank
        error = json.loads((tmp_path / f"cp4_ddp_refused.{r}.json").read_text())["error"]
        assert "no attention of this model went through" in error, error
