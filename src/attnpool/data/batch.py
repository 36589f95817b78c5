"""Batch assembly: documents from a source packed into global batches, then split over ranks.

Every rank builds the same :class:`DocumentStream` (same source, same seed), so
every rank computes the same :class:`GlobalBatch` for a step without any
communication, lays it out with a layout from :mod:`attnpool.plan`, and takes its
own :class:`RankBatch`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from attnpool.errors import ConfigError
from attnpool.plan.documents import DocPiece, PieceTable
from attnpool.plan.layout import nano_batch_bounds

# Label of a token with no target (the last token of a document). PyTorch's
# cross_entropy ignores it by default; ``loss_mask`` says the same as a float.
IGNORE_INDEX = -100

STATE_VERSION = 1
# A resume reads this many documents, from the stream's place on, and compares their tokens with the checkpoint's:
# data changed under the same name (other files, another tokenizer's output) and of the same document count.
FINGERPRINT_DOCS = 4


def _positive_int(field: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ConfigError(field, value, "must be a positive integer")
    return int(value)


@dataclass(frozen=True, eq=False)
class RankBatch:
    """One rank's share of a global batch, in the rank's token order (its pieces, in layout order).

    ``positions`` are absolute within each document, so the second piece of a
    split document continues where the first stopped (RoPE needs that).
    ``global_label_tokens`` counts label tokens of the global batch this one is cut
    from (one micro-batch's, or a ping-pong half's, of every rank): divide the rank's
    summed loss by it and the all-reduced loss is that batch's mean over every real
    token, however tokens are spread over ranks. A step of several micro-batches
    divides by their sum instead (train.runners.forward_backward).
    """

    rank: int
    step: int
    tokens: np.ndarray  # (T_r,) int64
    labels: np.ndarray  # (T_r,) int64, IGNORE_INDEX where loss_mask is False
    loss_mask: np.ndarray  # (T_r,) bool
    positions: np.ndarray  # (T_r,) int64
    pieces: list[DocPiece]
    global_label_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def to_torch(self, device="cpu") -> "RankTensors":
        import torch  # keep attnpool.data importable (and cheap) without torch

        def put(array, dtype):
            return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)

        return RankTensors(put(self.tokens, torch.int64), put(self.labels, torch.int64),
                           put(self.positions, torch.int64), put(self.loss_mask, torch.float32))


@dataclass(frozen=True)
class RankTensors:
    """A RankBatch as torch tensors: tokens, labels, positions int64; loss_mask float32."""

    tokens: "torch.Tensor"  # noqa: F821
    labels: "torch.Tensor"  # noqa: F821
    positions: "torch.Tensor"  # noqa: F821
    loss_mask: "torch.Tensor"  # noqa: F821


@dataclass(frozen=True, eq=False)
class GlobalBatch:
    """The documents of one step, all tokens concatenated in document order.

    ``labels[t]`` is the next token of the same document; the last token of each
    document has no label (``IGNORE_INDEX``, ``loss_mask`` False). Labels are set
    here, before any split, so a token at a split between ranks keeps its label.
    ``doc_source[d]`` / ``doc_source_start[d]``: which source document document
    ``d`` was cut from, and at which token.
    """

    step: int
    num_ranks: int
    tokens_per_rank: int
    doc_lens: np.ndarray  # (D,) int64
    tokens: np.ndarray  # (N,) int64
    labels: np.ndarray  # (N,) int64
    loss_mask: np.ndarray  # (N,) bool
    doc_source: np.ndarray  # (D,) int64
    doc_source_start: np.ndarray  # (D,) int64

    @classmethod
    def from_documents(cls, docs: Sequence[np.ndarray], step: int = 0, num_ranks: int = 1,
                       tokens_per_rank: int | None = None, doc_source=None, doc_source_start=None,
                       targets: Sequence[np.ndarray | None] | None = None) -> "GlobalBatch":
        """Build a batch from document token arrays (labels and mask derived here).

        ``targets`` (optional, per document, None for all): which tokens are to be predicted (a source's
        ``targets``, e.g. a task's answer); the token before each one gets it as its label."""
        lens = np.asarray([len(d) for d in docs], dtype=np.int64)
        if lens.size == 0 or np.any(lens == 0):
            raise ConfigError("docs", lens.tolist(), "need at least one document and no empty ones")
        tokens = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs])
        last = np.cumsum(lens) - 1
        labels = np.empty_like(tokens)
        labels[:-1] = tokens[1:]
        labels[last] = IGNORE_INDEX
        loss_mask = np.ones(len(tokens), dtype=bool)
        loss_mask[last] = False
        if targets is not None and any(t is not None for t in targets):
            wanted = np.concatenate([np.ones(n, dtype=bool) if t is None else np.asarray(t, dtype=bool)
                                     for n, t in zip(lens.tolist(), targets)])
            loss_mask[:-1] &= wanted[1:]
            labels[~loss_mask] = IGNORE_INDEX
        if tokens_per_rank is None:
            tokens_per_rank = -(-len(tokens) // num_ranks)
        d = len(lens)
        src = np.arange(d, dtype=np.int64) if doc_source is None else np.asarray(doc_source, dtype=np.int64)
        start = np.zeros(d, dtype=np.int64) if doc_source_start is None else np.asarray(doc_source_start, np.int64)
        return cls(step, num_ranks, tokens_per_rank, lens, tokens, labels, loss_mask, src, start)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_docs(self) -> int:
        return len(self.doc_lens)

    @property
    def doc_offsets(self) -> np.ndarray:
        """(D + 1,) start of each document in ``tokens``, then the total."""
        return np.r_[0, np.cumsum(self.doc_lens)]

    @property
    def positions(self) -> np.ndarray:
        """Position of every token within its document."""
        return np.arange(self.num_tokens) - np.repeat(self.doc_offsets[:-1], self.doc_lens)

    @property
    def num_label_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def padded(self, pad_lens: Sequence[int]) -> "GlobalBatch":
        """This batch with padding documents of ``pad_lens`` tokens appended (token 0, no labels), as
        plan.layout.pad_ranks lays them out. The loss and the real tokens' attention do not see them."""
        lens = np.asarray(pad_lens, dtype=np.int64)
        if not len(lens):
            return self
        n = int(lens.sum())
        return GlobalBatch(self.step, self.num_ranks, self.tokens_per_rank, np.r_[self.doc_lens, lens],
                           np.r_[self.tokens, np.zeros(n, dtype=np.int64)],
                           np.r_[self.labels, np.full(n, IGNORE_INDEX, dtype=np.int64)],
                           np.r_[self.loss_mask, np.zeros(n, dtype=bool)],
                           np.r_[self.doc_source, np.full(len(lens), -1, dtype=np.int64)],
                           np.r_[self.doc_source_start, np.zeros(len(lens), dtype=np.int64)])

    def split_documents(self, parts: int) -> list["GlobalBatch"]:
        """Up to ``parts`` batches of whole documents (ping-pong nano-batches), cut as
        :func:`attnpool.plan.layout.nano_batch_bounds` says."""
        offsets = self.doc_offsets
        out = []
        for d0, d1 in nano_batch_bounds(self.doc_lens, parts, self.num_ranks):
            t0, t1 = int(offsets[d0]), int(offsets[d1])
            out.append(GlobalBatch(self.step, self.num_ranks, -(-(t1 - t0) // self.num_ranks), self.doc_lens[d0:d1],
                                   self.tokens[t0:t1], self.labels[t0:t1], self.loss_mask[t0:t1],
                                   self.doc_source[d0:d1], self.doc_source_start[d0:d1]))
        return out

    def split(self, layout: Sequence[Sequence[DocPiece]] | PieceTable) -> list[RankBatch]:
        """Every rank's batch for a layout (``doc_id`` = index of a document of this batch): DocPiece
        lists per rank, or a PieceTable such as a plan's ``pieces``."""
        table = self._check_layout(layout)
        return [self._rank_batch(table, r) for r in range(table.num_ranks)]

    def rank_batch(self, layout: Sequence[Sequence[DocPiece]] | PieceTable, rank: int) -> RankBatch:
        """One rank's batch for a layout (the layout is validated as a whole)."""
        table = self._check_layout(layout)
        if not 0 <= rank < table.num_ranks:
            raise ConfigError("rank", rank, f"must be in [0, {table.num_ranks})")
        return self._rank_batch(table, rank)

    def _check_layout(self, layout) -> PieceTable:
        # DocPiece lists are checked to tile each document exactly; a PieceTable already was.
        table = layout if isinstance(layout, PieceTable) else PieceTable.from_pieces(layout)
        if table.num_docs != self.num_docs or np.any(table.doc_ids != np.arange(self.num_docs)):
            raise ConfigError("layout", f"doc_ids {table.doc_ids[:8].tolist()}...",
                              f"must cover documents 0..{self.num_docs - 1} of the batch, each exactly once")
        bad = np.flatnonzero(table.doc_len != self.doc_lens)
        if bad.size:
            d = int(bad[0])
            raise ConfigError("layout", f"doc_id={d} doc_len={int(table.doc_len[d])}",
                              f"the batch's document {d} has {int(self.doc_lens[d])} tokens")
        return table

    def _rank_batch(self, table: PieceTable, rank: int) -> RankBatch:
        # Pieces of a rank are contiguous in the rank-major table, in layout order.
        sel = table.rank == rank
        doc, start, length = table.doc[sel], table.start[sel], table.length[sel]
        within = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
        positions = np.repeat(start, length) + within
        index = np.repeat(self.doc_offsets[doc], length) + positions
        return RankBatch(rank, self.step, self.tokens[index], self.labels[index], self.loss_mask[index],
                         positions, [DocPiece(int(table.doc_ids[d]), int(table.doc_len[d]), int(s), int(n))
                                     for d, s, n in zip(doc, start, length)], self.num_label_tokens)


class DocumentStream:
    """Documents of a source in a seeded shuffled order, packed into global batches.

    Each batch holds exactly ``num_ranks * tokens_per_rank`` tokens. Documents
    are poured in order; the one that overflows the batch is cut and its rest
    starts the next batch as a new document: its positions restart at 0 and its
    first token sees none of the part before the cut. Documents longer than
    ``max_doc_len`` are cut first into pieces of ``max_doc_len`` tokens (from the
    document's start), each a document of its own. Epoch ``e`` visits every
    source document once, in the order ``permutation`` seeded by ``(seed, e)``;
    documents with no tokens are skipped.

    The source needs only ``len(source)`` and ``source[i]``. The stream is a pure
    function of (source, seed, batch size, max_doc_len), so every rank builds the
    same one; ``state_dict()`` is a few JSON-able ints from which
    ``load_state_dict()`` continues exactly where the stream stopped.
    """

    def __init__(self, source, num_ranks: int, tokens_per_rank: int, seed: int = 0,
                 max_doc_len: int | None = None):
        self.source = source
        self.num_ranks = _positive_int("num_ranks", num_ranks)
        self.tokens_per_rank = _positive_int("tokens_per_rank", tokens_per_rank)
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
            raise ConfigError("seed", seed, "must be a non-negative integer")
        self.seed = int(seed)
        self.max_doc_len = None if max_doc_len is None else _positive_int("max_doc_len", max_doc_len)
        self.num_docs = len(source)
        if self.num_docs < 1:
            raise ConfigError("source", type(source).__name__, "holds no documents")
        self.step = 0  # batches produced so far
        self.epoch = 0
        self.cursor = 0  # index into this epoch's order of the document being poured
        self.pos = 0  # tokens of that document already poured
        self._order = self._epoch_order(0)
        self._cached: tuple | None = None  # the last document read: (index, tokens, targets or None)

    @property
    def batch_tokens(self) -> int:
        return self.num_ranks * self.tokens_per_rank

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_docs)

    def _read(self, index: int) -> np.ndarray:
        # A long document spans several batches: read it once, not once per batch.
        if self._cached is None or self._cached[0] != index:
            targets = getattr(self.source, "targets", None)
            self._cached = (index, np.asarray(self.source[index], dtype=np.int64),
                            None if targets is None else targets(index))
        return self._cached[1]

    def _next_document(self) -> None:
        self.pos = 0
        self.cursor += 1
        if self.cursor == self.num_docs:
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)

    def next_batch(self) -> GlobalBatch:
        budget = self.batch_tokens
        chunks, sources, starts, targets = [], [], [], []
        filled = 0
        empty_in_a_row = 0
        while filled < budget:
            index = int(self._order[self.cursor])
            doc = self._read(index)
            if self.pos >= len(doc):  # an empty document
                empty_in_a_row += 1
                if empty_in_a_row > self.num_docs:
                    raise ConfigError("source", type(self.source).__name__, "every document is empty")
                self._next_document()
                continue
            empty_in_a_row = 0
            end = len(doc)
            if self.max_doc_len is not None:
                end = min(end, (self.pos // self.max_doc_len + 1) * self.max_doc_len)
            take = min(end - self.pos, budget - filled)
            chunks.append(doc[self.pos:self.pos + take])
            wanted = self._cached[2]
            targets.append(None if wanted is None else wanted[self.pos:self.pos + take])
            sources.append(index)
            starts.append(self.pos)
            self.pos += take
            filled += take
            if self.pos == len(doc):
                self._next_document()
        batch = GlobalBatch.from_documents(chunks, self.step, self.num_ranks, self.tokens_per_rank,
                                           sources, starts, targets)
        self.step += 1
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """Where the stream stands, as JSON-able ints."""
        return {"version": STATE_VERSION, "seed": self.seed, "num_docs": self.num_docs, "step": self.step,
                "epoch": self.epoch, "cursor": self.cursor, "pos": self.pos, "fingerprint": self._fingerprint()}

    def _fingerprint(self) -> str:
        """A hash of the tokens of the next FINGERPRINT_DOCS documents of this epoch's order, from the cursor; "" (not
        compared) where they do not read: a checkpoint is not lost to a document the run has not reached, and
        reaching it will say what is wrong with it."""
        digest = hashlib.sha256()
        try:
            for index in self._order[self.cursor:self.cursor + FINGERPRINT_DOCS]:
                digest.update(np.asarray(self.source[int(index)], dtype=np.int64).tobytes())
        except (OSError, ConfigError, ValueError):
            return ""
        return digest.hexdigest()[:16]

    def load_state_dict(self, state: dict, same_documents: bool = True) -> None:
        """Continue from ``state``. The seed, the source's size and (unless not ``same_documents``: data changed on
        purpose) the documents at the stream's place must match; the batch size may change."""
        missing = [k for k in ("version", "seed", "num_docs", "step", "epoch", "cursor", "pos") if k not in state]
        if missing:
            raise ConfigError("data_state", sorted(state), f"missing keys {missing}")
        if state["version"] != STATE_VERSION:
            raise ConfigError("data_state.version", state["version"], f"this attnpool reads version {STATE_VERSION}")
        for key, ours in (("seed", self.seed), ("num_docs", self.num_docs)):
            if state[key] != ours:
                raise ConfigError(f"data_state.{key}", state[key], f"does not match this stream's {key} = {ours}")
        if not 0 <= state["cursor"] < self.num_docs or state["pos"] < 0 or state["epoch"] < 0 or state["step"] < 0:
            raise ConfigError("data_state", {k: state[k] for k in ("epoch", "cursor", "pos")}, "out of range")
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.cursor, self.pos = int(state["cursor"]), int(state["pos"])
        self._order = self._epoch_order(self.epoch)
        # (a checkpoint from before fingerprints has none, and "" is one that did not read: nothing to compare)
        ours = self._fingerprint() if same_documents and state.get("fingerprint") else ""
        if ours and state["fingerprint"] != ours:
            raise ConfigError("data_state.fingerprint", state["fingerprint"],
                              f"the documents at the checkpoint's place in the data ({FINGERPRINT_DOCS} read from "
                              f"document {self.cursor} of epoch {self.epoch}'s order) are not the ones it trained "
                              "on: the data changed since, keeping its document count; resume with that data, or "
                              "start a new run")
