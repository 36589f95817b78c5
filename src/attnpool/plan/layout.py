"""Layouts: which rank holds which contiguous pieces of the batch's documents.

- :func:`linear_layout`: every rank gets the same token budget; documents are
  poured in order and the one that overflows a rank continues on the next, as
  DistCA does. Equal tokens, so equal linear-layer work and activation memory.
- :func:`wlb_layout`: WLB-LLM's variable-length packing. Documents (longest
  first) go to the rank with the least attention work that still has room under
  a memory cap, so attention work evens out while token counts may differ by up
  to the cap; a document that fits nowhere is split over the ranks with the
  most room.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from attnpool.errors import ConfigError
from attnpool.plan.documents import DocPiece, causal_pairs


def validate_doc_lens(doc_lens: Sequence[int], field: str = "doc_lens") -> np.ndarray:
    lens = np.asarray(doc_lens)
    if lens.ndim != 1 or lens.size == 0:
        raise ConfigError(field, f"shape {lens.shape}", "need a non-empty flat list of document lengths")
    if not np.issubdtype(lens.dtype, np.integer):
        if not np.all(np.mod(lens, 1) == 0):
            raise ConfigError(field, lens[np.mod(lens, 1) != 0][0], "document lengths must be whole numbers")
    lens = lens.astype(np.int64)
    if np.any(lens <= 0):
        i = int(np.flatnonzero(lens <= 0)[0])
        raise ConfigError(f"{field}[{i}]", int(lens[i]), "document lengths must be positive")
    return lens


def _budget(lens: np.ndarray, num_ranks: int, tokens_per_rank: int | None) -> int:
    if not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise ConfigError("num_ranks", num_ranks, "need at least one rank")
    total = int(lens.sum())
    if tokens_per_rank is None:
        return -(-total // num_ranks)
    if tokens_per_rank < 1:
        raise ConfigError("tokens_per_rank", tokens_per_rank, "the token budget must be positive")
    if total > tokens_per_rank * num_ranks:
        raise ConfigError("doc_lens", f"{total} tokens",
                          f"more than {num_ranks} ranks x {tokens_per_rank} tokens can hold")
    return int(tokens_per_rank)


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
    """WLB-LLM packing: even out causal pairs per rank, tokens per rank <= memory_cap x budget."""
    lens = validate_doc_lens(doc_lens)
    budget = _budget(lens, num_ranks, tokens_per_rank)
    if not memory_cap >= 1.0:
        raise ConfigError("memory_cap", memory_cap, "must be >= 1.0 (tokens per rank relative to the budget)")
    cap = int(memory_cap * budget)
    room = np.full(num_ranks, cap, dtype=np.int64)
    work = np.zeros(num_ranks, dtype=np.float64)
    layout: list[list[DocPiece]] = [[] for _ in range(num_ranks)]
    # Heap of (work, rank): the least-loaded rank with room is found lazily.
    heap = [(0.0, r) for r in range(num_ranks)]
    order = np.argsort(-lens, kind="stable")
    for d in order.tolist():
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
        # Fits nowhere whole: split it over the ranks with the most room, in order.
        start = 0
        for r in np.argsort(-room, kind="stable").tolist():
            take = min(int(room[r]), length - start)
            if take <= 0:
                break
            layout[r].append(DocPiece(d, length, start, take))
            work[r] += float(causal_pairs(start, start + take))
            room[r] -= take
            start += take
        heap = [(work[r], r) for r in range(num_ranks)]
        heapq.heapify(heap)
    # Keep each rank's pieces in document order (deterministic token order).
    return [sorted(pieces, key=lambda p: (p.doc_id, p.start)) for pieces in layout]


LAYOUTS = {"linear": linear_layout, "wlb": wlb_layout}
