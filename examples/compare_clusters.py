"""The same model and batch on different hardware, including a what-if: DGX A100 nodes with a
quarter of their InfiniBand bandwidth (4 NICs at 100 Gb/s instead of 8 at 200 Gb/s)."""

import autopar

model = autopar.models.build("gpt3-13b")
clusters = {
    "48 x dgx-a100-80g": autopar.Cluster.from_profile("dgx-a100-80g", num_nodes=48),
    "48 x dgx-a100-80g, 4x100G": autopar.Cluster.from_profile(
        "dgx-a100-80g", num_nodes=48, nics_per_node=4, nic_gbps=100),
    "24 x dgx-h100": autopar.Cluster.from_profile("dgx-h100", num_nodes=24),
}
for name, cluster in clusters.items():
    plan = autopar.compile(model, cluster, global_batch_size=1536, seq_len=2048, dtype="bf16")
    est = plan.estimate
    print(f"{name:>27}: {plan.config.short():50} {est.step_time_s:6.2f} s/step  "
          f"{est.tokens_per_s / 1e6:5.2f} M tokens/s  dp_comm {est.breakdown['dp_comm']:.2f} s")
