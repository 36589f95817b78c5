"""Triton kernels of vertical-slash sparse attention over the CA-task layout.

Five kernels, all over the index built in :mod:`attnpool.kernels.sparse`
(``SparseIndex``); see :mod:`attnpool.sparse.pattern` for the attended set.

- ``_fwd``: one program per (query block, query head). Loops over the head's block
  diagonals Delta <= I (key block J = I - Delta, a 128x128 tile, causal inside
  the diagonal tile), then over the vertical columns c with c // B <= I - run,
  gathered BV (64) at a time, masking those whose tile is a slash tile. Online
  softmax in base 2; returns out and the natural-log LSE.
- ``_bwd_dq``: the same loops, computing dQ (no atomics). After the Gluon pass
  (:mod:`attnpool.kernels.sparse_gluon`, which computes the slash tiles' dK, dV and dQ on Hopper)
  it runs with ``SLASH=False, ACCUMULATED=True``: the columns' part only, added to that pass's fp32 dQ,
  then scaled and cast.
- ``_bwd_dkdv_slash``: one program per (key block, kv head); loops over the query
  heads of the group and, per head, over the diagonals that reach a query block of
  the segment (the transposed slash index is a contiguous range of the sorted
  diagonal list: Delta in [max(i0, J) - J, i1 - 1 - J]). Writes dK/dV of the
  block once, no atomics.
- ``_bwd_dkdv_vert``: one program per (vertical chunk of BV columns, query head,
  split of the query blocks); accumulates the columns' dK/dV over the query
  blocks that attend them as verticals and adds them with fp32 atomics into the
  buffers the slash pass wrote (contention: only query heads of one group that
  chose the same column, and the splits of one chunk).
- ``_bwd_delta``: the backward's rowsum(dO * O) per (row, head), read once in bf16.

dQ fused into the dK/dV passes here (FlashAttention-2's scheme: 5 tile products instead of
7, dQ added with fp32 atomics) was 14-19% slower than the separate dQ pass on an H200
and an H100, and nondeterministic; it was removed after 3c1bded
(bench/results/2026-11-22-h200-sparse-backward.md, 2026-11-22-h100-sparse.md). The Gluon pass
does the same with the reductions in warps of their own, and is 5-12.5% faster than these passes. The
vertical pass's atomics are ``relaxed``: only the sum after the kernel matters, and
Triton's default acquire-release ordering made them twice as slow.

Rows are positions in key coordinates (p = k_len - q_len + row); blocks are
aligned to key position 0, so a query shard that starts mid-block gets a partial
first tile, exactly as the cost model counts.

The forward and the dQ pass read their slash K/V tiles through TMA descriptors
(``_rows_desc``, one per program, head and tensor, over the segment's rows, so that
rows outside it load as zeros): on an H200 that made the forward 12-14% (with a third
pipeline stage) and the dQ pass 21% faster (bench/results/2026-11-22-h200-sparse-tma.md).
The dK/dV passes keep pointer loads of their query rows. Through TMA with a descriptor
per head, built in the loop over the group's heads, the slash pass was 4-13% slower; with
one per program over all heads, the backward moved -1.3% to +1.05% in an A/B in one run,
and with K/V through TMA as well (fewer register spills) it was no faster
(bench/results/2026-11-22-h200-sparse-dkdv-tma.md). Gathered vertical columns have no TMA
form on Hopper.

Masks cost time (a fifth of the slash dK/dV pass on an H200), so only the tiles
that need them have them. A slash tile below the diagonal (Delta >= 1) lies wholly
before its queries and inside the segment's keys: the forward and the dQ pass mask
only the diagonal tile, and the slash dK/dV pass, which loads each tile's query rows,
masks a head's first and last diagonal, where the query block can be partial
(bench/results/2026-11-22-h200-sparse-unmasked.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Integer arguments that are sizes of the call: query rows, program counts, pattern-table widths.
# They change with every batch, and Triton specialises integer arguments on divisibility by 16 (and
# on == 1): each new combination would compile another variant of a kernel, for seconds, in the
# middle of training and at a different step on each rank. Not specialising on them cost nothing
# measurable (bench/results/2026-11-22-h200-sparse-warmup.md).
PER_CALL_SIZES = ["T_q", "N_PROG", "N_KPROG", "N_VPROG", "NBT", "NVT"]


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _rows_desc(X, r0, n_rows, s_t, head, s_h, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """TMA descriptor of one head's rows [r0, r0 + n_rows) of a (T, H, HEAD_DIM) tensor, ROWS at a time.

    Row coordinates are relative to r0; rows outside [0, n_rows) load as zeros, which is
    the masked load of rows outside the segment, without the mask's address arithmetic.
    """
    return tl.make_tensor_descriptor(X + r0.to(tl.int64) * s_t + head * s_h, shape=[n_rows, HEAD_DIM],
                                     strides=[s_t, 1], block_shape=[ROWS, HEAD_DIM])


@triton.jit(do_not_specialize=PER_CALL_SIZES)
def _bwd_delta(O, DO, DELTA, so_t, so_h, sdo_t, sdo_h, T_q, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """DELTA[h, i] = sum_d O[i, h, d] * DO[i, h, d] in fp32: one read of both, no fp32 copies."""
    h = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < T_q
    offs_d = tl.arange(0, HEAD_DIM)
    r = rows.to(tl.int64)[:, None]
    o = tl.load(O + r * so_t + h * so_h + offs_d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + r * sdo_t + h * sdo_h + offs_d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + h * T_q + rows, tl.sum(o * do, 1), mask=ok)


@triton.jit
def _fwd_slash_tile(m_i, l_i, acc, q, k_desc, v_desc, kblock, offs_m, k_len, scale_log2,
                    BLOCK: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """One B x B slash tile of the forward's online softmax (masks only when MASKED)."""
    kpos = kblock * BLOCK + tl.arange(0, BLOCK)
    kt = tl.trans(k_desc.load([kblock * BLOCK, 0]))
    qk = _dot(q, kt, IEEE) * scale_log2
    if MASKED:
        qk = tl.where((kpos[None, :] < k_len) & (kpos[None, :] <= offs_m[:, None]), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = m_new  # finite: every entry of an unmasked tile is
    vt = v_desc.load([kblock * BLOCK, 0])
    p = tl.math.exp2(qk - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, IEEE)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=PER_CALL_SIZES)
def _fwd(Q, K, V, O, LSE,
         sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, T_q,
         CU_Q, CU_K, SEG_DOC, PROG_SEG, PROG_BLK, N_PROG,
         SL_LIST, SL_BITS, NBT, BLK_OFF, VERT, NVT, VERT_OFF, N_SL, V_HI,
         scale_log2,
         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BV: tl.constexpr,
         IEEE: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(PROG_SEG + pid)
    if s >= 0:
        I = tl.load(PROG_BLK + pid)
        q0 = tl.load(CU_Q + s)
        q_len = tl.load(CU_Q + s + 1) - q0
        k0 = tl.load(CU_K + s)
        k_len = tl.load(CU_K + s + 1) - k0
        shift = k_len - q_len
        doc = tl.load(SEG_DOC + s)
        boff = tl.load(BLK_OFF + doc)
        voff = tl.load(VERT_OFF + doc)
        kvh = h // GROUP
        offs_m = I * BLOCK + tl.arange(0, BLOCK)
        rows = offs_m - shift
        row_ok = (rows >= 0) & (rows < q_len)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_v = tl.arange(0, BV)
        q = tl.load(Q + (q0 + rows)[:, None].to(tl.int64) * sq_t + h * sq_h + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
        k_desc = _rows_desc(K, k0, k_len, sk_t, kvh, sk_h, HEAD_DIM, BLOCK)
        v_desc = _rows_desc(V, k0, k_len, sv_t, kvh, sv_h, HEAD_DIM, BLOCK)
        n_sl = tl.load(N_SL + h * N_PROG + pid)
        # Only the first diagonal, Delta = 0 (always present), needs masks: the causal one, and the keys
        # past the segment's end in its last block. Rows outside the segment are never stored.
        n_masked = tl.minimum(n_sl, 1)
        for t in range(0, n_masked):
            kblock = I - tl.load(SL_LIST + h * NBT + boff + t)
            m_i, l_i, acc = _fwd_slash_tile(m_i, l_i, acc, q, k_desc, v_desc, kblock, offs_m, k_len, scale_log2,
                                            BLOCK, True, IEEE)
        for t in range(n_masked, n_sl):
            kblock = I - tl.load(SL_LIST + h * NBT + boff + t)
            m_i, l_i, acc = _fwd_slash_tile(m_i, l_i, acc, q, k_desc, v_desc, kblock, offs_m, k_len, scale_log2,
                                            BLOCK, False, IEEE)
        v_hi = tl.load(V_HI + h * N_PROG + pid)
        for t0 in range(0, v_hi, BV):
            idx = t0 + offs_v
            vm = idx < v_hi
            cols = tl.load(VERT + h * NVT + voff + idx, mask=vm, other=0)
            covered = tl.load(SL_BITS + h * NBT + boff + I - cols // BLOCK, mask=vm, other=1)
            ok = vm & (covered == 0)
            krow = (k0 + cols).to(tl.int64)
            kt = tl.load(K + krow[None, :] * sk_t + kvh * sk_h + offs_d[:, None], mask=ok[None, :], other=0.0)
            qk = _dot(q, kt, IEEE) * scale_log2
            qk = tl.where(ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(V + krow[:, None] * sv_t + kvh * sv_h + offs_d[None, :], mask=ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, IEEE)
            m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
        orow = (q0 + rows).to(tl.int64)
        tl.store(O + orow[:, None] * so_t + h * so_h + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + h * T_q + orow, lse, mask=row_ok)


@triton.jit
def _dq_slash_tile(dq, q, do, lse2, di, k_desc, v_desc, kblock, offs_m, row_ok, k_len, scale_log2,
                   BLOCK: tl.constexpr, SUB_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """dQ of one B x B slash tile, SUB_N keys at a time (masks only when MASKED)."""
    for sub in tl.static_range(BLOCK // SUB_N):
        kpos = kblock * BLOCK + sub * SUB_N + tl.arange(0, SUB_N)
        k = k_desc.load([kblock * BLOCK + sub * SUB_N, 0])
        if MASKED:
            ok = row_ok[:, None] & (kpos[None, :] < k_len) & (kpos[None, :] <= offs_m[:, None])
            p = tl.where(ok, tl.math.exp2(_dot(q, tl.trans(k), IEEE) * scale_log2 - lse2[:, None]), 0.0)
        else:
            p = tl.math.exp2(_dot(q, tl.trans(k), IEEE) * scale_log2 - lse2[:, None])
        v = v_desc.load([kblock * BLOCK + sub * SUB_N, 0])
        ds = p * (_dot(do, tl.trans(v), IEEE) - di[:, None])
        dq += _dot(ds.to(k.dtype), k, IEEE)
    return dq


@triton.jit(do_not_specialize=PER_CALL_SIZES)
def _bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, DQ32,
            sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sdo_t, sdo_h, sdq_t, sdq_h, s32_t, s32_h, T_q,
            CU_Q, CU_K, SEG_DOC, PROG_SEG, PROG_BLK, N_PROG,
            SL_LIST, SL_BITS, NBT, BLK_OFF, VERT, NVT, VERT_OFF, N_SL, V_HI,
            scale, scale_log2,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BV: tl.constexpr,
            SUB_N: tl.constexpr, SLASH: tl.constexpr, ACCUMULATED: tl.constexpr, IEEE: tl.constexpr):
    """dQ = scale * (the slash tiles' part, if SLASH + the vertical columns' part [+ DQ32's rows, unscaled,
    if ACCUMULATED]), cast to DQ's type. Without SLASH a program with no columns only scales and casts."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(PROG_SEG + pid)
    if s >= 0:
        I = tl.load(PROG_BLK + pid)
        q0 = tl.load(CU_Q + s)
        q_len = tl.load(CU_Q + s + 1) - q0
        k0 = tl.load(CU_K + s)
        k_len = tl.load(CU_K + s + 1) - k0
        shift = k_len - q_len
        doc = tl.load(SEG_DOC + s)
        boff = tl.load(BLK_OFF + doc)
        voff = tl.load(VERT_OFF + doc)
        kvh = h // GROUP
        offs_m = I * BLOCK + tl.arange(0, BLOCK)
        rows = offs_m - shift
        row_ok = (rows >= 0) & (rows < q_len)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_v = tl.arange(0, BV)
        qrow = (q0 + rows).to(tl.int64)
        if ACCUMULATED:
            dq = tl.load(DQ32 + qrow[:, None] * s32_t + h * s32_h + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        else:
            dq = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
        v_hi = tl.load(V_HI + h * N_PROG + pid)
        work = v_hi > 0
        if SLASH:
            work = True
        if work:
            q = tl.load(Q + qrow[:, None] * sq_t + h * sq_h + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            do = tl.load(DO + qrow[:, None] * sdo_t + h * sdo_h + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(LSE + h * T_q + qrow, mask=row_ok, other=0.0) * 1.4426950408889634
            lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
            di = tl.load(DELTA + h * T_q + qrow, mask=row_ok, other=0.0)
            if SLASH:
                k_desc = _rows_desc(K, k0, k_len, sk_t, kvh, sk_h, HEAD_DIM, SUB_N)
                v_desc = _rows_desc(V, k0, k_len, sv_t, kvh, sv_h, HEAD_DIM, SUB_N)
                n_sl = tl.load(N_SL + h * N_PROG + pid)
                # Only the first diagonal, Delta = 0 (always present), needs masks: the causal one, and the keys
                # past the segment's end in its last block. Rows outside the segment are never stored.
                n_masked = tl.minimum(n_sl, 1)
                for t in range(0, n_masked):
                    kblock = I - tl.load(SL_LIST + h * NBT + boff + t)
                    dq = _dq_slash_tile(dq, q, do, lse2, di, k_desc, v_desc, kblock, offs_m, row_ok, k_len,
                                        scale_log2, BLOCK, SUB_N, True, IEEE)
                for t in range(n_masked, n_sl):
                    kblock = I - tl.load(SL_LIST + h * NBT + boff + t)
                    dq = _dq_slash_tile(dq, q, do, lse2, di, k_desc, v_desc, kblock, offs_m, row_ok, k_len,
                                        scale_log2, BLOCK, SUB_N, False, IEEE)
            for t0 in range(0, v_hi, BV):
                idx = t0 + offs_v
                vm = idx < v_hi
                cols = tl.load(VERT + h * NVT + voff + idx, mask=vm, other=0)
                covered = tl.load(SL_BITS + h * NBT + boff + I - cols // BLOCK, mask=vm, other=1)
                okc = vm & (covered == 0)
                krow = (k0 + cols).to(tl.int64)
                kt = tl.load(K + krow[None, :] * sk_t + kvh * sk_h + offs_d[:, None], mask=okc[None, :], other=0.0)
                ok = row_ok[:, None] & okc[None, :]
                p = tl.where(ok, tl.math.exp2(_dot(q, kt, IEEE) * scale_log2 - lse2[:, None]), 0.0)
                vt = tl.load(V + krow[None, :] * sv_t + kvh * sv_h + offs_d[:, None], mask=okc[None, :], other=0.0)
                ds = p * (_dot(do, vt, IEEE) - di[:, None])
                dq += _dot(ds.to(kt.dtype), tl.trans(kt), IEEE)
        tl.store(DQ + qrow[:, None] * sdq_t + h * sdq_h + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
                 mask=row_ok[:, None])


@triton.jit
def _dkdv_tile(dk, dv, k, v, kpos, kmask, qblock, Q, DO, LSE, DELTA, h, q0, shift, q_len, T_q,
               sq_t, sq_h, sdo_t, sdo_h, scale_log2,
               HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SUB_M: tl.constexpr, MASKED: tl.constexpr,
               IEEE: tl.constexpr):
    """dK/dV of the keys held (slash block or gathered columns at positions kpos) from query
    block qblock, SUB_M query rows at a time.

    Unmasked (MASKED false) only for a tile whose rows are all valid and whose keys all lie
    at or before every row: no mask on loads or probabilities.
    """
    offs_d = tl.arange(0, HEAD_DIM)
    for sub in tl.static_range(BLOCK // SUB_M):
        offs_m = qblock * BLOCK + sub * SUB_M + tl.arange(0, SUB_M)
        rows = offs_m - shift
        row_ok = (rows >= 0) & (rows < q_len)
        qrow = (q0 + rows).to(tl.int64)
        q_ptr = Q + qrow[:, None] * sq_t + h * sq_h + offs_d[None, :]
        do_ptr = DO + qrow[:, None] * sdo_t + h * sdo_h + offs_d[None, :]
        if MASKED:
            q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptr, mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(LSE + h * T_q + qrow, mask=row_ok, other=0.0) * 1.4426950408889634
            lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
            di = tl.load(DELTA + h * T_q + qrow, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_ptr)
            do = tl.load(do_ptr)
            lse2 = tl.load(LSE + h * T_q + qrow) * 1.4426950408889634  # finite: each row attends this tile
            di = tl.load(DELTA + h * T_q + qrow)
        # Transposed tile: keys along rows, queries along columns.
        qkT = _dot(k, tl.trans(q), IEEE) * scale_log2
        if MASKED:
            ok = kmask[:, None] & row_ok[None, :] & (kpos[:, None] <= offs_m[None, :])
            pT = tl.where(ok, tl.math.exp2(qkT - lse2[None, :]), 0.0)
        else:
            pT = tl.math.exp2(qkT - lse2[None, :])
        dv += _dot(pT.to(do.dtype), do, IEEE)
        dpT = _dot(v, tl.trans(do), IEEE)
        dsT = pT * (dpT - di[None, :])
        dk += _dot(dsT.to(q.dtype), q, IEEE)
    return dk, dv


@triton.jit(do_not_specialize=PER_CALL_SIZES)
def _bwd_dkdv_slash(Q, K, V, DO, LSE, DELTA, DK, DV,
                    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sdo_t, sdo_h, sdk_t, sdk_h, T_q,
                    CU_Q, CU_K, SEG_DOC, KPROG_SEG, KPROG_BLK, N_KPROG,
                    SL_LIST, NBT, BLK_OFF, KV_LO, KV_HI,
                    scale, scale_log2,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SUB_M: tl.constexpr,
                    IEEE: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.load(KPROG_SEG + pid)
    if s >= 0:
        J = tl.load(KPROG_BLK + pid)
        q0 = tl.load(CU_Q + s)
        q_len = tl.load(CU_Q + s + 1) - q0
        k0 = tl.load(CU_K + s)
        k_len = tl.load(CU_K + s + 1) - k0
        shift = k_len - q_len
        doc = tl.load(SEG_DOC + s)
        boff = tl.load(BLK_OFF + doc)
        offs_d = tl.arange(0, HEAD_DIM)
        kpos = J * BLOCK + tl.arange(0, BLOCK)
        kmask = kpos < k_len
        krow = (k0 + kpos).to(tl.int64)
        k = tl.load(K + krow[:, None] * sk_t + kvh * sk_h + offs_d[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(V + krow[:, None] * sv_t + kvh * sv_h + offs_d[None, :], mask=kmask[:, None], other=0.0)
        dk = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
        for g in range(GROUP):
            h = kvh * GROUP + g
            lo = tl.load(KV_LO + h * N_KPROG + pid)
            hi = tl.load(KV_HI + h * N_KPROG + pid)
            # Diagonals are sorted and distinct, so only the first (Delta = 0, or the segment's
            # first query block) and the last (its last query block) need masks.
            if hi > lo:
                qblock = J + tl.load(SL_LIST + h * NBT + boff + lo)
                dk, dv = _dkdv_tile(dk, dv, k, v, kpos, kmask, qblock, Q, DO, LSE, DELTA, h, q0, shift, q_len,
                                    T_q, sq_t, sq_h, sdo_t, sdo_h, scale_log2,
                                    HEAD_DIM, BLOCK, SUB_M, True, IEEE)
            for t in range(lo + 1, hi - 1):
                qblock = J + tl.load(SL_LIST + h * NBT + boff + t)
                dk, dv = _dkdv_tile(dk, dv, k, v, kpos, kmask, qblock, Q, DO, LSE, DELTA, h, q0, shift, q_len,
                                    T_q, sq_t, sq_h, sdo_t, sdo_h, scale_log2,
                                    HEAD_DIM, BLOCK, SUB_M, False, IEEE)
            if hi - 1 > lo:
                qblock = J + tl.load(SL_LIST + h * NBT + boff + hi - 1)
                dk, dv = _dkdv_tile(dk, dv, k, v, kpos, kmask, qblock, Q, DO, LSE, DELTA, h, q0, shift, q_len,
                                    T_q, sq_t, sq_h, sdo_t, sdo_h, scale_log2,
                                    HEAD_DIM, BLOCK, SUB_M, True, IEEE)
        tl.store(DK + krow[:, None] * sdk_t + kvh * sdk_h + offs_d[None, :], dk * scale, mask=kmask[:, None])
        tl.store(DV + krow[:, None] * sdk_t + kvh * sdk_h + offs_d[None, :], dv, mask=kmask[:, None])


@triton.jit(do_not_specialize=PER_CALL_SIZES)
def _bwd_dkdv_vert(Q, K, V, DO, LSE, DELTA, DK, DV,
                   sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sdo_t, sdo_h, sdk_t, sdk_h, T_q,
                   CU_Q, CU_K, SEG_DOC, VPROG_SEG, VPROG_CHUNK, N_VPROG, V_MAX,
                   SL_BITS, NBT, BLK_OFF, VERT, NVT, VERT_OFF, RUN, N_HEADS,
                   scale, scale_log2,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BV: tl.constexpr,
                   QSPLIT: tl.constexpr, SUB_M: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    s = tl.load(VPROG_SEG + pid)
    if s >= 0:
        chunk = tl.load(VPROG_CHUNK + pid)
        nv = tl.load(V_MAX + h * N_VPROG + pid)
        q0 = tl.load(CU_Q + s)
        q_len = tl.load(CU_Q + s + 1) - q0
        k0 = tl.load(CU_K + s)
        k_len = tl.load(CU_K + s + 1) - k0
        shift = k_len - q_len
        doc = tl.load(SEG_DOC + s)
        boff = tl.load(BLK_OFF + doc)
        voff = tl.load(VERT_OFF + doc)
        run = tl.load(RUN + doc * N_HEADS + h)
        i0 = tl.maximum(shift, 0) // BLOCK
        i1 = (k_len + BLOCK - 1) // BLOCK
        first = tl.load(VERT + h * NVT + voff + chunk * BV, mask=chunk * BV < nv, other=0)
        lo = tl.maximum(tl.maximum(i0, first // BLOCK + run), i0 + split * QSPLIT)
        hi = tl.minimum(i1, i0 + (split + 1) * QSPLIT)
        if (chunk * BV < nv) & (lo < hi):
            kvh = h // GROUP
            offs_d = tl.arange(0, HEAD_DIM)
            idx = chunk * BV + tl.arange(0, BV)
            vm = idx < nv
            cols = tl.load(VERT + h * NVT + voff + idx, mask=vm, other=0)
            cb = cols // BLOCK
            krow = (k0 + cols).to(tl.int64)
            k = tl.load(K + krow[:, None] * sk_t + kvh * sk_h + offs_d[None, :], mask=vm[:, None], other=0.0)
            v = tl.load(V + krow[:, None] * sv_t + kvh * sv_h + offs_d[None, :], mask=vm[:, None], other=0.0)
            dk = tl.zeros([BV, HEAD_DIM], tl.float32)
            dv = tl.zeros([BV, HEAD_DIM], tl.float32)
            for I in range(lo, hi):
                dlt = I - cb
                covered = tl.load(SL_BITS + h * NBT + boff + dlt, mask=vm & (dlt >= 0), other=1)
                okc = vm & (covered == 0)
                # Columns before the diagonal block: the causal test inside the tile always passes.
                dk, dv = _dkdv_tile(dk, dv, k, v, cols, okc, I, Q, DO, LSE, DELTA, h, q0, shift, q_len,
                                    T_q, sq_t, sq_h, sdo_t, sdo_h, scale_log2,
                                    HEAD_DIM, BLOCK, SUB_M, True, IEEE)
            ptr = krow[:, None] * sdk_t + kvh * sdk_h + offs_d[None, :]
            tl.atomic_add(DK + ptr, dk * scale, mask=vm[:, None], sem="relaxed")
            tl.atomic_add(DV + ptr, dv, mask=vm[:, None], sem="relaxed")
