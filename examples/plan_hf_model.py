"""Plan a Hugging Face model: build it from its config on the meta device (no weights, no
memory) and let autopar find the fastest layout on 4 DGX H100 nodes."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autopar

config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
with torch.device("meta"):
    model = LlamaForCausalLM(config)

cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=4)
plan = autopar.compile(model, cluster, global_batch_size=256, seq_len=8192, dtype="bf16")
print(plan.report())
