"""Vertical-slash sparse attention: estimation, attended set, CPU twin, Triton (interpreter), cost model."""

from __future__ import annotations

import math
import os

import background
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnpool.errors import ConfigError
from attnpool.kernels import attention, reference
from attnpool.kernels import sparse as sk
from attnpool.sparse import SparseConfig, VerticalSlashPattern, estimate_vertical_slash
from attnpool.sparse.cost import SparseCoefficients, SparseCost, fit_coefficients

INF = float("inf")
B = 16  # pattern block in these tests (128 on GPUs)
CHUNK = 16  # vertical chunk (64 on GPUs)


def cu(lengths):
    return torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32)


def small_config(**kw):
    base = dict(coverage=0.6, vertical_cap=24, slash_cap=20, min_doc_len=128, last_queries=16, sink_tokens=4,
                local_window=16, block=B, vertical_chunk=CHUNK)
    base.update(kw)
    return SparseConfig(**base)


def rope_like(lengths, n_q, n_kv, dim, seed=0, dtype=torch.float64):
    """q/k whose scores depend mostly on the distance (slashes), plus a sink key."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    pos = torch.cat([torch.arange(L) for L in lengths]).double()
    freqs = 1.0 / (50.0 ** (torch.arange(dim // 2).double() / (dim // 2)))
    ang = pos[:, None] * freqs[None, :]
    cos, sin = torch.cos(ang), torch.sin(ang)

    def rot(x):
        a, b = x[..., : dim // 2], x[..., dim // 2:]
        return torch.cat([a * cos[:, None] - b * sin[:, None], a * sin[:, None] + b * cos[:, None]], -1)

    u = torch.randn(n_q, dim, generator=g, dtype=torch.float64)
    w = u.view(n_kv, n_q // n_kv, dim).mean(1)
    q = rot(3.0 * u[None].expand(T, -1, -1) + 0.5 * torch.randn(T, n_q, dim, generator=g, dtype=torch.float64))
    k = rot(w[None].expand(T, -1, -1) + 0.5 * torch.randn(T, n_kv, dim, generator=g, dtype=torch.float64))
    starts = np.cumsum([0] + list(lengths[:-1]))
    k[starts] += 4.0 * u.view(n_kv, -1, dim).mean(1)  # sink tokens: every document's first key
    return q.to(dtype), k.to(dtype)


# --- config ---

@pytest.mark.parametrize("kw, field", [
    (dict(coverage=0.0), "sparse_coverage"), (dict(coverage=1.5), "sparse_coverage"),
    (dict(coverage=float("nan")), "sparse_coverage"), (dict(coverage=-0.1), "sparse_coverage"),
    (dict(vertical_cap=0), "sparse_vertical_cap"), (dict(slash_cap=-3), "sparse_slash_cap"),
    (dict(min_doc_len=-1), "sparse_min_doc_len"), (dict(dense_layers=-1), "dense_layers"),
    (dict(mode="block"), "sparse"), (dict(block=100), "sparse_block"), (dict(last_queries=0), "sparse_last_queries"),
    (dict(sink_tokens=5000), "sparse_sink_tokens"), (dict(kv_transfer="blocks"), "sparse_kv_transfer"),
])
def test_config_errors(kw, field):
    with pytest.raises(ConfigError) as err:
        SparseConfig(**kw)
    assert err.value.field == field
    assert repr(list(kw.values())[0]) in str(err.value) or field in str(err.value)


def test_config_defaults_and_layers():
    cfg = SparseConfig()
    assert (cfg.coverage, cfg.vertical_cap, cfg.slash_cap, cfg.min_doc_len, cfg.last_queries) == (0.9, 4096, 4096, 8192, 64)
    assert SparseConfig(coverage=1.0).coverage == 1.0
    cfg = SparseConfig(dense_layers=2)
    assert [cfg.is_sparse_layer(i) for i in range(4)] == [False, False, True, True]
    assert not SparseConfig(mode="none").is_sparse_layer(5)


# --- the attended set, by its definition ---

def brute_mask(diag, cols, q_len, k_len, block):
    """The attended set written as loops: c <= p and ((p//B - c//B) in diag or c in cols)."""
    m = torch.zeros(q_len, k_len, dtype=torch.bool)
    diag, cols = set(diag), set(cols)
    for j in range(q_len):
        p = k_len - q_len + j
        for c in range(min(p + 1, k_len)):
            if p >= 0 and ((p // block - c // block) in diag or c in cols):
                m[j, c] = True
    return m


def test_mask_matches_definition():
    pat = VerticalSlashPattern.from_lists([70, 40], [[[0, 2], [1, 3, 40]], [[], [2]]],
                                          [[[0, 5, 33, 60, 69], [17]], [[3], []]], block=B)
    assert pat.doc_lists(0)[0] == [[0, 2], [0, 1, 3]]  # 0 added, 40 out of range dropped
    for doc, (q_len, k_len) in [(0, (70, 70)), (0, (23, 50)), (1, (40, 40)), (1, (9, 3)), (0, (1, 64))]:
        m = pat.mask(doc, q_len, k_len)
        diag, cols = pat.doc_lists(doc)
        for h in range(2):
            assert torch.equal(m[h], brute_mask(diag[h], cols[h], q_len, k_len, B)), (doc, q_len, k_len, h)


def test_keys_read_is_the_union_of_the_attended_sets():
    """What kv_transfer="read" sends a task: every key some head attends from some of its queries."""
    g = torch.Generator().manual_seed(1)
    lens = [300, 77, 513, 16]
    pat = VerticalSlashPattern.random(lens, 3, B, n_slash=2, n_vertical=5, generator=g)
    doc, q_first, q_last, key, want = [], [], [], [], []
    for d, L in enumerate(lens):
        for _ in range(6):
            a = int(torch.randint(0, L, (1,), generator=g))
            b = int(torch.randint(a + 1, L + 1, (1,), generator=g))
            read = pat.mask(d, b - a, b).any(0).any(0)  # queries [a, b) over keys [0, b)
            for c in range(b):
                doc.append(d), q_first.append(a), q_last.append(b - 1), key.append(c), want.append(bool(read[c]))
    t = torch.tensor
    got = pat.keys_read(t(doc), t(q_first), t(q_last), t(key), sum(lens))
    assert torch.equal(got, t(want))
    assert 0.3 < float(t(want).float().mean()) < 0.95  # neither nothing nor everything is read


def test_full_pattern_is_causal_attention():
    segs = [(50, 50), (20, 70), (0, 9), (30, 30)]
    q, k = torch.randn(100, 4, 16, dtype=torch.float64), torch.randn(159, 2, 16, dtype=torch.float64)
    v = torch.randn(159, 2, 16, dtype=torch.float64)
    cu_q, cu_k = cu([s[0] for s in segs]), cu([s[1] for s in segs])
    pat = VerticalSlashPattern.full([50, 70, 9, 30], 4, B)
    out, lse = sk.forward(q, k, v, cu_q, cu_k, 50, 70, pattern=pat)
    ref_out, ref_lse = reference.forward(q, k, v, cu_q, cu_k, 50, 70)
    assert torch.allclose(out, ref_out, atol=1e-12) and torch.allclose(lse, ref_lse, atol=1e-12)


# --- twin against a dense masked float64 computation ---

def dense_masked(q, k, v, segs, masks, scale):
    """Float64 attention under explicit per-segment (H, q_len, k_len) masks, with autograd."""
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    q0 = k0 = 0
    for (q_len, k_len), m in zip(segs, masks):
        kh = k[k0:k0 + k_len].repeat_interleave(group, 1).transpose(0, 1)
        vh = v[k0:k0 + k_len].repeat_interleave(group, 1).transpose(0, 1)
        s = scale * q[q0:q0 + q_len].transpose(0, 1) @ kh.transpose(1, 2)
        s = s.masked_fill(~m, -INF)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0)[..., None])
        outs.append((p @ vh).transpose(0, 1))
        lses.append(lse)
        q0 += q_len
        k0 += k_len
    return torch.cat(outs), torch.cat(lses, 1)


def segment_case(seed=0, dtype=torch.float64):
    """Tasks of three documents, as a CA-task server sees them (two tasks of doc 0)."""
    doc_lens = [100, 40, 70]
    g = torch.Generator().manual_seed(seed)
    pat = VerticalSlashPattern.random(doc_lens, 4, B, n_slash=2, n_vertical=6, generator=g)
    segs = [(70, 100, 0), (40, 40, 1), (50, 50, 2), (17, 17, 0), (5, 3, 2)]
    Tq, Tk = sum(s[0] for s in segs), sum(s[1] for s in segs)
    q, k, v = torch.randn(Tq, 4, 16, generator=g), torch.randn(Tk, 2, 16, generator=g), torch.randn(Tk, 2, 16, generator=g)
    do = torch.randn(Tq, 4, 16, generator=g)
    return dict(pat=pat, segs=segs, q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), do=do.to(dtype),
                cu_q=cu([s[0] for s in segs]), cu_k=cu([s[1] for s in segs]),
                seg_doc=torch.tensor([s[2] for s in segs]))


def test_twin_matches_dense_masked_float64():
    c = segment_case()
    pat, segs = c["pat"], c["segs"]
    masks = []
    for q_len, k_len, d in segs:
        diag, cols = pat.doc_lists(d)
        masks.append(torch.stack([brute_mask(diag[h], cols[h], q_len, k_len, B) for h in range(4)]))
    leaves = [c[n].clone().requires_grad_() for n in ("q", "k", "v")]
    scale = 0.3
    ref_out, ref_lse = dense_masked(*leaves, [(s[0], s[1]) for s in segs], masks, scale)
    ref_grads = torch.autograd.grad(ref_out, leaves, c["do"])
    # The twin, through the generic autograd wrapper with a bound backend.
    be = sk.backend(pat, c["seg_doc"])
    leaves2 = [c[n].clone().requires_grad_() for n in ("q", "k", "v")]
    out, lse = attention(*leaves2, c["cu_q"], c["cu_k"], 100, 100, backend=be, scale=scale)
    grads = torch.autograd.grad(out, leaves2, c["do"])
    assert lse.dtype == torch.float64
    assert torch.allclose(out, ref_out, atol=1e-12)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert torch.allclose(lse[~torch.isinf(lse)], ref_lse[~torch.isinf(ref_lse)], atol=1e-12)
    blind = slice(c["q"].shape[0] - 5, c["q"].shape[0] - 3)  # the 2 rows of the (5, 3) segment that see no key
    assert torch.isinf(lse[:, blind]).all() and (lse[:, blind] < 0).all() and (out[blind] == 0).all()
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, atol=1e-10)


def test_twin_float32_close_to_float64():
    c64, c32 = segment_case(1), segment_case(1, torch.float32)
    o64, l64 = sk.forward(c64["q"], c64["k"], c64["v"], c64["cu_q"], c64["cu_k"], 100, 100, pattern=c64["pat"],
                          seg_doc=c64["seg_doc"])
    o32, l32 = sk.forward(c32["q"], c32["k"], c32["v"], c32["cu_q"], c32["cu_k"], 100, 100, pattern=c32["pat"],
                          seg_doc=c32["seg_doc"])
    assert l32.dtype == torch.float32
    assert torch.allclose(o32.double(), o64, atol=1e-5)


def test_bad_pattern_refused():
    c = segment_case()
    with pytest.raises(ConfigError):
        sk.forward(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], 100, 100, pattern=c["pat"])  # 5 segments, 3 docs
    with pytest.raises(ConfigError):
        sk.forward(c["q"][:, :2], c["k"][:, :1], c["v"][:, :1], c["cu_q"], c["cu_k"], 100, 100, pattern=c["pat"],
                   seg_doc=c["seg_doc"])
    with pytest.raises(ConfigError):
        sk.forward(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], 100, 100, pattern="x")


# --- estimation ---

def brute_masses(q, k, lengths, n_last, scale):
    """Per document: (vertical mass (H, L), slash mass (H, L), n) in float64 from the exact softmax."""
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for L in lengths:
        n = min(n_last, L)
        qs = q[start + L - n:start + L].double().transpose(0, 1)
        ks = k[start:start + L].double().repeat_interleave(group, 1).transpose(0, 1)
        s = scale * qs @ ks.transpose(1, 2)
        pos = torch.arange(L - n, L)
        s = s.masked_fill(torch.arange(L)[None, :] > pos[:, None], -INF)
        p = torch.softmax(s, -1)
        vm = p.sum(1)
        sm = torch.zeros(q.shape[1], L, dtype=torch.float64)
        for j in range(n):
            c = torch.arange(pos[j] + 1)
            sm[:, pos[j] - c] += p[:, j, c]
        out.append((vm, sm, n))
        start += L
    return out


def check_greedy(mass, chosen, forced, total, coverage, cap, tol=1e-5):
    """One (doc, head): forced kept, cap respected, coverage reached, greedy and minimal."""
    assert chosen[forced].all()
    count = int(chosen.sum())
    assert count <= cap
    got = float(mass[chosen].sum())
    assert got >= coverage * total - tol or count == cap
    free = chosen & ~forced
    if free.any():
        smallest = float(mass[free].min())
        rest = mass[~chosen]
        assert (float(rest.max()) if rest.numel() else 0.0) <= smallest + tol  # greedy by mass
        assert got - smallest < coverage * total + tol  # stops once coverage is reached


def test_estimation_properties():
    lengths = [300, 90, 520, 200]
    cfg = small_config(coverage=0.7, vertical_cap=40, slash_cap=24, min_doc_len=128)
    q, k = rope_like(lengths, 4, 2, 16, dtype=torch.float32)
    c = cu(lengths)
    sel = estimate_vertical_slash(q, k, c, c, cfg, chunk=64, return_selection=True)
    pat = sel.pattern
    masses = brute_masses(q, k, lengths, cfg.last_queries, 1 / 4)
    assert pat.dense.tolist() == [False, True, False, False]
    start = 0
    for d, L in enumerate(lengths):
        vm, sm, n = masses[d]
        diag, cols = pat.doc_lists(d)
        nb = math.ceil(L / B)
        for h in range(4):
            v_sel = sel.vertical[h, start:start + L]
            s_sel = sel.slash[h, start:start + L]
            assert torch.allclose(sel.vertical_mass[h, start:start + L].double(), vm[h], atol=1e-5)
            assert torch.allclose(sel.slash_mass[h, start:start + L].double(), sm[h], atol=1e-5)
            if pat.dense[d]:
                assert diag[h] == list(range(nb)) and cols[h] == [] and not v_sel.any() and not s_sel.any()
                continue
            pos = torch.arange(L)
            check_greedy(vm[h], v_sel, pos < cfg.sink_tokens, n, cfg.coverage, cfg.vertical_cap)
            check_greedy(sm[h], s_sel, pos < cfg.local_window, n, cfg.coverage, cfg.slash_cap)
            assert cols[h] == torch.nonzero(v_sel).flatten().tolist()  # stored sorted
            want = {0}
            for off in torch.nonzero(s_sel).flatten().tolist():
                want |= {x for x in (off // B, -(-off // B)) if x < nb}
            assert set(diag[h]) == want and {0, 1} <= want  # block diagonals of the chosen offsets, local band
            assert int(pat.run[d, h]) >= 2
        start += L
    # Slash structure is found: the estimated pattern is sparse on the long document.
    m = pat.mask(2, 520, 520)
    assert m.float().mean() < 0.5 * (520 * 521 / 2) / 520 ** 2 * 2


def test_estimation_full_coverage_and_caps():
    lengths = [260]
    q, k = rope_like(lengths, 2, 2, 16, seed=3, dtype=torch.float32)
    c = cu(lengths)
    sel = estimate_vertical_slash(q, k, c, c, small_config(coverage=1.0, vertical_cap=7, slash_cap=20), chunk=32,
                                  return_selection=True)
    assert sel.vertical.sum(1).tolist() == [7, 7] and sel.slash.sum(1).tolist() == [20, 20]
    assert sel.pattern.n_vert[0].tolist() == [7, 7]


def test_estimation_short_queries_and_shard_tail():
    """A CA-task server estimating from the task that ends each document: shard [a, L) over keys [0, L)."""
    lengths = [300, 200]
    q, k = rope_like(lengths, 4, 2, 16, seed=5, dtype=torch.float32)
    c = cu(lengths)
    full = estimate_vertical_slash(q, k, c, c, small_config(), chunk=64)
    # Only the last 40 and 10 queries of each document are present (the tail shards).
    tails = torch.cat([q[260:300], q[490:500]])
    part = estimate_vertical_slash(tails, k, cu([40, 10]), c, small_config(), chunk=64, return_selection=True)
    assert part.n_last.tolist() == [16, 10]  # "fewer for short shards"
    assert torch.equal(part.pattern.slash[:, :19], full.slash[:, :19])  # doc 0: same 16 estimating queries
    assert torch.equal(part.pattern.vert[:, :full.vert_off[1]], full.vert[:, :full.vert_off[1]])


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    # Layout ops differ with shapes (a reshape is a view or a copy); count the rest.
    LAYOUT = ("view", "_unsafe_view", "clone", "alias", "expand", "permute", "reshape", "t.", "transpose",
              "unsqueeze", "squeeze", "slice", "select", "detach", "constant_pad_nd", "copy_")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not any(name.startswith(f"aten.{op}") for op in self.LAYOUT):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_estimation_is_vectorised():
    """The same sequence of tensor ops for 2 documents x 2 heads as for 40 documents x 8 heads:
    no Python loop over documents or heads, and no host read of a device value (.item/.tolist)."""
    def ops(lengths, heads):
        q, k = rope_like(lengths, heads, 2, 16, dtype=torch.float32)
        c = cu(lengths)
        with _OpCounter() as counter:
            estimate_vertical_slash(q, k, c, c, small_config(), chunk=64, memory_elements=1 << 30)
        return counter.ops

    small, large = ops([300, 150], 2), ops([50 + 7 * i for i in range(40)], 8)
    assert small == large
    assert not any("item" in op or "_local_scalar_dense" in op for op in small)


# --- kernel index and cost model against brute-force counting ---

def brute_tiles(pat, doc, a, b, chunk):
    """(slash tiles, bar tiles) of task [a, b) from the pattern's lists, by loops."""
    diag, cols = pat.doc_lists(doc)
    Bk = pat.block
    i0, i1 = a // Bk, -(-b // Bk) if b > a else a // Bk
    slash = bars = 0
    for h in range(len(diag)):
        ds = set(diag[h])
        run = 0
        while run in ds:
            run += 1
        for I in range(i0, i1):
            slash += sum(1 for x in ds if x <= I)
            bars += -(-sum(1 for c in cols[h] if c // Bk <= I - run) // chunk)
    return slash, bars


def attended_tiles(pat, doc, a, b):
    """Distinct (head, I, J) tiles holding an attended slash pair, from the mask."""
    m = pat.mask(doc, b - a, b)
    diag, _ = pat.doc_lists(doc)
    n = 0
    p = torch.arange(a, b)
    for h in range(m.shape[0]):
        hit = torch.nonzero(m[h])
        tiles = {(int(p[j]) // B, int(c) // B) for j, c in hit.tolist() if (int(p[j]) // B - int(c) // B) in diag[h]}
        n += len(tiles)
    return n


def test_cost_tiles_match_brute_force_and_kernel_index():
    g = torch.Generator().manual_seed(7)
    doc_lens = [333, 100, 64, 17]
    pat = VerticalSlashPattern.random(doc_lens, 3, B, n_slash=4, n_vertical=12, generator=g)
    tasks = [(0, 0, 333), (0, 100, 333), (0, 7, 45), (0, 320, 333), (1, 0, 100), (1, 50, 51), (2, 16, 64),
             (3, 0, 17), (0, 40, 40)]
    model = SparseCost.from_pattern(pat, chunk=CHUNK)
    doc, a, b = (np.array(x) for x in zip(*tasks))
    slash, bars = model.tiles(a, b, doc)
    for (d, ta, tb), s, br in zip(tasks, slash, bars):
        want = brute_tiles(pat, d, ta, tb, CHUNK)
        assert (s, br) == want, (d, ta, tb)
        if tb > ta:
            assert attended_tiles(pat, d, ta, tb) == want[0]
    # The kernel index visits exactly these tiles, all tasks in one call.
    live = [t for t in tasks if t[2] > t[1]]
    cu_q, cu_k = cu([t[2] - t[1] for t in live]), cu([t[2] for t in live])
    idx = sk.SparseIndex.build(pat, cu_q, cu_k, int(cu_q[-1]), int(cu_k[-1]), 333,
                               torch.tensor([t[0] for t in live]), chunk=CHUNK)
    n_sl, n_bar = idx.tiles()
    live_model = model.tiles(*(np.array(x) for x in zip(*[(t[1], t[2], t[0]) for t in live])))
    assert int(n_sl) == live_model[0].sum() and int(n_bar) == live_model[1].sum()
    # Seconds: the coefficients times the counts; scalar path agrees.
    coef = SparseCoefficients()
    t = model.cost(a, b, doc)
    assert np.allclose(t, (coef.fwd_slash + coef.bwd_slash) * slash + (coef.fwd_bar + coef.bwd_bar) * bars)
    assert model.cost1(100, 333, 0) == pytest.approx(t[1])
    assert model.with_phase("fwd").cost1(100, 333, 0) == pytest.approx(coef.fwd_slash * slash[1] + coef.fwd_bar * bars[1])


def test_cost_dense_document_is_causal_tiles_and_uniform_prior():
    model = SparseCost.from_pattern(VerticalSlashPattern.full([1000], 2, B), chunk=CHUNK)
    nb = math.ceil(1000 / B)
    assert model.tiles([0], [1000], [0])[0][0] == 2 * nb * (nb + 1) / 2
    assert model.density([0])[0] == pytest.approx(1.0)
    prior = SparseCost.uniform([1 << 17, 4096], 8, diagonals=40, verticals=512)
    full = prior.tiles(np.array([0, 0]), np.array([1 << 17, 4096]), np.array([0, 1]))[0]
    assert prior.density([1])[0] == pytest.approx(1.0) and 0.0 < prior.density([0])[0] < 0.1
    # The tail shard costs far less more than the head one than it does dense (pairs ratio ~31).
    L, m = 1 << 17, 8192
    head, tail = prior.cost(np.array([0, L - m]), np.array([m, L]), np.array([0, 0]))
    dense_ratio = (m * (2 * L - m + 1) / 2) / (m * (m + 1) / 2)
    assert 1.0 < tail / head < 0.5 * dense_ratio and full[0] > 0


def test_fit_coefficients_recovers_a_linear_model():
    rng = np.random.default_rng(0)
    slash, bars = rng.integers(1000, 10 ** 6, 30), rng.integers(0, 10 ** 5, 30)
    t = 20e-9 * slash + 30e-9 * bars + 5e-6
    a, b, c = fit_coefficients(slash, bars, t * (1 + 0.01 * rng.standard_normal(30)))
    assert a == pytest.approx(20e-9, rel=0.05) and b == pytest.approx(30e-9, rel=0.1)
    coef = SparseCoefficients(fwd_slash=a, fwd_bar=b, fwd_task=c)
    assert SparseCoefficients.from_json(coef.to_json()) == coef
    with pytest.raises(ConfigError):
        SparseCoefficients(fwd_slash=-1.0)


def test_calibrated_coefficients_price_the_planned_sparse_work(tmp_path):
    """``cost_coefficients`` (a bench/gpu_sparse.py calibration) replaces the packaged H200 fit in cad's
    sparse costs; its per-call constants stay out of task costs; a missing or foreign file is refused,
    naming the option, when the config is made."""
    import json

    from attnpool.plan.cost import build_h200_default_table
    from attnpool.sparse.cost import H200_MEASURED, SparsePrior

    calibrated = SparseCoefficients(2 * H200_MEASURED.fwd_slash, H200_MEASURED.fwd_bar, 1e-3,
                                    2 * H200_MEASURED.bwd_slash, H200_MEASURED.bwd_bar, 5e-3, source="test GPU")
    path = tmp_path / "sparse_cost_coefficients.json"
    path.write_text(json.dumps(calibrated.to_json()))
    lengths, dense = [1 << 15, 1 << 14], build_h200_default_table()

    def sparse_cost(config):
        return SparsePrior(config, num_heads=32, head_dim=128, n_layers=4).cost_model(lengths, dense).sparse

    def whole_doc_tiles(model):
        return model.tiles(np.array([0]), np.array([lengths[0]]), np.array([0]))

    packaged, mine = sparse_cost(SparseConfig()), sparse_cost(SparseConfig(cost_coefficients=str(path)))
    (slash,), (bars,) = whole_doc_tiles(mine)
    assert slash > 0 and bars > 0
    assert all(np.array_equal(x, y) for x, y in zip(whole_doc_tiles(mine), whole_doc_tiles(packaged)))  # same work
    for model, coef in ((packaged, H200_MEASURED), (mine, calibrated)):
        whole = model.cost1(0, lengths[0], 0)
        assert whole == pytest.approx((coef.fwd_slash + coef.bwd_slash) * slash + (coef.fwd_bar + coef.bwd_bar) * bars)
    with pytest.raises(ConfigError, match="cannot read") as err:
        SparseConfig(cost_coefficients=str(tmp_path / "missing.json"))
    assert err.value.field == "sparse_cost_coefficients"
    dense_table = tmp_path / "cost_table.json"
    dense_table.write_text(json.dumps({"format": "attnpool-cost-table/1", "tables": {}}))
    with pytest.raises(ConfigError, match="not a sparse cost file") as err:
        SparseConfig(cost_coefficients=str(dense_table))
    assert err.value.field == "sparse_cost_coefficients"


# --- Triton through its interpreter ---

def _patch_interpreter_for_numpy2():
    """Triton 3.6's interpreter calls int() on 1-element arrays, which NumPy >= 2.4 refuses."""
    import triton.runtime.interpreter as ti

    if getattr(ti, "_attnpool_patched", False):
        return
    original = ti._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    ti._patch_lang_tensor = patched
    ti._attnpool_patched = True


def _interpreter_check():
    """Run in a fresh process with TRITON_INTERPRET=1 (Triton reads it when its own library is first
    imported, and torch may import Triton earlier in this one)."""
    _patch_interpreter_for_numpy2()
    first = segment_case(2, torch.float32)
    _interpreter_case(first)
    # The Gluon path (Hopper only, no interpreter): its launcher, with the slash pass stood in for by the
    # twin; the vertical dK/dV pass and the dQ pass that adds the columns' part to the slash part, then
    # scales and casts, interpreted. This case has query rows that see no key (zero gradients).
    _interpreter_case_gluon(first)
    # Blocks of 32 cut into sub-tiles of 16 in the backward kernels, as 128 into 32 on GPUs.
    g = torch.Generator().manual_seed(4)
    pat = VerticalSlashPattern.random([150, 70], 4, 32, n_slash=2, n_vertical=10, generator=g)
    # The last segment ends mid-block, where the TMA descriptors' zero fill stands in for masks.
    segs = [(100, 150), (20, 64), (70, 70)]
    T_k = sum(s[1] for s in segs)
    # K and V as strided views (different strides, head stride != head_dim), as a fused projection gives
    # them, with NaN in the rows past T_k: a descriptor must use each tensor's own strides and end.
    # Q and dO likewise end before NaN rows: no dK/dV pass may take in a query row past T_q (the forward
    # and the dQ pass never store such rows, so they would not show it).
    k_buf, v_buf = torch.randn(T_k + 64, 2, 3, 16, generator=g), torch.randn(T_k + 64, 5, 16, generator=g)
    q_buf, do_buf = torch.randn(190 + 64, 5, 16, generator=g), torch.randn(190 + 64, 4, 16, generator=g)
    for buf, end in ((k_buf, T_k), (v_buf, T_k), (q_buf, 190), (do_buf, 190)):
        buf[end:] = float("nan")
    c = dict(pat=pat, seg_doc=torch.tensor([0, 0, 1]), cu_q=cu([s[0] for s in segs]), cu_k=cu([s[1] for s in segs]),
             q=q_buf[:190, 1:], k=k_buf[:T_k, :, 1], v=v_buf[:T_k, 2:4], do=do_buf[:190])
    for name in ("dq", "dkdv", "vert"):
        sk.CONFIG[name] = {key: (16 if key.startswith("SUB") else val) for key, val in sk.CONFIG[name].items()}
    _interpreter_case(c)
    # Contiguous but starting 4 bytes off 16-byte alignment: TMA cannot read them, so the launcher copies.
    for name in ("k", "v"):
        flat = torch.empty(c[name].numel() + 1)
        c[name] = flat[1:].view(c[name].shape).copy_(c[name])
        assert c[name].is_contiguous() and c[name].data_ptr() % 16
    _interpreter_case(c)
    # Q and dO stored head-major (head stride != head_dim): every kernel must use their own strides.
    for name in ("q", "do"):
        c[name] = c[name].permute(1, 0, 2).contiguous().permute(1, 0, 2)
        assert c[name].stride(1) != c[name].shape[2]
    _interpreter_case(c)
    _interpreter_case_gluon(c)  # blocks of 32, q and dO head-major: the launcher must copy them for TMA
    print("INTERPRETER OK")


def _interpreter_case_gluon(c):
    saved, sk.SLASH_BACKWARD = sk.SLASH_BACKWARD, "gluon"
    stand_in = _SlashPassTwin(c)
    token = sk._gluon_stand_in.set(stand_in)
    try:
        _interpreter_case(c)
    finally:
        sk._gluon_stand_in.reset(token)
        sk.SLASH_BACKWARD = saved
    assert stand_in.launches == 1


class _SlashPassTwin:
    """Stands in for attnpool.kernels.sparse_gluon: ``_bwd_slash[grid](...)`` writes what the Gluon pass
    writes, from the twin on the pattern without its vertical columns: the slash tiles' dK (scaled) and dV,
    and their dQ unscaled, added into DQ32."""

    def __init__(self, c):
        p = c["pat"]
        self.case, self.launches = c, 0
        self.slash_only = VerticalSlashPattern(p.block, p.doc_len, p.blk_off, p.slash, p.vert_off, p.vert,
                                               torch.zeros_like(p.n_vert), p.dense)
        self._bwd_slash = self

    def __getitem__(self, grid):
        self.grid = grid
        return self._launch

    def _launch(self, q, k, v, dout, lse_rows, delta_rows, dk32, dv32, dq32, *rest, **constexprs):
        c, scale, row_base = self.case, rest[-2], rest[-3]
        sq_t, sk_t, sv_t, sdo_t, sdk_t, sdq_t, t_rows, H, H_kv = rest[:9]
        D = q.shape[2]
        # What the Gluon pass assumes of its arguments: (rows, heads * D) views, one program per (key-block
        # program, KV head), LSE and delta rows where every query block starts 16-byte aligned.
        for x, stride in ((q, sq_t), (k, sk_t), (v, sv_t), (dout, sdo_t), (dk32, sdk_t), (dq32, sdq_t)):
            assert x.stride(2) == 1 and x.stride(1) == D and x.stride(0) == stride
        assert (H, H_kv) == (q.shape[1], k.shape[1]) and constexprs["GROUP"] == H // H_kv
        assert self.grid == (rest[14], H_kv) and constexprs["HEAD_DIM"] == D
        assert lse_rows.shape == delta_rows.shape == (H, t_rows) and t_rows % 4 == 0
        q_lens, k_lens = (c["cu_q"][1:] - c["cu_q"][:-1]).tolist(), (c["cu_k"][1:] - c["cu_k"][:-1]).tolist()
        lse = torch.empty(H, q.shape[0])
        delta = torch.empty(H, q.shape[0])
        for s, (q0, q_len, k_len) in enumerate(zip(c["cu_q"][:-1].tolist(), q_lens, k_lens)):
            base = int(row_base[s])
            assert (base - (k_len - q_len)) % 4 == 0, (s, base, q_len, k_len)
            lse[:, q0:q0 + q_len] = lse_rows[:, base:base + q_len]
            delta[:, q0:q0 + q_len] = delta_rows[:, base:base + q_len]
        mq, mk = int((c["cu_q"][1:] - c["cu_q"][:-1]).max()), int((c["cu_k"][1:] - c["cu_k"][:-1]).max())
        args = (q, k, v, c["cu_q"], c["cu_k"], mq, mk)
        # The full pattern's softmax: P of a slash tile is normalised over all keys the row attends.
        out, lse_full = sk.forward(*args, scale, pattern=c["pat"], seg_doc=c["seg_doc"], impl="twin")
        covered = torch.zeros(q.shape[0], dtype=torch.bool)
        covered[:int(c["cu_q"][-1])] = True
        fin = torch.isfinite(lse_full) & covered
        assert torch.allclose(lse[fin], lse_full[fin].float(), atol=1e-5)
        assert torch.allclose(delta[:, covered], (dout.float() * out.float()).sum(-1).T[:, covered], atol=1e-5)
        dq, dk, dv = sk.backward(dout, *args[:3], out, lse_full, *args[3:], scale, pattern=self.slash_only,
                                 seg_doc=c["seg_doc"], impl="twin")
        dq32 += dq.float() / scale
        dk32.copy_(dk)
        dv32.copy_(dv)
        self.launches += 1


def _interpreter_case(c):
    mq, mk = int((c["cu_q"][1:] - c["cu_q"][:-1]).max()), int((c["cu_k"][1:] - c["cu_k"][:-1]).max())
    args = (c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], mq, mk)
    idx = sk.SparseIndex.build(c["pat"], c["cu_q"], c["cu_k"], c["q"].shape[0], c["k"].shape[0], 150, c["seg_doc"],
                               chunk=CHUNK)
    o_twin, l_twin = sk.forward(*args, pattern=c["pat"], seg_doc=c["seg_doc"], impl="twin")
    o_tri, l_tri = sk.forward(*args, pattern=c["pat"], seg_doc=c["seg_doc"], impl="triton", index=idx)
    assert torch.allclose(o_tri, o_twin, atol=1e-5)
    assert torch.equal(torch.isinf(l_tri), torch.isinf(l_twin))
    fin = ~torch.isinf(l_twin)
    assert torch.allclose(l_tri[fin], l_twin[fin].float(), atol=1e-5)
    g_twin = sk.backward(c["do"], *args[:3], o_twin, l_twin, *args[3:], pattern=c["pat"], seg_doc=c["seg_doc"],
                         impl="twin")
    g_tri = sk.triton_backward(c["do"], *args[:3], o_tri, l_tri, *args[3:], pattern=c["pat"], seg_doc=c["seg_doc"],
                               index=idx)
    for name, a, b in zip(("dq", "dk", "dv"), g_tri, g_twin):
        assert torch.allclose(a, b, atol=1e-4), (name, (a - b).abs().max())


def test_gluon_rows_start_every_query_block_16_byte_aligned():
    """The Gluon pass reads an item's LSE and delta rows by TMA at coordinate h * T_rows + base[s] + row, row =
    block * 128 + sub * 64 - (k_len - q_len): TMA takes only 16-byte aligned innermost coordinates (an
    unaligned one was an illegal instruction on an H100). The copies hold every segment's rows, at such
    bases, for odd lengths, shards that start inside a block, a one-row segment and rows past the last."""
    cu_q = torch.tensor([0, 1001, 2500, 2501, 3200], dtype=torch.int32)
    cu_k = torch.tensor([0, 1001, 3500, 6000, 6903], dtype=torch.int32)
    lse, delta = torch.randn(3, 3300), torch.randn(3, 3300)
    (lse_rows, delta_rows), base, t_rows = sk._tma_rows(cu_q, cu_k, lse, delta)
    assert t_rows % 4 == 0 and lse_rows.shape == delta_rows.shape == (3, t_rows) and base.dtype == torch.int32
    for s in range(4):
        q0, q1, shift = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s + 1] - cu_k[s]) - int(cu_q[s + 1] - cu_q[s])
        assert (int(base[s]) - shift) % 4 == 0
        assert torch.equal(lse_rows[:, base[s]:base[s] + q1 - q0], lse[:, q0:q1])
        assert torch.equal(delta_rows[:, base[s]:base[s] + q1 - q0], delta[:, q0:q1])
    assert torch.equal(lse_rows[:, int(base[3]) + 3200 - 2501:][:, :100], lse[:, 3200:])  # past the last


def test_kernels_do_not_specialise_on_per_call_sizes():
    """Triton compiles a variant of a kernel for each divisibility class of its integer arguments; the
    sizes of a call change with every batch, so specialising on them recompiled the kernels mid-training
    (17 variants instead of 5 over 32 server calls, bench/results/2026-11-22-h200-sparse-warmup.md)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from attnpool.kernels import sparse_triton as st

    if not hasattr(st._fwd, "params"):  # Triton's interpreter (TRITON_INTERPRET=1) compiles nothing
        pytest.skip("the kernels are interpreted")
    exempt = set()
    for kernel in (st._fwd, st._bwd_delta, st._bwd_dq, st._bwd_dkdv_slash, st._bwd_dkdv_vert):
        for param in kernel.params:
            if param.name in st.PER_CALL_SIZES:
                assert param.do_not_specialize, (kernel.__name__, param.name)
                exempt.add(param.name)
    # Triton ignores names that are no parameter: a renamed size would silently be specialised again.
    assert exempt == set(st.PER_CALL_SIZES)
    from attnpool.kernels import sparse_gluon as sg

    exempt = {param.name for param in sg._bwd_slash.params if param.do_not_specialize}
    assert exempt == set(sg.PER_CALL_SIZES)


def test_kernels_compile_for_hopper_within_its_shared_memory(monkeypatch, tmp_path):
    """Every launch of the GPU path, compiled here as on an sm_90 GPU (Triton's compiler needs none), the
    Gluon pass included: it compiles at its CONFIG, and fits Hopper's shared memory, which Triton checks
    only when it launches; the Gluon pass's products' item loop does not touch local memory (spills). The
    launches and their argument types are those the launchers make (recorded, not run)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the kernels are interpreted")
    # bf16 at head_dim 128: the backward's slash tiles in the Gluon pass; head_dim 64: in the Triton passes.
    monkeypatch.setattr(sk, "SLASH_BACKWARD", "gluon")  # whatever ATTNPOOL_SLASH_BACKWARD says here
    for head_dim, launches in ((128, {"fwd", "delta", "slash_bwd", "vert", "dq_vertical"}),
                               (64, {"fwd", "delta", "dq", "dkdv", "vert"})):
        compiled = sk.compile_offline(head_dim=head_dim)
        assert set(compiled) == launches
        for name, kernel in compiled.items():
            assert 0 < kernel.metadata.shared <= sk.HOPPER_SHARED_MEMORY, (name, kernel.metadata.shared)
        if "slash_bwd" in compiled:
            spills = _products_local_memory(compiled["slash_bwd"], tmp_path)
            assert not spills, "the Gluon pass's products spill:\n" + "\n".join(spills[:20])


def _products_local_memory(kernel, tmp_path):
    """The local-memory (spill) instructions between the first and the last tensor-core product (HGMMA) of
    a compiled kernel's SASS, by the cuobjdump that Triton ships: the Gluon pass's item loop, less its
    bookkeeping at the head and the latch. Spills there made the pass take 35% longer at 128K on an H100
    (sparse_gluon's docstring)."""
    import subprocess

    from triton import knobs

    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    products = [i for i, line in enumerate(sass) if "HGMMA" in line]
    assert products, "no HGMMA in the Gluon pass"
    return [line.strip() for line in sass[products[0]:products[-1]] if "STL" in line or "LDL" in line]


@background.job("test_triton_interpreter_matches_twin")
def interpreted(tmp):
    """_interpreter_check in a process of its own, under TRITON_INTERPRET=1."""
    import importlib.util
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_sparse; test_sparse._interpreter_check()"
    return background.run([sys.executable, "-c", code], env={"TRITON_INTERPRET": "1"}, timeout=300)


def test_triton_interpreter_matches_twin():
    run = interpreted.result()
    assert run.returncode == 0 and "INTERPRETER OK" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]


def test_pack_unpack_moves_documents_between_servers():
    """The server of a document's last shard estimates; others receive its rows as one int32 buffer."""
    from attnpool.sparse.pattern import pack_pattern, packed_sizes, unpack_patterns

    lengths = [300, 90, 520]
    cfg = small_config(coverage=0.8, vertical_cap=30, slash_cap=24)
    q, k = rope_like(lengths, 4, 2, 16, seed=9, dtype=torch.float32)
    c = cu(lengths)
    pat = estimate_vertical_slash(q, k, c, c, cfg, chunk=64)
    docs = [2, 1, 0]
    buf = pack_pattern(pat, docs, [lengths[d] for d in docs], cfg)
    assert buf.dtype == torch.int32 and buf.numel() == packed_sizes([lengths[d] for d in docs], 4, cfg).sum()
    got = unpack_patterns(buf, [lengths[d] for d in docs], 4, cfg)
    for i, d in enumerate(docs):
        assert got.doc_lists(i) == pat.doc_lists(d)
        assert bool(got.dense[i]) == bool(pat.dense[d])
        assert torch.equal(got.mask(i, 50, lengths[d]), pat.mask(d, 50, lengths[d]))


def test_cad_balances_sparse_tasks_by_their_tile_cost():
    """The planner takes a per-document cost model: cad balances the sparse cost itself."""
    import numpy as np
    from attnpool.plan import linear_table, plan_attention
    from attnpool.plan.cost import doc_costs
    from attnpool.sparse.cost import SparseCost

    lens = [40000, 3000, 9000, 26000, 700, 12000, 30000, 1500]
    table = linear_table(lens, 4)
    sparse = SparseCost.uniform(table.doc_len, num_heads=4, diagonals=8, verticals=64)
    cost, _ = doc_costs(sparse)

    def imbalance(plan):
        loads = np.bincount(plan.task_server, weights=cost(plan.task_start, plan.task_end, plan.task_doc), minlength=4)
        return loads.max() / loads.mean()

    local = imbalance(plan_attention(table, "local", cost_model=sparse))
    dense_plan = imbalance(plan_attention(table, "cad", cost_model="pairs", min_shard_tokens=128))
    sparse_plan = imbalance(plan_attention(table, "cad", cost_model=sparse, min_shard_tokens=128))
    assert local > 1.05 and dense_plan > 1.05  # balancing dense work leaves sparse work unbalanced
    assert sparse_plan <= 1.02


# --- the greedy selection against a per-(segment, head) Python reference ---

def greedy_reference(mass, forced, total, coverage, cap):
    """One (segment, head), as loops: forced first, then by decreasing mass, equal masses in position order;
    take while the mass taken before an entry is below coverage * total and fewer than cap precede it."""
    order = sorted(range(len(mass)), key=lambda t: (not forced[t], -mass[t], t))
    taken, before = [False] * len(mass), 0.0
    for rank, t in enumerate(order):
        taken[t] = forced[t] or (rank < cap and before < coverage * total)
        before += mass[t]
    return taken


@pytest.mark.parametrize("seed", range(6))
def test_select_matches_python_reference(seed):
    from attnpool.sparse.pattern import _select, slot_owner

    g = torch.Generator().manual_seed(seed)
    lengths = [0, 5, 37, 1, 200, 0, 64, 130, 9]  # empty segments, segments shorter than the cap, long ones
    H, n_forced = 3, 3
    cap = [4, 10, 50][seed % 3]
    coverage = [0.5, 0.9, 1.0][(seed // 3) % 3]
    T = sum(lengths)
    # Few distinct values (many ties, forced and unforced alike), zeros, and some random masses;
    # totals: the exact column sums, a larger value (coverage never reached), or 0 (nothing unforced).
    levels = torch.tensor([0.0, 0.125, 0.25, 0.5, 1.0])
    mass = levels[torch.randint(0, 5, (H, T), generator=g)]
    mass = torch.where(torch.rand(H, T, generator=g) < 0.3, torch.rand(H, T, generator=g), mass).float()
    c = cu(lengths).long()
    pos_seg = slot_owner(c, T)
    forced = (torch.arange(T) - c[pos_seg]) < n_forced
    seg_total = torch.zeros(H, len(lengths), dtype=torch.float64).index_add_(1, pos_seg, mass.double())
    total = torch.tensor([4.0, 3.0, 1.5, 1.0, 50.0, 0.0, 0.0, 40.0, 2.0], dtype=torch.float64)
    total[2] = float(seg_total[0, 2])  # one total for all heads (as n_last): head 0's exact sum
    got = _select(mass, forced[None].expand(H, -1), pos_seg, c, total, 64.0, coverage, cap)
    for s, L in enumerate(lengths):
        a, b = int(c[s]), int(c[s + 1])
        for h in range(H):
            want = greedy_reference(mass[h, a:b].double().tolist(), forced[a:b].tolist(), float(total[s]),
                                    coverage, cap)
            assert got[h, a:b].tolist() == want, (s, h, cap, coverage)


def test_estimation_same_pattern_with_host_lengths_selection_and_chunk_groups():
    """Host lengths only size the chunk layout exactly; return_selection also scores dense documents;
    with one group of chunks the masses reuse the log-sum-exp pass's scores, with several they are
    scored again: none of it changes the pattern."""
    lengths = [300, 90, 20, 520, 1, 200, 60]
    cfg = small_config(coverage=0.8)
    q, k = rope_like(lengths, 4, 2, 16, seed=11, dtype=torch.float32)
    c = cu(lengths)
    base = estimate_vertical_slash(q, k, c, c, cfg, chunk=64)
    per_chunk = q.shape[1] * cfg.last_queries * 64  # float32 scores of one chunk
    for host in (None, lengths):
        sel = estimate_vertical_slash(q, k, c, c, cfg, chunk=64, k_lens_host=host, return_selection=True)
        pat = estimate_vertical_slash(q, k, c, c, cfg, chunk=64, k_lens_host=host)
        grouped = estimate_vertical_slash(q, k, c, c, cfg, chunk=64, k_lens_host=host, memory_elements=3 * per_chunk)
        for p in (sel.pattern, pat, grouped):
            for name in ("slash", "vert", "n_vert", "dense", "vert_off", "blk_off"):
                assert torch.equal(getattr(p, name), getattr(base, name)), (host, name)


def test_slash_backward_switch_is_checked_before_training(monkeypatch):
    """ATTNPOOL_SLASH_BACKWARD picks the backward's slash pass; a bad value is refused by device_problem,
    which training and `attnpool bench` call before their first step, naming the variable."""
    monkeypatch.setattr(sk, "SLASH_BACKWARD", "fast")
    problem = sk.device_problem(0)
    assert "ATTNPOOL_SLASH_BACKWARD='fast'" in problem and "gluon, triton" in problem
    with pytest.raises(ConfigError, match="ATTNPOOL_SLASH_BACKWARD"):
        sk.gluon_problem(torch.zeros(1, 1, 128, dtype=torch.bfloat16), 128)
    monkeypatch.setattr(sk, "SLASH_BACKWARD", "triton")
    assert sk.gluon_problem(torch.zeros(1, 1, 128, dtype=torch.bfloat16), 128) == "SLASH_BACKWARD is 'triton'"
    monkeypatch.setattr(sk, "SLASH_BACKWARD", "gluon")
    assert "CUDA" in sk.gluon_problem(torch.zeros(1, 1, 128, dtype=torch.bfloat16), 128)  # no GPU here
    assert "bf16" in sk.gluon_problem(torch.zeros(1, 1, 64, dtype=torch.bfloat16), 128)


def test_cad_never_ends_above_local_under_the_sparse_prior():
    """Issue 26: the README's sparse example (tiny model, 4 ranks x 256 tokens, 64-token shards, block 16) planned
    its first steps worse than local under its own prior (1.258 -> 1.270: a 64-token shard carries a third of the
    mean, moves overfilled receivers and the greedy kept its last state). Over random batches of that shape cad's
    busiest server now never carries more than local's, by the prior that plans it."""
    from attnpool.plan import linear_table, load_cost_model, plan_attention
    from attnpool.plan.metrics import home_loads, server_loads
    from attnpool.sparse.cost import SparsePrior

    cfg = SparseConfig(min_doc_len=256, block=16, vertical_chunk=16, last_queries=32, sink_tokens=4, local_window=32,
                       slash_cap=32, vertical_cap=64)
    prior = SparsePrior(cfg, num_heads=4, head_dim=32, n_layers=4)
    pairs = load_cost_model("pairs")
    rng = np.random.default_rng(0)
    batches = [[1024]] + [list(rng.integers(1, 900, size=int(rng.integers(1, 8)))) for _ in range(40)]
    for lens in batches:
        total = sum(lens)
        lens = lens + [4 * 256 - total] if total < 4 * 256 else lens  # 4 x 256 tokens, as the demo's steps
        table = linear_table(lens, 4, -(-sum(lens) // 4))
        model = prior.cost_model(table.doc_len, pairs)
        local = home_loads(table, model)
        planned = server_loads(plan_attention(table, "cad", cost_model=model, min_shard_tokens=64), model)
        assert planned.max() <= local.max() * (1 + 1e-9), (lens, planned, local)
    one = linear_table([1024], 4, 256)
    model = prior.cost_model(one.doc_len, pairs)
    planned = server_loads(plan_attention(one, "cad", cost_model=model, min_shard_tokens=64), model)
    assert planned.max() / planned.mean() < 1.05  # was 1.270, local 1.258


def test_the_prior_follows_pattern_size_by_document_length():
    """A cap on the slash offsets covers most block diagonals of a short document and few of a long one (an
    untrained model's patterns: random q and k). Priced with one size for all lengths, cad's plans carried 1.3-1.4x
    the mean on the busiest server by the real patterns; priced by each length class's size, learnt from the steps
    before, within 5% (bench/sparse_prior_by_length.py measures the same at prolong 256K x 4)."""
    from attnpool.plan import linear_table, load_cost_model, plan_attention
    from attnpool.plan.metrics import imbalance
    from attnpool.runtime.sparse import SparseStats
    from attnpool.sparse.cost import LayerMixCost, SparsePrior
    from attnpool.sparse.pattern import estimate_untrained

    cfg = SparseConfig(min_doc_len=256, block=16, vertical_chunk=16, last_queries=32, sink_tokens=4, local_window=16,
                       slash_cap=48, vertical_cap=64)
    heads, head_dim, world = 2, 16, 4
    pairs = load_cost_model("pairs")
    priors = {"one size": SparsePrior(cfg, heads, head_dim, 1), "by length": SparsePrior(cfg, heads, head_dim, 1)}
    _, coefficients = priors["one size"]._pricing(pairs)
    rng = np.random.default_rng(0)
    measured = {name: [] for name in priors}
    for step in range(6):
        lens = np.array(list(rng.integers(256, 700, size=10)) + [int(rng.integers(3000, 5000))])
        table = linear_table(lens, world, -(-int(lens.sum()) // world))
        pattern = estimate_untrained(lens, heads, head_dim, cfg, seed=step)
        exact = LayerMixCost(pairs, SparseCost.from_pattern(pattern, coefficients, chunk=cfg.vertical_chunk), 0, 1,
                             lens >= cfg.min_doc_len)
        sums, by_length = SparseStats.of_pattern(pattern)  # the step's statistics, as the ranks report them
        for name, prior in priors.items():
            plan = plan_attention(table, "cad", cost_model=prior.cost_model(table.doc_len, pairs), min_shard_tokens=32)
            load = np.bincount(plan.task_server, weights=exact.cost(plan.task_start, plan.task_end, plan.task_doc),
                               minlength=world)
            measured[name].append(imbalance(load))
            prior.update(*sums[:3], by_length=by_length if name == "by length" else None)
    assert min(measured["one size"][1:]) > 1.2, measured  # the failure this guards against
    assert max(measured["by length"][1:]) < 1.05, measured


def test_the_prior_by_length_interpolates_and_survives_a_checkpoint():
    from attnpool.sparse.cost import SparsePrior
    from attnpool.sparse.pattern import LENGTH_CLASSES, length_class

    cfg = SparseConfig(min_doc_len=256, block=16, local_window=16, sink_tokens=4, slash_cap=48, vertical_cap=64)
    prior = SparsePrior(cfg, num_heads=2, head_dim=16, n_layers=1)
    before = prior.sizes([300, 5000])
    assert before[0].tolist() == [prior.diagonals] * 2  # no class seen: one size
    by_length = np.zeros((LENGTH_CLASSES, 3))
    short, long = length_class(np.array([300, 4096]))
    by_length[short] = (2, 2 * (10 + prior.local_blocks), 2 * (20 + 4))  # 2 sparse heads: 10 diagonals, 20 verticals
    by_length[long] = (2, 2 * (40 + prior.local_blocks), 2 * (60 + 4))
    prior.update(4, by_length[:, 1].sum(), by_length[:, 2].sum(), by_length=by_length)
    middle = 2 ** ((np.array([short, long]) + 0.5) / 2)  # the lengths in the middle of the two classes
    diagonals, verticals = prior.sizes([*middle, 1100, 100, 10**6])
    assert diagonals[:2].tolist() == pytest.approx([10, 40]) and verticals[:2].tolist() == pytest.approx([20, 60])
    assert 10 < diagonals[2] < 40  # between the classes seen, by log length
    assert diagonals[3] == pytest.approx(10) and diagonals[4] == pytest.approx(40)  # the nearest beyond them
    restored = SparsePrior(cfg, num_heads=2, head_dim=16, n_layers=1)
    restored.load_state_dict(prior.state_dict())
    assert np.array_equal(restored.sizes([1100])[0], prior.sizes([1100])[0])
    older = {k: v for k, v in prior.state_dict().items() if k != "by_length"}  # a checkpoint of before
    restored.load_state_dict(older)
    assert restored.sizes([300, 4096])[0].tolist() == [prior.diagonals] * 2


def test_the_prior_fits_the_tiles_price_to_the_kernels_seconds():
    """SparsePrior.update_kernel_scale: the ranks' kernel seconds less their dense work, against their sparse work at
    the calibration's prices, as deviations from the step's mean (what every rank pays alike moves nothing), give the
    tiles' price scale once two steps are in and the sparse work spreads over the ranks; bounded; ranks that ran no
    sparse kernels left out; kept in checkpoints; used by the plans and the served price only where the prices are
    seconds and price_from_kernels is on."""
    from attnpool.plan import load_cost_model
    from attnpool.sparse.cost import SparsePrior

    cfg = SparseConfig(min_doc_len=256, block=16, local_window=16, sink_tokens=4, slash_cap=48, vertical_cap=64,
                       price_from_kernels=True)
    table, pairs = load_cost_model("table", backend="flash"), load_cost_model("pairs")
    prior = SparsePrior(cfg, num_heads=2, head_dim=16, n_layers=1)
    assert prior.learns_kernel_scale(table) and not prior.learns_kernel_scale(pairs)
    rng = np.random.default_rng(0)
    sparse, dense = rng.uniform(0.0, 0.1, (3, 5)), rng.uniform(0.0, 0.1, (3, 5))
    # the kernels: tiles at 1.8x their prices, dense spans at theirs, and 5 ms every rank pays
    kernel = 1.8 * sparse + dense + 0.005
    kernel[:, 4] = 0.0  # a rank that ran no sparse layer (a dense pipeline stage): left out
    prior.update_kernel_scale(kernel[0], sparse[0], dense[0])
    assert prior.kernel_scale == 1.0  # one step is not enough
    prior.update_kernel_scale(kernel[1], sparse[1], dense[1])
    assert prior.kernel_scale == pytest.approx(1.8)
    # the plans' tile prices follow it; the dense documents' do not
    lengths = np.array([300, 100])
    with_scale, calibrated = prior.cost_model(lengths, table), SparsePrior(cfg, 2, 16, 1).cost_model(lengths, table)
    a, e, doc = np.array([0, 0]), np.array([300, 100]), np.array([0, 1])
    ratio = with_scale.cost(a, e, doc) / calibrated.cost(a, e, doc)
    assert ratio[1] == pytest.approx(1.0) and ratio[0] == pytest.approx(1.8)  # (all layers sparse here)
    assert prior.served_price(table).sparse_scale == prior.kernel_scale and prior.served_price(pairs).sparse_scale == 1
    assert np.array_equal(prior.cost_model(lengths, pairs).cost(a, e, doc),
                          SparsePrior(cfg, 2, 16, 1).cost_model(lengths, pairs).cost(a, e, doc))
    # a checkpoint keeps it, and one from before the fit starts from the calibration
    restored = SparsePrior(cfg, 2, 16, 1)
    restored.load_state_dict(prior.state_dict())
    assert restored.kernel_scale == prior.kernel_scale and restored.kernel_steps == 2
    dearer = np.where(kernel[2] > 0, kernel[2] + 0.5 * sparse[2], 0.0)  # a step whose tiles cost 2.3x
    restored.update_kernel_scale(dearer, sparse[2], dense[2])
    prior.update_kernel_scale(dearer, sparse[2], dense[2])
    assert restored.kernel_scale == prior.kernel_scale and 1.8 < prior.kernel_scale < 2.3  # the newest step weighs in
    restored.load_state_dict({k: v for k, v in prior.state_dict().items() if not k.startswith("kernel")})
    assert restored.kernel_scale == 1.0 and restored.kernel_steps == 0
    # sparse work alike on every rank says nothing of its price; a fit past the bounds is clamped
    flat = SparsePrior(cfg, 2, 16, 1)
    for step in range(3):
        flat.update_kernel_scale(3.0 * sparse[step] + dense[step], np.full(5, 0.05), dense[step])
    assert flat.kernel_scale == 1.0
    steep = SparsePrior(cfg, 2, 16, 1)
    for step in range(2):
        steep.update_kernel_scale(10.0 * sparse[step] + dense[step], sparse[step], dense[step])
    assert steep.kernel_scale == SparsePrior.KERNEL_SCALE_RANGE[1]
    # a rank whose clock read no finite time is left out; ranks in groups (pipeline stages) are compared within
    # their group: a stage that runs more layers pays more, on every rank of it alike
    grouped = SparsePrior(cfg, 2, 16, 1)
    for step in range(2):
        stage = np.repeat([0, 1], [2, 3])
        seconds = 1.8 * sparse[step] + dense[step] + np.where(stage == 1, 0.3, 0.0)
        seconds[0] = np.inf if step == 0 else seconds[0]
        grouped.update_kernel_scale(seconds, sparse[step], dense[step], groups=stage)
    assert grouped.kernel_scale == pytest.approx(1.8)
    # off: the calibration's prices
    off = SparsePrior(SparseConfig(min_doc_len=256, block=16, local_window=16, sink_tokens=4, slash_cap=48,
                                   vertical_cap=64, price_from_kernels=False), 2, 16, 1)
    assert not off.learns_kernel_scale(table) and off.served_price(table).sparse_scale == 1.0


def test_price_from_kernels_is_an_option():
    """``--sparse-args price_from_kernels=true`` turns the fit on (off by default); a value that is not a boolean is
    refused naming the option."""
    from attnpool.errors import ConfigError
    from attnpool.train.config import TrainConfig
    from attnpool.train.spec import check_sparse, model_spec

    model = model_spec("llama3-8b").config
    sparse = lambda **kw: check_sparse(TrainConfig(sparse="vertical-slash", **kw), model)
    assert not sparse().price_from_kernels and sparse(sparse_args={"price_from_kernels": True}).price_from_kernels
    with pytest.raises(ConfigError, match="sparse_args.price_from_kernels='maybe'"):
        sparse(sparse_args={"price_from_kernels": "maybe"})


def test_served_work_prices_tiles_at_the_plans_scale():
    """SparseStats' served work: the short documents' spans plus the tiles at the calibration's prices times the
    plans' scale; its two parts are reported before the scale."""
    from attnpool.plan import load_cost_model
    from attnpool.runtime.sparse import SparseStats
    from attnpool.sparse.cost import ServedPrice

    price = ServedPrice(load_cost_model("pairs"), SparseCoefficients(2.0, 3.0, 0.0, 5.0, 11.0, 0.0), sparse_scale=1.5)
    stats = SparseStats(price)
    stats.served = torch.tensor([10.0, 4.0, 1000.0], dtype=torch.float64)  # slash tiles, bars, pairs (x heads)
    stats.dense_served_work, stats.dense_served = 100.0, 50.0
    pairs, work, _, tiles, dense = stats.values()[5:10]
    assert tiles == 7.0 * 10 + 14.0 * 4 and dense == 100.0 and pairs == 1050.0
    assert work == pytest.approx(100.0 + 1.5 * tiles)
