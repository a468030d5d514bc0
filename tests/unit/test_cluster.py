"""`autopar.Cluster`: construction, what-if overrides, and errors a user can act on."""

import pytest

import autopar
import hwprofiles


def test_from_profile_world_size_and_what_if_overrides():
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=128)
    assert (cluster.world_size, cluster.gpus_per_node) == (1024, 8)
    full = autopar.Cluster.from_profile("dgx-a100-80g", num_nodes=48)
    half = autopar.Cluster.from_profile("dgx-a100-80g", num_nodes=48, nics_per_node=4,
                                        nic_gbps=100)
    assert half.world_size == 384
    dp_group = list(range(0, 384, 8))  # one rank per node: all traffic crosses the NICs
    ratio = (half.collective_time("all_reduce", 2**30, dp_group)
             / full.collective_time("all_reduce", 2**30, dp_group))
    assert 3.0 < ratio < 4.5  # a quarter of the NIC bandwidth, less the latency share
    small = autopar.Cluster.from_profile("dgx-h100", num_nodes=1, device_memory_gb=40)
    assert small.hardware.device.memory_bytes == 40e9


def test_from_toml_reads_a_users_profile(tmp_path):
    text = (hwprofiles.PROFILE_DIR / "dgx-h100.toml").read_text().replace(
        'name = "dgx-h100"', 'name = "my-h100"')
    path = tmp_path / "my-h100.toml"
    path.write_text(text)
    cluster = autopar.Cluster.from_toml(path, num_nodes=2)
    assert cluster.name == "my-h100" and cluster.world_size == 16
    reference = autopar.Cluster.from_profile("dgx-h100", num_nodes=2)
    assert cluster.collective_time("all_reduce", 2**26, range(16)) == \
        reference.collective_time("all_reduce", 2**26, range(16))


def test_rank_r_lives_on_node_r_div_gpus_per_node():
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=4)
    assert [cluster.node_of(r) for r in (0, 7, 8, 31)] == [0, 0, 1, 3]
    inside = cluster.collective_estimate("all_reduce", 2**30, range(8))
    across = cluster.collective_estimate("all_reduce", 2**30, range(0, 32, 8))
    assert inside.algorithm == "nvls" and across.algorithm in ("ring", "tree")
    assert across.time_s > inside.time_s


def test_a_group_laid_out_once_costs_what_the_cluster_says():
    from autopar.estimate.core import EvalCache

    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=4)
    cache = EvalCache(cluster)
    groups = [tuple(range(8)), tuple(range(0, 32, 8)), tuple(range(2, 32, 4)), (3, 12), (5,)]
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        for group in groups:
            for nbytes in (0, 4096, 2**20, 3 * 2**30):
                assert cache.collective_time(kind, nbytes, list(group)) == \
                    cluster.collective_time(kind, nbytes, group)
    assert cache.collective_time("send_recv", 2**20, (3, 12)) == \
        cluster.collective_time("send_recv", 2**20, [3, 12])
    with pytest.raises(ValueError, match=r"ranks \[40\] are outside"):
        cache.collective_time("all_gather", 1024, (0, 40))


@pytest.mark.parametrize("call,match", [
    (lambda c: c.collective_time("allreduce", 1024, [0, 1]), "unknown collective 'allreduce'"),
    (lambda c: c.collective_time("all_reduce", -1, [0, 1]), "nbytes must be"),
    (lambda c: c.collective_time("all_reduce", 1024, [0, 16]), r"ranks \[16\] are outside"),
    (lambda c: c.collective_time("all_reduce", 1024, [1, 1]), "must be distinct"),
    (lambda c: c.collective_time("send_recv", 1024, [0, 1, 2]), "send_recv takes the two ranks"),
    (lambda c: c.collective_estimate("all_gather", 1024, [0, 1], algorithm="nvls"),
     "not available for all_gather.*ring"),
])
def test_bad_calls_say_what_is_wrong(call, match):
    cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=2)
    with pytest.raises(ValueError, match=match):
        call(cluster)


def test_bad_construction_says_what_is_allowed():
    with pytest.raises(ValueError, match="num_nodes must be an integer >= 1"):
        autopar.Cluster.from_profile("dgx-h100", num_nodes=0)
    with pytest.raises(ValueError, match="unknown hardware profile 'dgx-h1000'.*dgx-h100"):
        autopar.Cluster.from_profile("dgx-h1000")
    with pytest.raises(ValueError, match="Cluster.from_toml"):
        autopar.Cluster.from_profile("my.toml")
    with pytest.raises(ValueError, match="'cpu-gloo' has no scale-out network"):
        autopar.Cluster.from_profile("cpu-gloo", num_nodes=2)
    with pytest.raises(ValueError, match="cannot override 'nic_speed'"):
        autopar.Cluster.from_profile("dgx-h100", nic_speed=100)
