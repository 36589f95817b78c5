"""A step's plans: each micro-batch laid out over the dp ranks and its core attention planned (attnpool.plan),
as the run spec says (strategy, cost model, shard size, heads, padding).

Every rank plans the same batches the same way, so the plans agree (core attention compares their
fingerprints before its first collective). ``StepPlan`` keeps the attention loads each rank would have had
served at home beside those of the plan: the balance the metrics report. A model whose layers differ in kind
(sliding windows: attnpool.kinds) gets one plan per window, and the loads are the layers' mean.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from attnpool.data import GlobalBatch
from attnpool.plan import PieceTable, layout_table, linear_table, pad_ranks, plan_attention
from attnpool.plan.metrics import home_loads, imbalance, server_loads
from attnpool.plan.plan import Plan
from attnpool.plan.stages import POOLED, pooled_table, schedule_stage_layers, slot_presence, ticks
from attnpool.sparse.cost import SparsePrior
from attnpool.train.spec import RunSpec


@dataclass
class StepPlan:
    plan: Plan | None  # its ``pieces`` are the layout (None for a step's combined nano-batches); the first kind's
    batch: GlobalBatch | None  # the batch the plan's pieces refer to (with any padding documents)
    load_local: list[float]  # per rank: attention load if every rank served its own tokens of the linear layout
    load_planned: list[float]  # per rank: attention load under the plan
    imbalance_local: float  # max / mean of load_local
    imbalance_planned: float  # max / mean of load_planned
    plans: dict | None = None  # window -> the plan of the layers with that window (RunSpec.plan_windows)


def plan_batch(batch: GlobalBatch, spec: RunSpec, sparse_prior: SparsePrior | None = None,
               strategy: str | None = None) -> StepPlan:
    """Lay out the batch over the dp ranks (the run's layout, or wlb's re-packing) and plan its core attention for the
    run's strategy (or ``strategy``: "local" where only the layout is wanted, as a pooled pipeline plans its ticks
    itself).

    With sparse attention the cost of a task is its expected sparse work (``sparse_prior``). Under tensor
    parallelism every rank's tokens are padded to a multiple of tp by a padding document
    (plan.layout.pad_ranks), which the returned ``batch`` holds."""
    a, dp = spec.config.attention, spec.dims.dp
    linear = linear_table(batch.doc_lens, dp, batch.tokens_per_rank)
    table = layout_table(a.layout, batch.doc_lens, dp, batch.tokens_per_rank, a.strategy, a.memory_cap, linear)
    if spec.tokens_multiple > 1:
        table = pad_ranks(table, spec.tokens_multiple)
        batch = batch.padded(table.doc_len[batch.num_docs:])
    cost_model = spec.cost_model
    if sparse_prior is not None:  # the tables number documents in batch order, padding last
        cost_model = sparse_prior.cost_model(table.doc_len, cost_model)
    longest = int(table.doc_len.max(initial=0))
    plans = {}
    for window in spec.plan_windows:
        # a window no document reaches past computes causal attention: planned (and served) as such
        planned_window = window if window is not None and window < longest else None
        same = next((p for p in plans.values() if p.window == planned_window), None)
        plans[window] = same or plan_attention(table, strategy or a.strategy, cost_model=cost_model,
                                               min_shard_tokens=a.min_shard, eps=a.eps, shape=spec.attention_shape,
                                               topology=spec.topology, window=planned_window,
                                               byte_seconds=spec.byte_seconds)
    # "before" is always plain packing served at home; the loads are the layers' mean over their kinds
    weights = layer_shares(spec)
    local = sum(w * home_loads(linear, cost_model, plans[window].window) for window, w in weights.items())
    planned = sum(w * server_loads(plans[window], cost_model) for window, w in weights.items())
    plan = plans[spec.plan_windows[0]]
    return StepPlan(plan, batch, local.tolist(), planned.tolist(), imbalance(local), imbalance(planned), plans)


def layer_shares(spec: RunSpec) -> dict:
    """window -> the share of the model's layers with that window (one entry, 1.0, without kinds)."""
    kinds = spec.layer_kinds
    if not kinds:
        return {None: 1.0}
    counts = Counter(kind.window for kind in kinds)
    return {window: counts[window] / len(kinds) for window in spec.plan_windows}


def plan_microbatch(batch: GlobalBatch, spec: RunSpec, sparse_prior: SparsePrior | None = None,
                    strategy: str | None = None) -> list[StepPlan]:
    """A micro-batch's plans: one, or with ping-pong one per nano-batch (its documents split in two)."""
    nanos = batch.split_documents(2) if spec.config.attention.pingpong else [batch]
    return [plan_batch(nano, spec, sparse_prior, strategy) for nano in nanos]


def plan_pooled_ticks(tables: list[PieceTable], spec: RunSpec,
                      linear_tables: list[PieceTable] | None = None) -> list[list[StepPlan | None]]:
    """Every tick's plans of a pooled pipeline step (attnpool.parallel.pooled_pipeline) over all stages' dp
    ranks, per layer slot: one plan for each set of stages with a layer in the slot (plan.stages.slot_presence;
    slots of the same set share it), None where no stage has tokens in it. Loads are divided by the model's
    layers: each micro-batch's tokens are in as many slots as it has layers, so the slots' summed loads are the
    step's attention work per layer, as a step's plans count it without pooling. ``linear_tables``: the
    micro-batches' linear layouts, whose loads at home are the "before" of every layout (default ``tables``)."""
    stages, layers = spec.dims.pp, spec.model.config.n_layers
    presence = slot_presence([len(r) for r in schedule_stage_layers(spec.model.config, POOLED, stages)])
    out = []
    for tick in range(ticks(len(tables), stages)):
        by_presence = {present: _pooled_plan(pooled_table(tables, tick, stages, present), spec, layers,
                                             pooled_table(linear_tables or tables, tick, stages, present))
                       for present in set(presence)}
        out.append([by_presence[present] for present in presence])
    return out


def _pooled_plan(table: PieceTable | None, spec: RunSpec, layers: int, linear: PieceTable | None) -> StepPlan | None:
    if table is None:
        return None
    a = spec.config.attention
    plan = plan_attention(table, a.strategy, cost_model=spec.cost_model, min_shard_tokens=a.min_shard, eps=a.eps,
                          shape=spec.attention_shape, byte_seconds=spec.byte_seconds)
    local, planned = home_loads(linear, spec.cost_model) / layers, server_loads(plan, spec.cost_model) / layers
    return StepPlan(plan, None, local.tolist(), planned.tolist(), imbalance(local), imbalance(planned))


def combine_plans(plans: list[StepPlan], in_turn: bool = False) -> StepPlan:
    """One step's balance over its nano-batches: per-rank loads summed (the plans themselves stay separate).
    ``in_turn``: the plans run one after another, each as long as its busiest rank, so the step's imbalance is
    the sum of their busiest ranks' loads over the sum of their means (a pooled pipeline's ticks)."""
    if len(plans) == 1:
        return plans[0]
    local = np.sum([p.load_local for p in plans], axis=0).tolist()
    planned = np.sum([p.load_planned for p in plans], axis=0).tolist()
    if in_turn:
        def step_imbalance(loads):
            mean = sum(float(np.mean(x)) for x in loads)
            return sum(max(x) for x in loads) / mean if mean > 0 else 1.0  # as imbalance(): 1.0 without work
        return StepPlan(None, None, local, planned, step_imbalance([p.load_local for p in plans]),
                        step_imbalance([p.load_planned for p in plans]))
    return StepPlan(None, None, local, planned, imbalance(local), imbalance(planned))
