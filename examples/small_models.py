"""Small models that train in seconds on a CPU, for trying a plan end to end with gloo:

    autopar plan --model examples.small_models:small_llama --cluster cpu-gloo --nodes 1 \
        --global-batch 8 --seq-len 64 --dtype fp32 --pin tp=2 -o plan.json
    autopar codegen plan.json --model-factory examples.small_models:small_llama -o train.py
    torchrun --nproc_per_node=4 train.py --steps 10
    python train.py --reference --steps 10      # the same steps in one process, unsharded

A factory returns the model with its weights, identical on every rank (seeded here);
``small_hf_llama`` is a Hugging Face model, run as `transformers` writes it.
"""

import torch

from autopar.models import GPT, GPTConfig, Llama, LlamaConfig


def small_llama() -> Llama:
    """Llama shape (RoPE, GQA, SwiGLU), dim 256, 4 layers, vocab 512: 3.4 M parameters."""
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
                             ffn_dim=768, max_seq_len=128))


def small_gpt() -> GPT:
    """GPT-2 shape (learned positions, fused qkv, tied head), dim 256, 4 layers, vocab 512."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=512, max_seq_len=128, dim=256, n_layers=4, n_heads=8))


def small_hf_llama():
    """A Hugging Face ``LlamaForCausalLM`` from a small config (dim 256, 4 layers, 8 heads, 4
    kv heads, vocab 512), as ``transformers`` writes it: the runtime needs no change to it."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = HFLlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                           max_position_embeddings=128, attn_implementation="sdpa",
                           use_cache=False)
    return LlamaForCausalLM(config)
