"""Sparse core attention through the distributed runtime (gloo, CPU twin) against a single-process reference.

The reference estimates each document's pattern in one process from the
document's last queries and all of its keys, applies it as an explicit mask to
dense float64 attention with autograd, and cuts the results into ranks' rows.
Every strategy must compute that same function, wherever the shards ran and
whichever server estimated.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from attnpool import DocPiece, plan_attention
from attnpool.comm import comm_stats
from attnpool.kernels.base import Backend
from attnpool.plan import linear_layout, load_cost_model
from attnpool.runtime import CoreAttention
from attnpool.runtime.sparse import KernelClock, PatternRoutes, SparseStats
from attnpool.runtime.sparse_kv import withheld_segments
from attnpool.sparse import SparseCoefficients, SparseConfig, estimate_vertical_slash
from attnpool.sparse.cost import ServedPrice
from dist_harness import run_distributed
from test_runtime import local_rows, rel_err
from test_sparse import rope_like

STRATEGIES = ("local", "percp", "cad")
N_Q, N_KV, HEAD_DIM = 4, 2, 16
CONFIG = SparseConfig(coverage=0.7, vertical_cap=24, slash_cap=20, min_doc_len=200, last_queries=16, sink_tokens=4,
                      local_window=16, block=16, vertical_chunk=16)
# What SparseStats prices served work at: distinct per-tile prices (forward + backward) and dense spans by their pairs
PRICE = ServedPrice(load_cost_model("pairs"), SparseCoefficients(2.0, 3.0, 0.0, 5.0, 11.0, 0.0))


def make_cases(world):
    """(name, pieces per rank). "linear": long sparse documents (one over every rank), short
    dense ones, odd lengths. "short-tails": every rank holds a sparse document's head and
    the previous rank's document's last few tokens, fewer than the estimating queries."""
    linear = linear_layout([260 * world + 37, 150, 410, 90, 333, 45, 520, 201], world)
    tails = [[] for _ in range(world)]
    for r in range(world):
        L, tail = 280 + 10 * r + 3 + r, 3 + r
        tails[r].append(DocPiece(r, L, 0, L - tail))
        tails[(r + 1) % world].append(DocPiece(r, L, L - tail, tail))
        tails[r].append(DocPiece(world + r, 50 + r, 0, 50 + r))
    return [("linear", linear), ("short-tails", tails)]


def plans(pieces):
    return {s: plan_attention(pieces, s, cost_model="pairs", min_shard_tokens=32) for s in STRATEGIES}


def global_inputs(pieces_per_rank):
    """q/k with slash and sink structure per document, random v and upstream grad; float64."""
    docs = sorted({(p.doc_id, p.doc_len) for pieces in pieces_per_rank for p in pieces})
    data = {}
    for d, L in docs:
        q, k = rope_like([L], N_Q, N_KV, HEAD_DIM, seed=100 + d)
        g = torch.Generator().manual_seed(200 + d)
        v = torch.randn(L, N_KV, HEAD_DIM, generator=g, dtype=torch.float64)
        dout = torch.randn(L, N_Q, HEAD_DIM, generator=g, dtype=torch.float64)
        data[d] = [q, k, v, dout]
    return data


def worker(rank, world):
    results = {}
    for case, pieces in make_cases(world):
        results[case] = run_case(rank, pieces)
    return results


def run_case(rank, pieces):
    """Per strategy (kv_transfer "prefix") and per "strategy/read" (kv_transfer "read")."""
    data = global_inputs(pieces)
    results = {}
    for strategy, plan in plans(pieces).items():
        for transfer in ("prefix", "read"):
            q, k, v, dout = (local_rows(data, pieces[rank], i) for i in range(4))
            for t in (q, k, v):
                t.requires_grad_(True)
            stats = SparseStats(PRICE)
            comm_stats.reset()
            attention = CoreAttention(plan, sparse=replace(CONFIG, kv_transfer=transfer), sparse_stats=stats)
            out = attention(q, k, v, layer=0)
            out.backward(dout)
            sent = {tag: v[1] for tag, v in comm_stats.by_tag.items()}
            results[strategy if transfer == "prefix" else f"{strategy}/read"] = dict(
                out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad, stats=stats.values(), sent=sent,
                pattern_bytes=sent.get("sparse_pattern", 0), query_bytes=sent.get("sparse_queries", 0))
    return results


def reference(pieces_per_rank):
    data = global_inputs(pieces_per_rank)
    grads = {}
    for d, (q, k, v, dout) in data.items():
        L = q.shape[0]
        m = min(L, CONFIG.last_queries)
        cu_q = torch.tensor([0, m], dtype=torch.int32)
        cu_k = torch.tensor([0, L], dtype=torch.int32)
        pattern = estimate_vertical_slash(q[L - m:], k, cu_q, cu_k, CONFIG)
        mask = pattern.mask(0, L, L)  # (H, L, L): the attended set, explicitly
        q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
        rep = N_Q // N_KV
        kk, vv = k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1)
        scores = (q.transpose(0, 1) @ kk.transpose(1, 2)) / HEAD_DIM ** 0.5
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out = (probs @ vv).transpose(0, 1)
        out.backward(dout)
        grads[d] = (out.detach(), q.grad, k.grad, v.grad)
    return [{name: local_rows(grads, pieces, i) for i, name in enumerate(("out", "dq", "dk", "dv"))}
            for pieces in pieces_per_rank]


@pytest.fixture(scope="module", params=[2, 3])
def world_results(request):
    return request.param, run_distributed(worker, request.param)


def test_sparse_matches_masked_reference_every_strategy(world_results):
    world, results = world_results
    for case, pieces in make_cases(world):
        ref = reference(pieces)
        for strategy in STRATEGIES + tuple(f"{s}/read" for s in STRATEGIES):
            for rank in range(world):
                for name in ("out", "dq", "dk", "dv"):
                    if ref[rank][name].numel():
                        err = rel_err(results[rank][case][strategy][name], ref[rank][name])
                        assert err <= 1e-10, (world, case, strategy, rank, name, err)
    # The short tails made local's estimating servers fetch the queries they lack.
    assert all(results[r]["short-tails"]["local"]["query_bytes"] > 0 for r in range(world))


def test_read_kv_transfer_withholds_where_documents_are_split(world_results):
    """kv_transfer="read" computes the same function (above); it withholds KV only where a sparse
    document has servers besides its estimating one."""
    world, results = world_results
    withheld_somewhere = False
    for case, pieces in make_cases(world):
        for strategy, plan in plans(pieces).items():
            withheld = withheld_segments(plan, CONFIG).any()
            read = [results[r][case][f"{strategy}/read"]["sent"] for r in range(world)]
            assert any(s.get("sparse_kv_marks", 0) for s in read) == withheld, (case, strategy)
            assert not withheld or strategy != "local"
            withheld_somewhere |= withheld
    assert withheld_somewhere


def long_document_worker(rank, world):
    """One 2048-token document over the ranks, small caps: per strategy and transfer, output,
    gradients and bytes sent by tag."""
    config = replace(CONFIG, vertical_cap=12, slash_cap=16, min_doc_len=512)
    pieces = linear_layout([2048, 300], world)
    data = global_inputs(pieces)
    results = {}
    for strategy in ("percp", "cad"):
        plan = plan_attention(pieces, strategy, cost_model="pairs", min_shard_tokens=128)
        for transfer in ("prefix", "read"):
            q, k, v, dout = (local_rows(data, pieces[rank], i).requires_grad_(i < 3) for i in range(4))
            comm_stats.reset()
            out = CoreAttention(plan, sparse=replace(config, kv_transfer=transfer))(q, k, v, layer=0)
            out.backward(dout)
            sent = {tag: v[1] for tag, v in comm_stats.by_tag.items()}
            results[strategy, transfer] = (out.detach(), q.grad, k.grad, v.grad, sent)
    return results


def test_read_kv_transfer_moves_fewer_bytes_on_a_sparse_document():
    per_rank = run_distributed(long_document_worker, 2)
    for strategy in ("percp", "cad"):
        for r in per_rank:
            for a, b in zip(r[strategy, "prefix"][:4], r[strategy, "read"][:4]):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        # KV the read transfer withheld from the dispatch, and what it sent instead (rows read, marks).
        withheld = sum(r[strategy, "prefix"][4]["dispatch"] - r[strategy, "read"][4]["dispatch"] for r in per_rank)
        rows = sum(r[strategy, "read"][4]["sparse_kv"] for r in per_rank)
        marks = sum(r[strategy, "read"][4]["sparse_kv_marks"] for r in per_rank)
        assert 0 < rows <= withheld, (strategy, rows, withheld)
        if strategy == "percp":  # its servers hold late shards, whose sparse rows read little of the prefix
            assert rows + marks < 0.6 * withheld, (rows, marks, withheld)


def test_pattern_exchange_only_where_documents_are_shared(world_results):
    """Patterns move only from a document's estimating server to its other servers, and each
    sparse document is estimated exactly once in the group."""
    world, all_results = world_results
    for case, pieces in make_cases(world):
        check_routes(world, pieces, [r[case] for r in all_results])


def check_routes(world, pieces, results):
    for strategy, plan in plans(pieces).items():
        routes = [PatternRoutes.build(plan, r, N_Q, CONFIG, "cpu") for r in range(world)]
        estimated = np.concatenate([r.est_docs for r in routes])
        sparse_docs = np.flatnonzero(plan.pieces.doc_len >= CONFIG.min_doc_len)
        assert sorted(estimated.tolist()) == sparse_docs.tolist(), strategy  # short documents stay dense
        shared = any(len(set(plan.task_server[plan.task_doc == d])) > 1 for d in sparse_docs)
        assert routes[0].exchange == shared
        assert shared or strategy == "local"  # percp and cad split the long documents over servers
        for r in range(world):
            assert sum(routes[r].extra_send_splits) * routes[r].est_q_index.numel() >= 0
        for r in range(world):
            assert sum(routes[r].send_splits) * 4 == results[r][strategy]["pattern_bytes"]
            assert [routes[s].send_splits[r] for s in range(world)] == routes[r].recv_splits
        # Each document's stats counted once: the causal pairs over ranks are the batch's.
        causal = sum(results[r][strategy]["stats"][4] for r in range(world))
        L = plan.pieces.doc_len.astype(np.float64)
        assert causal == pytest.approx(N_Q * float((L * (L + 1) / 2).sum()))
        density = sum(results[r][strategy]["stats"][3] for r in range(world)) / causal
        assert 0.2 < density < 1.0, (strategy, density)  # the long documents really are sparse
        # Each rank's served work, measured from the patterns its kernel ran, is what its segments' tiles are: in
        # pairs, and priced per tile and dense span.
        reference = [served_reference(plan, r, pieces) for r in range(world)]
        served = [results[r][strategy]["stats"][5] for r in range(world)]
        assert served == pytest.approx([pairs for pairs, _ in reference]), strategy
        work = [results[r][strategy]["stats"][6] for r in range(world)]
        assert work == pytest.approx([work for _, work in reference]), strategy
        # its two parts, the tiles at the calibration's prices and the dense spans (unscaled: PRICE's scale is 1)
        parts = [results[r][strategy]["stats"][8] + results[r][strategy]["stats"][9] for r in range(world)]
        assert parts == pytest.approx(work), strategy
        # and the kernel calls that served it were timed, on every rank that served some
        kernel_s = [results[r][strategy]["stats"][7] for r in range(world)]
        assert all((s > 0) == (p > 0) for s, p in zip(kernel_s, served)), (strategy, kernel_s, served)


def served_reference(plan, rank, pieces):
    """(pairs, work) of rank's kernel call: the (query, key) pairs x heads of the tiles it computes, counted one query
    block at a time from each document's pattern estimated alone: per head, the kept diagonals Delta <= I (B x B
    pairs each) and the vertical columns before key block I - run + 1 in bars of vertical_chunk (B x chunk each),
    where run counts the consecutive diagonals from 0 (those key blocks are slash tiles); dense documents their
    exact causal pairs. The work: those tiles at PRICE's per-tile prices, and each dense span at its pairs of one
    head."""
    B, chunk = CONFIG.block, CONFIG.vertical_chunk
    slash_price, bar_price = 2.0 + 5.0, 3.0 + 11.0
    data = global_inputs(pieces)
    total = work = 0.0
    for doc, a, e in zip(*plan.kernel_spans(rank)):
        L = int(plan.pieces.doc_len[doc])
        if L < CONFIG.min_doc_len:
            total += N_Q * (e * (e + 1) - a * (a + 1)) / 2
            work += (e * (e + 1) - a * (a + 1)) / 2
            continue
        q, k = data[int(plan.pieces.doc_ids[doc])][:2]
        m = min(L, CONFIG.last_queries)
        pattern = estimate_vertical_slash(q[L - m:], k, torch.tensor([0, m], dtype=torch.int32),
                                          torch.tensor([0, L], dtype=torch.int32), CONFIG)
        nb = -(-L // B)
        for h in range(N_Q):
            diagonals = pattern.slash[h, :nb].tolist()
            run = next((i for i, kept in enumerate(diagonals) if not kept), nb)
            columns = pattern.vert[h, :int(pattern.n_vert[0, h])].tolist()
            for i in range(a // B, -(-e // B)):
                slash_tiles = sum(diagonals[:i + 1])
                bars = -(-sum(c // B <= i - run for c in columns) // chunk)
                total += slash_tiles * B * B + bars * B * chunk
                work += slash_tiles * slash_price + bars * bar_price
    return total, work


def recompute_worker(rank, world, strategy, transfer):
    """Activation checkpointing recomputes core attention in backward: the layer's patterns are reused."""
    from torch.utils.checkpoint import checkpoint

    pieces = make_cases(world)[0][1]
    plan = plans(pieces)[strategy]
    data = global_inputs(pieces)
    grads = []
    for recompute in (False, True):
        q, k, v, dout = (local_rows(data, pieces[rank], i).clone() for i in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)
        attention = CoreAttention(plan, sparse=replace(CONFIG, kv_transfer=transfer))
        comm_stats.reset()
        fn = lambda q, k, v: attention(q, k, v, layer=3)
        out = checkpoint(fn, q, k, v, use_reentrant=False) if recompute else fn(q, k, v)
        out.backward(dout)
        calls = {tag: comm_stats.by_tag.get(tag, [0])[0] for tag in ("sparse_pattern", "sparse_kv_marks", "sparse_kv")}
        grads.append((q.grad, k.grad, v.grad, calls))
    return grads


@pytest.mark.parametrize("strategy, transfer", [("cad", "prefix"), ("percp", "read")])
def test_recompute_reuses_the_forward_patterns(strategy, transfer):
    for plain, recomputed in run_distributed(recompute_worker, 2, strategy, transfer):
        # One pattern exchange, not a second one in the recompute; with "read" the marks are kept
        # too, and only the rows read are fetched again.
        assert plain[3]["sparse_pattern"] == recomputed[3]["sparse_pattern"] == 1
        if transfer == "read":
            assert plain[3]["sparse_kv_marks"] == recomputed[3]["sparse_kv_marks"] == 1
            assert (plain[3]["sparse_kv"], recomputed[3]["sparse_kv"]) == (1, 2)
        for a, b in zip(plain[:3], recomputed[:3]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def mismatched_options_worker(rank, world):
    """Rank 1 asks for a different coverage: the exchanges would be sized differently on each rank."""
    from dataclasses import replace

    from attnpool.errors import ConfigError

    pieces = make_cases(world)[0][1]
    q, k, v, _ = (local_rows(global_inputs(pieces), pieces[rank], i) for i in range(4))
    config = CONFIG if rank == 0 else replace(CONFIG, coverage=0.8)
    try:
        CoreAttention(plans(pieces)["cad"], sparse=config)(q, k, v, layer=0)
    except ConfigError as exc:
        return str(exc)
    return None


def test_mismatched_sparse_options_fail_on_every_rank():
    for message in run_distributed(mismatched_options_worker, 2):
        assert message is not None and "different plans, sparse options or nodes" in message, message


def coefficients_path_worker(rank, world):
    """Each rank reads the same calibration from a path of its own, as nodes may: not a mismatch (the
    coefficients price the plan, whose fingerprint is compared)."""
    import json
    import tempfile
    from dataclasses import replace

    from attnpool.sparse.cost import H200_MEASURED

    pieces = make_cases(world)[0][1]
    q, k, v, _ = (local_rows(global_inputs(pieces), pieces[rank], i) for i in range(4))
    with tempfile.TemporaryDirectory(prefix=f"rank{rank}-") as tmp:
        path = f"{tmp}/sparse_cost_coefficients.json"
        with open(path, "w") as f:
            json.dump(H200_MEASURED.to_json(), f)
        out = CoreAttention(plans(pieces)["cad"], sparse=replace(CONFIG, cost_coefficients=path))(q, k, v, layer=0)
    return tuple(out.shape)


def test_same_coefficients_at_other_paths_agree():
    shapes = run_distributed(coefficients_path_worker, 2)
    assert all(len(shape) == 3 for shape in shapes)


def test_kernel_clock_times_each_call_of_a_timed_backend():
    """The clock counts the calls of the backends it timed, forward and backward, and nothing else."""
    def slow(seconds):
        def fn(q, *args, **kwargs):
            time.sleep(seconds)
            return q
        return fn

    clock = KernelClock()
    plain = Backend("slow", slow(0.02), slow(0.03))
    timed = clock.timed(plain)
    q = torch.zeros(1)
    plain.forward(q)  # untimed
    assert clock.seconds() == 0.0
    timed.forward(q, into=None)
    timed.backward(q)
    assert 0.05 <= clock.seconds() < 0.5
    assert timed.name == plain.name and timed.positions is None


def _recording(backend: Backend, calls: list, kind: str) -> Backend:
    """``backend``, noting (kind, the segments' query lengths) of every call it gets."""
    def note(fn):
        def call(*args, **kwargs):
            cu_q = args[6] if fn is backend.backward else args[3]  # (dout, q, k, v, out, lse, cu_q, ...)
            calls.append((kind, np.diff(cu_q.numpy()).tolist()))
            return fn(*args, **kwargs)
        return call
    return Backend(kind, note(backend.forward), note(backend.backward))


@pytest.mark.parametrize("segments", [6, 60])
def test_split_backend_computes_what_one_call_computes(segments):
    """A server's call split into its long documents' segments and its short ones' (interleaved, as cad leaves them),
    each part through its own backend, gives one call's outputs and gradients, and each backend gets its own part's
    segments alone: with few runs of segments the parts' rows are copied run by run, with more than MAX_ROW_RUNS
    through their index."""
    from attnpool.kernels import reference
    from attnpool.runtime.dispatch import MAX_ROW_RUNS, SegmentRows
    from attnpool.runtime.sparse import split_backend

    rng = np.random.default_rng(segments)
    q_len = rng.integers(1, 9, segments)
    k_len = q_len + rng.integers(0, 6, segments)  # each segment's queries are the last of its keys
    keep = np.arange(segments) % 3 == 1  # the "sparse" segments, never adjacent
    parts = [SegmentRows.of(q_len, k_len, subset, "cpu") for subset in (keep, ~keep)]
    assert all((p.q_rows.runs is None) == (segments > 3 * MAX_ROW_RUNS) for p in parts)  # a run in every 3
    cu = lambda n: torch.tensor(np.r_[0, np.cumsum(n)], dtype=torch.int32)
    q = torch.randn(int(q_len.sum()), 4, 8, dtype=torch.float64)
    k, v = (torch.randn(int(k_len.sum()), 2, 8, dtype=torch.float64) for _ in range(2))
    dout = torch.randn_like(q)
    args = (cu(q_len), cu(k_len), int(q_len.max()), int(k_len.max()))
    one, calls = reference.BACKEND, []
    split = split_backend(_recording(one, calls, "sparse"), _recording(one, calls, "dense"), *parts)
    (out, lse), (want_out, want_lse) = split.forward(q, k, v, *args), one.forward(q, k, v, *args)
    assert torch.allclose(out, want_out) and torch.allclose(lse, want_lse)
    for got, want in zip(split.backward(dout, q, k, v, out, lse, *args), one.backward(dout, q, k, v, out, lse, *args)):
        assert torch.allclose(got, want)
    own = {"sparse": q_len[keep].tolist(), "dense": q_len[~keep].tolist()}
    assert calls == [(kind, own[kind]) for _ in range(2) for kind in ("sparse", "dense")]


def test_served_backend_sends_long_documents_to_the_sparse_kernel_and_short_ones_to_the_dense():
    """A server's call (runtime.sparse.served_backend) over a plan's long and short documents: the long ones'
    segments go to the sparse kernel bound to their patterns, the short ones' to the dense backend; ``wrap`` sees
    each kind's backend; a server without long documents gets the dense backend alone."""
    from attnpool.kernels import reference
    from attnpool.runtime.sparse import served_backend
    from attnpool.sparse.pattern import estimate_untrained, pack_pattern, unpack_patterns

    pieces = linear_layout([600, 90, 450, 120, 70, 150, 150, 150, 130], 3)  # rank 2: short documents alone
    plan = plan_attention(pieces, "local", cost_model="pairs")
    doc_len = plan.pieces.doc_len
    pattern = estimate_untrained(doc_len, N_Q, HEAD_DIM, CONFIG, seed=0, num_kv_heads=N_KV)
    kinds = []
    for rank in range(3):
        routes = PatternRoutes.build(plan, rank, N_Q, CONFIG, "cpu")
        assert np.array_equal(routes.served_lens, doc_len[routes.served_docs])
        assert all(doc_len[routes.served_docs] >= CONFIG.min_doc_len)
        doc, q_len, k_len = plan.kernel_segments(rank)
        calls, wrapped = [], []
        served = None
        if len(routes.served_docs):  # the served documents' rows of the batch's pattern, as the exchange leaves them
            served = unpack_patterns(pack_pattern(pattern, routes.served_docs, routes.served_lens, CONFIG),
                                     routes.served_lens, N_Q, CONFIG)
        backend = served_backend(served, routes, reference.BACKEND, CONFIG,
                                 wrap=lambda b, kind: wrapped.append(kind) or _recording(b, calls, kind))
        cu = lambda n: torch.tensor(np.r_[0, np.cumsum(n)], dtype=torch.int32)
        q = torch.randn(int(q_len.sum()), N_Q, HEAD_DIM, dtype=torch.float64)
        k, v = (torch.randn(int(k_len.sum()), N_KV, HEAD_DIM, dtype=torch.float64) for _ in range(2))
        backend.forward(q, k, v, cu(q_len), cu(k_len), int(q_len.max()), int(k_len.max()))
        long = doc_len[doc] >= CONFIG.min_doc_len
        expected = [(kind, q_len[mask].tolist()) for kind, mask in (("sparse", long), ("dense", ~long)) if mask.any()]
        assert calls == expected and wrapped == [kind for kind, _ in expected]
        assert (served is None) == (not long.any())
        kinds.append(wrapped)
    assert kinds == [["sparse", "dense"], ["sparse", "dense"], ["dense"]]
