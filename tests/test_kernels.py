"""Kernel backends against an independent dense float64 reference (CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpool.errors import ConfigError
from attnpool.kernels import BACKENDS, Backend, attention, flash, get_backend, reference

INF = float("inf")


# --- an independent dense reference: one masked (q_len x k_len) matrix per segment ---

def dense_attention(q, k, v, segments, scale=None):
    """Causal bottom-right attention in float64 with autograd; returns (out, lse).

    Rows that see no key get out = 0, lse = -inf and no graph at all, so their
    gradients are exactly zero.
    """
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    q0 = k0 = 0
    for q_len, k_len in segments:
        qs, ks, vs = q[q0:q0 + q_len], k[k0:k0 + k_len], v[k0:k0 + k_len]
        blind = min(q_len, max(0, q_len - k_len))  # leading rows that see no key
        outs.append(torch.zeros(blind, q.shape[1], q.shape[2], dtype=q.dtype))
        lses.append(torch.full((q.shape[1], blind), -INF, dtype=q.dtype))
        if q_len > blind:
            kh = ks.repeat_interleave(group, dim=1).transpose(0, 1)   # (H_q, k_len, D)
            vh = vs.repeat_interleave(group, dim=1).transpose(0, 1)
            qh = qs[blind:].transpose(0, 1)                           # (H_q, rows, D)
            scores = scale * qh @ kh.transpose(1, 2)
            rows = torch.arange(blind, q_len)[:, None]
            keys = torch.arange(k_len)[None, :]
            scores = scores.masked_fill(keys > k_len - q_len + rows, -INF)
            lses.append(torch.logsumexp(scores, dim=-1))
            outs.append((torch.softmax(scores, dim=-1) @ vh).transpose(0, 1))
        q0 += q_len
        k0 += k_len
    return torch.cat(outs), torch.cat(lses, dim=1)


def make_inputs(segments, n_q, n_kv, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t_q = sum(s[0] for s in segments)
    t_k = sum(s[1] for s in segments)
    q = torch.randn(t_q, n_q, dim, generator=gen).to(dtype)
    k = torch.randn(t_k, n_kv, dim, generator=gen).to(dtype)
    v = torch.randn(t_k, n_kv, dim, generator=gen).to(dtype)
    dout = torch.randn(t_q, n_q, dim, generator=gen).to(dtype)
    cu_q = torch.tensor([0] + [sum(s[0] for s in segments[:i + 1]) for i in range(len(segments))],
                        dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(s[1] for s in segments[:i + 1]) for i in range(len(segments))],
                        dtype=torch.int32)
    max_q = max((s[0] for s in segments), default=0)
    max_k = max((s[1] for s in segments), default=0)
    return q, k, v, dout, cu_q, cu_k, max_q, max_k


def dense_with_grads(q, k, v, dout, segments, scale=None):
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, lse = dense_attention(*leaves, segments, scale)
    if not out.requires_grad:  # no row sees a key: nothing depends on q, k, v
        return out.detach(), lse.detach(), [torch.zeros_like(x) for x in leaves]
    grads = torch.autograd.grad(out, leaves, dout.double(), allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]
    return out.detach(), lse.detach(), grads


def rel_error(got, want, floor=0.1):
    """Max abs error over the exact values' scale, taken as at least ``floor``: the inputs are unit-scale, so
    float32 rounds each term of a sum (of order 0.1-1) to ~1e-7 absolute, and a result that cancels to far below its terms
    (a 2-token segment's dq, ~1e-3) keeps that absolute error; its relative error says nothing."""
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), "-inf rows differ"
    if not finite.any():
        return 0.0
    diff = (got[finite] - want[finite]).abs().max().item()
    return diff / max(want[finite].abs().max().item(), floor)


def check_backend_against_dense(segments, n_q, n_kv, dim, dtype, tol, scale=None, seed=0):
    q, k, v, dout, cu_q, cu_k, max_q, max_k = make_inputs(segments, n_q, n_kv, dim, dtype, seed)
    want_out, want_lse, want_grads = dense_with_grads(q, k, v, dout, segments, scale)
    out, lse = reference.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.shape == (n_q, q.shape[0])
    assert rel_error(out, want_out) <= tol
    assert rel_error(lse, want_lse) <= tol
    grads = reference.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=scale)
    for name, got, want, like in zip("qkv", grads, want_grads, (q, k, v)):
        assert got.dtype == like.dtype and got.shape == like.shape, name
        assert rel_error(got, want) <= tol, f"d{name}"


# Segments as (q_len, k_len): q_len 0, q_len == k_len, q_len < k_len, k_len 0,
# q_len > k_len (leading rows see no key), odd lengths.
MIXED_SEGMENTS = [(5, 5), (0, 7), (3, 11), (0, 0), (4, 0), (13, 13), (6, 4), (1, 1), (9, 23)]
HEADS = [(4, 4), (4, 2), (4, 1), (1, 1)]


@pytest.mark.parametrize("n_q,n_kv", HEADS)
def test_reference_float32_matches_dense(n_q, n_kv):
    check_backend_against_dense(MIXED_SEGMENTS, n_q, n_kv, 8, torch.float32, tol=1e-5)


def test_reference_float64_and_custom_scale():
    check_backend_against_dense(MIXED_SEGMENTS, 4, 2, 8, torch.float64, tol=1e-12, scale=0.3)


@pytest.mark.parametrize("n_q,n_kv", [(4, 2), (2, 2)])
def test_reference_bfloat16_inputs(n_q, n_kv):
    check_backend_against_dense(MIXED_SEGMENTS, n_q, n_kv, 16, torch.bfloat16, tol=2e-2)


def test_reference_chunks_give_the_same_answer(monkeypatch):
    segments = [(17, 17), (10, 29), (12, 5)]
    monkeypatch.setattr(reference, "MAX_CHUNK_ROWS", 3)
    check_backend_against_dense(segments, 4, 2, 8, torch.float32, tol=1e-5)
    monkeypatch.setattr(reference, "MAX_SCORE_ELEMENTS", 1)  # one row per chunk
    check_backend_against_dense(segments, 4, 2, 8, torch.float32, tol=1e-5)


def test_rows_without_keys():
    segments = [(3, 0), (5, 2), (2, 2)]
    q, k, v, dout, cu_q, cu_k, max_q, max_k = make_inputs(segments, 4, 2, 8, torch.float32)
    out, lse = reference.forward(q, k, v, cu_q, cu_k, max_q, max_k)
    blind = [0, 1, 2, 3, 4, 5]  # all 3 rows of segment 0, first 3 rows of segment 1
    assert torch.all(lse[:, blind] == -INF)
    assert torch.all(torch.isfinite(lse[:, 6:]))
    assert torch.all(out[blind] == 0)
    dq, dk, dv = reference.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k)
    assert torch.all(dq[blind] == 0)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_empty_batch():
    q, k, v, dout, cu_q, cu_k, _, _ = make_inputs([(0, 0)], 2, 1, 8, torch.float32)
    out, lse = reference.forward(q, k, v, cu_q, cu_k, 0, 0)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    dq, dk, dv = reference.backward(dout, q, k, v, out, lse, cu_q, cu_k, 0, 0)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_autograd_wrapper_equals_explicit_backward():
    q, k, v, dout, cu_q, cu_k, max_q, max_k = make_inputs(MIXED_SEGMENTS, 4, 2, 8, torch.float32)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = attention(*leaves, cu_q, cu_k, max_q, max_k, backend="reference")
    assert not lse.requires_grad
    grads = torch.autograd.grad(out, leaves, dout)
    out2, lse2 = reference.forward(q, k, v, cu_q, cu_k, max_q, max_k)
    assert torch.equal(out.detach(), out2) and torch.equal(lse, lse2)
    explicit = reference.backward(dout, q, k, v, out2, lse2, cu_q, cu_k, max_q, max_k)
    for got, want in zip(grads, explicit):
        assert torch.equal(got, want)


def test_autograd_wrapper_gradcheck_float64():
    segments = [(2, 3), (3, 2), (1, 1)]
    q, k, v, _, cu_q, cu_k, max_q, max_k = make_inputs(segments, 2, 1, 4, torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    fn = lambda q, k, v: attention(q, k, v, cu_q, cu_k, max_q, max_k, backend="reference")[0]
    assert torch.autograd.gradcheck(fn, leaves)


def test_get_backend():
    assert BACKENDS == ("reference", "flash", "fa4")
    assert get_backend(None, "cpu").name == "reference"
    assert get_backend("reference", torch.device("cpu")) is reference.BACKEND
    assert isinstance(get_backend("reference", "cpu"), Backend)
    with pytest.raises(ConfigError) as err:
        get_backend("flash", "cpu")
    assert err.value.field == "backend" and err.value.value == "flash"
    with pytest.raises(ConfigError) as err:
        get_backend("triton", "cpu")
    assert err.value.value == "triton"
    with pytest.raises(ConfigError):
        attention(*make_inputs([(1, 1)], 1, 1, 4, torch.float32)[:3],
                  torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                  1, 1, backend="nope")


def test_bad_inputs_are_refused():
    q, k, v, _, cu_q, cu_k, max_q, max_k = make_inputs([(2, 3)], 3, 2, 4, torch.float32)
    with pytest.raises(ConfigError, match="heads"):
        reference.forward(q, k, v, cu_q, cu_k, max_q, max_k)
    q, k, v, _, cu_q, cu_k, max_q, max_k = make_inputs([(2, 3)], 2, 2, 4, torch.float32)
    with pytest.raises(ConfigError, match="cu_q"):
        reference.forward(q, k, v, cu_q.long(), cu_k, max_q, max_k)


def test_flash_shim_reads_this_torch():
    """Runs on CPU: the signature shim and the backward op lookup, not the kernel."""
    shim = flash._varlen()
    assert shim.fixed_kwargs.get("window_size", (-1, 0)) == (-1, 0)
    assert isinstance(shim.fixed_kwargs.get("window_size", ()), tuple)
    assert flash.backward_path() == "direct op"
    q, k, v, _, cu_q, cu_k, max_q, max_k = make_inputs([(2, 3)], 2, 2, 8, torch.float32)
    with pytest.raises(ConfigError):
        flash.forward(q, k, v, cu_q, cu_k, max_q, max_k)


@st.composite
def attention_cases(draw):
    n_q, n_kv = draw(st.sampled_from(HEADS))
    dim = draw(st.sampled_from([4, 8]))
    segments = []
    for _ in range(draw(st.integers(1, 4))):
        k_len = draw(st.integers(0, 12))
        q_len = draw(st.integers(0, k_len + 2))
        segments.append((q_len, k_len))
    return segments, n_q, n_kv, dim, draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None)
@given(attention_cases())
def test_reference_property(case):
    segments, n_q, n_kv, dim, seed = case
    check_backend_against_dense(segments, n_q, n_kv, dim, torch.float32, tol=1e-5, seed=seed)


# --- queries at given positions of one document (Backend.positions) ---

def dense_at_positions(q, k, v, positions, scale=None):
    """float64 attention with the explicit mask key <= position, autograd; (out, lse)."""
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    kh, vh = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))
    scores = scale * q.transpose(0, 1) @ kh.transpose(1, 2)
    hidden = torch.arange(k.shape[0])[None, :] > torch.as_tensor(positions)[:, None]
    scores = scores.masked_fill(hidden, -INF)
    return (torch.softmax(scores, dim=-1) @ vh).transpose(0, 1), torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize("chunk_rows", [1024, 7])
def test_reference_positions_match_dense(monkeypatch, chunk_rows):
    """Non-adjacent shards of one document, out of nothing but their positions: the reference's PositionKernel
    against the dense masked float64 attention, forward and backward (into= too)."""
    monkeypatch.setattr(reference, "MAX_CHUNK_ROWS", chunk_rows)
    positions = torch.cat([torch.arange(3, 20), torch.arange(40, 41), torch.arange(70, 101)])
    num_keys = 101
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(len(positions), 4, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(num_keys, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    kernel = reference.BACKEND.positions
    handle = kernel.prepare(positions.numpy(), num_keys, "cpu")
    out, lse = kernel.forward(q, k, v, handle, scale=0.3)
    into = tuple(torch.empty_like(x) for x in (q, k, v))
    got = kernel.backward(dout, q, k, v, out, lse, handle, scale=0.3, into=into)
    assert all(g is t for g, t in zip(got, into))
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    want_out, want_lse = dense_at_positions(qr, kr, vr, positions, scale=0.3)
    want_out.backward(dout)
    torch.testing.assert_close(out, want_out.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse.detach(), rtol=1e-10, atol=1e-10)
    for g, w in zip(got, (qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_positions_are_checked():
    kernel = reference.BACKEND.positions
    with pytest.raises(ConfigError, match="positions"):
        kernel.prepare([0, 5, 9], 9, "cpu")
    with pytest.raises(ConfigError, match="positions"):
        kernel.prepare([-1, 2], 9, "cpu")
    handle = kernel.prepare([0, 5, 8], 9, "cpu")
    q, k = torch.zeros(3, 2, 4), torch.zeros(9, 1, 4)
    with pytest.raises(ConfigError, match=r"k.shape\[0\]"):
        kernel.forward(q, k[:8], k[:8], handle)
    with pytest.raises(ConfigError, match=r"q.shape\[0\]"):
        kernel.forward(q[:2], k, k, handle)


@pytest.mark.parametrize("spans, num_keys", [
    ([(0, 100), (500, 777), (1200, 1201), (2000, 3001)], 3001),
    ([(1024, 2048), (3072, 4096)], 4096),
    ([(5, 6)], 300),
    ([(0, 129), (200, 457)], 4000),
    ([(0, 3000)], 3000),
])
def test_fa4_position_tables_cover_exactly_the_visible_pairs(spans, num_keys):
    """fa4's block-sparse tables (built from ranges, so checked here on the CPU): forward, per query block,
    the key blocks it sees in part and in full; backward, per key block, the query blocks. A block is full
    only where every row sees every key of it, every block with a visible pair is full or partial, never
    both, and each row lists its blocks ascending."""
    import numpy as np

    from attnpool.kernels import fa4

    B = fa4.POSITION_BLOCK
    positions = np.concatenate([np.arange(a, b) for a, b in spans])
    visible = np.arange(num_keys)[None, :] <= positions[:, None]
    m_blocks, n_blocks = -(-len(positions) // B), -(-num_keys // B)
    want_full = np.zeros((m_blocks, n_blocks), bool)
    want_seen = np.zeros((m_blocks, n_blocks), bool)
    for m in range(m_blocks):
        for n in range(n_blocks):
            tile = visible[m * B:(m + 1) * B, n * B:(n + 1) * B]
            want_full[m, n] = tile.shape[1] == B and tile.all()
            want_seen[m, n] = tile.any()
    full_end, seen_end, partial_start, full_start = fa4.position_block_ranges(positions, num_keys)

    def listed(count, index):  # the (rows, cols) bool table a (count, index) pair lists, checking the order
        count, index = count[0, 0].numpy(), index[0, 0].numpy()
        table = np.zeros((len(count), index.shape[1]), bool)
        for row, (c, columns) in enumerate(zip(count, index)):
            assert list(columns[:c]) == sorted(set(columns[:c]))
            table[row, columns[:c]] = True
        return table

    partial_fwd = listed(*fa4.range_table(full_end, seen_end, n_blocks, "cpu"))
    full_fwd = listed(*fa4.range_table(np.zeros(m_blocks, dtype=np.int64), full_end, n_blocks, "cpu"))
    partial_bwd = listed(*fa4.range_table(partial_start, full_start, m_blocks, "cpu"))
    full_bwd = listed(*fa4.range_table(full_start, np.full(n_blocks, m_blocks), m_blocks, "cpu"))
    assert np.array_equal(full_fwd, want_full) and np.array_equal(partial_fwd, want_seen & ~want_full)
    assert np.array_equal(full_bwd, want_full.T) and np.array_equal(partial_bwd, (want_seen & ~want_full).T)


def test_positions_must_increase():
    with pytest.raises(ConfigError, match="increasing"):
        reference.BACKEND.positions.prepare([0, 5, 5], 9, "cpu")


def test_fa4_position_kernel_runs_only_where_checked():
    """sm90 at head_dim <= 128 (where it was checked); elsewhere, the CPU included, the runtime copies."""
    from attnpool.kernels import fa4, serves_positions

    assert not fa4.supports_positions("cpu", 128) and not fa4.supports_positions(None, 128)
    assert not serves_positions("fa4", "cpu", 128) and not serves_positions("fa4", None, 128)
    assert serves_positions("reference", None, 256) and not serves_positions("flash", "cpu", 128)
    assert not serves_positions("auto", "cpu", 128)
