"""Plan metrics: balance, bytes on the wire, KV memory, shard sizes and planning time, in one object."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from attnpool.plan.cost import doc_costs, for_window
from attnpool.plan.plan import AttentionShape, Plan
from attnpool.plan.ulysses import ulysses_loads, ulysses_rows, ulysses_traffic

SHARD_HISTOGRAM_EDGES = (1, 128, 256, 512, 1024, 4096, 16384, 65536, 2**62)


def shard_histogram(lengths: np.ndarray) -> dict[str, int]:
    counts, _ = np.histogram(lengths, bins=SHARD_HISTOGRAM_EDGES)
    labels = [f"<{e}" for e in SHARD_HISTOGRAM_EDGES[1:-1]] + [f">={SHARD_HISTOGRAM_EDGES[-2]}"]
    return dict(zip(labels, counts.tolist()))


def imbalance(loads) -> float:
    """max / mean of per-server loads (1.0 when there is no work)."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = float(loads.mean())
    return float(loads.max() / mean) if mean > 0 else 1.0


def home_loads(table, cost_model, window: int | None = None) -> np.ndarray:
    """Per-rank work if every piece were served at home (the `local` strategy), under a sliding window of
    ``window`` keys where one is given."""
    cost, _ = doc_costs(for_window(cost_model, window))
    return np.bincount(table.rank, weights=cost(table.start, table.end, table.doc), minlength=table.num_ranks)


def server_loads(plan: Plan, cost_model) -> np.ndarray:
    """Per-server work under a plan."""
    if plan.head_parallel:
        return ulysses_loads(plan, for_window(cost_model, plan.window))
    cost, _ = doc_costs(for_window(cost_model, plan.window))
    return np.bincount(plan.task_server, weights=cost(plan.task_start, plan.task_end, plan.task_doc),
                       minlength=plan.num_ranks)


def work_moved(plan: Plan, cost_model) -> tuple[float, float]:
    """(work served away from home, work the ranks hold above their mean at home): what a plan moves against the
    least any plan that balances to the mean must move. cad's greedy donates only a server's excess over the mean
    (plan.cad), so the first is close to the second where it could cut shards to fit."""
    if plan.head_parallel:
        raise ValueError("work_moved counts CA-tasks served away from home; a ulysses plan splits heads, not tasks")
    cost, _ = doc_costs(for_window(cost_model, plan.window))
    before = home_loads(plan.pieces, cost_model, plan.window)
    remote = plan.task_server != plan.task_home
    moved = float(cost(plan.task_start[remote], plan.task_end[remote], plan.task_doc[remote]).sum())
    return moved, float(np.maximum(before - before.mean(), 0.0).sum())


@dataclass
class PlanMetrics:
    strategy: str
    num_servers: int
    cost_unit: str
    load_before: list[float]  # per server, every piece served at home
    load_after: list[float]  # per server, under this plan
    imbalance_before: float  # max / mean
    imbalance_after: float
    q_bytes_out: list[int]  # per rank: query tokens sent to other servers
    kv_bytes_out: list[int]  # per rank: KV sent, once per destination
    o_bytes_back: list[int]  # per rank (as server): outputs returned to homes
    bytes_moved: int  # all of the above, summed over ranks
    kv_tokens_unique: list[int]  # per server: KV tokens held, each once
    kv_tokens_expanded: list[int]  # per server: sum of task prefixes (a copy per shard, as DistCA keeps;
    # the runtime's kernel call expands less: Plan.kernel_segments)
    max_kv_tokens: int
    num_shards: int
    min_shard_tokens: int  # smallest shard in the plan
    shard_histogram: dict[str, int]
    plan_ms: float
    # The forward exchanges' bytes between nodes (plan.plan.inter_node_bytes) where the servers are on several
    # nodes: set by who knows the nodes (`attnpool plan --ranks-per-node`); None otherwise
    inter_node_bytes: int | None = None

    @classmethod
    def of(cls, plan: Plan, cost_model, shape: AttentionShape = AttentionShape(),
           relay_nodes=None) -> "PlanMetrics":
        """``relay_nodes``: each rank's node, where KV goes through the hierarchical exchange (a relayed segment is
        then sent by its relay: KVTransfers.senders)."""
        W = plan.num_ranks
        t = plan.pieces
        before, after = home_loads(t, cost_model, plan.window), server_loads(plan, cost_model)
        if plan.head_parallel:  # KV tokens: every token's, on the rank's share of the heads
            q_out, kv_out, o_back = ulysses_traffic(plan, shape)
            unique = expanded = np.full(W, int(t.tokens_per_rank.sum()), dtype=np.int64)
        else:
            remote = plan.task_server != plan.task_home
            qlen = np.where(remote, plan.task_len, 0)
            q_out = np.bincount(plan.task_home, weights=qlen, minlength=W).astype(np.int64) * shape.q_bytes
            o_back = np.bincount(plan.task_server, weights=qlen, minlength=W).astype(np.int64) * shape.o_bytes
            x = plan.kv_transfers()
            senders = x.senders(relay_nodes)
            sent = np.where(senders != x.server, x.length, 0)
            kv_out = np.bincount(senders, weights=sent, minlength=W).astype(np.int64) * shape.kv_bytes
            unique = np.bincount(x.group_server, weights=x.group_len, minlength=W).astype(np.int64)
            expanded = np.bincount(plan.task_server, weights=plan.task_end - plan.task_key_start,
                                   minlength=W).astype(np.int64)
        return cls(
            strategy=plan.strategy, num_servers=W, cost_unit=getattr(cost_model, "unit", "work"),
            load_before=before.tolist(), load_after=after.tolist(),
            imbalance_before=imbalance(before), imbalance_after=imbalance(after),
            q_bytes_out=q_out.tolist(), kv_bytes_out=kv_out.tolist(), o_bytes_back=o_back.tolist(),
            bytes_moved=int(q_out.sum() + kv_out.sum() + o_back.sum()),
            kv_tokens_unique=unique.tolist(), kv_tokens_expanded=expanded.tolist(),
            max_kv_tokens=int(unique.max()), num_shards=plan.num_tasks,
            min_shard_tokens=int(plan.task_len.min()), shard_histogram=shard_histogram(plan.task_len),
            plan_ms=plan.plan_seconds * 1e3,
        )

    def summary(self) -> dict:
        """The scalar fields (what `attnpool plan --json` prints per strategy)."""
        keys = ("strategy", "num_servers", "imbalance_before", "imbalance_after", "plan_ms", "bytes_moved",
                "max_kv_tokens", "num_shards", "min_shard_tokens", "shard_histogram")
        out = {k: getattr(self, k) for k in keys}
        out["max_bytes_per_rank"] = int(max(q + k + o for q, k, o in zip(self.q_bytes_out, self.kv_bytes_out, self.o_bytes_back)))
        out["max_kv_tokens_expanded"] = int(max(self.kv_tokens_expanded))
        if self.inter_node_bytes is not None:
            out["inter_node_bytes"] = self.inter_node_bytes
        return out

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        s = self.summary()
        return (f"{self.strategy}: {self.num_servers} servers, max/mean {self.imbalance_before:.3f} -> "
                f"{self.imbalance_after:.3f}, {s['bytes_moved'] / 2**30:.2f} GiB moved "
                f"(max {s['max_bytes_per_rank'] / 2**20:.1f} MiB/rank), max KV {self.max_kv_tokens} tokens "
                f"({s['max_kv_tokens_expanded']} with a copy per shard), {self.num_shards} shards "
                f"(smallest {self.min_shard_tokens}), planned in {self.plan_ms:.1f} ms")


@dataclass(frozen=True)
class AttentionRows:
    """Per rank, the rows core attention holds under a plan (what its memory depends on):
    ``home`` tokens (the rank's layer activations), ``query`` rows it serves (its Q buffer, its
    LSE), ``returned`` of them served for other ranks (their outputs, kept for backward),
    ``unique_kv`` rows it holds (each once) and ``expanded_kv`` rows its kernel calls read: the unique rows
    (the runtime copies none, but where few, runtime.dispatch.MIN_AVOIDED_KEYS_PER_CALL, which this leaves
    uncounted), plus three times the most keys of a segment other than its document's widest, among the
    documents of two to ``causal_call_segments`` segments on the server (the runtime serves those as a causal
    call per segment, which makes that segment's dK and dV apart in backward, in the kernel's dtype, and sums
    them in float32, twice a half-precision row: runtime.dispatch.DocumentServing, MAX_CAUSAL_CALL_SEGMENTS).
    With ``copies`` (a backend without a position kernel, kernels.serves_positions: flash, fa4 off sm90), a
    server with a document that takes one call at its queries' positions instead (more segments, or several
    under a sliding window) reads one prefix per kernel segment (Plan.kernel_segments), copies; any other server
    the larger of the two counts (:func:`_kernel_keys`); ``causal_call_segments`` 0: every server copies (the
    sparse serving)."""

    home: np.ndarray
    query: np.ndarray
    returned: np.ndarray
    unique_kv: np.ndarray
    expanded_kv: np.ndarray

    @classmethod
    def of(cls, plan: Plan, copies: bool = True, causal_call_segments: int = 0) -> "AttentionRows":
        if plan.head_parallel:
            return cls(**ulysses_rows(plan))
        W = plan.num_ranks
        remote = plan.task_server != plan.task_home
        x = plan.kv_transfers()
        unique_kv = np.bincount(x.server, weights=x.length, minlength=W).astype(np.int64)
        return cls(
            home=np.asarray(plan.pieces.tokens_per_rank, dtype=np.int64),
            query=np.bincount(plan.task_server, weights=plan.task_len, minlength=W).astype(np.int64),
            returned=np.bincount(plan.task_server, weights=np.where(remote, plan.task_len, 0), minlength=W).astype(np.int64),
            unique_kv=unique_kv,
            expanded_kv=np.array([_kernel_keys(plan, r, int(unique_kv[r]), copies, causal_call_segments)
                                  for r in range(W)], dtype=np.int64),
        )


def _kernel_keys(plan: Plan, server: int, unique: int, copies: bool, max_segments: int) -> int:
    """AttentionRows.expanded_kv of one server (see its docstring). Without a position kernel (``copies``), a server
    whose documents could all run as causal calls runs them so only where that avoids enough copies
    (runtime.dispatch.MIN_AVOIDED_KEYS_PER_CALL, MIN_AVOIDED_FRACTION, which this does not apply): the larger of
    the two counts. With one, where too few are avoided the runtime copies too, which this leaves uncounted."""
    doc, _, k_len = plan.kernel_segments(server)
    without = unique + 3 * _narrower_segment_keys(doc, k_len, max_segments)
    if not copies:
        return without
    copied = int(k_len.sum())
    return copied if _needs_position_calls(doc, max_segments, plan.window is not None) else max(copied, without)


def _needs_position_calls(doc: np.ndarray, max_segments: int, windowed: bool) -> bool:
    """Whether some document of a server's kernel segments (``doc``: each segment's) takes one call at its
    queries' positions rather than a causal call per segment: it has more than ``max_segments`` segments, or,
    under a sliding window, several (their windows may not share a first key; an upper bound). A backend without
    a position kernel copies there."""
    if len(doc) < 2:
        return False
    _, counts = np.unique(doc, return_counts=True)
    return bool(counts.max() > (1 if windowed else max_segments))


def _narrower_segment_keys(doc: np.ndarray, k_len: np.ndarray, max_segments: int) -> int:
    """The most keys of one of a server's kernel segments (``doc``, ``k_len``: each one's document and keys) that is
    not the widest of its document's, among its documents of at most ``max_segments`` segments (under a sliding
    window, where a document's segments may not share a first key and then take one position call, an upper
    bound)."""
    if len(doc) < 2 or max_segments < 2:
        return 0
    order = np.lexsort((-k_len, doc))  # by document, widest first
    doc, k_len = doc[order], k_len[order]
    _, inverse, counts = np.unique(doc, return_inverse=True, return_counts=True)
    narrower = np.r_[False, doc[1:] == doc[:-1]] & (counts[inverse] <= max_segments)
    return int(k_len[narrower].max(initial=0))
