"""The runtime's process groups are the ones the estimate costs, in any mesh order: on a fake
process group of 48 ranks, the DeviceMesh `apply_plan` builds from a plan's mesh gives rank 0
the tp, cp, data-parallel (`data_parallel_mesh`) and expert-parallel (`expert_groups`) groups
that `autopar.estimate.groups.rank_groups` lists, and every rank its groups as
`mesh_groups` lists them."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.config import ParallelConfig, check_config
from autopar.estimate.groups import mesh_groups, rank_groups, replica_axes
from autopar.plan.sections import PlanMesh
from autopar.runtime.context_parallel import data_parallel_mesh
from autopar.runtime.expert_parallel import expert_groups

SIZES = {"pp": 2, "dp": 2, "cp": 3, "tp": 4}  # 48 ranks, every axis a different size


@pytest.fixture(params=[0, 17, 46])
def fake_rank(request):
    dist.init_process_group("fake", store=FakeStore(), rank=request.param, world_size=48)
    try:
        yield request.param
    finally:
        dist.destroy_process_group()


def _row_of(groups, rank: int) -> list[int]:
    return next(row for row in groups.tolist() if rank in row)


# ep = 3 runs cross from one cp ring to the next where dp and cp are neighbours; apart,
# they must not (`check_config`), and ep = 2 divides dp
@pytest.mark.parametrize("order,ep", [(("pp", "dp", "cp", "tp"), 3), (("tp", "cp", "dp", "pp"), 3),
                                      (("cp", "pp", "dp", "tp"), 2), (("dp", "tp", "pp", "cp"), 3),
                                      (("dp", "tp", "pp", "cp"), 6)])
def test_runtime_mesh_groups_are_the_estimates(order, ep, fake_rank):
    cfg = ParallelConfig(**SIZES, ep=ep, mesh_order=order)
    check_config(cfg, world_size=48, global_batch_size=48, num_layers=8, num_experts=6)
    plan = SimpleNamespace(config=cfg, mesh=PlanMesh(axes=order,
                                                     sizes=tuple(SIZES[a] for a in order)))
    mesh = init_device_mesh("cpu", tuple(plan.mesh.sizes), mesh_dim_names=tuple(order))
    for axis in ("tp", "cp", "pp"):
        assert mesh[axis].mesh.tolist() == _row_of(mesh_groups(cfg, (axis,)), fake_rank)
    replicas = _row_of(mesh_groups(cfg, replica_axes(cfg)), fake_rank)
    assert data_parallel_mesh(mesh).mesh.tolist() == replicas
    ep = expert_groups(mesh, plan)
    start = replicas.index(fake_rank) // cfg.ep * cfg.ep
    assert dist.get_process_group_ranks(ep.ep_group) == replicas[start:start + cfg.ep]
    if fake_rank == 0:  # the groups the estimate starts from
        first = rank_groups(cfg)
        assert (mesh["tp"].mesh.tolist(), mesh["cp"].mesh.tolist()) == \
            (list(first.tp), list(first.cp))
        assert (replicas, dist.get_process_group_ranks(ep.ep_group)) == \
            (list(first.dp), list(first.ep))


def test_every_order_is_a_valid_device_mesh_layout():
    """`mesh_groups` partitions the ranks for every axis in every order (each rank in
    exactly one group)."""
    for order in itertools.permutations(SIZES):
        cfg = ParallelConfig(**SIZES, mesh_order=order)
        for axes in (("tp",), ("cp",), ("pp",), ("dp",), replica_axes(cfg)):
            groups = mesh_groups(cfg, axes)
            assert sorted(groups.ravel().tolist()) == list(range(48))


def test_expert_groups_a_device_mesh_cannot_slice_are_refused():
    cfg = ParallelConfig(**SIZES, ep=3, mesh_order=("cp", "pp", "dp", "tp"))
    with pytest.raises(ValueError, match="ep=3 groups would cross dp=2 in mesh_order "
                                         "cp,pp,dp,tp, where pp lies between dp and cp"):
        check_config(cfg, world_size=48, global_batch_size=48, num_layers=8, num_experts=6)
