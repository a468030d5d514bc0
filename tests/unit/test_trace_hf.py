"""Hugging Face causal LMs built from small configs (no downloads) trace unchanged, and compile
without a WARNING or ERROR record (an MoE fallback is one INFO line).

Oracles: parameter count vs ``sum(p.numel())``; one block per decoder stack; fwd+bwd FLOPs of
the traced graph vs ``FlopCounterMode`` over a real CPU training step of the same model
(with FlopCounterMode's own sdpa formulas registered for the CPU flash-attention kernels,
which it has none for)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import autopar
from autopar.ir import OpKind
from autopar.trace import trace

transformers = pytest.importorskip("transformers")  # a dev dependency: present in CI

aten = torch.ops.aten
VOCAB, LAYERS, BATCH, SEQ = 256, 3, 2, 16
_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                bos_token_id=0, eos_token_id=0, pad_token_id=0)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _DECODER, "model.layers"),
    "mistral": ("MistralConfig", "MistralForCausalLM", _DECODER, "model.layers"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _DECODER, "model.layers"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(_DECODER, num_local_experts=4, num_experts_per_tok=2), "model.layers"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64,
                  bos_token_id=0, eos_token_id=0, attn_pdrop=0.0), "transformer.h"),
}


def _build(case, device, **extra):
    config_cls, model_cls, kwargs, _ = CASES[case]
    config = getattr(transformers, config_cls)(**kwargs, attn_implementation="sdpa", **extra)
    with torch.device(device):
        model = getattr(transformers, model_cls)(config)
    return model


def _real_step_flops(model):
    mapping = {
        aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *a, **kw: sdpa_flop_count(q, k, v),
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda g, q, k, v, *a, **kw: sdpa_backward_flop_count(g, q, k, v),
    }
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        logits = model(tokens, use_cache=False).logits
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_model_on_meta_traces_with_one_block(case):
    model = _build(case, "meta")
    graph = trace(model, global_batch_size=BATCH, seq_len=SEQ)
    stack = CASES[case][3]
    assert [(b.representative, b.count) for b in graph.blocks] == [(f"{stack}.0", LAYERS)]
    assert graph.num_params == sum(p.numel() for p in model.parameters())
    attention = [n for n in graph.nodes if n.kind is OpKind.ATTENTION]
    assert len(attention) == 1 and attention[0].module_path.startswith(f"{stack}.0.")
    assert any(n.kind is OpKind.LOSS for n in graph.nodes)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_train_flops_match_flop_counter(case):
    # GPT-2 is built with attn_pdrop=0: with attention dropout the CPU picks the unfused math
    # kernel, whose backward (2x forward) has no flash recompute (the IR's 2.5x).
    # Mixtral runs its eager expert loop for the measurement (FlopCounterMode has no
    # grouped-matmul formula); every token meets exactly k experts either way.
    torch.manual_seed(0)
    extra = {"experts_implementation": "eager"} if case == "mixtral" else {}
    model = _build(case, "cpu", **extra)
    graph = trace(model, global_batch_size=BATCH, seq_len=SEQ)
    assert graph.flops_fwd + graph.flops_bwd == _real_step_flops(model)


def test_hf_mixtral_experts_become_an_moe_leaf_with_all_expert_weights():
    # the eager expert loop routes with nonzero, which fake tensors cannot run, so the experts
    # become a leaf whether or not this torch's grouped matmul takes fp32 fake tensors
    model = _build("mixtral", "meta", experts_implementation="eager")
    graph = trace(model, global_batch_size=BATCH, seq_len=SEQ)
    kinds = {n.kind for n in graph.nodes if n.module_path.startswith("model.layers.0.mlp")}
    assert {OpKind.MOE_DISPATCH, OpKind.MOE_COMBINE, OpKind.MATMUL} <= kinds
    used = {p.fqn for n in graph.nodes for p in n.params}
    assert {"model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj"} <= used


def test_hf_mixtral_grouped_mm_path_matches_leaf_cost():
    # in bf16 the library's grouped-matmul path runs on fake tensors; its FLOPs (every routed
    # row meets one expert matrix) must equal the leaf's expected-routing cost.
    grouped = trace(_build("mixtral", "meta").to(torch.bfloat16), global_batch_size=BATCH,
                    seq_len=SEQ)
    leaf = trace(_build("mixtral", "meta", experts_implementation="eager"),
                 global_batch_size=BATCH, seq_len=SEQ)
    assert grouped.flops_fwd == leaf.flops_fwd


@pytest.mark.parametrize("case", ["llama", "mixtral"])
def test_hf_compile_logs_no_error(case, every_log_record):
    # Where this torch's grouped matmul refuses fp32 fake tensors (bf16 only), Mixtral's fused
    # experts are costed as an MoE leaf, which the compile says once, at INFO; where it accepts
    # them the experts trace as they are.
    model = _build(case, "meta")
    plan = autopar.compile(model, autopar.Cluster.from_profile("cpu-gloo", gpus_per_node=2),
                           global_batch_size=8, seq_len=64, dtype="fp32")
    assert plan.config.dp * plan.config.tp * plan.config.pp * plan.config.cp == 2
    loud = [f"{r.name}: {r.getMessage()}" for r in every_log_record
            if r.levelno >= logging.WARNING]
    assert loud == []
    leaf = [r for r in every_log_record
            if r.name.startswith("autopar") and "MoE leaf" in r.getMessage()]
    allowed = [[], [logging.INFO]] if case == "mixtral" else [[]]
    assert [r.levelno for r in leaf] in allowed
