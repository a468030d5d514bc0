"""Llama (2/3): RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU, untied head.
Parameter names follow torchtitan (``layers.0.attention.wq``, ``layers.0.feed_forward.w1``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from autopar.models.common import (
    AttentionImpl,
    SwiGLU,
    apply_rope,
    attention,
    rope_tables,
    token_positions,
)

__all__ = ["Llama", "LlamaConfig"]


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 128256
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 14336
    max_seq_len: int = 8192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    attention: AttentionImpl = AttentionImpl.SDPA
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"need dim % n_heads == 0 and n_heads % n_kv_heads == 0, got "
                             f"dim={self.dim}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}")


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.impl = cfg.n_heads, cfg.n_kv_heads, cfg.attention
        head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, -1).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, -1).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, -1).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attention(q, k, v, impl=self.impl, dropout=0.0, training=self.training)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, feed_forward: nn.Module | None = None):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = feed_forward or SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, make_block=Block):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(make_block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"seq_len {seq} exceeds max_seq_len {self.config.max_seq_len}")
        x = self.tok_embeddings(tokens)
        # token_positions: global positions of the local tokens under context parallel
        cos, sin = rope_tables(seq, self.config.dim // self.config.n_heads,
                               self.config.rope_theta, x.device, x.dtype,
                               positions=token_positions(seq, x.device))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))
