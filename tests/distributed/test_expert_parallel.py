"""Expert parallelism on gloo.

(a) The expert-parallel MoE layer alone, against the reference ``mixtral.MoE`` on the same
global tokens: output, input gradient, router gradient (after the data-parallel mean) and every
expert gradient (after the expert reduction: Σ over replicas / (dp·cp)), within 1e-5.  Ranks
hold different numbers of tokens, and rank 0's tokens all route to ep rank 0's experts, so
all-to-all splits are uneven and some are zero.  Layouts, in one torchrun launch of 4 ranks:
ep=2 over dp=4 (two replicas per expert), ep=4 (one), ep=2 × tp=2 (tp-sharded experts), and
ep=2 over dp=4 under ZeRO-3 (experts FSDP2-sharded over their replicas, divide factor dp·cp).

(b) Whole model: after one training step under a plan (ZeRO-0/1/3, tp, pp, cp with ep), every
gradient each rank holds equals the reference's within 1e-5 (loss parity alone cannot see a
wrong constant factor on a gradient: AdamW normalises it away).

(Plans with ep pinned trained for several steps next to a reference:
tests/distributed/test_runtime_matrix.py.)

Plus single-process checks: MoE placements under tp and ep, kept parameter names, refusals.
This file is also the torchrun worker of (a) and (b): ``test_expert_parallel.py layer OUT_DIR``,
``test_expert_parallel.py grads OUT_DIR PLAN...``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from autopar.plan.sections import PlanMesh

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_parity import TORCHRUN, _run

GRAD_TOL = 1e-5
# (name, dp, tp, ep, zero_stage)
MODULE_LAYOUTS = [("ep2_dp4", 4, 1, 2, 0), ("ep4_dp4", 4, 1, 4, 0), ("ep2_dp2_tp2", 2, 2, 2, 0),
                  ("ep2_dp4_zero3", 4, 1, 2, 3)]
DIM, HIDDEN, EXPERTS, TOP_K = 16, 32, 4, 2


def _reference_moe():
    from autopar.models.mixtral import MoE

    torch.manual_seed(7)
    moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K)
    with torch.no_grad():  # experts 0, 1 like direction u, experts 2, 3 dislike it
        u = torch.nn.functional.normalize(torch.randn(DIM), dim=0)
        for e, scale in enumerate((4.0, 3.5, -4.0, -3.5)):
            moe.router.weight[e] += scale * u
    return moe, u


def _tokens(num_ranks: int, u: torch.Tensor) -> list[torch.Tensor]:
    """Tokens per data rank: 5 + 3·r of them; rank 0's all point along u (experts 0 and 1)."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for r in range(num_ranks):
        x = torch.randn(5 + 3 * r, DIM, generator=gen)
        if r == 0:
            x = 0.1 * x + 3.0 * u
        out.append(x)
    return out


def _module_layout(name: str, dp: int, tp: int, ep: int, zero: int) -> dict[str, float]:
    """Run one layout on this rank; returns {quantity: max abs error vs the reference}."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.expert_parallel import (
        apply_expert_parallel,
        expert_groups,
        shard_expert_params,
        sync_expert_gradients,
    )

    mesh = init_device_mesh("cpu", (1, dp, 1, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    data_rank = mesh["dp"].get_local_rank()
    moe, u = _reference_moe()
    tokens = _tokens(dp, u)
    n_total = sum(len(t) for t in tokens)
    weights = torch.randn(n_total, DIM, generator=torch.Generator().manual_seed(3))

    # reference: one process, all tokens, loss = Σ(out · weights) / n_total
    ref = copy.deepcopy(moe)
    x_all = torch.cat(tokens).requires_grad_(True)
    out_ref = ref(x_all)
    (out_ref * weights).sum().div(n_total).backward()

    # expert parallel: rank-local tokens, local loss scaled so that (1/D)·Σ_r L_r = reference
    placements = {}
    for e in range(EXPERTS):
        for lin, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
            placements[f"moe.experts.{e}.{lin}.weight"] = {"tp": f"S({dim})" if tp > 1 else "R",
                                                           "ep": "S(0)"}
    plan = SimpleNamespace(
        config=SimpleNamespace(ep=ep, zero_stage=zero, pp=1, pp_schedule="1f1b"),
        mesh=PlanMesh(axes=("pp", "dp", "cp", "tp"), sizes=(1, dp, 1, tp), ep=ep),
        placements=placements, training=SimpleNamespace(dtype="fp32"))
    holder = torch.nn.Module()
    holder.moe = copy.deepcopy(moe)
    groups = expert_groups(mesh, plan)
    apply_expert_parallel([holder], plan, groups)
    shard_expert_params(holder, plan, groups)
    lo = sum(len(t) for t in tokens[:data_rank])
    mine = slice(lo, lo + len(tokens[data_rank]))
    x = tokens[data_rank].clone().requires_grad_(True)
    out = holder.moe(x)
    (out * weights[mine]).sum().mul(dp / n_total).backward()
    router_grad = holder.moe.router.weight.grad.clone()  # the dense data-parallel mean
    dist.all_reduce(router_grad, group=mesh["dp"].get_group())
    router_grad /= dp
    sync_expert_gradients([holder])

    first = ref.router(tokens[0]).topk(TOP_K).indices
    assert int(first.max()) < EXPERTS // 2, "rank 0's tokens must all route to experts 0 and 1"
    out, out_ref = out.detach(), out_ref.detach()
    errors = {"output": float((out - out_ref[mine]).abs().max()),
              "input_grad": float((x.grad / dp - x_all.grad[mine]).abs().max()),
              "router_grad": float((router_grad - ref.router.weight.grad).abs().max())}
    worst = 0.0
    for key, expert in holder.moe.experts.items():
        for pname, p in expert.named_parameters():
            got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            want = ref.experts[int(key)].get_parameter(pname).grad
            worst = max(worst, float((got - want).abs().max()))
    errors["expert_grads"] = worst
    errors["experts_held"] = float(len(holder.moe.experts))
    return errors


def _layer_worker(out_dir: str) -> None:
    from autopar import runtime

    rank, _, _ = runtime.init_distributed(timeout_s=60)
    torch.set_num_threads(1)
    results = {name: _module_layout(name, dp, tp, ep, zero)
               for name, dp, tp, ep, zero in MODULE_LAYOUTS}
    Path(out_dir, f"module.{rank}.json").write_text(json.dumps(results))
    runtime.shutdown()


def _grads_worker(out_dir: str, plan_paths: list[str]) -> None:
    """One training step of tiny_mixtral under each saved plan; every rank saves the full
    gradient of each parameter it holds (dense ones first, then experts, so that the gathers
    over different groups run in the same order everywhere)."""
    import tiny_models

    from autopar import runtime
    from autopar.plan import load_plan
    from autopar.runtime.train import vocab_size

    rank, _, device = runtime.init_distributed(timeout_s=60)
    torch.set_num_threads(1)
    for path in plan_paths:
        model = tiny_models.tiny_mixtral()
        plan = load_plan(path, model=model)
        rt = runtime.apply_plan(model, plan, device=device)
        x, y = runtime.synthetic_batch(1, 0, plan.training.global_batch_size,
                                       plan.training.seq_len, vocab_size(model))
        rt.train_step(x, y)
        named = [(n, p) for m in rt.modules for n, p in m.named_parameters()]
        named.sort(key=lambda item: ".experts." in item[0])
        grads = {}
        for name, p in named:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.removeprefix("module.")] = g.detach().cpu()
        torch.save(grads, Path(out_dir, f"{Path(path).stem}.{rank}.pt"))
    runtime.shutdown()


# ----------------------------------------------------------------------------------- tests


def test_expert_parallel_layer_matches_reference(tmp_path):
    res = _run([TORCHRUN, "--standalone", "--nproc_per_node=4", str(Path(__file__)), "layer",
                str(tmp_path)], timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    failures = []
    for rank in range(4):
        got = json.loads((tmp_path / f"module.{rank}.json").read_text())
        for name, _dp, _tp, ep, _zero in MODULE_LAYOUTS:
            errs = got[name]
            print(f"{name} rank {rank}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()
                                                      if k != "experts_held"))
            assert errs.pop("experts_held") == EXPERTS // ep
            failures += [f"{name} rank {rank} {k}: {v:.2e}" for k, v in errs.items()
                         if v > GRAD_TOL]
    assert not failures, "\n".join(failures)


def test_moe_placements_and_kept_expert_names():
    """Plans replicate the router on tp and ep, shard each expert column→row on tp and split the
    experts list over ep; the expert-parallel layer keeps the reference parameter names."""
    import tiny_models

    import autopar
    from autopar.runtime.expert_parallel import ExpertGroups, ExpertParallelMoE

    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=4)
    plan = autopar.compile(tiny_models.tiny_mixtral(), cluster, global_batch_size=8, seq_len=64,
                           dtype="fp32", constraints={"dp": 2, "ep": 2, "tp": 2})
    ff = "layers.1.feed_forward"
    assert plan.placements[f"{ff}.router.weight"] == {"dp": "R", "tp": "R", "ep": "R"}
    for e in range(4):
        for lin, tp in (("w1", "S(0)"), ("w3", "S(0)"), ("w2", "S(1)")):
            assert plan.placements[f"{ff}.experts.{e}.{lin}.weight"]["tp"] == tp
            assert plan.placements[f"{ff}.experts.{e}.{lin}.weight"]["ep"] == "S(0)"

    model = tiny_models.tiny_mixtral()
    groups = ExpertGroups(ep=2, ep_rank=1, ep_group=None, replica_mesh=None, num_replicas=1,
                          dp_cp=2, tp=1, tp_rank=0, tp_mesh=None)
    full = dict(model.named_parameters())
    model.layers[1].feed_forward = ExpertParallelMoE(model.layers[1].feed_forward, groups,
                                                     renormalize=True, tp_sharded=False)
    kept = {k for k in dict(model.named_parameters()) if k.startswith(ff)}
    assert kept == {f"{ff}.router.weight"} | {f"{ff}.experts.{e}.{w}.weight"
                                               for e in (2, 3) for w in ("w1", "w2", "w3")}
    assert all(model.get_parameter(k) is full[k] for k in kept)


def test_routing_other_than_softmax_top_k_is_refused():
    from autopar.models.mixtral import MoE
    from autopar.runtime.expert_parallel import _routing_kind, check_expert_parallel

    class SigmoidMoE(MoE):
        def forward(self, x):
            flat = x.reshape(-1, x.shape[-1])
            weights, chosen = torch.sigmoid(self.router(flat)).topk(self.top_k, dim=-1)
            out = torch.zeros_like(flat)
            for e, expert in enumerate(self.experts):
                token, slot = torch.where(chosen == e)
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
            return out.view_as(x)

    class PlainTopK(MoE):  # softmax top-k without renormalised gates
        def forward(self, x):
            flat = x.reshape(-1, x.shape[-1])
            weights, chosen = torch.softmax(self.router(flat), -1).topk(self.top_k, dim=-1)
            out = torch.zeros_like(flat)
            for e, expert in enumerate(self.experts):
                token, slot = torch.where(chosen == e)
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
            return out.view_as(x)

    torch.manual_seed(0)
    assert _routing_kind(MoE(DIM, HIDDEN, EXPERTS, TOP_K), "moe") is True
    assert _routing_kind(PlainTopK(DIM, HIDDEN, EXPERTS, TOP_K), "moe") is False
    with pytest.raises(ValueError, match="not softmax"):
        _routing_kind(SigmoidMoE(DIM, HIDDEN, EXPERTS, TOP_K), "moe")
    plan = SimpleNamespace(config=SimpleNamespace(ep=2),
                           mesh=PlanMesh(axes=("pp", "dp", "cp", "tp"), sizes=(1, 2, 1, 1)))
    with pytest.raises(ValueError, match="no MoE layer"):
        check_expert_parallel(torch.nn.Linear(4, 4), plan)
    holder = torch.nn.Module()
    holder.moe = MoE(DIM, HIDDEN, 3, TOP_K)
    with pytest.raises(ValueError, match="3 experts"):
        check_expert_parallel(holder, plan)


# 4-rank plans whose gradients after one step are compared with the reference's
GRAD_PLANS = [
    ("g_ep2_dp4_zero3", {"dp": 4, "ep": 2, "zero_stage": 3}),
    ("g_ep4_dp4_zero1", {"dp": 4, "ep": 4, "zero_stage": 1}),
    ("g_ep2_tp2_dp2", {"dp": 2, "ep": 2, "tp": 2, "zero_stage": 0, "sequence_parallel": False}),
    ("g_ep2_pp2_dp2_zero2", {"dp": 2, "ep": 2, "pp": 2, "zero_stage": 2, "pp_schedule": "1f1b",
                             "micro_batch_size": 2}),
    ("g_ep4_cp2_dp2", {"dp": 2, "cp": 2, "ep": 4, "zero_stage": 0}),  # ep groups span cp
]


def test_expert_parallel_gradients_match_reference(tmp_path):
    """After one training step under each plan, every gradient each rank holds (dense and
    expert, gathered from FSDP / tp shards) equals the single-process reference's.  This
    checks what loss parity cannot: AdamW is blind to a constant factor on a gradient."""
    import tiny_models

    import autopar
    from autopar.runtime import lm_loss, synthetic_batch

    cluster = autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=4)
    paths = []
    for name, constraints in GRAD_PLANS:
        plan = autopar.compile(tiny_models.tiny_mixtral(), cluster, global_batch_size=8,
                               seq_len=64, dtype="fp32", constraints=constraints)
        paths.append(str(plan.save(tmp_path / f"{name}.json")))
    res = _run([TORCHRUN, "--standalone", "--nproc_per_node=4", str(Path(__file__)), "grads",
                str(tmp_path), *paths], timeout=150)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    model = tiny_models.tiny_mixtral()
    x, y = synthetic_batch(1, 0, 8, 64, 128)
    lm_loss(model(x), y).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    failures = []
    for name, _ in GRAD_PLANS:
        seen, worst = set(), 0.0
        for rank in range(4):
            for fqn, g in torch.load(tmp_path / f"{name}.{rank}.pt").items():
                seen.add(fqn)
                worst = max(worst, float((g - want[fqn]).abs().max()))
        print(f"{name}: max abs gradient difference {worst:.1e} over {len(seen)} parameters")
        if seen != set(want) or worst > GRAD_TOL:
            failures.append(f"{name}: {worst:.2e}, missing {sorted(set(want) - seen)[:3]}")
    assert not failures, "\n".join(failures)


if __name__ == "__main__":
    if sys.argv[1] == "layer":
        _layer_worker(sys.argv[2])
    else:
        _grads_worker(sys.argv[2], sys.argv[3:])
