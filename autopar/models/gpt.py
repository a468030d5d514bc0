"""GPT (GPT-2 / GPT-3, Megatron-style): learned positions, pre-LayerNorm, fused QKV,
GELU MLP of width ``ffn_mult * dim``, dropout where Megatron puts it, tied output head."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
import torch.nn.functional as F

from autopar.models.common import AttentionImpl, FeedForward, attention, token_positions

__all__ = ["GPT", "GPTConfig"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 50257
    max_seq_len: int = 1024
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    ffn_mult: int = 4
    dropout: float = 0.0
    attention: AttentionImpl = AttentionImpl.SDPA
    tie_embeddings: bool = True

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads, self.dropout, self.impl = cfg.n_heads, cfg.dropout, cfg.attention
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        y = attention(q, k, v, impl=self.impl, dropout=self.dropout, training=self.training)
        # -1, not d: under tensor parallelism this rank holds n_heads / tp heads
        return F.dropout(self.wo(y.transpose(1, 2).reshape(b, s, -1)), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.dropout = cfg.dropout
        self.attention_norm = nn.LayerNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_mult * cfg.dim)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + F.dropout(self.feed_forward(self.ffn_norm(x)), self.dropout, self.training)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        """Token ids ``[batch, seq]`` → logits ``[batch, seq, vocab]``."""
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"seq_len {seq} exceeds max_seq_len {self.config.max_seq_len}")
        pos = token_positions(seq, tokens.device)  # global positions under context parallel
        x = F.dropout(self.tok_embeddings(tokens) + self.pos_embeddings(pos),
                      self.config.dropout, self.training)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))
