"""Sparse core attention on the servers: each document's pattern estimated once, shared, bound to the kernel.

Who estimates. A vertical-slash pattern is estimated from a document's last
``m = min(last_queries, L)`` queries against all of its keys
(:mod:`attnpool.sparse.pattern`). Of the CA-tasks of a document exactly one ends
at the document's end, and its server holds the whole KV prefix [0, L) and that
shard's queries. That server estimates. Where the shard is shorter than ``m``
(a layout may cut a document anywhere), the home ranks of the missing queries
send them first, so the pattern never depends on how the document was cut: every
strategy computes the same function. Every other server of the document then
receives the packed pattern in one all-to-all of int32 words. All sizes follow
from the plan and document lengths alone (``packed_sizes``), so no exchange
needs a size negotiation or a device read. A plan in which no document has
tasks on two servers (a fully local plan, for one) exchanges nothing.

Documents shorter than ``min_doc_len`` stay dense: their tasks run through the
dense backend (FlashAttention on GPUs) and take no part in estimation or
exchange; a server with both kinds makes one call of each kernel.

The forward binds the backend to the patterns and ``_Serve`` keeps that backend
for its backward, so backward reuses the forward's patterns.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

import numpy as np
import torch

from attnpool.comm import all_to_all_flat
from attnpool.kernels import sparse as sparse_kernels
from attnpool.kernels.base import Backend
from attnpool.plan.documents import ranges
from attnpool.plan.plan import Plan
from attnpool.runtime.dispatch import Rows, SegmentRows, backward_in_parts, index_tensor, put_rows, take_rows
from attnpool.runtime.sparse_kv import ReadRoutes, ReadSelection, estimating_servers
from attnpool.sparse import SparseConfig, VerticalSlashPattern, estimate_vertical_slash, packed_sizes
from attnpool.sparse.pattern import LENGTH_CLASSES, PackLayout, exclusive_cumsum, length_class

# Per call, summed over the documents this rank estimated (each document is estimated once
# in the whole group, so summing over ranks counts each once): see SparseStats.
_STAT_FIELDS = ("sparse_heads", "diagonals", "verticals", "pairs_computed", "pairs_causal")


@dataclass(frozen=True, eq=False)
class PatternRoutes:
    """Host-built index maps of one (plan, rank, query heads, sparse config)."""

    est_docs: np.ndarray  # plan document indices estimated here, ascending
    est_lens: np.ndarray
    extra_send_rows: torch.Tensor  # local rows of queries other servers estimate with, peer by peer
    extra_send_splits: list[int]
    extra_recv_splits: list[int]
    extra_local_rows: torch.Tensor  # local rows of queries this server estimates with but does not serve
    tail_rows: torch.Tensor  # rows of the server's Q buffer: the estimating queries its last shards hold
    est_q_index: torch.Tensor  # each estimating query in cat(Q[tail_rows], extra local, extra received)
    est_cu_q: torch.Tensor  # int32
    est_k_rows: Rows  # rows of the server's unique KV buffer: each estimated document's keys [0, L), a run each
    est_cu_k: torch.Tensor  # int32
    own_pack: PackLayout  # the estimated documents' packed buffer
    est_index: torch.Tensor  # 0 .. len(est_docs) - 1 on the device: the estimated pattern's documents
    send_words: torch.Tensor  # words of the own packed buffer to send, peer by peer
    send_splits: list[int]
    recv_splits: list[int]
    served_docs: np.ndarray  # plan document indices of the sparse documents served here, ascending
    served_lens: np.ndarray  # their lengths
    served_words: torch.Tensor | None  # index into cat(own packed, received); None: served == estimated
    served_pack: PackLayout | None  # the served documents' packed buffer (None with served_words)
    seg_doc: torch.Tensor  # served sparse-document index of each sparse kernel segment (Plan.kernel_segments)
    sparse_rows: "SegmentRows | None"  # the sparse segments of the kernel call (None: all of them)
    dense_rows: "SegmentRows | None"  # the dense (short-document) segments; None when there are none
    dense_pairs: float  # causal (query, key) pairs x heads of the dense documents whose last task is here
    # What this server's kernel call computes, for SparseStats' served work: each sparse segment's served
    # document and query blocks [first, end), and the (query, key) pairs x heads of its dense segments.
    seg_first_block: torch.Tensor
    seg_end_block: torch.Tensor
    dense_served_pairs: float
    dense_served_start: np.ndarray  # the dense segments' query spans [start, end) (document coordinates), to price
    dense_served_end: np.ndarray
    exchange: bool  # some document has tasks on two servers (a plan property: equal on every rank)
    extra_exchange: bool  # some estimating server needs queries from another rank (also a plan property)

    @classmethod
    def build(cls, plan: Plan, rank: int, num_heads: int, config: SparseConfig, device) -> "PatternRoutes":
        W = plan.num_ranks
        doc_len = plan.pieces.doc_len
        D = len(doc_len)
        sparse_doc = doc_len >= config.min_doc_len
        server, n = plan.task_server, plan.task_len
        est_server, last_task = estimating_servers(plan)

        x = plan.kv_transfers()  # (server, doc) groups, sorted: the documents each server serves
        g_server, g_doc = x.group_server, x.group_doc
        mine = np.flatnonzero(server == rank)
        my_all = np.flatnonzero(g_server == rank)
        group_base = (np.cumsum(x.group_len[my_all]) - x.group_len[my_all])[sparse_doc[g_doc[my_all]]]
        my_groups = my_all[sparse_doc[g_doc[my_all]]]  # only sparse documents are estimated and exchanged
        served = g_doc[my_groups]
        task_pos = np.cumsum(n[mine]) - n[mine]  # first row of each served task in the server's Q buffer
        pos_of_task = np.full(plan.num_tasks, -1, dtype=np.int64)
        pos_of_task[mine] = task_pos

        est_here = served[est_server[served] == rank]
        est_lens = doc_len[est_here]
        est_k_rows = ranges(group_base[np.searchsorted(served, est_here)], est_lens)

        queries = _estimating_queries(plan, rank, est_server, last_task, est_here, pos_of_task, config)
        words = packed_sizes(doc_len, num_heads, config)
        own_off = np.zeros(D, dtype=np.int64)
        own_off[est_here] = np.cumsum(words[est_here]) - words[est_here]
        remote = (g_server != est_server[g_doc]) & sparse_doc[g_doc]  # groups whose pattern comes from elsewhere
        # Send: to each peer, the documents I estimate that it also serves, in document order.
        out = np.flatnonzero(remote & (est_server[g_doc] == rank))  # groups sorted by (server, doc)
        send_words = ranges(own_off[g_doc[out]], words[g_doc[out]])
        send_splits = np.bincount(g_server[out], weights=words[g_doc[out]], minlength=W).astype(np.int64).tolist()
        # Receive: from each peer, the documents it estimates that I serve, in document order.
        inc = my_groups[remote[my_groups]]
        inc = inc[np.lexsort((g_doc[inc], est_server[g_doc[inc]]))]
        recv_splits = np.bincount(est_server[g_doc[inc]], weights=words[g_doc[inc]],
                                  minlength=W).astype(np.int64).tolist()
        served_words = None
        if len(est_here) != len(served):
            recv_off = np.zeros(D, dtype=np.int64)
            recv_off[g_doc[inc]] = int(words[est_here].sum()) + np.cumsum(words[g_doc[inc]]) - words[g_doc[inc]]
            start = np.where(est_server[served] == rank, own_off[served], recv_off[served])
            served_words = ranges(start, words[served])

        dev = functools.partial(index_tensor, device=device)

        seg_doc, seg_q, seg_k = plan.kernel_segments(rank)  # the kernel call's segments
        _, seg_start, seg_end = plan.kernel_spans(rank)
        is_sparse = sparse_doc[seg_doc]
        dense_here = np.flatnonzero(~sparse_doc & (est_server == rank))
        L = doc_len[dense_here].astype(np.float64)
        a, e = seg_start[~is_sparse].astype(np.float64), seg_end[~is_sparse].astype(np.float64)

        return cls(
            est_docs=est_here, est_lens=est_lens,
            extra_send_rows=dev(queries["extra_send_rows"]), extra_send_splits=queries["extra_send_splits"],
            extra_recv_splits=queries["extra_recv_splits"], extra_local_rows=dev(queries["extra_local_rows"]),
            tail_rows=dev(queries["tail_rows"]),
            est_q_index=dev(queries["est_q_index"]), est_cu_q=dev(queries["est_cu_q"], torch.int32),
            est_k_rows=Rows.of(est_k_rows, device), est_cu_k=dev(np.r_[0, np.cumsum(est_lens)], torch.int32),
            own_pack=PackLayout.build(est_lens, num_heads, config, device), est_index=dev(np.arange(len(est_here))),
            send_words=dev(send_words), send_splits=send_splits, recv_splits=recv_splits,
            served_docs=served, served_lens=doc_len[served], served_words=None if served_words is None else dev(served_words),
            served_pack=None if served_words is None else PackLayout.build(doc_len[served], num_heads, config, device),
            seg_doc=dev(np.searchsorted(served, seg_doc[is_sparse])),
            sparse_rows=None if is_sparse.all() else SegmentRows.of(seg_q, seg_k, is_sparse, device),
            dense_rows=None if is_sparse.all() else SegmentRows.of(seg_q, seg_k, ~is_sparse, device),
            dense_pairs=float(num_heads * (L * (L + 1) / 2).sum()),
            seg_first_block=dev(seg_start[is_sparse] // config.block),
            seg_end_block=dev(-(-seg_end[is_sparse] // config.block)),
            dense_served_pairs=float(num_heads * (e * (e + 1) - a * (a + 1)).sum() / 2),
            dense_served_start=seg_start[~is_sparse], dense_served_end=seg_end[~is_sparse], exchange=bool(np.any(remote)),
            extra_exchange=queries["extra_exchange"],
        )


def served_backend(pattern: VerticalSlashPattern | None, routes: PatternRoutes, dense: Backend,
                   config: SparseConfig, wrap=None) -> Backend:
    """A server's kernel call: the sparse kernel bound to its served documents' ``pattern`` (in ``routes``'
    served order) for their segments, ``dense`` for the short documents' segments; ``dense`` alone where no
    sparse document is served here. ``wrap(backend, kind)`` ("sparse" or "dense"), where given, wraps each
    kernel's backend (a clock, say) inside the split."""
    wrap = wrap or (lambda backend, kind: backend)
    if not len(routes.served_lens):
        return wrap(dense, "dense")
    backend = wrap(sparse_kernels.backend(pattern, seg_doc=routes.seg_doc, chunk=config.vertical_chunk), "sparse")
    if routes.dense_rows is not None:
        backend = split_backend(backend, wrap(dense, "dense"), routes.sparse_rows, routes.dense_rows)
    return backend


def split_backend(sparse: Backend, dense: Backend, sparse_rows: SegmentRows, dense_rows: SegmentRows) -> Backend:
    """One backend over a server's tasks that runs the sparse ones and the dense ones as two kernel calls.

    The caller's segment arguments are those of the whole call; the subsets carry their own."""

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=None):
        # the two parts' rows are all the call's rows: each written once
        out = torch.empty_like(q)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # the kernels' lse dtype
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=acc, device=q.device)
        for p, be in ((sparse_rows, sparse), (dense_rows, dense)):
            part_out, part_lse = be.forward(take_rows(q, p.q_rows), take_rows(k, p.k_rows), take_rows(v, p.k_rows),
                                            p.cu_q, p.cu_k, p.max_q, p.max_k, scale=scale)
            put_rows(out, p.q_rows, part_out)
            put_rows(lse.T, p.q_rows, part_lse.T)
        return out, lse

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=None):
        return backward_in_parts(((sparse_rows, sparse), (dense_rows, dense)), dout, q, k, v, out, lse, scale)

    return Backend(f"{sparse.name}+{dense.name}", forward, backward)


def _estimating_queries(plan: Plan, rank: int, est_server, last_task, est_here, pos_of_task,
                        config: SparseConfig) -> dict:
    """Index maps that put each estimated document's last ``m`` queries together on its estimating server.

    The last shard [a, L) gives its tail; where a > L - m the queries [L - m, a) come from
    the pieces holding them: copied if this rank holds them, else received from their home.
    """
    doc_len, doc, n = plan.pieces.doc_len, plan.task_doc, plan.task_len
    W, D = plan.num_ranks, len(doc_len)
    last = last_task[last_task >= 0]
    m_all = np.minimum(doc_len, config.last_queries)
    a_all = np.zeros(D, dtype=np.int64)
    a_all[doc[last]] = plan.task_start[last]
    t = plan.pieces
    lo = np.maximum(t.start, doc_len[t.doc] - m_all[t.doc])
    hi = np.where(doc_len[t.doc] >= config.min_doc_len, np.minimum(t.end, a_all[t.doc]), lo)  # sparse docs only
    e = np.flatnonzero(hi > lo)  # pieces holding missing estimating queries
    e = e[np.lexsort((lo[e], t.doc[e]))]  # (doc, position) order
    e_src, e_dst, e_doc, e_len = t.rank[e], est_server[t.doc[e]], t.doc[e], hi[e] - lo[e]
    e_row = t.offset[e] + lo[e] - t.start[e]
    e_out = np.flatnonzero((e_src == rank) & (e_dst != rank))
    e_out = e_out[np.argsort(e_dst[e_out], kind="stable")]
    e_loc = np.flatnonzero((e_src == rank) & (e_dst == rank))
    e_inc = np.flatnonzero((e_dst == rank) & (e_src != rank))
    e_inc = e_inc[np.argsort(e_src[e_inc], kind="stable")]
    # Where each piece lands in cat(the last shards' tails, extra local, extra received).
    tl = last_task[est_here]
    m = m_all[est_here]
    shard_rows = np.minimum(n[tl], m)
    n_tails = int(shard_rows.sum())
    e_at = np.zeros(len(e), dtype=np.int64)
    e_at[e_loc] = n_tails + np.cumsum(e_len[e_loc]) - e_len[e_loc]
    e_at[e_inc] = n_tails + int(e_len[e_loc].sum()) + np.cumsum(e_len[e_inc]) - e_len[e_inc]
    mine_e = np.flatnonzero(e_dst == rank)  # already in (doc, position) order
    starts = np.concatenate([e_at[mine_e], np.cumsum(shard_rows) - shard_rows])
    lengths = np.concatenate([e_len[mine_e], shard_rows])
    keys = np.concatenate([e_doc[mine_e], est_here])  # per document: its extra pieces, then its shard's tail
    first = np.concatenate([np.zeros(len(mine_e)), np.ones(len(est_here))])
    order = np.lexsort((first, keys))
    est_q_index = ranges(starts[order], lengths[order])

    return dict(
        extra_send_rows=ranges(e_row[e_out], e_len[e_out]),
        extra_send_splits=np.bincount(e_dst[e_out], weights=e_len[e_out], minlength=W).astype(np.int64).tolist(),
        extra_recv_splits=np.bincount(e_src[e_inc], weights=e_len[e_inc], minlength=W).astype(np.int64).tolist(),
        extra_local_rows=ranges(e_row[e_loc], e_len[e_loc]),
        tail_rows=ranges(pos_of_task[tl] + n[tl] - shard_rows, shard_rows), est_q_index=est_q_index, est_cu_q=np.r_[0, np.cumsum(m)], extra_exchange=bool(np.any(e_src != e_dst)))


class SparseStats:
    """What the patterns of one step looked like, summed on the device (read once per step).

    - ``sparse_heads``: (document, head) pairs estimated sparse (dense short documents excluded);
    - ``diagonals`` / ``verticals``: their block diagonals and vertical columns, summed;
    - ``pairs_computed`` / ``pairs_causal``: every document's attended (query, key) pairs
      (slash tiles counted whole, verticals as their causal column length; dense
      documents all their pairs) against its causal pairs, per head: their ratio
      is the attention density, an upper bound by a little (a column inside a kept
      diagonal block counts twice).

    Also what this rank served, measured from the patterns its kernels ran, summed over the step's calls (forward;
    the backward runs the same tiles). Unlike the sums above it is this rank's own: its spread over the ranks is the
    sparse work's measured balance, where the planner's max/mean is a prediction made before the step's patterns
    exist. Three measures of it, of the sparse layers alone (every rank a plan balances runs the same layers):

    - ``served_pairs``: the (query, key) pairs x heads of the tiles its kernel calls computed (slash tiles and
      vertical bars whole, dense documents' causal pairs);
    - ``served_work`` (with ``price``): the same tiles priced per tile and head as the planner prices them
      (``price.slash``, ``price.bar``, times ``price.sparse_scale``) and the dense documents' spans by the planner's
      dense model
      (``price.dense_cost``, over the kernel call's spans, where the planner prices each task: adjacent tasks of one
      document are one span), so in the planner's unit: seconds with a measured cost table. The kernels spend
      different time per pair on a slash tile, a bar and a dense span (2.4x more on a bar's pair than on a slash
      tile's with the H200 calibration), so a plan balanced in seconds need not be balanced in pairs: in a CPU
      replay of synthetic prolong 256K over 4 ranks with a random model's patterns, planned in seconds, the ranks'
      pairs spread 1.11 where their priced work spread 1.02 (bench/results/2026-12-01-cpu-sparse-served-units.md);
    - ``served_kernel_s``: the seconds its sparse layers' attention kernel calls took (:class:`KernelClock`): the
      forward, a checkpointed layer's recompute of it and the backward, with whatever the host spends inside them.
    """

    SERVED = ("pairs", "work", "kernel_s", "tiles_work", "dense_work")  # per rank, in values() and parse()

    def __init__(self, price=None):
        """``price``: what the planner charges (``sparse.cost.ServedPrice``); None: ``served_work`` is not kept."""
        self.price = price
        self.sums: torch.Tensor | None = None
        self.dense_pairs = 0.0  # dense documents' pairs, known on the host
        self.served: torch.Tensor | None = None  # (slash tiles, bars, pairs) x heads, on the device
        self.dense_served = 0.0
        self.dense_served_work = 0.0
        self._dense_price: dict[PatternRoutes, float] = {}  # each plan's dense spans priced once, not once a layer
        self.kernel_clock = KernelClock()

    def add(self, pattern: VerticalSlashPattern | None, dense_pairs: float = 0.0) -> None:
        """One call's estimated patterns (None: none here) and the causal pairs of its dense documents."""
        self.dense_pairs += dense_pairs
        if pattern is not None:
            values = _pattern_stats(pattern)
            self.sums = values if self.sums is None else self.sums + values

    def add_served(self, pattern: VerticalSlashPattern | None, routes: PatternRoutes, chunk: int) -> None:
        """One kernel call's served work: its sparse segments' tiles under ``pattern`` (the served documents';
        None: none served here) and its dense segments."""
        self.dense_served += routes.dense_served_pairs
        if self.price is not None and len(routes.dense_served_start):
            if routes not in self._dense_price:  # (hashed by identity: one per plan and rank, cached on the plan)
                self._dense_price[routes] = self.price.dense_cost(routes.dense_served_start, routes.dense_served_end)
            self.dense_served_work += self._dense_price[routes]
        if pattern is not None:
            slash, bars = pattern.block_tiles(chunk)
            B = pattern.block
            tiles = torch.stack([slash.double(), bars.double()], 1)
            prefix = exclusive_cumsum(torch.cat([tiles, tiles @ tiles.new_tensor([[B * B], [B * chunk]])], 1), dim=0)
            off = pattern.blk_off[routes.seg_doc]
            served = (prefix[off + routes.seg_end_block] - prefix[off + routes.seg_first_block]).sum(0)
            self.served = served if self.served is None else self.served + served

    def timed(self, backend: Backend) -> Backend:
        """``backend`` with its kernel calls timed into ``served_kernel_s``."""
        return self.kernel_clock.timed(backend)

    def values(self) -> list[float]:
        """The sums, this rank's served pairs, served work (0 without a price), served kernel seconds, and the served
        work's two parts (the tiles at the calibration's prices, before the plans' ``sparse_scale``, and the short
        documents' spans), then the first three sums by length class (``LENGTH_CLASSES`` x 3), as floats
        (synchronises with the device): what :meth:`parse` reads back from every rank's."""
        width = len(_STAT_FIELDS) + 3 * LENGTH_CLASSES
        sums = [0.0] * width if self.sums is None else self.sums.double().cpu().tolist()
        sums[3] += self.dense_pairs
        sums[4] += self.dense_pairs
        slash, bars, pairs = [0.0] * 3 if self.served is None else self.served.cpu().tolist()
        tiles = 0.0 if self.price is None else self.price.tiles_cost(slash, bars)
        work = 0.0 if self.price is None else self.dense_served_work + self.price.sparse_scale * tiles
        return (sums[:len(_STAT_FIELDS)] + [self.dense_served + pairs, work, self.kernel_clock.seconds(), tiles,
                                            self.dense_served_work]
                + sums[len(_STAT_FIELDS):])

    @staticmethod
    def of_pattern(pattern: VerticalSlashPattern) -> tuple[np.ndarray, np.ndarray]:
        """One pattern's sums and sums by length class, as :meth:`parse` gives a step's: what the planning prior
        is updated with."""
        stats = _pattern_stats(pattern).double().cpu().numpy()
        return stats[:len(_STAT_FIELDS)], stats[len(_STAT_FIELDS):].reshape(LENGTH_CLASSES, 3)

    @staticmethod
    def parse(per_rank: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every rank's :meth:`values` (world, n) as (the sums over the ranks (5,), each rank's served pairs, work,
        kernel seconds, tiles' work and dense work (``SERVED``: 5, world), the sums by length class over the ranks
        (LENGTH_CLASSES, 3)). Each document was estimated on one rank, so the sums over ranks count each once."""
        n, m = len(_STAT_FIELDS), len(SparseStats.SERVED)
        return (per_rank[:, :n].sum(0), per_rank[:, n:n + m].T,
                per_rank[:, n + m:].sum(0).reshape(LENGTH_CLASSES, 3))


class KernelClock:
    """The seconds a rank's attention kernel calls take: on a GPU, CUDA events recorded on the current stream around
    each call and read once, when the step's statistics are (their elapsed time is the kernels' where nothing else
    runs on that stream between them); on the CPU, where calls return when done, the host's clock."""

    def __init__(self):
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.host_s = 0.0

    def timed(self, backend: Backend) -> Backend:
        """``backend`` with its forward and backward calls (its position kernel's too) timed."""
        positions = backend.positions
        if positions is not None:
            positions = dataclasses.replace(positions, forward=self._timed(positions.forward),
                                            backward=self._timed(positions.backward))
        return dataclasses.replace(backend, forward=self._timed(backend.forward),
                                   backward=self._timed(backend.backward), positions=positions)

    def _timed(self, fn):
        @functools.wraps(fn)
        def call(q, *args, **kwargs):
            if q.is_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                result = fn(q, *args, **kwargs)
                end.record()
                self.events.append((start, end))
                return result
            t0 = time.perf_counter()
            result = fn(q, *args, **kwargs)
            self.host_s += time.perf_counter() - t0
            return result
        return call

    def seconds(self) -> float:
        """Every timed call's seconds so far (waits for the device, on whichever streams the calls ran)."""
        if self.events:
            torch.cuda.synchronize()
        return self.host_s + sum(start.elapsed_time(end) for start, end in self.events) / 1e3


@torch.no_grad()
def _pattern_stats(pattern: VerticalSlashPattern) -> torch.Tensor:
    B, H = pattern.block, pattern.num_heads
    dev = pattern.device
    L = pattern.doc_len.double()
    nb = pattern.num_blocks()
    sparse = ~pattern.dense
    n_slash = pattern.n_slash.double()  # (D, H)
    n_vert = pattern.n_vert.double()
    # Slash tiles: diagonal Delta of a document with nb blocks has nb - Delta tiles.
    blk_doc = pattern.blk_doc.clamp(max=max(pattern.num_docs - 1, 0))
    delta = torch.arange(pattern.slash.shape[1], device=dev) - pattern.blk_off[blk_doc]
    tiles = (pattern.slash.double() * (nb[blk_doc] - delta).clamp(min=0).double()[None, :]).sum()
    # A vertical column c is read by the L - c queries at or after it.
    vdoc = pattern.vert_doc.clamp(max=max(pattern.num_docs - 1, 0))
    vlen = (pattern.doc_len[vdoc][None, :] - pattern.vert).clamp(min=0).double()
    vert_pairs = vlen.sum()  # unused slots hold doc_len, so they add 0
    causal = (L * (L + 1) / 2).sum() * H
    computed = torch.minimum(tiles * B * B + vert_pairs, causal)
    # The first three by the documents' length class as well: (sparse heads, diagonals, verticals) per class.
    per_doc = torch.stack([sparse.double() * H, (n_slash * sparse[:, None]).sum(1), (n_vert * sparse[:, None]).sum(1)], 1)
    by_length = torch.zeros(LENGTH_CLASSES, 3, dtype=torch.float64, device=dev).index_add_(
        0, length_class(pattern.doc_len), per_doc)
    return torch.cat([torch.stack([per_doc[:, 0].sum(), per_doc[:, 1].sum(), per_doc[:, 2].sum(), computed, causal]),
                      by_length.flatten()])


class SparseServing:
    """Turns a server's inputs into a Backend bound to their documents' patterns (dense documents: ``dense``)."""

    def __init__(self, plan: Plan, rank: int, config: SparseConfig, dense: Backend, group,
                 stats: SparseStats | None = None):
        self.plan, self.rank, self.config, self.dense, self.group, self.stats = plan, rank, config, dense, group, stats
        self.bound: Backend | None = None  # after the first bind: reused, with no estimation or exchange
        # kv_transfer="read": the withheld KV rows this layer's patterns read (runtime.sparse_kv), kept
        # with the bound backend; None where nothing is withheld.
        self.read: ReadSelection | None = None

    def _per_plan(self, kind, build, *key):
        """``build()`` once per plan (cached on it; every rank's options were compared with the plan in
        core_attention.dispatch_layout) for this rank, config and ``key``."""
        key = (kind, self.rank, self.config, *key)
        cache = self.plan.runtime_cache
        if key not in cache:
            cache[key] = build()
        return cache[key]

    def routes(self, num_heads: int, device) -> PatternRoutes:
        return self._per_plan("sparse_routes", lambda: PatternRoutes.build(self.plan, self.rank, num_heads,
                                                                           self.config, device),
                              num_heads, str(device))

    @torch.no_grad()
    def bind(self, q: torch.Tensor, q_srv: torch.Tensor, k_unique: torch.Tensor) -> Backend:
        """Estimate the documents whose last shard is served here, exchange, and bind the backend.

        ``q``: this rank's own queries (home side); ``q_srv``, ``k_unique``: the
        server's query buffer and unique KV buffer (runtime.core_attention). Every
        rank takes part in both exchanges whenever the plan has any, with or
        without documents of its own in them. A second call (a recompute of the same
        layer, on every rank alike) returns the first call's backend."""
        if self.bound is None:
            self.bound = self._bind(q, q_srv, k_unique)
        return self.bound

    def fetch_read_kv(self, k: torch.Tensor, v: torch.Tensor, k_unique: torch.Tensor, v_unique: torch.Tensor) -> None:
        """After ``bind``: fill the withheld rows the patterns read into the server's KV buffers (zeros in
        the other withheld rows); nothing where nothing is withheld (on every rank)."""
        if self.read is not None:
            self.read.place(self.read.fetch(k, v, self.group), k_unique, v_unique)

    def _bind(self, q: torch.Tensor, q_srv: torch.Tensor, k_unique: torch.Tensor) -> Backend:
        r = self.routes(q_srv.shape[1], q_srv.device)
        extra = [q[r.extra_local_rows]]
        if r.extra_exchange:
            width = q.shape[1] * q.shape[2]
            received = all_to_all_flat(q[r.extra_send_rows].reshape(-1), [x * width for x in r.extra_send_splits],
                                       [x * width for x in r.extra_recv_splits], self.group, tag="sparse_queries")
            extra.append(received.view(-1, *q.shape[1:]))
        pattern = None
        if len(r.est_docs):
            q_est = torch.cat([q_srv[r.tail_rows], *extra])[r.est_q_index]
            # Scores in float32 whatever the caller's autocast: the selection ranks small masses.
            with torch.autocast(q.device.type, enabled=False):
                pattern = estimate_vertical_slash(q_est, r.est_k_rows.take(k_unique), r.est_cu_q, r.est_cu_k, self.config,
                                                  k_lens_host=r.est_lens)
        if self.stats is not None:
            self.stats.add(pattern, r.dense_pairs)
        if r.exchange:
            own = q.new_empty(0, dtype=torch.int32) if pattern is None else r.own_pack.pack(pattern, r.est_index)
            received = all_to_all_flat(own[r.send_words], r.send_splits, r.recv_splits, self.group,
                                       tag="sparse_pattern")
            if r.served_words is not None:
                pattern = r.served_pack.unpack(torch.cat([own, received])[r.served_words])
        if self.config.kv_transfer == "read":
            read = self._per_plan("sparse_read_routes",
                                  lambda: ReadRoutes.build(self.plan, self.rank, self.config, q.device), str(q.device))
            if read.active:
                self.read = ReadSelection.select(read, pattern, self.group)
        if self.stats is not None:
            self.stats.add_served(pattern if len(r.served_lens) else None, r, self.config.vertical_chunk)
        backend = served_backend(pattern, r, self.dense, self.config)
        return backend if self.stats is None else self.stats.timed(backend)
