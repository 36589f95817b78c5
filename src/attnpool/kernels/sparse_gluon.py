"""Warp-specialised backward of the slash tiles on Hopper, in Gluon: dK, dV and dQ in one pass.

The Triton backward (:mod:`attnpool.kernels.sparse_triton`) computes dQ in a pass of its own, because dQ of
a query block gets a contribution from every key block whose program visits it: 7 tile products per tile
instead of the 5 that dK, dV and dQ need. Adding dQ from the dK/dV pass with atomics was slower (the
atomics stalled the products, bench/results/2026-11-22-h200-sparse-backward.md). This kernel hands each dQ
tile to warps of its own, which add it to an fp32 buffer with one TMA bulk reduce-add while the products go
on (FlashAttention-3's scheme).

One program per (key block J of BLOCK keys, KV head), over the same index as ``_bwd_dkdv_slash``: for each
query head of the group, the head's diagonals that reach a query block of the segment, SUB_M query rows at
a time (an *item*). Three partitions, each walking the same items in the same order (the ring's and the
barriers' phases count them):

- the default one (8 warps, two warpgroups) per item: S = Q K^T and dP = dO V^T ([SUB_M, BLOCK], each
  warpgroup half the keys), P and dS to shared memory, then dQ = dS K, dV += P^T dO and dK += dS^T Q.
  dQ goes first so that its hand-off overlaps the other two products. dK and dV of the block stay in
  registers and are stored once, as in the Triton pass;
- a load warp: K and V of the block once, then Q and dO of each item into a two-slot ring (TMA,
  descriptors over the segment's rows, so rows outside it load as zeros), with the item's rows of LSE and
  delta (the products would otherwise compute 64-bit addresses for them, see below);
- a dQ warp: adds each dQ tile into DQ32 by one TMA reduce-add (rows past the segment's end are clipped by
  the descriptor). A tile that starts before the segment's first row (a CA-task shard that starts inside a
  block) would need a negative coordinate, which the reduce does not take (an illegal instruction on an
  H100): that tile goes out by element atomics.

The vertical columns' dQ and the final scaling and cast are ``_bwd_dq`` with ``SLASH=False`` and
``ACCUMULATED=True``; their dK/dV is ``_bwd_dkdv_vert`` as before. dQ's summation order depends on timing:
the backward is not bitwise deterministic (nor was it: the vertical pass adds dK/dV with atomics).

The products' warps must not spill: at 240 registers a thread, dK and dV take 128 and S and dP 64. With
the SUB_M loop unrolled (``static_range``), the compiler kept the wgmma operand descriptors of one copy for
the other and spilled them, and the per-row LSE and delta addresses spilled too. The spill traffic missed L1
(most of it is shared memory here), and about half of the products' stall samples waited on memory: the pass
took 35% longer at 128K on an H100. The CI compile test checks the products' item loop (from its first
tensor-core product to its last) for local-memory accesses.

Tensors are seen as (rows, heads * HEAD_DIM): heads must be contiguous (the launcher copies otherwise). LSE
and delta come in the launcher's layout (``sparse._tma_rows``): (H, T_ROWS), segment s's rows from
ROW_BASE[s], placed so that every item's first row is 16-byte aligned. TMA takes no other innermost
coordinate: an unaligned one is an illegal instruction on an H100 (seen with shards of odd lengths).
Measured on an H100 and an H200: the backward 23-29% faster than with the Triton passes, 2.22-2.34x its
forward (bench/results/2026-11-22-h100-sparse-gluon-nospill.md).
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

# Sizes of the call (see sparse_triton.PER_CALL_SIZES): not specialised on, so that they compile nothing new.
PER_CALL_SIZES = ["T_ROWS", "N_KPROG", "NBT"]


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA bulk reduce-add (``cp.reduce.async.bulk.tensor``) of a shared-memory tile into global memory at
    ``coord``. Triton 3.6's Gluon builds the operation but has no Hopper wrapper for it; its completion is
    awaited like a TMA store's (``tma.store_wait``)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _program(CU_Q, CU_K, SEG_DOC, KPROG_SEG, KPROG_BLK, BLK_OFF):
    """(pid, kv head, valid, key block J, q0, q_len, k0, k_len, shift, the document's first diagonal slot,
    segment) of this program; an unused program (segment -1) reads segment 0 and has no items."""
    pid = gl.program_id(0)
    s = gl.load(KPROG_SEG + pid)
    valid = s >= 0
    s = gl.maximum(s, 0)
    q0 = gl.load(CU_Q + s)
    q_len = gl.load(CU_Q + s + 1) - q0
    k0 = gl.load(CU_K + s)
    k_len = gl.load(CU_K + s + 1) - k0
    boff = gl.load(BLK_OFF + gl.load(SEG_DOC + s))
    return pid, gl.program_id(1), valid, gl.load(KPROG_BLK + pid), q0, q_len, k0, k_len, k_len - q_len, boff, s


@gluon.jit
def _diagonal_range(KV_LO, KV_HI, h, N_KPROG, pid, valid):
    """The head's diagonals [lo, hi) that reach the segment's query blocks from this key block."""
    lo = gl.load(KV_LO + h * N_KPROG + pid)
    hi = gl.load(KV_HI + h * N_KPROG + pid)
    return lo, gl.where(valid, hi, lo)


@gluon.jit
def _load_partition(Q, K, V, DO, LSE, DELTA, T_ROWS, sq_t, sk_t, sv_t, sdo_t, H, H_KV,
                    CU_Q, CU_K, SEG_DOC, KPROG_SEG, KPROG_BLK, N_KPROG, SL_LIST, NBT, BLK_OFF, KV_LO, KV_HI, ROW_BASE,
                    k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_bar, q_ready, q_empty,
                    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, SUB_M: gl.constexpr,
                    NBUF: gl.constexpr):
    pid, kvh, valid, J, q0, q_len, k0, k_len, shift, boff, s = _program(CU_Q, CU_K, SEG_DOC, KPROG_SEG, KPROG_BLK,
                                                                         BLK_OFF)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD_DIM], gl.bfloat16)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([SUB_M, HEAD_DIM], gl.bfloat16)
    # Over the segment's rows, all heads side by side: rows outside the segment load as zeros.
    k_desc = tma.make_tensor_descriptor(K + k0.to(gl.int64) * sk_t, [k_len, H_KV * HEAD_DIM], [sk_t, 1],
                                        [BLOCK, HEAD_DIM], kv_layout)
    v_desc = tma.make_tensor_descriptor(V + k0.to(gl.int64) * sv_t, [k_len, H_KV * HEAD_DIM], [sv_t, 1],
                                        [BLOCK, HEAD_DIM], kv_layout)
    q_desc = tma.make_tensor_descriptor(Q + q0.to(gl.int64) * sq_t, [q_len, H * HEAD_DIM], [sq_t, 1],
                                        [SUB_M, HEAD_DIM], q_layout)
    do_desc = tma.make_tensor_descriptor(DO + q0.to(gl.int64) * sdo_t, [q_len, H * HEAD_DIM], [sdo_t, 1],
                                         [SUB_M, HEAD_DIM], q_layout)
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    # LSE and delta (H, T_ROWS) seen flat: rows outside the segment load padding or a neighbour's values
    # (zeros outside the tensor), which the products mask.
    lse_desc = tma.make_tensor_descriptor(LSE, [H * T_ROWS], [1], [SUB_M], row_layout)
    delta_desc = tma.make_tensor_descriptor(DELTA, [H * T_ROWS], [1], [SUB_M], row_layout)
    row_base = gl.load(ROW_BASE + s)
    mbarrier.expect(kv_bar, 2 * BLOCK * HEAD_DIM * 2)
    tma.async_copy_global_to_shared(k_desc, [J * BLOCK, kvh * HEAD_DIM], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [J * BLOCK, kvh * HEAD_DIM], kv_bar, v_smem)
    it = 0
    for g in range(GROUP):
        h = kvh * GROUP + g
        lo, hi = _diagonal_range(KV_LO, KV_HI, h, N_KPROG, pid, valid)
        for t in range(lo, hi):
            I = J + gl.load(SL_LIST + h * NBT + boff + t)
            for sub in range(BLOCK // SUB_M):
                slot = it % NBUF
                mbarrier.wait(q_empty.index(slot), ((it // NBUF) & 1) ^ 1)
                row = I * BLOCK + sub * SUB_M - shift  # negative for a shard starting inside the block
                mbarrier.expect(q_ready.index(slot), 2 * SUB_M * HEAD_DIM * 2 + 2 * SUB_M * 4)
                tma.async_copy_global_to_shared(q_desc, [row, h * HEAD_DIM], q_ready.index(slot), q_bufs.index(slot))
                tma.async_copy_global_to_shared(do_desc, [row, h * HEAD_DIM], q_ready.index(slot),
                                                do_bufs.index(slot))
                c = h * T_ROWS + row_base + row  # a multiple of 4
                tma.async_copy_global_to_shared(lse_desc, [c], q_ready.index(slot), lse_bufs.index(slot))
                tma.async_copy_global_to_shared(delta_desc, [c], q_ready.index(slot), delta_bufs.index(slot))
                it += 1


@gluon.jit
def _dq_partition(DQ32, sdq_t, H, CU_Q, CU_K, SEG_DOC, KPROG_SEG, KPROG_BLK, N_KPROG, SL_LIST, NBT, BLK_OFF,
                  KV_LO, KV_HI, dq_smem, dq_ready, dq_empty,
                  GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, SUB_M: gl.constexpr):
    pid, kvh, valid, J, q0, q_len, k0, k_len, shift, boff, s = _program(CU_Q, CU_K, SEG_DOC, KPROG_SEG, KPROG_BLK,
                                                                         BLK_OFF)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([SUB_M, HEAD_DIM], gl.float32)
    dq_desc = tma.make_tensor_descriptor(DQ32 + q0.to(gl.int64) * sdq_t, [q_len, H * HEAD_DIM], [sdq_t, 1],
                                         [SUB_M, HEAD_DIM], dq_layout)
    # The atomics of a tile that starts before the segment: 8 rows at a time, one warp.
    rows8: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, 1], [1, 0])
    offs_r = gl.arange(0, 8, gl.SliceLayout(1, rows8))
    offs_d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, rows8))
    it = 0
    for g in range(GROUP):
        h = kvh * GROUP + g
        lo, hi = _diagonal_range(KV_LO, KV_HI, h, N_KPROG, pid, valid)
        for t in range(lo, hi):
            I = J + gl.load(SL_LIST + h * NBT + boff + t)
            for sub in range(BLOCK // SUB_M):
                mbarrier.wait(dq_ready.index(0), it & 1)
                row = I * BLOCK + sub * SUB_M - shift
                if row >= 0:
                    _tma_reduce_add(dq_desc, [row, h * HEAD_DIM], dq_smem)
                    tma.store_wait(pendings=0)  # the reduce has read the tile: it may be overwritten
                else:
                    for r in gl.static_range(SUB_M // 8):
                        vals = dq_smem.slice(r * 8, 8, 0).load(rows8)
                        rows = row + r * 8 + offs_r
                        ok = (rows >= 0) & (rows < q_len)
                        ptr = DQ32 + (q0 + rows).to(gl.int64)[:, None] * sdq_t + h * HEAD_DIM + offs_d[None, :]
                        gl.atomic_add(ptr, vals, mask=ok[:, None], sem="relaxed")
                mbarrier.arrive(dq_empty.index(0), count=1)
                it += 1


@gluon.jit
def _mma_partition(DK, DV, sdk_t, scale, scale_log2,
                   CU_Q, CU_K, SEG_DOC, KPROG_SEG, KPROG_BLK, N_KPROG, SL_LIST, NBT, BLK_OFF, KV_LO, KV_HI,
                   k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, p_smem, ds_smem, dq_smem,
                   kv_bar, q_ready, q_empty, dq_ready, dq_empty,
                   GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, SUB_M: gl.constexpr,
                   NBUF: gl.constexpr):
    pid, kvh, valid, J, q0, q_len, k0, k_len, shift, boff, s = _program(CU_Q, CU_K, SEG_DOC, KPROG_SEG, KPROG_BLK,
                                                                         BLK_OFF)
    # S and dP as [SUB_M queries, BLOCK keys], each warpgroup half the keys; dK and dV as [BLOCK, HEAD_DIM],
    # each warpgroup 64 keys; dQ as [SUB_M, HEAD_DIM], each warpgroup half of HEAD_DIM.
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, BLOCK // 2, 16])
    mma_kv: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                     instr_shape=[16, HEAD_DIM, 16])
    mma_dq: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                     instr_shape=[16, HEAD_DIM // 2, 16])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma_s)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma_s)
    dk = gl.zeros([BLOCK, HEAD_DIM], gl.float32, mma_kv)
    dv = gl.zeros([BLOCK, HEAD_DIM], gl.float32, mma_kv)
    mbarrier.wait(kv_bar, 0)
    it = 0
    for g in range(GROUP):
        h = kvh * GROUP + g
        lo, hi = _diagonal_range(KV_LO, KV_HI, h, N_KPROG, pid, valid)
        for t in range(lo, hi):
            I = J + gl.load(SL_LIST + h * NBT + boff + t)
            # Diagonals are sorted and distinct: only the first (Delta = 0, or the segment's first query
            # block) and the last (its last query block) can hold masked pairs.
            masked = (t == lo) | (t == hi - 1)
            for sub in range(BLOCK // SUB_M):  # not unrolled: unrolled, the products spill (module docstring)
                slot = it % NBUF
                offs_m = I * BLOCK + sub * SUB_M + gl.arange(0, SUB_M, rows_l)
                rows = offs_m - shift
                row_ok = (rows >= 0) & (rows < q_len)
                mbarrier.wait(q_ready.index(slot), (it // NBUF) & 1)
                lse2 = gl.where(row_ok, lse_bufs.index(slot).load(rows_l) * 1.4426950408889634, 0.0)
                di = gl.where(row_ok, delta_bufs.index(slot).load(rows_l), 0.0)
                q_s = q_bufs.index(slot)
                do_s = do_bufs.index(slot)
                sc = warpgroup_mma(q_s, k_smem.permute((1, 0)), gl.zeros([SUB_M, BLOCK], gl.float32, mma_s),
                                   use_acc=False, is_async=True)
                dp = warpgroup_mma(do_s, v_smem.permute((1, 0)), gl.zeros([SUB_M, BLOCK], gl.float32, mma_s),
                                   use_acc=False, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc, ))
                p = gl.exp2(sc * scale_log2 - lse2[:, None])
                if masked:
                    # Key positions only here: held across the loop they would cost 32 registers.
                    kpos = J * BLOCK + gl.arange(0, BLOCK, cols_l)
                    ok = row_ok[:, None] & (kpos[None, :] < k_len) & (kpos[None, :] <= offs_m[:, None])
                    p = gl.where(ok, p, 0.0)
                dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, ))
                ds = p * (dp - di[:, None])
                p_smem.store(p.to(gl.bfloat16))
                ds_smem.store(ds.to(gl.bfloat16))
                fence_async_shared()
                gl.thread_barrier()  # each warpgroup's products read both warpgroups' halves of P and dS
                dq = warpgroup_mma(ds_smem, k_smem, gl.zeros([SUB_M, HEAD_DIM], gl.float32, mma_dq),
                                   use_acc=False, is_async=True)
                dv = warpgroup_mma(p_smem.permute((1, 0)), do_s, dv, is_async=True)
                dk = warpgroup_mma(ds_smem.permute((1, 0)), q_s, dk, is_async=True)
                dq = warpgroup_mma_wait(num_outstanding=2, deps=(dq, ))
                mbarrier.wait(dq_empty.index(0), (it & 1) ^ 1)
                dq_smem.store(dq)
                fence_async_shared()  # the dQ warp's TMA reads the tile through the async proxy
                gl.thread_barrier()
                mbarrier.arrive(dq_ready.index(0), count=1)
                dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
                mbarrier.arrive(q_empty.index(slot), count=1)
                it += 1
    offs_d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, mma_kv))
    kpos = J * BLOCK + gl.arange(0, BLOCK, gl.SliceLayout(1, mma_kv))
    ok = (kpos < k_len) & valid
    ptr = (k0 + kpos).to(gl.int64)[:, None] * sdk_t + kvh * HEAD_DIM + offs_d[None, :]
    gl.store(DK + ptr, dk * scale, mask=ok[:, None])
    gl.store(DV + ptr, dv, mask=ok[:, None])


@gluon.jit(do_not_specialize=PER_CALL_SIZES)
def _bwd_slash(Q, K, V, DO, LSE, DELTA, DK, DV, DQ32,
               sq_t, sk_t, sv_t, sdo_t, sdk_t, sdq_t, T_ROWS, H, H_KV,
               CU_Q, CU_K, SEG_DOC, KPROG_SEG, KPROG_BLK, N_KPROG, SL_LIST, NBT, BLK_OFF, KV_LO, KV_HI, ROW_BASE,
               scale, scale_log2,
               GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, SUB_M: gl.constexpr,
               NBUF: gl.constexpr):
    """dK and dV of the slash tiles into DK/DV (fp32, scaled, written once), their dQ added unscaled into DQ32
    (fp32, zeroed by the caller). LSE and DELTA: (H, T_ROWS) float32, segment s's rows from ROW_BASE[s]
    (``sparse._tma_rows``)."""
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD_DIM], gl.bfloat16)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([SUB_M, HEAD_DIM], gl.bfloat16)
    ps_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([SUB_M, BLOCK], gl.bfloat16)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([SUB_M, HEAD_DIM], gl.float32)
    # 193 KB at BLOCK 128, SUB_M 64, HEAD_DIM 128, NBUF 2. A second dQ tile (224 KB) was slower on an H100.
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK, HEAD_DIM], kv_layout)
    q_bufs = gl.allocate_shared_memory(gl.bfloat16, [NBUF, SUB_M, HEAD_DIM], q_layout)
    do_bufs = gl.allocate_shared_memory(gl.bfloat16, [NBUF, SUB_M, HEAD_DIM], q_layout)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [SUB_M, BLOCK], ps_layout)
    ds_smem = gl.allocate_shared_memory(gl.bfloat16, [SUB_M, BLOCK], ps_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [SUB_M, HEAD_DIM], dq_layout)
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [NBUF, SUB_M], row_layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [NBUF, SUB_M], row_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    dq_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NBUF):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    mbarrier.init(dq_ready.index(0), count=1)
    mbarrier.init(dq_empty.index(0), count=1)
    # The load and dQ warps get 24 registers each: with maxnreg 168 (CONFIG) that leaves the two
    # warpgroups of products 240.
    gl.warp_specialize([
        (_mma_partition, (DK, DV, sdk_t, scale, scale_log2,
                          CU_Q, CU_K, SEG_DOC, KPROG_SEG, KPROG_BLK, N_KPROG, SL_LIST, NBT, BLK_OFF, KV_LO, KV_HI,
                          k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, p_smem, ds_smem, dq_smem,
                          kv_bar, q_ready, q_empty, dq_ready, dq_empty, GROUP, HEAD_DIM, BLOCK, SUB_M, NBUF)),
        (_load_partition, (Q, K, V, DO, LSE, DELTA, T_ROWS, sq_t, sk_t, sv_t, sdo_t, H, H_KV,
                           CU_Q, CU_K, SEG_DOC, KPROG_SEG, KPROG_BLK, N_KPROG, SL_LIST, NBT, BLK_OFF, KV_LO, KV_HI,
                           ROW_BASE,
                           k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_bar, q_ready, q_empty,
                           GROUP, HEAD_DIM, BLOCK, SUB_M, NBUF)),
        (_dq_partition, (DQ32, sdq_t, H,
                         CU_Q, CU_K, SEG_DOC, KPROG_SEG, KPROG_BLK, N_KPROG, SL_LIST, NBT, BLK_OFF, KV_LO, KV_HI,
                         dq_smem, dq_ready, dq_empty, GROUP, HEAD_DIM, BLOCK, SUB_M)),
    ], [1, 1], [24, 24])
