"""Distributed core attention on gloo (2 and 4 processes) against a single-process float64 reference."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import zlib

import background
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnpool import ConfigError, DocPiece, core_attention, plan_attention
from attnpool.comm import comm_stats
from attnpool.kernels import reference as reference_kernels
from attnpool.plan import AttentionShape, linear_layout
from attnpool.runtime.core_attention import CoreAttention, dispatch_layout
from attnpool.sparse import SparseConfig
from dist_harness import run_distributed

STRATEGIES = ("local", "percp", "cad")
HEADS = {"gqa": (4, 2), "mha": (2, 2)}
HEAD_DIM = 16


def case_seed(case: str, heads: str) -> int:
    return zlib.crc32(f"{case}/{heads}".encode())  # hash() of a str differs between processes


def make_cases(world: int, scale: int = 2):
    """(name, pieces_per_rank) with every required feature: a document over every rank,
    a rank holding no tokens, odd lengths (``scale`` times shorter)."""
    rng = np.random.default_rng(world)
    lens = rng.integers(1, 2500 // scale, size=3 * world).tolist()
    lens.insert(len(lens) // 2, world * 700 // scale + 13)  # spans every rank
    cases = [("linear", linear_layout(lens, world))]
    short = rng.integers(1, 900 // scale, size=2 * world).tolist()
    empty_rank = linear_layout(short, world - 1) + [[]]
    cases.append(("empty-rank", [empty_rank[-1]] + empty_rank[:-1]))  # rank 0 holds nothing
    return cases


def global_inputs(pieces_per_rank, n_q, n_kv, seed):
    """Random q, k, v, upstream grad for every document, float64, identical on every rank."""
    docs = {}
    for pieces in pieces_per_rank:
        for p in pieces:
            docs[p.doc_id] = p.doc_len
    g = torch.Generator().manual_seed(seed)
    return {d: [torch.randn(L, h, HEAD_DIM, generator=g, dtype=torch.float64) for h in (n_q, n_kv, n_kv, n_q)]
            for d, L in sorted(docs.items())}


def local_rows(tensors, pieces, which):
    return torch.cat([tensors[p.doc_id][which][p.start:p.end] for p in pieces]) if pieces else \
        torch.zeros(0, *tensors[next(iter(tensors))][which].shape[1:], dtype=torch.float64)


def worker(rank, world, dtype_name, backward_group_keys=None, copies=False, relay_nodes=None, head_chunks=1,
           heads=None, segmented=None):
    """``copies``: the reference backend without its PositionKernel (as flash), so that a server with a document
    that would take a position call copies prefixes instead; else every server with split documents runs them in
    calls of their own, however few copies that avoids (these documents are short). ``relay_nodes``: each
    rank's node, for the hierarchical exchange. ``head_chunks``: each call in that many groups of heads.
    ``heads``: the (query, KV) head counts to run, by name (default HEADS). ``segmented``: whether such a
    document (here always of two segments) runs as a causal call per segment rather than one position call;
    default: on 4 ranks, not on 2, so that the reference checks both."""
    import attnpool.runtime.dispatch as dispatch
    from attnpool.runtime.core_attention import serves_documents

    # this process only (the harness runs every worker in its own, kept between calls: set on every call)
    dispatch.MIN_AVOIDED_KEYS_PER_CALL = dispatch.MIN_AVOIDED_FRACTION = 0
    dispatch.MAX_CAUSAL_CALL_SEGMENTS = 2 if (world == 4 if segmented is None else segmented) else 1
    backend = dataclasses.replace(reference_kernels.BACKEND, positions=None) if copies else None
    if backward_group_keys is not None:
        dispatch.BACKWARD_GROUP_KEYS = backward_group_keys
    dtype = getattr(torch, dtype_name)
    heads_run, results = heads, {}
    for case, pieces in make_cases(world):
        for strategy in STRATEGIES:
            plan = plan_attention(pieces, strategy, cost_model="pairs", min_shard_tokens=32)
            for heads, (n_q, n_kv) in (heads_run or HEADS).items():
                data = global_inputs(pieces, n_q, n_kv, seed=case_seed(case, heads))
                mine = pieces[rank]
                q, k, v, dout = (local_rows(data, mine, i).to(dtype) for i in range(4))
                for t in (q, k, v):
                    t.requires_grad_(True)
                comm_stats.reset()
                saved = []
                with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                    out = core_attention(q, k, v, plan, backend=backend, relay_nodes=relay_nodes,
                                         head_chunks=head_chunks)
                layout = dispatch_layout(plan, q, k, v, relay_nodes=relay_nodes)
                served = serves_documents(layout, backend or reference_kernels.BACKEND, q)  # no prefix copies
                out.backward(dout)
                results[(case, strategy, heads)] = dict(
                    out=out.detach().double(), dq=q.grad.double(), dk=k.grad.double(), dv=v.grad.double(),
                    stats={t: list(v) for t, v in comm_stats.by_tag.items()}, calls=comm_stats.calls,
                    kv_sent=layout.kv_send_splits, relay_sent=None if layout.relay is None else layout.relay.send_splits,
                    # The output itself is saved too: the caller's next layer keeps it anyway. A tensor saved by
                    # several nodes (head groups sharing KV buffers) is held once.
                    saved_numel=sum({(t.data_ptr(), t.numel()): t.numel() for t in saved
                                     if not (out.numel() and t.data_ptr() == out.data_ptr())}.values()),
                    saved_inputs=any(t.data_ptr() == x.data_ptr() for t in saved for x in (q, k, v) if x.numel()),
                    backward_groups=len(layout.backward_groups),
                    document_calls=len(layout.documents.calls) if served else 0,
                    segmented_documents=len(layout.documents.segmented) if served else 0,
                    server_numel=(layout.num_server_q * n_q + 2 * layout.num_unique_kv * n_kv
                                  + sum(layout.q_recv_splits) * n_q) * HEAD_DIM
                    + layout.num_server_q * n_q,  # Q, unique K and V, outputs sent home to other ranks, LSE
                )
    return results


def reference(pieces_per_rank, n_q, n_kv, seed):
    """Dense causal attention per document in float64 with autograd, then cut into ranks' rows."""
    data = global_inputs(pieces_per_rank, n_q, n_kv, seed)
    grads = {}
    for d, (q, k, v, dout) in data.items():
        q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
        L = q.shape[0]
        rep = n_q // n_kv
        kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        mask = torch.ones(L, L, dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=mask)
        out = out.transpose(0, 1)
        out.backward(dout)
        grads[d] = (out.detach(), q.grad, k.grad, v.grad)
    return [{name: local_rows(grads, pieces, i) for i, name in enumerate(("out", "dq", "dk", "dv"))}
            for pieces in pieces_per_rank]


def rel_err(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@functools.cache
def one_group_results(world, relay_nodes=None):
    """The float32 worker's results in one group of heads, flat or through the hierarchical exchange: computed once
    for the tests that read them."""
    return run_distributed(worker, world, "float32", None, False, relay_nodes)


@pytest.fixture(scope="module", params=[2, 4])
def world_results(request):
    world = request.param
    return world, one_group_results(world)


def assert_matches_reference(world, results, tolerance, heads_run=None):
    for case, pieces in make_cases(world):
        for heads, (n_q, n_kv) in (heads_run or HEADS).items():
            ref = reference(pieces, n_q, n_kv, seed=case_seed(case, heads))
            for strategy in STRATEGIES:
                for rank in range(world):
                    got = results[rank][(case, strategy, heads)]
                    for name in ("out", "dq", "dk", "dv"):
                        if ref[rank][name].numel():
                            err = rel_err(got[name], ref[rank][name])
                            assert err <= tolerance, (world, case, strategy, heads, rank, name, err)


def test_outputs_and_grads_match_reference_float32(world_results):
    assert_matches_reference(*world_results, tolerance=1e-5)


def test_documents_with_several_segments_run_in_calls_of_their_own(world_results):
    """The reference backend serves queries at given positions, so a server's non-adjacent shards of one
    document run without copies: on 2 ranks as one call over its unique keys at the queries' positions, on 4
    as a causal call per segment over the keys it reads (the worker's ``segmented``)."""
    world, results = world_results
    got = [got for rank_results in results for got in rank_results.values()]
    calls, segmented = (sum(g[key] for g in got) for key in ("document_calls", "segmented_documents"))
    assert (calls > 0 and segmented == 0) if world == 2 else (segmented > 0 and calls == 0)


def test_backward_in_groups_of_segments_matches_reference():
    """With a bound of 350 key rows per backward call, servers run their backward in several calls
    (and segments longer than the bound alone); the gradients are those of one call. Documents of two
    segments run as a causal call each, the first writing its keys' gradients, the second adding to them, under
    a backend without a PositionKernel too (as flash); and the same with prefix copies (such a backend, where the
    documents would take a position call), grouped the same way."""
    for copies, segmented in ((False, True), (True, True), (True, False)):
        results = run_distributed(worker, 2, "float32", 350, copies, None, 1, None, segmented)
        got = [got for rank_results in results for got in rank_results.values()]
        assert max(g["backward_groups"] for g in got) >= 3
        assert (sum(g["segmented_documents"] for g in got) > 0) == segmented
        assert sum(g["document_calls"] for g in got) == 0
        assert_matches_reference(2, results, tolerance=1e-5)


def alternating_plans():
    """Plans where rank 0 of two holds every document and each rank serves alternate shards of it: documents
    of two, three and four segments a server (and, on two documents, one of each beside the other)."""
    from attnpool.plan.documents import DocPiece, PieceTable
    from attnpool.plan.plan import make_plan

    for doc_lens, shard in (([96], 24), ([144], 24), ([192], 24), ([96, 120], 24)):
        pieces = PieceTable.from_pieces([[DocPiece(d, n, 0, n) for d, n in enumerate(doc_lens)], []])
        doc = np.concatenate([np.full(n // shard, d) for d, n in enumerate(doc_lens)])
        start = np.concatenate([np.arange(n // shard) * shard for n in doc_lens])
        yield make_plan("test", pieces, doc, start, start + shard, doc, np.arange(len(doc)) % 2, shard)


@pytest.mark.parametrize("segmented", [False, True])
def test_server_step_without_copies_writes_every_row(monkeypatch, segmented):
    """serve_forward/serve_backward as DocumentServing cuts the work, against the copies path, on every server
    of the plans above that holds a split document, and of alternating_plans (up to four segments a document):
    float64, every buffer allocated empty filled with NaN first (a row left unwritten shows), backward groups
    of at most 75 keys, and beside the reference a backend that writes its gradients in place (backward_into,
    as fa4 does). Split documents run as one position call each, or as a causal call per segment
    (``segmented``, at most MAX_CAUSAL_CALL_SEGMENTS of them), which a backend without a PositionKernel (as flash)
    runs too; where a position call is wanted, such a backend copies."""
    import attnpool.runtime.dispatch as dispatch
    from attnpool.runtime.core_attention import serve_backward, serve_forward, serves_documents
    from attnpool.runtime.dispatch import DispatchLayout

    monkeypatch.setattr(dispatch, "BACKWARD_GROUP_KEYS", 75)
    monkeypatch.setattr(dispatch, "MAX_CAUSAL_CALL_SEGMENTS", 4 if segmented else 1)
    monkeypatch.setattr(dispatch, "MIN_AVOIDED_KEYS_PER_CALL", 0)
    monkeypatch.setattr(dispatch, "MIN_AVOIDED_FRACTION", 0)
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda x, **kw: empty_like(x, **kw).fill_(float("nan")))
    ref = reference_kernels.BACKEND

    def backward_into(*args, scale=None, into=None):
        grads = ref.backward(*args, scale=scale)
        if into is None:
            return grads
        for target, grad in zip(into, grads):
            target.copy_(grad)
        return into

    in_place = dataclasses.replace(ref, backward=backward_into, backward_into=True)
    no_positions = dataclasses.replace(ref, positions=None)
    copies = dataclasses.replace(ref, positions=None, splits_by_segment=False)  # (the copies path, always)
    plans = [(world, plan_attention(pieces, strategy, cost_model="pairs", min_shard_tokens=8))
             for world in (2, 4) for (_, pieces), strategy in itertools.product(make_cases(world, scale=4), STRATEGIES)]
    plans += [(2, plan) for plan in alternating_plans()]
    servers = split_runs = mixed = 0
    segments_seen = set()
    for world, plan in plans:
        for r in range(world):
            L = DispatchLayout.build(plan, r, "cpu")
            if L.documents is None:
                continue
            gen = torch.Generator().manual_seed(r)
            q, dout = (torch.randn(L.num_server_q, 4, 8, generator=gen, dtype=torch.float64) for _ in range(2))
            k, v = (torch.randn(L.num_unique_kv, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
            want_out, want_lse = serve_forward(L, copies, q, k, v)
            want = serve_backward(L, copies, dout, q, k, v, want_out, want_lse)
            assert not serves_documents(L, copies, q) and serves_documents(L, no_positions, q) == segmented
            for backend in (ref, in_place, no_positions):
                out, lse = serve_forward(L, backend, q, k, v)
                torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
                torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
                for grad, wanted in zip(serve_backward(L, backend, dout, q, k, v, out, lse), want):
                    torch.testing.assert_close(grad, wanted, rtol=1e-10, atol=1e-10)
            servers += 1
            split_runs += len(L.documents.varlen_groups) > len(L.documents.varlen)
            mixed += bool(L.documents.varlen)
            assert bool(L.documents.segmented) == segmented and bool(L.documents.calls) != segmented
            segments_seen |= {len(segments) for segments in L.documents.segmented}
    assert servers and split_runs and mixed
    assert segments_seen == ({2, 3, 4} if segmented else set())


def test_few_copies_are_kept_rather_than_split_into_calls():
    """A server runs without copies only where it avoids many copied rows: per call it makes, and against its
    unique rows. A split document of a few segments runs as a causal call per segment, one of more as one
    position call."""
    from attnpool.plan.documents import DocPiece, PieceTable
    from attnpool.plan.plan import make_plan
    from attnpool.runtime.dispatch import MIN_AVOIDED_FRACTION, MIN_AVOIDED_KEYS_PER_CALL, DispatchLayout

    def layout(doc_lens, shard, server_of_shard):  # rank 0 holds every document; shards served as given
        pieces = PieceTable.from_pieces([[DocPiece(d, n, 0, n) for d, n in enumerate(doc_lens)], []])
        doc = np.concatenate([np.full(n // shard, d) for d, n in enumerate(doc_lens)])
        start = np.concatenate([np.arange(n // shard) * shard for n in doc_lens])
        plan = make_plan("test", pieces, doc, start, start + shard, doc, server_of_shard(doc, start // shard), shard)
        return DispatchLayout.build(plan, 0, "cpu")

    def odd(doc, i):  # rank 0 serves the odd shards
        return 1 - i % 2

    # one document's odd 16K shards of 4: two segments, 32K rows avoided in their two calls, half the unique ones
    D = layout([65536], 16384, odd).documents
    assert len(D.segmented) == 1 and len(D.segmented[0]) == 2 and not D.calls
    # its odd 4K shards of 16: eight segments, more than MAX_CAUSAL_CALL_SEGMENTS, in one position call
    D = layout([65536], 4096, odd).documents
    assert len(D.calls) == 1 and not D.segmented
    # a document's first and last 1K of 16: 1K avoided, under both bounds
    assert layout([16384], 1024, lambda doc, i: np.where((i == 0) | (i == 15), 0, 1)).documents is None
    # two documents of odd 8K shards of 4 around a whole one: 5 calls (a segment each, the whole one's run)
    # avoiding 32K rows, under 16K per call though above a quarter of the unique rows
    L = layout([32768, 8192, 32768], 8192, lambda doc, i: np.where(doc == 1, 0, odd(doc, i)))
    avoided = 2 * 16384
    assert avoided < 5 * MIN_AVOIDED_KEYS_PER_CALL and avoided >= MIN_AVOIDED_FRACTION * L.num_unique_kv
    assert L.documents is None


@pytest.mark.parametrize("segmented", [False, True])
def test_document_serving_partitions_the_servers_rows(monkeypatch, segmented):
    """DocumentServing's parts (varlen calls over runs of one-segment documents, one position call per document
    with several, or with ``segmented`` a causal call per segment) cover every query row exactly once, and every
    unique KV row once counting a segmented document's first segment only (its keys hold its others'); each
    document call's positions are its tasks' document positions, and each segment's queries the tail of its
    keys."""
    import attnpool.runtime.dispatch as dispatch
    from attnpool.runtime.dispatch import DispatchLayout

    monkeypatch.setattr(dispatch, "MIN_AVOIDED_KEYS_PER_CALL", 0)
    monkeypatch.setattr(dispatch, "MIN_AVOIDED_FRACTION", 0)
    monkeypatch.setattr(dispatch, "MAX_CAUSAL_CALL_SEGMENTS", 2 if segmented else 1)

    def rows(r, n):
        mask = np.zeros(n, dtype=int)
        np.add.at(mask, np.arange(n)[r] if isinstance(r, slice) else r.numpy(), 1)
        return mask

    seen = 0
    for world in (2, 4):
        for _, pieces in make_cases(world):
            for strategy in STRATEGIES:
                plan = plan_attention(pieces, strategy, cost_model="pairs", min_shard_tokens=32)
                for r in range(world):
                    layout = DispatchLayout.build(plan, r, "cpu")
                    D = layout.documents
                    if D is None:
                        continue
                    seen += len(D.calls) + len(D.segmented)
                    # a segmented document's first segment reads its keys' rows, which hold its others'
                    q_cover = sum(rows(c.q_rows, layout.num_server_q) for c in (*D.calls, *sum(D.segmented, ())))
                    k_cover = sum(rows(c.k_rows, layout.num_unique_kv) for c in (*D.calls, *(s[0] for s in D.segmented)))
                    for first, *others in D.segmented:
                        assert all(first.k_rows.start <= o.k_rows.start and o.k_rows.stop <= first.k_rows.stop
                                   for o in others)
                    for parts in (D.varlen, D.varlen_groups):  # the forward's runs, the backward's groups
                        q_part = q_cover + sum(rows(p.q_rows, layout.num_server_q) for p in parts)
                        k_part = k_cover + sum(rows(p.k_rows, layout.num_unique_kv) for p in parts)
                        assert (q_part == 1).all() and (k_part == 1).all()
                        # every call reads slices of the server's buffers: no gathered copy
                        assert all(isinstance(p.q_rows, slice) and isinstance(p.k_rows, slice) for p in parts)
                    tasks = plan.server_tasks(r)
                    task_pos = np.concatenate([np.arange(plan.task_start[t], plan.task_end[t]) for t in tasks])
                    for c in D.calls:
                        assert np.array_equal(c.positions, task_pos[c.q_rows])
                        assert c.positions.max() == c.k_rows.stop - c.k_rows.start - 1
                    for first, *others in D.segmented:
                        for seg in (first, *others):
                            end = seg.k_rows.stop - first.k_rows.start  # the document's rows start at its first key
                            assert np.array_equal(task_pos[seg.q_rows],
                                                  np.arange(end - (seg.q_rows.stop - seg.q_rows.start), end))
                    assert bool(D.segmented) == segmented and bool(D.calls) != segmented
    assert seen


def test_segment_groups_bound_their_keys():
    from attnpool.runtime.dispatch import segment_groups

    assert segment_groups(np.array([300, 300, 500, 2000, 100, 100]), 700) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert segment_groups(np.array([5, 5]), 10) == [(0, 2)]
    assert segment_groups(np.array([], dtype=np.int64), 10) == []


def _rows_of_runs(rng, runs: int, size: int) -> np.ndarray:
    """Row indices in ``runs`` runs of consecutive rows below ``size`` (runs may touch, overlap or repeat)."""
    starts = rng.integers(0, size - 8, runs)
    return np.concatenate([np.arange(a, a + rng.integers(1, 8)) for a in starts])


@pytest.mark.parametrize("runs", [0, 1, 3, 40])
def test_rows_copy_by_slices_or_index_alike(runs):
    """Rows and RowMap give what indexing gives, whether they copy slice by slice (few runs: one run taken is a
    view) or through the index (more than MAX_ROW_RUNS); a row listed twice gets both additions."""
    from attnpool.runtime.dispatch import MAX_ROW_RUNS, RowMap, Rows

    rng = np.random.default_rng(runs)
    x = torch.randn(64, 3, 2, dtype=torch.float64)
    rows_np = _rows_of_runs(rng, runs, 64) if runs else np.zeros(0, dtype=np.int64)
    rows = Rows.of(rows_np, "cpu")
    index = torch.as_tensor(rows_np)
    assert (rows.runs is None) == (runs > MAX_ROW_RUNS) and len(rows) == len(rows_np)
    assert torch.equal(rows.take(x), x[index]) and torch.equal(rows.take(x, own=True), x[index])
    one_run = rows.runs is not None and len(rows.runs) == 1
    assert one_run == (runs == 1) and (rows.take(x).untyped_storage().data_ptr() == x.untyped_storage().data_ptr()) == one_run
    assert rows.take(x, own=True).untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    src = torch.randn(len(rows_np), 3, 2, dtype=torch.float64)
    assert torch.allclose(rows.add(x.clone(), src), x.clone().index_add_(0, index, src))
    unique = np.unique(rows_np)  # placing is defined for distinct rows
    rng.shuffle(unique) if runs > MAX_ROW_RUNS else None
    placed, expected = x.clone(), x.clone()
    Rows.of(unique, "cpu").put(placed, src[:len(unique)])
    expected[torch.as_tensor(unique)] = src[:len(unique)]
    assert torch.equal(placed, expected)
    # a map from rows of x to distinct rows of y, and back
    dst_np = rng.permutation(96)[:len(unique)] if runs > MAX_ROW_RUNS else np.arange(5, 5 + len(unique))
    mapping = RowMap.of(dst_np, unique, "cpu")
    dst, src_idx = torch.as_tensor(dst_np), torch.as_tensor(unique)
    y, want = torch.zeros(96, 3, 2, dtype=torch.float64), torch.zeros(96, 3, 2, dtype=torch.float64)
    mapping.copy(y, x)
    want[dst] = x[src_idx]
    assert torch.equal(y, want)
    back, want_back = torch.zeros_like(x), torch.zeros_like(x)
    mapping.inverse.copy(back, y)
    want_back[src_idx] = y[dst]
    assert torch.equal(back, want_back)
    assert torch.allclose(mapping.inverse.add(x.clone(), y), x.clone().index_add_(0, src_idx, y[dst]))
    assert torch.allclose(mapping.add(y.clone(), x), y.clone().index_add_(0, dst, x[src_idx]))


def test_saved_for_backward_is_the_servers_buffers_alone(world_results):
    """No row is held twice: backward keeps the server's Q, unique KV and LSE, of its outputs only the
    rows it returned to other ranks (the local ones are in the rank's output), and none of the caller's
    q, k, v (their rows served elsewhere are held by their server)."""
    world, results = world_results
    for rank_results in results:
        for key, got in rank_results.items():
            assert got["saved_numel"] == got["server_numel"], key
            assert not got["saved_inputs"], key


def test_bytes_counted_equal_plan_prediction(world_results):
    world, results = world_results
    for case, pieces in make_cases(world):
        for strategy in STRATEGIES:
            plan = plan_attention(pieces, strategy, cost_model="pairs", min_shard_tokens=32)
            for heads, (n_q, n_kv) in HEADS.items():
                shape = AttentionShape(n_q, n_kv, HEAD_DIM, 4)
                remote = plan.task_server != plan.task_home
                x = plan.kv_transfers()
                crossing = x.src != x.server
                for rank in range(world):
                    q_out = int(plan.task_len[remote & (plan.task_home == rank)].sum()) * shape.q_bytes
                    o_back = int(plan.task_len[remote & (plan.task_server == rank)].sum()) * shape.o_bytes
                    kv_out = int(x.length[crossing & (x.src == rank)].sum()) * shape.kv_bytes
                    kv_in = int(x.length[crossing & (x.server == rank)].sum()) * shape.kv_bytes
                    stats = results[rank][(case, strategy, heads)]["stats"]
                    sent = {tag: s[1] for tag, s in stats.items()}
                    if not stats:
                        assert q_out == kv_out == o_back == 0
                        continue
                    assert sent["dispatch"] == q_out + kv_out
                    assert sent["return"] == o_back
                    assert sent["dispatch_grad"] == q_out
                    assert sent["return_grad"] == o_back + kv_in


RELAY_NODES = (0, 0, 1, 1)  # 4 ranks as 2 nodes of 2


def test_hierarchical_exchange_computes_the_same_and_sends_kv_across_nodes_once():
    """4 gloo ranks as 2 nodes: with the hierarchical exchange every strategy's outputs and gradients are the
    reference's; KV crosses between nodes once per (piece, node) where the flat exchange sent it to each
    server there (counted here by loops over the plan's segments, apart from the layout's vectorised choice);
    relays forward only inside their node; and the relayed KV's gradients come back the way it went."""
    world = 4
    results = one_group_results(world, RELAY_NODES)
    assert_matches_reference(world, results, tolerance=1e-5)
    relayed_somewhere = False
    for case, pieces in make_cases(world):
        for strategy in STRATEGIES:
            plan = plan_attention(pieces, strategy, cost_model="pairs", min_shard_tokens=32)
            x = plan.kv_transfers()
            # a remote segment crosses unless the relay of its piece's segments bound for its node holds its rows: the
            # relay is the longest of them; where several are, the (piece index mod their count)-th by server
            crossing = {}
            for i in range(len(x.src)):
                src, server = int(x.src[i]), int(x.server[i])
                if RELAY_NODES[src] == RELAY_NODES[server]:
                    continue
                group = [j for j in range(len(x.src)) if x.piece[j] == x.piece[i]
                         and RELAY_NODES[int(x.server[j])] == RELAY_NODES[server]]
                longest = max(int(x.length[j]) for j in group)
                ties = sorted((int(x.server[j]), j) for j in group if x.length[j] == longest)
                r = ties[int(x.piece[i]) % len(ties)][1]
                a, n = int(x.src_row[i]), int(x.length[i])
                covered = r != i and x.src_row[r] <= a and a + n <= x.src_row[r] + x.length[r]
                if not covered:
                    crossing[src, server] = crossing.get((src, server), 0) + n
            for heads in HEADS:
                for rank in range(world):
                    got = results[rank][(case, strategy, heads)]
                    across = {peer: n for peer, n in enumerate(got["kv_sent"])
                              if RELAY_NODES[peer] != RELAY_NODES[rank] and n}
                    assert across == {s: n for (r, s), n in crossing.items() if r == rank}, (case, strategy, rank)
                    if got["relay_sent"] is not None:
                        assert all(n == 0 for peer, n in enumerate(got["relay_sent"])
                                   if RELAY_NODES[peer] != RELAY_NODES[rank])
                        relayed_somewhere |= sum(got["relay_sent"]) > 0
                        stats = got["stats"]
                        assert stats["relay"][1] == stats["relay_grad"][2] and stats["relay"][2] == stats["relay_grad"][1]
    assert relayed_somewhere  # (the document spanning every rank, served on both nodes)


@pytest.mark.parametrize("world", [2, 4])
def test_head_chunks_compute_the_same_with_the_same_bytes_and_memory(world):
    """Each call in two groups of heads (every strategy, GQA and MHA, a rank without tokens; on 4 ranks through the
    hierarchical exchange of 2 nodes): the reference's outputs and gradients; backward keeps the server's buffers
    alone, as one call does; every exchange carries the same bytes in all as one call's, in twice the launches."""
    relay_nodes = RELAY_NODES if world == 4 else None
    chunked = run_distributed(worker, world, "float32", None, False, relay_nodes, 2)
    assert_matches_reference(world, chunked, tolerance=1e-5)
    whole = one_group_results(world, relay_nodes)
    for rank in range(world):
        for key, got in chunked[rank].items():
            assert got["saved_numel"] == got["server_numel"] and not got["saved_inputs"], key
            one = whole[rank][key]["stats"]
            assert {tag: s[1:] for tag, s in got["stats"].items()} == {tag: s[1:] for tag, s in one.items()}, key
            assert all(got["stats"][tag][0] == 2 * n for tag, (n, _, _) in one.items()), key


# Head groups finer than the KV heads: four groups over two KV heads and over one
FINER_HEADS = {"gqa": (4, 2), "one_kv": (4, 1)}


def test_head_groups_finer_than_the_kv_heads_compute_the_same_with_the_same_bytes_and_memory(world=4):
    """Four groups of query heads over two KV heads and over one (a KV head's first group sends it, the others read
    it on the server): the reference's outputs and gradients for every strategy (on 4 ranks through the
    hierarchical exchange); every exchange carries the same bytes in all as one call's, in four times the launches;
    backward keeps the server's buffers alone, each KV buffer once however many groups read it."""
    relay_nodes = RELAY_NODES
    finer = run_distributed(worker, world, "float32", None, False, relay_nodes, 4, FINER_HEADS)
    assert_matches_reference(world, finer, tolerance=1e-5, heads_run=FINER_HEADS)
    whole = run_distributed(worker, world, "float32", None, False, relay_nodes, 1, FINER_HEADS)
    for rank in range(world):
        for key, got in finer[rank].items():
            assert got["saved_numel"] == got["server_numel"] and not got["saved_inputs"], key
            one = whole[rank][key]["stats"]
            assert {tag: s[1:] for tag, s in got["stats"].items()} == {tag: s[1:] for tag, s in one.items()}, key
            assert all(got["stats"][tag][0] == 4 * n for tag, (n, _, _) in one.items()
                       if tag not in ("relay", "relay_grad")), key


def kv_alive_worker(rank, world, chunks):
    """Elements of the server's unique K/V buffers still alive when collect starts, in a checkpointed forward."""
    import gc
    import importlib
    import weakref

    from torch.utils.checkpoint import checkpoint

    runtime = importlib.import_module("attnpool.runtime.core_attention")
    buffers, alive = [], []
    server_inputs, collect = runtime._server_inputs, runtime._Collect.forward

    def recorded_server_inputs(*args):
        made = server_inputs(*args)
        buffers.extend(weakref.ref(t) for t in made[1:])
        return made

    def counted_collect(ctx, *args):
        gc.collect()
        alive.append(sum(t().numel() for t in buffers if t() is not None))
        return collect(ctx, *args)

    runtime._server_inputs, runtime._Collect.forward = recorded_server_inputs, staticmethod(counted_collect)
    try:
        pieces = linear_layout([300, 40, 500, 60], world)
        plan = plan_attention(pieces, "cad", cost_model="pairs", min_shard_tokens=32)
        data = global_inputs(pieces, 4, 2, seed=1)
        q, k, v, dout = (local_rows(data, pieces[rank], i).float().requires_grad_(i < 3) for i in range(4))
        out = checkpoint(lambda *qkv: core_attention(*qkv, plan, head_chunks=chunks), q, k, v, use_reentrant=False)
        out.backward(dout)
    finally:
        runtime._server_inputs, runtime._Collect.forward = server_inputs, staticmethod(collect)
    return alive[0], len(buffers) > 0


def test_server_kv_buffers_do_not_outlive_their_readers():
    """Under activation checkpointing the first forward keeps nothing: the server's K/V buffers go after their
    kernel, in one group and in groups finer than the KV heads (whose buffers the other groups of a KV head read)."""
    for chunks in (1, 4):
        for alive, made in run_distributed(kv_alive_worker, 2, chunks):
            assert made and alive == 0, (chunks, alive)


def launch_order_worker(rank, world):
    """The order in which each head group's exchanges are launched and waited for, forward and backward: events
    (what, tag, head group), the group of a handle known from the forward launch it was made for."""
    import importlib

    runtime = importlib.import_module("attnpool.runtime.core_attention")  # (the package's core_attention is the function)

    events, group_of, forward_launches = [], {}, {}
    launch, wait = runtime._Handle.launch, runtime._Handle.wait

    def logged_launch(handle, send, send_sizes, recv_sizes, group, tag):
        if tag in ("dispatch", "return"):
            group_of[id(handle)] = forward_launches[tag] = forward_launches.get(tag, -1) + 1
        events.append(("launch", tag, group_of[id(handle)]))
        handle.logged_tag = tag
        return launch(handle, send, send_sizes, recv_sizes, group, tag)

    def logged_wait(handle):
        events.append(("wait", handle.logged_tag, group_of[id(handle)]))
        return wait(handle)

    runtime._Handle.launch, runtime._Handle.wait = logged_launch, logged_wait
    try:
        pieces = linear_layout([300, 40, 500, 60], world)
        plan = plan_attention(pieces, "cad", cost_model="pairs", min_shard_tokens=32)
        data = global_inputs(pieces, 4, 4, seed=1)
        q, k, v, dout = (local_rows(data, pieces[rank], i).float().requires_grad_(i < 3) for i in range(4))
        core_attention(q, k, v, plan, head_chunks=4).backward(dout)
    finally:
        runtime._Handle.launch, runtime._Handle.wait = launch, wait
    return events


def test_head_groups_exchanges_are_launched_in_the_order_that_overlaps_them():
    """Forward: every group's Q/KV out, then each group's outputs home in group order (group g's once its kernel
    ran). Backward, as autograd serves the groups last to first: every group's dO out, last group first, then each
    group's dQ/dKV back in the same order, so that a group's kernel backward runs while the next group's dO is
    in flight and the one before's gradients go home."""
    for events in run_distributed(launch_order_worker, 2):
        launches = [(tag, g) for what, tag, g in events if what == "launch"]
        assert launches == ([("dispatch", g) for g in range(4)] + [("return", g) for g in range(4)]
                            + [("dispatch_grad", g) for g in (3, 2, 1, 0)]
                            + [("return_grad", g) for g in (3, 2, 1, 0)]), launches
        # each group's kernel backward waits for its own dO only, and launches its gradients before the next waits
        backward = [e for e in events if e[1] in ("dispatch_grad", "return_grad")]
        assert backward.index(("launch", "return_grad", 3)) < backward.index(("wait", "dispatch_grad", 2))


def test_exchanges_in_flight_together_count_once_in_comm_time():
    """Head groups keep several exchanges in flight: their time is the union of the spans, never more than the
    wall time they cover (the summary reads it as part of core attention's time)."""
    from attnpool.comm.all_to_all import CommStats, covered_seconds

    assert covered_seconds([]) == 0.0
    assert covered_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.8)]) == pytest.approx(4.0)
    assert covered_seconds([(1.0, 3.0), (0.0, 2.0)]) == pytest.approx(3.0)

    class Event:  # a recorded CUDA event's time (s), as CommStats reads it: elapsed_time in ms
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

        def synchronize(self):
            pass

    stats = CommStats(timing=True)
    stats._origin = Event(10.0)
    stats._events = [(Event(10.0), Event(12.0)), (Event(10.5), Event(12.5)), (Event(13.0), Event(13.25))]
    assert stats.seconds() == pytest.approx(2.75)
    stats._events = [(Event(14.0), Event(15.0))]
    assert stats.seconds() == pytest.approx(3.75)
    stats.reset()
    assert stats.seconds() == 0.0 and stats._origin is None
    stats._events = [(Event(20.0), Event(21.0))]  # launched before the reset, waited for after it
    assert stats.seconds() == pytest.approx(1.0)


def test_head_chunks_are_refused_where_they_cannot_split_the_heads():
    pieces = linear_layout([40, 30], 1)
    plan = plan_attention(pieces, "cad", cost_model="pairs")
    q, k = torch.randn(70, 4, HEAD_DIM), torch.randn(70, 2, HEAD_DIM)
    for bad in (3, 8):  # neither divides the 2 KV heads nor, a multiple of them, the 4 query heads
        with pytest.raises(ConfigError, match="head_chunks.*must divide the 2 KV heads.* 4 query heads"):
            core_attention(q, k, k, plan, head_chunks=bad)
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="head_chunks"):
            CoreAttention(plan, head_chunks=bad)
    with pytest.raises(ConfigError, match="head_chunks.*sparse"):
        CoreAttention(plan, head_chunks=2, sparse=SparseConfig(mode="vertical-slash"))


@pytest.mark.parametrize("segmented", [False, True])
def test_bfloat16_within_tolerance(segmented):
    """bf16 against the float64 reference, split documents as one position call or a causal call per segment."""
    results = run_distributed(worker, 2, "bfloat16", None, False, None, 1, None, segmented)
    assert_matches_reference(2, results, tolerance=2e-2)


def whole_documents(world):
    return [[DocPiece(2 * r, 300, 0, 300), DocPiece(2 * r + 1, 77, 0, 77)] for r in range(world)]


def local_worker(rank, world):
    pieces = whole_documents(world)
    plan = plan_attention(pieces, "local")
    data = global_inputs(pieces, 4, 2, seed=11)
    q, k, v, dout = (local_rows(data, pieces[rank], i).float() for i in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    comm_stats.reset()
    out = core_attention(q, k, v, plan)
    out.backward(dout)
    got = dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)
    return plan.is_fully_local(), comm_stats.calls, {name: t.double() for name, t in got.items()}


def test_fully_local_plan_launches_no_collective_and_matches_reference():
    """The path without traffic: no collective, and the output and its gradients of the reference
    (in it, _Collect alone assembles the server's dO)."""
    ref = reference(whole_documents(2), 4, 2, seed=11)
    for rank, (fully_local, calls, got) in enumerate(run_distributed(local_worker, 2)):
        assert fully_local and calls == 0
        for name, value in got.items():
            assert rel_err(value, ref[rank][name]) <= 1e-5, (rank, name)


def bad_input_worker(rank, world, kind):
    lens = [700, 500, 300, 900]
    pieces = linear_layout(lens, world)
    plan = plan_attention(pieces, "cad", cost_model="pairs", min_shard_tokens=32)
    T = sum(p.length for p in pieces[rank])
    H_q, H_kv, D = 4, 2, 8
    if kind == "tokens" and rank == 1:
        T -= 1
    if kind == "plans" and rank == 1:
        plan = plan_attention(pieces, "percp", cost_model="pairs", min_shard_tokens=32)
    if kind == "world":
        plan = plan_attention(linear_layout(lens, world + 1), "cad")
    if kind == "heads" and rank == 0:
        H_q = 3
    q = torch.randn(T, H_q, D)
    k = torch.randn(T, H_kv, D)
    v = torch.randn(T, H_kv, D)
    try:
        core_attention(q, k, v, plan)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kind, needle", [
    ("tokens", "rank 1: q.shape[0]"),
    ("plans", "different plans"),
    ("world", "made for 3 ranks"),
    ("heads", "rank 0: heads"),
])
def test_bad_input_fails_on_every_rank(kind, needle):
    messages = run_distributed(bad_input_worker, 2, kind)
    for msg in messages:
        assert msg is not None and needle in msg, messages


def test_end_process_flushes_and_exits_with_the_code():
    """Ranks leave through end_process (attnpool.comm.process): what they printed must still arrive."""
    import subprocess
    import sys

    code = "from attnpool.comm import end_process; print('rank done', end=''); end_process(3)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 3 and p.stdout == "rank done", (p.returncode, p.stdout, p.stderr)


def test_contiguous_tasks_share_one_kernel_segment():
    """Shards of one document on one server that continue each other run as one kernel segment,
    so their shared prefix is expanded once (the reference tests above run such plans)."""
    from attnpool.runtime.dispatch import DispatchLayout

    merged_somewhere = False
    for world in (2, 4):
        for _, pieces in make_cases(world):
            for strategy in STRATEGIES:
                plan = plan_attention(pieces, strategy, cost_model="pairs", min_shard_tokens=32)
                for r in range(world):
                    tasks = plan.server_tasks(r)
                    doc, q_len, k_len = plan.kernel_segments(r)
                    layout = DispatchLayout.build(plan, r, "cpu")
                    assert q_len.sum() == plan.task_len[tasks].sum() == layout.num_server_q
                    assert layout.kv_expand.numel() == k_len.sum() <= plan.task_end[tasks].sum()
                    merged_somewhere |= len(doc) < len(tasks)
    assert merged_somewhere


def test_prefix_copies_sum_as_index_add_does():
    """Three documents served as segments of their prefixes (one alone, one in three segments out of order,
    one in two), and one document in 1K-token segments as gpu_fa4 benchmarks it: the float32 sum of the
    copies equals the float64 index_add_ over kv_expand."""
    from attnpool.plan.documents import ranges
    from attnpool.runtime.dispatch import PrefixCopies

    cases = [(np.array([0, 5, 5, 5, 12, 12]), np.array([5, 3, 7, 4, 6, 9])),
             (np.zeros(8, dtype=np.int64), np.arange(1, 9) * 16)]
    for seg_base, seg_k in cases:
        num_unique = int(max(b + k for b, k in zip(seg_base, seg_k)))
        kv_expand = torch.as_tensor(ranges(seg_base, seg_k))
        d = torch.randn(len(kv_expand), 2, 3, dtype=torch.float64)
        want = torch.zeros(num_unique, 2, 3, dtype=torch.float64).index_add_(0, kv_expand, d)
        copies = PrefixCopies.of(seg_base, seg_k, num_unique, "cpu")
        assert len(copies.extra) == len(seg_k) - len(set(seg_base.tolist()))
        got = copies.sum(d.float())
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    # Sliding windows: overlapping segments of which none covers the rows (each its queries' window) are
    # summed by an index_add_ over every expanded row.
    seg_base, seg_k = np.array([0, 4, 5, 2]), np.array([4, 2, 3, 5])
    copies = PrefixCopies.of(seg_base, seg_k, 8, "cpu")
    kv_expand = torch.as_tensor(ranges(seg_base, seg_k))
    d = torch.randn(len(kv_expand), 2, 3, dtype=torch.float64)
    assert copies.spread is not None
    torch.testing.assert_close(copies.sum(d.float()).double(),
                               torch.zeros(8, 2, 3, dtype=torch.float64).index_add_(0, kv_expand, d), rtol=1e-6, atol=1e-6)


def _prefix_sum_interpreted():
    """kernels.prefix_sum through Triton's interpreter against PrefixCopies' torch sum: documents in
    segments out of order, copies shorter and longer than a row block, column counts not a multiple of
    the column block, float32 and bfloat16 (summed in float32 both)."""
    import test_sparse

    from attnpool.runtime.dispatch import PrefixCopies

    test_sparse._patch_interpreter_for_numpy2()
    g = torch.Generator().manual_seed(0)
    cases = [(np.array([0, 5, 5, 5, 12, 12]), np.array([5, 3, 7, 4, 6, 9]), (2, 3)),
             (np.zeros(6, dtype=np.int64), np.arange(1, 7) * 24, (3, 50)),
             (np.array([0, 0, 70, 0]), np.array([70, 33, 40, 1]), (1, 130))]
    for seg_base, seg_k, shape in cases:
        num_unique = int(max(b + k for b, k in zip(seg_base, seg_k)))
        copies = PrefixCopies.of(seg_base, seg_k, num_unique, "cpu")
        for dtype in (torch.float32, torch.bfloat16):
            d = torch.randn(int(seg_k.sum()), *shape, generator=g).to(dtype)
            want, got = copies.sum(d, impl="torch"), copies.sum(d, impl="triton")
            assert got.dtype == dtype and got.shape == want.shape
            # float32 sums in another order (each document's copies longest first): rounding apart
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    print("PREFIX SUM OK")


@background.job("test_prefix_copies_kernel_sums_as_torch_does")
def prefix_sum_interpreted(tmp):
    """_prefix_sum_interpreted in a process of its own, under TRITON_INTERPRET=1."""
    import importlib.util
    import os
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_runtime; test_runtime._prefix_sum_interpreted()"
    return background.run([sys.executable, "-c", code], env={"TRITON_INTERPRET": "1"}, timeout=300)


def test_prefix_copies_kernel_sums_as_torch_does():
    run = prefix_sum_interpreted.result()
    assert run.returncode == 0 and "PREFIX SUM OK" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]
