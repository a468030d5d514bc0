"""Plan GPT-3 175B on 128 DGX A100 nodes and print the Megatron-LM flags that run the plan,
with a note for anything Megatron-LM cannot express."""

import autopar
from autopar.plan import export_plan

model = autopar.models.build("gpt3-175b")
cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_nodes=128)
plan = autopar.compile(model, cluster, global_batch_size=1536, seq_len=2048, dtype="fp16",
                       constraints={"tp": 8})
exported = export_plan(plan, "megatron")
print(exported.text)
for note in exported.notes:
    print("note:", note)
