"""Context parallelism: every rank of a ``cp`` group holds a slice of each sequence and causal
attention runs as a ring over the group (PyTorch's own ``context_parallel`` has no CPU path in
torch 2.13, so this is written out).

Load balancing ("zigzag"): the sequence is cut into ``2·cp`` equal chunks and cp rank ``r``
holds chunks ``r`` and ``2·cp−1−r``, in that order.  Under a causal mask every rank then
attends over the same number of (query, key) pairs: in each ring step after the first it
computes exactly two of its four chunk pairs, the others being entirely in the future.

Ring attention (:func:`ring_attention`) is a ``torch.autograd.Function``:

* forward: for ``i = 0..cp−1`` the rank holds the keys/values of rank ``(r−i) mod cp`` and
  attends its query chunks to those key chunks, block by block, with a causal mask built from
  global positions (fully masked blocks are skipped, fully visible ones take no mask); blocks
  merge with an online softmax through their log-sum-exp.  K/V rotate one step around the ring
  (batched ``isend``/``irecv`` on the group) while the current block computes.
* backward: recomputes each block's probabilities from the saved log-sum-exp, adds dQ locally,
  and adds dK/dV into fp32 accumulators that travel around the ring one step behind their K/V
  (each hop under the next step's blocks, as PyTorch's ring does); after ``cp`` hops every
  accumulator is back at its owner.

Grouped-query attention keeps K/V at their own head count (the ring sends ``n_kv_heads``
heads): queries are viewed as ``[batch, kv_heads, group, seq, head_dim]``.

The models learn about all this through ``autopar.models.common.sequence_shard``, which the
runtime activates around each training step with a :class:`ContextParallel`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.runtime.local_attention import local_heads

if TYPE_CHECKING:
    from autopar.plan.plan import Plan

__all__ = ["BlockKind", "ContextParallel", "block_kind", "block_mask", "check_context_parallel",
           "data_parallel_mesh", "replica_dims", "ring_attention", "zigzag_chunks", "zigzag_merge",
           "zigzag_positions", "zigzag_split"]

log = logging.getLogger(__name__)

BlockKind = Literal["skip", "full", "partial"]
Layout = Literal["zigzag", "contiguous"]


# ---------------------------------------------------------------------------------------------
# Pure pieces: the zigzag layout and the causal mask of one (query chunk, key chunk) block.


def zigzag_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunk indices (of ``2·cp``) that cp rank ``rank`` holds, in local order."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is outside 0..{cp - 1}")
    return rank, 2 * cp - 1 - rank


def _chunk_len(seq_len: int, cp: int) -> int:
    if seq_len % (2 * cp):
        raise ValueError(f"context parallel cuts each sequence into 2*cp = {2 * cp} equal chunks, "
                         f"but seq_len={seq_len} is not divisible by {2 * cp}; use a seq_len that "
                         f"is a multiple of {2 * cp} or a smaller cp")
    return seq_len // (2 * cp)


def zigzag_positions(seq_len: int, rank: int, cp: int) -> torch.Tensor:
    """int64 ``[seq_len / cp]``: the global positions of the tokens rank ``rank`` holds."""
    c = _chunk_len(seq_len, cp)
    return torch.cat([torch.arange(j * c, (j + 1) * c) for j in zigzag_chunks(rank, cp)])


def zigzag_split(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s share of ``x`` along the sequence dimension ``dim`` (its two chunks,
    concatenated; a new contiguous tensor)."""
    c = _chunk_len(x.shape[dim], cp)
    return torch.cat([x.narrow(dim, j * c, c) for j in zigzag_chunks(rank, cp)], dim=dim)


def zigzag_merge(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`zigzag_split`: the full tensor from every rank's share, in rank order."""
    cp = len(parts)
    c = parts[0].shape[dim] // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        if part.shape[dim] != 2 * c:
            raise ValueError(f"rank {rank}'s share has {part.shape[dim]} positions on dim {dim}, "
                             f"rank 0's has {2 * c}; all shares must be the same length")
        first, second = zigzag_chunks(rank, cp)
        chunks[first], chunks[second] = part.narrow(dim, 0, c), part.narrow(dim, c, c)
    return torch.cat(chunks, dim=dim)


def block_kind(q_start: int, q_len: int, k_start: int, k_len: int) -> BlockKind:
    """How a causal mask covers queries at positions ``[q_start, q_start+q_len)`` against keys at
    ``[k_start, k_start+k_len)``: ``skip`` (every key is after every query), ``full`` (every key
    is at or before every query) or ``partial``."""
    if k_start > q_start + q_len - 1:
        return "skip"
    if k_start + k_len - 1 <= q_start:
        return "full"
    return "partial"


def block_mask(q_start: int, q_len: int, k_start: int, k_len: int,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """bool ``[q_len, k_len]``: True where the query may attend the key (key position <= query
    position)."""
    q_pos = torch.arange(q_start, q_start + q_len, device=device)
    k_pos = torch.arange(k_start, k_start + k_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]


# ---------------------------------------------------------------------------------------------
# Block math on [batch, kv_heads, group, len, head_dim] (fp32), shared by forward and backward.


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float,
            mask: torch.Tensor | None) -> torch.Tensor:
    s = (q @ k.unsqueeze(2).transpose(-2, -1)) * scale
    if mask is None:
        return s
    return s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """A log-sum-exp with the rows that attend to nothing (-inf) at 0, so their
    probabilities come out 0 rather than NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _block_forward(q, k, v, scale, mask):
    """(output, log-sum-exp) of softmax attention of q over one key block."""
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - _finite(lse)[..., None]) @ v.unsqueeze(2), lse


def _block_backward(q, k, v, scale, mask, do, lse, delta):
    """(dq, dk, dv) of one block, from the final log-sum-exp and ``delta = sum(dO * O)``."""
    p = torch.exp(_scores(q, k, scale, mask) - _finite(lse)[..., None])
    dv = (p.transpose(-2, -1) @ do).sum(2)
    ds = p * (do @ v.unsqueeze(2).transpose(-2, -1) - delta[..., None])
    dq = (ds @ k.unsqueeze(2)) * scale
    dk = (ds.transpose(-2, -1) @ q).sum(2) * scale
    return dq, dk, dv


def _wait(reqs: list[Any]) -> None:
    for r in reqs:
        r.wait()


@dataclass(frozen=True)
class _Ring:
    """This rank's place in the cp ring, its local layout and the attention's mask."""

    group: Any
    rank: int
    size: int
    chunk: int  # tokens per chunk (a rank holds two chunks under zigzag, one if contiguous)
    device: torch.device
    layout: Layout = "zigzag"
    causal: bool = True
    # an explicit mask over global positions, broadcastable to [batch, kv_heads, group, S, S]:
    # bool (True: attend) or additive; None: causal or no mask
    mask: torch.Tensor | None = None

    def chunks(self, rank: int) -> tuple[int, ...]:
        return zigzag_chunks(rank, self.size) if self.layout == "zigzag" else (rank,)

    def blocks(self, src: int):
        """(query slice, key slice, mask) of every block of this rank's queries against the keys
        held by rank ``src`` that is not entirely masked."""
        c = self.chunk
        for qi, qc in enumerate(self.chunks(self.rank)):
            for ki, kc in enumerate(self.chunks(src)):
                qs, ks = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
                if self.mask is not None:
                    yield qs, ks, self.mask[..., qc * c:(qc + 1) * c, kc * c:(kc + 1) * c]
                    continue
                kind = block_kind(qc * c, c, kc * c, c) if self.causal else "full"
                if kind == "skip":
                    continue
                yield (qs, ks,
                       None if kind == "full" else block_mask(qc * c, c, kc * c, c, self.device))

    def start_shift(self, t: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        """Start sending ``t`` to the next rank and receiving the previous rank's into a new
        buffer; returns (buffer, requests to wait on)."""
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=(self.rank + 1) % self.size),
               dist.P2POp(dist.irecv, buf, group=self.group,
                          group_peer=(self.rank - 1) % self.size)]
        return buf, dist.batch_isend_irecv(ops)

    def shift(self, t: torch.Tensor) -> torch.Tensor:
        """Send ``t`` to the next rank; return the previous rank's."""
        buf, reqs = self.start_shift(t)
        _wait(reqs)
        return buf


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, scale: float):
        b, h, n, d = q.shape
        hk = k.shape[1]
        qg = q.reshape(b, hk, h // hk, n, d).float()
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for i in range(ring.size):
            src = (ring.rank - i) % ring.size
            nxt, reqs = ring.start_shift(kv) if i < ring.size - 1 else (None, [])
            kf, vf = kv[0].float(), kv[1].float()
            for qs, ks, mask in ring.blocks(src):
                o, block_lse = _block_forward(qg[..., qs, :], kf[..., ks, :], vf[..., ks, :],
                                              scale, mask)
                # online softmax (rows that attend to nothing yet stay at 0)
                old = lse[..., qs]
                new = torch.logaddexp(old, block_lse)
                norm = _finite(new)
                out[..., qs, :] = (out[..., qs, :] * torch.exp(old - norm)[..., None]
                                   + o * torch.exp(block_lse - norm)[..., None])
                lse[..., qs] = new
            _wait(reqs)
            kv = nxt if nxt is not None else kv
        result = out.reshape(b, h, n, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.ring, ctx.scale = ring, scale
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        b, h, n, d = q.shape
        hk = k.shape[1]
        qg = q.reshape(b, hk, h // hk, n, d).float()
        do = grad_out.reshape(b, hk, h // hk, n, d).float()
        delta = (do * out.reshape(b, hk, h // hk, n, d).float()).sum(-1)
        dq = torch.zeros_like(qg)
        kv = torch.stack([k, v])
        # the accumulator of the K/V this rank holds arrives from the previous rank while the
        # rank computes its own share; it leaves for the next rank with that share added
        arriving: tuple[torch.Tensor, list[Any]] | None = None
        for i in range(ring.size):
            src = (ring.rank - i) % ring.size
            nxt, reqs = ring.start_shift(kv) if i < ring.size - 1 else (None, [])
            kf, vf = kv[0].float(), kv[1].float()
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for qs, ks, mask in ring.blocks(src):
                dq_b, dk_b, dv_b = _block_backward(qg[..., qs, :], kf[..., ks, :], vf[..., ks, :],
                                                   scale, mask, do[..., qs, :], lse[..., qs],
                                                   delta[..., qs])
                dq[..., qs, :] += dq_b
                dkv[0, ..., ks, :] += dk_b
                dkv[1, ..., ks, :] += dv_b
            if arriving is not None:
                _wait(arriving[1])
                dkv += arriving[0]
            if ring.size > 1:  # after `size` hops every accumulator is home
                arriving = ring.start_shift(dkv)
            _wait(reqs)
            kv = nxt if nxt is not None else kv
        if arriving is not None:
            _wait(arriving[1])
            dkv = arriving[0]
        return (dq.reshape(b, h, n, d).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                   scale: float | None = None, *, layout: Layout = "zigzag", causal: bool = True,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the whole sequence from this rank's share of it.

    ``q``: ``[batch, heads, local_len, head_dim]``, ``k``/``v``: ``[batch, kv_heads, local_len,
    head_dim]`` (``heads`` a multiple of ``kv_heads``), where the local tokens are, for this
    rank ``r`` of ``group`` (a process group; every rank of it must call this with the same
    shapes), chunks ``r`` and ``2·cp−1−r`` of ``2·cp`` (``layout="zigzag"``,
    :func:`zigzag_split`) or chunk ``r`` of ``cp`` (``"contiguous"``).  ``causal``: a causal
    mask over global positions; ``mask``: an explicit mask over global positions instead
    (``[S, S]``, ``[batch or 1, heads or 1, S, S]``; bool, True where a query attends a key, or
    additive), as ``F.scaled_dot_product_attention`` takes it.  Returns the local rows of the
    full-sequence output, in q's dtype (the math runs in fp32)."""
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] \
            or k.shape[2:] != q.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention takes q [batch, heads, seq, head_dim] and k, v [batch, "
                         f"kv_heads, seq, head_dim] with heads % kv_heads == 0; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    chunks = 2 if layout == "zigzag" else 1
    if q.shape[2] % chunks:
        raise ValueError(f"the local sequence holds two equal zigzag chunks, so its length must "
                         f"be even; got {q.shape[2]}")
    size = dist.get_world_size(group)
    if mask is not None:
        mask = _grouped_mask(mask, q.shape[1], k.shape[1], q.shape[2] * size)
    ring = _Ring(group=group, rank=dist.get_rank(group), size=size,
                 chunk=q.shape[2] // chunks, device=q.device, layout=layout,
                 causal=causal and mask is None, mask=mask)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, ring, scale)


def _grouped_mask(mask: torch.Tensor, heads: int, kv_heads: int, seq: int) -> torch.Tensor:
    """An SDPA attention mask over the global sequence, viewed to broadcast against scores
    ``[batch, kv_heads, heads / kv_heads, S, S]``."""
    if mask.shape[-2:] != (seq, seq) or mask.dim() > 4:
        raise ValueError(f"context parallel takes an attention mask over the whole sequence "
                         f"([..., {seq}, {seq}], at most 4-D); got {tuple(mask.shape)}")
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)
    return mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, seq, seq)


# ---------------------------------------------------------------------------------------------
# Runtime glue.


@dataclass
class ContextParallel:
    """This rank's context-parallel role; implements ``autopar.models.common.SequenceShard``
    (activate with ``sequence_shard(cp)`` around forward and backward)."""

    group: Any
    rank: int
    size: int
    attention_calls: int = 0
    verified: bool = False

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        return zigzag_positions(local_len * self.size, self.rank, self.size).to(device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.attention_calls += 1
        if any(isinstance(t, DTensor) for t in (q, k, v)):  # tensor parallel: local heads
            q, k, v, wrap = local_heads(q, k, v)
            return wrap(ring_attention(q, k, v, self.group))
        return ring_attention(q, k, v, self.group)

    def verify(self, device: torch.device) -> None:
        """After the first step (a collective over all ranks, once): raise on every rank if no
        rank's attention went through the hook, i.e. the model computes attention itself and
        every rank attended only to its own tokens."""
        if self.verified:
            return
        calls = torch.tensor([float(self.attention_calls)], device=device)
        dist.all_reduce(calls)
        if calls.item() == 0:
            raise NotImplementedError(
                "context parallel: no attention of this model went through "
                "autopar.models.common.attention, so each rank attended only to its own tokens "
                "(wrong results). cp > 1 runs models whose attention calls that function and whose "
                "positions come from autopar.models.common.token_positions (the reference Llama, "
                "Mixtral, GPT); route the model's attention through them or plan with cp=1")
        self.verified = True

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's zigzag share of a ``[batch, seq, ...]`` tensor (tokens, labels)."""
        return zigzag_split(x, self.rank, self.size, dim)


def check_context_parallel(plan: Plan) -> None:
    """ValueError, before any collective, for a cp > 1 plan this runtime cannot run: its
    sequence must cut into ``2·cp`` equal zigzag chunks, or ``cp`` contiguous ones
    (``autopar.compile`` keeps to the same; this guards hand-edited plans)."""
    cfg, seq = plan.config, int(plan.training.seq_len)
    if plan.model.cp_layout == "zigzag":
        _chunk_len(seq, cfg.cp)
        return
    if seq % cfg.cp:
        raise ValueError(f"context parallel cuts each sequence into cp = {cfg.cp} equal chunks, "
                         f"but seq_len={seq} is not divisible by {cfg.cp}; use a seq_len that "
                         f"is a multiple of {cfg.cp} or a smaller cp")


def data_parallel_mesh(mesh: Any) -> Any:
    """The 1-D mesh gradients are averaged over: ``dp`` alone, or ``dp`` × ``cp`` flattened
    (context-parallel ranks hold the same parameters and train on different tokens)."""
    if "cp" not in mesh.mesh_dim_names or mesh["cp"].size() == 1:
        return mesh["dp"]
    return mesh[replica_dims(mesh)]._flatten("dp_cp")


def replica_dims(mesh: Any) -> tuple[str, ...]:
    """The mesh's dp and cp dimensions in mesh order (DeviceMesh slices no other order), so
    the outer of the two is major when flattened, as the estimate's `replica_axes`."""
    return tuple(a for a in mesh.mesh_dim_names if a in ("dp", "cp"))
