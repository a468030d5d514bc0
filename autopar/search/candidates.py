"""The configs a search considers: the space under the caller's pins and the target's rules
(`space_table`, `enumerate_configs`), which recompute policies differ on a model
(`recompute_policies`), and why a pinned space is empty (`why_empty`)."""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.estimate.core import EstimateOptions, ModelCosts
from autopar.search.settings import SearchSettings
from autopar.search.space import ConfigTable, ModelShape, config_table, key_groups
from autopar.targets import AUTOPAR, EngineTarget, Facts

__all__ = ["enumerate_configs", "recompute_policies", "space_table", "why_empty"]


def recompute_policies(costs: ModelCosts, options: EstimateOptions) -> tuple[str, ...]:
    """The recompute policies that differ on this model: "none" and "full" always; "selective"
    where there are score tensors to drop (unfused attention in the model's code, or an
    unfused kernel); "per_op" where every block keeps the output of some op
    (`ModelCosts.per_op_costed`)."""
    out = ["none"]
    if options.attention_kernel == "math" or any(
            u.saved_bytes_recompute < u.saved_bytes for u in costs.units):
        out.append("selective")
    if costs.per_op_costed:
        out.append("per_op")
    return (*out, "full")


def space_table(costs: ModelCosts, cluster: Cluster, *, global_batch_size: int,
           constraints: dict[str, Any], options: EstimateOptions,
           settings: SearchSettings, target: EngineTarget = AUTOPAR) -> ConfigTable:
    """The space before the target's rules (`EngineTarget.allows`), with the schedules the
    target runs with fewer micro-batches than pipeline ranks."""
    model = ModelShape(
        num_layers=costs.body_layers,
        body_layers=sum(u.count for u in costs.units if u.is_block) or costs.body_layers,
        num_heads=costs.num_heads, num_kv_heads=costs.num_kv_heads, seq_len=costs.seq_len,
        num_experts=costs.num_experts)
    return config_table(
        model, world=cluster.world_size, gpus_per_node=cluster.gpus_per_node,
        global_batch_size=global_batch_size, constraints=constraints,
        recomputes=recompute_policies(costs, options), settings=settings,
        few_microbatches=target.few_microbatches)


def enumerate_configs(costs: ModelCosts, cluster: Cluster, *, global_batch_size: int,
                      constraints: dict[str, Any], options: EstimateOptions,
                      settings: SearchSettings, dtype: str = "bf16",
                      target: EngineTarget = AUTOPAR) -> Iterator[ParallelConfig]:
    """Every candidate config the target runs, in a fixed order (validity is checked by
    `evaluate`); the search itself works on the columns (`autopar.search.space.config_table`)."""
    table = space_table(costs, cluster, global_batch_size=global_batch_size,
                        constraints=constraints, options=options, settings=settings,
                        target=target)
    if target.restricts:
        table = table.rows(target.allows(table, Facts.of(costs, dtype, options)))
    return table.configs()


def why_empty(costs: ModelCosts, cluster: Cluster, *, global_batch_size: int,
               constraints: dict[str, Any], options: EstimateOptions,
               settings: SearchSettings, target: EngineTarget = AUTOPAR) -> str:
    """Why the space under `constraints` is empty: each pinned value that no config holds even
    without the pins (with the values configs do hold), a pinned dp·tp·pp·cp that cannot
    factor the GPUs, or else that the pins are possible one by one but not together; then
    the enumeration's rules for the pinned fields and for dp and pp."""
    free = space_table(costs, cluster, global_batch_size=global_batch_size, constraints={},
                       options=options, settings=settings, target=target)
    if not len(free):
        return (f": no dp·tp·pp·cp factoring of the {cluster.world_size} GPUs has a dp that "
                f"divides the global batch ({global_batch_size}) with tp within a node, pp at "
                f"most the block layers ({costs.body_layers}) and cp at most max_cp "
                f"({settings.max_cp}); use fewer GPUs or a larger global batch")
    rules = {
        "dp": f"dp = GPUs / (tp·pp·cp) and divides the global batch ({global_batch_size})",
        "tp": f"tp divides the GPUs and stays within a node ({cluster.gpus_per_node} GPUs)"
              + (f" and divides the attention heads ({costs.num_heads}) and key/value heads "
                 f"({costs.num_kv_heads}) or is a multiple of the latter"
                 if costs.num_heads else ""),
        "pp": f"pp divides GPUs / (tp·cp) and is at most the block layers "
              f"({costs.body_layers})",
        "cp": ("cp needs a sequence to split, which this model's inputs do not have"
               if not costs.seq_len else
               f"cp needs a sequence ({costs.seq_len}) divisible by 2·cp and is at most max_cp "
               f"({settings.max_cp})" + ("" if costs.num_heads else
                                         "; it splits attention computed by "
                                         "F.scaled_dot_product_attention, and this model "
                                         "computes attention with ops of its own (or none)")),
        "ep": f"ep divides dp·cp (tp·cp·dp with etp=1) and the experts "
              f"({costs.num_experts or 'none'})",
        "etp": "etp=1 (experts whole, ep folded over tp) needs experts, tp > 1 and sequence "
               "parallel",
        "zero_stage": "ZeRO needs dp·cp > 1",
        "micro_batch_size": f"the micro-batch size divides the global batch / dp, leaves a "
                            f"micro-batch per pipeline rank and is at most "
                            f"max_micro_batch_size ({settings.max_micro_batch_size})",
        "pp_schedule": "pp > 1 for any schedule but the default 1f1b; interleaving needs "
                       "the body layers to split evenly into pp·v chunks and the "
                       "micro-batches of a step to be a multiple of pp",
        "virtual_stages": f"v > 1 only with interleaved-1f1b, the body layers split evenly "
                          f"into pp·v chunks, at most max_virtual_stages "
                          f"({settings.max_virtual_stages})",
        "sequence_parallel": ("sequence parallelism needs tp > 1 and a sequence" if costs.seq_len
                              else "sequence parallelism splits a sequence in the model's "
                                   "inputs (token ids [batch, seq]), which this model's inputs "
                                   "do not have"),
        "recompute": "selective recompute needs attention that keeps its scores (a math "
                     "kernel); per_op needs ops whose outputs each block keeps (an MoE layer "
                     "costed as a whole must hold its experts in an even number of [E, ...] "
                     "weights)",
        "recompute_every": f"recompute_every > 1 needs recompute='full' and that many layers "
                           f"in each chunk of a pipeline rank, and is one of "
                           f"SearchSettings.recompute_every "
                           f"({', '.join(map(str, settings.recompute_every))})",
        "mesh_order": "the mesh order names pp, dp, cp and tp once each, outer first",
    }
    out = []
    for name, want in sorted(constraints.items()):
        if name == "mesh_order":  # any config runs in any order
            continue
        have = sorted({getattr(free.config(int(i)), name)
                       for i in key_groups(free, np.arange(len(free)), (name,))[0]})
        if want not in have:
            out.append(f"no config has {name}={want!r} (without the pins: "
                       f"{', '.join(map(repr, have))})")
    mesh = {k: v for k, v in constraints.items() if k in ("dp", "tp", "pp", "cp")}
    if not out and mesh and (math.prod(mesh.values()) != cluster.world_size if len(mesh) == 4
                             else cluster.world_size % math.prod(mesh.values())):
        out.append(f"dp·tp·pp·cp must equal the {cluster.world_size} GPUs, and "
                   f"{'·'.join(f'{k}={v}' for k, v in sorted(mesh.items()))} "
                   f"{'does not' if len(mesh) == 4 else 'does not divide them'}")
    if not out:
        return (f": each pin is possible on its own but not together with the others; "
                f"relax one of {', '.join(sorted(constraints))}")
    # the rules of the pinned fields, and those of dp and pp that every factoring meets
    named = dict.fromkeys([*sorted(constraints), "dp", "pp"])
    return ": " + "; ".join(out) + ". Rules: " + "; ".join(rules[k] for k in named) + "."
