"""Layouts: which rank holds which contiguous pieces of the batch's documents.

- :func:`linear_layout`: every rank gets the same token budget; documents are
  poured in order and the one that overflows a rank continues on the next, as
  DistCA does. Equal tokens, so equal linear-layer work and activation memory.
- :func:`wlb_layout`: WLB-LLM's variable-length packing. Documents (longest
  first) go to the rank with the least attention work that still has room under
  a memory cap, so attention work evens out while token counts may differ by up
  to the cap; a document that fits nowhere is cut into contiguous pieces over
  the ranks with the most room, filling each or where their attention work
  evens out, whichever packs the batch evener.
- :func:`balanced_table`: the same packing with no room beyond the budget, so
  every rank keeps equal tokens (as linear's) while whole documents already even
  out attention work. Which rank holds a document is free: its tokens are read
  there in any case, so the balance it gives costs no byte, and ``cad`` has less
  to move: 2.05-52x fewer bytes on the benchmark's ProLong steps over 2 ranks;
  little gain where the longest documents make the imbalance, and ``cad``'s greedy
  moves can cost more from a better start
  (bench/results/2026-11-29-cpu-balanced-layout.md, 2026-11-30-cpu-balanced-layout-plans.md).

Ping-pong splits a batch into nano-batches of whole documents first (:func:`nano_batch_bounds`), each then laid
out over every rank.

Each comes as a :class:`PieceTable` (``*_table``, what planners and the
simulator use; vectorised or O(documents log ranks)) and as lists of
:class:`DocPiece` per rank (``*_layout``). Document ids are indices into
``doc_lens``.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import numpy as np

from attnpool.errors import ConfigError
from attnpool.plan.documents import DocPiece, PieceTable, causal_pairs, prefix_pairs, prefix_pairs_inverse1


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


def nano_batch_bounds(doc_lens: Sequence[int], parts: int, num_ranks: int) -> list[tuple[int, int]]:
    """The documents [d0, d1) of up to ``parts`` nano-batches of whole documents (ping-pong's: the runtime's,
    data.batch.GlobalBatch.split_documents, and the simulator's), each cut after the document that reaches an
    equal share of the tokens. Cutting a document would change what its tokens attend to, so fewer documents than
    ``parts`` give fewer nano-batches and one long document makes them unequal. Where the document that reaches
    a share is the batch's last, the cut is made before it: two unequal nano-batches still hide part of each
    other's exchanges, where one hides nothing (pretrain 128K on 2 GPUs: a 164,712-token document after six
    shorter ones; bench/results/2026-11-30-cpu-nano-batch-cut.md).

    No cut leaves a nano-batch of fewer than ``num_ranks`` squared tokens (a batch's leftover of a document before
    a long one): each is laid out over the ``num_ranks`` dp ranks at ceil(n / num_ranks) tokens a rank, which can
    leave a rank empty for n up to (num_ranks - 1) squared, and so small a nano-batch hides nothing of the other's
    exchanges (a rank without tokens runs, but only waits)."""
    lens = np.asarray(doc_lens, dtype=np.int64)
    offsets = np.r_[0, np.cumsum(lens)]
    targets = np.arange(1, parts) * offsets[-1] / parts
    # (searchsorted gives the cut after the document that reaches each share; after the last it is moved before it)
    cuts = np.unique(np.clip(np.searchsorted(offsets, targets), 1, max(len(lens) - 1, 1)))
    smallest = num_ranks * num_ranks
    bounds = [0]
    for c in (int(c) for c in cuts if 0 < c < len(lens)):
        if offsets[c] - offsets[bounds[-1]] >= smallest and offsets[-1] - offsets[c] >= smallest:
            bounds.append(c)
    bounds.append(len(lens))
    return list(zip(bounds[:-1], bounds[1:]))


def linear_table(doc_lens: Sequence[int], num_ranks: int, tokens_per_rank: int | None = None) -> PieceTable:
    """Pour documents in order into ranks of ``tokens_per_rank`` tokens (default: total / ranks, rounded up)."""
    lens = validate_doc_lens(doc_lens)
    budget = _budget(lens, num_ranks, tokens_per_rank)
    doc_start = np.r_[0, np.cumsum(lens)[:-1]]
    doc_end = doc_start + lens
    # Rank r covers global tokens [r * budget, (r + 1) * budget); intersect with every document.
    first = doc_start // budget
    count = (doc_end - 1) // budget - first + 1
    doc = np.repeat(np.arange(len(lens)), count)
    rank = np.repeat(first, count) + (np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count))
    lo = np.maximum(doc_start[doc], rank * budget)
    hi = np.minimum(doc_end[doc], (rank + 1) * budget)
    return PieceTable.from_arrays(num_ranks, lens, rank, doc, lo - doc_start[doc], hi - lo)


def even_level(works: Sequence[float], pairs: float) -> float:
    """The level that ``pairs`` more work, poured over ranks holding ``works``, evens them out to: the ``level`` with
    ``sum(max(0, level - w)) == pairs`` (water-filling; ranks already above it get none)."""
    ordered = sorted(works)
    total = float(pairs)
    for k, w in enumerate(ordered, start=1):
        total += w
        level = total / k
        if k == len(ordered) or level <= ordered[k]:
            return level
    raise ValueError("no ranks")


def end_after_pairs(a: int, pairs: float) -> int:
    """The end ``b >= a`` whose queries [a, b) hold the nearest to ``pairs`` causal pairs (0 or less: ``a``)."""
    if pairs <= 0:
        return a
    b = int(prefix_pairs_inverse1(prefix_pairs(a, None) + pairs, None))  # (the real end, then the nearest whole one)
    return min((b, b + 1), key=lambda e: abs(causal_pairs(a, e) - pairs))


def wlb_pieces(doc_lens: Sequence[int], num_ranks: int, tokens_per_rank: int | None = None, memory_cap: float = 1.1):
    """WLB-LLM packing as arrays ``(lens, rank, doc, start, length)`` sorted by (rank, doc, start).

    Longest document first, to the rank with the fewest causal pairs that has room
    under the cap. Ranks without room for the current document are parked until the
    (non-increasing) document length drops to their room: O(documents log ranks). A
    document that fits nowhere whole is cut into contiguous pieces over the fewest ranks
    that can hold it, those with the most room: either each piece filling its rank, or
    cut where those ranks' causal pairs even out. The batch is packed both ways and the
    packing whose busiest rank has fewer pairs is kept: the even cut balances the cut
    document (attention at max/mean 1.005 where filling gives 1.651, on the benchmark's
    pretrain batch at 256K tokens per GPU over 2 ranks), but leaves the next rank less
    room, which can leave a later document to be cut as well.
    """
    lens = validate_doc_lens(doc_lens)
    budget = _budget(lens, num_ranks, tokens_per_rank)
    if not (math.isfinite(memory_cap) and memory_cap >= 1.0):
        raise ConfigError("memory_cap", memory_cap, "must be a finite number >= 1.0 (tokens per rank relative to the budget)")
    cap = int(memory_cap * budget)
    # (fewest pairs on the busiest rank, then fewest pieces; the even cut first where they tie). A batch that cuts no
    # document packs the same both ways: packed once.
    packings = [_wlb_pack(lens, num_ranks, cap, even_cut=True)]
    if len(packings[0][0][0]) > len(lens):
        packings.append(_wlb_pack(lens, num_ranks, cap, even_cut=False))
    pieces, _ = min(packings, key=lambda packed: (max(packed[1]), len(packed[0][0])))
    rank, doc, start, length = pieces
    o = np.lexsort((start, doc, rank))
    return lens, rank[o], doc[o], start[o], length[o]


def _wlb_pack(lens: np.ndarray, W: int, cap: int, even_cut: bool) -> tuple[tuple[np.ndarray, ...], list[float]]:
    """wlb_pieces' packing with one rule for cutting a document that fits nowhere whole: its pieces
    ``(rank, doc, start, length)`` in placement order, and each rank's causal pairs."""
    room = [cap] * W
    work = [0.0] * W
    heap = [(0.0, r) for r in range(W)]  # every rank that may fit the current document
    parked: list[tuple[int, int]] = []  # (-room, rank): too full for the current document
    out_r, out_d, out_s, out_n = [], [], [], []
    lens_l = lens.tolist()
    for d in np.argsort(-lens, kind="stable").tolist():
        length = lens_l[d]
        while parked and -parked[0][0] >= length:
            _, r = heapq.heappop(parked)
            heapq.heappush(heap, (work[r], r))
        placed = False
        while heap:
            _, r = heapq.heappop(heap)
            if room[r] >= length:
                out_r.append(r); out_d.append(d); out_s.append(0); out_n.append(length)
                room[r] -= length
                work[r] += float(length * (length + 1) // 2)
                heapq.heappush(heap, (work[r], r))
                placed = True
                break
            heapq.heappush(parked, (-room[r], r))
        if placed:
            continue
        # Fits nowhere whole: contiguous pieces over the fewest ranks that can hold it, those with the most room, in
        # order (each more rank adds a piece whose remote prefix is exchanged). Filling each rank in turn leaves the
        # dear tail to the last; the even cut pours the document's pairs over those ranks to one level (a rank
        # already above it takes only what the later ranks cannot hold).
        order = np.argsort(-np.asarray(room), kind="stable").tolist()
        order = order[:int(np.searchsorted(np.cumsum([room[r] for r in order]), length)) + 1]
        start = 0
        for i, r in enumerate(order):
            left = length - start
            if left <= 0:
                break
            take = min(room[r], left)
            if even_cut:
                level = even_level([work[q] for q in order[i:]], causal_pairs(start, length))
                later_room = sum(room[q] for q in order[i + 1:])  # (what the rest must hold: total room >= length)
                take = min(max(end_after_pairs(start, level - work[r]) - start, left - later_room), take)
            if take <= 0:
                continue
            out_r.append(r); out_d.append(d); out_s.append(start); out_n.append(take)
            work[r] += float(causal_pairs(start, start + take))
            room[r] -= take
            start += take
        heap = [(work[r], r) for r in range(W)]
        heapq.heapify(heap)
        parked = []
    return tuple(np.asarray(x, dtype=np.int64) for x in (out_r, out_d, out_s, out_n)), work


def wlb_table(doc_lens: Sequence[int], num_ranks: int, tokens_per_rank: int | None = None,
              memory_cap: float = 1.1) -> PieceTable:
    """WLB-LLM packing: even out causal pairs per rank, tokens per rank <= memory_cap x budget."""
    lens, rank, doc, start, length = wlb_pieces(doc_lens, num_ranks, tokens_per_rank, memory_cap)
    return PieceTable.from_arrays(num_ranks, lens, rank, doc, start, length)


def balanced_table(doc_lens: Sequence[int], num_ranks: int, tokens_per_rank: int | None = None) -> PieceTable:
    """Equal tokens per rank (as :func:`linear_table`), documents placed as :func:`wlb_table` places them (longest
    first, to the rank with the least causal pairs that has room), a document that fits nowhere whole cut over the
    ranks with the most room as :func:`wlb_pieces` cuts it."""
    return wlb_table(doc_lens, num_ranks, tokens_per_rank, memory_cap=1.0)


def linear_layout(doc_lens: Sequence[int], num_ranks: int, tokens_per_rank: int | None = None) -> list[list[DocPiece]]:
    return linear_table(doc_lens, num_ranks, tokens_per_rank).to_pieces()


def wlb_layout(doc_lens: Sequence[int], num_ranks: int, tokens_per_rank: int | None = None,
               memory_cap: float = 1.1) -> list[list[DocPiece]]:
    return wlb_table(doc_lens, num_ranks, tokens_per_rank, memory_cap).to_pieces()


LAYOUTS = ("linear", "balanced")  # the layouts a strategy may be planned over (wlb's own packing is the wlb strategy)


def layout_table(layout: str, doc_lens: Sequence[int], num_ranks: int, tokens_per_rank: int | None = None,
                 strategy: str = "local", memory_cap: float = 1.1, linear: PieceTable | None = None) -> PieceTable:
    """The batch laid out for ``strategy``: wlb's packing under ``memory_cap`` for ``wlb``, else ``layout``
    (``linear``: the batch's linear table where the caller has it already, for the "before" loads)."""
    if strategy == "wlb":
        return wlb_table(doc_lens, num_ranks, tokens_per_rank, memory_cap)
    if layout not in LAYOUTS:
        raise ConfigError("layout", layout, f"unknown; choose one of {', '.join(LAYOUTS)}")
    if layout == "balanced":
        return balanced_table(doc_lens, num_ranks, tokens_per_rank)
    return linear if linear is not None else linear_table(doc_lens, num_ranks, tokens_per_rank)


def pad_ranks(table: PieceTable, multiple: int) -> PieceTable:
    """``table`` with each rank's token count rounded up to a multiple of ``multiple`` by a padding
    document of its own, last on its rank (numbered after the table's documents, in rank order).

    Tensor parallelism splits a rank's tokens evenly over its tp ranks; a padding document attends only
    to itself and carries no labels (data.GlobalBatch.padded), so the real tokens compute the same."""
    pad = (-table.tokens_per_rank) % multiple
    ranks = np.flatnonzero(pad)
    if not len(ranks):
        return table
    n = len(ranks)
    rank = np.r_[table.rank, ranks]
    doc = np.r_[table.doc, table.num_docs + np.arange(n)]
    start = np.r_[table.start, np.zeros(n, dtype=np.int64)]
    length = np.r_[table.length, pad[ranks]]
    order = np.argsort(rank, kind="stable")  # each rank's padding after its own pieces
    return PieceTable.from_arrays(table.num_ranks, np.r_[table.doc_len, pad[ranks]], rank[order], doc[order],
                                  start[order], length[order])
