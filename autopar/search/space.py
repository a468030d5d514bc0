"""The outer search space as columns: every config in a fixed order, and its bounds.

A search on a large cluster considers tens of thousands of configs (dp·tp·pp·cp factorings x
ep x ZeRO x SP x recompute x micro-batch x schedule x virtual stages) and evaluates some of
them. Building a `ParallelConfig` and calling the bounds one config at a time cost more than
the evaluations, and grew with depth (a deeper model has more pipeline degrees and
virtual-stage splits). Here the space is a table of integer columns, built one (tp, cp, pp,
ep) block at a time with numpy, and the bounds are column arithmetic:

- the memory lower bound from model states of an even share of the parameters, by ZeRO
  stage (`states_lower_bounds`);
- the step-time lower bound of `autopar.estimate.bounds.step_lower_bound`, from the busiest
  pipeline rank's and all ranks' work per micro-batch, formed once per (pipeline split x
  micro-batch, tp, cp, ep, SP, recompute) (`step_lower_bounds`);
- the first pipeline rank's memory (`first_rank_memory`): its model states, the activations
  its schedule keeps in flight, one layer's working set and ZeRO-3 buffers, i.e. the rank-0
  term of the closed-form peak that `evaluate(exact=False)` maximises over ranks. A config
  above the device memory by it cannot fit, so the search can skip it without changing the
  ranking (only fitting configs are ranked and simulated).

The first two are the same floating-point operations in the same order as the one-config
forms (numpy element-wise arithmetic on float64 rounds exactly as Python floats do, and
integers below 2^53 convert exactly), so the search prunes and orders exactly as the
one-config loop did; the third sums in another order and is compared with a margin. A row
becomes a `ParallelConfig` only when the search evaluates it (`ConfigTable.config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from autopar.config import (DEFAULT_MESH_ORDER, PP_SCHEDULES, RECOMPUTE_POLICIES, ParallelConfig,
                            divisors, tp_splits_heads)
from autopar.estimate.core import EstimateOptions
from autopar.search.settings import SearchSettings
from costmodels.memory import RANK_FIXED_BYTES, reserved_bytes, state_bytes_split

__all__ = ["ConfigTable", "ModelShape", "config_table", "encode", "key_groups",
           "states_lower_bounds", "step_lower_bounds", "first_rank_memory", "TIME_KEY_COLUMNS"]

COLUMNS = ("dp", "tp", "pp", "cp", "ep", "etp", "zero_stage", "micro_batch_size",
           "pp_schedule", "virtual_stages", "sequence_parallel", "recompute", "recompute_every")
# the columns per-unit times depend on (the key of `EvalCache.times`, less the options)
TIME_KEY_COLUMNS = ("micro_batch_size", "tp", "cp", "ep", "etp", "sequence_parallel",
                    "recompute", "recompute_every")
_INTERLEAVED = PP_SCHEDULES.index("interleaved-1f1b")
_ZERO_BUBBLE = PP_SCHEDULES.index("zero-bubble")


@dataclass(frozen=True)
class ConfigTable:
    """Configs as int64 columns (pp_schedule and recompute as indices into PP_SCHEDULES and
    RECOMPUTE_POLICIES, sequence_parallel as 0/1), rows in enumeration order."""

    columns: dict[str, np.ndarray]
    mesh_order: tuple[str, ...] = DEFAULT_MESH_ORDER  # every row's

    def __len__(self) -> int:
        return len(self.columns["dp"])

    def config(self, i: int) -> ParallelConfig:
        row = {name: int(self.columns[name][i]) for name in COLUMNS}
        row["pp_schedule"] = PP_SCHEDULES[row["pp_schedule"]]
        row["recompute"] = RECOMPUTE_POLICIES[row["recompute"]]
        row["sequence_parallel"] = bool(row["sequence_parallel"])
        return ParallelConfig(**row, mesh_order=self.mesh_order)

    def configs(self) -> Iterator[ParallelConfig]:
        return (self.config(i) for i in range(len(self)))

    @classmethod
    def of(cls, configs: Sequence[ParallelConfig]) -> "ConfigTable":
        """The table of `configs` (one mesh order, or the default for none): the inverse of
        `config`."""
        orders = {cfg.mesh_order for cfg in configs}
        assert len(orders) <= 1, "a table holds configs of one mesh order"
        columns = {name: np.array([encode(name, getattr(cfg, name)) for cfg in configs],
                                  dtype=np.int64) for name in COLUMNS}
        return cls(columns, orders.pop() if orders else DEFAULT_MESH_ORDER)

    def rows(self, keep: np.ndarray) -> "ConfigTable":
        """The rows that the mask or index array ``keep`` selects."""
        return ConfigTable({name: col[keep] for name, col in self.columns.items()},
                           self.mesh_order)

    def tie_order(self) -> tuple[np.ndarray, ...]:
        """The columns of the search's tie-break, most significant first: (pp, tp, cp, ep, dp,
        zero_stage, recompute, recompute_every, micro_batch_size, pp_schedule, virtual_stages,
        sequence_parallel, etp); recompute and pp_schedule compare by their index in
        RECOMPUTE_POLICIES / PP_SCHEDULES, as `_tie_key` does."""
        c = self.columns
        return tuple(c[name] for name in ("pp", "tp", "cp", "ep", "dp", "zero_stage", "recompute",
                                          "recompute_every", "micro_batch_size", "pp_schedule",
                                          "virtual_stages", "sequence_parallel", "etp"))


def encode(name: str, value: Any) -> int:
    """A config field's value as its table column holds it."""
    if name == "pp_schedule":
        return PP_SCHEDULES.index(value)
    if name == "recompute":
        return RECOMPUTE_POLICIES.index(value)
    return int(value)


def _allowed(name: str, values: list, constraints: dict[str, Any]) -> list:
    if name in constraints:
        return [v for v in values if v == constraints[name]]
    return values


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What of a model the space's rules read (`config_table`)."""

    num_layers: int
    """The block layers: pp is at most this many."""
    body_layers: int
    """Every block layer of every kind: interleaving and one-in-k recompute split these."""
    num_heads: int | None
    """Attention heads, which tp splits (None: no attention of its own to split, nor cp)."""
    num_kv_heads: int | None
    """Key/value heads (`tp_splits_heads`)."""
    seq_len: int | None
    """The sequence of the inputs (None: no token dimension, so no SP and no cp)."""
    num_experts: int | None
    """Experts of the MoE layers, which ep divides (None: a dense model, ep 1)."""


def config_table(model: ModelShape, *, world: int, gpus_per_node: int, global_batch_size: int,
                 constraints: dict[str, Any], recomputes: tuple[str, ...],
                 settings: SearchSettings, few_microbatches: tuple[str, ...] = ("gpipe",)
                 ) -> ConfigTable:
    """Every candidate config (validity is checked by `evaluate`), in the order: tp, cp, pp,
    ep ascending (ep within dp x cp, then, for a model with experts under tp, ep folded over
    tp x cp x dp: etp = 1, with SP only); then micro-batch size, recompute, SP, schedule
    (gpipe, 1f1b, zero-bubble, interleaved by virtual stages), ZeRO stage. tp stays within a
    node and splits the heads (`tp_splits_heads`);
    sequence parallelism needs a sequence (``seq_len``) whose cp shards tp divides;
    cp needs a sequence divisible by 2·cp and at most ``settings.max_cp``; pp is at most
    ``num_layers`` (the block layers) and the micro-batches per step at least pp, unless the
    schedule is one of ``few_microbatches``; interleaving needs the body layers to split evenly
    into pp·v chunks and the micro-batches to be a multiple of pp. ``recomputes`` are the
    recompute policies that differ on this model (`RECOMPUTE_POLICIES`); full recompute comes
    once per ``settings.recompute_every`` k of at most the layers per chunk of a pipeline
    rank, k ascending. ``settings`` also bounds the micro-batch size and the virtual
    stages."""
    gbs, heads, seq_len = global_batch_size, model.num_heads, model.seq_len
    degrees: list[tuple[int, ...]] = []  # (dp, tp, pp, cp, ep, etp) of each block
    sizes: list[int] = []
    inner: list[dict[str, np.ndarray]] = []
    rules = _Rules(global_batch_size=gbs, constraints=constraints,
                   body_layers=model.body_layers, recomputes=recomputes, settings=settings,
                   few=few_microbatches, grids=_Grids())
    blocks: dict[tuple[int, int, bool, bool], dict[str, np.ndarray] | None] = {}
    tps = [t for t in divisors(world) if t <= gpus_per_node
           and tp_splits_heads(t, heads, model.num_kv_heads)]
    for tp in _allowed("tp", tps, constraints):
        cps = [c for c in divisors(world // tp) if c <= settings.max_cp
               and (c == 1 or (heads is not None and seq_len and seq_len % (2 * c) == 0))]
        for cp in _allowed("cp", cps, constraints):
            pps = [p for p in divisors(world // (tp * cp)) if p <= model.num_layers]
            for pp in _allowed("pp", pps, constraints):
                dp = world // (tp * cp * pp)
                if "dp" in constraints and constraints["dp"] != dp:
                    continue
                if gbs % dp:
                    continue
                eps = [(e, 0) for e in divisors(dp * cp)
                       if model.num_experts and model.num_experts % e == 0] or [(1, 0)]
                # tp and cp shape a block only through whether SP and ZeRO apply; SP splits
                # each cp rank's tokens over tp
                key = (dp, pp, tp > 1 and bool(seq_len) and seq_len % (tp * cp) == 0,
                       dp * cp > 1)
                if key not in blocks:
                    blocks[key] = _block(rules, dp=dp, pp=pp, with_sp=key[2], with_zero=key[3])
                block = blocks[key]
                if block is None:
                    continue
                if model.num_experts and key[2]:  # folded over tp: SP rows only
                    eps += [(e, 1) for e in divisors(dp * cp * tp)
                            if model.num_experts % e == 0]
                for ep, etp in eps:
                    if constraints.get("ep", ep) != ep or constraints.get("etp", etp) != etp:
                        continue
                    degrees.append((dp, tp, pp, cp, ep, etp))
                    sizes.append(len(block["zero_stage"]))
                    inner.append(block)
    order = (ParallelConfig(mesh_order=constraints["mesh_order"]).mesh_order
             if "mesh_order" in constraints else DEFAULT_MESH_ORDER)
    if not inner:
        return ConfigTable({name: np.zeros(0, dtype=np.int64) for name in COLUMNS}, order)
    per_block = np.array(degrees, dtype=np.int64)
    columns = {name: np.repeat(per_block[:, k], sizes)
               for k, name in enumerate(("dp", "tp", "pp", "cp", "ep", "etp"))}
    for name in _INNER_COLUMNS:
        columns[name] = np.concatenate([b[name] for b in inner])
    table = ConfigTable({name: columns[name] for name in COLUMNS}, order)
    folded_without_sp = (columns["etp"] == 1) & (columns["sequence_parallel"] == 0)
    return table.rows(~folded_without_sp) if folded_without_sp.any() else table


_INNER_COLUMNS = ("zero_stage", "micro_batch_size", "pp_schedule", "virtual_stages",
                  "sequence_parallel", "recompute", "recompute_every")


class _Grids:
    """Memo of one `config_table` call: the C-order index grids of each block shape and the
    int64 arrays of each list of values (blocks repeat both many times)."""

    def __init__(self) -> None:
        self._grids: dict[tuple[int, ...], tuple[np.ndarray, ...]] = {}
        self._arrays: dict[tuple, np.ndarray] = {}

    def grid(self, shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
        if shape not in self._grids:
            self._grids[shape] = tuple(a.ravel() for a in np.indices(shape))
        return self._grids[shape]

    def array(self, values: tuple) -> np.ndarray:
        if values not in self._arrays:
            self._arrays[values] = np.array(values, dtype=np.int64)
        return self._arrays[values]


@dataclass(frozen=True)
class _Rules:
    """What every block of one `config_table` call is enumerated under."""

    global_batch_size: int
    constraints: dict[str, Any]  # the caller's pins
    body_layers: int  # `ModelShape.body_layers`
    recomputes: tuple[str, ...]  # the recompute policies that differ on the model
    settings: SearchSettings  # the largest micro-batch, virtual stages, recompute_every
    few: tuple[str, ...]  # schedules that run fewer micro-batches than pipeline ranks
    grids: _Grids  # the call's memo of index grids and value arrays


def _block(rules: _Rules, *, dp: int, pp: int, with_sp: bool, with_zero: bool
           ) -> dict[str, np.ndarray] | None:
    """The ZeRO, micro-batch, schedule, virtual-stage, SP and recompute columns of the rows
    of one (tp, cp, pp, dp, ep): the product micro-batch x recompute x SP x schedule x ZeRO
    in that nesting (C order), less the rows with fewer micro-batches than pp unless their
    schedule is one of `rules.few`, and interleaved rows whose micro-batch count is not a
    multiple of pp. SP is searched `with_sp` (tp > 1 and the model has a sequence: CNNs have
    no token dimension to split), ZeRO `with_zero` (dp * cp > 1)."""
    gbs, constraints, grids = rules.global_batch_size, rules.constraints, rules.grids
    body_layers, few = rules.body_layers, rules.few
    max_mbs, max_v = rules.settings.max_micro_batch_size, rules.settings.max_virtual_stages
    zeros = _allowed("zero_stage", [0, 1, 2, 3] if with_zero else [0], constraints)
    sps = _allowed("sequence_parallel", [False, True] if with_sp else [False], constraints)
    everies = _allowed("recompute_every", [k for k in rules.settings.recompute_every
                                           if k == 1 or k * pp <= body_layers], constraints)
    recomputes = [(r, k) for r in _allowed("recompute", list(rules.recomputes), constraints)
                  for k in (everies if r == "full" else [1] if 1 in everies else [])]
    # fewer micro-batches than pipeline ranks: the schedules `few` (`check_config`)
    mbss = _allowed("micro_batch_size", [b for b in divisors(gbs // dp) if b <= max_mbs],
                    constraints)
    if pp == 1:
        schedules = [("1f1b", 1)]
    else:
        per_stage = body_layers // pp
        vs = [v for v in range(2, max_v + 1) if per_stage >= v and body_layers % (pp * v) == 0]
        schedules = [("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1)] + \
            [("interleaved-1f1b", v) for v in vs]
    schedules = [(s, v) for s, v in schedules
                 if constraints.get("pp_schedule", s) == s
                 and ("virtual_stages" not in constraints or constraints["virtual_stages"] == v)]
    shape = (len(mbss), len(recomputes), len(sps), len(schedules), len(zeros))
    if 0 in shape:
        return None
    i_mbs, i_rc, i_sp, i_sched, i_zero = grids.grid(shape)
    mbs = grids.array(tuple(mbss))[i_mbs]
    sched = grids.array(tuple(PP_SCHEDULES.index(s) for s, _ in schedules))[i_sched]
    out = {
        "zero_stage": grids.array(tuple(zeros))[i_zero],
        "micro_batch_size": mbs,
        "pp_schedule": sched,
        "virtual_stages": grids.array(tuple(v for _, v in schedules))[i_sched],
        "sequence_parallel": grids.array(tuple(int(x) for x in sps))[i_sp],
        "recompute": grids.array(tuple(RECOMPUTE_POLICIES.index(r) for r, _ in recomputes))[i_rc],
        "recompute_every": grids.array(tuple(k for _, k in recomputes))[i_rc],
    }
    if pp > 1:
        m = gbs // (dp * mbs)
        keep = (m >= pp) | np.isin(sched, grids.array(tuple(PP_SCHEDULES.index(s)
                                                             for s in few)))
        if any(s == "interleaved-1f1b" for s, _ in schedules):
            keep &= ~((sched == _INTERLEAVED) & (m % pp != 0))
        # one block in k checkpointed needs k blocks in each of a rank's chunks
        keep &= out["recompute_every"] * pp * out["virtual_stages"] <= body_layers
        if not keep.all():
            out = {name: col[keep] for name, col in out.items()}
    return out


def _int_over(numerator: int, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator per element, rounded as Python's int / int (exactly once)."""
    if abs(numerator) <= 2 ** 53 and int(np.abs(denominator).max(initial=0)) <= 2 ** 53:
        out = denominator.astype(np.float64)
        return np.divide(float(numerator), out, out=out)
    return np.array([numerator / int(d) for d in denominator], dtype=np.float64)


def _state_bytes(dtype: str, zero: np.ndarray, shards: np.ndarray,
                 fp32_params: bool = False) -> np.ndarray:
    """`state_bytes_per_param` per row: weights + grads + optimizer states, each divided by
    the shards from the ZeRO stage that shards it on (the same three terms, summed left to
    right). Two arrays of the table's length, reused in place: at tens of thousands of rows
    each new one costs page faults, more than its arithmetic. With `fp32_params` the terms
    change with the stage (`state_bytes_split`'s three cases, stage 0, 1-2 and 3)."""
    if fp32_params and dtype != "fp32":
        whole = zero == 0
        weights = np.where(zero == 3, 4.0 / shards, 2.0)
        grads = 4.0 / shards
        optim = np.where(zero == 3, 8.0, 12.0)
        optim /= shards
        for term, unsharded in ((weights, 4.0), (grads, 4.0), (optim, 8.0)):
            term[whole] = unsharded
        weights += grads
        weights += optim
        return weights
    terms = state_bytes_split(dtype, 0, 1)
    out, term = np.empty(len(zero)), np.empty(len(zero))
    for k, (bytes_, into) in enumerate(zip(terms, (out, term, term))):
        np.divide(bytes_, shards, out=into)  # stage 3 shards weights, 2 grads, 1 optimizer
        np.copyto(into, bytes_, where=zero < 3 - k)
        if k:
            out += term
    return out


def _expert_split(c: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """`ParallelConfig.expert_tp` and `expert_dp` per row: the ranks splitting each expert,
    and those sharing each expert shard."""
    expert_tp = np.where(c["etp"] == 1, 1, c["tp"])
    return expert_tp, c["dp"] * c["cp"] * c["tp"] // (c["ep"] * expert_tp)


def states_lower_bounds(table: ConfigTable, *, dense_params: int, expert_params: int,
                        dtype: str, fp32_params: bool = False) -> np.ndarray:
    """Per row: the bytes no placement can avoid, model states of an even share of the
    parameters plus the fixed buffers (the search's `_states_lower_bound`). A model without
    experts skips their term (adding 0.0 changes no sum)."""
    c = table.columns
    if not len(table):
        return np.zeros(0)
    model = c["tp"] * c["pp"]
    shards = c["dp"] * c["cp"]
    out = _int_over(dense_params, model)
    out *= _state_bytes(dtype, c["zero_stage"], shards, fp32_params)
    if expert_params:
        expert_tp, expert_dp = _expert_split(c)
        expert = _int_over(expert_params, expert_tp * c["pp"] * c["ep"])
        expert *= _state_bytes(dtype, c["zero_stage"], expert_dp, fp32_params)
        out += expert
    out += RANK_FIXED_BYTES
    return out


def step_lower_bounds(table: ConfigTable, rows: np.ndarray, busiest: np.ndarray,
                      total: np.ndarray, tail: np.ndarray, *,
                      global_batch_size: int) -> np.ndarray:
    """`step_lower_bound` for `rows` of the table, given per row the busiest pipeline rank's
    and all ranks' forward + backward seconds of one micro-batch (`busiest`, `total`) and
    the largest rank's forward + backward less weight-grad (`tail`): (m + (p-1)/v)·busiest
    interleaved, m·busiest for p = 1, m·busiest + (p-1)·max(tail, 0) for ZB-H1, else total +
    (m-1)·busiest."""
    col = table.columns
    pp, sched = col["pp"][rows], col["pp_schedule"][rows]
    m = col["dp"][rows] * col["micro_batch_size"][rows]
    np.floor_divide(global_batch_size, m, out=m)
    # each schedule's form on its rows alone, interleaved over p = 1 over ZB-H1 over the rest
    # (fewer temporaries of the table's length: at tens of thousands of rows each new one
    # costs page faults, more than its arithmetic)
    out = (m - 1) * busiest
    out += total
    at = np.flatnonzero(sched == _ZERO_BUBBLE)
    out[at] = m[at] * busiest[at] + (pp[at] - 1) * np.maximum(tail[at], 0.0)
    at = np.flatnonzero(pp == 1)
    out[at] = m[at] * busiest[at]
    at = np.flatnonzero(sched == _INTERLEAVED)
    out[at] = (m[at] + (pp[at] - 1) / col["virtual_stages"][rows[at]]) * busiest[at]
    return out


def key_groups(table: ConfigTable, rows: np.ndarray, names: tuple[str, ...]
               ) -> tuple[np.ndarray, np.ndarray]:
    """Group `rows` (non-empty) by the columns `names`: the position in `rows` of the first
    row of each distinct key (keys in ascending order), and each row's key number."""
    code = np.zeros(len(rows), dtype=np.int64)  # the columns as one mixed-radix integer
    span = 1
    for name in names:
        col = table.columns[name][rows]
        radix = int(col.max()) + 1
        code = code * radix + col
        span *= radix
    if span > 8 * len(rows) + 4096:  # sparse codes: sort them
        _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
        return first, np.asarray(inverse).reshape(-1)
    # dense codes: number the ones present by a table over all codes (no sort)
    present = np.zeros(span, dtype=bool)
    present[code] = True
    keys = np.flatnonzero(present)
    number = np.empty(span, dtype=np.int64)
    number[keys] = np.arange(len(keys))
    inverse = number[code]
    first = np.full(len(keys), len(rows), dtype=np.int64)
    np.minimum.at(first, inverse, np.arange(len(rows)))
    return first, inverse


def first_rank_memory(table: ConfigTable, rows: np.ndarray, *, units: dict[int, tuple],
                      structure_of, activations_of, dtype: str, global_batch_size: int,
                      options: EstimateOptions, memo: dict | None = None) -> np.ndarray:
    """Peak bytes of pipeline rank 0 by the closed form of `evaluate(exact=False)`, per row
    (NaN where the rank's layers are unknown: a split the estimate refuses).

    `units[mbs]` are the model's units for a micro-batch size; `structure_of(pp, v)` the
    layer counts per rank of that split (None if it cannot be made); `activations_of(unit,
    cfg, flash)` the (kept, working) bytes per layer. `options` says whether attention is
    flash (`attention_kernel`), the ZeRO-3 gather cap and whether weights are fp32.
    `memo`, a dict the caller keeps across calls on one table, holds the per-unit activation
    bytes of each key already seen. The sum is formed in another order than the estimate's,
    so callers compare it with a relative margin."""
    flash, zero3_cap = options.attention_kernel != "math", options.zero3_max_live_params
    fp32_params = options.fp32_params
    if not len(rows):
        return np.zeros(0)
    c = {name: col[rows] for name, col in table.columns.items()}
    tp, cp, pp, v, mbs = (c[n] for n in ("tp", "cp", "pp", "virtual_stages", "micro_batch_size"))
    n_units = len(next(iter(units.values())))
    # rank 0's layers per unit, per (pp, v) split
    s_first, s_index = key_groups(table, rows, ("pp", "virtual_stages"))
    counts = np.full((len(s_first), n_units), np.nan)
    for k, i in enumerate(s_first):
        st = structure_of(int(pp[i]), int(v[i]))
        if st is not None:
            counts[k] = st.rank_counts[0]
    counts = counts[s_index]
    present = counts > 0
    # per-layer activation bytes per (micro-batch, tp, cp, SP, recompute, recompute_every)
    names = ("micro_batch_size", "tp", "cp", "sequence_parallel", "recompute", "recompute_every",
             "zero_stage")  # ZeRO: whether autocast's weight copies are kept
    a_first, a_index = key_groups(table, rows, names)
    kept_u = np.empty((len(a_first), n_units))
    working_u = np.empty((len(a_first), n_units))
    memo = {} if memo is None else memo
    keys = np.stack([c[name][a_first] for name in names], axis=1).tolist()
    for k, key in enumerate(map(tuple, keys)):
        if key not in memo:
            cfg = table.config(int(rows[a_first[k]]))
            acts = [activations_of(u, cfg, flash) for u in units[cfg.micro_batch_size]]
            memo[key] = ([a for a, _ in acts], [w for _, w in acts])
        kept_u[k], working_u[k] = memo[key]
    kept = (counts * kept_u[a_index]).sum(axis=1)
    working = np.where(present, working_u[a_index], 0.0).max(axis=1)
    base = units[min(units)]
    tps, at = np.unique(tp, return_inverse=True)
    dense = (counts * np.array([[u.dense_on_tp_rank(int(t)) for u in base]
                                for t in tps])[at]).sum(axis=1)
    expert_tp, expert_dp = _expert_split(c)
    expert = (counts * np.array([u.expert_params for u in base], float)).sum(axis=1) \
        / (expert_tp * c["ep"])
    shards = c["dp"] * cp
    zero = c["zero_stage"]
    if options.fsdp2:  # what the rank holds at its peak (`memory.held_zero_stage`)
        zero = np.where((pp > 1) & (zero > 1), 1, zero)
    states = dense * _state_bytes(dtype, zero, shards, fp32_params) \
        + expert * _state_bytes(dtype, zero, expert_dp, fp32_params)
    pbytes = np.array([u.param_bytes for u in base], float)
    bpp = pbytes / np.maximum(1, [u.dense_params + u.expert_params for u in base])
    gathered = 2 * np.where(present, pbytes, 0.0).max(axis=1) / tp
    if zero3_cap is not None:
        gathered = np.minimum(gathered, zero3_cap * np.where(present, bpp, 0.0).max(axis=1))
    gathered = np.where(zero == 3, gathered, 0.0)
    m = global_batch_size // (c["dp"] * mbs)
    sched = c["pp_schedule"]
    held = np.where(m == pp, m * v, np.minimum(2 * (pp - 1) + (v - 1) * pp + 1, m * v))
    inflight = np.where(sched == PP_SCHEDULES.index("gpipe"), m * kept,
                        np.where((sched == _INTERLEAVED) & (v > 1), held * kept / v,
                                 np.minimum(pp, m) * kept))
    live = states + inflight + working + gathered
    return reserved_bytes(live)
