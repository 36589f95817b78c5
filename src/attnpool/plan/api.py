"""``plan_attention``: one entry point for every strategy, returning a :class:`Plan`."""

from __future__ import annotations

import math
import time
from typing import Sequence

import numpy as np

from attnpool.errors import ConfigError
from attnpool.plan.cad import schedule_cad
from attnpool.plan.cost import byte_price_problem, default_min_shard_tokens, load_cost_model
from attnpool.plan.documents import DocPiece, PieceTable
from attnpool.plan.local import schedule_local
from attnpool.plan.percp import schedule_percp
from attnpool.plan.plan import AttentionShape, Plan, Topology, make_plan
from attnpool.plan.ulysses import schedule_ulysses, ulysses_problem

# A strategy is a scheduler over a given layout. ``wlb`` is a layout (see layout.py)
# served locally, so as a scheduler it is ``local``. ``ulysses`` splits heads, not tasks (ulysses.py).
SCHEDULERS = {"local": schedule_local, "wlb": schedule_local, "percp": schedule_percp, "cad": schedule_cad,
              "ulysses": schedule_ulysses}
STRATEGIES = tuple(SCHEDULERS)
# The strategies whose plans send KV rows from the rank holding them to one serving queries that need them (what
# the hierarchical exchange relays, Topology.relays): local and wlb too, for a document split across ranks (its
# remote prefix); ulysses exchanges heads instead.
KV_EXCHANGING = ("local", "wlb", "percp", "cad")
# The strategies whose plans may give a server several shards of one document, with the most segments of one document
# a server gets (None: any number): percp's head and tail shards, cad's tasks. The runtime serves them without copies
# where the backend can, as a causal call per segment (up to runtime.dispatch.MAX_CAUSAL_CALL_SEGMENTS) or in one call
# at their positions (runtime.dispatch.DocumentServing). local and wlb serve each rank's own pieces, one per document
# on every layout.
SHARD_SERVING: dict[str, int | None] = {"percp": 2, "cad": None}


def head_chunks_problem(head_chunks, kv_heads: int | None = None, q_heads: int | None = None) -> str | None:
    """What is wrong with running core attention in ``head_chunks`` groups of heads (runtime.CoreAttention) on a
    rank holding ``kv_heads`` KV heads and ``q_heads`` query heads (None: not known yet), or None. A group is whole
    KV heads and their query heads, or, past the KV heads (a multiple of them), a share of one KV head's query heads
    (head_group_heads)."""
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
        return "must be a whole number >= 1"
    if kv_heads is None or kv_heads % head_chunks == 0:
        return None
    if head_chunks % kv_heads == 0 and (q_heads is None or q_heads % head_chunks == 0):
        return None
    return (f"must divide the {kv_heads} KV heads a rank holds, or be a multiple of them that divides its"
            + (f" {q_heads}" if q_heads is not None else "") + " query heads")


def head_group_heads(head_chunks: int, q_heads: int, kv_heads: int) -> tuple[int, int]:
    """The (query, KV) heads of each of ``head_chunks`` groups (head_chunks_problem: none). Past the KV heads, a
    group's queries share one KV head with the groups beside them: each group's kernel reads one."""
    return q_heads // head_chunks, max(1, kv_heads // head_chunks)


def plan_attention(pieces_per_rank: Sequence[Sequence[DocPiece]] | PieceTable, strategy: str = "cad", *,
                   cost_model=None, min_shard_tokens: int | None = None, eps: float = 0.02,
                   shape: AttentionShape = AttentionShape(), topology: Topology | None = None,
                   window: int | None = None, byte_seconds: float = 0.0) -> Plan:
    """Plan core attention for pieces already laid out on ranks.

    Deterministic: the same arguments give a byte-identical plan (see
    :meth:`Plan.fingerprint`) in any process on any machine.

    - ``cost_model``: ``None`` (the shipped measured table), ``"pairs"``, a JSON
      path, or a cost-model object.
    - ``min_shard_tokens``: smallest query shard a scheduler may cut; default from
      the cost table (512 for the H200 table).
    - ``eps``: ``cad`` leaves max/mean server load <= 1 + eps (it aims at 1 + eps/2, and
      stops early only where the minimum shard size makes the tolerance unreachable).
    - ``topology``: which node each rank is on; ``cad`` then prices bytes between nodes higher and
      prefers moves inside a node (None: every byte alike, as on one node), and with ``topology.relays``
      prices KV another server of the receiver's node already has as a hop inside the node.
    - ``window``: the sliding window (keys) of the layers the plan serves (None: causal attention). Tasks
      are priced by their windowed work and need only the window's KV (plan.plan).
    - ``byte_seconds``: what a byte of a server's exchange costs in seconds of its attention work
      (plan.cost.exchange_byte_seconds of the link's GiB/s); ``cad`` then keeps the plan of least busiest work
      plus priced bytes, balanced or not (plan.cad). 0: balance within ``eps`` whatever the bytes.
    """
    if strategy not in SCHEDULERS:
        raise ConfigError("strategy", strategy, f"unknown; choose one of {', '.join(STRATEGIES)}")
    if not (0.0 <= eps < 1.0):
        raise ConfigError("eps", eps, "must be in [0, 1)")
    table = pieces_per_rank if isinstance(pieces_per_rank, PieceTable) else PieceTable.from_pieces(pieces_per_rank)
    model = cost_model if hasattr(cost_model, "cost") else load_cost_model(cost_model)
    if min_shard_tokens is None:
        min_shard_tokens = default_min_shard_tokens(model)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
            raise ConfigError("window", window, "a sliding window is a positive number of keys")
        if not hasattr(model, "windowed"):
            raise ConfigError("cost_model", getattr(model, "name", type(model).__name__),
                              "prices causal tasks only; a windowed plan needs a model with windowed()")
        model = model.windowed(int(window))
    if min_shard_tokens < 1:
        raise ConfigError("min_shard_tokens", min_shard_tokens, "must be >= 1")
    if not (math.isfinite(byte_seconds) and byte_seconds >= 0.0):
        raise ConfigError("byte_seconds", byte_seconds, "must be a finite number >= 0")
    if byte_seconds and byte_price_problem(model):
        raise ConfigError("byte_seconds", byte_seconds, byte_price_problem(model))
    if topology is not None and len(topology.rank_node) != table.num_ranks:
        raise ConfigError("topology", f"{len(topology.rank_node)} ranks", f"the layout has {table.num_ranks}")
    if strategy == "ulysses":
        problem = ulysses_problem(table.num_ranks, shape.n_q_heads, shape.n_kv_heads)
        if problem:
            raise ConfigError("strategy", strategy, problem)
    t0 = time.perf_counter()
    tasks = SCHEDULERS[strategy](table, cost_model=model, min_shard_tokens=min_shard_tokens, eps=eps, shape=shape,
                                 topology=topology, byte_seconds=byte_seconds)
    seconds = time.perf_counter() - t0
    options = {"eps": eps, "cost_model": getattr(model, "name", type(model).__name__)}
    if strategy == "ulysses":  # which heads each rank computes (plan.ulysses)
        options["heads"] = (shape.n_q_heads, shape.n_kv_heads)
    if topology is not None and topology.num_nodes > 1:
        options["nodes"] = topology.num_nodes
        if topology.relays and strategy == "cad":  # (cad prices relayed KV: plan.cad)
            options["relays"] = True
    if byte_seconds and strategy == "cad":
        options["byte_seconds"] = byte_seconds
    return make_plan(strategy, table, *tasks, min_shard_tokens=min_shard_tokens, options=options, plan_seconds=seconds,
                     window=window)
