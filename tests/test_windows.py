"""Sliding windows and soft-capped scores (attention kinds): kernels, plans and distributed core attention, each
against float64 dense attention with the explicit window and soft-cap mask."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from attnpool import ConfigError, core_attention, plan_attention
from attnpool.kernels import flash, reference
from attnpool.plan import AttentionShape, linear_layout, linear_table
from attnpool.plan.cost import PairsCost, default_cost_model
from attnpool.plan.documents import key_start, prefix_pairs, prefix_pairs_inverse, window_pairs
from attnpool.plan.metrics import home_loads, imbalance, server_loads
from dist_harness import run_distributed

INF = float("inf")


def dense_windowed(q, k, v, segments, window=None, softcap=None, scale=None):
    """Attention per segment (queries the tail of its keys) in float64 with autograd, from an explicit mask: query
    row j sees key n where n <= k_len - q_len + j and, under a window, n > k_len - q_len + j - window."""
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    outs, q0, k0 = [], 0, 0
    for q_len, k_len in segments:
        qh = q[q0:q0 + q_len].transpose(0, 1)
        kh = k[k0:k0 + k_len].repeat_interleave(group, 1).transpose(0, 1)
        vh = v[k0:k0 + k_len].repeat_interleave(group, 1).transpose(0, 1)
        scores = scale * qh @ kh.transpose(1, 2)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        last = torch.arange(q_len)[:, None] + (k_len - q_len)
        keys = torch.arange(k_len)[None, :]
        hidden = keys > last
        if window is not None:
            hidden = hidden | (keys <= last - window)
        outs.append((torch.softmax(scores.masked_fill(hidden, -INF), -1) @ vh).transpose(0, 1))
        q0, k0 = q0 + q_len, k0 + k_len
    return torch.cat(outs)


def _inputs(segments, n_q=4, n_kv=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(s[0] for s in segments), sum(s[1] for s in segments)
    q, dout = (torch.randn(tq, n_q, dim, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(tk, n_kv, dim, generator=g, dtype=torch.float64) for _ in range(2))
    cu = [torch.tensor(np.r_[0, np.cumsum([s[i] for s in segments])], dtype=torch.int32) for i in (0, 1)]
    return q, k, v, dout, cu


def _dense_grads(q, k, v, dout, segments, **kind):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = dense_windowed(*leaves, segments, **kind)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


# windows larger than, equal to and smaller than the segments; a document shorter than the window; shards
# (queries the tail of longer keys) as the CA-task layout calls the kernel
SEGMENTS = [(40, 40), (7, 7), (16, 50), (33, 90), (1, 12)]
KINDS = [dict(window=5), dict(window=16), dict(window=40), dict(window=200), dict(softcap=2.0),
         dict(window=9, softcap=1.5)]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_reference_kernel_matches_dense_with_the_explicit_mask(kind):
    q, k, v, dout, (cu_q, cu_k) = _inputs(SEGMENTS)
    want = _dense_grads(q, k, v, dout, SEGMENTS, **kind)
    backend = reference.BACKEND.for_kind(kind.get("window"), kind.get("softcap"))
    max_q, max_k = max(s[0] for s in SEGMENTS), max(s[1] for s in SEGMENTS)
    out, lse = backend.forward(q, k, v, cu_q, cu_k, max_q, max_k)
    grads = backend.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k)
    for got, exact in zip((out, *grads), want):
        torch.testing.assert_close(got, exact, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS[:3] + KINDS[5:], ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_reference_position_kernel_matches_dense(kind):
    """Queries at given positions of one document over its keys, as a server's non-adjacent shards run."""
    n_keys, positions = 60, np.r_[np.arange(3, 11), np.arange(30, 38), np.arange(52, 60)]
    q, k, v, dout, _ = _inputs([(len(positions), n_keys)])
    # dense: every position as a one-row segment over its keys [0, position]
    segments = [(1, int(p) + 1) for p in positions]
    kk = torch.cat([k[:p + 1] for p in positions])
    vv = torch.cat([v[:p + 1] for p in positions])
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    kk = torch.cat([leaves[1][:p + 1] for p in positions])
    vv = torch.cat([leaves[2][:p + 1] for p in positions])
    want_out = dense_windowed(leaves[0], kk, vv, segments, **kind)
    want = (want_out.detach(), *torch.autograd.grad(want_out, leaves, dout))
    backend = reference.BACKEND.for_kind(kind.get("window"), kind.get("softcap"))
    handle = backend.positions.prepare(positions, n_keys, "cpu")
    out, lse = backend.positions.forward(q, k, v, handle)
    grads = backend.positions.backward(dout, q, k, v, out, lse, handle)
    for got, exact in zip((out, *grads), want):
        torch.testing.assert_close(got, exact, rtol=1e-10, atol=1e-10)


def test_backends_refuse_what_they_cannot_compute_by_name():
    with pytest.raises(ConfigError, match="softcap.*flash backend does not soft-cap"):
        flash.BACKEND.for_kind(None, 50.0)
    assert flash.BACKEND.for_kind(4096, None).kind == (4096, None)
    with pytest.raises(ConfigError, match="window.*does not compute sliding windows"):
        dataclasses.replace(reference.BACKEND, name="sparse", takes_window=False).for_kind(4096, None)
    assert reference.BACKEND.for_kind() is reference.BACKEND


# --- planning ---

def test_window_pairs_count_each_querys_visible_keys():
    for w in (None, 1, 3, 8, 100):
        for a in range(0, 20):
            for b in range(a, 24):
                brute = sum(min(i + 1, w or i + 1) for i in range(a, b))
                assert window_pairs(a, b, w) == brute
                assert window_pairs(np.array([a]), np.array([b]), w)[0] == brute
        x = np.arange(0, 300)
        assert np.allclose(prefix_pairs_inverse(prefix_pairs(x, w), w), x)


def test_a_windowed_plans_kv_is_each_tasks_window_merged_per_server():
    lens = [5000, 300, 9000, 1200, 40]
    table = linear_table(lens, 4)
    for strategy in ("local", "percp", "cad"):
        plan = plan_attention(table, strategy, cost_model="pairs", min_shard_tokens=128, window=1000)
        x = plan.kv_transfers()
        assert plan.window == 1000 and np.all(plan.task_key_start == key_start(plan.task_start, 1000))
        for r in range(4):
            mine = plan.server_tasks(r)
            starts, ends = plan.task_key_start[mine], plan.task_end[mine]
            needed = {(int(d), p) for d, s, e in zip(plan.task_doc[mine], starts, ends) for p in range(s, e)}
            at = x.server == r
            held = [(int(d), p) for d, s, n in zip(x.doc[at], x.start[at], x.length[at]) for p in range(s, s + n)]
            assert len(held) == len(set(held)) and set(held) == needed, (strategy, r)
        causal = plan_attention(table, strategy, cost_model="pairs", min_shard_tokens=128)
        xc = causal.kv_transfers()
        assert x.length.sum() < xc.length.sum()
        assert plan.fingerprint() != causal.fingerprint()


def test_cad_balances_windowed_work_at_scale():
    """64 servers x 512K tokens of prolong documents, Gemma-3-like windows: max/mean <= 1.03 for each kind."""
    from attnpool.data.lengths import sample_batches

    lens = sample_batches("prolong", 64 * 512 * 1024, 1, seed=0)[0]
    table = linear_table(lens, 64)
    model = default_cost_model()
    for window in (None, 1024, 4096):
        plan = plan_attention(table, "cad", window=window)
        assert imbalance(server_loads(plan, model)) <= 1.03, window
        assert imbalance(server_loads(plan, model)) <= imbalance(home_loads(table, model, window))


def test_windowed_cost_prices_the_windows_work():
    table = default_cost_model()
    assert PairsCost(64).cost1(0, 1000) == window_pairs(0, 1000, 64)
    # a task deep in a long document costs about the same however deep, under a window
    deep, deeper = table.windowed(4096).cost1(60_000, 61_024), table.windowed(4096).cost1(120_000, 121_024)
    assert deeper == pytest.approx(deep, rel=0.01)
    assert table.cost1(120_000, 121_024) > 10 * deeper


# --- distributed core attention ---

def _docs(world):
    rng = np.random.default_rng(7 + world)
    lens = rng.integers(1, 300, size=3 * world).tolist()
    lens.insert(len(lens) // 2, world * 150 + 13)  # spans every rank
    return lens


def _window_worker(rank, world):
    import attnpool.runtime.dispatch as dispatch

    dispatch.MIN_AVOIDED_KEYS_PER_CALL = dispatch.MIN_AVOIDED_FRACTION = 0
    pieces = linear_layout(_docs(world), world)
    results = {}
    for strategy, copies in (("local", False), ("percp", False), ("percp", True), ("cad", False), ("cad", True),
                             ("ulysses", False)):
        backend = dataclasses.replace(reference.BACKEND, positions=None) if copies else reference.BACKEND
        for window, softcap in ((None, 3.0), (40, None), (150, 2.0), (2000, None)):
            plan = plan_attention(pieces, strategy, cost_model="pairs", min_shard_tokens=32, window=window,
                                  shape=AttentionShape(4, 2, 8, 8))
            g = torch.Generator().manual_seed(11)
            tensors = {}
            docs = {p.doc_id: p for rank_pieces in pieces for p in rank_pieces}
            for p in sorted(docs.values(), key=lambda p: p.doc_id):
                tensors[p.doc_id] = [torch.randn(p.doc_len, h, 8, generator=g, dtype=torch.float64)
                                     for h in (4, 2, 2, 4)]
            q, k, v, dout = (torch.cat([tensors[p.doc_id][i][p.start:p.end] for p in pieces[rank]]) for i in range(4))
            for t in (q, k, v):
                t.requires_grad_(True)
            out = core_attention(q, k, v, plan, backend=backend, softcap=softcap)
            out.backward(dout)
            results[(strategy, copies, window, softcap)] = [x.detach() for x in (out, q.grad, k.grad, v.grad)]
    return results


def test_core_attention_under_windows_matches_dense_per_document(world=4):
    """Every strategy, windows shorter and longer than the shards and the documents, soft-caps, with and without
    the position kernel (a server's shards of one document in one call, or each its own keys copied)."""
    pieces = linear_layout(_docs(world), world)
    got = run_distributed(_window_worker, world)
    g = torch.Generator().manual_seed(11)
    docs = sorted({p.doc_id: p for rank_pieces in pieces for p in rank_pieces}.values(), key=lambda p: p.doc_id)
    data = {p.doc_id: [torch.randn(p.doc_len, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4)]
            for p in docs}
    for case in got[0]:
        window, softcap = case[2:]
        exact = {d: _dense_grads(*x, [(len(x[0]), len(x[0]))], window=window, softcap=softcap)
                 for d, x in data.items()}
        for rank in range(world):
            want = [torch.cat([exact[p.doc_id][i][p.start:p.end] for p in pieces[rank]]) for i in range(4)]
            for name, a, b in zip(("out", "dq", "dk", "dv"), got[rank][case], want):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"{case} rank {rank} {name}")


# --- training: a model whose layers differ in kind ---

# Gemma-3-like in small: two windowed layers to one global, soft-capped scores and output logits
KINDED = dict(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, sliding_window=24, layer_types="2/1",
              attn_softcap=20.0, final_softcap=15.0)


def _train_kinds(rank, world, out):
    from attnpool.train import TrainConfig, train

    def config(name, **overrides):
        values = dict(model="tiny", model_args=dict(KINDED), data="stdlib", tokens_per_rank=256, steps=4, lr=3e-3,
                      warmup_steps=1, cost_model="pairs", min_shard=16, device="cpu", progress=False,
                      out=f"{out}/{name}", checkpoint_every=-1)
        values.update(overrides)
        return TrainConfig(**values)

    runs = {"local": config("local", attention="local"), "cad": config("cad", attention="cad"),
            "cad-pingpong": config("cad-pingpong", attention="cad", pingpong=True, max_doc_len=160),
            "local-pingpong-ref": config("local-short", attention="local", max_doc_len=160),
            "ulysses": config("ulysses", attention="ulysses"),
            # 1F1B stages (dp = 1 on two ranks): each stage's layers run their kinds' plans by their model-wide index
            "pp": config("pp", attention="cad", pp=2, microbatches=2),
            "pp-local": config("pp-local", attention="local", pp=2, microbatches=2),
            "causal": config("causal", attention="local", model_args={**KINDED, "sliding_window": None,
                                                                      "attn_softcap": None, "final_softcap": None})}
    return {name: train(cfg).rows for name, cfg in runs.items()}


def test_cad_trains_a_model_of_mixed_kinds_as_local_does():
    """Losses of cad, ping-pong, ulysses and 1F1B stages equal local's within 1e-4 (float32, 2 gloo ranks), with
    windows shorter than the documents; without the kinds the losses differ (the windows and caps took effect)."""
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        results = run_distributed(_train_kinds, 2, out)[0]
    losses = {name: np.array([r["loss"] for r in rows]) for name, rows in results.items()}
    for name, ref in (("cad", "local"), ("ulysses", "local"), ("pp", "pp-local"),
                      ("cad-pingpong", "local-pingpong-ref")):
        assert np.max(np.abs(losses[name] - losses[ref]) / losses[ref]) <= 1e-4, (name, losses[name], losses[ref])
    assert np.max(np.abs(losses["causal"] - losses["local"])) > 1e-3
    assert all(r["comm_bytes"] > 0 for r in results["cad"])


def test_the_chunked_loss_soft_caps_the_logits_as_gemma_2_does():
    import torch.nn.functional as F

    from attnpool.model.llama import chunked_cross_entropy

    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[5] = -100
    logits = 3.0 * torch.tanh(h @ weight.T / 3.0)
    want = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(chunked_cross_entropy(h, weight, labels, chunk=8, softcap=3.0), want)
    assert not torch.allclose(chunked_cross_entropy(h, weight, labels, chunk=8), want)


def test_a_preset_with_a_window_in_every_layer_exports_as_mistral(tmp_path):
    """The export of a windowed preset loads in transformers and computes attnpool's logits (float32, documents
    several windows long); a preset whose layers mix kinds has no transformers architecture and is refused."""
    transformers = pytest.importorskip("transformers")
    from attnpool.model.config import model_config
    from attnpool.model.hf import config_to_hf, save_hf_checkpoint
    from attnpool.model.llama import Transformer
    from attnpool.runtime import plan_layer_kinds

    config = model_config("tiny", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=97,
                          sliding_window=8)
    torch.manual_seed(0)
    model = Transformer(config).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    save_hf_checkpoint(model, config, tmp_path / "m", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager").double().eval()
    assert hf.config.model_type == "mistral" and hf.config.sliding_window == 8
    docs = [torch.randint(0, 97, (n,)) for n in (30, 5, 17)]
    pieces = linear_layout([len(d) for d in docs], 1)
    with torch.no_grad():
        got = model(torch.cat(docs), torch.cat([torch.arange(len(d)) for d in docs]),
                    plan_layer_kinds(config.layer_kinds(), pieces, "local", cost_model="pairs"))
        want = torch.cat([hf(input_ids=d[None]).logits[0] for d in docs])
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()  # (the export's float32 weights)
    mixed = model_config("tiny", n_layers=2, sliding_window=8, layer_types="1/1")
    with pytest.raises(ConfigError, match="attention kinds"):
        config_to_hf(mixed)


def test_a_layer_refuses_a_core_attention_of_another_kind():
    """A causal layer given a windowed or soft-capped core attention is refused, as a windowed one given a causal
    core attention is; one of its own kind runs."""
    from attnpool.model import Transformer
    from attnpool.model.config import model_config
    from attnpool.runtime import CoreAttention

    pieces = linear_layout([40, 30], 1)
    tokens, positions = torch.randint(0, 256, (70,)), torch.cat([torch.arange(40), torch.arange(30)])
    causal = Transformer(model_config("tiny", **{**TINY_SHAPE, "n_layers": 1}))
    windowed = Transformer(model_config("tiny", **{**TINY_SHAPE, "n_layers": 1, "sliding_window": 8}))
    window_plan = plan_attention(pieces, "local", cost_model="pairs", window=8)
    causal_plan = plan_attention(pieces, "local", cost_model="pairs")
    for model, attention in ((causal, CoreAttention(window_plan)), (causal, CoreAttention(causal_plan, softcap=5.0)),
                             (windowed, CoreAttention(causal_plan))):
        with pytest.raises(ConfigError, match="attention kind"):
            model(tokens, positions, attention)
    with torch.no_grad():
        windowed(tokens, positions, CoreAttention(window_plan))


TINY_SHAPE = dict(dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64)


def test_memory_rows_average_what_layers_save_and_take_the_largest_call():
    """Over a 2/1 model's kinds: the unique KV a layer saves is the layers' mean, the keys one call reads the
    largest kind's (the global layers')."""
    from attnpool.data import DocumentStream, stdlib_corpus
    from attnpool.plan.metrics import AttentionRows
    from attnpool.runtime.dispatch import MAX_CAUSAL_CALL_SEGMENTS
    from attnpool.train import TrainConfig
    from attnpool.train.memory_check import layer_mean_rows
    from attnpool.train.planning import plan_microbatch
    from attnpool.train.spec import resolve_run_spec

    config = TrainConfig(model="tiny", model_args=dict(KINDED), data="stdlib", tokens_per_rank=1024, device="cpu",
                         attention="cad", cost_model="pairs", min_shard=16, nproc=4, progress=False)
    spec = resolve_run_spec(config, 4, torch.device("cpu"))
    stream = DocumentStream(stdlib_corpus(), 4, 1024, 0, None)
    (step,) = plan_microbatch(stream.next_batch(), spec)
    rows = layer_mean_rows(step, spec, copies=True)
    # (as the runtime serves them: a split document of a few segments as causal calls even without a position
    # kernel, the copies this backend makes only where one would be wanted)
    window, causal = (AttentionRows.of(step.plans[w], True, causal_call_segments=MAX_CAUSAL_CALL_SEGMENTS)
                      for w in (KINDED["sliding_window"], None))
    np.testing.assert_allclose(rows.unique_kv, (2 * window.unique_kv + causal.unique_kv) / 3)
    np.testing.assert_array_equal(rows.expanded_kv, np.maximum(window.expanded_kv, causal.expanded_kv))
    assert (window.unique_kv < causal.unique_kv).any()
