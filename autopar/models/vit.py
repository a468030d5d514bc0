"""Vision Transformer (ViT): conv patch embedding, class token, learned positions,
pre-LayerNorm encoder layers with bidirectional attention, linear classification head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models.common import FeedForward

__all__ = ["ViT", "ViTConfig"]


@dataclass(frozen=True, kw_only=True)
class ViTConfig:
    image_size: int = 224
    patch_size: int = 16
    channels: int = 3
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    mlp_dim: int = 3072
    num_classes: int = 1000

    def __post_init__(self):
        if self.image_size % self.patch_size or self.dim % self.n_heads:
            raise ValueError("need image_size % patch_size == 0 and dim % n_heads == 0")


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.attention_norm = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)
        self.ffn_norm = nn.LayerNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg.dim, cfg.mlp_dim)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(b, s, 3, self.n_heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.wo(y.transpose(1, 2).reshape(b, s, -1))  # -1: d / tp under tensor parallel
        return x + self.feed_forward(self.ffn_norm(x))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.config = cfg
        patches = (cfg.image_size // cfg.patch_size) ** 2
        self.patch_embed = nn.Conv2d(cfg.channels, cfg.dim, cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, patches + 1, cfg.dim))
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)[:, 0])
