"""A slice of ``benchmarks/runtime_matrix.py`` in the suite: models written independently of
autopar (a hand-written Llama, nanoGPT with its tied head, an MoE written as a loop, Hugging Face
Llama and Mixtral, a ViT) under tensor + sequence (also with per-op recompute), pipeline,
context parallel (alone and with a pipeline) and 3-D plans on 2-8 gloo ranks, each
trained for 3 steps next to a one-process reference: every cell matches it (losses within 1e-4,
gradients within 1e-5 of the largest reference gradient) or was refused by compile with the
runtime's reason. Every cell of the module trains in one torchrun launch per rank count."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import collectives_agreement as ca  # noqa: E402
from benchmarks import runtime_matrix as rm  # noqa: E402

MODELS = ["plain_llama", "nano_gpt", "moe_loop", "hf_llama", "hf_mixtral", "hf_gpt2",
          "vit_encoder"]
# plan -> the models it trains on here (every model under every plan:
# benchmarks/runtime_matrix.py): the tp plans and cp on all (the collectives test below reads
# the tp cells of every model), expert plans on all (dense models: "n/a", at no cost), the
# others on models of distinct styles
SLICE = {
    "tp": MODELS, "tp_sp": MODELS, "tp_sp_mb1": MODELS,
    "tp_sp_per_op": ["plain_llama", "hf_mixtral", "hf_gpt2"],
    "pp_zero_bubble": ["moe_loop", "hf_gpt2", "vit_encoder"],
    "tp_zero3": ["nano_gpt", "hf_llama", "hf_mixtral"],
    "tp_sp_pp": ["plain_llama", "hf_mixtral", "hf_gpt2", "vit_encoder"],
    "cp": MODELS, "cp_pp": ["plain_llama", "hf_mixtral"],
    **{p: MODELS for p in ("ep", "ep_zero3", "ep_zero3_per_op", "ep_tp", "ep_tp_zero1")},
}


# StarCoder's and Phi-3's fused q/k/v projections run whole: on gloo's latencies the ILP
# executes them with one all-reduce of the whole projection's output gradient, where the
# runtime and the estimate gather the queries' and reduce K's and V's (three collectives)
# OLMo 2's (and FlexOlmo's) norms over the whole q and k projections: on gloo's latencies
# the ILP gathers the projections (two collectives), where the runtime and the estimate
# all-reduce each norm's per-row statistic each way and gather its weight's gradient (three;
# the ILP's choice too at Llama-7B widths on H100)
ILP_EXECUTES_OTHERWISE = ("hf_gpt_bigcode", "hf_phi3", "hf_olmo2", "hf_flexolmo")


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("matrix")


ZOO = [(m, p) for m in ("tiny_llama", "tiny_gpt") for p in ("tp", "tp_sp", "tp_sp_mb1")]
MQA = [("plain_mqa", p) for p in ("tp", "tp_sp", "tp_sp_mb1")] + [("hf_gemma", "tp")]
FUSED = [("hf_gpt_bigcode", "tp_sp"), ("hf_phi3", "tp")]
NORMS = [("hf_qwen3", "tp"), ("hf_qwen3", "tp_sp"), ("hf_gemma2", "tp"), ("hf_olmo2", "tp"),
         ("hf_gemma", "tp_sp")]
PARALLEL = [(m, p) for m in ("hf_gptj", "hf_gpt_neox", "hf_falcon") for p in ("tp", "tp_sp")]
LAYOUTS = [("hf_deepseek_v3", "tp"), ("hf_deepseek_v3", "tp_sp"), ("hf_opt", "tp_sp"),
           ("hf_bloom", "tp"), ("hf_bloom", "tp_sp"), ("hf_bert", "tp"), ("hf_bert", "tp_sp"),
           ("hf_biogpt", "tp_sp"),
           ("hf_flexolmo", "tp_sp"), ("hf_distilbert", "tp_sp"), ("torch_transformer", "tp"),
           ("torch_transformer", "tp_sp"), ("torchvision_vit", "tp"), ("scaled_mlp", "tp"),
           ("scaled_mlp", "tp_sp"), ("torch_transformer_seq_first", "tp"),
           ("torch_transformer_seq_first", "tp_sp")]
DP_PLANS = ["dp", "zero1_mb2", "zero2_mb2", "zero3_mb2", "zero3_pp", "tp_zero2_mb2"]
DP = [(m, p) for m in ("plain_llama", "hf_gpt2") for p in DP_PLANS]
OTHERS = [("hf_ernie45_moe", "tp_sp_dp"), ("hf_falcon_h1", "tp_sp"),
          ("hf_qwen3_next", "tp_sp"), ("hf_gemma2", "pp_1f1b"), ("hf_bloom", "dp_per_op"),
          ("hf_bloom", "tp_sp_per_op"),
          ("hf_qwen2_moe", "ep_tp"), ("hf_gpt2_odd_vocab", "tp_sp"), ("hf_gpt2_odd_vocab", "tp_pp"),
          ("titan_llama", "tp_sp"), ("titan_llama", "cp"), ("plain_llama", "cp_full"),
          ("hf_modernbert", "pp_1f1b"), ("hf_llama4", "pp_1f1b"), ("hf_gpt_oss", "ep"),
          ("hf_gpt_oss", "ep_tp"), ("torch_transformer", "pp_1f1b"), ("torch_transformer", "cp"),
          ("torchvision_vit", "pp_1f1b"), ("torch_transformer_seq_first", "pp_1f1b"),
          ("torch_transformer_seq_first", "cp")]
# autopar's own Llama and Mixtral under the plans no other cell trains for several steps:
# GPipe with one micro-batch (fewer than stages), interleaved 1F1B, ZeRO-2 with full
# recompute, ZeRO-1 in a pipeline, dp x pp and dp x tp + SP without ZeRO, FSDP2 under tp in
# another mesh order, dp x tp x pp under ZeRO-3, cp with ZeRO-3, with tp + sequence parallel
# and outside dp, experts over a (dp, cp) mesh sliced out of order (generated scripts:
# test_parity.py)
OWN = [("tiny_llama", p) for p in ("pp_gpipe_mb8", "pp_interleaved", "zero2_full", "zero1_pp",
                                    "dp_pp_gpipe", "cp_zero3", "cp_zero2_cp_outer")] + \
    [("tiny_llama_wide", p) for p in ("tp_sp_dp", "tp_zero3_dp_inner", "zero3_tp_pp",
                                      "cp_tp_sp")] + \
    [("tiny_mixtral", "ep_cp_outer")]


# context parallel with tensor parallel of models that compute attention themselves: the
# (cp, tp) activations through a hand-written Llama, Hugging Face Llama, GPT-2 (Conv1D GEMMs
# on flattened tokens, fused q/k/v), Phi-3 (a fused projection run whole) and OPT (MLPs on
# flattened tokens beside a residual of them) and Mixtral (its MoE sub-layers on local shards
# of each rank's tokens), with sequence parallel, FSDP2 over dp x cp, in a pipeline and with
# tp outside cp in the device mesh
CP_TP = [("plain_llama", "cp_tp"), ("hf_llama", "cp_tp_sp"), ("hf_gpt2", "cp_tp"),
         ("hf_phi3", "cp_tp"), ("hf_opt", "cp_tp_sp"), ("hf_llama", "cp_tp_zero3"),
         ("plain_llama", "cp_tp_sp_pp"), ("hf_mixtral", "cp_tp_sp"),
         ("plain_llama", "cp_tp_sp_tp_outer")]
# OPT flattens its tokens for the MLP under sequence parallel: a sequence split over cp and tp
# cannot be flattened by DTensor, so the runtime gathers it over tp first (8 all-gathers a
# step the estimate does not charge), and the MLP's partial output meets the flattened
# residual with an all-reduce where the estimate charges a reduce-scatter
CP_TP_OTHERWISE = (("hf_opt", "cp_tp_sp"),)
# context parallel with expert parallel of models that compute attention themselves: each MoE
# layer gathers its cp rank's own tokens over an ep group made of cp ranks, with tensor
# parallel too
EP_CP = [("moe_loop", "ep_cp"), ("hf_mixtral", "ep_cp"), ("hf_qwen3_moe", "ep_cp_tp")]


@pytest.fixture(scope="module")
def matrix(plan_dir):
    """Every cell the tests read, trained in one launch per rank count."""
    pairs = [(m, p) for p, models in SLICE.items() for m in models] + ZOO + MQA + FUSED \
        + NORMS + PARALLEL + LAYOUTS + DP + OTHERS + OWN + CP_TP + EP_CP
    return {(c.model, c.plan): c for c in rm.run_pairs(list(dict.fromkeys(pairs)), plan_dir)}


@pytest.fixture(scope="module")
def cells(matrix):
    return [matrix[m, p] for p, models in SLICE.items() for m in models]


@pytest.fixture(scope="module")
def zoo_cells(matrix):
    """autopar's own Llama (hook attention, GQA) and GPT (fused q/k/v, tied head)."""
    return [matrix[k] for k in ZOO]


@pytest.fixture(scope="module")
def mqa_cells(matrix):
    """Multi-query attention, one kv head over tp=2: repeated to the query heads before SDPA
    (a hand-written Llama) and read as one head by SDPA's grouped-query path (Hugging Face
    Gemma): the K and V projections run replicated."""
    return [matrix[k] for k in MQA]


@pytest.fixture(scope="module")
def fused_cells(matrix):
    """Fused q/k/v projections tp cannot split by head, run whole with each rank slicing its
    query heads: StarCoder's (one k/v head after the queries) and Phi-3's (q, k and v rows
    sliced at unequal widths)."""
    return [matrix[k] for k in FUSED]


@pytest.fixture(scope="module")
def parallel_cells(matrix):
    """A parallel attention and MLP: GPT-J's after one norm, GPT-NeoX's after two, Falcon's
    summed in place (``mlp_output += attention_output``): their partial outputs are summed
    and reduced once, and where both read one tensor its gradient is reduced once."""
    return [matrix[k] for k in PARALLEL]


@pytest.fixture(scope="module")
def layout_cells(matrix):
    """DeepSeek-V3's latent attention: its low-rank q and kv down-projections (and their
    norms) run whole on every rank, the up-projections split by head, the keys assembled in
    a new tensor sharded as the heads; MoE layers after a dense one. OPT's MLP on the tokens
    flattened to ``[batch * seq, hidden]``, under sequence parallel a strided shard of them:
    gathered and reduce-scattered on the sequence of its unflattened view. BLOOM's attention
    over batch and heads flattened (``baddbmm`` with its ALiBi bias): each rank's rows,
    its residual handed to each sub-layer left a sequence shard. BERT's MLM head: the dense
    transform and its norm whole, the vocabulary projection split; under sequence parallel
    its post-norm sub-layers add their gathered input back inside them (the residual add
    reads the shard it was gathered from, so q, k and v reduce their gradients once).
    BioGPT's embedding scaled by a float inside its module: still a partial sum,
    reduce-scattered once. FlexOlmo's
    norms after its MoE sub-layers: on the sequence shard, their gradients in the
    once-a-step all-reduce. DistilBERT's head (a transform and a norm, then the tied
    vocabulary projection): under sequence parallel the transform and the norm run whole on
    the shard, and the sequence is gathered at the projection. PyTorch's own
    ``nn.TransformerEncoder``: its packed q/k/v projection split by chunk, its heads viewed
    inside ``[seq, batch * heads, head_dim]``; on sequence-first tensors under sequence
    parallel its stream sharded on dim 0, where its sub-layers gather and reduce-scatter. A
    learned scalar scaling the split MLP features: its partial gradient in the once-a-step
    all-reduce."""
    return [matrix[k] for k in LAYOUTS]


@pytest.fixture(scope="module")
def norm_cells(matrix):
    """Norms the layout leaves replicated where tp splits or shards what they read: Qwen3's
    per-head q/k norms (partial gradients over the heads, with sequence parallel too) and
    Gemma 2's post-norms with their ``1 + w`` scales and final logit soft-capping (the loss
    reads the logits through element-wise ops, still split over the vocabulary); and Gemma's
    embedding, scaled by a buffer inside its module, reduce-scattered under sequence
    parallel as any other; OLMo 2's norms over the whole q and k projections, whose per-row
    statistics each rank sums over its share of the features."""
    return [matrix[k] for k in NORMS]


@pytest.mark.parametrize("model", MODELS)
def test_every_cell_matches_the_reference_or_was_refused_at_compile(cells, model):
    for cell in (c for c in cells if c.model == model):
        if cell.loss_err is None:
            assert cell.status.startswith(("refused: ", "n/a")), (cell.plan, cell.status)
            continue
        assert cell.loss_err <= rm.LOSS_TOL and cell.grad_err <= rm.GRAD_TOL, \
            (cell.plan, cell.loss_err, cell.grad_err)


def test_autopars_own_models_train_like_the_reference(matrix, plan_dir):
    """autopar's own models under `OWN`: each pinned choice compiled as pinned, the losses over
    3 steps and the first gradients the reference's."""
    from autopar.plan import load_plan

    for model, plan_name in OWN:
        cell = matrix[model, plan_name]
        assert cell.ok, (model, plan_name, cell.text())
        plan = load_plan(plan_dir / f"{model}.{plan_name}.json")
        for key, value in rm.PLANS[plan_name][1].items():
            assert getattr(plan.config, key) == value, (plan_name, key, plan.config)


def test_plans_run_on_the_models_own_forward(cells):
    """Context parallel of models that compute attention themselves, expert parallel of MoE
    layers autopar did not write (a loop over an expert list, Hugging Face's fused experts),
    alone, with ZeRO-3 over the expert replicas (also inside blocks under per-op recompute)
    and with tensor parallel (also with ZeRO-1 over the replicas), and the
    pipeline of an image model run; dense models have no ep cell."""
    by = {(c.model, c.plan): c.text() for c in cells}
    assert all(c.text().startswith("ok") for c in cells
               if c.plan == "cp" and c.model != "vit_encoder"), by
    assert "shards token sequences" in by["vit_encoder", "cp"]  # images: refused, saying why
    for model in ("moe_loop", "hf_mixtral"):
        for plan in ("ep", "ep_zero3", "ep_zero3_per_op"):
            assert by[model, plan].startswith("ok"), by
    # experts, in a list or fused [E, ...] weights, also split over tp within each ep rank,
    # and with FSDP2 over their replicas (8 ranks: dp4 tp2 ep2, ZeRO-1)
    for model in ("moe_loop", "hf_mixtral"):
        for plan in ("ep_tp", "ep_tp_zero1"):
            assert by[model, plan].startswith("ok"), by
    assert by["plain_llama", "ep"] == "n/a (dense)"
    assert by["vit_encoder", "pp_zero_bubble"].startswith("ok"), by  # an image model's stages


def test_context_parallel_of_a_models_own_forward_runs_with_tensor_parallel(matrix, plan_dir):
    """`CP_TP`: each model trains like the reference on (cp, tp) activations, the plan's
    contiguous layout as pinned."""
    from autopar.plan import load_plan

    for model, plan_name in CP_TP:
        cell = matrix[model, plan_name]
        assert cell.ok, (model, plan_name, cell.text())
        plan = load_plan(plan_dir / f"{model}.{plan_name}.json")
        assert plan.model.cp_layout == "contiguous"
        assert (plan.config.cp, plan.config.tp) == (2, 2)


def test_context_parallel_of_a_models_own_forward_runs_with_expert_parallel(matrix, plan_dir):
    """`EP_CP`: each MoE model trains like the reference with its experts split over the cp
    ranks, the plan's contiguous layout as pinned."""
    from autopar.plan import load_plan

    for model, plan_name in EP_CP:
        cell = matrix[model, plan_name]
        assert cell.ok, (model, plan_name, cell.text())
        plan = load_plan(plan_dir / f"{model}.{plan_name}.json")
        assert plan.model.cp_layout == "contiguous" and plan.model.ep_dispatch == "all_gather"
        assert (plan.config.dp, plan.config.cp, plan.config.ep) == (1, 2, 2)


def test_expert_parallel_collectives_are_the_ones_the_estimate_charges(matrix, plan_dir):
    """`EP_CP`: each MoE layer's input all-gathered over the ep group and its output
    reduce-scattered, forward and backward (`timing.ep_collectives`, all-gather dispatch),
    with the experts' gradients reduced over their replicas and the dense ones over dp x cp,
    are the estimate's. Hugging Face's fused experts take the router's top-k indices and
    weights as inputs, so those are gathered too (and the weights' gradient reduce-scattered):
    12 bytes per token and choice that the estimate does not charge, a 16th of the hidden
    state's here."""
    for key in EP_CP:
        got = ca.compare(matrix[key], plan_dir)
        assert not got.charged - got.issued, (key, ca._difference(got.issued, got.charged))
        hidden = max(n for (kind, n) in got.charged if kind == "all_gather")
        routing = got.issued - got.charged
        assert {kind for kind, _ in routing} <= {"all_gather", "reduce_scatter"}, key
        assert all(16 * n <= hidden for _, n in routing), (key, routing)
        assert bool(routing) == (key[0] != "moe_loop"), (key, routing)


def test_alternating_blocks_run_in_order_in_a_pipeline(matrix, plan_dir):
    """Gemma 2 (sliding-window and global layers alternating in one block list, hand-written
    soft-capped attention, tied head) in a 1F1B pipeline: each stage owns consecutive layers
    and the losses and gradients are the reference's."""
    import json

    assert matrix["hf_gemma2", "pp_1f1b"].ok, matrix["hf_gemma2", "pp_1f1b"].text()
    stages = json.loads((plan_dir / "hf_gemma2.pp_1f1b.json").read_text())["stages"]
    layers = [int(n.rsplit(".", 1)[1]) for stage in stages for n in stage
              if n.startswith("model.layers.")]
    assert layers == list(range(4)) and all(stages), stages


def test_stages_keep_what_the_model_reads_off_the_modules_they_do_not_own(matrix):
    """A pipeline stage stands in for the blocks and glue it does not own, and a model's own
    forward may read them: ModernBERT each layer's ``attention_type`` (its mask), Llama 4 its
    embedding's weight device. Both train in a 1F1B pipeline to the reference's losses and
    gradients."""
    for model in ("hf_modernbert", "hf_llama4"):
        assert matrix[model, "pp_1f1b"].ok, matrix[model, "pp_1f1b"].text()


def test_pytorchs_own_transformer_layers_run_every_parallelism(matrix, plan_dir):
    """A language model built from ``nn.TransformerEncoder`` (``nn.MultiheadAttention`` with
    its packed ``in_proj_weight`` and separately added bias, heads viewed as ``[seq,
    batch * heads, head_dim]``): tensor parallel splits the packed projection by chunk, weight
    and bias alike (so each rank holds whole heads of q, k and v) with and without sequence
    parallel; context parallel runs its attention as a ring; a 1F1B pipeline runs the
    encoder's own forward, which reads the first layer's ``self_attn.batch_first`` on stages
    that do not own it. The same on sequence-first tensors (``batch_first=False``) under tp,
    tp+sp, cp and in a pipeline, whose stages send a transposed hidden state and its gradient. A
    ViT written as torchvision writes it (``nn.MultiheadAttention`` blocks in an
    ``nn.Sequential``) trains under tp and in a pipeline. All train to the reference's
    losses and gradients."""
    from autopar.plan import load_plan

    for cell in [matrix["torch_transformer", p] for p in ("tp", "tp_sp", "cp", "pp_1f1b")] + \
            [matrix["torch_transformer_seq_first", p] for p in ("tp", "tp_sp", "cp",
                                                                 "pp_1f1b")] + \
            [matrix["torchvision_vit", p] for p in ("tp", "pp_1f1b")]:
        assert cell.ok, cell.text()
    plan = load_plan(plan_dir / "torch_transformer.tp.json")
    attn = "encoder.layers.0.self_attn."
    assert [plan.tp_placements[attn + n] for n in ("in_proj_weight", "in_proj_bias",
                                                   "out_proj.weight")] == ["S(0)", "S(0)",
                                                                          "S(1)"]


def test_experts_with_biases_split_over_ep_or_tp_not_both(matrix):
    """GPT-OSS's fused experts add a bias per expert: expert parallel trains them (dp2 ep2),
    and with ep and tp together compile refuses the plan, saying why (each tp rank's partial
    sum would add the bias), where the runtime would fail at launch."""
    assert matrix["hf_gpt_oss", "ep"].ok, matrix["hf_gpt_oss", "ep"].text()
    refused = matrix["hf_gpt_oss", "ep_tp"].text()
    assert refused.startswith("refused") and "add a bias per expert" in refused, refused


def test_per_op_recompute_runs_blocks_that_keep_no_op(matrix):
    """Hugging Face BLOOM (Linear layers with biases, attention written with ``baddbmm``: no
    op per-op recompute keeps, so each block re-runs whole) under per-op recompute, with data
    parallel and with tensor and sequence parallel: the losses and gradients are the
    reference's."""
    cells = [matrix["hf_bloom", p] for p in ("dp_per_op", "tp_sp_per_op")]
    assert all(c.ok for c in cells), [c.text() for c in cells]


def test_a_shared_expert_beside_the_routed_ones_runs_on_local_shards(matrix):
    """Hugging Face Qwen2-MoE (a shared expert run before the router, behind a one-output
    sigmoid gate) under expert x tensor parallel (dp2 tp2 ep2), whose fused expert weights
    split over ep and tp run only on local shards: the shared expert is column->row like
    the experts and its gate whole, so the sub-layer is the sum of its ranks' outputs and
    the losses and gradients are the reference's."""
    cell = matrix["hf_qwen2_moe", "ep_tp"]
    assert cell.ok, cell.text()


def test_frozen_parameters_and_depthwise_convolutions_run_under_tensor_parallel(matrix):
    """Ernie 4.5 MoE's router holds a frozen parameter (a selection bias with
    requires_grad=False) that gets no gradient: the data-parallel all-reduce beside tensor
    parallel leaves it out. Falcon-H1's Mamba-2 mixer convolves each channel on its own
    (depthwise): the plan keeps it whole while its projections split. Qwen3-Next's gated
    delta-net reshapes slices of its fused projection and transposes a projection's output
    for its convolution, whose gradient comes back transposed."""
    for key in (("hf_ernie45_moe", "tp_sp_dp"), ("hf_falcon_h1", "tp_sp"),
                ("hf_qwen3_next", "tp_sp")):
        assert matrix[key].ok, (key, matrix[key].text())


def test_a_vocabulary_tp_does_not_divide_is_split_unevenly(matrix):
    """GPT-2 with an odd vocabulary (257 tokens, as its own 50,257) under tensor parallel with
    sequence parallel and in a pipeline (tp2 pp2): the tied embedding and head split 129 and
    128 rows over the two tp ranks and the losses and gradients are the reference's."""
    for plan in ("tp_sp", "tp_pp"):
        cell = matrix["hf_gpt2_odd_vocab", plan]
        assert cell.ok, cell.text()


def test_a_llama_written_as_torchtitan_writes_it_runs_as_costed(matrix, plan_dir):
    """A Llama with torchtitan's RoPE as complex products (``view_as_complex`` on the heads) and
    its layers in a ModuleDict, under tp + sequence parallel and under cp: the losses and
    gradients are the reference's, and rank 0 issues the collectives the estimate charges."""
    for plan in ("tp_sp", "cp"):
        cell = matrix["titan_llama", plan]
        assert cell.ok, cell.text()
        got = ca.compare(cell, plan_dir)
        assert got.same, (plan, ca._difference(got.issued, got.charged))


def test_vocab_parallel_logits_take_the_parallel_loss(cells):
    """Under tensor parallel the untied heads' logits stay vocab-sharded on the last stage and
    the loss runs under loss_parallel."""
    by = {(c.model, c.plan): c for c in cells}
    assert by["plain_llama", "tp_sp"].detail["loss_parallel"] is True
    assert by["hf_llama", "tp_zero3"].detail["loss_parallel"] is True


def test_tensor_parallel_issues_megatrons_collectives(cells):
    """nanoGPT (fused q/k/v split by ``split``, tied head) at tp=2 without sequence parallel, one
    micro-batch of 8: per block one all-reduce after each row-parallel GEMM forward and one for
    each sub-layer's input gradient backward (4 blocks x 4), the vocab-parallel embedding's
    forward (1), the vocab-parallel loss (max, sum and target logit: 3) and the head's input
    gradient (1) -- all-reduces only: no all-gather (q, k and v split on whole heads) and no
    re-layout."""
    by = {(c.model, c.plan): c for c in cells}
    assert by["nano_gpt", "tp"].detail["collectives"] == {"all_reduce": 21, "allreduce_": 1}


@pytest.mark.parametrize("plan_name", ["tp", "tp_sp", "tp_sp_mb1"])
def test_the_estimate_and_the_plan_charge_the_collectives_the_runtime_issues(
        cells, zoo_cells, mqa_cells, norm_cells, fused_cells, parallel_cells, layout_cells,
        plan_dir, plan_name):
    """One layout, three readers: on the dense models (a hand-written Llama, nanoGPT with its
    fused q/k/v and tied head, Hugging Face Llama and GPT-2 with its [in, out] Conv1D weights,
    autopar's own Llama and GPT with q/k/v viewed as (3, heads, head_dim), a ViT with its
    channel-split patch convolution and class head) under tensor parallel (tp=2, without and
    with sequence parallel, and at one sequence per micro-batch, where the ILP's layout runs
    every MLP replicated on the sequence shard), the collectives the runtime issued in a
    training step (rank 0, each kind with its bytes; less the scalar all-reduce of the
    reported loss) are the ones the estimate charges for the plan's layout
    (`tp_step_collectives`), and each block's in the plan (`plan.intra_op`, the ILP's
    solution of the layout the plan runs) are the estimate's for one layer, as
    reduce-scatters and all-gathers (`primitive_collectives`). MoE layers written as a loop
    over an expert list and Hugging Face Mixtral's fused experts included in the first:
    each MoE sub-layer reduces its output once, its router's partial gradient joins the
    once-a-step all-reduce, and the ILP prices their blocks so (the routing ops pass partial
    gradients back, the experts' gated activation keeps its features split). With one kv
    head (`mqa_cells`) K and V are replicated and the gradients of the attention's K/V inputs
    move backward: all-gathered where the model repeats them to the query heads, all-reduced
    where SDPA reads the one head. Replicated norms on split heads or after a row GEMM join
    the once-a-step all-reduce of partial gradients (`norm_cells`); a norm over a split
    projection all-reduces its per-row statistics. A fused q/k/v projection
    run whole (`fused_cells`) gathers its queries' gradient and reduces no input gradient.
    A parallel attention and MLP (`parallel_cells`) reduce their summed outputs once, and
    their input gradients once where both read one tensor (the plan's
    ``summed_row_weights``). Latent attention's down-projections run whole and reduce
    nothing in the sub-layer; an MLP on flattened tokens reduces as any other; BERT's
    transform before its vocabulary projection runs whole, as Megatron-LM's; heads split
    inside a dim that merges them with the batch (BLOOM, ``nn.MultiheadAttention``) stay split
    in the ILP's execution as strided shards (`layout_cells`)."""
    checked = []
    for cell in (c for c in cells + zoo_cells + mqa_cells + norm_cells + fused_cells
                 + parallel_cells + layout_cells
                 if c.plan == plan_name and c.loss_err is not None):
        assert cell.loss_err <= rm.LOSS_TOL and cell.grad_err <= rm.GRAD_TOL, cell
        got = ca.compare(cell, plan_dir)
        assert got.issued == got.charged, cell.model
        if cell.model not in ILP_EXECUTES_OTHERWISE:
            assert got.ilp_same, (cell.model, got.blocks)
        plan = got.plan
        checked.append(cell.model)
        if (cell.model, cell.plan) in PARALLEL:
            assert plan.model.summed_row_weights, cell.model
        if plan_name == "tp_sp_mb1" and cell.model not in rm.MOE_MODELS:  # MLPs, no routing
            assert all(e.get("replicated_sublayers") for e in plan.intra_op.values()), \
                cell.model
    assert set(checked) == {"plain_llama", "nano_gpt", "moe_loop", "hf_llama", "hf_mixtral",
                            "hf_gpt2", "tiny_llama", "tiny_gpt", "plain_mqa"} | (
        {m for m, p in PARALLEL + LAYOUTS if p == plan_name}) | (
        {"vit_encoder", "hf_gemma", "hf_qwen3", "hf_gemma2", "hf_phi3", "hf_olmo2"}
        if plan_name == "tp"
        else {"hf_qwen3", "hf_gemma", "hf_gpt_bigcode"} if plan_name == "tp_sp" else set()), \
        checked
    from autopar.plan import load_plan

    for cell in mqa_cells:  # K and V replicated: whole on each rank
        plan = load_plan(plan_dir / f"{cell.model}.{cell.plan}.json")
        name = "blocks.0.attn.{}.weight" if cell.model == "plain_mqa" else \
            "model.layers.0.self_attn.{}_proj.weight"
        assert [plan.tp_placements[name.format(w)] for w in "qkvo"] == \
            ["S(0)", "R", "R", "S(1)"], cell.model
    for cell in fused_cells:
        plan = load_plan(plan_dir / f"{cell.model}.{cell.plan}.json")
        fused, out = ("transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj") if \
            cell.model == "hf_gpt_bigcode" else ("model.layers.0.self_attn.qkv_proj",
                                                 "model.layers.0.self_attn.o_proj")
        assert (plan.tp_placements[f"{fused}.weight"], plan.tp_placements[f"{out}.weight"]) \
            == ("R", "S(1)"), cell.model


def test_data_parallel_collectives_are_the_ones_the_estimate_charges(matrix, plan_dir):
    """The ZeRO stages as FSDP2 runs them (`EstimateOptions.fsdp2`, set by the "autopar"
    preset), on a hand-written Llama and Hugging Face GPT-2 (tied head, in the root unit):
    the all-reduces, all-gathers and reduce-scatters rank 0 issues in a step, with their
    bytes, are the ones `dp_step_collectives` lists. With two micro-batches a rank each
    forward gathers every FSDP unit (the blocks and the root) again, ZeRO-3's backward too;
    ZeRO-1 reduce-scatters once, ZeRO-2 and -3 every micro-batch; in a pipeline each unit
    is gathered and reduce-scattered once a step. With tensor parallel (dp2 tp2, sequence
    parallel) FSDP2 makes each tp gradient whole on its own in every reduce-scatter pass: an
    all-reduce per norm weight, and for GPT-2's fused q/k/v bias (whole on each tp rank under
    FSDP2) an all-gather of its chunks (`tp_comm.gradient_collectives`)."""
    cells = [matrix[k] for k in DP]
    for cell in cells:
        assert cell.loss_err is not None and cell.loss_err < rm.LOSS_TOL, cell.text()
        got = ca.compare(cell, plan_dir)
        assert got.same, (cell.model, cell.plan, ca._difference(got.issued, got.charged))
    by = {(c.model, c.plan): c.detail["collectives"] for c in cells}
    assert by["plain_llama", "zero2_mb2"] == {"_allgather_base_": 10,
                                              "_reduce_scatter_base_": 10, "allreduce_": 1}


# MoE models under cp without ZeRO or a pipeline: DDP reduces their gradients in two buckets (its
# first is 1 MiB), where the estimate charges one all-reduce of the same bytes
CP_MOE_OTHERWISE = (("moe_loop", "cp"), ("hf_mixtral", "cp"))


# the plans with a pipeline or a cp ring whose cells the test below reads
PLANS_OF = {name: pins for name, (_, pins) in rm.PLANS.items()
            if (pins.get("pp", 1) > 1 or pins.get("cp", 1) > 1) and pins.get("ep", 1) == 1
            and pins.get("pp_schedule") != "zero-bubble"}


def test_pipeline_and_context_parallel_transfers_are_the_ones_the_estimate_charges(
        matrix, plan_dir):
    """Every cell of the module with a pipeline or a cp ring (without expert parallel, and
    outside zero-bubble schedules, whose split backward the recording upsets): the sends rank
    0 issues in a step, with their bytes, are the ones the estimate lists beside its other
    collectives. A pipeline rank sends each micro-batch's activation to the next stage and
    its gradient to the previous, per stage it holds (interleaved: two), sequence-parallel
    activations as their tp share and replicated ones whole; a weight tied across stages
    (nanoGPT's and GPT-2's head) sends its gradient once a step, as FSDP2's shard under ZeRO
    (`pipeline_comm.pp_step_collectives`). A cp ring passes each attention's K/V cp-1 times
    forward and backward and the fp32 dK/dV accumulators cp times
    (`timing.cp_collectives`, ``cp_rotate="ring"``), again forward in the blocks full
    recompute re-runs (`layout.recomputed_layers`).
    An MoE layer routes each cp rank's own tokens: no gather of the sequence
    (`runtime.cp_moe`), only DDP's buckets set those cells apart."""
    checked = []
    for cell in matrix.values():
        plan = PLANS_OF.get(cell.plan)
        if plan is None or (cell.model, cell.plan) in CP_MOE_OTHERWISE + CP_TP_OTHERWISE \
                or cell.loss_err is None:
            continue
        assert cell.loss_err < rm.LOSS_TOL, cell.text()
        got = ca.compare(cell, plan_dir)
        assert got.same, (cell.model, cell.plan, ca._difference(got.issued, got.charged))
        checked.append((cell.model, cell.plan))
    assert len(checked) >= 18, checked
    for key in CP_MOE_OTHERWISE:
        got = ca.compare(matrix[key], plan_dir)
        assert {kind for kind, _ in got.issued - got.charged} == {"all_reduce"}, key
        assert sum(n * k for (_, n), k in (got.issued - got.charged).items()) == \
            sum(n * k for (_, n), k in (got.charged - got.issued).items()), key
    assert {("nano_gpt", "cp"), ("plain_llama", "cp_pp"), ("tiny_llama", "pp_interleaved"),
            ("hf_gpt2", "tp_sp_pp"), ("tiny_llama_wide", "cp_tp_sp"),
            ("plain_llama", "cp_full"), ("hf_llama", "cp_tp_sp"), ("hf_llama", "cp_tp_zero3"),
            ("plain_llama", "cp_tp_sp_pp")} <= set(checked), checked
