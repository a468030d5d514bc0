"""A model factory for the CLI tests (`--model cli_models:tiny_gpt`)."""

import torch

from autopar.models.gpt import GPT, GPTConfig


def tiny_gpt():
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=8192, max_seq_len=512, dim=512, n_layers=4, n_heads=8))
