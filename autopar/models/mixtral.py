"""Mixtral-style sparse MoE transformer: the Llama block with its MLP replaced by top-k
routing over SwiGLU experts. Routing loops over experts with ``torch.where``, as eager
reference code does; the tracer costs it as an MoE leaf under uniform routing."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models.common import SwiGLU
from autopar.models.llama import Block, Llama, LlamaConfig

__all__ = ["MoE", "Mixtral", "MixtralConfig"]


@dataclass(frozen=True, kw_only=True)
class MixtralConfig(LlamaConfig):
    num_experts: int = 8
    top_k: int = 2

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"need 0 < top_k <= num_experts, got {self.top_k}, {self.num_experts}")


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(dim, hidden) for _ in range(num_experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = F.softmax(self.router(flat), dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view_as(x)


class Mixtral(Llama):
    def __init__(self, cfg: MixtralConfig):
        def make_block(c):
            return Block(c, MoE(c.dim, c.ffn_dim, c.num_experts, c.top_k))

        super().__init__(cfg, make_block=make_block)
