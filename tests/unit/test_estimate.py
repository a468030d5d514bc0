"""`autopar.estimate` term by term against closed forms, and the properties issue 4 names.

Closed forms: Megatron's tensor-parallel communication (two all-reduces of the hidden state per
transformer layer forward and two backward, the vocab-parallel embedding's forward and head's
backward, the parallel loss's reductions),
the data-parallel gradient all-reduce of every local parameter, the ZeRO paper's state bytes
(16 per parameter, sharded by stage), MFU as 3 x forward FLOPs over peak, and the pipeline
makespan of uniform stages.
"""

import dataclasses
import functools

import pytest
import torch

import autopar
import costmodels.compute
from autopar import ParallelConfig
from autopar.estimate import EstimateOptions, estimate
from autopar.models.gpt import GPT, GPTConfig

DIM, LAYERS, HEADS, VOCAB, SEQ = 512, 4, 8, 4096, 512


@functools.lru_cache(maxsize=None)
def graph(mbs: int):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, dim=DIM, n_layers=LAYERS,
                              n_heads=HEADS))
    return autopar.trace(model, global_batch_size=mbs, seq_len=SEQ, dtype="bf16")


def run(nodes=1, gbs=16, profile="dgx-h100", options=EstimateOptions(), gpus=8, **cfg):
    cluster = autopar.Cluster.from_profile(profile, num_nodes=nodes, gpus_per_node=gpus)
    config = ParallelConfig(**cfg)
    return cluster, estimate(graph(config.micro_batch_size), cluster, config,
                             global_batch_size=gbs, options=options)


def test_tp_communication_is_megatrons_four_all_reduces_per_layer():
    cluster, est = run(dp=1, tp=8, micro_batch_size=2)
    act = 2 * SEQ * DIM * 2  # micro-batch x seq x hidden, bf16
    t = functools.partial(cluster.collective_time, ranks=range(8))
    # forward: two per layer and the vocab-parallel embedding's output, and the parallel
    # loss's max, sum and target logit (fp32 per token); backward: two per layer and the
    # vocab-parallel head's input gradient
    loss = 3 * t("all_reduce", 2 * SEQ * 4)
    per_mb = 2 * (2 * LAYERS + 1) * t("all_reduce", act) + loss
    assert est.breakdown["tp_comm"] == pytest.approx(est.num_microbatches * per_mb)
    _, sp = run(dp=1, tp=8, micro_batch_size=2, sequence_parallel=True)
    per_mb_sp = 2 * (2 * LAYERS + 1) * (t("all_gather", act) + t("reduce_scatter", act)) + loss
    # once a step, the gradients of the norms on the sequence-sharded stream (two per layer
    # and the final one, weight and bias) and of the position table, in one all-reduce
    stream = (2 * LAYERS + 1) * 2 * DIM + SEQ * DIM
    assert sp.breakdown["tp_comm"] == pytest.approx(sp.num_microbatches * per_mb_sp
                                                    + t("all_reduce", 2 * stream))


def test_dp_gradient_all_reduce_moves_every_parameter_in_fp32():
    cluster, est = run(dp=8, micro_batch_size=1)
    params = graph(1).num_params
    expected = cluster.collective_time("all_reduce", 4 * params, range(8))
    assert est.breakdown["dp_comm_total"] == pytest.approx(expected)
    # overlap: only what the last micro-batch's backward cannot hide is exposed
    _, no_overlap = run(dp=8, micro_batch_size=1, options=EstimateOptions(overlap_dp_comm=False))
    assert no_overlap.breakdown["dp_comm"] == pytest.approx(expected)
    assert est.breakdown["dp_comm"] <= no_overlap.breakdown["dp_comm"]


@pytest.mark.parametrize("zero,bytes_per_param", [(0, 16.0), (1, 4 + 12 / 8), (2, 2 + 14 / 8),
                                                  (3, 16 / 8)])
def test_model_states_follow_the_zero_paper(zero, bytes_per_param):
    _, est = run(dp=8, zero_stage=zero)
    states = est.memory_by_stage[0]["states"]
    assert states == pytest.approx(bytes_per_param * graph(1).num_params)


def test_mfu_is_three_forward_passes_over_dense_peak():
    cluster, est = run(dp=8, micro_batch_size=2)
    flops = 3 * graph(2).flops_fwd * (16 / 2)
    peak = cluster.hardware.device.peak_flops["bf16"]
    assert est.mfu == pytest.approx(flops / (est.step_time_s * 8 * peak))
    assert est.model_tflops_per_gpu == pytest.approx(flops / (est.step_time_s * 8) / 1e12)
    assert est.tokens_per_s == pytest.approx(16 * SEQ / est.step_time_s)


def test_breakdown_sums_to_step_time_and_stages_cover_the_model():
    _, est = run(dp=2, tp=2, pp=2, micro_batch_size=1, pp_schedule="1f1b")
    parts = {k: v for k, v in est.breakdown.items() if k not in ("dp_comm_total",
                                                                 "pp_p2p_per_transfer")}
    assert sum(parts.values()) == pytest.approx(est.step_time_s)
    layers = [f for stage in est.stage_layers for f in stage]
    assert layers[1:-1] == [f"layers.{i}" for i in range(LAYERS)]
    assert len(est.stage_layers) == 2


def test_zero3_uses_less_memory_than_zero1_than_zero0():
    mem = {z: run(dp=8, zero_stage=z)[1].memory_by_stage[0]["states"] for z in (0, 1, 3)}
    assert mem[3] < mem[1] < mem[0]


def test_full_recompute_uses_least_activation_memory_and_most_time():
    ests = {rc: run(dp=8, micro_batch_size=2, recompute=rc, gbs=16,
                    options=EstimateOptions(attention_kernel="math"))[1]
            for rc in ("none", "selective", "full")}
    acts = {rc: e.memory_by_stage[0]["activations"] for rc, e in ests.items()}
    times = {rc: e.step_time_s for rc, e in ests.items()}
    assert acts["full"] < acts["selective"] < acts["none"]
    assert times["full"] > times["selective"] > times["none"]


def test_more_dp_ranks_at_fixed_global_batch_never_raise_compute_per_rank():
    previous = None
    for dp in (1, 2, 4, 8):
        _, est = run(dp=dp, gbs=16, gpus=dp)
        compute = est.breakdown["compute"]
        if previous is not None:
            assert compute <= previous * (1 + 1e-12)
        previous = compute


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_bubble_shrinks_like_p_minus_1_over_m(schedule):
    # uniform-ish stages: the bubble share of the step falls as (p-1)/(m+p-1) with more
    # micro-batches; bubble and step come from the simulated schedule
    shares = []
    for gbs in (8, 32, 128):  # m = 4, 16, 64: at least a micro-batch per pipeline rank
        _, est = run(dp=2, pp=4, gbs=gbs, pp_schedule=schedule)
        shares.append(est.breakdown["bubble"] / est.step_time_s)
        m, p = est.num_microbatches, 4
        assert shares[-1] >= 0.5 * (p - 1) / (m + p - 1)
    assert shares[0] > shares[1] > shares[2]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fewer_micro_batches_than_pipeline_ranks_pay_the_larger_bubble(schedule):
    """m = 2 micro-batches on pp = 4 ranks (Megatron-LM and DeepSpeed run it; GPipe in any
    runtime): every rank idles (p - 1) of the m + p - 1 slots of its pipelined work, a larger
    share of the step than with m = p."""
    _, few = run(dp=2, pp=4, gbs=16, micro_batch_size=4, pp_schedule=schedule)
    _, enough = run(dp=2, pp=4, gbs=16, micro_batch_size=2, pp_schedule=schedule)
    assert (few.num_microbatches, enough.num_microbatches) == (2, 4)
    m, p = 2, 4
    assert few.breakdown["bubble"] / few.step_time_s >= 0.5 * (p - 1) / (m + p - 1)
    assert few.breakdown["bubble"] / few.step_time_s > \
        enough.breakdown["bubble"] / enough.step_time_s


@pytest.mark.parametrize("cfg,match", [
    (dict(dp=4), r"dp\*tp\*pp\*cp = 4\*1\*1\*1 = 4, but the cluster has 8 GPUs; dp=8"),
    (dict(dp=2, tp=4, micro_batch_size=3), "not a multiple of dp\\*micro_batch_size"),
    (dict(dp=1, tp=8, ep=2), "ep=2 must divide dp\\*cp = 1"),
    (dict(dp=8, ep=2), "needs a model with experts"),
    (dict(dp=1, pp=8), "8 pipeline stages for 4 layers|pp\\*virtual_stages = 8 stages"),
    (dict(dp=2, pp=4, micro_batch_size=4, pp_schedule="zero-bubble"),
     r"pp_schedule=zero-bubble with pp=4 needs at least 4 micro-batches per step, one per "
     r"pipeline rank; .* = 16 / \(2\*4\) = 2: lower .* or use gpipe or 1f1b"),
])
def test_bad_configs_say_what_is_wrong_and_what_would_work(cfg, match):
    with pytest.raises(ValueError, match=match):
        run(**cfg)


def test_tp_must_divide_heads():
    with pytest.raises(ValueError, match=r"tp=16 must divide the 8 attention heads; allowed tp"):
        run(nodes=2, dp=1, tp=16)


def test_zero3_gather_buffers_are_two_blocks_or_the_live_parameter_cap():
    _, fsdp = run(dp=8, zero_stage=3)
    block = 12 * DIM * DIM + 13 * DIM  # one GPT block's parameters
    assert fsdp.memory_by_stage[0]["zero3_buffers"] >= 2 * block * 2
    _, capped = run(dp=8, zero_stage=3, options=EstimateOptions(zero3_max_live_params=1000))
    assert capped.memory_by_stage[0]["zero3_buffers"] == pytest.approx(1000 * 2)


def _sync_gather_s(cluster, tensors):
    from costmodels.collectives import ZERO3_SYNC_GATHER_BYTES_PER_S

    return sum(cluster.collective_time("all_gather", 2 * n, range(8))
               + 2 * n / ZERO3_SYNC_GATHER_BYTES_PER_S for n in tensors)


# per GPT block qkv, proj, fc1, fc2 (weight and bias together); LayerNorms stay whole (< 1e5)
_BLOCK_TENSORS = [3 * DIM * DIM + 3 * DIM, DIM * DIM + DIM, 4 * DIM * DIM + 4 * DIM,
                  4 * DIM * DIM + DIM]


def test_deepspeed_2021_zero3_gathers_every_tensor_synchronously_in_each_pass():
    # no reuse: every use gathers. Token and position embeddings; the tied head gathers the
    # token embedding again
    sync = EstimateOptions(zero3_gather="sync", zero3_max_reuse_distance=-1)
    cluster, plain = run(dp=8, zero_stage=3, options=sync)
    _, full = run(dp=8, zero_stage=3, recompute="full", options=sync)
    per_pass = _sync_gather_s(cluster, LAYERS * _BLOCK_TENSORS + [VOCAB * DIM, SEQ * DIM,
                                                                   VOCAB * DIM])
    m = plain.num_microbatches
    # full recompute adds one pass over the blocks (the glue is not recomputed); the forward
    # and backward passes are never hidden
    assert full.breakdown["dp_comm_total"] - plain.breakdown["dp_comm_total"] == \
        pytest.approx(m * _sync_gather_s(cluster, LAYERS * _BLOCK_TENSORS))
    assert plain.breakdown["dp_comm"] >= 2 * m * per_pass * (1 - 1e-9)
    _, prefetch = run(dp=8, zero_stage=3)
    assert plain.breakdown["dp_comm"] > prefetch.breakdown["dp_comm"]
    assert plain.peak_memory_bytes == prefetch.peak_memory_bytes


def test_deepspeed_zero3_keeps_tensors_reused_within_the_reuse_distance():
    def total(distance, **cfg):
        options = EstimateOptions(zero3_gather="sync", zero3_max_reuse_distance=distance)
        return run(dp=8, zero_stage=3, options=options, **cfg)

    cluster, plain = total(1)
    _, full = total(1, recompute="full")
    m = plain.num_microbatches
    # distance 1 keeps only back-to-back uses: each block's fc2 from its recompute to its
    # backward (nothing runs between) and the head from its forward to its backward, so
    # recompute adds qkv, proj and fc1 of every block and nothing else
    assert full.breakdown["dp_comm_total"] - plain.breakdown["dp_comm_total"] == \
        pytest.approx(m * _sync_gather_s(cluster, LAYERS * _BLOCK_TENSORS[:3]))
    # the default (1e9 elements) exceeds this 15M-parameter model: each tensor use is kept
    # until its next one, so the step gathers every tensor once per micro-batch
    once = m * _sync_gather_s(cluster, LAYERS * _BLOCK_TENSORS + [VOCAB * DIM, SEQ * DIM,
                                                                   VOCAB * DIM])
    # (without reuse: twice, and the blocks a third time under full recompute)
    blocks = m * _sync_gather_s(cluster, LAYERS * _BLOCK_TENSORS)
    for cfg, extra in (({}, once), ({"recompute": "full"}, once + blocks)):
        kept = total(10**9, **cfg)[1].breakdown["dp_comm_total"]
        assert total(-1, **cfg)[1].breakdown["dp_comm_total"] - kept == pytest.approx(extra)


def test_cp_ring_is_timed_by_its_slowest_link(monkeypatch):
    # 16 ranks of context parallelism on 2 nodes: the ring's cross-node hop sets its pace
    # (exposed where the ring outlasts the attention it overlaps: this small model's calls
    # are taken at their work alone, without the per-call floor that would hide it)
    from autopar.estimate.groups import rank_groups

    monkeypatch.setattr(costmodels.compute, "ATTENTION_CALL_FLOOR_S", {"fwd": 0.0, "bwd": 0.0})

    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=2)
    groups = rank_groups(ParallelConfig(cp=16))
    inside = cluster.collective_time("send_recv", 2**21, groups.cp[:2])
    across = cluster.collective_time("send_recv", 2**21, (groups.cp[-1], groups.cp[0]))
    assert across > inside
    one_node = run(cp=8, gbs=16)[1].breakdown["cp_comm"]
    two_nodes = run(nodes=2, cp=16, gbs=16)[1].breakdown["cp_comm"]
    assert two_nodes > one_node


def _every_ranks_groups(cfg: ParallelConfig, world: int) -> dict[str, set[tuple[int, ...]]]:
    """The oracle: each rank's groups from its mesh coordinates, rank = ((p dp + d) cp + c) tp
    + t; dp lists the dp x cp replicas (d, c) in order, ep takes blocks of ep of them."""
    tp, cp, dp, ep = cfg.tp, cfg.cp, cfg.dp, cfg.ep
    stage = tp * cp * dp
    out: dict[str, set] = {"tp": set(), "cp": set(), "dp": set(), "ep": set(), "pp": set()}
    for r in range(world):
        p, rest = divmod(r, stage)
        d, rest = divmod(rest, cp * tp)
        c, t = divmod(rest, tp)
        base = p * stage
        out["tp"].add(tuple(base + (d * cp + c) * tp + u for u in range(tp)))
        out["cp"].add(tuple(base + (d * cp + k) * tp + t for k in range(cp)))
        replicas = [base + j * tp + t for j in range(dp * cp)]
        out["dp"].add(tuple(replicas))
        block = (d * cp + c) // ep
        out["ep"].add(tuple(replicas[block * ep:(block + 1) * ep]))
        if r + stage < world:
            out["pp"].add((r, r + stage))
    return out


@pytest.mark.parametrize("gpus,nodes,degrees", [
    (8, 3, dict(tp=3, dp=8)), (8, 3, dict(tp=6, dp=4)), (6, 2, dict(tp=4, dp=3)),
    (8, 3, dict(tp=2, cp=3, dp=4)), (8, 3, dict(tp=2, dp=12, ep=3)),
    (8, 3, dict(cp=2, dp=12, ep=3)), (8, 6, dict(tp=2, cp=2, dp=3, ep=6, pp=4)),
    (8, 2, dict(pp=4, dp=4)), (8, 3, dict(pp=8, dp=3)), (8, 3, dict(tp=3, pp=2, dp=4)),
    (8, 2, dict(tp=4, dp=4)), (8, 4, dict(tp=2, cp=2, dp=2, pp=4)), (8, 2, dict(tp=2, cp=8)),
])
def test_estimate_costs_each_axis_on_its_slowest_group(gpus, nodes, degrees):
    # a step runs at its slowest rank's pace: where some groups of an axis straddle nodes
    # (tp = 3 on 8-GPU nodes), the estimate's group is as slow as the slowest of any rank's
    from autopar.estimate.groups import _PROBES, rank_groups, slowest_groups

    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=nodes, gpus_per_node=gpus)
    cfg = ParallelConfig(**degrees)
    chosen = slowest_groups(cfg, cluster)
    every = _every_ranks_groups(cfg, cluster.world_size)

    def time(axis, group):
        kind, nbytes = _PROBES[axis]
        return cluster.collective_time(kind, nbytes, group)

    def ring_hops(ring):
        return [time("cp", (a, b)) for a, b in zip(ring, ring[1:] + ring[:1])]

    for axis, group in (("tp", chosen.tp), ("dp", chosen.dp), ("ep", chosen.ep)):
        if len(group) > 1:
            assert group in every[axis]
            assert time(axis, group) == max(time(axis, g) for g in every[axis])
    if cfg.cp > 1:  # a ring, whose first or wrap-around hop (what the estimate times) is
        # its slowest and as slow as any ring's
        hops = ring_hops(chosen.cp)
        assert sorted(chosen.cp) in [sorted(g) for g in every["cp"]]
        slowest = max(max(ring_hops(g)) for g in every["cp"])
        assert max(hops[0], hops[-1]) == max(hops) == slowest
    if cfg.pp > 1:
        assert chosen.pp_hop in every["pp"]
        assert time("pp", chosen.pp_hop) == max(time("pp", g) for g in every["pp"])
    # where every group of each axis lies alike on the nodes, rank 0's stand for all
    alike = all(len({cluster.group_layout(g) for g in every[a]}) == 1 for a in every)
    assert (chosen == rank_groups(cfg)) or not alike


def test_tensor_parallel_groups_straddling_nodes_pay_for_it():
    # tp=4 on 6-GPU nodes: ranks 4-7 span two nodes, so every step waits for their
    # all-reduces; on one 12-GPU node the same config's groups all stay inside
    _, straddling = run(nodes=2, gpus=6, dp=3, tp=4, micro_batch_size=2, gbs=12)
    _, inside = run(nodes=1, gpus=12, dp=3, tp=4, micro_batch_size=2, gbs=12)
    act = 2 * SEQ * DIM * 2
    two_nodes = autopar.Cluster.from_profile("dgx-h100", num_nodes=2, gpus_per_node=6)
    t = functools.partial(two_nodes.collective_time, ranks=(4, 5, 6, 7))
    expected = straddling.num_microbatches * (2 * (2 * LAYERS + 1) * t("all_reduce", act)
                                              + 3 * t("all_reduce", 2 * SEQ * 4))
    assert straddling.breakdown["tp_comm"] == pytest.approx(expected)
    assert straddling.breakdown["tp_comm"] > 2 * inside.breakdown["tp_comm"]


@pytest.mark.parametrize("schedule,pp,v", [("gpipe", 4, 1), ("1f1b", 4, 1),
                                           ("interleaved-1f1b", 2, 2), ("zero-bubble", 4, 1)])
def test_closed_form_ranking_tracks_the_simulated_schedule(schedule, pp, v):
    # the search ranks with the closed form and re-estimates its best with the simulation:
    # they must agree closely, and on memory exactly where in-flight counts are closed-form
    from autopar.estimate import ModelCosts, evaluate

    costs = ModelCosts.from_graph(graph(1))
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
    cfg = ParallelConfig(dp=8 // pp, pp=pp, pp_schedule=schedule, virtual_stages=v)
    exact = evaluate(costs, cluster, cfg, global_batch_size=32, exact=True)
    fast = evaluate(costs, cluster, cfg, global_batch_size=32, exact=False)
    assert fast.step_time_s == pytest.approx(exact.step_time_s, rel=0.15)
    if schedule in ("gpipe", "1f1b"):
        assert fast.peak_memory_bytes == pytest.approx(exact.peak_memory_bytes, rel=1e-9)


def test_eager_loss_holds_eight_more_bytes_per_logit_than_a_fused_one():
    """Eager fp32 cross-entropy keeps 4 B/logit and peaks at 12 B/logit in its backward; a
    fused kernel keeps the bf16 logits (2 B) and writes one bf16 gradient (2 B): 8 B/logit
    apart at the loss's backward (one micro-batch in flight, pp=1)."""
    vocab, seq, mb = 4096, 64, 2
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=vocab, max_seq_len=seq, dim=64, n_layers=2, n_heads=4))
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
    cfg = ParallelConfig(dp=8, tp=1, pp=1, micro_batch_size=mb)
    mem = {k: estimate(model, cluster, cfg, global_batch_size=8 * mb, seq_len=seq, dtype="bf16",
                       options=EstimateOptions(loss_kernel=k)).tensor_memory_bytes
           for k in ("eager", "fused")}
    assert mem["eager"] - mem["fused"] == pytest.approx(8 * mb * seq * vocab)
    cfg_tp = ParallelConfig(dp=4, tp=2, pp=1, micro_batch_size=mb)
    tp = {k: estimate(model, cluster, cfg_tp, global_batch_size=4 * mb, seq_len=seq,
                      dtype="bf16", options=EstimateOptions(loss_kernel=k)).tensor_memory_bytes
          for k in ("eager", "fused")}
    assert tp["eager"] - tp["fused"] == pytest.approx(8 * mb * seq * vocab / 2)  # vocab-parallel


def test_loss_time_is_its_kernels_bytes_per_logit_over_the_vocabulary_shard():
    """The cross-entropy's compute time is the counted bytes per bf16 logit (eager 22 + 26,
    Megatron 38 + 14, fused 4 + 4) at the profile's bandwidth, its logits split over tp
    (vocabulary-parallel): the step differs between two loss kernels by exactly that, per
    micro-batch; the memory-bound factor of the other ops does not apply to it."""
    from costmodels.compute import memory_time_s

    vocab, seq, mb, micro = 32768, 256, 2, 3
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=vocab, max_seq_len=seq, dim=64, n_layers=2, n_heads=4))
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
    device = cluster.hardware.device
    for tp in (1, 2):
        cfg = ParallelConfig(dp=8 // tp, tp=tp, pp=1, micro_batch_size=mb)
        compute = {k: estimate(model, cluster, cfg, global_batch_size=8 // tp * mb * micro,
                               seq_len=seq, dtype="bf16",
                               options=EstimateOptions(loss_kernel=k)).breakdown["compute"]
                   for k in ("eager", "megatron", "fused")}
        logits = mb * seq * vocab / tp
        for kernel, per_logit in (("eager", 48), ("megatron", 52)):
            gap = memory_time_s(device, logits * (per_logit - 8)) * micro
            assert compute[kernel] - compute["fused"] == pytest.approx(gap, rel=1e-9), kernel

class _CountGemms(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.gemms += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
        return func(*args, **(kwargs or {}))


def _recomputed_gemms(model, tokens) -> int:
    """Linear GEMMs torch re-runs in backward: with every block checkpointed as autopar's
    runtime does it (non-reentrant), less a backward without checkpointing."""
    from autopar.runtime.apply import _apply_recompute

    counts = []
    for policy in ("none", "full"):
        if policy == "full":
            _apply_recompute([model], "full")
        loss = model(tokens).float().square().mean()
        with _CountGemms() as mode:
            loss.backward()
        counts.append(mode.gemms)
    return counts[1] - counts[0]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_early_stop_recompute_skips_what_torch_skips(family):
    # oracle: torch 2.13's non-reentrant checkpoint on CPU does not re-run a block's last
    # GEMM (its output is kept by nothing inside the block); the trace's tail says the same
    torch.manual_seed(0)
    if family == "gpt":
        model = GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2, n_heads=4))
    else:
        from autopar.models.llama import Llama, LlamaConfig

        model = Llama(LlamaConfig(vocab_size=128, max_seq_len=16, dim=32, n_layers=2,
                                  n_heads=4, n_kv_heads=2, ffn_dim=64))
    from autopar.estimate.core import ModelCosts

    units = ModelCosts.from_graph(autopar.trace(model, global_batch_size=2, seq_len=16)).units
    block = next(u for u in units if u.count == 2)
    gemms = [op for op in block.ops if op.kind == "gemm"]
    tail = [op for op in gemms if op.tail]
    assert len(tail) == 1 and block.tail_kernels >= 2  # the last GEMM and the residual add
    tokens = torch.randint(0, 128, (2, 16))
    assert _recomputed_gemms(model, tokens) == 2 * (len(gemms) - len(tail))
    # the estimate: early stop saves exactly the tail's forward time per layer
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
    cfg = ParallelConfig(dp=8, recompute="full")
    full = autopar.estimate(model, cluster, cfg, global_batch_size=16, seq_len=16,
                            options=EstimateOptions(recompute_early_stop=False))
    early = autopar.estimate(model, cluster, cfg, global_batch_size=16, seq_len=16)
    assert early.breakdown["recompute"] < full.breakdown["recompute"]
    assert early.breakdown["compute"] == full.breakdown["compute"]


def test_full_recompute_reruns_the_blocks_not_the_head():
    # checkpointing wraps the blocks (Megatron's layers, the runtime's ModuleList children):
    # a larger vocabulary adds head and loss work but no recompute
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
    cfg = ParallelConfig(dp=8, recompute="full")
    out = []
    for vocab in (VOCAB, 4 * VOCAB):
        with torch.device("meta"):
            model = GPT(GPTConfig(vocab_size=vocab, max_seq_len=SEQ, dim=DIM, n_layers=LAYERS,
                                  n_heads=HEADS, tie_embeddings=False))
        out.append(autopar.estimate(model, cluster, cfg, global_batch_size=16, seq_len=SEQ))
    assert out[1].breakdown["compute"] > out[0].breakdown["compute"]
    assert out[1].breakdown["recompute"] == pytest.approx(out[0].breakdown["recompute"])


def test_unfused_attention_dropout_adds_its_own_passes_and_a_fused_kernel_none():
    """Dropout on the probabilities of a materialized score matrix is a kernel of its own
    (MATH_ATTENTION_DROPOUT_PASSES passes of the scores each way); flash applies it inside."""
    from costmodels.compute import (MATH_ATTENTION_DROPOUT_PASSES, AttentionCall, attention_time_s,
                                    memory_time_s)

    device = autopar.Cluster.from_profile("dgx-a100-80g", num_nodes=1).hardware.device
    common = dict(flops=1e12, io_bytes=1e8, score_bytes=3e9, causal=True, seq_kv=2048)
    for backward in (False, True):
        for kernels in ("fused", "eager"):
            with_, without = (attention_time_s(device, "fp16", AttentionCall(dropout=d, **common),
                                               kernel="math", kernels=kernels, backward=backward)
                              for d in (True, False))
            assert with_ - without == pytest.approx(
                memory_time_s(device, MATH_ATTENTION_DROPOUT_PASSES * 3e9))
        flash = [attention_time_s(device, "fp16", AttentionCall(dropout=d, **common),
                                  kernel="flash", backward=backward) for d in (True, False)]
        assert flash[0] == flash[1]


def test_triton_flash_attention_runs_at_its_ampere_plateau_at_every_key_length():
    """FlashAttention-1 in Triton (llm-foundry's attn_impl "triton"): the causal half of the
    FLOPs at FUSED_ATTENTION_PEAK_FRACTION[("triton", "ampere")] of dense peak times the
    sustained fraction, with no sequence-length curve (it has no ATTENTION_SEQ_HALF entry);
    an architecture without a figure scales the kernel's own Ampere figure."""
    import dataclasses

    from costmodels.compute import (ATTENTION_SEQ_HALF, FUSED_ATTENTION_PEAK_FRACTION,
                                    AttentionCall, attention_time_s, fused_attention_fraction,
                                    sustained_fraction)

    device = autopar.Cluster.from_profile("dgx-a100-80g", num_nodes=1).hardware.device
    frac = FUSED_ATTENTION_PEAK_FRACTION[("triton", "ampere")]
    assert frac == 0.40 and ("triton", "fwd") not in ATTENTION_SEQ_HALF
    rate = device.peak_flops["bf16"] * frac * sustained_fraction("ampere")
    for seq_kv in (1024, 65536):
        for backward in (False, True):
            t = attention_time_s(device, "bf16", AttentionCall(flops=4e12, io_bytes=1e6,
                                                               causal=True, seq_kv=seq_kv),
                                 kernel="triton", backward=backward)
            assert t == pytest.approx(2e12 / rate)
    other = dataclasses.replace(device, arch="future", gemm_efficiency={"bf16": 0.869 / 2})
    assert fused_attention_fraction(other, "triton") == pytest.approx(frac / 2)


def _unit(name: str, count: int) -> "Unit":
    from autopar.estimate.units import Unit

    zero = dict.fromkeys(("num_kernels", "num_ops", "dense_params", "expert_params",
                          "saved_bytes", "saved_bytes_recompute", "saved_bytes_memory_ops",
                          "act_bytes",
                          "moe_dispatch_bytes", "attention_kv_bytes",
                          "attention_score_bytes", "param_bytes"), 0)
    fqns = tuple(f"{name}.{i}" for i in range(count)) if count > 1 else (name,)
    return Unit(name=name, layer_fqns=fqns, ops=(), tp_syncs=(), **zero)


@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 5, 7, 9])
def test_megatron_placement_splits_the_blocks_evenly_with_glue_at_the_ends(chunks):
    from autopar.estimate.layout import structure
    from autopar.estimate.stages import layer_sequence, megatron_boundaries

    # glue, 5 copies of block a, glue between, 4 copies of block b, glue: 9 block layers
    units = (_unit("pre", 1), _unit("a", 5), _unit("glue1", 1), _unit("b", 4), _unit("post", 1))
    seq = [f for _, f in layer_sequence(units)]
    cuts = megatron_boundaries(units, chunks)
    assert [f for i, j in cuts for f in seq[i:j]] == seq and all(i < j for i, j in cuts)
    # the blocks (and the glue between them) evenly: chunk 0 the base size, the remainder
    # one each on chunks 1, 2, ...; the glue before and after rides on the end chunks
    body = [j - i for i, j in cuts]
    body[0] -= 1
    body[-1] -= 1
    base, extra = divmod(10, chunks)
    assert body == [base + (0 < c <= extra) for c in range(chunks)]
    for pp in (p for p in (1, 2, 3) if chunks % p == 0):
        st = structure(units, pp, chunks // pp)
        assert st.stage_layers == tuple(tuple(seq[i:j]) for i, j in cuts)
        for c, layers in enumerate(st.stage_layers):  # counts per unit, counted by name
            assert list(st.counts[c]) == [sum(f.split(".")[0] == u.name for f in layers)
                                          for u in units]
        for r in range(pp):
            assert list(st.rank_counts[r]) == list(st.counts[r::pp].sum(axis=0))


def test_megatron_placement_gives_the_head_then_the_embedding_a_chunk_past_the_blocks():
    """More chunks than block layers (Megatron-LM counting the loss and the embedding as
    pipeline layers; the Zero Bubble fork's padding): one block per chunk, the glue after the
    blocks alone in the last chunk, then the glue before them alone in the first; beyond
    that, refused."""
    from autopar.estimate.stages import layer_sequence, megatron_boundaries

    units = (_unit("pre", 1), _unit("a", 10), _unit("post", 1))
    seq = [f for _, f in layer_sequence(units)]
    chunks = lambda n: [seq[i:j] for i, j in megatron_boundaries(units, n)]  # noqa: E731
    assert chunks(11) == [["pre", "a.0"]] + [[f"a.{i}"] for i in range(1, 10)] + [["post"]]
    assert chunks(12) == [["pre"]] + [[f"a.{i}"] for i in range(10)] + [["post"]]
    with pytest.raises(ValueError, match="13 pipeline stages for 10 block layers"):
        megatron_boundaries(units, 13)
    with pytest.raises(ValueError, match="12 pipeline stages for 10 block layers"):
        megatron_boundaries((_unit("a", 10), _unit("post", 1)), 12)  # no glue before


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_units_scaled_to_a_micro_batch_equal_the_units_traced_at_it(family):
    """The search costs a micro-batch of b as the batch-1 trace scaled by b; what does not
    grow with the batch -- parameter reads, and Llama's rotary tables made from a buffer and
    read by every layer -- must not be scaled. Oracle: the trace at b itself. Two residues:
    the loss's scalar output, which no rule can tell from a batch at b = 1, and GPT's position
    ids (an arange the embedding keeps for its backward), since a unit's saved bytes are not
    split by origin."""
    from autopar.estimate.core import ModelCosts, evaluate
    from autopar.models.llama import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=HEADS,
                                  n_kv_heads=2, ffn_dim=4 * DIM, max_seq_len=SEQ)) \
            if family == "llama" else GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, dim=DIM,
                                                    n_layers=LAYERS, n_heads=HEADS))
    one, four = (ModelCosts.from_graph(autopar.trace(model, global_batch_size=b, seq_len=SEQ,
                                                     dtype="bf16")) for b in (1, 4))
    scaled = one.units_for(4)
    assert len(scaled) == len(four.units)
    for got, want in zip(scaled, four.units):
        if family == "gpt" and got.name == "pre":  # the int64 position ids, 3 x too many
            extra = 3 * SEQ * 8
            assert (got.saved_bytes - want.saved_bytes, got.saved_bytes_memory_ops
                    - want.saved_bytes_memory_ops) == (extra, extra)
            got = dataclasses.replace(got, saved_bytes=want.saved_bytes,
                                      saved_bytes_recompute=want.saved_bytes_recompute,
                                      saved_bytes_memory_ops=want.saved_bytes_memory_ops)
        assert dataclasses.replace(got, ops=()) == dataclasses.replace(want, ops=())
        assert len(got.ops) == len(want.ops)
        for a, b in zip(got.ops, want.ops):
            if a.logits:  # the mean loss: one element written at any batch
                assert a.bytes_fwd - b.bytes_fwd == 3 * a.logit_bytes
                a = dataclasses.replace(a, bytes_fwd=b.bytes_fwd)
            assert a == b
    if family == "llama":
        cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
        cfg = ParallelConfig(dp=2, tp=2, pp=2, micro_batch_size=4, pp_schedule="1f1b")
        for exact in (False, True):
            got, want = (evaluate(c, cluster, cfg, global_batch_size=32, exact=exact)
                         for c in (one, four))
            assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-12)
            assert got.peak_memory_bytes == pytest.approx(want.peak_memory_bytes, rel=1e-12)


def _nanotron_cut(costs: list[float], pp: int) -> list[int]:
    """nanotron's build_model loop (src/nanotron/models/base.py): the stage of each pipeline
    block, from the blocks' compute costs in model order."""
    total, running, rank, owner = sum(costs), 0.0, 0, []
    for cost in costs:
        running += cost
        owner.append(rank)
        if running > total * (rank + 1) / pp:
            rank += 1
    return owner


@pytest.mark.parametrize("vocab,layers,pp", [(2048, 8, 2), (8192, 16, 2), (8192, 16, 4),
                                             (4096, 6, 3), (65536, 6, 3)])
def test_nanotron_pipeline_balance_cuts_where_nanotron_does(vocab, layers, pp):
    """pipeline_balance="gemm_weights" against nanotron's own loop over its block costs
    (get_block_compute_costs: 4·heads·head_dim·h + 3·ffn·h per decoder layer, vocab·h for the
    LM head, nothing for the embedding), for a Llama with full multi-head attention; where
    nanotron's loop would leave a stage empty (a head heavier than a stage's share), the
    estimate keeps Megatron's even cut."""
    from autopar.models.llama import Llama, LlamaConfig

    h, ffn = 256, 704
    cfg = LlamaConfig(vocab_size=vocab, dim=h, n_layers=layers, n_heads=4, n_kv_heads=4,
                      ffn_dim=ffn, max_seq_len=128)
    with torch.device("meta"):
        model = Llama(cfg)
    costs = [0.0] + [4 * h * h + 3 * ffn * h] * layers + [vocab * h]
    owner = _nanotron_cut(costs, pp)
    cluster = autopar.Cluster.from_profile("dgx-h100", gpus_per_node=pp)
    config = ParallelConfig(pp=pp)
    balanced = estimate(model, cluster, config, global_batch_size=8, seq_len=128,
                        options=EstimateOptions(pipeline_balance="gemm_weights"))
    got = [len(stage) for stage in balanced.stage_layers]
    even = estimate(model, cluster, config, global_batch_size=8, seq_len=128)
    if owner[-1] == pp - 1:
        assert got == [owner.count(r) for r in range(pp)]
        assert balanced.step_time_s != even.step_time_s
    else:
        assert got == [len(stage) for stage in even.stage_layers]


def test_estimate_options_refuse_a_value_outside_their_choices():
    with pytest.raises(ValueError, match=r"pipeline_balance='params' is not one of 'layers', "
                                         r"'gemm_weights'"):
        EstimateOptions(pipeline_balance="params")
    with pytest.raises(ValueError, match="a plan chooses its own cut"):
        autopar.compile(GPT(GPTConfig(vocab_size=VOCAB, dim=DIM, n_layers=LAYERS,
                                      n_heads=HEADS)).to("meta"),
                        autopar.Cluster.from_profile("dgx-h100"), global_batch_size=16,
                        seq_len=SEQ, options=EstimateOptions(pipeline_balance="gemm_weights"))


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("pp", [1, 2])
def test_fsdp2_data_parallel_collectives_are_the_ones_fsdp2_issues(zero, pp):
    """`EstimateOptions.fsdp2` against FSDP2's units counted by hand (blocks, and the root
    holding what is not in a block; the runtime's are counted in
    tests/distributed/test_runtime_matrix.py): without a pipeline each of m micro-batches
    gathers every unit for its forward (ZeRO-3 for its backward too); ZeRO-1 reduce-scatters
    once, ZeRO-2 and -3 every micro-batch. In a pipeline each unit is gathered and
    reduce-scattered once a step, whatever m. `dp_comm`'s total traffic is the time of exactly
    the collectives `dp_step_collectives` lists, and without FSDP2 ZeRO-1 and -2 move one
    collective of the rank's whole states a step."""
    from autopar.estimate.core import ModelCosts
    from autopar.estimate.data_parallel import dp_step_collectives

    fsdp2 = EstimateOptions(fsdp2=True)
    costs = ModelCosts.from_graph(graph(1))
    dp = 8 // pp
    units = LAYERS // pp + 1  # pipeline rank 0's blocks and its root (the embeddings)
    for gbs in (dp, 2 * dp, 4 * dp):
        m = gbs // dp
        config = ParallelConfig(dp=dp, pp=pp, zero_stage=zero, micro_batch_size=1)
        listed = dp_step_collectives(costs, config, fsdp2, global_batch_size=gbs, dtype="bf16")
        kinds = [kind for kind, _ in listed]
        if pp == 1:
            want = (m * units * (2 if zero == 3 else 1), units * (1 if zero == 1 else m))
        else:
            want = (units, units)
        assert (kinds.count("all_gather"), kinds.count("reduce_scatter")) == want
        assert len(kinds) == sum(want)
        cluster, est = run(dp=dp, pp=pp, zero_stage=zero, gbs=gbs, options=fsdp2)
        heavy = max(range(pp), key=lambda r: est.memory_by_stage[r]["_params"])
        listed = dp_step_collectives(costs, config, fsdp2, global_batch_size=gbs,
                                     dtype="bf16", pipeline_rank=heavy)
        assert est.breakdown["dp_comm_total"] == pytest.approx(  # rank 0's replicas: 0..dp-1
            sum(cluster.collective_time(kind, n, ranks=range(dp)) for kind, n in listed))
    if zero < 3:  # Megatron's distributed optimizer: the rank's states in one of each
        listed = dp_step_collectives(costs, config, EstimateOptions(),
                                     global_batch_size=4 * dp, dtype="bf16")
        assert sorted(kind for kind, _ in listed) == ["all_gather", "reduce_scatter"]
