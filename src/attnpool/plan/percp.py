"""``percp``: per-document context parallelism as a plan.

Every document is cut into 2W equal chunks and chunk j is served by rank
min(j, 2W-1-j) (head-tail pairing, so each rank gets equal causal work of every
document). Cuts never make a shard below the minimum shard size: a document
shorter than 2W shards gets fewer chunks (n = L // min_shard), paired head-tail
over the n/2 ranks starting at the rank holding its first token, and a chunk
boundary closer than the minimum to a piece boundary is dropped.
"""

from __future__ import annotations

import numpy as np

from attnpool.plan.documents import PieceTable


def snap_cuts(bounds: list[int], desired: list[int], min_shard: int) -> list[int]:
    """Merge mandatory ``bounds`` (piece edges, incl. 0 and L) with ``desired`` cuts,
    dropping any desired cut closer than ``min_shard`` to a kept neighbour."""
    bset = sorted(set(bounds))
    out = [bset[0]]
    di = 0
    for nb in bset[1:]:
        while di < len(desired) and desired[di] < nb:
            c = desired[di]
            di += 1
            if c - out[-1] >= min_shard and nb - c >= min_shard:
                out.append(c)
        out.append(nb)
    return out


def schedule_percp(table: PieceTable, min_shard_tokens: int = 1, **_):
    W = table.num_ranks
    order = np.lexsort((table.start, table.doc))
    docs, starts, ends, ranks = (a[order].tolist() for a in (table.doc, table.start, table.end, table.rank))
    out_doc, out_s, out_e, out_p, out_srv = [], [], [], [], []
    i = 0
    P = len(order)
    while i < P:
        d = docs[i]
        j = i
        while j < P and docs[j] == d:
            j += 1
        L = int(table.doc_len[d])
        n = min(2 * W, max(1, L // max(1, min_shard_tokens)))
        chunk_edges = [(c * L) // n for c in range(n + 1)]
        bounds = [0] + ends[i:j]
        cuts = snap_cuts(bounds, chunk_edges[1:-1], min_shard_tokens)
        first_rank = ranks[i]
        k = i  # piece cursor
        for a, b in zip(cuts[:-1], cuts[1:]):
            while ends[k] <= a:
                k += 1
            chunk = min(n - 1, int(np.searchsorted(chunk_edges, a, side="right")) - 1)
            pair = min(chunk, n - 1 - chunk)
            server = pair if n == 2 * W else (first_rank + pair) % W
            out_doc.append(d); out_s.append(a); out_e.append(b); out_p.append(int(order[k])); out_srv.append(server)
        i = j
    return out_doc, out_s, out_e, out_p, out_srv
