"""Pipeline-parallel traffic: the activations and their gradients a stage passes to its
neighbours, and the sum of the gradients of a weight two stages hold (an LM head tied to the
token embedding) -- as a rank's step lists them (`pp_step_collectives`, what a runtime's
recorded collectives are checked against) and as the time the tied sums add to a step
(`tied_gradient_sync`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from autopar.config import ParallelConfig
from autopar.estimate.data_parallel import dp_bytes
from autopar.estimate.groups import RankGroups
from autopar.estimate.layout import Layout, step_layers
from autopar.estimate.options import EstimateOptions
from autopar.estimate.stages import Boundaries
from autopar.estimate.units import Unit

if TYPE_CHECKING:
    from autopar.estimate.core import EvalCache, ModelCosts

__all__ = ["boundary_bytes", "pp_step_collectives", "tied_gradient_collectives",
           "tied_gradient_sync"]


def boundary_bytes(units: Sequence[Unit], config: ParallelConfig) -> float:
    """Bytes of the hidden state one rank sends across a stage boundary for one micro-batch:
    its cp share of the tokens, and its tp share only under sequence parallelism (without it
    the activation is whole on every tp rank, and each sends it, as torch.distributed.pipelining
    and Megatron-Core do)."""
    return max(u.act_bytes for u in units) / config.cp \
        / (config.tp if config.sequence_parallel else 1)


def tied_gradient_collectives(units: Sequence[Unit], counts: Sequence[Sequence[float]],
                              config: ParallelConfig, options: EstimateOptions, dtype: str,
                              rank: int) -> list[tuple[str, float]]:
    """What pipeline rank `rank` sends once a step, after the pipeline drains, to sum the
    gradients of the weights it shares with another stage (`Unit.tied_params`; ``counts``:
    each rank's layers of each unit): its copy's gradient, in the dtype gradients are reduced
    in, split over tp (a tied embedding and head are vocabulary-parallel; the first tp rank's
    share, the largest) and, under FSDP2 with ZeRO, over the data-parallel shards
    (Megatron-LM's embedding-group all-reduce between two ranks; autopar's runtime's exchange,
    `autopar.runtime.pipeline`)."""
    if config.pp == 1:
        return []
    where = {u.name: {r for r, c in enumerate(counts) if c[i]} for i, u in enumerate(units)}
    shards = config.dp * config.cp if options.fsdp2 and config.zero_stage else 1
    grad_b = dp_bytes(dtype, options)[1]
    # the first tp rank's rows: tp splits a vocabulary it does not divide unevenly
    return [("send_recv", -(-rows // config.tp) * numel / rows * grad_b / shards)
            for u in units for owner, numel, rows in u.tied_params
            if (rank in where[owner]) != (rank in where[u.name])]


def tied_gradient_sync(cache: "EvalCache", units: Sequence[Unit], lay: Layout,
                       config: ParallelConfig, groups: RankGroups, options: EstimateOptions,
                       dtype: str) -> float:
    """Seconds of the slowest rank's `tied_gradient_collectives` over a pipeline hop."""
    if config.pp == 1 or groups.pp_hop is None:
        return 0.0
    return max(sum(cache.collective_time(kind, n, groups.pp_hop) for kind, n in
                   tied_gradient_collectives(units, lay.rank_counts, config, options, dtype,
                                             rank))
               for rank in range(config.pp))


def pp_step_collectives(costs: "ModelCosts", config: ParallelConfig, *, global_batch_size: int,
                        options: EstimateOptions = EstimateOptions(), dtype: str = "bf16",
                        pipeline_rank: int = 0, boundaries: Boundaries | None = None
                        ) -> list[tuple[str, float]]:
    """Every pipeline transfer pipeline rank `pipeline_rank` sends in one step: per micro-batch
    and stage it holds (virtual stages included), the activation to the next stage unless it
    is the last and the activation's gradient to the previous unless it is the first
    (`boundary_bytes`), then `tied_gradient_collectives`."""
    if config.pp == 1:
        return []
    m, units, counts = step_layers(costs, config, global_batch_size, boundaries)
    last = config.pp * config.virtual_stages - 1
    hops = sum((stage < last) + (stage > 0) for stage in
               range(pipeline_rank, last + 1, config.pp))
    return [("send_recv", boundary_bytes(units, config))] * (hops * m) \
        + tied_gradient_collectives(units, counts, config, options, dtype, pipeline_rank)
