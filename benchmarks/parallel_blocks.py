"""What reducing a parallel attention and MLP once is worth. Models whose blocks add both
branches to the stream (``x + attn(n(x)) + mlp(n(x))``: GPT-J, GPT-NeoX, Falcon, Phi-2, Cohere)
at their published widths (8 layers), at tp=8 on one DGX H100, planned by `autopar.compile` with tp
pinned: the estimate of the plan as autopar runs it (the branches' partial outputs summed
before one reduction, `autopar.ir.residual.reduction_points`) beside the same plan with
each branch reduced apart, as Megatron-LM's layout runs a block (one reduction per
row-parallel GEMM each way). Prints per model and sequence-parallel setting the step time
and the tensor-parallel communication of both, and their ratio.

Run: python benchmarks/parallel_blocks.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.estimate.core import costs_of_layout, evaluate  # noqa: E402

# (name, transformers config class, model class, widths as published)
MODELS = [
    ("GPT-J-6B", "GPTJConfig", "GPTJForCausalLM",
     dict(vocab_size=50400, n_positions=2048, n_embd=4096, n_head=16, rotary_dim=64)),
    ("GPT-NeoX-20B", "GPTNeoXConfig", "GPTNeoXForCausalLM",
     dict(vocab_size=50432, hidden_size=6144, num_attention_heads=64,
          intermediate_size=24576, max_position_embeddings=2048)),
    ("Falcon-40B", "FalconConfig", "FalconForCausalLM",
     dict(vocab_size=65024, hidden_size=8192, num_attention_heads=128, num_kv_heads=8,
          new_decoder_architecture=True, parallel_attn=True, bias=False)),
]
LAYERS, SEQ, BATCH = 8, 2048, 32


def _apart(costs):
    """``costs`` with each block's branches reduced apart: one reduction per row-parallel
    GEMM each way (its sub-layers' `reductions`), as Megatron-LM's layout runs them."""
    units = []
    for unit in costs.units:
        rows = sum(sub.reductions for sub in unit.sublayers)
        if not rows:
            units.append(unit)
            continue
        act = float(unit.act_bytes)
        syncs = [s for s in unit.tp_syncs if s[1] not in ("reduce", "reduce_sp")]
        syncs += [("forward", "reduce", act)] * rows + [("backward", "reduce", act)] * rows
        units.append(dataclasses.replace(unit, tp_syncs=tuple(syncs)))
    return dataclasses.replace(costs, units=tuple(units))


def main() -> None:
    import transformers

    node = autopar.Cluster.from_profile("dgx-h100", num_nodes=1)
    print(f"{'model':<14} {'sp':<3} {'plan':<34} {'summed s':>9} {'apart s':>8} "
          f"{'ratio':>6} {'tp comm':>8} {'apart':>7}")
    for name, config_class, model_class, widths in MODELS:
        config = getattr(transformers, config_class)(**widths, **{
            "n_layer" if config_class == "GPTJConfig" else "num_hidden_layers": LAYERS},
            use_cache=False)
        with torch.device("meta"):
            model = getattr(transformers, model_class)(config)
        for sp in (False, True):
            plan = autopar.compile(model, node, global_batch_size=BATCH, seq_len=SEQ,
                                   constraints={"tp": 8, "sequence_parallel": sp})
            cfg = plan.config
            graph = autopar.trace(model, global_batch_size=cfg.micro_batch_size, seq_len=SEQ,
                                  dtype=plan.training.dtype)
            costs = costs_of_layout(graph, cfg, plan.tp_placements)
            where = dict(global_batch_size=BATCH, dtype=plan.training.dtype,
                         options=plan.training.estimate_options)
            summed = evaluate(costs, node, cfg, **where)
            apart = evaluate(_apart(costs), node, cfg, **where)
            print(f"{name:<14} {'yes' if sp else 'no':<3} {cfg.short():<34} "
                  f"{summed.step_time_s:>9.4f} {apart.step_time_s:>8.4f} "
                  f"{summed.step_time_s / apart.step_time_s:>6.3f} "
                  f"{summed.breakdown['tp_comm']:>8.4f} {apart.breakdown['tp_comm']:>7.4f}")


if __name__ == "__main__":
    main()
