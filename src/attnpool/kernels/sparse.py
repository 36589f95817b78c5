"""Sparse backend: vertical-slash attention over the CA-task layout (Triton on CUDA, a twin on CPU).

Same contract as every backend (kernels.base): packed varlen segments, queries
the tail of their keys (bottom-right causal), GQA, (out, lse) with lse (H_q, T_q)
float32 (float64 for float64 inputs in the twin), -inf / 0 / zero gradients for
rows that see no key. Plus one keyword: the ``pattern`` (a
:class:`~attnpool.sparse.pattern.VerticalSlashPattern`, one entry per document)
and ``seg_doc``, the pattern document of each segment (default: segment i is
document i). A segment's key coordinates are its document's: a CA-task [a, b)
passes keys [0, b) of its document. The attended set is defined in
:mod:`attnpool.sparse.pattern`.

    out, lse = forward(q, k, v, cu_q, cu_k, max_q, max_k, pattern=p)
    dq, dk, dv = backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, pattern=p)
    be = backend(p)        # a Backend bound to one pattern, for core_attention

``impl``: "triton" (CUDA default; on CPU only under TRITON_INTERPRET=1) or "twin"
(CPU default): the same attended set applied as an explicit mask with the
reference math, accumulating in float32 (float64 for float64 inputs). On Hopper,
for bf16 at head_dim 128, the backward's slash tiles run in one warp-specialised
Gluon pass (:mod:`attnpool.kernels.sparse_gluon`, ``SLASH_BACKWARD``).
"""

from __future__ import annotations

import contextvars
import os
from dataclasses import dataclass

import torch

from attnpool.errors import ConfigError
from attnpool.kernels.base import Backend, check_inputs, default_scale, last_dim_contiguous
from attnpool.sparse.pattern import VerticalSlashPattern, exclusive_cumsum, slot_owner

VERTICAL_CHUNK = 64  # vertical columns gathered per kernel step on GPUs
DELTA_ROWS = 64  # query rows per program of the backward's rowsum(dout * out)
QSPLIT = 64  # query blocks per program of the vertical dK/dV pass
# Launch configuration on CUDA per kernel: warps, pipeline stages, and the sub-tile
# (keys per dQ step, query rows per dK/dV step) that a 128 x 128 tile is cut into.
# bench/gpu_sparse.py sweeps these; the defaults are its best on an H200.
CONFIG = {
    "fwd": dict(num_warps=8, num_stages=3),
    "dq": dict(num_warps=8, num_stages=2, SUB_N=64),
    # The dQ pass after the Gluon pass: the columns only (SUB_N, of slash tiles, unused).
    "dq_vertical": dict(num_warps=8, num_stages=2, SUB_N=64),
    "dkdv": dict(num_warps=8, num_stages=2, SUB_M=64),
    "vert": dict(num_warps=4, num_stages=1, SUB_M=64),
    # The Gluon pass (sparse_gluon): 8 warps of products and 2 of loads and dQ reductions; maxnreg 168 gives
    # the products 240 registers a thread.
    "slash_bwd": dict(num_warps=8, maxnreg=168, SUB_M=64, NBUF=2),
}
# The backward's slash tiles: "gluon" (dK, dV and dQ in one warp-specialised pass, sparse_gluon) where that
# runs (gluon_problem), else "triton" (a dQ pass and a dK/dV pass). bench/gpu_sparse.py times both; the
# environment variable ATTNPOOL_SLASH_BACKWARD=triton turns the Gluon pass off without a code change.
SLASH_BACKWARDS = ("gluon", "triton")
SLASH_BACKWARD = os.environ.get("ATTNPOOL_SLASH_BACKWARD", "gluon")


# CONFIG's shared memory (at head_dim 128, bf16, up to 224 KB: the forward, compile_offline) fits Hopper's
# 227 KB per block, not the 163 KB of an A100; TMA loads need sm_90 as well.
MIN_CAPABILITY = (9, 0)


def _slash_backward_problem() -> str | None:
    if SLASH_BACKWARD not in SLASH_BACKWARDS:
        return f"ATTNPOOL_SLASH_BACKWARD={SLASH_BACKWARD!r}: choose one of {', '.join(SLASH_BACKWARDS)}"
    return None


def device_problem(device) -> str | None:
    """Why the sparse Triton kernels cannot run on the CUDA ``device``, or None."""
    problem = _slash_backward_problem()  # here too, so that training refuses it before its first step
    if problem is not None:
        return problem
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return (f"the sparse Triton kernels need an sm_{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]} (Hopper) or newer GPU; "
                f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}")
    return None


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, eq=False)
class SparseIndex:
    """Per-call kernel index: programs and per-(head, program) loop counts.

    Built on the device from the pattern and cu_q/cu_k with shapes bounded by
    the tensor sizes, never by their values: no host synchronisation.
    """

    block: int
    chunk: int
    # query-block programs (forward, dQ)
    prog_seg: torch.Tensor  # (NPQ,) int32, -1 for unused
    prog_blk: torch.Tensor  # (NPQ,) int32
    n_sl: torch.Tensor  # (H, NPQ) int32: diagonals Delta <= I
    v_hi: torch.Tensor  # (H, NPQ) int32: verticals visited (c // B <= I - run)
    # key-block programs (slash dK/dV)
    kprog_seg: torch.Tensor
    kprog_blk: torch.Tensor
    kv_lo: torch.Tensor  # (H, NPK) int32: first diagonal-list entry reaching a query block
    kv_hi: torch.Tensor  # (H, NPK) int32
    # vertical-chunk programs (vertical dK/dV)
    vprog_seg: torch.Tensor
    vprog_chunk: torch.Tensor
    v_max: torch.Tensor  # (H, NPV) int32: verticals visited by the segment's last query block
    n_split: int
    seg_doc: torch.Tensor  # (S,) int32

    @classmethod
    def build(cls, pattern: VerticalSlashPattern, cu_q: torch.Tensor, cu_k: torch.Tensor, T_q: int, T_k: int,
              max_q: int, seg_doc: torch.Tensor | None = None, chunk: int = VERTICAL_CHUNK) -> "SparseIndex":
        B = pattern.block
        dev = pattern.device
        S = cu_q.numel() - 1
        cu_q = cu_q.to(dev, torch.int64)
        cu_k = cu_k.to(dev, torch.int64)
        doc = torch.arange(S, device=dev) if seg_doc is None else seg_doc.to(dev, torch.int64)
        q_len, k_len = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        shift = k_len - q_len
        i0 = shift.clamp(min=0) // B
        i1 = torch.where(q_len > 0, (k_len + B - 1) // B, i0).clamp(min=i0)

        def programs(count, bound):
            off = exclusive_cumsum(count)
            seg = slot_owner(off, bound)
            segc = seg.clamp(max=max(S - 1, 0))
            local = torch.arange(bound, device=dev) - off[segc]
            return seg, segc, local, seg < S

        # Query blocks [i0, i1) of each segment: at most q_len / B + 2 of them.
        NPQ = T_q // B + 2 * S
        seg, segc, local, used = programs(i1 - i0, NPQ)
        blk = i0[segc] + local
        d = doc[segc]
        n_sl = torch.where(used, pattern.slash_le(d, blk), 0)
        v_hi = torch.where(used, pattern.vert_active(d, blk), 0)
        prog_seg, prog_blk = torch.where(used, segc, -1), torch.where(used, blk, 0)

        # Key blocks of each segment.
        NPK = T_k // B + S
        seg, segc, local, used = programs((k_len + B - 1) // B, NPK)
        J = local
        d = doc[segc]
        lo = pattern.slash_le(d, torch.maximum(i0[segc], J) - J - 1)
        hi = pattern.slash_le(d, i1[segc] - 1 - J)
        kv_lo = torch.where(used, lo, 0)
        kv_hi = torch.where(used, torch.maximum(hi, lo), 0)
        kprog_seg, kprog_blk = torch.where(used, segc, -1), torch.where(used, J, 0)

        # Vertical chunks: columns visited by the segment's last query block.
        cap = (pattern.vert_off[1:] - pattern.vert_off[:-1])[doc]
        n_chunks = (torch.minimum(cap, k_len) + chunk - 1) // chunk
        NVT = pattern.vert.shape[1]
        NPV = max(1, min(T_k // chunk + S, S * ((NVT + chunk - 1) // chunk)))
        seg, segc, local, used = programs(n_chunks, NPV)
        d = doc[segc]
        last = pattern.vert_active(d, (i1 - 1)[segc])
        v_max = torch.where(used & (i1 > i0)[segc], last, 0)
        vprog_seg, vprog_chunk = torch.where(used, segc, -1), torch.where(used, local, 0)
        n_split = max(1, -(-(int(max_q) // B + 2) // QSPLIT))

        i32 = lambda x: x.to(torch.int32).contiguous()
        return cls(B, chunk, i32(prog_seg), i32(prog_blk), i32(n_sl), i32(v_hi), i32(kprog_seg), i32(kprog_blk),
                   i32(kv_lo), i32(kv_hi), i32(vprog_seg), i32(vprog_chunk), i32(v_max), n_split, i32(doc))

    def tiles(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slash tiles, vertical tiles) the forward visits, summed over heads: B x B
        tiles and B x chunk gathered tiles (device scalars)."""
        return self.n_sl.sum(), ((self.v_hi + self.chunk - 1) // self.chunk).sum()


def _check_pattern(pattern, q, seg_doc, cu_q):
    if not isinstance(pattern, VerticalSlashPattern):
        raise ConfigError("pattern", type(pattern).__name__, "the sparse backend needs a VerticalSlashPattern")
    if pattern.num_heads != q.shape[1]:
        raise ConfigError("pattern.num_heads", pattern.num_heads, f"q has {q.shape[1]} heads")
    if seg_doc is None and pattern.num_docs != cu_q.numel() - 1:
        raise ConfigError("seg_doc", None, f"{cu_q.numel() - 1} segments but the pattern has {pattern.num_docs} "
                          "documents: pass seg_doc")


# --- the CPU twin: explicit mask, reference math ---

def _twin_segments(cu_q, cu_k, seg_doc, n_docs):
    bq, bk = cu_q.tolist(), cu_k.tolist()
    docs = list(range(len(bq) - 1)) if seg_doc is None else [int(x) for x in seg_doc.tolist()]
    for i in range(len(bq) - 1):
        yield bq[i], bq[i + 1] - bq[i], bk[i], bk[i + 1] - bk[i], docs[i]


def _twin_probabilities(q_seg, k_seg, mask, scale, group, row_lse=None):
    """(H, q_len, k_len) probabilities under the mask, and the row lse."""
    kh = k_seg.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = scale * torch.matmul(q_seg.transpose(0, 1), kh.transpose(1, 2))
    scores = scores.masked_fill(~mask, float("-inf"))
    if row_lse is None:
        row_lse = torch.logsumexp(scores, dim=-1)
    shift = row_lse.masked_fill(torch.isinf(row_lse), 0.0)
    return torch.exp(scores - shift[..., None]), row_lse


def twin_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, *, pattern, seg_doc=None):
    check_inputs(q, k, v, cu_q, cu_k)
    _check_pattern(pattern, q, seg_doc, cu_q)
    scale = default_scale(q.shape[2]) if scale is None else scale
    acc = _acc_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device)
    for q0, q_len, k0, k_len, d in _twin_segments(cu_q, cu_k, seg_doc, pattern.num_docs):
        if q_len == 0 or k_len == 0:
            continue
        mask = pattern.mask(d, q_len, k_len, device=q.device)
        p, row_lse = _twin_probabilities(q[q0:q0 + q_len].to(acc), k[k0:k0 + k_len].to(acc), mask, scale, group)
        vh = v[k0:k0 + k_len].to(acc).repeat_interleave(group, dim=1).transpose(0, 1)
        out[q0:q0 + q_len] = torch.matmul(p, vh).transpose(0, 1).to(q.dtype)
        lse[:, q0:q0 + q_len] = row_lse
    return out, lse


def twin_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=None, *, pattern, seg_doc=None):
    check_inputs(q, k, v, cu_q, cu_k)
    _check_pattern(pattern, q, seg_doc, cu_q)
    scale = default_scale(q.shape[2]) if scale is None else scale
    acc = _acc_dtype(q.dtype)
    n_q, n_kv = q.shape[1], k.shape[1]
    group = n_q // n_kv
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q0, q_len, k0, k_len, d in _twin_segments(cu_q, cu_k, seg_doc, pattern.num_docs):
        if q_len == 0 or k_len == 0:
            continue
        mask = pattern.mask(d, q_len, k_len, device=q.device)
        qs, ks, vs = q[q0:q0 + q_len].to(acc), k[k0:k0 + k_len].to(acc), v[k0:k0 + k_len].to(acc)
        p, _ = _twin_probabilities(qs, ks, mask, scale, group, lse[:, q0:q0 + q_len].to(acc))
        go = dout[q0:q0 + q_len].to(acc).transpose(0, 1)  # (H, q, D)
        vh = vs.repeat_interleave(group, dim=1).transpose(0, 1)
        kh = ks.repeat_interleave(group, dim=1).transpose(0, 1)
        dp = torch.matmul(go, vh.transpose(1, 2))
        delta = (go * out[q0:q0 + q_len].to(acc).transpose(0, 1)).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq[q0:q0 + q_len] = (torch.matmul(ds, kh) * scale).transpose(0, 1).to(q.dtype)
        dkh = torch.matmul(ds.transpose(1, 2), qs.transpose(0, 1)) * scale  # (H, k, D)
        dvh = torch.matmul(p.transpose(1, 2), go)
        dk[k0:k0 + k_len] = dkh.view(n_kv, group, k_len, -1).sum(1).transpose(0, 1).to(k.dtype)
        dv[k0:k0 + k_len] = dvh.view(n_kv, group, k_len, -1).sum(1).transpose(0, 1).to(v.dtype)
    return dq, dk, dv


# --- Triton ---

# A _LaunchRecorder while compile_offline runs the launchers: per thread (and context), so that launches
# elsewhere, such as autograd's backward thread, stay real.
_kernel_module_override: contextvars.ContextVar = contextvars.ContextVar("attnpool_sparse_kernels", default=None)


def _triton_module():
    recorder = _kernel_module_override.get()
    if recorder is not None:
        return recorder
    try:
        from attnpool.kernels import sparse_triton
    except ImportError as error:  # triton missing
        raise ConfigError("backend", "sparse", f"needs triton ({error})") from error
    return sparse_triton


# A stand-in for the Gluon module, for tests on the host: the launcher's Gluon path runs (its Triton kernels
# interpreted) with the slash pass computed by the stand-in. compile_offline's recorder stands in for both
# modules through _kernel_module_override.
_gluon_stand_in: contextvars.ContextVar = contextvars.ContextVar("attnpool_sparse_gluon", default=None)


def _gluon_module():
    stand_in = _gluon_stand_in.get()
    if stand_in is not None:
        return stand_in
    recorder = _kernel_module_override.get()
    from attnpool.kernels import sparse_gluon

    if recorder is not None:
        return _LaunchRecorder(sparse_gluon, recorder.launches)
    return sparse_gluon


def gluon_problem(q, block) -> str | None:
    """Why the backward's slash tiles cannot run in the Gluon pass for ``q`` (or, under compile_offline, on
    the GPU it compiles for), or None."""
    if _slash_backward_problem() is not None:
        raise ConfigError("ATTNPOOL_SLASH_BACKWARD", SLASH_BACKWARD, f"choose one of {', '.join(SLASH_BACKWARDS)}")
    if SLASH_BACKWARD != "gluon":
        return f"SLASH_BACKWARD is {SLASH_BACKWARD!r}"
    if _gluon_stand_in.get() is not None:
        return None
    if q.dtype != torch.bfloat16 or q.shape[2] != 128 or block != 128:
        return (f"the Gluon pass is built for bf16, head_dim 128 and blocks of 128 (got {q.dtype}, "
                f"{q.shape[2]}, {block})")
    recorder = _kernel_module_override.get()
    if recorder is not None:
        capability = recorder.capability
    elif q.device.type != "cuda" or _interpreting():
        return "the Gluon pass needs a CUDA GPU (Gluon has no interpreter)"
    else:
        capability = torch.cuda.get_device_capability(q.device)
    if capability[0] != 9:
        return f"the Gluon pass uses Hopper's wgmma and TMA (sm_90), not sm_{capability[0]}{capability[1]}"
    try:
        from triton._C.libtriton import gluon_ir
    except ImportError as error:
        return f"this Triton has no Gluon ({error})"
    if not hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce"):
        return "this Triton's Gluon has no TMA reduce"
    return None


def _tma_scratch(size: int, alignment: int, stream):
    """Global scratch for the TMA descriptors that the forward, the dQ pass and the Gluon pass build on the
    device (128 bytes per program and descriptor), on the current device, where Triton launches."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _set_tma_scratch():
    # Triton keeps its allocator per thread (a ContextVar), and autograd runs backward in a thread
    # of its own: set it before every launch.
    import triton

    triton.set_allocator(_tma_scratch)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pattern_args(pattern: VerticalSlashPattern, dev):
    cache = pattern.__dict__.setdefault("_kernel_tables", {})
    if dev not in cache:
        i32 = lambda x: x.to(device=dev, dtype=torch.int32).contiguous()
        sl_list = torch.where(pattern.slash_list == torch.iinfo(torch.int64).max, 0, pattern.slash_list)
        cache[dev] = dict(sl_list=i32(sl_list), bits=pattern.slash.to(device=dev, dtype=torch.int8).contiguous(),
                          blk_off=i32(pattern.blk_off), vert=i32(pattern.vert), vert_off=i32(pattern.vert_off),
                          run=i32(pattern.run))
    return cache[dev]


def _tma_rows(cu_q, cu_k, *rows):
    """Copies of (H, T_q) float32 ``rows`` (LSE and delta) for the Gluon pass, which reads each item's 64 rows
    by TMA: (H, T_rows) with segment s's rows from ``base[s]``, where base[s] minus the segment's shift
    (k_len - q_len) is a multiple of 4. A query block's first row then starts 16-byte aligned, the only
    innermost coordinate TMA takes. Returns (copies, base as int32, T_rows); the padding is zeros.

    base[s] = q0[s] + 4 s + ((shift[s] - q0[s]) mod 4) leaves a gap of 1 to 7 rows between segments, on the
    device, without a host read; rows past the last segment keep their offset from it."""
    n = cu_q.numel() - 1
    H, T = rows[0].shape
    q0 = cu_q[:-1].long()
    shift = (cu_k[1:] - cu_k[:-1]).long() - (cu_q[1:] - q0)
    base = q0 + 4 * torch.arange(n, device=q0.device) + torch.remainder(shift - q0, 4)
    t_rows = -(-(T + 4 * n + 4) // 4) * 4
    if n == 0:  # no segment: nothing reads the rows
        return [x.new_zeros(H, t_rows) for x in rows], base.int(), t_rows
    t = torch.arange(T, device=q0.device)
    seg = torch.searchsorted(cu_q[1:].long(), t, right=True).clamp(max=n - 1)
    index = base[seg] + t - q0[seg]
    copies = [x.new_zeros(H, t_rows).index_copy_(1, index, x) for x in rows]
    return copies, base.int(), t_rows


def _tma_ready(x, heads_contiguous=False):
    """x (K or V), or a fresh contiguous copy where TMA cannot read it. TMA needs a unit stride in
    head_dim, and the start and the token and head strides 16-byte aligned (so that every
    segment's and head's first row is). ``heads_contiguous``: also heads side by side in a row (head
    stride head_dim), as the Gluon pass reads a (rows, heads * head_dim) view."""
    size = x.element_size()
    ok = x.stride(2) == 1 and x.data_ptr() % 16 == 0 and x.stride(0) * size % 16 == 0 and x.stride(1) * size % 16 == 0
    ok = ok and (not heads_contiguous or x.stride(1) == x.shape[2])
    # clone, not contiguous(): a contiguous tensor can still start misaligned.
    return x if ok else x.clone(memory_format=torch.contiguous_format)


# The largest head row (bytes), pattern block and vertical chunk whose launches fit Hopper's 227 KB of shared
# memory at CONFIG (compile_offline): head_dim 128 in bf16 (the forward needs 224 KB) or 64 in float32 (the
# forward, 224.5 KB), at block 128 and chunk 64 or 128 (the dQ pass needs 193 KB at 128). Twice the head row
# or the block makes the forward need about 448 KB, and a chunk of 256 the forward 289 KB and the dQ pass
# 321 KB (bench/kernel_resources.py --head-dim 256 --beyond-limits).
MAX_HEAD_BYTES = 256
MAX_BLOCK = 128
MAX_VERTICAL_CHUNK = 128


def launch_problem(head_dim: int, element_size: int = 2, block: int = 128,
                   vertical_chunk: int = VERTICAL_CHUNK) -> ConfigError | None:
    """Why the sparse Triton kernels cannot run at ``head_dim`` for elements of ``element_size`` bytes, a
    pattern of ``block``-token blocks and ``vertical_chunk`` columns per step (an error naming the field), or
    None."""
    largest = MAX_HEAD_BYTES // element_size
    if head_dim < 16 or head_dim > largest or head_dim & (head_dim - 1):
        return ConfigError("head_dim", head_dim, f"the sparse Triton kernels need a power of two from 16 to "
                                                 f"{largest} for {8 * element_size}-bit inputs")
    if block > MAX_BLOCK:
        return ConfigError("sparse_block", block, f"the sparse Triton kernels need at most {MAX_BLOCK}")
    if vertical_chunk > MAX_VERTICAL_CHUNK:
        return ConfigError("sparse_vertical_chunk", vertical_chunk,
                           f"the sparse Triton kernels need at most {MAX_VERTICAL_CHUNK}")
    return None


def _launch_ok(q, block, chunk):
    problem = launch_problem(q.shape[2], q.element_size(), block, chunk)
    if problem is not None:
        raise problem


def triton_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, *, pattern, seg_doc=None, index=None):
    check_inputs(q, k, v, cu_q, cu_k)
    _check_pattern(pattern, q, seg_doc, cu_q)
    _launch_ok(q, pattern.block, VERTICAL_CHUNK if index is None else index.chunk)
    st = _triton_module()
    _set_tma_scratch()
    scale = default_scale(q.shape[2]) if scale is None else scale
    q, k, v = last_dim_contiguous(q), _tma_ready(k), _tma_ready(v)
    dev = q.device
    pattern = _on_device(pattern, dev)
    idx = index or SparseIndex.build(pattern, cu_q, cu_k, q.shape[0], k.shape[0], max_q, seg_doc)
    tab = _pattern_args(pattern, dev)
    H, D = q.shape[1], q.shape[2]
    out = torch.zeros_like(q)
    lse = torch.full((H, q.shape[0]), float("-inf"), dtype=torch.float32, device=dev)
    npq = idx.prog_seg.numel()
    if npq and q.shape[0] and k.shape[0]:
        st._fwd[(npq, H)](
            q, k, v, out, lse, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), q.shape[0],
            cu_q.to(dev, torch.int32), cu_k.to(dev, torch.int32), idx.seg_doc, idx.prog_seg, idx.prog_blk, npq,
            tab["sl_list"], tab["bits"], tab["bits"].shape[1], tab["blk_off"], tab["vert"], tab["vert"].shape[1],
            tab["vert_off"], idx.n_sl, idx.v_hi, scale * 1.4426950408889634,
            GROUP=H // k.shape[1], HEAD_DIM=D, BLOCK=idx.block, BV=idx.chunk, IEEE=q.dtype == torch.float32,
            **_launch_options(dev, idx.block, "fwd"))
    return out, lse


def _launch_options(dev, block, kernel):
    """Triton launch options and sub-tile sizes of one kernel (no warps, stages or register limit on the
    host: the interpreter, and compile_offline's recording, which passes CONFIG's itself)."""
    cfg = dict(CONFIG[kernel])
    for name in ("SUB_N", "SUB_M"):
        if name in cfg:
            cfg[name] = min(cfg[name], block)
    if torch.device(dev).type != "cuda":
        for option in ("num_warps", "num_stages", "maxnreg"):
            cfg.pop(option, None)
    return cfg


# Hopper's shared memory per block (227 KB): what a launch may use on the GPUs of MIN_CAPABILITY.
HOPPER_SHARED_MEMORY = 232448
# Triton's names of the argument types the launchers pass (torch dtype of a tensor -> its pointer type).
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                 torch.int64: "i64", torch.int8: "i8"}


class _LaunchRecorder:
    """Stands in for the kernel module while the launchers run on the host: ``kernel[grid](*args, **kw)``
    is recorded as (kernel, args, kw), and nothing runs."""

    def __init__(self, module, launches=None, capability=None):
        self.module, self.launches, self.capability = module, [] if launches is None else launches, capability

    def __getattr__(self, name):
        kernel = getattr(self.module, name)
        if not hasattr(kernel, "arg_names"):  # not a Triton or Gluon kernel
            return kernel
        return _RecordedKernel(self.launches, kernel)


class _RecordedKernel:
    def __init__(self, launches, kernel):
        self.launches, self.kernel = launches, kernel

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((self.kernel, args, kw))


def _recorded_launches(head_dim: int, group: int, block: int, chunk: int, dtype: torch.dtype,
                       capability: tuple[int, int]) -> dict:
    """{launch name: (kernel, args, constexprs)}: every launch that triton_forward and triton_backward make on
    a GPU of ``capability``, with arguments of their real types, on a small host problem of 8 KV heads
    (Llama-3-8B's). Launch names are the CONFIG entries (and "delta")."""
    g = torch.Generator().manual_seed(0)
    lengths, kv_heads = [3 * block, block + 5], 8
    heads = kv_heads * group
    pattern = VerticalSlashPattern.random(lengths, heads, block, n_slash=2, n_vertical=4, generator=g)
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    T = sum(lengths)
    q, do = (torch.randn(T, heads, head_dim, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(T, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    index = SparseIndex.build(pattern, cu, cu, T, T, max(lengths), chunk=chunk)
    recorder = _LaunchRecorder(_triton_module(), capability=capability)
    token = _kernel_module_override.set(recorder)
    try:
        out, lse = triton_forward(q, k, v, cu, cu, max(lengths), max(lengths), pattern=pattern, index=index)
        triton_backward(do, q, k, v, out, lse, cu, cu, max(lengths), max(lengths), pattern=pattern, index=index)
    finally:
        _kernel_module_override.reset(token)
    names = {"_fwd": "fwd", "_bwd_delta": "delta", "_bwd_dq": "dq", "_bwd_dkdv_slash": "dkdv",
             "_bwd_dkdv_vert": "vert", "_bwd_slash": "slash_bwd"}
    launches = {}
    for kernel, args, kw in recorder.launches:
        name = names[kernel.__name__]
        launches["dq_vertical" if name == "dq" and not kw["SLASH"] else name] = (kernel, args, kw)
    return launches


def compile_offline(capability: tuple[int, int] = MIN_CAPABILITY, *, head_dim: int = 128, group: int = 4,
                    block: int = 128, chunk: int = VERTICAL_CHUNK, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Compile every sparse kernel launch at its ``CONFIG`` for a CUDA GPU of ``capability``, on any machine:
    Triton's compiler and the ptxas it ships need no GPU. {launch name: triton CompiledKernel}; its
    ``metadata.shared`` is the shared memory a launch needs, which Triton checks only when it launches.

    The launches are those the launchers make: they run on a small host problem with the kernels recorded,
    not run, and each argument is typed as passed (so a launch the launchers refuse, e.g. a head_dim over
    ``launch_problem``'s limit, raises its ConfigError here too). Each compile is what Triton would compile
    for that launch on a GPU: its pointers are 16-byte aligned and its strides multiples of 16 elements, as
    the runtime's buffers are. A launch with a misaligned pointer or stride compiles other code (narrower
    loads)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = {}
    for launch, (kernel, args, kw) in _recorded_launches(head_dim, group, block, chunk, dtype, capability).items():
        gluon = kernel.is_gluon()
        # On the host the launchers leave out warps and stages; on a GPU they pass CONFIG's (Triton's defaults
        # for a launch without an entry).
        options = dict(num_warps=4, maxnreg=None) if gluon else dict(num_warps=4, num_stages=3)
        options.update({name: value for name, value in CONFIG.get(launch, {}).items() if name in options})
        per_call_sizes = (_gluon_module() if gluon else _triton_module()).PER_CALL_SIZES
        values = dict(zip(kernel.arg_names, args))
        signature = {}
        for name in kernel.arg_names:
            value = values.get(name)
            if name in kw:
                signature[name] = "constexpr"
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + _TRITON_TYPES[value.dtype]
            elif isinstance(value, float):
                signature[name] = "fp32"
            elif isinstance(value, int) and -2**31 <= value < 2**31:
                signature[name] = "i32"
            else:
                raise TypeError(f"{kernel.__name__}: argument {name} = {value!r} has no Triton type here")
        # A launch tells Triton which pointers are 16-byte aligned and which integers are multiples of 16 (but
        # for the per-call sizes it does not specialise on); that decides vector widths and how many loads go
        # through shared memory (twice as many bytes in the dK/dV passes).
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                   if (signature[name].startswith("*") and values[name].data_ptr() % 16 == 0)
                   or (signature[name] == "i32" and name not in per_call_sizes and values[name] % 16 == 0)}
        if gluon:
            from triton.experimental.gluon._runtime import GluonASTSource as source_type
        else:
            source_type = ASTSource
        source = source_type(kernel, signature, constexprs=kw, attrs=aligned)
        target = GPUTarget("cuda", 10 * capability[0] + capability[1], 32)
        compiled[launch] = triton.compile(source, target=target, options=options)
    return compiled


def _on_device(pattern: VerticalSlashPattern, dev) -> VerticalSlashPattern:
    """The pattern on the kernel's device (copied once and cached on the pattern)."""
    dev = torch.device(dev)
    if pattern.device == dev or (dev.type == "cuda" and pattern.device.type == "cuda" and dev.index is None):
        return pattern
    cache = pattern.__dict__.setdefault("_copies", {})
    if dev not in cache:
        cache[dev] = pattern.to(dev)
    return cache[dev]


def triton_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=None, *, pattern, seg_doc=None,
                    index=None, timings: dict | None = None):
    check_inputs(q, k, v, cu_q, cu_k)
    _check_pattern(pattern, q, seg_doc, cu_q)
    _launch_ok(q, pattern.block, VERTICAL_CHUNK if index is None else index.chunk)
    st = _triton_module()
    _set_tma_scratch()
    scale = default_scale(q.shape[2]) if scale is None else scale
    gluon = gluon_problem(q, pattern.block) is None
    q, out, dout = (last_dim_contiguous(x) for x in (q, out, dout.to(q.dtype)))
    if gluon:  # its TMA reads Q and dO as well, as (rows, heads * head_dim)
        q, dout = (_tma_ready(x, heads_contiguous=True) for x in (q, dout))
    k, v = (_tma_ready(x, heads_contiguous=gluon) for x in (k, v))
    dev = q.device
    pattern = _on_device(pattern, dev)
    idx = index or SparseIndex.build(pattern, cu_q, cu_k, q.shape[0], k.shape[0], max_q, seg_doc)
    tab = _pattern_args(pattern, dev)
    H, H_kv, D = q.shape[1], k.shape[1], q.shape[2]
    G = H // H_kv
    lse = lse.float().contiguous()
    # D_i = rowsum(dout * out), (H, T_q) float32.
    delta = torch.empty(H, q.shape[0], dtype=torch.float32, device=dev)
    if q.shape[0]:
        st._bwd_delta[(-(-q.shape[0] // DELTA_ROWS), H)](
            out, dout, delta, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), q.shape[0],
            HEAD_DIM=D, ROWS=DELTA_ROWS)
    dq = torch.zeros_like(q)  # rows no query block visits (no key, or past cu_q[-1]) keep zero gradients
    # The Gluon pass adds the slash tiles' dQ here (fp32, unscaled); the dQ pass then adds the columns' part.
    dq32 = torch.zeros(q.shape, dtype=torch.float32, device=dev) if gluon else dq
    dk32 = torch.zeros(k.shape, dtype=torch.float32, device=dev)
    dv32 = torch.zeros(v.shape, dtype=torch.float32, device=dev)
    cuq, cuk = cu_q.to(dev, torch.int32), cu_k.to(dev, torch.int32)
    common = dict(GROUP=G, HEAD_DIM=D, BLOCK=idx.block, IEEE=q.dtype == torch.float32)
    opts = lambda name: _launch_options(dev, idx.block, name)
    scale_log2 = scale * 1.4426950408889634
    events = []

    def mark(name):  # CUDA events between kernels, only when the caller asks for timings
        if timings is not None and dev.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            events.append((name, e))

    if q.shape[0] and k.shape[0]:
        mark("start")
        npq, npk, npv = idx.prog_seg.numel(), idx.kprog_seg.numel(), idx.vprog_seg.numel()

        def dq_pass(slash):
            st._bwd_dq[(npq, H)](
                q, k, v, dout, lse, delta, dq, dq32, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                v.stride(1), dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), dq32.stride(0),
                dq32.stride(1), q.shape[0], cuq, cuk, idx.seg_doc, idx.prog_seg, idx.prog_blk, npq,
                tab["sl_list"], tab["bits"], tab["bits"].shape[1], tab["blk_off"], tab["vert"],
                tab["vert"].shape[1], tab["vert_off"], idx.n_sl, idx.v_hi, scale, scale_log2, BV=idx.chunk,
                SLASH=slash, ACCUMULATED=not slash, **common, **opts("dq" if slash else "dq_vertical"))

        if gluon:
            (lse_rows, delta_rows), row_base, t_rows = _tma_rows(cuq, cuk, lse, delta)
            _gluon_module()._bwd_slash[(npk, H_kv)](
                q, k, v, dout, lse_rows, delta_rows, dk32, dv32, dq32, q.stride(0), k.stride(0), v.stride(0),
                dout.stride(0), dk32.stride(0), dq32.stride(0), t_rows, H, H_kv, cuq, cuk, idx.seg_doc,
                idx.kprog_seg, idx.kprog_blk, npk, tab["sl_list"], tab["bits"].shape[1], tab["blk_off"], idx.kv_lo,
                idx.kv_hi, row_base, scale, scale_log2, GROUP=G, HEAD_DIM=D, BLOCK=idx.block, **opts("slash_bwd"))
            mark("dkdv_dq_slash")
        else:
            dq_pass(slash=True)
            mark("dq")
            st._bwd_dkdv_slash[(npk, H_kv)](
                q, k, v, dout, lse, delta, dk32, dv32, q.stride(0), q.stride(1), k.stride(0),
                k.stride(1), v.stride(0), v.stride(1), dout.stride(0), dout.stride(1), dk32.stride(0),
                dk32.stride(1), q.shape[0], cuq, cuk, idx.seg_doc, idx.kprog_seg, idx.kprog_blk, npk,
                tab["sl_list"], tab["bits"].shape[1], tab["blk_off"], idx.kv_lo, idx.kv_hi, scale, scale_log2,
                **common, **opts("dkdv"))
            mark("dkdv_slash")
        st._bwd_dkdv_vert[(npv, H, idx.n_split)](
            q, k, v, dout, lse, delta, dk32, dv32, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), dout.stride(0), dout.stride(1), dk32.stride(0), dk32.stride(1),
            q.shape[0], cuq, cuk, idx.seg_doc, idx.vprog_seg, idx.vprog_chunk, npv,
            idx.v_max, tab["bits"], tab["bits"].shape[1], tab["blk_off"], tab["vert"], tab["vert"].shape[1],
            tab["vert_off"], tab["run"], H, scale, scale_log2, BV=idx.chunk, QSPLIT=QSPLIT,
            **common, **opts("vert"))
        mark("dkdv_vertical")
        if gluon:
            dq_pass(slash=False)
            mark("dq_vertical")
    if events:
        torch.cuda.synchronize(dev)
        for (_, a), (name, b) in zip(events, events[1:]):
            timings[name] = timings.get(name, 0.0) + a.elapsed_time(b) / 1e3
    return dq, dk32.to(k.dtype), dv32.to(v.dtype)


# --- dispatch ---

def _impl(q, impl):
    if impl is None:
        return "triton" if q.device.type == "cuda" else "twin"
    if impl not in ("triton", "twin"):
        raise ConfigError("impl", impl, "choose 'triton' or 'twin'")
    if impl == "triton" and q.device.type != "cuda" and not _interpreting():
        raise ConfigError("impl", impl, "Triton on CPU needs TRITON_INTERPRET=1")
    return impl


def forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, *, pattern, seg_doc=None, impl=None, index=None):
    """Vertical-slash attention; returns (out, lse) per the kernels contract."""
    if _impl(q, impl) == "twin":
        return twin_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, pattern=pattern, seg_doc=seg_doc)
    return triton_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, pattern=pattern, seg_doc=seg_doc, index=index)


def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=None, *, pattern, seg_doc=None, impl=None,
             index=None):
    """Gradients (dq, dk, dv) of vertical-slash attention, from the forward's out and lse (same pattern)."""
    if _impl(q, impl) == "twin":
        return twin_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, pattern=pattern,
                             seg_doc=seg_doc)
    return triton_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, pattern=pattern,
                           seg_doc=seg_doc, index=index)


def backend(pattern: VerticalSlashPattern, seg_doc: torch.Tensor | None = None, impl: str | None = None,
            chunk: int = VERTICAL_CHUNK) -> Backend:
    """A Backend bound to one pattern (one layer, one step): forward and backward reuse it.

    The kernel index is built once per (cu_q, cu_k) and shared by forward and backward. ``chunk``: vertical
    columns gathered per kernel step (``SparseConfig.vertical_chunk``, which the cost model counts in).
    """
    cache: dict = {}

    def _index(q, k, cu_q, cu_k, max_q):
        if _impl(q, impl) == "twin":
            return None
        key = (id(cu_q), id(cu_k), q.shape[0], k.shape[0])
        if key not in cache:
            cache.clear()
            cache[key] = SparseIndex.build(pattern, cu_q, cu_k, q.shape[0], k.shape[0], max_q, seg_doc, chunk)
        return cache[key]

    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale=None):
        return forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, pattern=pattern, seg_doc=seg_doc, impl=impl,
                       index=_index(q, k, cu_q, cu_k, max_q))

    def bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=None):
        return backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, pattern=pattern, seg_doc=seg_doc,
                        impl=impl, index=_index(q, k, cu_q, cu_k, max_q))

    return Backend("sparse", fwd, bwd)
