"""torchrun worker for tests/distributed/test_context_parallel.py: ring attention on zigzag and
contiguous shares against ``F.scaled_dot_product_attention`` on the full sequence (causal; and,
on contiguous shares, without a mask, with a boolean mask and with an additive per-head mask),
forward output and dq/dk/dv, with cp = world size (the default group) and cp = 2 on the ``cp``
axis of a (world/2, 2) mesh (sub-groups addressed by group rank).  Writes
``<out>/ring.<rank>.json``: ``{case: max abs error}``.

    torchrun --standalone --nproc_per_node=4 cp_ring_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from autopar.runtime.context_parallel import ring_attention, zigzag_split

# (batch, heads, kv_heads, seq_len, head_dim)
SHAPES = [(2, 4, 4, 32, 8), (2, 4, 2, 32, 8), (1, 6, 2, 48, 16)]


# (layout, mask): "causal", "none", "bool" ([s, s], the diagonal always visible), "additive"
# ([batch, heads, s, s])
CASES = [("zigzag", "causal"), ("contiguous", "causal"), ("contiguous", "none"),
         ("contiguous", "bool"), ("contiguous", "additive")]


def _check(group, cp_rank: int, cp: int, shape, seed: int, layout: str = "zigzag",
           masking: str = "causal") -> dict[str, float]:
    b, h, hk, s, d = shape
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, s, d, generator=gen) for n in (h, hk, hk))
    grad = torch.randn(b, h, s, d, generator=gen)
    mask = None
    if masking == "bool":
        mask = (torch.rand(s, s, generator=gen) < 0.5) | torch.eye(s, dtype=torch.bool)
    elif masking == "additive":
        mask = torch.randn(b, h, s, s, generator=gen)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=masking == "causal",
                                         enable_gqa=hk != h)
    ref.backward(grad)

    def share(t):
        return zigzag_split(t, cp_rank, cp, dim=2) if layout == "zigzag" else \
            t.tensor_split(cp, dim=2)[cp_rank]

    local = [share(t).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group, layout=layout, causal=masking == "causal", mask=mask)
    out.backward(share(grad))
    errors = {"out": (out.detach() - share(ref.detach())).abs().max()}
    for name, mine, theirs in zip(("dq", "dk", "dv"), local, full):
        errors[name] = (mine.grad - share(theirs.grad)).abs().max()
    return {k: float(e) for k, e in errors.items()}


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, dict[str, float]] = {}
    for i, shape in enumerate(SHAPES):
        for layout, masking in CASES:
            results[f"cp{world}_world_{shape}_{layout}_{masking}"] = _check(
                dist.group.WORLD, rank, world, shape, i, layout, masking)
    if world % 2 == 0 and world > 2:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))
        cp_mesh = mesh["cp"]
        for i, shape in enumerate(SHAPES):
            seed = 100 + i + mesh["dp"].get_local_rank()  # each cp group its own data
            results[f"cp2_submesh_{shape}"] = _check(cp_mesh.get_group(), cp_mesh.get_local_rank(),
                                                     2, shape, seed)
    (out_dir / f"ring.{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
