"""Pin parallel degrees you must keep (here tensor parallelism 8 and pipeline 4) and let autopar
choose the rest; compare with its unconstrained choice."""

import autopar

model = autopar.models.build("llama3-70b")
cluster = autopar.Cluster.from_profile("dgx-h100", num_nodes=16)
free = autopar.compile(model, cluster, global_batch_size=512, seq_len=8192)
pinned = autopar.compile(model, cluster, global_batch_size=512, seq_len=8192,
                         constraints={"tp": 8, "pp": 4})
for name, plan in (("autopar's choice", free), ("tp=8, pp=4 pinned", pinned)):
    est = plan.estimate
    print(f"{name:>18}: {plan.config.short():55} {est.step_time_s:7.2f} s/step  "
          f"MFU {100 * est.mfu:4.1f}%  peak {est.peak_memory_bytes / 1e9:5.1f} GB")
