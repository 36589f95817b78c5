"""Dispatch layout: everything one rank needs to run a plan, as index maps.

Built once per (plan, rank) with NumPy (no loop over tokens or shards) and
reused by every layer. Message format of the dispatch all-to-all, per peer:
``[Q rows | KV rows]``, a Q row being H_q*D elements and a KV row 2*H_kv*D
(K then V). Orders, all derived from the plan's canonical task order so that a
sender and its receiver agree without talking:

- Q sent to server s: my tasks with server s, canonical order. The server receives
  them grouped by home rank, canonical order within each.
- KV sent to server s: the plan's KV segments for s whose source is me, in
  (doc, start) order; received grouped by source.
- On the server, tasks run in canonical order; its unique KV buffer holds each
  served document's prefix [0, kv_end) once (under a sliding window, each merged range of
  its tasks' windows: plan.KVTransfers), in (doc, start) order. Each kernel
  segment's keys are a slice of it, expanded only transiently for the kernel, and
  not at all where each served document is one segment (``kv_expand_identity``;
  ``Plan.kernel_segments``: adjacent tasks that continue each other are one segment).
- Where the backend serves queries at given positions (``Backend.positions``; not the sparse
  serving, whose bound backend has none), a served document with several segments (shards that do
  not continue each other) runs without copies: with a few segments, one causal call per segment over
  the slice of its unique keys it reads; with more, one call of its own at its queries' positions. Each
  run of documents with one segment is a varlen call over theirs (``DocumentServing``).
- Outputs go back in the order the queries came.
- With ``relay_nodes`` (the node of each rank: a hierarchical exchange), KV a server needs from a rank of another
  node comes through one server of its own node where that server receives a range holding it
  (``KVTransfers.relays``): the dispatch carries each such range across the network once, and a second all-to-all
  inside the node forwards the nested ranges from the relay's received rows (``KVRelay``); the relayed rows
  follow the dispatched ones in the server's received KV.
- Each row map (the rows a rank sends, its rows served at home and where they go in the server's buffers, the
  received rows' places) is a ``Rows`` or a pair of them (``RowMap``): copied slice by slice where the rows are a few
  runs of consecutive rows, as they mostly are, rather than by an indexed kernel at a fraction of the bandwidth.
- The kernel's backward runs over groups of consecutive segments of at most
  ``BACKWARD_GROUP_KEYS`` key rows (``backward_groups``), one call each: FlashAttention-2's
  backward allocates a workspace in proportion to its call (with GQA, dK and dV for every
  query head), and one call over every task of a busy server made that workspace the
  step's peak memory (bench/results/2026-11-22-h200x4-memory.md).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from attnpool.plan.documents import key_start, ranges
from attnpool.plan.plan import Plan


def index_tensor(a, dtype=torch.int64, *, device) -> torch.Tensor:
    """A host-built index array on ``device``: built once per plan, never per layer (a host-to-device
    copy per layer would synchronise the host with the GPU)."""
    return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype).to(device)


# Runs of consecutive rows up to which Rows and RowMap copy slice by slice: a slice is a kernel launch and a few
# microseconds of Python, an indexed copy a single kernel that moves rows at a fraction of a contiguous copy's speed.
MAX_ROW_RUNS = 16


def _runs(*arrays: np.ndarray) -> np.ndarray | None:
    """Where equal-length index arrays are all consecutive together: the first position of each run and the end
    (``np.r_[starts, len]``); None where there are more than MAX_ROW_RUNS runs."""
    n = len(arrays[0])
    step = np.zeros(max(n - 1, 0), dtype=bool)
    for a in arrays:
        step |= np.diff(a) != 1
    breaks = np.flatnonzero(step) + 1
    return None if len(breaks) >= MAX_ROW_RUNS else np.r_[0, breaks, n] if n else np.zeros(1, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class Rows:
    """Rows of a buffer, in order, built once per plan, and taken (``x[rows]``), placed (``x[rows] = y``) or added to
    (``x.index_add_(0, rows, y)``) through slices where they are a few runs of consecutive rows, as a rank's rows
    mostly are (its tasks served at home, the tasks it sends a server), else through the index. An indexed copy
    moves rows at a fraction of a slice copy's bandwidth: on an H200 the dispatch's and collect's indexed copies
    took two thirds as long as the attention kernels they fed (bench/results/2026-11-29-h200x2-cad-copies.md)."""

    index: torch.Tensor
    runs: tuple[tuple[int, int], ...] | None  # (first row, rows) per run; None: more than MAX_ROW_RUNS runs

    @classmethod
    def of(cls, rows, device) -> "Rows":
        rows = np.asarray(rows, dtype=np.int64)
        bounds = _runs(rows)
        runs = None if bounds is None else tuple((int(rows[a]), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:]))
        return cls(index_tensor(rows, device=device), runs)

    def __len__(self) -> int:
        return self.index.numel()

    def take(self, x: torch.Tensor, own: bool = False) -> torch.Tensor:
        """``x[rows]``. Where they are one run, a view of ``x`` unless ``own``: one to read at once, not to keep
        (saved for backward or held by an exchange in flight it would keep the whole of ``x`` alive)."""
        if self.runs is None:
            return x[self.index]
        if len(self.runs) == 1:
            first, n = self.runs[0]
            return x[first:first + n].clone() if own else x[first:first + n]
        return torch.cat([x[first:first + n] for first, n in self.runs]) if self.runs else x.new_empty(0, *x.shape[1:])

    def put(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst[rows] = src``."""
        assert src.shape[0] == len(self), (src.shape, len(self))  # slices would not check it, as indexing does
        if self.runs is None:
            dst[self.index] = src
            return
        at = 0
        for first, n in self.runs:
            dst[first:first + n] = src[at:at + n]
            at += n

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """``dst.index_add_(0, rows, src)``: a row listed twice gets both (runs added one after another)."""
        assert src.shape[0] == len(self), (src.shape, len(self))
        if self.runs is None:
            return dst.index_add_(0, self.index, src)
        at = 0
        for first, n in self.runs:
            dst[first:first + n] += src[at:at + n]
            at += n
        return dst


@dataclass(frozen=True, eq=False)
class RowMap:
    """Rows ``src`` of one buffer paired with rows ``dst`` of another, in order: ``copy`` is ``x[dst] = y[src]`` and
    ``add`` is ``x.index_add_(0, dst, y[src])``, through slices where both are consecutive together in few runs;
    ``inverse`` pairs them the other way round (``dst`` from ``src``)."""

    dst: Rows
    src: Rows
    runs: tuple[tuple[int, int, int], ...] | None  # (first dst row, first src row, rows) per run; None: index

    @classmethod
    def of(cls, dst, src, device) -> "RowMap":
        dst, src = np.asarray(dst, dtype=np.int64), np.asarray(src, dtype=np.int64)
        bounds = _runs(dst, src)
        runs = None if bounds is None else tuple((int(dst[a]), int(src[a]), int(b - a))
                                                 for a, b in zip(bounds[:-1], bounds[1:]))
        return cls(Rows.of(dst, device), Rows.of(src, device), runs)

    @functools.cached_property
    def inverse(self) -> "RowMap":
        return RowMap(self.src, self.dst, None if self.runs is None else tuple((s, d, n) for d, s, n in self.runs))

    def copy(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``x[dst] = y[src]``."""
        if self.runs is None:
            self.dst.put(x, self.src.take(y))
            return
        for d, s, n in self.runs:
            x[d:d + n] = y[s:s + n]

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``x.index_add_(0, dst, y[src])``."""
        if self.runs is None:
            return self.dst.add(x, self.src.take(y))
        for d, s, n in self.runs:
            x[d:d + n] += y[s:s + n]
        return x


# Key rows (expanded) per backward kernel call: bounds the backward's workspace, while each call
# stays large enough to run the kernel at full speed. A segment with more keys runs alone.
BACKWARD_GROUP_KEYS = 128 * 1024


@dataclass(frozen=True, eq=False)
class SegmentRows:
    """A subset of a server's kernel segments as their own kernel call: its rows in the full call's Q
    and expanded-KV buffers (slices, views without a copy, where the subset is consecutive; else
    :class:`Rows`, copied run by run where they are a few runs, as a sparse layer's long and short
    documents' segments are) and its own segment boundaries. :func:`take_rows` and :func:`put_rows` read and
    write them either way."""

    q_rows: slice | Rows
    k_rows: slice | Rows
    cu_q: torch.Tensor  # int32
    cu_k: torch.Tensor  # int32
    max_q: int
    max_k: int

    @classmethod
    def of(cls, q_len: np.ndarray, k_len: np.ndarray, keep: np.ndarray, device,
           k_start: np.ndarray | None = None) -> "SegmentRows":
        """``q_len``, ``k_len``: the full call's segments in call order; ``keep``: the subset's (bool);
        ``k_start``: each segment's first key row where the keys are not the segments' own, in order."""
        q_start = np.cumsum(q_len) - q_len
        k_start = np.cumsum(k_len) - k_len if k_start is None else np.asarray(k_start)
        n, end = q_len[keep], k_len[keep]
        kept = np.flatnonzero(keep)
        dev = functools.partial(index_tensor, device=device)
        if len(kept) and kept[-1] - kept[0] + 1 == len(kept):
            first, last = kept[0], kept[-1]
            q_rows = slice(int(q_start[first]), int(q_start[last] + q_len[last]))
            k_rows = slice(int(k_start[first]), int(k_start[last] + k_len[last]))
        else:
            q_rows, k_rows = Rows.of(ranges(q_start[keep], n), device), Rows.of(ranges(k_start[keep], end), device)
        return cls(q_rows, k_rows, dev(np.r_[0, np.cumsum(n)], torch.int32), dev(np.r_[0, np.cumsum(end)], torch.int32),
                   int(n.max(initial=0)), int(end.max(initial=0)))


def take_rows(x: torch.Tensor, rows: slice | Rows) -> torch.Tensor:
    """``x[rows]`` (a view where ``rows`` is a slice or one run) of a :class:`SegmentRows`' rows."""
    return x[rows] if isinstance(rows, slice) else rows.take(x)


def put_rows(dst: torch.Tensor, rows: slice | Rows, src: torch.Tensor) -> None:
    """``dst[rows] = src`` of a :class:`SegmentRows`' rows."""
    if isinstance(rows, slice):
        dst[rows] = src
    else:
        rows.put(dst, src)


def backward_in_parts(parts, dout, q, k, v, out, lse, scale, into=None):
    """A kernel call's backward as one call per part, ``parts`` being (SegmentRows, Backend) pairs that
    partition the call's segments (every row in one part, or in ``into``'s rows that others write); each
    part's gradients land in its rows of ``into`` (contiguous (dq, dk, dv); else new): written there by the
    kernel where the backend can (``Backend.backward_into``) and the rows are a range, else copied."""
    # contiguous whatever the inputs' strides: a part's rows are then contiguous views the kernel can write
    dq, dk, dv = into if into is not None else (x.new_empty(x.shape) for x in (q, k, v))
    for rows, backend in parts:
        qr, kr = rows.q_rows, rows.k_rows
        args = (take_rows(dout, qr), take_rows(q, qr), take_rows(k, kr), take_rows(v, kr), take_rows(out, qr),
                take_rows(lse.T, qr).T.contiguous(), rows.cu_q, rows.cu_k, rows.max_q, rows.max_k)
        if backend.backward_into and isinstance(qr, slice) and isinstance(kr, slice):
            backend.backward(*args, scale=scale, into=(dq[qr], dk[kr], dv[kr]))
            continue
        grads = backend.backward(*args, scale=scale)
        del args
        for dst, rows_of, grad in zip((dq, dk, dv), (qr, kr, kr), grads):
            put_rows(dst, rows_of, grad)
        del grads  # one part's kernel outputs at a time
    return dq, dk, dv


@dataclass(frozen=True, eq=False)
class PrefixCopies:
    """How the kernel's expanded keys map back to the unique KV rows, for summing their gradients (the
    backward of ``k_u[kv_expand]``). Each kernel segment reads a prefix ``[base, base + k_len)`` of the
    unique buffer, its document's rows; the longest segment of each document covers them all. Its
    gradient rows are gathered once (``first``), in float32 (float64 stays float64), and every other
    segment's are added as one slice each (``extra``: (unique start, expanded start, length)): contiguous
    adds with no atomics, and a float32 sum where bf16 atomics (index_add_) rounded at every one of up to
    a document's number of segments additions (one H200, a 64K-token document in 1K-token segments: 8 ms
    against 26 ms per tensor, max error 2.9e-3 of the largest value against 2.3e-2;
    bench/results/2026-11-26-h200-fa4.md). On CUDA below float64, ``sum`` runs kernels.prefix_sum instead: every
    expanded row read once and every unique row written once, 12.6-14.5 ms faster than the slices on that layout
    (bench/results/2026-11-27-h200-fa4-prefix-sum.md).

    Under a sliding window no segment need cover its group's rows (each reads the window of its own queries):
    then every expanded row is added into its unique row at once (``spread``: the unique row of each expanded
    row, index_add_ in float32)."""

    num_unique: int
    first: slice | torch.Tensor  # expanded row of each unique row, in its document's longest segment
    extra: tuple[tuple[int, int, int], ...]
    # The same for kernels.prefix_sum (int32): each unique row's document; per document its first unique
    # row, where its copies start in the two lists below and how many it has; every copy's first expanded
    # row and length, each document's longest first.
    tables: tuple[torch.Tensor, ...] = ()
    spread: torch.Tensor | None = None  # where the fast path does not apply: each expanded row's unique row

    @classmethod
    def of(cls, seg_base: np.ndarray, seg_k: np.ndarray, num_unique: int, device) -> "PrefixCopies":
        """``seg_base``: each segment's first unique row (its document's); ``seg_k``: its keys."""
        seg_base, seg_k = np.asarray(seg_base, dtype=np.int64), np.asarray(seg_k, dtype=np.int64)
        exp_start = np.cumsum(seg_k) - seg_k
        # per document (base), its longest segment: sort by (base, -length), keep the first of each base
        order = np.lexsort((-seg_k, seg_base))
        is_first = np.r_[True, seg_base[order][1:] != seg_base[order][:-1]] if len(order) else np.zeros(0, bool)
        longest, others = order[is_first], np.sort(order[~is_first])
        if not np.array_equal(np.r_[seg_base[longest], num_unique], np.r_[0, np.cumsum(seg_k[longest])]):
            # windows: no one segment per base covering the unique rows in order
            return cls(num_unique, slice(0, 0), (), spread=index_tensor(ranges(seg_base, seg_k), device=device))
        if len(longest) == 1:
            first = slice(int(exp_start[longest[0]]), int(exp_start[longest[0]] + seg_k[longest[0]]))
        else:
            first = index_tensor(ranges(exp_start[longest], seg_k[longest]), device=device)
        extra = tuple(zip(seg_base[others].tolist(), exp_start[others].tolist(), seg_k[others].tolist()))
        doc_first = np.flatnonzero(is_first)
        doc_count = np.diff(np.r_[doc_first, len(order)])
        row_doc = np.repeat(np.arange(len(longest)), seg_k[longest])
        if int(seg_k.sum()) >= 2**31:  # (the tables are int32; the kernel's element offsets are int64)
            raise ValueError(f"{int(seg_k.sum())} expanded key rows: more than int32 row indices hold")
        tables = tuple(index_tensor(a, torch.int32, device=device) for a in
                       (row_doc, seg_base[longest], doc_first, doc_count, exp_start[order], seg_k[order]))
        return cls(num_unique, first, extra, tables)

    def sum(self, d_expanded: torch.Tensor, impl: str = "auto") -> torch.Tensor:
        """The unique rows' gradient (in ``d_expanded``'s dtype) from the expanded keys' gradient.
        ``impl``: "triton" (kernels.prefix_sum, one pass; "auto" on CUDA below float64) or "torch"."""
        if impl not in ("auto", "triton", "torch"):
            raise ValueError(f"impl={impl!r}: choose auto, triton or torch")
        if self.spread is not None:
            dtype = torch.promote_types(d_expanded.dtype, torch.float32)
            total = torch.zeros((self.num_unique, *d_expanded.shape[1:]), dtype=dtype, device=d_expanded.device)
            return total.index_add_(0, self.spread, d_expanded.to(dtype)).to(d_expanded.dtype)
        if impl == "auto":
            impl = "triton" if d_expanded.is_cuda and d_expanded.dtype != torch.float64 else "torch"
        if impl == "triton":
            from attnpool.kernels.prefix_sum import prefix_sum

            out = torch.empty((self.num_unique, *d_expanded.shape[1:]), dtype=d_expanded.dtype, device=d_expanded.device)
            return prefix_sum(d_expanded.contiguous(), out, *self.tables)
        # float32 at least (float64 stays float64)
        dtype = torch.promote_types(d_expanded.dtype, torch.float32)
        total = torch.empty((self.num_unique, *d_expanded.shape[1:]), dtype=dtype, device=d_expanded.device)
        total.copy_(d_expanded[self.first])
        for unique, expanded, n in self.extra:
            total[unique:unique + n] += d_expanded[expanded:expanded + n]
        return total.to(d_expanded.dtype)


# When a server's work runs without prefix copies: only where the copied key rows it avoids are at least
# MIN_AVOIDED_KEYS_PER_CALL per kernel call it makes (a call costs something of its own: FA4's host-side
# setup, a launch, a smaller grid) and MIN_AVOIDED_FRACTION of its unique KV rows (the position kernel runs
# a few percent below a causal varlen call, which a few copies cost less than). Measured on one H200
# (bench/results/2026-11-27-h200-h100-fa4-positions.md), fa4 without copies against fa4 with them: 1.28x and
# 1.24x faster avoiding 15.5x and 7.5x the unique rows in one call, 1.00x at 25%, 0.98x at 12.5%; on
# 2 x H200 (pretrain 64K, percp) 1-9 calls a step avoiding about 16K rows in all made steps 1.2% slower.
# Thresholds between those points, not tuned.
MIN_AVOIDED_KEYS_PER_CALL = 16 * 1024
MIN_AVOIDED_FRACTION = 0.25

# A served document with at most this many segments runs as one causal call per segment over the slice of its
# unique keys the segment reads (views, no copies), rather than as one position-kernel call: the position kernel
# (FA4's non-varlen kernel with a mask_mod and block sparsity) ran its work 8-11% slower forward and 3.3-3.5%
# slower backward than FA4's causal varlen kernel runs the same work (2 x H200, pretrain 256K batch 3: a
# 302,696-token document whose head and tail a server holds as two segments; 2.3-2.5% slower forward+backward for
# two 32K-query segments of a 128K document: bench/results/2026-11-30-h200x2-pretrain-trace.md), where the
# per-segment calls cost a launch each and, in backward, each other segment's key gradients made apart and added.
# Many segments keep the single position call, which measured 1.08x and 1.10x the copies at 8 and 16 segments of
# a 128K document (1.28x at a 64K document's 32). Between 2 and 8, not measured.
MAX_CAUSAL_CALL_SEGMENTS = 4


@dataclass(frozen=True, eq=False)
class DocumentCall:
    """A served document with several kernel segments, as one PositionKernel call: its queries (consecutive
    rows of the server's Q buffer) at their document positions, over its unique keys."""

    q_rows: slice
    k_rows: slice
    positions: np.ndarray  # int64, one per query row


@dataclass(frozen=True, eq=False)
class DocumentServing:
    """A server's kernel work without prefix copies: each document with several segments in calls of its own
    (``segmented``: a causal call per segment over the slice of the unique keys it reads, where the document has at
    most MAX_CAUSAL_CALL_SEGMENTS and one segment's keys hold every other's, which any dense backend runs; else
    ``calls``: one call of a PositionKernel, without which the server copies prefixes instead), and the documents
    with one segment in varlen calls over their unique rows (such a segment's keys are its document's whole prefix
    as the buffer holds it), one per run of them between the others, so that every call reads slices of the server's buffers, no gathered copy.
    The parts partition the Q rows; the unique KV rows are partitioned by ``calls``, the runs and each
    segmented document's first segment, whose keys hold its others'."""

    varlen: tuple[SegmentRows, ...]  # forward: each run of one-segment documents (rows of Q and unique KV)
    varlen_groups: tuple[SegmentRows, ...]  # backward: the runs cut into groups of at most BACKWARD_GROUP_KEYS keys
    calls: tuple[DocumentCall, ...]
    # per such document, its segments as causal calls, the one whose keys hold the others' first
    segmented: tuple[tuple[SegmentRows, ...], ...] = ()
    _handles: dict = dataclasses.field(default_factory=dict)

    def handles(self, backend, device) -> tuple:
        """The backend's PositionKernel handles of ``calls``, prepared on first use (host tables, once per
        layout and backend)."""
        if not self.calls:  # (a backend without a PositionKernel serves causal calls alone)
            return ()
        if backend.name not in self._handles:
            prepare = backend.positions.prepare
            self._handles[backend.name] = tuple(prepare(c.positions, c.k_rows.stop - c.k_rows.start, device)
                                                for c in self.calls)
        return self._handles[backend.name]

    @classmethod
    def of(cls, seg_group, seg_q, seg_k, seg_base, group_rows, num_unique: int, device) -> "DocumentServing | None":
        """From the server's kernel segments (KV group: its document, or under a window its range of it; query
        and key rows; first unique row) and each segment's group's unique rows (first, count) and its unique KV
        rows; None where no group has several segments, or where the copies avoided are too few
        (MIN_AVOIDED_KEYS_PER_CALL per call, MIN_AVOIDED_FRACTION of the unique rows)."""
        # each group's segments are consecutive (tasks in (doc, start) order): [doc_start, doc_end)
        doc_start = np.flatnonzero(np.r_[True, seg_group[1:] != seg_group[:-1]])
        doc_end = np.r_[doc_start[1:], len(seg_group)]
        split = doc_end - doc_start > 1
        if not split.any():
            return None
        several = np.repeat(split, doc_end - doc_start)
        q_start = np.cumsum(seg_q) - seg_q
        # a segment's queries are the tail of its keys: positions counted from its group's first unique row
        seg_start = seg_base - group_rows[0] + (seg_k - seg_q)
        segs = np.arange(len(seg_group))
        calls, segmented = [], []
        for a, b in zip(doc_start[split], doc_end[split]):
            widest = a + int(np.argmax(seg_k[a:b]))  # causal: the last segment's keys, its document's whole prefix
            holds_all = (seg_base[widest] <= seg_base[a:b].min()
                         and seg_base[widest] + seg_k[widest] >= (seg_base[a:b] + seg_k[a:b]).max())
            if b - a <= MAX_CAUSAL_CALL_SEGMENTS and holds_all:
                segmented.append((widest, *(i for i in range(a, b) if i != widest)))
            else:
                calls.append(DocumentCall(slice(int(q_start[a]), int(q_start[b - 1] + seg_q[b - 1])),
                                          slice(int(group_rows[0][a]), int(group_rows[0][a] + group_rows[1][a])),
                                          ranges(seg_start[a:b], seg_q[a:b])))
        # runs of one-segment documents: consecutive segments, so consecutive rows of both buffers
        run_first = np.flatnonzero(~several & np.r_[True, several[:-1]])
        run_end = np.flatnonzero(~several & np.r_[several[1:], True]) + 1
        avoided = int(seg_k.sum()) - num_unique
        num_calls = len(run_first) + len(calls) + sum(len(s) for s in segmented)
        if avoided < max(MIN_AVOIDED_KEYS_PER_CALL * num_calls, MIN_AVOIDED_FRACTION * num_unique):
            return None
        varlen, varlen_groups = [], []
        for a, b in zip(run_first, run_end):
            varlen.append(SegmentRows.of(seg_q, seg_k, (segs >= a) & (segs < b), device, k_start=seg_base))
            varlen_groups += [SegmentRows.of(seg_q, seg_k, (segs >= a + c) & (segs < a + d), device, k_start=seg_base)
                              for c, d in segment_groups(seg_k[a:b], BACKWARD_GROUP_KEYS)]
        return cls(tuple(varlen), tuple(varlen_groups), tuple(calls),
                   tuple(tuple(SegmentRows.of(seg_q, seg_k, segs == i, device, k_start=seg_base) for i in order)
                         for order in segmented))


def segment_groups(seg_k: np.ndarray, max_keys: int) -> list[tuple[int, int]]:
    """[first, last) segment ranges, consecutive, each with at most ``max_keys`` keys in all
    (a segment with more is a group of its own)."""
    groups, first, keys = [], 0, 0
    for i, n in enumerate(seg_k.tolist()):
        if i > first and keys + n > max_keys:
            groups.append((first, i))
            first, keys = i, 0
        keys += n
    if len(seg_k):
        groups.append((first, len(seg_k)))
    return groups


@dataclass(frozen=True, eq=False)
class KVRelay:
    """A server's part of the hierarchical exchange's second all-to-all (inside its node): the rows of its
    received KV it forwards to its node's other servers, grouped by server, and what it receives from its node's
    relays (appended after its dispatched rows; their places in the unique buffer are in ``recv_kv_pos``)."""

    send_rows: Rows  # rows of the received KV, destination-ordered
    send_splits: list[int]
    recv_splits: list[int]


def _splits(owner: np.ndarray, lengths: np.ndarray, world: int) -> list[int]:
    return np.bincount(owner, weights=lengths, minlength=world).astype(np.int64).tolist()


@dataclass(frozen=True, eq=False)
class DispatchLayout:
    rank: int
    world: int
    num_tokens: int  # tokens this rank holds (T_r)
    any_traffic: bool  # False for a fully local plan: no collective at all
    # dispatch (Q and KV out), per peer token counts
    q_send_splits: list[int]
    kv_send_splits: list[int]
    q_recv_splits: list[int]
    kv_recv_splits: list[int]
    q_send_rows: Rows  # local rows, peer-ordered
    kv_send_rows: Rows
    # server side: tasks in canonical order
    local_q: RowMap  # local rows of tasks served here (src) and their positions in the server's Q buffer (dst)
    recv_q_pos: Rows  # position in the server's Q buffer of each received Q row
    num_server_q: int
    local_kv: RowMap  # local rows that are part of the unique KV buffer (src) and their positions in it (dst)
    recv_kv_pos: Rows  # position in the unique KV buffer of each received KV row (relayed ones last)
    num_unique_kv: int
    kv_expand_identity: bool  # expanded == unique (one segment per served document): no copy needed
    cu_q: torch.Tensor  # int32
    cu_k: torch.Tensor  # int32
    max_q: int
    max_k: int
    backward_groups: tuple[SegmentRows, ...]  # empty where one backward call covers every segment
    documents: DocumentServing | None  # the same work without copies (Backend.positions); None: none or few to avoid
    relay: KVRelay | None  # the hierarchical exchange's second all-to-all; None where the plan relays nothing
    # each kernel segment's first unique row and keys, and the device: kv_expand and prefix_copies, built on
    # first use only (a backend that serves positions needs neither; they hold one entry per expanded row)
    segment_base: np.ndarray
    segment_keys: np.ndarray
    device: torch.device

    @functools.cached_property
    def kv_expand(self) -> torch.Tensor:
        """The unique-KV row of each expanded key (one prefix per kernel segment)."""
        return index_tensor(ranges(self.segment_base, self.segment_keys), device=self.device)

    @functools.cached_property
    def prefix_copies(self) -> PrefixCopies | None:
        """How the expanded keys' gradients sum back (None with the identity)."""
        if self.kv_expand_identity:
            return None
        return PrefixCopies.of(self.segment_base, self.segment_keys, self.num_unique_kv, self.device)

    @classmethod
    def build(cls, plan: Plan, rank: int, device, withheld: np.ndarray | None = None,
              relay_nodes: tuple[int, ...] | None = None) -> "DispatchLayout":
        """``withheld``: bool per KV segment of ``plan.kv_transfers()``; remote ones marked are not sent
        (runtime.sparse_kv sends what of them is read later). Local segments are always copied.
        ``relay_nodes``: each rank's node, for the hierarchical exchange (``KVTransfers.relays``; not with
        ``withheld``)."""
        W = plan.num_ranks
        t = plan.pieces
        home, server, n = plan.task_home, plan.task_server, plan.task_len
        offset = plan.task_home_offset

        # Q I send: my tasks served elsewhere, ordered by server.
        out_q = np.flatnonzero((home == rank) & (server != rank))
        out_q = out_q[np.argsort(server[out_q], kind="stable")]
        q_send_rows = ranges(offset[out_q], n[out_q])
        q_send_splits = _splits(server[out_q], n[out_q], W)

        # Tasks I serve, canonical order; their rows in my Q buffer.
        mine = np.flatnonzero(server == rank)
        pos = np.cumsum(n[mine]) - n[mine]
        is_local = home[mine] == rank
        local_q_rows = ranges(offset[mine[is_local]], n[mine[is_local]])
        local_q_pos = ranges(pos[is_local], n[mine[is_local]])
        remote = np.flatnonzero(~is_local)
        remote = remote[np.argsort(home[mine[remote]], kind="stable")]
        recv_q_pos = ranges(pos[remote], n[mine[remote]])
        q_recv_splits = _splits(home[mine[remote]], n[mine[remote]], W)

        # KV segments (sorted by server, doc, start).
        x = plan.kv_transfers()
        if relay_nodes is not None and withheld is not None:
            raise ValueError("the hierarchical exchange relays KV the dispatch sends; this layout withholds some")
        relay_of = x.relays(relay_nodes) if relay_nodes is not None else np.full(len(x.src), -1)
        sent = (np.ones(len(x.src), dtype=bool) if withheld is None else ~withheld) & (relay_of < 0)
        out_kv = np.flatnonzero((x.src == rank) & (x.server != rank) & sent)  # already server-ordered
        kv_send_rows = ranges(x.src_row[out_kv], x.length[out_kv])
        kv_send_splits = _splits(x.server[out_kv], x.length[out_kv], W)
        seg = np.flatnonzero(x.server == rank)
        seg_pos = np.cumsum(x.length[seg]) - x.length[seg]
        seg_local = x.src[seg] == rank
        local_kv_rows = ranges(x.src_row[seg[seg_local]], x.length[seg[seg_local]])
        local_kv_pos = ranges(seg_pos[seg_local], x.length[seg[seg_local]])
        seg_remote = np.flatnonzero(~seg_local & sent[seg])
        seg_remote = seg_remote[np.argsort(x.src[seg[seg_remote]], kind="stable")]
        recv_kv_pos = ranges(seg_pos[seg_remote], x.length[seg[seg_remote]])
        kv_recv_splits = _splits(x.src[seg[seg_remote]], x.length[seg[seg_remote]], W)
        relay = None
        if (relay_of >= 0).any():  # (the same on every rank: each calls the second exchange)
            # as a relay: the segments nested in those I received, from where they lie in my received rows
            received_at = np.full(len(x.src), -1, dtype=np.int64)
            received_at[seg[seg_remote]] = np.cumsum(x.length[seg[seg_remote]]) - x.length[seg[seg_remote]]
            out = np.flatnonzero((relay_of >= 0) & (x.server[np.maximum(relay_of, 0)] == rank))
            out = out[np.argsort(x.server[out], kind="stable")]
            held = relay_of[out]
            send_rows = ranges(received_at[held] + (x.src_row[out] - x.src_row[held]), x.length[out])
            # as a server: what my node's relays forward, grouped by relay, after the dispatched rows
            inward = np.flatnonzero(relay_of[seg] >= 0)
            inward = inward[np.argsort(x.server[relay_of[seg[inward]]], kind="stable")]
            recv_kv_pos = np.r_[recv_kv_pos, ranges(seg_pos[inward], x.length[seg[inward]])]
            relay = KVRelay(Rows.of(send_rows, device), _splits(x.server[out], x.length[out], W),
                            _splits(x.server[relay_of[seg[inward]]], x.length[seg[inward]], W))

        # Each KV group's rows start where its first segment does (segments of a (server, doc, range) group
        # tile [kv_start, kv_end) in order); a kernel segment's keys start at its first key's row of its group.
        my_groups = np.flatnonzero(x.group_server == rank)
        group_len = x.group_len[my_groups]
        group_base = np.cumsum(group_len) - group_len
        num_unique_kv = int(x.length[seg].sum())
        seg_doc, seg_start, seg_end = plan.kernel_spans(rank)
        seg_key = key_start(seg_start, plan.window)  # each segment's first key (document position)
        seg_q, seg_k = seg_end - seg_start, seg_end - seg_key  # as Plan.kernel_segments gives them
        span = int(x.group_kv_end.max(initial=0)) + 1
        seg_group = np.searchsorted(x.group_doc[my_groups] * span + x.group_kv_start[my_groups],
                                    seg_doc * span + seg_key, side="right") - 1
        seg_base = group_base[seg_group] + (seg_key - x.group_kv_start[my_groups][seg_group])
        # the segments read [0, N) in order, each its own rows: expanded == unique
        kv_expand_identity = bool(np.array_equal(seg_base, np.cumsum(seg_k) - seg_k)
                                  and int(seg_k.sum()) == num_unique_kv)
        cu_q = np.r_[0, np.cumsum(seg_q)]
        cu_k = np.r_[0, np.cumsum(seg_k)]

        dev = functools.partial(index_tensor, device=device)
        groups = segment_groups(seg_k, BACKWARD_GROUP_KEYS)
        segs = np.arange(len(seg_k))
        backward_groups = tuple(SegmentRows.of(seg_q, seg_k, (segs >= a) & (segs < b), device)
                                for a, b in groups) if len(groups) > 1 else ()

        return cls(
            rank=rank, world=W, num_tokens=int(t.tokens_per_rank[rank]), any_traffic=not plan.is_fully_local(),
            q_send_splits=q_send_splits, kv_send_splits=kv_send_splits,
            q_recv_splits=q_recv_splits, kv_recv_splits=kv_recv_splits,
            q_send_rows=Rows.of(q_send_rows, device), kv_send_rows=Rows.of(kv_send_rows, device),
            local_q=RowMap.of(local_q_pos, local_q_rows, device), recv_q_pos=Rows.of(recv_q_pos, device),
            num_server_q=int(n[mine].sum()),
            local_kv=RowMap.of(local_kv_pos, local_kv_rows, device), recv_kv_pos=Rows.of(recv_kv_pos, device),
            num_unique_kv=num_unique_kv,
            kv_expand_identity=kv_expand_identity,
            cu_q=dev(cu_q, torch.int32), cu_k=dev(cu_k, torch.int32),
            max_q=int(seg_q.max(initial=0)), max_k=int(seg_k.max(initial=0)), backward_groups=backward_groups,
            documents=DocumentServing.of(seg_group, seg_q, seg_k, seg_base,
                                         (group_base[seg_group], group_len[seg_group]), num_unique_kv, device),
            relay=relay, segment_base=seg_base, segment_keys=seg_k, device=torch.device(device),
        )
