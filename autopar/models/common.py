"""Building blocks shared by the reference models: attention kinds, RoPE, feed-forwards."""

from __future__ import annotations

import enum
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["AttentionImpl", "FeedForward", "SwiGLU", "apply_rope", "attention", "rope_tables"]


class AttentionImpl(enum.Enum):
    """``SDPA``: ``F.scaled_dot_product_attention`` (a fused, flash-style kernel on GPU).
    ``MATH``: explicit ``softmax(q k^T / sqrt(d)) v`` that keeps the score tensors."""

    SDPA = "sdpa"
    MATH = "math"


def attention(q, k, v, *, impl: AttentionImpl, dropout: float, training: bool):
    """Causal attention over ``[batch, heads, seq, head_dim]``; k/v may have fewer heads."""
    if impl is AttentionImpl.SDPA:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout if training else 0.0, is_causal=True,
            enable_gqa=k.shape[1] != q.shape[1])
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    seq = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    probs = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    probs = F.dropout(probs, dropout, training)
    return probs @ v


def rope_tables(seq_len: int, head_dim: int, theta: float, device, dtype):
    """cos/sin tables ``[seq, head_dim]`` for rotate-half RoPE."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """Rotate ``x`` ``[batch, heads, seq, head_dim]`` by the RoPE tables."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class FeedForward(nn.Module):
    """GELU MLP: ``w2(gelu(w1 x))`` (GPT, ViT)."""

    def __init__(self, dim: int, hidden: int, *, bias: bool = True):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class SwiGLU(nn.Module):
    """Gated MLP: ``w2(silu(w1 x) * w3 x)`` (Llama, Mixtral experts)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
