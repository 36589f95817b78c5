"""``percp``: per-document context parallelism as a plan.

Every document is cut into n = 2W equal chunks and chunk j is served by rank
min(j, 2W-1-j) (head-tail pairing, so each rank gets equal causal work of every
document). Cuts never make a shard below the minimum shard size: a document
shorter than 2W shards gets fewer chunks (n = L // min_shard), paired head-tail
over the n/2 ranks starting at the rank holding its first token, and a chunk
boundary closer than the minimum to a piece boundary is dropped (chunk
boundaries are at least L/n >= min_shard apart, so no other check is needed).
Vectorised over all documents.
"""

from __future__ import annotations

import numpy as np

from attnpool.plan.documents import PieceTable, ranges


def schedule_percp(table: PieceTable, min_shard_tokens: int = 1, **_):
    W = table.num_ranks
    L = table.doc_len
    n = np.minimum(2 * W, np.maximum(1, L // max(1, min_shard_tokens)))
    span = np.int64(L.max() + 1)  # keys doc * span + position sort by (doc, position)
    order = np.lexsort((table.start, table.doc))
    p_doc, p_start, p_end = table.doc[order], table.start[order], table.end[order]
    edges = np.unique(np.concatenate([p_doc * span + p_start, p_doc * span + p_end]))
    # Desired chunk boundaries j * L // n for j = 1 .. n-1 of every document.
    cut_doc = np.repeat(np.arange(len(L)), n - 1)
    j = ranges(np.ones(len(L), np.int64), n - 1)
    cuts = cut_doc * span + (j * L[cut_doc]) // n[cut_doc]
    # Drop those closer than min_shard to a piece edge (edges include 0 and L of every doc).
    right = np.searchsorted(edges, cuts, side="left")
    gap = np.minimum(edges[np.minimum(right, len(edges) - 1)] - cuts, cuts - edges[np.maximum(right - 1, 0)])
    bounds = np.unique(np.concatenate([edges, cuts[gap >= min_shard_tokens]]))
    same_doc = bounds[1:] // span == bounds[:-1] // span
    seg_start, seg_end = bounds[:-1][same_doc], bounds[1:][same_doc]
    doc = seg_start // span
    a, b = seg_start - doc * span, seg_end - doc * span
    piece = order[np.searchsorted(p_doc * span + p_start, seg_start, side="right") - 1]
    nd = n[doc]
    chunk = np.minimum(((a + 1) * nd - 1) // L[doc], nd - 1)  # largest j with j * L // n <= a
    pair = np.minimum(chunk, nd - 1 - chunk)
    first_rank = table.rank[order][np.searchsorted(p_doc * span + p_start, doc * span, side="left")]
    server = np.where(nd == 2 * W, pair, (first_rank + pair) % W)
    return doc, a, b, piece, server
