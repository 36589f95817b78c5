"""Ulysses (head-parallel) core attention on gloo against the single-process float64 reference, its bytes and
what it saves, the planner's view of it, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnpool import ConfigError, plan_attention
from attnpool.comm import comm_stats
from attnpool.plan import AttentionShape, PairsCost, linear_layout, linear_table
from attnpool.plan.metrics import PlanMetrics
from attnpool.plan.ulysses import kv_heads_per_rank, ulysses_traffic
from attnpool.runtime import core_attention
from dist_harness import run_distributed
from test_runtime import HEAD_DIM, case_seed, global_inputs, local_rows, reference, rel_err

# (query heads, KV heads): KV heads split over the ranks, and (4 ranks) one KV head replicated to two ranks each
HEADS = {"gqa": (8, 4), "gqa-replicated": (8, 2), "mha": (4, 4)}


def make_cases(world: int):
    """(name, pieces_per_rank): a document over every rank, odd lengths; and a rank holding no tokens with the
    documents out of the exchange's order (rank 0's last)."""
    rng = np.random.default_rng(world)
    lens = rng.integers(1, 400, size=2 * world).tolist()
    lens.insert(len(lens) // 2, world * 150 + 13)
    cases = [("linear", linear_layout(lens, world))]
    empty_rank = linear_layout(rng.integers(1, 300, size=2 * world).tolist(), world - 1) + [[]]
    cases.append(("empty-rank", [empty_rank[-1]] + empty_rank[1:-1] + [empty_rank[0]]))
    return cases


def worker(rank, world):
    results = {}
    for case, pieces in make_cases(world):
        for heads, (n_q, n_kv) in HEADS.items():
            plan = plan_attention(pieces, "ulysses", cost_model="pairs", shape=AttentionShape(n_q, n_kv, HEAD_DIM, 4))
            data = global_inputs(pieces, n_q, n_kv, seed=case_seed(case, heads))
            q, k, v, dout = (local_rows(data, pieces[rank], i).float() for i in range(4))
            for t in (q, k, v):
                t.requires_grad_(True)
            comm_stats.reset()
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                out = core_attention(q, k, v, plan)
            forward_bytes = comm_stats.bytes_sent
            out.backward(dout)
            results[(case, heads)] = dict(
                out=out.detach().double(), dq=q.grad.double(), dk=k.grad.double(), dv=v.grad.double(),
                forward_bytes=forward_bytes, bytes=comm_stats.bytes_sent, calls=comm_stats.calls,
                saved_numel=sum(t.numel() for t in saved if t.is_floating_point()),
                saved_inputs=any(t.data_ptr() == x.data_ptr() for t in saved for x in (q, k, v) if x.numel()))
    return results


@pytest.fixture(scope="module")
def world_results():
    return 4, run_distributed(worker, 4)


def test_outputs_and_grads_match_the_float64_reference(world_results):
    world, results = world_results
    for case, pieces in make_cases(world):
        for heads, (n_q, n_kv) in HEADS.items():
            ref = reference(pieces, n_q, n_kv, seed=case_seed(case, heads))
            for rank in range(world):
                got = results[rank][(case, heads)]
                for name in ("out", "dq", "dk", "dv"):
                    if ref[rank][name].numel():
                        assert rel_err(got[name], ref[rank][name]) <= 1e-5, (world, case, heads, rank, name)


def test_bytes_and_saved_tensors_are_what_the_plan_says(world_results):
    """Forward: one exchange of Q, K and V and one of the output, as many bytes as plan.ulysses counts; backward
    the same again. Saved: the kernel's inputs and output on this rank's heads and its LSE, not the rank's q, k, v."""
    world, results = world_results
    for case, pieces in make_cases(world):
        for heads, (n_q, n_kv) in HEADS.items():
            plan = plan_attention(pieces, "ulysses", cost_model="pairs", shape=AttentionShape(n_q, n_kv, HEAD_DIM, 4))
            q_out, kv_out, o_back = ulysses_traffic(plan, AttentionShape(n_q, n_kv, HEAD_DIM, 4))
            got = [results[rank][(case, heads)] for rank in range(world)]
            # backward sends what forward received: the same bytes over all ranks
            assert sum(g["bytes"] for g in got) == 2 * sum(g["forward_bytes"] for g in got)
            for rank, got in enumerate(got):
                assert got["calls"] == 4
                assert got["forward_bytes"] == q_out[rank] + kv_out[rank] + o_back[rank], (case, heads, rank)
                assert not got["saved_inputs"]
                total, heads_here = int(plan.pieces.tokens_per_rank.sum()), n_q // world
                # Q, output, K and V of every token on this rank's heads; LSE
                expected = total * ((2 * heads_here + 2 * kv_heads_per_rank(world, n_kv)) * HEAD_DIM + heads_here)
                assert got["saved_numel"] == expected, (case, heads, rank)


def test_every_rank_carries_the_same_work_and_moves_every_token():
    rng = np.random.default_rng(0)
    lens = [40_000] + rng.integers(100, 3000, size=30).tolist()
    table = linear_table(lens, 8, sum(lens) // 8 + 1)
    shape = AttentionShape(32, 8, 128, 2)
    local = PlanMetrics.of(plan_attention(table, "local", cost_model="pairs", shape=shape), PairsCost(), shape)
    ulysses = PlanMetrics.of(plan_attention(table, "ulysses", cost_model="pairs", shape=shape), PairsCost(), shape)
    assert local.imbalance_after > 2.5 and ulysses.imbalance_after == pytest.approx(1.0)
    assert sum(ulysses.load_after) == pytest.approx(sum(local.load_after))
    # 7/8 of every token's Q, K, V and O cross: 32 x 128, 2 x 8 x 128 and 32 x 128 bf16 values
    assert ulysses.bytes_moved == pytest.approx(sum(lens) * 7 / 8 * (8192 + 4096 + 8192), rel=1e-3)


def test_a_degree_that_does_not_split_the_heads_is_refused():
    table = linear_table([300, 200], 3, 200)
    with pytest.raises(ConfigError, match="strategy=.ulysses.: 3 ranks cannot split 32 query heads"):
        plan_attention(table, "ulysses", cost_model="pairs", shape=AttentionShape(32, 8, 128, 2))
    table = linear_table([300, 200], 4, 200)
    with pytest.raises(ConfigError, match="4 ranks cannot split 6 KV heads"):
        plan_attention(table, "ulysses", cost_model="pairs", shape=AttentionShape(12, 6, 128, 2))


# --- Training ---------------------------------------------------------------------------------------------


def _train_local_and_ulysses(rank, world, out):
    from test_train import full_weights, tiny_config

    from attnpool.train import train

    results = {}
    for layout in (dict(), dict(tp=2), dict(pp=2, microbatches=2)):
        for strategy in ("local", "ulysses"):
            name = " ".join([strategy] + [f"{k}={v}" for k, v in layout.items()])
            result = train(tiny_config(f"{out}/{name.replace(' ', '-')}", steps=3, attention=strategy, **layout))
            results[name] = (result.rows, full_weights(result.model) if "pp" not in layout else None)
    return results


def test_ulysses_trains_as_local_does_with_tp_and_pp(tmp_path):
    """4 gloo ranks, 4 query heads and 2 KV heads: over dp=4 each KV head goes to two ranks; under tp=2 x dp=2
    each tp rank's one KV head to both dp ranks; under pp=2 x dp=2 each stage's dp pair splits the heads. Each
    against local attention in the same layout (which sees the same batches)."""
    from test_train import rel_diff

    results = run_distributed(_train_local_and_ulysses, 4, str(tmp_path))[0]
    for name, (rows, weights) in results.items():
        ref_rows, ref_weights = results[name.replace("ulysses", "local")]
        assert rel_diff([r["loss"] for r in rows], [r["loss"] for r in ref_rows]) <= 1e-4, name
        for key, w in (ref_weights or {}).items():
            torch.testing.assert_close(weights[key], w, rtol=1e-3, atol=1e-4, msg=f"{name}: {key}")
    assert all(r["imbalance_after"] == pytest.approx(1.0) for r in results["ulysses"][0])
    assert all(r["comm_bytes"] > 0 for r in results["ulysses"][0])
