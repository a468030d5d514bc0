"""One-GPU-sized models written outside autopar's zoo, for timing generated training scripts
against their plans on a GPU (`autopar codegen --model-factory benchmarks.gpu_models:NAME`):
the test corpus's hand-written Llama and Hugging Face's ``LlamaForCausalLM`` at TinyLlama-1.1B
widths over 8 layers (hidden 2048, 16 query and 8 kv heads, SwiGLU 5632, vocabulary 32,000)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WIDTHS = {"dim": 2048, "n_layers": 8, "n_heads": 16, "n_kv_heads": 8, "ffn_dim": 5632}
VOCAB = 32000
MAX_SEQ = 2048


def plain_llama_1b():
    """tests/corpus.py's PlainLlama (Meta's reference style) at the widths above."""
    import torch

    from tests.corpus import PlainLlama

    torch.manual_seed(0)
    return PlainLlama(vocab=VOCAB, max_seq=MAX_SEQ, **WIDTHS)


def hf_llama_1b():
    """transformers.LlamaForCausalLM at the widths above (SDPA attention, untied head)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTHS["dim"], num_hidden_layers=WIDTHS["n_layers"],
        num_attention_heads=WIDTHS["n_heads"], num_key_value_heads=WIDTHS["n_kv_heads"],
        intermediate_size=WIDTHS["ffn_dim"], max_position_embeddings=MAX_SEQ,
        attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def plain_llama_8b_4l():
    """tests/corpus.py's PlainLlama at Llama-3-8B widths over 4 layers (hidden 4096, 32 query
    and 8 kv heads, SwiGLU 14336, vocabulary 128,256): GEMMs large enough for fp8 to pay."""
    import torch

    from tests.corpus import PlainLlama

    torch.manual_seed(0)
    return PlainLlama(vocab=128256, dim=4096, n_layers=4, n_heads=32, n_kv_heads=8,
                      ffn_dim=14336, max_seq=8192)
