"""``plan_attention``: one entry point for every strategy, returning a :class:`Plan`."""

from __future__ import annotations

import time
from typing import Sequence

from attnpool.errors import ConfigError
from attnpool.plan.cad import schedule_cad
from attnpool.plan.cost import default_min_shard_tokens, load_cost_model
from attnpool.plan.documents import DocPiece, PieceTable
from attnpool.plan.local import schedule_local
from attnpool.plan.percp import schedule_percp
from attnpool.plan.plan import AttentionShape, Plan, make_plan

# A strategy is a scheduler over a given layout. ``wlb`` is a layout (see layout.py)
# served locally, so as a scheduler it is ``local``.
SCHEDULERS = {"local": schedule_local, "wlb": schedule_local, "percp": schedule_percp, "cad": schedule_cad}
STRATEGIES = tuple(SCHEDULERS)


def plan_attention(pieces_per_rank: Sequence[Sequence[DocPiece]] | PieceTable, strategy: str = "cad", *,
                   cost_model=None, min_shard_tokens: int | None = None, eps: float = 0.02,
                   shape: AttentionShape = AttentionShape()) -> Plan:
    """Plan core attention for pieces already laid out on ranks.

    Deterministic: the same arguments give a byte-identical plan (see
    :meth:`Plan.fingerprint`) in any process on any machine.

    - ``cost_model``: ``None`` (the shipped measured table), ``"pairs"``, a JSON
      path, or a cost-model object.
    - ``min_shard_tokens``: smallest query shard a scheduler may cut; default from
      the cost table (512 for the H200 table).
    - ``eps``: ``cad`` leaves max/mean server load <= 1 + eps (it aims at 1 + eps/2, and
      stops early only where the minimum shard size makes the tolerance unreachable).
    """
    if strategy not in SCHEDULERS:
        raise ConfigError("strategy", strategy, f"unknown; choose one of {', '.join(STRATEGIES)}")
    if not (0.0 <= eps < 1.0):
        raise ConfigError("eps", eps, "must be in [0, 1)")
    table = pieces_per_rank if isinstance(pieces_per_rank, PieceTable) else PieceTable.from_pieces(pieces_per_rank)
    model = cost_model if hasattr(cost_model, "cost") else load_cost_model(cost_model)
    if min_shard_tokens is None:
        min_shard_tokens = default_min_shard_tokens(model)
    if min_shard_tokens < 1:
        raise ConfigError("min_shard_tokens", min_shard_tokens, "must be >= 1")
    t0 = time.perf_counter()
    tasks = SCHEDULERS[strategy](table, cost_model=model, min_shard_tokens=min_shard_tokens, eps=eps, shape=shape)
    seconds = time.perf_counter() - t0
    options = {"eps": eps, "cost_model": getattr(model, "name", type(model).__name__)}
    return make_plan(strategy, table, *tasks, min_shard_tokens=min_shard_tokens, options=options, plan_seconds=seconds)
