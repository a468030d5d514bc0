"""Named presets with published dimensions, and ``build``.

Sources: GPT-2 (Radford et al. 2019, Table 2; vocab 50257, context 1024); GPT-3 (Brown et al.
2020, Table 2.1; context 2048); Llama 2 (Touvron et al. 2023) and Llama 3 (Dubey et al. 2024,
Table 3; vocab 128256); Mixtral 8x7B (Jiang et al. 2024, Table 1); ViT (Dosovitskiy et al.
2021, Table 1); ResNet (He et al. 2016, Table 1); Wide ResNet-50-2 (torchvision:
bottleneck width x2).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.models.mixtral import Mixtral, MixtralConfig
from autopar.models.resnet import ResNet, ResNetConfig
from autopar.models.vit import ViT, ViTConfig

__all__ = ["build", "list_presets", "preset"]


def _gpt3(dim, layers, heads):
    return GPTConfig(vocab_size=50257, max_seq_len=2048, dim=dim, n_layers=layers, n_heads=heads)


_PRESETS = {
    "gpt2": GPTConfig(dim=768, n_layers=12, n_heads=12),
    "gpt2-medium": GPTConfig(dim=1024, n_layers=24, n_heads=16),
    "gpt2-large": GPTConfig(dim=1280, n_layers=36, n_heads=20),
    "gpt2-xl": GPTConfig(dim=1600, n_layers=48, n_heads=25),
    "gpt3-1.3b": _gpt3(2048, 24, 16),
    "gpt3-6.7b": _gpt3(4096, 32, 32),
    "gpt3-13b": _gpt3(5120, 40, 40),
    "gpt3-175b": _gpt3(12288, 96, 96),
    "llama2-7b": LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                             ffn_dim=11008, max_seq_len=4096, rope_theta=10000.0, norm_eps=1e-5),
    "llama3-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "llama3-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    "llama3-405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                               ffn_dim=53248),
    "mixtral-8x7b": MixtralConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32,
                                  n_kv_heads=8, ffn_dim=14336, max_seq_len=32768,
                                  rope_theta=1e6, num_experts=8, top_k=2),
    "vit-b-16": ViTConfig(dim=768, n_layers=12, n_heads=12, mlp_dim=3072, patch_size=16),
    "vit-l-16": ViTConfig(dim=1024, n_layers=24, n_heads=16, mlp_dim=4096, patch_size=16),
    "vit-h-14": ViTConfig(dim=1280, n_layers=32, n_heads=16, mlp_dim=5120, patch_size=14),
    "resnet50": ResNetConfig(blocks=(3, 4, 6, 3), width_per_group=64),
    "resnet101": ResNetConfig(blocks=(3, 4, 23, 3), width_per_group=64),
    "resnet152": ResNetConfig(blocks=(3, 8, 36, 3), width_per_group=64),
    "wide-resnet50-2": ResNetConfig(blocks=(3, 4, 6, 3), width_per_group=128),
    "wide-resnet101-2": ResNetConfig(blocks=(3, 4, 23, 3), width_per_group=128),
}

_MODEL_OF = {MixtralConfig: Mixtral, LlamaConfig: Llama, GPTConfig: GPT, ViTConfig: ViT,
             ResNetConfig: ResNet}


def list_presets() -> list[str]:
    return sorted(_PRESETS)


def preset(name: str, **overrides):
    """The config of a preset, with fields replaced by ``overrides`` (e.g. ``n_layers=2``)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(list_presets())}")
    return dataclasses.replace(_PRESETS[name], **overrides)


def build(name_or_config, *, device="meta", dtype: torch.dtype | None = None,
          **overrides) -> nn.Module:
    """A model from a preset name or a config; ``overrides`` replace config fields."""
    if isinstance(name_or_config, str):
        cfg = preset(name_or_config, **overrides)
    elif type(name_or_config) in _MODEL_OF:
        cfg = dataclasses.replace(name_or_config, **overrides)
    else:
        raise ValueError(f"no model for {type(name_or_config).__name__}; pass a preset name or "
                         f"one of {[c.__name__ for c in _MODEL_OF]}")
    model_cls = _MODEL_OF[type(cfg)]
    with torch.device(device):
        model = model_cls(cfg)
    return model.to(dtype) if dtype is not None else model
