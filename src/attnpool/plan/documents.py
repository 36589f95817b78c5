"""Documents and the pieces of them that ranks hold.

A global batch is a list of documents (token lengths). A layout gives every rank
a list of :class:`DocPiece`, contiguous token ranges of documents, in that
rank's token order. :class:`PieceTable` is the same information as flat NumPy
arrays, which is what the schedulers and the runtime work with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from attnpool.errors import ConfigError


@dataclass(frozen=True)
class DocPiece:
    """Tokens [start, start + length) of document ``doc_id`` (``doc_len`` tokens)."""

    doc_id: int
    doc_len: int
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def ranges(starts, lengths) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), vectorised."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(total, dtype=np.int64)


def causal_pairs(a, b):
    """(query, key) pairs of causal attention for query tokens [a, b) over keys [0, b).

    ``sum_{i=a}^{b-1} (i + 1) = (b - a) * (a + b + 1) / 2``. Works on ints and arrays.
    """
    return (b - a) * (a + b + 1) // 2


def key_start(a, window: int | None):
    """The first key query tokens [a, ...) see: 0 for causal attention, ``max(0, a - window + 1)`` under a
    sliding window of ``window`` keys (query i sees keys (i - window, i]). Works on ints and arrays."""
    if window is None:
        return a * 0
    return np.maximum(a - window + 1, 0) if isinstance(a, np.ndarray) else max(a - window + 1, 0)


def prefix_pairs(x, window: int | None):
    """(query, key) pairs of query tokens [0, x): ``sum_{i<x} min(i + 1, window)`` (causal without a window).
    Works on ints and arrays (exact integers)."""
    if window is None:
        return x * (x + 1) // 2
    inside = np.minimum(x, window) if isinstance(x, np.ndarray) else min(x, window)
    return inside * (inside + 1) // 2 + (x - inside) * window


def window_pairs(a, b, window: int | None):
    """(query, key) pairs of query tokens [a, b) of a document under a sliding window of ``window`` keys
    (:func:`causal_pairs` where ``window`` is None): the work of a windowed CA-task."""
    if window is None:
        return causal_pairs(a, b)
    return prefix_pairs(b, window) - prefix_pairs(a, window)


def prefix_pairs_inverse(pairs, window: int | None):
    """The real x with prefix_pairs(x, window) = pairs (vectorised, float64): where to cut a document so that
    the queries before the cut carry ``pairs``."""
    pairs = np.asarray(pairs, dtype=np.float64)
    causal = (-1.0 + np.sqrt(np.maximum(0.0, 1.0 + 8.0 * pairs))) / 2.0
    if window is None:
        return causal
    full = window * (window + 1) / 2.0
    return np.where(pairs <= full, causal, window + (pairs - full) / window)


def prefix_pairs_inverse1(pairs: float, window: int | None) -> float:
    """:func:`prefix_pairs_inverse` of one number in plain Python: the same float64 arithmetic without NumPy's
    per-call overhead (cad's cut refinement runs it a few hundred times a plan)."""
    causal = (-1.0 + math.sqrt(max(0.0, 1.0 + 8.0 * pairs))) / 2.0
    if window is None:
        return causal
    full = window * (window + 1) / 2.0
    return causal if pairs <= full else window + (pairs - full) / window


@dataclass(frozen=True, eq=False)
class PieceTable:
    """All pieces of a layout as flat arrays, in rank-major order.

    ``doc`` is a dense document index (0..num_docs-1, in order of ``doc_ids``);
    ``offset`` is the position of the piece's first token in its rank's buffer.
    """

    num_ranks: int
    doc_ids: np.ndarray  # (D,) user doc ids, sorted ascending
    doc_len: np.ndarray  # (D,)
    rank: np.ndarray  # (P,)
    doc: np.ndarray  # (P,)
    start: np.ndarray  # (P,)
    length: np.ndarray  # (P,)
    offset: np.ndarray  # (P,)
    tokens_per_rank: np.ndarray  # (W,)

    @property
    def end(self) -> np.ndarray:
        return self.start + self.length

    @property
    def num_pieces(self) -> int:
        return len(self.rank)

    @property
    def num_docs(self) -> int:
        return len(self.doc_ids)

    @classmethod
    def from_pieces(cls, pieces_per_rank: Sequence[Sequence[DocPiece]]) -> "PieceTable":
        """Validate a layout and flatten it. Raises ConfigError naming the bad piece."""
        if len(pieces_per_rank) < 1:
            raise ConfigError("pieces_per_rank", len(pieces_per_rank), "need at least one rank")
        rows = []
        for r, pieces in enumerate(pieces_per_rank):
            for j, p in enumerate(pieces):
                if not isinstance(p, DocPiece):
                    raise ConfigError(f"pieces_per_rank[{r}][{j}]", p, "expected a DocPiece")
                rows.append((r, int(p.doc_id), int(p.doc_len), int(p.start), int(p.length)))
        if not rows:
            raise ConfigError("pieces_per_rank", "[]", "the batch holds no tokens")
        arr = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
        rank, doc_id, doc_len, start, length = arr.T
        bad = np.flatnonzero((doc_len <= 0) | (length <= 0) | (start < 0) | (start + length > doc_len))
        if bad.size:
            i = int(bad[0])
            raise ConfigError(
                "DocPiece", f"doc_id={doc_id[i]} doc_len={doc_len[i]} start={start[i]} length={length[i]}",
                "needs doc_len > 0, length > 0 and 0 <= start < start + length <= doc_len",
            )
        doc_ids, doc = np.unique(doc_id, return_inverse=True)
        dl = np.zeros(len(doc_ids), dtype=np.int64)
        dl[doc] = doc_len
        if np.any(dl[doc] != doc_len):
            i = int(np.flatnonzero(dl[doc] != doc_len)[0])
            raise ConfigError("DocPiece.doc_len", int(doc_len[i]), f"document {doc_id[i]} has pieces with different lengths")
        # Pieces of each document must tile [0, doc_len) exactly.
        order = np.lexsort((start, doc))
        s, e, d = start[order], (start + length)[order], doc[order]
        first = np.r_[True, d[1:] != d[:-1]]
        last = np.r_[d[1:] != d[:-1], True]
        expected_start = np.where(first, 0, np.r_[0, e[:-1]])
        gap = np.flatnonzero((s != expected_start) | (last & (e != dl[d])))
        if gap.size:
            i = int(gap[0])
            raise ConfigError(
                "pieces_per_rank", f"doc_id={doc_ids[d[i]]}",
                f"pieces must cover the document [0, {dl[d[i]]}) exactly once; found a gap or overlap near token {int(s[i])}",
            )
        W = len(pieces_per_rank)
        tokens_per_rank = np.bincount(rank, weights=length, minlength=W).astype(np.int64)
        # offset of each piece inside its rank's buffer: exclusive cumsum within rank
        csum = np.cumsum(length) - length
        rank_base = np.r_[0, np.cumsum(tokens_per_rank)[:-1]]
        offset = csum - rank_base[rank]
        return cls(W, doc_ids, dl, rank, doc, start, length, offset, tokens_per_rank)

    @classmethod
    def from_arrays(cls, num_ranks: int, doc_len, rank, doc, start, length) -> "PieceTable":
        """A table from pieces already in rank-major order, documents 0..D-1 (trusted: layouts build it)."""
        rank, doc, start, length = (np.asarray(x, dtype=np.int64) for x in (rank, doc, start, length))
        tokens = np.bincount(rank, weights=length, minlength=num_ranks).astype(np.int64)
        base = np.r_[0, np.cumsum(tokens)[:-1]]
        offset = (np.cumsum(length) - length) - base[rank]
        dl = np.asarray(doc_len, dtype=np.int64)
        return cls(num_ranks, np.arange(len(dl), dtype=np.int64), dl, rank, doc, start, length, offset, tokens)

    def to_pieces(self) -> list[list[DocPiece]]:
        out: list[list[DocPiece]] = [[] for _ in range(self.num_ranks)]
        for r, d, s, n in zip(self.rank.tolist(), self.doc.tolist(), self.start.tolist(), self.length.tolist()):
            out[r].append(DocPiece(int(self.doc_ids[d]), int(self.doc_len[d]), s, n))
        return out
