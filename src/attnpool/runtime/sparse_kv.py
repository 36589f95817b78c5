"""Send a sparse CA-task only the KV rows its pattern reads (``SparseConfig(kv_transfer="read")``).

By default the dispatch sends every CA-task its whole KV prefix. With ``"read"``
the dispatch withholds, for every sparse document, the remote prefix rows bound
for servers other than the document's estimating server: that one needs every
key to estimate, the others only what their tasks' patterns read. Once a server
holds its documents' patterns (runtime.sparse), per sparse layer:

1. the server marks each withheld row that some head attends from some of its
   tasks of that document (``VerticalSlashPattern.keys_read``) and sends the marks
   to the rows' home ranks, one byte per row (sizes known from the plan);
2. both sides count the marked rows per peer: one host read of 2 x ranks numbers;
3. the homes send the marked K and V rows, which fill the server's KV buffer.
   Backward sends their gradients home the same way.

The withheld rows never read are zeroed in the server's buffer: the Triton
kernels never use them, but the CPU twin multiplies masked probabilities by
every value row. A layer's marks and counts are kept for its
activation-checkpointing recompute, which repeats step 3 only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from attnpool.comm import all_to_all_flat
from attnpool.plan.documents import ranges
from attnpool.plan.plan import Plan
from attnpool.runtime.dispatch import index_tensor
from attnpool.sparse import SparseConfig, VerticalSlashPattern


def estimating_servers(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """Per plan document: the server of its task that ends at the document's end (it holds the whole
    KV prefix and estimates the pattern), and that task's index; -1 for documents without tasks."""
    doc_len = plan.pieces.doc_len
    last = np.flatnonzero(plan.task_end == doc_len[plan.task_doc])
    est_server = np.full(len(doc_len), -1, dtype=np.int64)
    last_task = np.full(len(doc_len), -1, dtype=np.int64)
    est_server[plan.task_doc[last]] = plan.task_server[last]
    last_task[plan.task_doc[last]] = last
    return est_server, last_task


def withheld_segments(plan: Plan, config: SparseConfig) -> np.ndarray:
    """Bool per segment of ``plan.kv_transfers()``: remote KV of a sparse document bound for a server
    that does not estimate it. Cached on the plan."""
    key = ("withheld_kv", config.min_doc_len)
    if key not in plan.runtime_cache:
        x = plan.kv_transfers()
        est_server, _ = estimating_servers(plan)
        sparse_doc = plan.pieces.doc_len >= config.min_doc_len
        plan.runtime_cache[key] = (x.src != x.server) & sparse_doc[x.doc] & (x.server != est_server[x.doc])
    return plan.runtime_cache[key]


@dataclass(frozen=True, eq=False)
class ReadRoutes:
    """Host-built maps of one (plan, rank, config) for the withheld KV rows."""

    active: bool  # some row is withheld somewhere (a plan property: equal on every rank)
    # As a home: my local rows that servers withheld, grouped by server, (doc, position) order within.
    home_rows: torch.Tensor
    home_peer: torch.Tensor  # the server of each
    home_splits: list[int]
    # As a server: the withheld rows of my unique KV buffer, grouped by home, (doc, position) order within.
    server_pos: torch.Tensor
    server_peer: torch.Tensor  # the home of each
    server_splits: list[int]
    # (withheld row, task of mine of its document) pairs with the row inside the task's prefix.
    pair_row: torch.Tensor
    pair_doc: torch.Tensor  # served sparse document (index into the served pattern)
    pair_q_first: torch.Tensor  # the task's query positions [q_first, q_last]
    pair_q_last: torch.Tensor
    pair_key: torch.Tensor  # the row's document position
    served_tokens: int  # sum of the served sparse documents' lengths
    world: int

    @classmethod
    def build(cls, plan: Plan, rank: int, config: SparseConfig, device) -> "ReadRoutes":
        W = plan.num_ranks
        t, x = plan.pieces, plan.kv_transfers()
        withheld = withheld_segments(plan, config)

        out = np.flatnonzero(withheld & (x.src == rank))  # x is sorted by (server, doc, start)
        home_rows = ranges(x.src_row[out], x.length[out])
        home_splits = np.bincount(x.server[out], weights=x.length[out], minlength=W).astype(np.int64).tolist()

        seg = np.flatnonzero(x.server == rank)  # my unique KV buffer, segment by segment
        seg_pos = np.cumsum(x.length[seg]) - x.length[seg]
        inc = np.flatnonzero(withheld[seg])
        inc = inc[np.argsort(x.src[seg[inc]], kind="stable")]
        n = x.length[seg[inc]]
        server_pos = ranges(seg_pos[inc], n)
        server_splits = np.bincount(x.src[seg[inc]], weights=n, minlength=W).astype(np.int64).tolist()
        row_key = ranges(x.start[seg[inc]], n)
        row_doc = np.repeat(x.doc[seg[inc]], n)

        # Served sparse documents in document order: the order of the served pattern (runtime.sparse).
        sparse_doc = t.doc_len >= config.min_doc_len
        groups = np.flatnonzero(x.group_server == rank)
        served = x.group_doc[groups][sparse_doc[x.group_doc[groups]]]
        # Every task of mine of each withheld row's document (canonical order groups them by document).
        mine = np.flatnonzero(plan.task_server == rank)
        first = np.searchsorted(plan.task_doc[mine], row_doc, side="left")
        count = np.searchsorted(plan.task_doc[mine], row_doc, side="right") - first
        pair_row = np.repeat(np.arange(len(row_doc)), count)
        pair_task = mine[np.repeat(first, count) + (np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count))]
        keep = row_key[pair_row] < plan.task_end[pair_task]
        pair_row, pair_task = pair_row[keep], pair_task[keep]

        dev = functools.partial(index_tensor, device=device)
        return cls(
            active=bool(withheld.any()),
            home_rows=dev(home_rows), home_peer=dev(np.repeat(x.server[out], x.length[out])), home_splits=home_splits,
            server_pos=dev(server_pos), server_peer=dev(np.repeat(x.src[seg[inc]], n)), server_splits=server_splits,
            pair_row=dev(pair_row), pair_doc=dev(np.searchsorted(served, row_doc[pair_row])),
            pair_q_first=dev(plan.task_start[pair_task]), pair_q_last=dev(plan.task_end[pair_task] - 1),
            pair_key=dev(row_key[pair_row]), served_tokens=int(t.doc_len[served].sum()), world=W,
        )


@dataclass(frozen=True, eq=False)
class ReadSelection:
    """The withheld rows one sparse layer's patterns read, both ways."""

    home_rows: torch.Tensor  # my local rows to send, grouped by server
    send_counts: list[int]
    server_pos: torch.Tensor  # the unique-KV positions the received rows fill, grouped by home
    recv_counts: list[int]
    withheld_pos: torch.Tensor  # every withheld position of the server's unique KV buffer

    @classmethod
    def select(cls, routes: ReadRoutes, pattern: VerticalSlashPattern | None, group) -> "ReadSelection":
        """Mark, exchange marks, count (the one host read). Every rank calls it when ``routes.active``."""
        r = routes
        hits = torch.zeros(r.server_pos.numel(), dtype=torch.int32, device=r.server_pos.device)
        if r.pair_row.numel():  # rows withheld here imply served sparse documents, hence a pattern
            hit = pattern.keys_read(r.pair_doc, r.pair_q_first, r.pair_q_last, r.pair_key, r.served_tokens)
            hits.index_add_(0, r.pair_row, hit.to(torch.int32))
        marks = (hits > 0).to(torch.uint8)
        wanted = all_to_all_flat(marks, r.server_splits, r.home_splits, group, tag="sparse_kv_marks")
        counts = torch.zeros(2, r.world, dtype=torch.int64, device=marks.device)
        counts[0].index_add_(0, r.home_peer, wanted.to(torch.int64))
        counts[1].index_add_(0, r.server_peer, marks.to(torch.int64))
        send_counts, recv_counts = counts.cpu().tolist()  # the host read; the selections below follow it
        return cls(r.home_rows[wanted.bool()], send_counts, r.server_pos[marks.bool()], recv_counts, r.server_pos)

    def fetch(self, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
        """The selected K and V rows from their homes: (rows, 2, kv_heads, head_dim), grouped by home."""
        width = 2 * k.shape[1] * k.shape[2]
        send = torch.stack([k[self.home_rows], v[self.home_rows]], 1).reshape(-1)
        received = all_to_all_flat(send, [n * width for n in self.send_counts], [n * width for n in self.recv_counts],
                                   group, tag="sparse_kv")
        return received.view(-1, 2, k.shape[1], k.shape[2])

    def place(self, rows: torch.Tensor, k_unique: torch.Tensor, v_unique: torch.Tensor) -> None:
        """Write the fetched rows (``fetch``) into the server's unique KV buffers, zeros in the other withheld rows."""
        k_unique[self.withheld_pos] = 0
        v_unique[self.withheld_pos] = 0
        k_unique[self.server_pos] = rows[:, 0]
        v_unique[self.server_pos] = rows[:, 1]

    def return_grads(self, dk_unique: torch.Tensor, dv_unique: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                     group) -> None:
        """Send the selected rows' gradients home and add the ones received to ``dk``, ``dv``."""
        width = 2 * dk.shape[1] * dk.shape[2]
        send = torch.stack([dk_unique[self.server_pos], dv_unique[self.server_pos]], 1).reshape(-1)
        received = all_to_all_flat(send, [n * width for n in self.recv_counts], [n * width for n in self.send_counts],
                                   group, tag="sparse_kv_grad").view(-1, 2, dk.shape[1], dk.shape[2])
        dk.index_add_(0, self.home_rows, received[:, 0])
        dv.index_add_(0, self.home_rows, received[:, 1])
