"""``ulysses``: DeepSpeed-Ulysses's head-parallel core attention, the baseline peers measure against.

Every rank of the group computes the attention of every document of the batch, whole, on 1/W of the query
heads and the KV heads they read. An all-to-all turns each rank's tokens of every head into every rank's
tokens of its own heads, one kernel call runs, and an all-to-all turns the output back (runtime.ulysses).
The work is balanced by construction, whatever the documents: each rank holds 1/W of every document's. The
price is the traffic: (W - 1) / W of every token's Q, K, V and O crosses the network in every layer, where
``cad`` moves only what balance needs.

GQA: rank j computes query heads [j H/W, (j + 1) H/W). Where W divides the KV heads, each rank receives its
H_kv / W of them; where W is larger, each rank's query heads read one KV head, which is sent to every rank
that reads it (replicated), so W must then be a multiple of H_kv.

A plan of this strategy keeps ``local``'s tasks (each piece at home): they say where the tokens live, from
which the runtime gathers each document whole. What a rank computes, sends and holds is derived here.
"""

from __future__ import annotations

import numpy as np

from attnpool.plan.cost import doc_costs
from attnpool.plan.documents import PieceTable
from attnpool.plan.local import home_tasks
from attnpool.plan.plan import AttentionShape, Plan


def ulysses_problem(degree: int, n_q_heads: int, n_kv_heads: int) -> str | None:
    """Why ``degree`` ranks cannot split these heads (per tensor-parallel rank), or None."""
    if n_q_heads % degree:
        return (f"{degree} ranks cannot split {n_q_heads} query heads evenly: ulysses needs a degree (the dp ranks) "
                f"that divides the query heads per tp rank")
    if n_kv_heads % degree and degree % n_kv_heads:
        return (f"{degree} ranks cannot split {n_kv_heads} KV heads: ulysses needs a degree that divides the KV heads "
                f"per tp rank, or a multiple of them (each rank then receives the one its query heads read)")
    return None


def kv_heads_per_rank(degree: int, n_kv_heads: int) -> int:
    """KV heads each rank computes with: its share, or (degree > n_kv_heads) the one its query heads read."""
    return max(1, n_kv_heads // degree)


def schedule_ulysses(table: PieceTable, **_):
    """The pieces at home: the tokens stay where the layout put them, and every rank computes every document."""
    return home_tasks(table)


def heads_of(plan: Plan) -> tuple[int, int]:
    """(query heads, KV heads) the plan was made for (per tensor-parallel rank)."""
    return plan.options["heads"]


def ulysses_loads(plan: Plan, cost_model) -> np.ndarray:
    """Per-rank work: every document whole, costed as one task, 1/W of it on each rank."""
    cost, _ = doc_costs(cost_model)
    t = plan.pieces
    docs = np.arange(t.num_docs)
    total = float(np.sum(cost(np.zeros(t.num_docs, dtype=np.int64), t.doc_len, docs)))
    return np.full(plan.num_ranks, total / plan.num_ranks)


def bytes_per_peer(degree: int, shape: AttentionShape) -> tuple[int, int, int]:
    """Bytes of one token that one rank sends to each other rank of ``degree``: its Q on the peer's query heads,
    K and V of the KV heads the peer reads, and (the way back) the output on the sender's query heads."""
    kv = 2 * kv_heads_per_rank(degree, shape.n_kv_heads) * shape.head_dim * shape.dtype_bytes
    return shape.q_bytes // degree, kv, shape.o_bytes // degree


def ulysses_traffic(plan: Plan, shape: AttentionShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rank, bytes of one call's forward: Q it sends to the other ranks, K and V it sends (replicated heads
    counted per receiver), and (as a server) the outputs it returns to the other ranks' tokens."""
    W = plan.num_ranks
    tokens = plan.pieces.tokens_per_rank.astype(np.int64)
    q, kv, o = bytes_per_peer(W, shape)
    return tokens * (W - 1) * q, tokens * (W - 1) * kv, (int(tokens.sum()) - tokens) * o


def ulysses_rows(plan: Plan) -> dict[str, np.ndarray]:
    """Per rank, core attention's rows (plan.metrics.AttentionRows), counted in rows of all of a tp rank's heads:
    the batch's every token on 1/W of the query heads is T/W query rows, and its output (which the kernel keeps
    for backward, beside the rank's own output after the exchange) as many; K and V on the rank's KV heads."""
    W = plan.num_ranks
    n_q, n_kv = heads_of(plan)
    home = plan.pieces.tokens_per_rank.astype(np.int64)
    total = int(home.sum())
    query = np.full(W, -(-total // W), dtype=np.int64)
    kv = np.full(W, -(-total * kv_heads_per_rank(W, n_kv) // n_kv), dtype=np.int64)
    return {"home": home, "query": query, "returned": query, "unique_kv": kv, "expanded_kv": kv}
