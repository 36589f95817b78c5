"""The Plan: every query shard (CA-task) of the batch, with its home rank and its server rank.

A CA-task is query tokens [start, end) of one document, inside one piece (so its
query tokens live contiguously on one home rank), served by ``server`` over the
document's causal KV prefix [0, end), or under a sliding window of w keys (a plan of a
windowed layer kind, ``Plan.window``) over keys [max(0, start - w + 1), end): the window's
KV, not the whole prefix. Every scheduler returns this one type.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from attnpool.plan.documents import PieceTable, key_start


@dataclass(frozen=True)
class AttentionShape:
    """Head configuration and element size: what a token's Q, K+V and O weigh on the wire."""

    n_q_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2

    @property
    def q_bytes(self) -> int:
        return self.n_q_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes(self) -> int:
        return 2 * self.n_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def o_bytes(self) -> int:
        return self.q_bytes


# A byte between nodes against one inside a node: NCCL's all-to-all at 260 GiB/s per rank over NVLink (2 x H200,
# measured) against the 50 GB/s per GPU the DistCA paper assumes between nodes.
NVLINK_GIBPS = 260.0
PAPER_INTER_NODE_GIBPS = 50e9 / 2**30
INTER_NODE_BYTE_COST = NVLINK_GIBPS * 2**30 / 50e9


def inter_node_byte_cost(intra_gibps: float | None = None, inter_gibps: float | None = None) -> float:
    """What a byte between nodes costs against one inside a node: the links' ratio, GiB/s per GPU each, NVLink's
    measured rate inside a node and the DistCA paper's 50 GB/s between nodes where not given
    (:data:`INTER_NODE_BYTE_COST` where neither is)."""
    if intra_gibps is None and inter_gibps is None:
        return INTER_NODE_BYTE_COST
    return (intra_gibps or NVLINK_GIBPS) / (inter_gibps or PAPER_INTER_NODE_GIBPS)


@dataclass(frozen=True)
class Topology:
    """Which node each rank of the group is on, what a byte between nodes costs the planner against one
    inside a node (the ratio of their bandwidths), and whether KV goes through the hierarchical exchange
    (``relays``: KV a node's servers need from another node crosses once, :meth:`KVTransfers.relays`)."""

    rank_node: tuple[int, ...]
    inter_node_byte_cost: float = INTER_NODE_BYTE_COST
    relays: bool = False

    @classmethod
    def of(cls, ranks: int, ranks_per_node: int, inter_node_byte_cost: float = INTER_NODE_BYTE_COST,
           relays: bool = False) -> "Topology":
        """``ranks`` consecutive ranks, ``ranks_per_node`` to a node."""
        return cls(tuple(r // ranks_per_node for r in range(ranks)), inter_node_byte_cost, relays)

    @property
    def num_nodes(self) -> int:
        return len(set(self.rank_node))


@dataclass(frozen=True, eq=False)
class Plan:
    strategy: str
    pieces: PieceTable
    task_doc: np.ndarray  # (S,) dense doc index
    task_start: np.ndarray  # (S,) first query token (document coordinates)
    task_end: np.ndarray  # (S,) one past the last query token; KV prefix is [0, end)
    task_piece: np.ndarray  # (S,) index into pieces
    task_server: np.ndarray  # (S,) rank that computes the task
    min_shard_tokens: int
    options: dict = field(default_factory=dict)
    plan_seconds: float = 0.0
    window: int | None = None  # the sliding window (keys) of the layers this plan serves; None: causal
    # Derived from the plan and kept with it (not part of its content): the KV transfers, and
    # the per-rank dispatch layouts the runtime builds.
    runtime_cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_ranks(self) -> int:
        return self.pieces.num_ranks

    @property
    def num_tasks(self) -> int:
        return len(self.task_doc)

    @property
    def task_len(self) -> np.ndarray:
        return self.task_end - self.task_start

    @property
    def task_home(self) -> np.ndarray:
        return self.pieces.rank[self.task_piece]

    @property
    def task_key_start(self) -> np.ndarray:
        """The first key of each task: 0, or under a sliding window the window's first."""
        return key_start(self.task_start, self.window)

    @property
    def task_home_offset(self) -> np.ndarray:
        """Offset of the task's first query token in its home rank's buffer."""
        p = self.task_piece
        return self.pieces.offset[p] + (self.task_start - self.pieces.start[p])

    def fingerprint(self) -> str:
        """SHA-256 of the plan's content; equal on every rank iff the plans are identical."""
        h = hashlib.sha256()
        h.update(f"{self.strategy}|{self.num_ranks}|{self.min_shard_tokens}|{self.window}|".encode())
        t = self.pieces
        for arr in (t.doc_ids, t.doc_len, t.rank, t.doc, t.start, t.length,
                    self.task_doc, self.task_start, self.task_end, self.task_piece, self.task_server):
            h.update(np.ascontiguousarray(arr, dtype="<i8").tobytes())
            h.update(b"|")
        return h.hexdigest()

    def kv_transfers(self) -> "KVTransfers":
        """The unique KV segments every server needs (computed once per plan)."""
        if "kv_transfers" not in self.runtime_cache:
            self.runtime_cache["kv_transfers"] = kv_transfers(self)
        return self.runtime_cache["kv_transfers"]

    @property
    def head_parallel(self) -> bool:
        """Whether every rank computes every document on a share of the heads (``ulysses``, plan.ulysses),
        rather than each task whole on its server."""
        return self.strategy == "ulysses"

    def is_fully_local(self) -> bool:
        """True when no token crosses the network: no Q, KV or O leaves its rank."""
        if self.head_parallel:
            return self.num_ranks == 1
        if np.any(self.task_server != self.task_home):
            return False
        x = self.kv_transfers()
        return not np.any(x.src != x.server)

    def server_tasks(self, server: int) -> np.ndarray:
        """Indices of the tasks a server runs, in canonical (doc, start) order."""
        return np.flatnonzero(self.task_server == server)

    def kernel_segments(self, server: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document, query length, key length) of each segment of the server's kernel call, in task order.

        A segment is a CA-task, or a run of tasks adjacent in the server's canonical order where each
        starts at the document position the previous one ends (shards of different pieces that the
        planner put on one server): their queries are consecutive rows of the server's Q buffer and
        consecutive positions [a, e), so one causal segment over keys [0, e) (under a window, from the
        window's first key of a) computes them all and their shared keys are expanded once, not once per
        task (bench/kv_expansion.py)."""
        doc, start, end = self.kernel_spans(server)
        return doc, end - start, end - key_start(start, self.window)

    def kernel_spans(self, server: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document, first query, one past the last query) of each segment of the server's kernel call
        (:meth:`kernel_segments`), in task order."""
        mine = self.server_tasks(server)
        if not len(mine):
            return (np.zeros(0, dtype=np.int64),) * 3
        doc, start, end = self.task_doc[mine], self.task_start[mine], self.task_end[mine]
        first = np.flatnonzero(np.r_[True, (doc[1:] != doc[:-1]) | (start[1:] != end[:-1])])
        last = np.r_[first[1:], len(mine)] - 1
        return doc[first], start[first], end[last]


@dataclass(frozen=True, eq=False)
class KVTransfers:
    """The unique KV each server needs, as segments of pieces.

    A server needs, of each document it serves, the keys of its tasks there: [0, kv_end) for causal
    attention, kv_end the largest task end of that doc on that server. Under a sliding window each task
    needs [key_start, end) only, and those ranges, merged where they overlap or touch, may be several
    per document (a document's head and tail on one server): one group per (server, doc, range),
    [group_kv_start, group_kv_end). Each piece overlapping a group's range gives one segment
    [start, start + length) (document coordinates) sent from the piece's rank ``src`` (no transfer when
    ``src == server``). Sorted by (server, doc, start): this is the order of the server's unique KV buffer.
    """

    server: np.ndarray
    doc: np.ndarray
    piece: np.ndarray
    src: np.ndarray
    start: np.ndarray
    length: np.ndarray
    src_row: np.ndarray  # the segment's first row in its source rank's tokens
    # per (server, doc, range) group, sorted by (server, doc, start):
    group_server: np.ndarray
    group_doc: np.ndarray
    group_kv_start: np.ndarray
    group_kv_end: np.ndarray

    @property
    def group_len(self) -> np.ndarray:
        """Each group's KV rows in the server's unique buffer."""
        return self.group_kv_end - self.group_kv_start

    def relays(self, rank_node) -> np.ndarray:
        """For every segment, the segment that relays it in a hierarchical exchange (-1: none; it is sent from its
        source). ``rank_node``: each rank's node. Among the segments of one piece bound for servers of one other
        node, the longest crosses between the nodes; each other one whose rows it holds is forwarded inside the node
        by that server. Where several are longest (servers that need the whole piece), the relay rotates with the
        piece's index, so that the pieces of one document do not all land on one relay, whose link would forward
        every one of them (sim.steptime charges it). (Causal prefixes of one piece nest, so with no sliding
        window every such segment is relayed; windowed ranges that do not nest are sent as before.)"""
        node = np.asarray(rank_node, dtype=np.int64)
        relay_of = np.full(len(self.src), -1, dtype=np.int64)
        remote = np.flatnonzero(node[self.src] != node[self.server])
        if not len(remote):
            return relay_of
        piece, dest = self.piece[remote], node[self.server[remote]]
        order = np.lexsort((self.server[remote], -self.length[remote], dest, piece))
        member, piece, dest = remote[order], piece[order], dest[order]
        first = np.r_[True, (piece[1:] != piece[:-1]) | (dest[1:] != dest[:-1])]
        group, start = np.cumsum(first) - 1, np.flatnonzero(first)
        # each group's longest segments lead it (lowest server first); the piece's index picks one of them
        ties = np.bincount(group, weights=self.length[member] == self.length[member[start]][group]).astype(np.int64)
        relay = member[start + piece[start] % ties][group]
        nested = ((self.src_row[member] >= self.src_row[relay])
                  & (self.src_row[member] + self.length[member] <= self.src_row[relay] + self.length[relay])
                  & (self.server[member] != self.server[relay]))
        relay_of[member[nested]] = relay[nested]
        return relay_of

    def senders(self, rank_node=None) -> np.ndarray:
        """Each segment's sender: its source rank, or under the hierarchical exchange (``rank_node``: each rank's
        node) the server that relays it, where one does (:meth:`relays`)."""
        if rank_node is None:
            return self.src
        relay_of = self.relays(rank_node)
        return np.where(relay_of >= 0, self.server[np.maximum(relay_of, 0)], self.src)


def inter_node_bytes(plan: "Plan", rank_node, shape: AttentionShape, relays: bool = False) -> float:
    """The bytes a plan's forward exchanges send between nodes (``rank_node``: each rank's node): Q out and O back
    of every task served off its home node, and the KV segments whose sender is on another node than their
    server; with ``relays`` (the hierarchical exchange) a relayed segment is sent from its relay."""
    node = np.asarray(rank_node, dtype=np.int64)
    moved = node[plan.task_home] != node[plan.task_server]
    x = plan.kv_transfers()
    crossing = node[x.senders(node if relays else None)] != node[x.server]
    return float(plan.task_len[moved].sum() * (shape.q_bytes + shape.o_bytes) + x.length[crossing].sum() * shape.kv_bytes)


def exchange_directions(plan: "Plan", shape: AttentionShape, topology: Topology | None = None) -> np.ndarray:
    """Per server (columns), the bytes of a plan's forward exchanges by direction (rows): Q and KV out (sent, received),
    then O back (sent, received), as the cad planner prices them: a byte between nodes counted
    ``topology.inter_node_byte_cost`` times; under ``topology.relays`` a relayed segment sent from its relay."""
    W = plan.num_ranks
    remote = plan.task_server != plan.task_home
    q = np.where(remote, plan.task_len, 0).astype(np.float64)
    x = plan.kv_transfers()
    nodes = None if topology is None or topology.num_nodes == 1 else np.asarray(topology.rank_node, dtype=np.int64)
    senders = x.senders(nodes if nodes is not None and topology.relays else None)
    kv = np.where(senders != x.server, x.length, 0).astype(np.float64) * shape.kv_bytes
    if nodes is not None:
        q = np.where(nodes[plan.task_home] != nodes[plan.task_server], q * topology.inter_node_byte_cost, q)
        kv = np.where(nodes[senders] != nodes[x.server], kv * topology.inter_node_byte_cost, kv)
    by = lambda ranks, weights: np.bincount(ranks, weights=weights, minlength=W)  # noqa: E731
    return np.stack([by(plan.task_home, q * shape.q_bytes) + by(senders, kv),
                     by(plan.task_server, q * shape.q_bytes) + by(x.server, kv),
                     by(plan.task_server, q * shape.o_bytes), by(plan.task_home, q * shape.o_bytes)])


def server_exchange_bytes(plan: "Plan", shape: AttentionShape, topology: Topology | None = None) -> np.ndarray:
    """Per server: the bytes of a plan's forward exchanges as they hold its link, each all-to-all as long as the larger
    of what the server sends and receives in it (as attnpool.sim prices a collective): out, then back
    (:func:`exchange_directions`)."""
    return exchange_time_bytes(exchange_directions(plan, shape, topology))


def exchange_time_bytes(directions: np.ndarray) -> np.ndarray:
    """Per server, from :func:`exchange_directions`' rows: the larger of sent and received out, plus the same back."""
    return np.maximum(directions[0], directions[1]) + np.maximum(directions[2], directions[3])


def kv_transfers(plan: Plan) -> KVTransfers:
    t = plan.pieces
    D = t.num_docs
    # Every task's key range, sorted by (server, doc, start); ranges of one (server, doc) that overlap or
    # touch merge into one group (a task's range starts where the running end of its block's ranges is).
    ks = plan.task_key_start
    order = np.lexsort((ks, plan.task_doc, plan.task_server))
    block = (plan.task_server * D + plan.task_doc)[order]
    start, end = ks[order], plan.task_end[order]
    span = int(end.max(initial=0)) + 1
    running_end = np.maximum.accumulate(block * span + end) - block * span  # within its block: the key offsets
    new_block = np.r_[True, block[1:] != block[:-1]]
    first = np.flatnonzero(new_block | np.r_[False, start[1:] > running_end[:-1]])
    last = np.r_[first[1:], len(order)] - 1
    g_server, g_doc = block[first] // max(D, 1), block[first] % max(D, 1)
    kv_start, kv_end = start[first], running_end[last]
    # Pieces sorted by (doc, start); each doc's pieces are a contiguous range.
    porder = np.lexsort((t.start, t.doc))
    pdoc = t.doc[porder]
    doc_first = np.searchsorted(pdoc, np.arange(D), side="left")
    count = np.searchsorted(pdoc, np.arange(D), side="right") - doc_first
    # Expand every group to all pieces of its doc, then keep the overlapping ones.
    n = count[g_doc]
    grp = np.repeat(np.arange(len(first)), n)
    within = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
    piece = porder[doc_first[g_doc][grp] + within]
    seg_start = np.maximum(t.start[piece], kv_start[grp])
    seg_end = np.minimum(t.start[piece] + t.length[piece], kv_end[grp])
    keep = seg_end > seg_start
    grp, piece, seg_start, seg_end = grp[keep], piece[keep], seg_start[keep], seg_end[keep]
    return KVTransfers(
        server=g_server[grp], doc=g_doc[grp], piece=piece, src=t.rank[piece],
        start=seg_start, length=seg_end - seg_start, src_row=t.offset[piece] + (seg_start - t.start[piece]),
        group_server=g_server, group_doc=g_doc, group_kv_start=kv_start, group_kv_end=kv_end,
    )


def canonical_tasks(doc, start, end, piece, server) -> tuple[np.ndarray, ...]:
    """Tasks (doc, start, end, piece, server) in canonical order (doc, start), contiguous tasks of one piece
    that share a server merged (they are one shard): the tasks a Plan holds, and so the ones costed."""
    doc, start, end, piece, server = (np.asarray(x, dtype=np.int64) for x in (doc, start, end, piece, server))
    order = np.lexsort((start, doc))
    doc, start, end, piece, server = doc[order], start[order], end[order], piece[order], server[order]
    joins = np.r_[False, (doc[1:] == doc[:-1]) & (piece[1:] == piece[:-1]) & (server[1:] == server[:-1]) & (start[1:] == end[:-1])]
    if joins.any():
        head = np.flatnonzero(~joins)
        last = np.r_[head[1:], len(doc)] - 1
        doc, start, piece, server = doc[head], start[head], piece[head], server[head]
        end = end[last]
    return doc, start, end, piece, server


def make_plan(strategy: str, pieces: PieceTable, doc, start, end, piece, server, min_shard_tokens: int,
              options: dict | None = None, plan_seconds: float = 0.0, window: int | None = None) -> Plan:
    """Build a Plan with tasks in canonical order (doc, start), merging contiguous tasks
    of one piece that share a server (they are one shard)."""
    doc, start, end, piece, server = canonical_tasks(doc, start, end, piece, server)
    return Plan(strategy, pieces, doc, start, end, piece, server, int(min_shard_tokens), dict(options or {}), plan_seconds,
                None if window is None else int(window))
