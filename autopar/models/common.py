"""Building blocks shared by the reference models: attention kinds, RoPE, feed-forwards, and
the sequence-shard hook through which a runtime runs the models on a slice of the sequence."""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

__all__ = ["AttentionImpl", "FeedForward", "SequenceShard", "SwiGLU", "apply_rope", "attention",
           "count_attention_calls", "recompute_attention_core", "rope_tables", "sequence_shard",
           "token_positions"]


class SequenceShard(Protocol):
    """What a process holding only some tokens of each sequence (context parallel) tells the
    models: where its local tokens sit in the full sequence, and how to run causal attention
    over the full sequence from its local q/k/v.  Implemented by ``autopar.runtime`` (which
    owns the communication); the models stay free of ``torch.distributed``."""

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """int64 ``[local_len]``: the global position of each local token, in local order."""
        ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the local queries over the keys/values of the whole sequence."""
        ...


# A process-wide setting rather than a context variable: autograd worker threads (backward on
# GPU) and activation-recompute replays during backward must see the same shard as forward.
_SEQUENCE_SHARD: SequenceShard | None = None


@contextlib.contextmanager
def sequence_shard(shard: SequenceShard | None) -> Iterator[None]:
    """Run the reference models on sequence shards while the block is active (``None``: whole
    sequences, the default).  Wrap forward *and* backward of a step in it."""
    global _SEQUENCE_SHARD
    previous, _SEQUENCE_SHARD = _SEQUENCE_SHARD, shard
    try:
        yield
    finally:
        _SEQUENCE_SHARD = previous


_RECOMPUTE_ATTENTION_CORE = False  # process-wide, like the sequence shard
_ATTENTION_CALLS: list[int] | None = None  # set by count_attention_calls


@contextlib.contextmanager
def count_attention_calls() -> Iterator[list[int]]:
    """Count the calls of :func:`attention` while the block is active (``calls[0]``): whether a
    model's attention goes through the hook that :func:`sequence_shard` replaces."""
    global _ATTENTION_CALLS
    previous, _ATTENTION_CALLS = _ATTENTION_CALLS, [0]
    try:
        yield _ATTENTION_CALLS
    finally:
        _ATTENTION_CALLS = previous


@contextlib.contextmanager
def recompute_attention_core(enabled: bool = True) -> Iterator[None]:
    """Selective activation recompute (Korthikanti et al. 2022, §4): while active, unfused
    (``MATH``) attention keeps only its q, k, v for backward and re-runs scores, softmax,
    dropout and the value product there, instead of keeping the score-sized tensors. Fused
    attention (``SDPA``) keeps no score tensors, so it is left as it is."""
    global _RECOMPUTE_ATTENTION_CORE
    previous, _RECOMPUTE_ATTENTION_CORE = _RECOMPUTE_ATTENTION_CORE, enabled
    try:
        yield
    finally:
        _RECOMPUTE_ATTENTION_CORE = previous


def token_positions(seq_len: int, device) -> torch.Tensor:
    """Positions of the ``seq_len`` tokens a model was given: ``0..seq_len-1`` normally, their
    global positions under an active :func:`sequence_shard`."""
    if _SEQUENCE_SHARD is None:
        return torch.arange(seq_len, device=device)
    return _SEQUENCE_SHARD.positions(seq_len, device)


class AttentionImpl(enum.Enum):
    """``SDPA``: ``F.scaled_dot_product_attention`` (a fused, flash-style kernel on GPU).
    ``MATH``: explicit ``softmax(q k^T / sqrt(d)) v`` that keeps the score tensors."""

    SDPA = "sdpa"
    MATH = "math"


def attention(q, k, v, *, impl: AttentionImpl, dropout: float, training: bool):
    """Causal attention over ``[batch, heads, seq, head_dim]``; k/v may have fewer heads.
    Under an active :func:`sequence_shard` the shard's attention runs instead (any ``impl``)."""
    if _ATTENTION_CALLS is not None:
        _ATTENTION_CALLS[0] += 1
    if _SEQUENCE_SHARD is not None:
        if dropout and training:
            raise NotImplementedError("attention dropout under context parallel (sequence "
                                      "shards) is not supported; set the model's dropout to 0 "
                                      "or plan with cp=1")
        return _SEQUENCE_SHARD.attention(q, k, v)
    if impl is AttentionImpl.SDPA:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout if training else 0.0, is_causal=True,
            enable_gqa=k.shape[1] != q.shape[1])
    if _RECOMPUTE_ATTENTION_CORE and torch.is_grad_enabled():
        # the RNG state is replayed, so the recomputed dropout mask is the forward's
        return torch.utils.checkpoint.checkpoint(_math_attention, q, k, v, dropout, training,
                                                 use_reentrant=False)
    return _math_attention(q, k, v, dropout, training)


def _math_attention(q, k, v, dropout: float, training: bool):
    """softmax(q kᵀ / sqrt(d) + causal mask) v, with the score tensors materialised."""
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    seq = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    probs = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    probs = F.dropout(probs, dropout, training)
    return probs @ v


def rope_tables(seq_len: int, head_dim: int, theta: float, device, dtype, positions=None):
    """cos/sin tables ``[seq, head_dim]`` for rotate-half RoPE, at token ``positions`` (int
    ``[seq]``; default ``0..seq_len-1``)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    if positions is None:
        positions = torch.arange(seq_len, device=device)
    angles = torch.outer(positions.float(), inv_freq)
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
