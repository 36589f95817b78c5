"""Vertical-slash patterns: which keys each query of a document attends to.

A pattern is per document and per query head, in the document's key coordinates
(position 0 is the document's first token; a CA-task [a, b) sees keys [0, b), so
its key coordinates are the document's). With block size B (128 on GPUs):

- slash part: a set Delta of *block diagonals*. Query block I = p // B attends key
  block J = c // B whole (causal inside) iff I - J is in Delta. A token slash at
  offset d (key = query - d) lies in block diagonals floor(d/B) and ceil(d/B), so
  a chosen offset d puts both into Delta (one when B divides d): the slash part is
  a superset of the chosen token slashes, at most 2 key blocks per query block
  per offset, and 0 is always in Delta (the diagonal block).
- vertical part: a sorted set V of key columns. Query p attends column c in V iff
  c <= p and the tile (p // B, c // B) is *not* a slash tile.

The attended set of query p (p >= 0) is therefore

    A(p) = { c : 0 <= c <= p,  (p//B - c//B) in Delta  or  c in V }

with every key counted once: verticals that fall inside a slash tile are left to
the slash tile. Rows with p < 0 (more queries than keys) attend nothing.

Storage is flat over documents (no padding to the longest document), so a packed
batch with one 512K document and a thousand short ones costs no more than its tokens:

- ``slash``  (H, NB_total) bool, document d's diagonals at ``blk_off[d] + Delta``;
- ``vert``   (H, NV_total) int64, document d's columns sorted ascending in slots
  ``vert_off[d] .. vert_off[d] + n_vert[d, h]``, unused slots hold ``doc_len[d]``.

Everything here is torch on the pattern's device; building and querying a
pattern never reads a device value on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from attnpool.plan.documents import ranges
from attnpool.sparse.config import SparseConfig


# Documents' length classes, half an octave each (class c: lengths [2^(c/2), 2^((c+1)/2))): what a pattern's size
# is tracked by (runtime.sparse.SparseStats, sparse.cost.SparsePrior), because it varies with the length (a cap on
# the slash offsets covers most block diagonals of a short document and few of a long one).
LENGTH_CLASSES = 64


def length_class(doc_len):
    """Each length's class (numpy array or torch tensor)."""
    if isinstance(doc_len, torch.Tensor):
        return torch.floor(2 * torch.log2(doc_len.double().clamp(min=1))).long().clamp(0, LENGTH_CLASSES - 1)
    return np.clip(np.floor(2 * np.log2(np.maximum(doc_len, 1))), 0, LENGTH_CLASSES - 1).astype(np.int64)


def exclusive_cumsum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Exclusive prefix sum with one more entry: out[..., i] = sum(x[..., :i])."""
    c = torch.cumsum(x, dim=dim)
    pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [1, 0]
    return torch.nn.functional.pad(c, pad)


def slot_owner(offsets: torch.Tensor, n_slots: int) -> torch.Tensor:
    """Which segment each of ``n_slots`` flat slots belongs to (len(offsets)-1 for unused ones)."""
    slots = torch.arange(n_slots, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets[1:].contiguous(), slots, right=True)


def block_diagonals_of_offsets(offsets: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block diagonals a token slash at offset d lies in: floor(d/B) and ceil(d/B)."""
    return offsets // block, (offsets + block - 1) // block


@dataclass(frozen=True, eq=False)
class VerticalSlashPattern:
    """Per-document, per-head vertical-slash pattern (see the module docstring)."""

    block: int
    doc_len: torch.Tensor  # (D,) int64
    blk_off: torch.Tensor  # (D+1,) int64: cumsum(ceil(doc_len / block))
    slash: torch.Tensor  # (H, NB_total) bool
    vert_off: torch.Tensor  # (D+1,) int64: slot capacity offsets
    vert: torch.Tensor  # (H, NV_total) int64
    n_vert: torch.Tensor  # (D, H) int64
    dense: torch.Tensor  # (D,) bool

    def __post_init__(self):
        H, nbt = self.slash.shape
        D = self.num_docs
        dev = self.slash.device
        blk_doc = slot_owner(self.blk_off, nbt)  # (NB_total,) in [0, D]
        base = torch.cat([self.blk_off[:-1], self.blk_off[-1:]])[blk_doc]
        local = torch.arange(nbt, device=dev) - base  # Delta of each slot
        set_bits = self.slash.to(torch.int64)
        excl = exclusive_cumsum(set_bits, 1)  # (H, NB_total + 1)
        n_slash = (excl[:, self.blk_off[1:]] - excl[:, self.blk_off[:-1]]).T  # (D, H)
        # Sorted list of each (doc, head)'s diagonals, compacted in its block slots.
        rank = excl[:, :-1] - excl[:, base]
        target = torch.where(self.slash, base[None, :] + rank, nbt)
        lst = torch.full((H, nbt + 1), torch.iinfo(torch.int64).max, dtype=torch.int64, device=dev)
        lst.scatter_(1, target, local[None, :].expand(H, -1).contiguous())
        lst = lst[:, :nbt]
        # Leading run of consecutive diagonals 0, 1, ..., run-1 (list[t] == t).
        in_run = (lst == local[None, :]).to(torch.int64)
        run = torch.zeros(D + 1, H, dtype=torch.int64, device=dev).index_add_(0, blk_doc, in_run.T)[:D]
        # Verticals per key block, for prefix counts.
        nvt = self.vert.shape[1]
        vert_doc = slot_owner(self.vert_off, nvt)
        vdoc = vert_doc.clamp(max=max(D - 1, 0))
        vlocal = torch.arange(nvt, device=dev) - self.vert_off[vdoc]
        if D:
            valid = (vert_doc < D)[None, :] & (vlocal[None, :] < self.n_vert[vdoc].T)
            slot = torch.where(valid, self.blk_off[vdoc][None, :] + self.vert // self.block, nbt)
        else:
            valid = torch.zeros(H, nvt, dtype=torch.bool, device=dev)
            slot = torch.full((H, nvt), nbt, dtype=torch.int64, device=dev)
        vhist = torch.zeros(H, nbt + 1, dtype=torch.int64, device=dev).scatter_add_(1, slot, valid.to(torch.int64))
        vexcl = exclusive_cumsum(vhist[:, :nbt], 1)
        for name, value in (("blk_doc", blk_doc), ("slash_excl", excl), ("n_slash", n_slash), ("slash_list", lst),
                            ("run", run), ("vert_excl", vexcl), ("vert_doc", vert_doc)):
            object.__setattr__(self, name, value)

    # --- shape ---

    @property
    def num_docs(self) -> int:
        return self.doc_len.numel()

    @property
    def num_heads(self) -> int:
        return self.slash.shape[0]

    @property
    def device(self) -> torch.device:
        return self.slash.device

    def num_blocks(self) -> torch.Tensor:
        """(D,) ceil(doc_len / block)."""
        return self.blk_off[1:] - self.blk_off[:-1]

    def to(self, device) -> "VerticalSlashPattern":
        return VerticalSlashPattern(self.block, *(getattr(self, n).to(device) for n in
                                                   ("doc_len", "blk_off", "slash", "vert_off", "vert", "n_vert", "dense")))

    # --- prefix counts the kernels and the cost model read (vectorised, (H, N) results) ---

    def slash_le(self, doc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Number of diagonals Delta <= x of each (doc, head); x (N,) or (H, N), may be negative."""
        nb = self.num_blocks()[doc]
        start = self.blk_off[doc]
        x = torch.broadcast_to(x, (self.num_heads, doc.numel()))
        idx = start[None, :] + torch.minimum(torch.clamp(x + 1, min=0), nb[None, :])
        return self.slash_excl.gather(1, idx) - self.slash_excl[:, start]

    def block_tiles(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(NB_total,) each: per query block of every document, summed over heads, the slash tiles the kernels
        compute (its diagonals Delta <= I) and the vertical bars of ``chunk`` columns they visit (vert_active);
        0 on unused blocks."""
        nbt = self.slash.shape[1]
        used = self.blk_doc < self.num_docs
        d = self.blk_doc.clamp(max=max(self.num_docs - 1, 0))
        local = torch.arange(nbt, device=self.device) - self.blk_off[d]
        slash = torch.where(used, self.slash_le(d, local).sum(0), 0)
        bars = torch.where(used, ((self.vert_active(d, local) + chunk - 1) // chunk).sum(0), 0)
        return slash, bars

    def vert_before_block(self, doc: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Number of vertical columns c with c // block < j; j (N,) or (H, N)."""
        nb = self.num_blocks()[doc]
        start = self.blk_off[doc]
        j = torch.broadcast_to(j, (self.num_heads, doc.numel()))
        idx = start[None, :] + torch.minimum(torch.clamp(j, min=0), nb[None, :])
        return self.vert_excl.gather(1, idx) - self.vert_excl[:, start]

    def vert_active(self, doc: torch.Tensor, qblock: torch.Tensor) -> torch.Tensor:
        """Verticals the kernel visits for query block I: those with c // B <= I - run (H, N).

        Key blocks I - run + 1 .. I are all slash tiles (diagonals 0..run-1), so a
        vertical there is never attended as a vertical; later exclusions are masked
        in the kernel.
        """
        run = self.run[doc].T  # (H, N)
        return self.vert_before_block(doc, qblock[None, :] - run + 1)

    def keys_read(self, doc: torch.Tensor, q_first: torch.Tensor, q_last: torch.Tensor, key: torch.Tensor,
                  num_tokens: int) -> torch.Tensor:
        """(N,) bool: whether some head attends key position ``key`` of document ``doc`` from some
        query position in [q_first, q_last] (all (N,); ``key <= q_last``).

        The union over heads of the attended sets: key block J = key // B is read whole (up to the
        queries' end) iff some head's diagonal Delta in [max(q_first//B - J, 0), q_last//B - J] is
        set; a vertical column iff some head chose it (any query at or after it attends it).
        ``num_tokens``: sum of the documents' lengths (host-known; sizes a lookup table).
        """
        B, D, dev = self.block, self.num_docs, self.device
        nb = self.num_blocks()[doc]
        blk = key // B
        lo = torch.minimum(torch.clamp(q_first // B - blk, min=0), nb)
        hi = torch.minimum(q_last // B - blk, nb - 1)
        diag = exclusive_cumsum(self.slash.any(0).to(torch.int64))  # union of the heads' diagonals
        base = self.blk_off[doc]
        slash_hit = (hi >= lo) & (diag[base + hi + 1] - diag[base + lo] > 0)
        # Union of the heads' columns as a per-token table over the documents, end to end.
        tok_off = exclusive_cumsum(self.doc_len)
        nvt = self.vert.shape[1]
        vdoc = self.vert_doc.clamp(max=max(D - 1, 0))
        slot = torch.arange(nvt, device=dev) - self.vert_off[vdoc]
        valid = (self.vert_doc < D)[None, :] & (slot[None, :] < self.n_vert[vdoc].T) if D else \
            torch.zeros(self.num_heads, nvt, dtype=torch.bool, device=dev)
        table = torch.zeros(num_tokens + 1, dtype=torch.bool, device=dev)
        table[torch.where(valid, tok_off[vdoc][None, :] + self.vert, num_tokens)] = True
        table[num_tokens] = False
        return slash_hit | table[tok_off[doc] + key]

    # --- host-side constructors (tests, benchmarks) ---

    @classmethod
    def from_lists(cls, doc_lens: Sequence[int], slash: Sequence[Sequence[Sequence[int]]],
                   vertical: Sequence[Sequence[Sequence[int]]], block: int, dense: Sequence[bool] | None = None,
                   device="cpu") -> "VerticalSlashPattern":
        """From Python lists: ``slash[d][h]`` block diagonals, ``vertical[d][h]`` columns.

        Diagonal 0 is added where missing; diagonals outside [0, ceil(L/B)) and
        columns outside [0, L) are dropped; duplicates are merged.
        """
        D = len(doc_lens)
        H = len(slash[0]) if D else 1
        nb = [math.ceil(L / block) for L in doc_lens]
        dense = list(dense) if dense is not None else [False] * D
        blk_off = [0]
        for n in nb:
            blk_off.append(blk_off[-1] + n)
        sl = torch.zeros(H, blk_off[-1], dtype=torch.bool)
        cols = [[sorted({int(c) for c in vertical[d][h] if 0 <= c < doc_lens[d]}) if not dense[d] else []
                 for h in range(H)] for d in range(D)]
        cap = [max([len(c) for c in cols[d]] + [0]) for d in range(D)]
        vert_off = [0]
        for c in cap:
            vert_off.append(vert_off[-1] + c)
        vt = torch.zeros(H, vert_off[-1], dtype=torch.int64)
        nv = torch.zeros(D, H, dtype=torch.int64)
        for d in range(D):
            vt[:, vert_off[d]:vert_off[d + 1]] = doc_lens[d]
            for h in range(H):
                deltas = range(nb[d]) if dense[d] else {0} | {int(x) for x in slash[d][h] if 0 <= x < nb[d]}
                for x in deltas:
                    sl[h, blk_off[d] + x] = True
                c = cols[d][h]
                vt[h, vert_off[d]:vert_off[d] + len(c)] = torch.tensor(c, dtype=torch.int64)
                nv[d, h] = len(c)
        as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)
        return cls(block, as_t(list(doc_lens)), as_t(blk_off), sl.to(device), as_t(vert_off), vt.to(device),
                   nv.to(device), torch.tensor(dense, dtype=torch.bool, device=device))

    @classmethod
    def full(cls, doc_lens: Sequence[int], num_heads: int, block: int, device="cpu") -> "VerticalSlashPattern":
        """Every document dense (all diagonals, no verticals): plain causal attention."""
        D = len(doc_lens)
        return cls.from_lists(doc_lens, [[[]] * num_heads] * D, [[[]] * num_heads] * D, block,
                              dense=[True] * D, device=device)

    @classmethod
    def random(cls, doc_lens: Sequence[int], num_heads: int, block: int, n_slash: int, n_vertical: int,
               generator: torch.Generator | None = None, device="cpu") -> "VerticalSlashPattern":
        """Random diagonals (n_slash per head besides 0 and 1) and columns (n_vertical, sinks 0..3 among them)."""
        g = generator or torch.Generator().manual_seed(0)
        sl, vt = [], []
        for L in doc_lens:
            nb = math.ceil(L / block)
            sl.append([[0, 1] + torch.randint(0, nb, (n_slash,), generator=g).tolist() for _ in range(num_heads)])
            vt.append([list(range(min(4, L))) + torch.randint(0, L, (n_vertical,), generator=g).tolist()
                       for _ in range(num_heads)])
        return cls.from_lists(doc_lens, sl, vt, block, device=device)

    # --- the attended set, explicitly (CPU twin and tests) ---

    def doc_lists(self, doc: int) -> tuple[list[list[int]], list[list[int]]]:
        """(diagonals per head, columns per head) of one document, on the host."""
        a, b = int(self.blk_off[doc]), int(self.blk_off[doc + 1])
        sl = self.slash[:, a:b].cpu()
        deltas = [torch.nonzero(sl[h]).flatten().tolist() for h in range(self.num_heads)]
        v0 = int(self.vert_off[doc])
        nv = self.n_vert[doc].cpu().tolist()
        vt = self.vert.cpu()
        cols = [vt[h, v0:v0 + nv[h]].tolist() for h in range(self.num_heads)]
        return deltas, cols

    def mask(self, doc: int, q_len: int, k_len: int, device="cpu") -> torch.Tensor:
        """(H, q_len, k_len) bool: the attended set of a segment of document ``doc``.

        The segment's queries are the tail of its k_len keys (bottom-right):
        query row j sits at position p = k_len - q_len + j.
        """
        H, B = self.num_heads, self.block
        a, b = int(self.blk_off[doc]), int(self.blk_off[doc + 1])
        diag = self.slash[:, a:b].to(device)  # (H, nb)
        p = torch.arange(q_len, device=device) + (k_len - q_len)
        c = torch.arange(k_len, device=device)
        causal = (c[None, :] <= p[:, None]) & (p[:, None] >= 0)
        delta = (p[:, None].div(B, rounding_mode="floor") - c[None, :] // B).clamp(min=0)
        delta = delta.clamp(max=max(diag.shape[1] - 1, 0))
        slash_tile = diag[:, delta] if diag.shape[1] else torch.zeros(H, q_len, k_len, dtype=torch.bool, device=device)
        slash_tile = slash_tile & causal[None]
        v0 = int(self.vert_off[doc])
        is_vert = torch.zeros(H, k_len + 1, dtype=torch.bool, device=device)
        nv = self.n_vert[doc].to(device)
        slots = torch.arange(int(self.vert_off[doc + 1]) - v0, device=device)
        cols = self.vert[:, v0:v0 + slots.numel()].to(device).clamp(max=k_len)
        is_vert.scatter_(1, torch.where(slots[None, :] < nv[:, None], cols, k_len), True)
        vert_hit = is_vert[:, None, :k_len] & causal[None] & ~slash_tile
        return slash_tile | vert_hit


# --- online estimation ---

def _tail_queries(q: torch.Tensor, cu_q: torch.Tensor, n_last: torch.Tensor, width: int) -> torch.Tensor:
    """(S, width, H, D) float32: each segment's last n_last[s] query rows, zero-padded after them."""
    j = torch.arange(width, device=q.device)
    rows = cu_q[1:, None] - n_last[:, None] + j[None, :]
    valid = j[None, :] < n_last[:, None]
    rows = torch.where(valid, rows, 0).clamp(0, max(q.shape[0] - 1, 0))
    out = q[rows].float() if q.shape[0] else q.new_zeros(rows.shape + q.shape[1:], dtype=torch.float32)
    return out * valid[:, :, None, None]


@dataclass(frozen=True, eq=False)
class _Chunks:
    """Key positions of some segments cut into chunks of C tokens that never cross a segment.

    Chunk i holds positions ``start[i] .. start[i] + C - 1`` of segment ``seg[i]``;
    ``flat[i, t]`` is the flat key index of slot t (``T_k`` where the slot is past its
    segment's end or unused). Only segments in ``include`` get chunks. The number of
    chunks is static, so that no device value is read: ``num`` (a bound on, or the
    exact count of, the included segments' chunks; default ``T_k // C + S``).
    """

    size: int
    seg: torch.Tensor  # (NCH,) in [0, S]
    seg_c: torch.Tensor  # (NCH,) clamped to S - 1 (for gathers)
    off: torch.Tensor  # (S+1,) first chunk of each segment
    start: torch.Tensor  # (NCH,) first document position of each chunk
    valid: torch.Tensor  # (NCH, C) bool: a position of an included segment
    flat: torch.Tensor  # (NCH, C) int64

    @classmethod
    def build(cls, cu_k: torch.Tensor, T_k: int, size: int, include: torch.Tensor | None = None,
              num: int | None = None) -> "_Chunks":
        dev = cu_k.device
        S = cu_k.numel() - 1
        k_len = cu_k[1:] - cu_k[:-1]
        n_ch = (k_len + size - 1) // size
        if include is not None:
            n_ch = torch.where(include, n_ch, 0)
        off = exclusive_cumsum(n_ch)
        nch = T_k // size + S if num is None else num
        seg = slot_owner(off, nch)
        seg_c = seg.clamp(max=max(S - 1, 0))
        start = (torch.arange(nch, device=dev) - off[seg_c]) * size
        pos = start[:, None] + torch.arange(size, device=dev)[None, :]
        valid = pos < torch.cat([k_len, k_len.new_zeros(1)])[seg][:, None]  # nothing valid in unused chunks
        flat = torch.where(valid, cu_k[seg_c][:, None] + pos, T_k)
        return cls(size, seg, seg_c, off, start, valid, flat)


def _select(mass: torch.Tensor, forced: torch.Tensor, seg: torch.Tensor, seg_start: torch.Tensor,
            total: torch.Tensor, max_total: float, coverage: float, cap: int) -> torch.Tensor:
    """Greedy top-mass selection per (segment, head) on flat (H, T) masses. Returns (H, T) bool.

    Within each segment, entries are taken in order of decreasing mass, forced ones
    first, while the mass taken before an entry is below ``coverage * total`` and
    fewer than ``cap`` are taken (forced entries always). One stable argsort of
    float64 (segment, -priority) keys: 4.7 ms for 32 heads x 256K keys on an H200,
    where a sort-free threshold search measured 8 ms (bench/sparse_estimation.py).
    """
    H, T = mass.shape
    big = 4.0 * max_total + 8.0  # above any mass (a mass is at most the total)
    # Ascending sort by (segment, -priority): one float64 key.
    prio = mass.double() + forced.double() * big
    key = seg.double()[None, :] * (4.0 * big) - prio
    order = torch.argsort(key, dim=1, stable=True)
    sorted_mass = mass.double().gather(1, order)
    excl = torch.cumsum(sorted_mass, 1) - sorted_mass
    # Sorting kept segments in place, so sorted slot t still belongs to seg[t].
    within = excl - excl[:, seg_start[seg]]
    rank = torch.arange(T, device=mass.device)[None, :] - seg_start[seg][None, :]
    take = forced.gather(1, order) | ((rank < cap) & (within < coverage * total.double()[seg][None, :]))
    return torch.zeros_like(take).scatter_(1, order, take)


@torch.no_grad()
def estimate_vertical_slash(q: torch.Tensor, k: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                            config: SparseConfig | None = None, *, scale: float | None = None,
                            chunk: int = 2048, memory_elements: int = 1 << 27, return_selection: bool = False,
                            k_lens_host: Sequence[int] | None = None):
    """Estimate one vertical-slash pattern per segment (= document) and query head.

    Same layout as the kernels: segment s has queries q[cu_q[s]:cu_q[s+1]], the
    tail of its keys k[cu_k[s]:cu_k[s+1]], bottom-right. The keys must be the
    *whole* document (its full causal prefix), and the estimating queries are the
    segment's last ``min(config.last_queries, q_len, k_len)`` rows, which must be
    the document's last tokens: a CA-task server holds exactly this for the task
    that ends a document (query shard [a, L) with keys [0, L)); pass that task's
    segment. For a document split over servers, the server of its last shard
    estimates and sends the pattern to the others (runtime.sparse).

    Scores are exact softmax rows of the estimating queries over all keys of the
    document (two passes over key chunks: log-sum-exp, then masses; the scores of one group of
    chunks serve both). Column mass of key c: sum over estimating queries of P(q, c). Slash mass
    of offset d: sum of P(q, pos(q) - d). Verticals and slashes are each selected greedily by mass
    until ``coverage`` of the total is reached or the cap is hit; sinks (columns
    < sink_tokens) and the local band (offsets < local_window) are always taken.
    Documents shorter than ``min_doc_len`` are dense.

    Vectorised over segments and heads: the only Python loop is over groups of key
    chunks sized to ``memory_elements`` float32 scores (a bound from the tensor
    shapes, not from their values), so nothing synchronises with the device.

    Dense documents need no masses: the score passes only cover the others, in
    chunks of ``chunk`` keys whose number is a static bound: all of T_k could belong
    to sparse documents. ``k_lens_host``, the segments' key lengths on the host (they must equal
    ``cu_k``'s differences; a caller that planned the batch knows them), makes that
    number exact, so a packed batch of mostly short documents costs only its long ones.

    Returns the pattern, or with ``return_selection`` a :class:`Selection` that
    also holds the token-level choice and the masses it was made from (then the
    masses of dense documents are computed too, for inspection).
    """
    cfg = config or SparseConfig()
    B = cfg.block
    dev = q.device
    S = cu_k.numel() - 1
    H, D_head = q.shape[1], q.shape[2]
    H_kv = k.shape[1]
    G = H // H_kv
    T_k = k.shape[0]
    scale = 1.0 / math.sqrt(D_head) if scale is None else scale
    cu_q = cu_q.to(dev, torch.int64)
    cu_k = cu_k.to(dev, torch.int64)
    q_len, k_len = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    n_max = cfg.last_queries
    n_last = torch.minimum(torch.minimum(q_len, k_len), torch.full_like(q_len, n_max))
    qt = _tail_queries(q, cu_q, n_last, n_max)  # (S, n, H, D)
    qt = qt.reshape(S, n_max, H_kv, G, D_head).permute(0, 2, 3, 1, 4).reshape(S, H_kv, G * n_max, D_head)

    dense = k_len < cfg.min_doc_len
    all_docs = return_selection  # masses of dense documents only for inspection

    def n_chunks(size: int, all_docs: bool) -> int:
        """Static number of chunks of the documents covered (exact from host lengths, else a bound)."""
        if k_lens_host is not None:
            L = np.asarray(k_lens_host, dtype=np.int64).reshape(S)
            return int((-(-L[(L >= cfg.min_doc_len) | all_docs] // size)).sum())
        n_docs = S if all_docs or cfg.min_doc_len == 0 else min(S, T_k // cfg.min_doc_len)
        return T_k // size + n_docs

    # Key chunks of C tokens, never crossing a segment.
    C = chunk
    ch = _Chunks.build(cu_k, T_k, C, include=None if all_docs else ~dense, num=n_chunks(C, all_docs))
    NCH = ch.seg.numel()
    ch_seg, seg_c, ch_start = ch.seg, ch.seg_c, ch.start
    per_chunk = H * n_max * C
    group = max(1, memory_elements // per_chunk)
    t_idx = torch.arange(C, device=dev)
    j_idx = torch.arange(n_max, device=dev)

    def chunk_scores(c0: int, c1: int):
        seg, sg = ch_seg[c0:c1], seg_c[c0:c1]
        pos = ch_start[c0:c1, None] + t_idx[None, :]  # key position in its document
        kvalid = ch.valid[c0:c1]
        rows = (cu_k[sg][:, None] + pos).clamp(0, max(T_k - 1, 0))
        kc = k[rows].float().permute(0, 2, 3, 1)  # (g, H_kv, D, C)
        s = torch.matmul(qt[sg], kc).view(c1 - c0, H_kv, G, n_max, C).reshape(c1 - c0, H, n_max, C)
        qpos = (k_len[sg] - n_last[sg])[:, None] + j_idx[None, :]  # (g, n)
        ok = kvalid[:, None, :] & (pos[:, None, :] <= qpos[:, :, None]) & (j_idx[None, :, None] < n_last[sg][:, None, None])
        return s.mul_(scale).masked_fill_(~ok[:, None], float("-inf")), seg, sg, qpos

    # Pass 1: row log-sum-exp per segment, merged over its chunks. When all chunks fit in one group
    # (64K keys at 32 heads and the default bound), pass 2 takes its scores instead of computing them again.
    ch_lse = torch.empty(NCH, H, n_max, device=dev)
    kept = None
    for c0 in range(0, NCH, group):
        c1 = min(NCH, c0 + group)
        scores = chunk_scores(c0, c1)
        ch_lse[c0:c1] = torch.logsumexp(scores[0], dim=-1)
        if NCH <= group:
            kept = scores
        del scores
    idx = ch_seg[:, None, None].expand(-1, H, n_max)
    m = torch.full((S + 1, H, n_max), float("-inf"), device=dev).scatter_reduce_(0, idx, ch_lse, "amax")
    m_safe = torch.where(torch.isinf(m), 0.0, m)
    # A segment's chunks are consecutive (ch.off), so its sum of chunk shares is a difference of one running
    # sum, which is computed in a fixed order. index_add_ added them in any order on a GPU, and in float32
    # that changed a few selections from one call to the next on the same input (an H200, 128K tokens).
    # Float64 keeps the differences exact to about 1e-13 of a sum, which is at least 1 (its largest share).
    shares = torch.exp(ch_lse - m_safe[ch_seg]).double()
    running = torch.cat([shares.new_zeros(1, H, n_max), shares.cumsum(0)])
    sumexp = running[ch.off[1:]] - running[ch.off[:-1]]  # (S, H, n): 0.0 for segments without chunks
    seg_lse = m_safe[:S] + torch.log(sumexp).float()  # -inf for padded rows

    # Pass 2: column and diagonal masses, flat over document positions; column T_k stays 0.0
    # (read by the gathers of padding slots below). A key lies in one chunk, so its column
    # mass is a plain write (padding slots write 0.0 into column T_k). Diagonal ranges of
    # neighbouring chunks overlap by n - 1 offsets, so those sums are accumulated, with
    # scatter_add_ rather than index_put_(accumulate=True), which sorts its indices on GPUs.
    # With C >= n - 1 an offset receives at most two adds onto 0.0: the same bits in any
    # order. Offsets outside a segment (all 0.0) go to a dump area of one slot per diagonal
    # index, so that their atomics do not pile up on one address.
    E = C + n_max - 1
    vmass = torch.zeros(H, T_k + 1, device=dev)
    smass = torch.zeros(H, T_k + 1 + E, device=dev)
    e = torch.arange(E, device=dev)
    for c0 in range(0, NCH, group):
        c1 = min(NCH, c0 + group)
        s, seg, sg, qpos = kept if kept is not None else chunk_scores(c0, c1)
        kept = None
        lse = seg_lse[sg]
        p = s.sub_(torch.where(torch.isinf(lse), 0.0, lse)[..., None]).exp_()  # (g, H, n, C), 0 where masked
        g = c1 - c0
        vmass.scatter_(1, ch.flat[c0:c1].reshape(1, g * C).expand(H, -1), p.sum(2).transpose(0, 1).reshape(H, g * C))
        # Diagonal sums by skewing: row j shifted right by j after flipping keys, then a column sum.
        skew = torch.nn.functional.pad(p.flip(-1), (0, n_max)).flatten(-2)[..., : n_max * E]
        diag = skew.view(g, H, n_max, E).sum(2)  # (g, H, E)
        d = (qpos[:, 0] - ch_start[c0:c1] - (C - 1))[:, None] + e[None, :]
        dvalid = (seg < S)[:, None] & (d >= 0) & (d < k_len[sg][:, None])
        dflat = torch.where(dvalid, cu_k[sg][:, None] + d, T_k + 1 + e[None, :])
        smass.scatter_add_(1, dflat.view(1, g * E).expand(H, -1), diag.transpose(0, 1).reshape(H, g * E))
        del s, p, skew, diag  # freed before the next group is scored (about half a GiB at 32 chunks)

    # Greedy selection per (segment, head); dense documents take nothing.
    vmass, smass = vmass[:, :T_k], smass[:, :T_k]
    pos_seg = slot_owner(cu_k, T_k)  # segment of each flat key position
    local = torch.arange(T_k, device=dev) - cu_k[pos_seg.clamp(max=max(S - 1, 0))]
    total = n_last.double()
    v_sel = _select(vmass, (local < cfg.sink_tokens)[None, :].expand(H, -1), pos_seg, cu_k, total,
                    float(n_max), cfg.coverage, cfg.vertical_cap)
    s_sel = _select(smass, (local < cfg.local_window)[None, :].expand(H, -1), pos_seg, cu_k, total,
                    float(n_max), cfg.coverage, cfg.slash_cap)
    sparse_pos = ~dense[pos_seg.clamp(max=max(S - 1, 0))][None, :]
    v_sel &= sparse_pos
    s_sel &= sparse_pos

    # Verticals, compacted in position order into each segment's slots.
    vcap = torch.minimum(k_len, torch.full_like(k_len, max(cfg.vertical_cap, cfg.sink_tokens)))
    vcap = torch.where(dense, 0, vcap)
    vert_off = exclusive_cumsum(vcap)
    NVT = min(T_k, S * max(cfg.vertical_cap, cfg.sink_tokens))
    vsel_i = v_sel.to(torch.int64)
    rank = torch.cumsum(vsel_i, 1) - vsel_i - exclusive_cumsum(vsel_i, 1)[:, cu_k[pos_seg.clamp(max=max(S - 1, 0))]]
    slot = torch.where(v_sel, vert_off[pos_seg.clamp(max=max(S - 1, 0))][None, :] + rank, NVT)
    vert_doc = slot_owner(vert_off, NVT)
    vert = k_len[vert_doc.clamp(max=max(S - 1, 0))][None, :].expand(H, -1).clone()
    vert = torch.cat([vert, vert[:, :1]], 1).scatter_(1, slot, local[None, :].expand(H, -1).contiguous())[:, :NVT]
    vexcl = exclusive_cumsum(vsel_i, 1)
    n_vert = (vexcl[:, cu_k[1:]] - vexcl[:, cu_k[:-1]]).T.contiguous()

    # Slashes -> block diagonals; dense documents get every diagonal.
    nb = (k_len + B - 1) // B
    blk_off = exclusive_cumsum(nb)
    NBT = T_k // B + S
    bm = torch.zeros(H, NBT + 1, dtype=torch.int64, device=dev)
    base = blk_off[pos_seg.clamp(max=max(S - 1, 0))][None, :]
    nb_pos = nb[pos_seg.clamp(max=max(S - 1, 0))]
    for dg in block_diagonals_of_offsets(local, B):
        # ceil(d / B) can reach nb, a diagonal no query block of the document has: drop it.
        ok = s_sel & (dg < nb_pos)[None, :]
        bm.scatter_add_(1, torch.where(ok, base + dg[None, :], NBT), ok.to(torch.int64))
    slash = bm[:, :NBT] > 0
    blk_doc = slot_owner(blk_off, NBT)
    slash |= (blk_doc < S)[None, :] & dense[blk_doc.clamp(max=max(S - 1, 0))][None, :]
    # Diagonal 0 always (it is in the local band unless local_window is 0 ... which config forbids).
    first = torch.zeros(NBT + 1, dtype=torch.bool, device=dev)
    first.scatter_(0, torch.where(nb > 0, blk_off[:-1], NBT), True)
    slash |= first[None, :NBT]
    pattern = VerticalSlashPattern(B, k_len, blk_off, slash, vert_off, vert, n_vert, dense)
    if return_selection:
        return Selection(pattern, v_sel, s_sel, vmass, smass, n_last)
    return pattern


@dataclass(frozen=True, eq=False)
class Selection:
    """What the estimator chose at token level, flat over key positions (H, T_k).

    ``vertical[h, t]``: key position t (of its segment) is a chosen column;
    ``slash[h, t]``: offset d = t - cu_k[segment] is a chosen slash. Masses are the
    estimating queries' column / diagonal sums (each segment's total = ``n_last``).
    """

    pattern: VerticalSlashPattern
    vertical: torch.Tensor
    slash: torch.Tensor
    vertical_mass: torch.Tensor
    slash_mass: torch.Tensor
    n_last: torch.Tensor


# --- moving patterns between servers ---


def estimate_untrained(doc_lens, num_heads: int, head_dim: int, config: SparseConfig, seed: int,
                       num_kv_heads: int | None = None, device="cpu",
                       dtype: torch.dtype = torch.float32) -> VerticalSlashPattern:
    """The patterns a randomly initialised model's attention, which spreads wide, would have: estimated as training
    estimates them, from random queries and keys (each document's last ``config.last_queries`` queries against all
    its keys; ``num_kv_heads`` of them, default ``num_heads``), drawn on ``device`` (a device's draws differ from the
    CPU's for one seed). For benchmarks and tests of what planning makes of real patterns' sizes."""
    lens = np.asarray(doc_lens, dtype=np.int64)
    m = np.minimum(lens, config.last_queries)
    g = torch.Generator(device=device).manual_seed(seed)
    draw = lambda n, h: torch.randn(n, h, head_dim, generator=g, device=device, dtype=dtype)
    k = draw(int(lens.sum()), num_heads if num_kv_heads is None else num_kv_heads)
    q = draw(int(m.sum()), num_heads)
    cu = lambda x: torch.tensor(np.r_[0, np.cumsum(x)], dtype=torch.int32, device=device)
    return estimate_vertical_slash(q, k, cu(m), cu(lens), config, k_lens_host=lens)


def packed_sizes(doc_lens, num_heads: int, config: SparseConfig) -> np.ndarray:
    """int32 words of each document's packed pattern, from host-known lengths alone:
    H x ceil(L/B) diagonal flags, H x vertical capacity columns, H counts."""
    L = np.asarray(doc_lens, dtype=np.int64)
    nb = -(-L // config.block)
    return num_heads * (nb + _vertical_capacity(L, config) + 1)


def _vertical_capacity(L: np.ndarray, config: SparseConfig) -> np.ndarray:
    cap = np.minimum(L, max(config.vertical_cap, config.sink_tokens))
    return np.where(L < config.min_doc_len, 0, cap)


@dataclass(frozen=True, eq=False)
class PackLayout:
    """Where each word of a packed buffer of documents with known lengths comes from and goes to.

    Per document: [diagonal flags h-major | vertical columns h-major | counts], ``packed_sizes``
    words. Built once on the host from the lengths (e.g. once per plan) and kept on the device,
    so that packing and unpacking per layer is gathers and scatters only: no host-to-device
    copy, which would synchronise the host with the GPU.
    """

    doc_lens: np.ndarray
    num_heads: int
    config: SparseConfig
    parts: tuple  # per kind (flags, columns, counts): (h, doc, slot) device tensors of its words, in buffer order
    order: torch.Tensor  # buffer position -> position in cat(flags words, column words, count words)
    sources: tuple  # per kind: the buffer positions of its words (for unpacking)
    blk_off: torch.Tensor  # the unpacked pattern's offsets, lengths and dense flags
    vert_off: torch.Tensor
    lens: torch.Tensor
    dense: torch.Tensor
    num_words: int  # of the buffer
    num_blocks: int  # block diagonals and vertical slots of the unpacked pattern, per head
    num_vert_slots: int

    @classmethod
    def build(cls, doc_lens, num_heads: int, config: SparseConfig, device) -> "PackLayout":
        L = np.asarray(doc_lens, dtype=np.int64)
        H = num_heads
        nb = -(-L // config.block)
        widths = (nb, _vertical_capacity(L, config), np.ones_like(nb))
        sizes = np.stack([H * w for w in widths], 1)  # (D, 3) words per document and kind
        start = np.concatenate([[0], np.cumsum(sizes.sum(1))])[:-1]
        dev = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64).to(device)
        parts, sources, kind_of_word = [], [], []
        for kind, width in enumerate(widths):
            n = H * width
            word = ranges(np.zeros_like(n), n)  # position inside this kind's part of its document
            doc = np.repeat(np.arange(len(L)), n)
            w = np.maximum(width[doc], 1)
            parts.append(tuple(dev(x) for x in (word // w, doc, word % w)))
            sources.append(dev(start[doc] + sizes[doc, :kind].sum(1) + word))
            kind_of_word.append(np.repeat(np.arange(len(L)) * 3 + kind, n))
        order = np.argsort(np.concatenate(kind_of_word), kind="stable")
        return cls(L, H, config, tuple(parts), dev(order), tuple(sources),
                   dev(np.concatenate([[0], np.cumsum(nb)])), dev(np.concatenate([[0], np.cumsum(widths[1])])),
                   dev(L), torch.as_tensor(L < config.min_doc_len).to(device), int(sizes.sum()), int(nb.sum()),
                   int(widths[1].sum()))

    def pack(self, pattern: VerticalSlashPattern, docs: torch.Tensor) -> torch.Tensor:
        """The rows of documents ``docs`` (device indices into ``pattern``, one per layout document)."""
        blk0, vert0 = pattern.blk_off[docs], pattern.vert_off[docs]
        (fh, fd, fs), (vh, vd, vs), (ch, cd, _) = self.parts
        words = torch.cat([pattern.slash[fh, blk0[fd] + fs].to(torch.int32),
                           pattern.vert[vh, vert0[vd] + vs].to(torch.int32),
                           pattern.n_vert[docs[cd], ch].to(torch.int32)])
        return words[self.order]

    def unpack(self, buffer: torch.Tensor) -> VerticalSlashPattern:
        H, D, dev = self.num_heads, len(self.doc_lens), buffer.device
        slash = torch.zeros(H, self.num_blocks, dtype=torch.bool, device=dev)
        vert = torch.zeros(H, self.num_vert_slots, dtype=torch.int64, device=dev)
        n_vert = torch.zeros(D, H, dtype=torch.int64, device=dev)
        (fh, fd, fs), (vh, vd, vs), (ch, cd, _) = self.parts
        flags, cols, counts = (buffer[src] for src in self.sources)
        slash[fh, self.blk_off[fd] + fs] = flags != 0
        vert[vh, self.vert_off[vd] + vs] = cols.to(torch.int64)
        n_vert[cd, ch] = counts.to(torch.int64)
        return VerticalSlashPattern(self.config.block, self.lens, self.blk_off, slash, self.vert_off, vert, n_vert,
                                    self.dense)


def pack_pattern(pattern: VerticalSlashPattern, docs, doc_lens, config: SparseConfig) -> torch.Tensor:
    """Pattern rows of documents ``docs`` (indices into ``pattern``, host ints) as one int32 buffer.

    ``doc_lens`` are those documents' lengths on the host (the plan knows them). Per
    document the buffer holds ``packed_sizes`` words; concatenated in the order of
    ``docs``. To pack the same documents every layer, build a :class:`PackLayout` once.
    """
    layout = PackLayout.build(doc_lens, pattern.num_heads, config, pattern.device)
    return layout.pack(pattern, torch.as_tensor(np.asarray(docs, dtype=np.int64)).to(pattern.device))


def unpack_patterns(buffer: torch.Tensor, doc_lens, num_heads: int, config: SparseConfig) -> VerticalSlashPattern:
    """Inverse of :func:`pack_pattern` over a concatenation of packed documents."""
    return PackLayout.build(doc_lens, num_heads, config, buffer.device).unpack(buffer)
