"""Simple loop versions of the layouts: an independent reference for the fast ones in attnpool.plan.layout."""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from attnpool.errors import ConfigError
from attnpool.plan.documents import DocPiece, causal_pairs
from attnpool.plan.layout import _budget, end_after_pairs, even_level, validate_doc_lens


def linear_layout(doc_lens: Sequence[int], num_ranks: int, tokens_per_rank: int | None = None) -> list[list[DocPiece]]:
    """Pour documents in order into ranks of ``tokens_per_rank`` tokens (default: total / ranks, rounded up)."""
    lens = validate_doc_lens(doc_lens)
    budget = _budget(lens, num_ranks, tokens_per_rank)
    doc_start = np.r_[0, np.cumsum(lens)[:-1]]
    doc_end = doc_start + lens
    layout: list[list[DocPiece]] = [[] for _ in range(num_ranks)]
    # Rank r covers global tokens [r*budget, (r+1)*budget); intersect with every document.
    first_rank = doc_start // budget
    last_rank = (doc_end - 1) // budget
    for d in range(len(lens)):
        for r in range(int(first_rank[d]), int(last_rank[d]) + 1):
            lo = max(int(doc_start[d]), r * budget)
            hi = min(int(doc_end[d]), (r + 1) * budget)
            layout[r].append(DocPiece(d, int(lens[d]), lo - int(doc_start[d]), hi - lo))
    return layout


def wlb_layout(doc_lens: Sequence[int], num_ranks: int, tokens_per_rank: int | None = None,
               memory_cap: float = 1.1) -> list[list[DocPiece]]:
    """WLB-LLM packing: even out causal pairs per rank, tokens per rank <= memory_cap x budget; packed with each rule
    for cutting a document that fits nowhere whole, the packing with the fewest pairs on its busiest rank kept."""
    lens = validate_doc_lens(doc_lens)
    budget = _budget(lens, num_ranks, tokens_per_rank)
    if not memory_cap >= 1.0:
        raise ConfigError("memory_cap", memory_cap, "must be >= 1.0 (tokens per rank relative to the budget)")
    cap = int(memory_cap * budget)
    packings = [_wlb_pack(lens, num_ranks, cap, even_cut) for even_cut in (True, False)]
    layout, _ = min(packings, key=lambda packed: (packed[1].max(), sum(map(len, packed[0]))))
    # Keep each rank's pieces in document order (deterministic token order).
    return [sorted(pieces, key=lambda p: (p.doc_id, p.start)) for pieces in layout]


def _wlb_pack(lens: np.ndarray, num_ranks: int, cap: int, even_cut: bool):
    room = np.full(num_ranks, cap, dtype=np.int64)
    work = np.zeros(num_ranks, dtype=np.float64)
    layout: list[list[DocPiece]] = [[] for _ in range(num_ranks)]
    # Heap of (work, rank): the least-loaded rank with room is found lazily.
    heap = [(0.0, r) for r in range(num_ranks)]
    for d in np.argsort(-lens, kind="stable").tolist():
        length = int(lens[d])
        skipped = []
        placed = False
        while heap:
            w, r = heapq.heappop(heap)
            if w != work[r]:
                continue  # stale entry
            if room[r] >= length:
                layout[r].append(DocPiece(d, length, 0, length))
                room[r] -= length
                work[r] += float(causal_pairs(0, length))
                heapq.heappush(heap, (work[r], r))
                placed = True
                break
            skipped.append((w, r))
        for item in skipped:
            heapq.heappush(heap, item)
        if placed:
            continue
        # Fits nowhere whole: contiguous pieces over the fewest ranks that can hold it, those with the most room, in
        # order, each filling its rank or cut where their causal pairs even out (the level and the cut are checked
        # against brute force in test_plan).
        start = 0
        ranks = []
        for r in np.argsort(-room, kind="stable").tolist():
            if sum(int(room[q]) for q in ranks) < length:
                ranks.append(r)
        for i, r in enumerate(ranks):
            left = length - start
            take = min(int(room[r]), left)
            if even_cut:
                level = even_level(work[ranks[i:]].tolist(), causal_pairs(start, length))
                take = min(max(end_after_pairs(start, level - work[r]) - start, left - int(room[ranks[i + 1:]].sum())),
                           take)
            if take <= 0:
                continue
            layout[r].append(DocPiece(d, length, start, take))
            work[r] += float(causal_pairs(start, start + take))
            room[r] -= take
            start += take
        heap = [(work[r], r) for r in range(num_ranks)]
        heapq.heapify(heap)
    return layout, work
