"""Small transformers written the way public code bases write them, not the way autopar's own
models (autopar/models) are written.

autopar's planner and runtime must handle models they did not author: other attribute names,
fused or split projections, buffers computed at construction, bare ``nn.Parameter``s, tuples
or dicts as outputs, Python loops over experts.  Each factory below is self-contained code in
the style of one well-known project; none shares a class with another, and none is named to
suit autopar.

Every factory takes no argument and returns a fresh fp32 model on the current default device
(so ``with torch.device("meta"): factory()`` builds it without memory), with weights fixed by
``torch.manual_seed``.  Dropout is 0 everywhere.  Sizes (hidden 64, 4 layers, 4 heads, vocab
256) keep a forward and backward of 8 sequences of 64 tokens to a few milliseconds on a CPU.

Token models take a LongTensor ``[batch, seq]`` of token ids as their only positional input
and return logits ``[batch, seq, VOCAB]`` as a tensor, a tuple, a dict or a Hugging Face
``ModelOutput``; ``logits_of`` unwraps any of them.  Image models take ``[batch, 3, 16, 16]``
images and return ``[batch, NUM_CLASSES]`` class logits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256
MAX_SEQ = 128
NUM_CLASSES = 10
IMAGE_SHAPE = (3, 16, 16)

TOKEN_MODELS = ["plain_llama", "plain_mqa", "nano_gpt", "torch_transformer",
                "torch_transformer_seq_first", "litgpt_style", "scaled_mlp", "moe_loop",
                "moe_batched",
                "hf_llama", "hf_mistral", "hf_qwen2", "hf_mixtral", "hf_gpt2", "hf_qwen3",
                "hf_phi3", "hf_gpt_neox", "hf_gemma2", "hf_gemma3", "hf_olmo2",
                "hf_gpt_bigcode", "hf_gemma", "hf_opt", "hf_falcon", "hf_bloom", "hf_phi", "hf_bert",
                "hf_qwen3_moe", "hf_olmoe", "hf_deepseek_v3",
                "hf_gptj", "hf_stablelm", "hf_cohere", "hf_granite", "hf_starcoder2",
                "hf_persimmon", "hf_mpt", "hf_codegen", "hf_nemotron", "hf_glm", "hf_exaone4",
                "hf_smollm3", "hf_granitemoe", "hf_qwen2_moe", "hf_phimoe", "hf_dbrx",
                "hf_gpt2_odd_vocab", "titan_llama", "hf_modernbert", "hf_llama4", "hf_gpt_oss",
                "hf_openai_gpt", "hf_apertus", "hf_olmo3", "hf_ernie", "hf_glm4",
                "hf_seed_oss", "hf_arcee", "hf_hunyuan", "hf_cohere2", "hf_helium", "hf_gptneo",
                "hf_xglm", "hf_biogpt", "hf_deepseek_v2", "hf_roberta", "hf_distilbert",
                "hf_vaultgemma", "hf_flexolmo", "hf_olmo", "hf_ministral", "hf_doge", "hf_lfm2",
                "hf_ernie45_moe", "hf_glm4_moe", "hf_qwen3_next", "hf_minimax",
                "hf_falcon_h1", "hf_bitnet", "hf_jamba"]
# token models whose attention is not causal
BIDIRECTIONAL = ("hf_bert", "hf_modernbert", "hf_roberta", "hf_distilbert")
IMAGE_MODELS = ["vit_encoder", "torchvision_vit"]


def logits_of(output) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, the first element of a tuple or
    list, or the "logits" entry of a dict or a Hugging Face ``ModelOutput``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):  # ModelOutput is an OrderedDict
        return output["logits"]
    if isinstance(output, (tuple, list)):
        return output[0]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(f"no logits in a {type(output).__name__}")


# =============================================================================================
# plain_llama: the original Meta llama repository
# =============================================================================================
class _LlamaRMSNorm(nn.Module):
    """Meta's RMSNorm, written out rather than ``nn.RMSNorm``: the normalisation is three
    elementwise ops and a reduction, not one recognisable module type."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


def _rope_tables(head_dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(end).float(), freqs)  # [end, head_dim / 2]
    return angles.cos(), angles.sin()


def _rotate_interleaved(x, cos, sin):
    """RoPE on (even, odd) pairs of the head dim, as Meta's complex-number version computes
    it: x [b, s, heads, head_dim], cos/sin [s, head_dim / 2]."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class _PlainAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.q = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.k = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        # the global head counts: a tensor-parallel rank holding half the columns of q
        # cannot take this view unless the runtime rewrites it
        q = self.q(x).view(b, s, self.n_heads, self.head_dim)
        k = self.k(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.v(x).view(b, s, self.n_kv_heads, self.head_dim)
        q, k = _rotate_interleaved(q, cos, sin), _rotate_interleaved(k, cos, sin)
        n_rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(n_rep, dim=2)
        v = v.repeat_interleave(n_rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class _PlainSwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _PlainBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, ffn_dim):
        super().__init__()
        self.attn_norm = _LlamaRMSNorm(dim)
        self.attn = _PlainAttention(dim, n_heads, n_kv_heads)
        self.mlp_norm = _LlamaRMSNorm(dim)
        self.mlp = _PlainSwiGLU(dim, ffn_dim)

    def forward(self, x, cos, sin):
        h = x + self.attn(self.attn_norm(x), cos, sin)
        return h + self.mlp(self.mlp_norm(h))


class PlainLlama(nn.Module):
    """A Llama written like Meta's reference repository (llama/model.py): a hand-written
    RMSNorm, separate q/k/v/o projections viewed with the global head counts, grouped-query
    attention by ``repeat_interleave``, rotary embeddings on interleaved (even, odd) pairs
    from cos/sin tables built at construction, a SwiGLU MLP and an untied output head.

    What it breaks: the rotary tables are non-persistent buffers, absent from the state dict
    and computed from nothing (a meta-built model has none to copy); the attention's views
    use the global head counts; the blocks are called with extra positional arguments; no
    name matches autopar's Llama (``wq``, ``feed_forward``, ``tok_embeddings``...)."""

    def __init__(self, vocab=VOCAB, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128,
                 max_seq=MAX_SEQ):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_PlainBlock(dim, n_heads, n_kv_heads, ffn_dim)
                                    for _ in range(n_layers))
        self.final_norm = _LlamaRMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        cos, sin = _rope_tables(dim // n_heads, max_seq)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens):
        s = tokens.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, cos, sin)
        return self.head(self.final_norm(h)).float()


def plain_llama():
    """Meta-llama style: hand-written RMSNorm, interleaved RoPE from buffers, GQA 4/2 heads,
    untied head; returns a tensor."""
    torch.manual_seed(101)
    return PlainLlama()


def plain_mqa():
    """The Meta-llama style model with multi-query attention: one k/v head repeated to the 4
    query heads by ``repeat_interleave`` before SDPA."""
    torch.manual_seed(126)
    return PlainLlama(n_kv_heads=1)


# =============================================================================================
# nano_gpt: Karpathy's nanoGPT
# =============================================================================================
class _NanoCausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout=0.0, bias=True):
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                           dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class _NanoMLP(nn.Module):
    def __init__(self, n_embd, dropout=0.0, bias=True):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class _NanoBlock(nn.Module):
    def __init__(self, n_embd, n_head, dropout=0.0, bias=True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = _NanoCausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = _NanoMLP(n_embd, dropout, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """GPT-2 as nanoGPT (model.py) writes it: a ``transformer`` ModuleDict of ``wte``,
    ``wpe``, ``drop``, ``h`` and ``ln_f``; one fused ``c_attn`` projection split by
    ``.split(n_embd, dim=2)`` into q, k and v; biases everywhere; the head tied by assigning
    ``wte.weight = lm_head.weight``; GPT-2's scaled init of the residual projections.

    What it breaks: the blocks sit inside a ModuleDict, the position ids are an ``arange``
    made inside forward, the q/k/v split needs ``c_attn``'s columns in [q | k | v] order on
    every rank (a plain column split hands rank 0 all of q and part of k), the tied weight
    is reached under two names, and the output is a ``(logits, loss)`` tuple.  Unlike
    nanoGPT's inference path, which keeps only the last position, the logits cover every
    position."""

    def __init__(self, vocab=VOCAB, block_size=MAX_SEQ, n_layer=4, n_head=4, n_embd=64,
                 dropout=0.0, bias=True):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([_NanoBlock(n_embd, n_head, dropout, bias) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd, bias=bias),
        ))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.block_size, f"sequence of {t} longer than block size {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss


def nano_gpt():
    """nanoGPT style: fused c_attn split in three, learned positions, biases, tied head;
    returns ``(logits, None)``."""
    torch.manual_seed(102)
    return NanoGPT()


# =============================================================================================
# torch_transformer: a GPT written with PyTorch's own nn.TransformerEncoder
# =============================================================================================
class TorchTransformerLM(nn.Module):
    """Learned positions, pre-norm ``nn.TransformerEncoderLayer`` blocks (``nn.MultiheadAttention``
    with its packed ``in_proj_weight``, a causal mask), GELU MLP, untied head. With
    ``batch_first=False`` (PyTorch's default) the blocks run on ``[seq, batch, dim]``,
    transposed in and out."""

    def __init__(self, dim=64, heads=4, layers=2, ffn=128, batch_first=True):
        super().__init__()
        self.batch_first = batch_first
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(MAX_SEQ, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, ffn, dropout=0.0, activation="gelu",
                                           batch_first=batch_first, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx):
        seq = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(seq, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=idx.device)
        if self.batch_first:
            return self.head(self.norm(self.encoder(x, mask=mask, is_causal=True)))
        x = self.encoder(x.transpose(0, 1), mask=mask, is_causal=True).transpose(0, 1)
        return self.head(self.norm(x))


def torch_transformer():
    """PyTorch's nn.TransformerEncoder as a causal language model."""
    torch.manual_seed(110)
    return TorchTransformerLM()


def torch_transformer_seq_first():
    """The same on sequence-first tensors (``batch_first=False``, PyTorch's default)."""
    torch.manual_seed(113)
    return TorchTransformerLM(batch_first=False)


# =============================================================================================
# scaled_mlp: an MLP that scales its hidden features by a learned scalar
# =============================================================================================
class _ScaledMlpBlock(nn.Module):
    """Pre-norm MLP block whose activation is scaled by one trainable element (a learned
    temperature, as xIELU's or LayerScale-like gates write it, here read directly)."""

    def __init__(self, dim=64):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.alpha = nn.Parameter(torch.full((1,), 0.7))

    def forward(self, x):
        return x + self.down(self.alpha * F.gelu(self.up(self.norm(x))))


class ScaledMlp(nn.Module):
    def __init__(self, layers=2, dim=64):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(_ScaledMlpBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def scaled_mlp():
    """MLP blocks scaling their split hidden features by a learned scalar (no attention)."""
    torch.manual_seed(112)
    return ScaledMlp()


# =============================================================================================
# litgpt_style: lit-gpt's Pythia (GPT-NeoX) configuration
# =============================================================================================
def _neox_rope_cache(seq_len, n_elem, device, base=10000):
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, device=device).float() / n_elem))
    idx_theta = torch.outer(torch.arange(seq_len, device=device).float(), theta)
    idx_theta = idx_theta.repeat(1, 2)  # [seq, n_elem]: the rotate-half layout
    return idx_theta.cos(), idx_theta.sin()


def _apply_rope_half(x, cos, sin):
    head_size = x.size(-1)
    x1 = x[..., : head_size // 2]
    x2 = x[..., head_size // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class _LitAttention(nn.Module):
    def __init__(self, n_embd, n_head, rope_n_elem):
        super().__init__()
        self.n_head, self.head_size = n_head, n_embd // n_head
        self.rope_n_elem = rope_n_elem
        self.attn = nn.Linear(n_embd, 3 * n_embd, bias=True)
        self.proj = nn.Linear(n_embd, n_embd, bias=True)

    def forward(self, x, cos, sin):
        B, T, C = x.size()
        qkv = self.attn(x)
        # GPT-NeoX layout: the fused columns run head by head, [q_h | k_h | v_h] per head
        qkv = qkv.view(B, T, self.n_head, 3 * self.head_size).permute(0, 2, 1, 3)
        q, k, v = qkv.split(self.head_size, dim=-1)  # each [B, nh, T, hs]
        n = self.rope_n_elem
        q = torch.cat((_apply_rope_half(q[..., :n], cos, sin), q[..., n:]), dim=-1)
        k = torch.cat((_apply_rope_half(k[..., :n], cos, sin), k[..., n:]), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           scale=1.0 / math.sqrt(self.head_size))
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class _LitMLP(nn.Module):
    def __init__(self, n_embd, intermediate_size):
        super().__init__()
        self.fc = nn.Linear(n_embd, intermediate_size, bias=True)
        self.proj = nn.Linear(intermediate_size, n_embd, bias=True)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class _LitBlock(nn.Module):
    def __init__(self, n_embd, n_head, intermediate_size, rope_n_elem):
        super().__init__()
        self.norm_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.attn = _LitAttention(n_embd, n_head, rope_n_elem)
        self.norm_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.mlp = _LitMLP(n_embd, intermediate_size)

    def forward(self, x, cos, sin):
        # parallel residual: attention and MLP both read the block's input
        return x + self.attn(self.norm_1(x), cos, sin) + self.mlp(self.norm_2(x))


class LitGPTStyle(nn.Module):
    """A Pythia-like GPT-NeoX as lit-gpt (lit_gpt/model.py) writes it: the fused ``attn``
    projection laid out head by head (``view(B, T, n_head, 3 * head_size)`` then split on
    the last dim), a parallel residual ``x + attn(norm_1(x)) + mlp(norm_2(x))``, rotary
    embeddings (rotate-half) on the first quarter of each head's dims only, recomputed in
    every forward, LayerNorm and GELU, an untied head.

    What it breaks: the block is not two sequential residual halves; the q/k/v split is per
    head, so the fused columns must be sharded by whole heads (not in thirds); the rotary
    tables are neither parameters nor buffers; partial rotary slices the head dim; the
    output is a dict ``{"logits": ...}``."""

    def __init__(self, vocab=VOCAB, n_embd=64, n_layer=4, n_head=4, intermediate_size=256,
                 rotary_percentage=0.25):
        super().__init__()
        head_size = n_embd // n_head
        self.rope_n_elem = int(rotary_percentage * head_size)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd),
            h=nn.ModuleList(_LitBlock(n_embd, n_head, intermediate_size, self.rope_n_elem)
                            for _ in range(n_layer)),
            ln_f=nn.LayerNorm(n_embd, eps=1e-5),
        ))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx):
        T = idx.size(1)
        cos, sin = _neox_rope_cache(T, self.rope_n_elem, idx.device)
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        x = self.transformer.ln_f(x)
        return {"logits": self.lm_head(x)}


def litgpt_style():
    """lit-gpt/Pythia style: per-head fused qkv, parallel residual, partial rotate-half RoPE;
    returns ``{"logits": ...}``."""
    torch.manual_seed(103)
    return LitGPTStyle()


# =============================================================================================
# moe_loop: Mixtral (Mistral's reference code) with a Python loop over experts
# =============================================================================================
class _MixRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).type_as(x)


class _MixAttention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.query = nn.Linear(dim, dim, bias=False)
        self.key = nn.Linear(dim, dim, bias=False)
        self.value = nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        q = self.query(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.key(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.value(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope_half(q, cos, sin), _apply_rope_half(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class _MixExpert(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class _SparseMoE(nn.Module):
    """Mistral's MoeLayer: top-k of the router logits, softmax over those k, and a loop over
    experts that gathers each expert's tokens with ``torch.where`` and scatters the weighted
    results back with ``index_add_``."""

    def __init__(self, dim, hidden, num_experts, topk):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(_MixExpert(dim, hidden) for _ in range(num_experts))
        self.topk = topk

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        gate_logits = self.gate(flat)
        weights, selected = torch.topk(gate_logits, self.topk, dim=-1)
        weights = F.softmax(weights, dim=-1, dtype=torch.float).to(flat.dtype)
        results = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            token_idx, nth = torch.where(selected == i)
            out = expert(flat[token_idx]) * weights[token_idx, nth, None]
            results.index_add_(0, token_idx, out)
        return results.view(shape)


class _MixBlock(nn.Module):
    def __init__(self, dim, n_heads, hidden, num_experts, topk):
        super().__init__()
        self.input_norm = _MixRMSNorm(dim)
        self.self_attn = _MixAttention(dim, n_heads)
        self.post_norm = _MixRMSNorm(dim)
        self.moe = _SparseMoE(dim, hidden, num_experts, topk)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_norm(x), cos, sin)
        return x + self.moe(self.post_norm(x))


class MoELoop(nn.Module):
    """A Llama-like decoder whose MLPs are Mixtral-style sparse MoE layers, written after
    Mistral's reference code: a bias-free ``gate`` router over 4 SwiGLU ``experts`` in an
    ``nn.ModuleList``, top-2 routing (the count kept in ``self.topk``), a Python loop over
    experts with ``torch.where`` and ``index_add_``; hand-written RMSNorm, full multi-head
    attention with rotate-half RoPE.

    What it breaks: the routing is data-dependent control flow (the shapes inside the loop
    depend on token values, so it cannot run on the meta device as is); the top-k count and
    the router are found under other names than ``top_k``/``router``; the expert weights
    are separate Linears per expert rather than stacked tensors."""

    def __init__(self, vocab=VOCAB, dim=64, n_layers=4, n_heads=4, hidden=128, num_experts=4,
                 topk=2, rope_theta=10000.0):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.decoder = nn.ModuleList(_MixBlock(dim, n_heads, hidden, num_experts, topk)
                                     for _ in range(n_layers))
        self.norm_out = _MixRMSNorm(dim)
        self.unembed = nn.Linear(dim, vocab, bias=False)
        self.head_dim, self.rope_theta = dim // n_heads, rope_theta

    def forward(self, tokens):
        s = tokens.shape[1]
        cos, sin = _neox_rope_cache(s, self.head_dim, tokens.device, base=self.rope_theta)
        h = self.tok_emb(tokens)
        for block in self.decoder:
            h = block(h, cos, sin)
        return self.unembed(self.norm_out(h))


def moe_loop():
    """Mixtral-style MoE (4 SwiGLU experts, top-2, loop with ``torch.where``/``index_add_``),
    RMSNorm, MHA; returns a tensor."""
    torch.manual_seed(104)
    return MoELoop()


# =============================================================================================
# moe_batched: experts as stacked weight tensors, GShard-style einsum dispatch
# =============================================================================================
class _StackedExperts(nn.Module):
    """Top-2 MoE with all experts' weights in two stacked tensors, ``w_in [E, h, 2f]`` (a
    GELU-gated input projection) and ``w_out [E, f, h]``, dispatched as GShard and Switch
    Transformer do: one-hot dispatch and combine tensors ``[tokens, E, capacity]`` and
    batched einsums over the experts.  The capacity is every token, so none is dropped and
    the result equals a per-token top-2 mixture."""

    def __init__(self, dim, ffn, num_experts, k=2):
        super().__init__()
        self.num_experts, self.k = num_experts, k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(num_experts, dim, 2 * ffn))
        self.w_out = nn.Parameter(torch.empty(num_experts, ffn, dim))
        nn.init.normal_(self.w_in, std=dim ** -0.5)
        nn.init.normal_(self.w_out, std=ffn ** -0.5)

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])                       # [T, h]
        probs = self.router(tokens).softmax(dim=-1)             # [T, E]
        top_p, top_e = probs.topk(self.k, dim=-1)               # [T, k]
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        capacity = tokens.shape[0]
        # slot of each (token, choice) in its expert's buffer: count of earlier assignments
        mask = F.one_hot(top_e, self.num_experts).to(tokens.dtype)   # [T, k, E]
        flat_mask = mask.permute(1, 0, 2).reshape(-1, self.num_experts)  # [k*T, E], choice-major
        slot = (torch.cumsum(flat_mask, dim=0) - 1) * flat_mask
        slot = slot.reshape(self.k, -1, self.num_experts).permute(1, 0, 2)  # [T, k, E]
        slot_1h = F.one_hot(slot.sum(-1).long(), capacity).to(tokens.dtype)  # [T, k, C]
        dispatch = torch.einsum("tke,tkc->tec", mask, slot_1h)           # [T, E, C]
        combine = torch.einsum("tk,tke,tkc->tec", top_p, mask, slot_1h)  # [T, E, C]
        expert_in = torch.einsum("tec,th->ech", dispatch, tokens)        # [E, C, h]
        gate, up = torch.bmm(expert_in, self.w_in).chunk(2, dim=-1)      # [E, C, f] each
        expert_out = torch.bmm(F.gelu(gate) * up, self.w_out)            # [E, C, h]
        out = torch.einsum("tec,ech->th", combine, expert_out)
        return out.reshape(shape)


class _BatchedBlock(nn.Module):
    def __init__(self, dim, n_heads, ffn, num_experts):
        super().__init__()
        self.n_heads = n_heads
        self.ln_attn = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln_moe = nn.LayerNorm(dim)
        self.moe = _StackedExperts(dim, ffn, num_experts)

    def _attention(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.n_heads, -1)).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(2))

    def forward(self, x):
        x = x + self._attention(self.ln_attn(x))
        return x + self.moe(self.ln_moe(x))


class MoEBatched(nn.Module):
    """A decoder whose MLPs are top-2 MoE layers with stacked expert weights and einsum
    dispatch (GShard / Switch / Megablocks-reference style), LayerNorm, GELU, a learned
    absolute position table held as a bare ``nn.Parameter`` and attention inlined in the
    block.

    What it breaks: the experts are not modules at all but two 3-D parameters (expert
    parallelism must shard dim 0 of a Parameter); the routing has no data-dependent shapes,
    so the whole MoE runs on the meta device and costs every expert on a capacity of all
    tokens; the position table is a top-level Parameter, not an Embedding."""

    def __init__(self, vocab=VOCAB, dim=64, n_layers=4, n_heads=4, ffn=64, num_experts=4,
                 max_seq=MAX_SEQ):
        super().__init__()
        self.token_table = nn.Embedding(vocab, dim)
        self.position_table = nn.Parameter(torch.randn(max_seq, dim) * 0.02)
        self.stack = nn.ModuleList(_BatchedBlock(dim, n_heads, ffn, num_experts)
                                   for _ in range(n_layers))
        self.ln_out = nn.LayerNorm(dim)
        self.readout = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.token_table(tokens) + self.position_table[: tokens.shape[1]]
        for block in self.stack:
            x = block(x)
        return self.readout(self.ln_out(x))


def moe_batched():
    """MoE with stacked ``w_in``/``w_out`` expert tensors, router + top-2, GShard einsum
    dispatch, LayerNorm, GELU; returns a tensor."""
    torch.manual_seed(105)
    return MoEBatched()


# =============================================================================================
# vit_encoder: timm's VisionTransformer
# =============================================================================================
class _PatchEmbed(nn.Module):
    def __init__(self, img_size=16, patch_size=4, in_chans=3, embed_dim=64):
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)  # B, N, C


class _TimmAttention(nn.Module):
    def __init__(self, dim, num_heads, qkv_bias=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class _TimmMlp(nn.Module):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(0.0)
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop2 = nn.Dropout(0.0)

    def forward(self, x):
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class _TimmBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = _TimmAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = _TimmMlp(dim, int(dim * mlp_ratio))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VitEncoder(nn.Module):
    """A ViT classifier as timm (timm/models/vision_transformer.py) writes it: a Conv2d
    ``patch_embed``, a ``cls_token`` and a ``pos_embed`` as bare Parameters, blocks in an
    ``nn.Sequential`` with the fused qkv reshaped ``(B, N, 3, heads, hd)`` and permuted to
    put q/k/v first, non-causal attention, and a ``head`` on the class token.

    What it breaks: the input is a float image batch, not token ids; the sequence (patches
    plus one class token, 17) is made inside the model; the blocks are an ``nn.Sequential``
    called as one module; the loss reads one position, not every token."""

    def __init__(self, img_size=16, patch_size=4, in_chans=3, num_classes=NUM_CLASSES,
                 embed_dim=64, depth=4, num_heads=4, mlp_ratio=4.0):
        super().__init__()
        self.num_classes = num_classes
        self.patch_embed = _PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(0.0)
        self.blocks = nn.Sequential(*[_TimmBlock(embed_dim, num_heads, mlp_ratio)
                                      for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward_features(self, x):
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.pos_drop(x + self.pos_embed)
        x = self.blocks(x)
        return self.norm(x)

    def forward(self, x):
        return self.head(self.forward_features(x)[:, 0])


def vit_encoder():
    """timm-style ViT: 3x16x16 images in 4x4 patches, class token, 2 blocks, 10 classes."""
    torch.manual_seed(106)
    return VitEncoder()


class _TorchvisionBlock(nn.Module):
    """torchvision's EncoderBlock: ``nn.MultiheadAttention`` (packed q/k/v projection) and
    an MLP ``nn.Sequential``, pre-norm residuals."""

    def __init__(self, dim, heads, mlp_dim):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Dropout(0.0),
                                 nn.Linear(mlp_dim, dim), nn.Dropout(0.0))

    def forward(self, x):
        h = self.ln_1(x)
        h, _ = self.self_attention(h, h, h, need_weights=False)
        x = x + h
        return x + self.mlp(self.ln_2(x))


class TorchvisionVit(nn.Module):
    """A ViT as torchvision writes it (torchvision/models/vision_transformer.py): a
    ``conv_proj`` patch convolution, a ``class_token``, an encoder holding the position
    embedding and its blocks in an ``nn.Sequential`` of ``nn.MultiheadAttention`` layers, a
    ``heads`` classifier on the class token."""

    def __init__(self, img_size=16, patch_size=4, dim=64, depth=2, heads=4,
                 num_classes=NUM_CLASSES):
        super().__init__()
        self.patch_size = patch_size
        self.conv_proj = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        seq = (img_size // patch_size) ** 2 + 1
        self.pos_embedding = nn.Parameter(torch.empty(1, seq, dim).normal_(std=0.02))
        self.layers = nn.Sequential(*[_TorchvisionBlock(dim, heads, 2 * dim)
                                      for _ in range(depth)])
        self.ln = nn.LayerNorm(dim, eps=1e-6)
        self.heads = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.ln(self.layers(x + self.pos_embedding))
        return self.heads(x[:, 0])


def torchvision_vit():
    """torchvision-style ViT: 3x16x16 images in 4x4 patches, ``nn.MultiheadAttention``."""
    torch.manual_seed(111)
    return TorchvisionVit()


# =============================================================================================
# Hugging Face transformers models from small configs
# =============================================================================================
_HF_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_SEQ,
                   attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                   use_cache=False)


def _hf(config_name, model_name, seed, attn_implementation="sdpa", **kwargs):
    import transformers

    config = getattr(transformers, config_name)(**kwargs,
                                                attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).float()


def hf_llama():
    """``transformers.LlamaForCausalLM``: GQA 4/2 heads, untied head (the family's default);
    returns a ``CausalLMOutputWithPast``."""
    return _hf("LlamaConfig", "LlamaForCausalLM", 107, **_HF_DECODER)


def hf_mistral():
    """``transformers.MistralForCausalLM`` (sliding window 4096, wider than any sequence
    here); GQA 4/2 heads, untied head."""
    return _hf("MistralConfig", "MistralForCausalLM", 108, **_HF_DECODER)


def hf_qwen2():
    """``transformers.Qwen2ForCausalLM``: biases on the q, k and v projections (none on o),
    GQA 4/2 heads, untied head (Qwen2Config's default)."""
    return _hf("Qwen2Config", "Qwen2ForCausalLM", 109, **_HF_DECODER)


def hf_mixtral():
    """``transformers.MixtralForCausalLM``: 4 experts, top-2, no router jitter; the experts
    are stacked 3-D tensors (``gate_up_proj``, ``down_proj``) as transformers 5 stores them."""
    return _hf("MixtralConfig", "MixtralForCausalLM", 110, **_HF_DECODER, num_local_experts=4,
               num_experts_per_tok=2, router_jitter_noise=0.0)


def hf_gpt2():
    """``transformers.GPT2LMHeadModel``: Conv1D layers (weights stored [in, out]), fused
    ``c_attn``, learned positions (128), tied head (GPT-2's default), every dropout 0."""
    return _hf("GPT2Config", "GPT2LMHeadModel", 111, vocab_size=VOCAB, n_embd=64, n_layer=4,
               n_head=4, n_positions=MAX_SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
               summary_first_dropout=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)



def hf_qwen3():
    """``transformers.Qwen3ForCausalLM``: RMSNorm over each head of q and k (``q_norm``,
    ``k_norm``) before RoPE, head_dim 16 set apart from hidden / heads."""
    return _hf("Qwen3Config", "Qwen3ForCausalLM", 112, **_HF_DECODER, head_dim=16)


def hf_phi3():
    """``transformers.Phi3ForCausalLM``: fused ``qkv_proj`` (q, then k, then v rows: GQA 4/2)
    and fused ``gate_up_proj`` split by ``chunk``."""
    return _hf("Phi3Config", "Phi3ForCausalLM", 113, **_HF_DECODER, resid_pdrop=0.0,
               embd_pdrop=0.0)


def hf_gpt_neox():
    """``transformers.GPTNeoXForCausalLM``: fused ``query_key_value`` laid out head by head
    ([heads, 3, head_dim] rows), parallel attention and MLP residual, rotary on a quarter of
    each head, LayerNorm with biases, untied ``embed_out``."""
    return _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", 114, vocab_size=VOCAB, hidden_size=64,
               intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               max_position_embeddings=MAX_SEQ, rotary_pct=0.25, hidden_dropout=0.0,
               attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)


def hf_gemma2():
    """``transformers.Gemma2ForCausalLM`` with its eager attention (hand-written scores with
    tanh soft-capping: SDPA is not offered for it): sliding-window and global layers
    alternate (two kinds of block in one list), embeddings scaled by sqrt(hidden), norms
    before and after each sub-layer, final logit soft-capping, tied head."""
    return _hf("Gemma2Config", "Gemma2ForCausalLM", 115, **_HF_DECODER, head_dim=16,
               attn_implementation="eager")


def hf_gemma3():
    """``transformers.Gemma3ForCausalLM`` (text): five sliding-window layers (window 16,
    shorter than the sequences here) to one global layer, RMSNorm on q and k, tied head."""
    return _hf("Gemma3TextConfig", "Gemma3ForCausalLM", 124, **_HF_DECODER, head_dim=16,
               sliding_window=16)


def hf_olmo2():
    """``transformers.Olmo2ForCausalLM``: RMSNorm over the whole q and k projections (not per
    head), norms after each sub-layer instead of before."""
    return _hf("Olmo2Config", "Olmo2ForCausalLM", 116, **_HF_DECODER)


def hf_gpt_bigcode():
    """``transformers.GPTBigCodeForCausalLM`` (StarCoder): multi-query attention (one k/v
    head) in a fused ``c_attn`` of q then k then v rows, learned positions, tied head."""
    return _hf("GPTBigCodeConfig", "GPTBigCodeForCausalLM", 117, vocab_size=VOCAB, n_embd=64,
               n_layer=4, n_head=4, n_positions=MAX_SEQ, multi_query=True, resid_pdrop=0.0,
               embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)


def hf_gemma():
    """``transformers.GemmaForCausalLM`` (Gemma 1 as its 2B size has it): multi-query attention
    (4 query heads, one k/v head) with separate k and v projections, GeGLU MLP, embeddings
    scaled by sqrt(hidden), tied head."""
    return _hf("GemmaConfig", "GemmaForCausalLM", 125, **{**_HF_DECODER, "num_key_value_heads": 1},
               head_dim=16)


def hf_opt():
    """``transformers.OPTForCausalLM``: learned positions offset by 2, ReLU MLP, biases
    everywhere, tied head."""
    return _hf("OPTConfig", "OPTForCausalLM", 118, vocab_size=VOCAB, hidden_size=64,
               ffn_dim=128, num_hidden_layers=4, num_attention_heads=4, word_embed_proj_dim=64,
               max_position_embeddings=MAX_SEQ, dropout=0.0, attention_dropout=0.0,
               use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=1)


def hf_falcon():
    """``transformers.FalconForCausalLM``, new decoder architecture: one fused
    ``query_key_value`` grouped by kv head ([kv heads, q per kv + 2, head_dim] rows, k and v
    taken by list indices), parallel attention and MLP, GQA 4/2, tied head."""
    return _hf("FalconConfig", "FalconForCausalLM", 121, vocab_size=VOCAB, hidden_size=64,
               num_hidden_layers=4, num_attention_heads=4, num_kv_heads=2,
               new_decoder_architecture=True, parallel_attn=True, bias=False,
               max_position_embeddings=MAX_SEQ, hidden_dropout=0.0, attention_dropout=0.0,
               use_cache=False, bos_token_id=0, eos_token_id=0)


def hf_bloom():
    """``transformers.BloomForCausalLM``: ALiBi position biases added to hand-written
    attention scores (``baddbmm``), fused q/k/v head by head, LayerNorm after the embedding,
    tied head."""
    return _hf("BloomConfig", "BloomForCausalLM", 122, vocab_size=VOCAB, hidden_size=64,
               n_layer=4, n_head=4, hidden_dropout=0.0, attention_dropout=0.0,
               use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation="eager")


def hf_phi():
    """``transformers.PhiForCausalLM`` (Phi-2): one LayerNorm feeding attention and MLP in
    parallel, partial rotary, biases, untied head with a bias."""
    return _hf("PhiConfig", "PhiForCausalLM", 125, vocab_size=VOCAB, hidden_size=64,
               intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
               max_position_embeddings=MAX_SEQ, use_cache=False, bos_token_id=0,
               eos_token_id=0)


def hf_bert():
    """``transformers.BertForMaskedLM``: a bidirectional encoder (no causal mask), post-norm
    blocks, learned and token-type embeddings, a transform + LayerNorm before the tied
    decoder; trained here on every token."""
    return _hf("BertConfig", "BertForMaskedLM", 123, vocab_size=VOCAB, hidden_size=64,
               num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               max_position_embeddings=MAX_SEQ, pad_token_id=0)


def hf_qwen3_moe():
    """``transformers.Qwen3MoeForCausalLM``: 4 fused experts ([E, ...] weights), top-2 with
    normalised weights, every layer sparse."""
    return _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", 119, **_HF_DECODER, head_dim=16,
               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
               decoder_sparse_step=1, mlp_only_layers=[])


def hf_olmoe():
    """``transformers.OlmoeForCausalLM``: 4 fused experts, top-2 without renormalising, q/k
    RMSNorm over the whole projections."""
    return _hf("OlmoeConfig", "OlmoeForCausalLM", 126, **_HF_DECODER, num_experts=4,
               num_experts_per_tok=2)


def hf_deepseek_v3():
    """``transformers.DeepseekV3ForCausalLM``: multi-head latent attention (low-rank q and
    kv with a shared rotary key), a dense first layer then MoE layers (a block list of two
    kinds), sigmoid routing limited to the top group of experts, one shared expert."""
    return _hf("DeepseekV3Config", "DeepseekV3ForCausalLM", 120, vocab_size=VOCAB,
               hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
               n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
               topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
               qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8,
               max_position_embeddings=MAX_SEQ, use_cache=False, bos_token_id=0,
               eos_token_id=0, pad_token_id=0)


# ---- probe: architectures not yet in the corpus ----------------------------------------------
def hf_gptj():
    """``transformers.GPTJForCausalLM``: parallel attention and MLP off one LayerNorm,
    interleaved (every-other-dim) rotary on 8 of each head's 16 dims, untied head with a bias."""
    return _hf("GPTJConfig", "GPTJForCausalLM", 127, vocab_size=VOCAB, n_embd=64, n_layer=4,
               n_head=4, rotary_dim=8, n_inner=128, n_positions=MAX_SEQ, resid_pdrop=0.0,
               embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
               pad_token_id=0)


def hf_stablelm():
    """``transformers.StableLmForCausalLM``: LayerNorm, partial rotary (25%), q/k/v biases,
    GQA 4/2, sequential residual."""
    return _hf("StableLmConfig", "StableLmForCausalLM", 128, **_HF_DECODER, use_qkv_bias=True,
               hidden_dropout=0.0)


def hf_cohere():
    """``transformers.CohereForCausalLM``: parallel attention and MLP off one bias-free
    LayerNorm, interleaved rotary, logits scaled by ``logit_scale``, tied head."""
    return _hf("CohereConfig", "CohereForCausalLM", 129, **_HF_DECODER, logit_scale=0.5)


def hf_granite():
    """``transformers.GraniteForCausalLM``: Llama with scalar multipliers on the embeddings,
    the residual branches, the attention scores and the logits."""
    return _hf("GraniteConfig", "GraniteForCausalLM", 130, **_HF_DECODER,
               embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25,
               logits_scaling=2.0)


def hf_starcoder2():
    """``transformers.Starcoder2ForCausalLM``: LayerNorm, biases everywhere, GELU MLP
    (c_fc / c_proj, no gate), GQA 4/2, tied head."""
    return _hf("Starcoder2Config", "Starcoder2ForCausalLM", 131, **_HF_DECODER,
               residual_dropout=0.0, embedding_dropout=0.0, use_bias=True)


def hf_persimmon():
    """``transformers.PersimmonForCausalLM``: fused ``query_key_value`` head by head, LayerNorm
    over each head of q and k, partial rotary, squared-ReLU MLP, no GQA."""
    return _hf("PersimmonConfig", "PersimmonForCausalLM", 132, vocab_size=VOCAB,
               hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, max_position_embeddings=MAX_SEQ, qk_layernorm=True,
               hidden_dropout=0.0, attention_dropout=0.0, use_cache=False, bos_token_id=0,
               eos_token_id=0, pad_token_id=0)


def hf_mpt():
    """``transformers.MptForCausalLM``: fused ``Wqkv``, ALiBi biases on eager scores, no
    biases, bias-free LayerNorm, tied head."""
    return _hf("MptConfig", "MptForCausalLM", 133, vocab_size=VOCAB, d_model=64, n_heads=4,
               n_layers=4, expansion_ratio=2, max_seq_len=MAX_SEQ, resid_pdrop=0.0,
               emb_pdrop=0.0, attn_config={"attn_pdrop": 0, "alibi": True},
               use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
               attn_implementation="eager")


def hf_codegen():
    """``transformers.CodeGenForCausalLM``: one fused ``qkv_proj`` laid out in 4 model-parallel
    blocks (q, v, k within each), parallel attention and MLP, interleaved partial rotary."""
    return _hf("CodeGenConfig", "CodeGenForCausalLM", 134, vocab_size=VOCAB, n_embd=64,
               n_layer=4, n_head=4, rotary_dim=8, n_inner=128, n_positions=MAX_SEQ,
               n_ctx=MAX_SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
               use_cache=False, bos_token_id=0, eos_token_id=0)


def hf_nemotron():
    """``transformers.NemotronForCausalLM``: LayerNorm1P (weight + 1), squared-ReLU MLP
    without gate, partial rotary (50%), GQA 4/2."""
    return _hf("NemotronConfig", "NemotronForCausalLM", 135, **_HF_DECODER, head_dim=16)


def hf_glm():
    """``transformers.GlmForCausalLM``: fused ``gate_up_proj``, interleaved rotary on half of
    each head, q/k/v biases, GQA 4/2."""
    return _hf("GlmConfig", "GlmForCausalLM", 136, **_HF_DECODER, head_dim=16)


def hf_exaone4():
    """``transformers.Exaone4ForCausalLM``: norms after each sub-layer, RMSNorm on each head of
    q and k, sliding-window (16) layers then a global layer without RoPE."""
    return _hf("Exaone4Config", "Exaone4ForCausalLM", 137, **_HF_DECODER, sliding_window=16,
               sliding_window_pattern=4)


def hf_smollm3():
    """``transformers.SmolLM3ForCausalLM``: every 4th layer without RoPE (NoPE), GQA 4/2,
    tied head."""
    return _hf("SmolLM3Config", "SmolLM3ForCausalLM", 138, **_HF_DECODER,
               no_rope_layer_interval=4)


def hf_granitemoe():
    """``transformers.GraniteMoeForCausalLM``: 4 fused experts top-2 (``gate_up_proj`` /
    ``down_proj``), Granite's scalar multipliers."""
    return _hf("GraniteMoeConfig", "GraniteMoeForCausalLM", 139, **_HF_DECODER,
               num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0,
               residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=2.0)


def hf_qwen2_moe():
    """``transformers.Qwen2MoeForCausalLM``: 4 fused experts top-2 plus a shared expert behind
    a sigmoid gate, q/k/v biases."""
    return _hf("Qwen2MoeConfig", "Qwen2MoeForCausalLM", 140, **_HF_DECODER, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=64,
               shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[])


def hf_phimoe():
    """``transformers.PhimoeForCausalLM``: 4 fused experts, top-2 by sparsemixer routing (a
    custom ``autograd.Function``; jitter 0 masks all but the top gate, so its Gumbel sampling
    is deterministic), LayerNorm with biases."""
    return _hf("PhimoeConfig", "PhimoeForCausalLM", 141, **_HF_DECODER, num_local_experts=4,
               num_experts_per_tok=2, router_jitter_noise=0.0, input_jitter_noise=0.0)


def hf_dbrx():
    """``transformers.DbrxForCausalLM``: fused ``Wqkv`` (GQA 4/2), q/k/v clipped to +-8,
    4 experts top-2 stored as flat [E * ffn, hidden] w1 / v1 / w2, LayerNorm without bias."""
    return _hf("DbrxConfig", "DbrxForCausalLM", 142, vocab_size=VOCAB, d_model=64, n_heads=4,
               n_layers=4, max_seq_len=MAX_SEQ, resid_pdrop=0.0, emb_pdrop=0.0,
               attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "attn_pdrop": 0.0,
                            "rope_theta": 10000.0},
               ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2,
                           "moe_jitter_eps": None},
               use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def hf_gpt2_odd_vocab():
    """``transformers.GPT2LMHeadModel`` as ``hf_gpt2`` with an odd vocabulary (257 tokens), as
    GPT-2's own 50,257: tensor parallel cannot split its embedding and head evenly."""
    return _hf("GPT2Config", "GPT2LMHeadModel", 111, vocab_size=VOCAB + 1, n_embd=64,
               n_layer=4, n_head=4, n_positions=MAX_SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0, summary_first_dropout=0.0, bos_token_id=0, eos_token_id=0,
               use_cache=False)


def _titan_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def _titan_rope(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class _TitanAttention(nn.Module):
    def __init__(self, dim, n_heads, n_kv):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = n_heads, n_kv, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.wv = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.wo = nn.Linear(n_heads * self.hd, dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.hd)
        xk = xk.view(bs, seqlen, -1, self.hd)
        xv = xv.view(bs, seqlen, -1, self.hd)
        xq, xk = _titan_rope(xq, xk, freqs_cis)
        rep = self.n_heads // self.n_kv
        xk = torch.repeat_interleave(xk, rep, dim=2)
        xv = torch.repeat_interleave(xv, rep, dim=2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2),
                                             xv.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class _TitanBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv):
        super().__init__()
        self.attention = _TitanAttention(dim, n_heads, n_kv)
        self.feed_forward = _PlainSwiGLU(dim, 128)  # torchtitan's FeedForward, Meta's SwiGLU
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class _TitanTransformer(nn.Module):
    """A Llama as torchtitan writes it (`titan_llama`)."""

    def __init__(self, vocab=256, dim=64, n_layers=4, n_heads=4, n_kv=2, max_seq=128):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", _titan_freqs_cis(dim // n_heads, max_seq * 2),
                             persistent=False)
        self.layers = nn.ModuleDict({str(i): _TitanBlock(dim, n_heads, n_kv)
                                     for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def titan_llama():
    """torchtitan style (torchtitan/models/llama3/model.py): RoPE as complex products
    (``torch.polar`` tables, ``view_as_complex``), the layers a ``ModuleDict`` keyed by their
    index, ``nn.RMSNorm``, GQA 4/2 heads by ``repeat_interleave``, untied head."""
    torch.manual_seed(151)
    return _TitanTransformer(vocab=VOCAB, max_seq=MAX_SEQ)


def hf_modernbert():
    """``transformers.ModernBertForMaskedLM``: a bidirectional encoder with rotary positions,
    GeGLU, pre-norm blocks without biases, global attention every second layer and a
    16-token local window in the others (the model reads each layer's ``attention_type``
    off the layer), a dense + norm head before the tied decoder."""
    return _hf("ModernBertConfig", "ModernBertForMaskedLM", 203, vocab_size=VOCAB,
               hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, max_position_embeddings=MAX_SEQ, pad_token_id=0,
               bos_token_id=0, eos_token_id=0, cls_token_id=0, sep_token_id=0,
               global_attn_every_n_layers=2, local_attention=16, embedding_dropout=0.0,
               mlp_dropout=0.0, attention_dropout=0.0)


def hf_llama4():
    """``transformers.Llama4ForCausalLM``: MoE every second layer (4 fused experts, top-1,
    sigmoid-gated, a shared expert beside them), dense MLPs between, rotary in three layers
    of four and none in the fourth, q/k L2-norm; the model reads its embedding's weight
    device."""
    return _hf("Llama4TextConfig", "Llama4ForCausalLM", 202, **_HF_DECODER, head_dim=16,
               intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
               interleave_moe_layer_step=2, attention_chunk_size=MAX_SEQ)


def hf_gpt_oss():
    """``transformers.GptOssForCausalLM``: MoE in every layer (4 fused experts with a bias
    per expert, top-2, a clamped SwiGLU on interleaved gate/up features), attention with a
    learned sink per head (eager), YaRN rotary."""
    return _hf("GptOssConfig", "GptOssForCausalLM", 201, attn_implementation="eager",
               **_HF_DECODER, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=64, layer_types=["full_attention"] * 4)


def hf_openai_gpt():
    """``transformers.OpenAIGPTLMHeadModel``: GPT-1, post-norm blocks (LayerNorm after each
    residual add), learned positions, a tied head, eager attention."""
    return _hf("OpenAIGPTConfig", "OpenAIGPTLMHeadModel", 214, attn_implementation="eager",
               vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=MAX_SEQ,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def hf_apertus():
    """``transformers.ApertusForCausalLM``: an MLP without a gate whose xIELU activation has
    trainable parameters of its own, q/k RMSNorm, GQA 4/2."""
    return _hf("ApertusConfig", "ApertusForCausalLM", 209, **_HF_DECODER, head_dim=16)


def hf_olmo3():
    """``transformers.Olmo3ForCausalLM``: post-norm sub-layers (RMSNorm on each branch's
    output before the residual add), q/k RMSNorm over the whole projections."""
    return _hf("Olmo3Config", "Olmo3ForCausalLM", 204, **_HF_DECODER,
               layer_types=["full_attention"] * 4)


def hf_ernie():
    """``transformers.Ernie4_5ForCausalLM``: Llama-shaped, interleaved rotary, no biases."""
    return _hf("Ernie4_5Config", "Ernie4_5ForCausalLM", 205, **_HF_DECODER, head_dim=16)


def hf_glm4():
    """``transformers.Glm4ForCausalLM``: four norms a block (before and after each sub-layer),
    a fused gate/up projection, partial rotary, q/k/v biases."""
    return _hf("Glm4Config", "Glm4ForCausalLM", 206, **_HF_DECODER, head_dim=16)


def hf_seed_oss():
    """``transformers.SeedOssForCausalLM``: Llama-shaped with q/k/v biases."""
    return _hf("SeedOssConfig", "SeedOssForCausalLM", 207, **_HF_DECODER, head_dim=16,
               residual_dropout=0.0)


def hf_arcee():
    """``transformers.ArceeForCausalLM``: an MLP without a gate, ReLU squared."""
    return _hf("ArceeConfig", "ArceeForCausalLM", 208, **_HF_DECODER, head_dim=16)


def hf_hunyuan():
    """``transformers.HunYuanDenseV1ForCausalLM``: q/k RMSNorm per head after rotary."""
    return _hf("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", 210, **_HF_DECODER,
               head_dim=16)


def hf_cohere2():
    """``transformers.Cohere2ForCausalLM``: Cohere's parallel attention and MLP with the
    layer-type machinery of sliding and global layers (all global here), tied head."""
    return _hf("Cohere2Config", "Cohere2ForCausalLM", 211, **_HF_DECODER, head_dim=16,
               layer_types=["full_attention"] * 4, sliding_window=64)


def hf_helium():
    """``transformers.HeliumForCausalLM``: Llama-shaped, an untied head."""
    return _hf("HeliumConfig", "HeliumForCausalLM", 212, **_HF_DECODER, head_dim=16)


def hf_gptneo():
    """``transformers.GPTNeoForCausalLM``: learned positions, unscaled attention scores in
    fp32 (eager), q/k/v without biases, tied head."""
    return _hf("GPTNeoConfig", "GPTNeoForCausalLM", 213, attn_implementation="eager",
               vocab_size=VOCAB, hidden_size=64, num_layers=4, num_heads=4,
               intermediate_size=128, max_position_embeddings=MAX_SEQ,
               attention_types=[[["global"], 4]], resid_dropout=0.0, embed_dropout=0.0,
               attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)


def hf_xglm():
    """``transformers.XGLMForCausalLM``: sinusoidal positions offset by the padding index,
    scaled embeddings, eager attention, tied head."""
    return _hf("XGLMConfig", "XGLMForCausalLM", 215, attn_implementation="eager",
               vocab_size=VOCAB, d_model=64, ffn_dim=128, num_layers=4, attention_heads=4,
               max_position_embeddings=MAX_SEQ, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, use_cache=False, pad_token_id=1)


def hf_biogpt():
    """``transformers.BioGptForCausalLM``: learned positions offset by two, scaled
    embeddings, pre-norm with biases."""
    return _hf("BioGptConfig", "BioGptForCausalLM", 216, vocab_size=VOCAB, hidden_size=64,
               intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               max_position_embeddings=MAX_SEQ, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, use_cache=False, pad_token_id=1)


def hf_deepseek_v2():
    """``transformers.DeepseekV2ForCausalLM``: latent attention, a dense first layer, then MoE
    with greedy softmax routing and a shared expert."""
    return _hf("DeepseekV2Config", "DeepseekV2ForCausalLM", 217, vocab_size=VOCAB,
               hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
               n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
               first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
               v_head_dim=16, qk_nope_head_dim=8, max_position_embeddings=MAX_SEQ,
               use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def hf_roberta():
    """``transformers.RobertaForMaskedLM``: BERT's post-norm encoder with positions offset by
    the padding index, a dense + norm head before the tied decoder."""
    return _hf("RobertaConfig", "RobertaForMaskedLM", 218, vocab_size=VOCAB, hidden_size=64,
               num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               max_position_embeddings=MAX_SEQ + 2, pad_token_id=1)


def hf_distilbert():
    """``transformers.DistilBertForMaskedLM``: a post-norm encoder without token types, a
    projector + norm before the tied vocabulary projection."""
    return _hf("DistilBertConfig", "DistilBertForMaskedLM", 219, vocab_size=VOCAB, dim=64,
               n_layers=4, n_heads=4, hidden_dim=128, dropout=0.0, attention_dropout=0.0,
               max_position_embeddings=MAX_SEQ, pad_token_id=0)


def hf_vaultgemma():
    """``transformers.VaultGemmaForCausalLM``: Gemma's scaled embeddings and soft-capping
    machinery with one norm per sub-layer (eager attention)."""
    return _hf("VaultGemmaConfig", "VaultGemmaForCausalLM", 220, attn_implementation="eager",
               **_HF_DECODER, head_dim=16, layer_types=["full_attention"] * 4,
               sliding_window=64)


def hf_flexolmo():
    """``transformers.FlexOlmoForCausalLM``: OLMo 2's post-norm blocks with fused MoE
    experts in every layer, top-2."""
    return _hf("FlexOlmoConfig", "FlexOlmoForCausalLM", 221, **_HF_DECODER, num_experts=4,
               num_experts_per_tok=2)


def hf_olmo():
    """``transformers.OlmoForCausalLM``: non-parametric layer norms (no weight, no bias)."""
    return _hf("OlmoConfig", "OlmoForCausalLM", 222, **_HF_DECODER)


def hf_ministral():
    """``transformers.MinistralForCausalLM``: Mistral's blocks, an explicit head_dim."""
    return _hf("MinistralConfig", "MinistralForCausalLM", 223, **_HF_DECODER, head_dim=16)


def hf_doge():
    """``transformers.DogeForCausalLM``: dynamic-mask attention (a learned per-head mask from
    the values) and residuals scaled by learned vectors (eager attention)."""
    return _hf("DogeConfig", "DogeForCausalLM", 224, attn_implementation="eager",
               **_HF_DECODER)


def hf_lfm2():
    """``transformers.Lfm2ForCausalLM``: short causal convolutions over the sequence in every
    other layer, attention in the others."""
    return _hf("Lfm2Config", "Lfm2ForCausalLM", 225, **_HF_DECODER,
               layer_types=["conv", "full_attention"] * 2)


def hf_ernie45_moe():
    """``transformers.Ernie4_5_MoeForCausalLM``: fused experts behind a dense first layer,
    a router bias used for selection only."""
    return _hf("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", 226, **_HF_DECODER,
               moe_num_experts=4, moe_k=2, moe_intermediate_size=64)


def hf_glm4_moe():
    """``transformers.Glm4MoeForCausalLM``: partial rotary, a dense first layer, grouped
    top-k routing with a shared expert."""
    return _hf("Glm4MoeConfig", "Glm4MoeForCausalLM", 227, **_HF_DECODER, n_routed_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
               head_dim=16)


def hf_qwen3_next():
    """``transformers.Qwen3NextForCausalLM``: gated delta-net linear attention in three
    layers of four, gated full attention in the fourth, MoE with a gated shared expert."""
    return _hf("Qwen3NextConfig", "Qwen3NextForCausalLM", 228, **_HF_DECODER, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16)


def hf_minimax():
    """``transformers.MiniMaxForCausalLM``: lightning (linear) attention layers between full
    attention ones, Mixtral-style experts."""
    return _hf("MiniMaxConfig", "MiniMaxForCausalLM", 229, **_HF_DECODER, num_local_experts=4,
               num_experts_per_tok=2, head_dim=16)


def hf_falcon_h1():
    """``transformers.FalconH1ForCausalLM``: attention and a Mamba-2 mixer side by side in
    every layer (torch's reference scan: no CUDA kernels)."""
    return _hf("FalconH1Config", "FalconH1ForCausalLM", 231, **_HF_DECODER, head_dim=16,
               mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8)


def hf_bitnet():
    """``transformers.BitNetForCausalLM``: a sub-norm before each output projection, squared
    ReLU gated MLP."""
    return _hf("BitNetConfig", "BitNetForCausalLM", 232, **_HF_DECODER)


def hf_jamba():
    """``transformers.JambaForCausalLM``: Mamba layers with attention every second layer and
    Mixtral-style experts every second layer (torch's reference scan)."""
    return _hf("JambaConfig", "JambaForCausalLM", 233, **_HF_DECODER, num_experts=4,
               num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
               attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8,
               use_mamba_kernels=False)
