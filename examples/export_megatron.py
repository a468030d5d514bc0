"""Plan GPT-3 175B on 128 DGX A100 nodes for Megatron-LM and print the flags that run the plan,
what to set up besides them, and what keeping to Megatron-LM's options cost against the best
plan for autopar's own runtime."""

import autopar
from autopar.plan import export_plan

model = autopar.models.build("gpt3-175b")
cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_nodes=128)
plan = autopar.compile(model, cluster, global_batch_size=1536, seq_len=2048, dtype="fp16",
                       constraints={"tp": 8}, target="megatron")
exported = export_plan(plan, "megatron")
print(exported.text)
for step in exported.setup:
    print("setup:", step)
for note in exported.notes:  # none for a plan made for Megatron-LM
    print("note:", note)
free = plan.training.unrestricted
if free["step_time_s"] is not None:
    print(f"best for autopar's runtime {free['step_time_s']:.3f} s ({free['config']}) vs best "
          f"for Megatron-LM {plan.estimate.step_time_s:.3f} s ({plan.config.short()})")
