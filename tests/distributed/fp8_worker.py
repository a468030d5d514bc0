"""torchrun worker for tests/distributed/test_fp8.py: `autopar.runtime.fp8.float8_linear` on
DTensors over 2 ranks -- column-parallel (its bias split), row-parallel (its bias replicated),
a fused projection split head-aware (``_StridedShard``, a replicated bias) and a replicated
weight on batch-split activations -- against an oracle in float64 that quantises each rank's
shards with their own scales (each rank scales what it holds). Output, and the full gradients
of x, w and b. Writes ``<out>/fp8.<rank>.json``: ``{case: {what: max abs error / max abs}}``.

    torchrun --standalone --nproc_per_node=2 fp8_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.runtime.fp8 import float8_linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
M, K, N = 24, 32, 48  # 24 rows: the weight gradient's inner dim is padded


def deq(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmax = torch.finfo(dtype).max
    scale = fmax / t.double().abs().max().clamp(min=1e-12)
    return (t.double() * scale).clamp(-fmax, fmax).to(dtype).double() / scale


def strided(t: torch.Tensor, rank: int, chunks: int = 3) -> torch.Tensor:
    """Rank `rank`'s rows of a fused [chunks x n] projection split within each chunk."""
    return torch.cat([c.chunk(2)[rank] for c in t.chunk(chunks)])


def oracle(case: str, x, w, b, g):
    """(y, grad x, grad w, grad b) in float64, each rank quantising its own shards."""
    if case in ("colwise", "strided"):
        pick = (lambda t, r: t.chunk(2)[r]) if case == "colwise" else strided
        ys, gws = [], []
        gx = torch.zeros(M, K, dtype=torch.float64)
        for r in range(2):
            w_r, g_r = pick(w, r), pick(g.T, r).T
            ys.append(deq(x, E4M3) @ deq(w_r, E4M3).T + pick(b, r).double())
            gx += deq(g_r, E5M2) @ deq(w_r, E4M3)
            gws.append(deq(g_r, E5M2).T @ deq(x, E4M3))
        y, gw = torch.cat(ys, 1), torch.cat(gws)
        if case == "strided":  # back from the ranks' order to the chunks' order
            order = torch.cat([strided(torch.arange(N), r) for r in range(2)])
            y, gw = y[:, order.argsort()], gw[order.argsort()]
        return y, gx, gw, g.double().sum(0)
    if case == "rowwise":
        xs, ws = x.chunk(2, 1), w.chunk(2, 1)
        y = sum(deq(xs[r], E4M3) @ deq(ws[r], E4M3).T for r in range(2)) + b.double()
        gx = torch.cat([deq(g, E5M2) @ deq(ws[r], E4M3) for r in range(2)], 1)
        gw = torch.cat([deq(g, E5M2).T @ deq(xs[r], E4M3) for r in range(2)], 1)
        return y, gx, gw, g.double().sum(0)
    # rows: x split on its rows, w replicated: each rank's rows with its own scales
    xs, gs = x.chunk(2), g.chunk(2)
    y = torch.cat([deq(xs[r], E4M3) @ deq(w, E4M3).T for r in range(2)]) + b.double()
    gx = torch.cat([deq(gs[r], E5M2) @ deq(w, E4M3) for r in range(2)])
    gw = sum(deq(gs[r], E5M2).T @ deq(xs[r], E4M3) for r in range(2))
    return y, gx, gw, g.double().sum(0)


LAYOUTS = {  # case: (x, w, b) placements
    "colwise": (Replicate(), Shard(0), Shard(0)),
    "rowwise": (Shard(1), Shard(1), Replicate()),
    "strided": (Replicate(), _StridedShard(0, split_factor=3), Replicate()),
    "rows": (Shard(0), Replicate(), Replicate()),
}


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen), \
        torch.randn(N, generator=gen)
    g = torch.randn(M, N, generator=gen)
    errors = {}
    for case, (px, pw, pb) in LAYOUTS.items():
        xd = DTensor.from_local(x, mesh, [Replicate()]).redistribute(mesh, [px])
        wd = DTensor.from_local(w, mesh, [Replicate()]).redistribute(mesh, [pw])
        bd = DTensor.from_local(b, mesh, [Replicate()]).redistribute(mesh, [pb])
        leaves = [t.detach().requires_grad_() for t in (xd, wd, bd)]
        y = float8_linear(*leaves, out_dtype=torch.float32)
        if y.placements[0].is_partial():  # row-parallel: the sum, as the layer's hook takes it
            y = y.redistribute(mesh, [Replicate()])
        y.backward(DTensor.from_local(g, mesh, [Replicate()]).redistribute(mesh, y.placements))
        got = [y.full_tensor()] + [t.grad.full_tensor() for t in leaves]
        errors[case] = {what: float((a.double() - e).abs().max() / e.abs().max())
                        for what, a, e in zip(("y", "grad_x", "grad_w", "grad_b"), got,
                                              oracle(case, x, w, b, g))}
    (out / f"fp8.{rank}.json").write_text(json.dumps(errors))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
