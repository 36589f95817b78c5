"""Ulysses core attention (plan.ulysses): two all-to-alls around one kernel call over the whole batch.

Forward, per call:

heads    one all-to-all: this rank's tokens of every head go out, each rank's share of the heads to it;
         back come every rank's tokens of this rank's heads, in rank order (the batch's token order)
compute  one kernel call over every document of the batch, whole, on this rank's heads
tokens   one all-to-all: each rank's tokens of this rank's heads go home; back come this rank's tokens of
         every rank's heads

Backward is the same two exchanges the other way round (each is the other's backward). Q, K and V travel
in one exchange. Where the ranks hold more KV heads than the model has (W > H_kv), K and V are indexed to
the head each rank reads before the exchange, whose backward sums the copies' gradients.

Saved for backward: the kernel's inputs and output on this rank's heads (the batch's tokens), and its LSE;
the exchanges save nothing, so this rank's own q, k, v are not kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnpool.comm import all_to_all_flat, group_rank_size
from attnpool.kernels.base import Backend
from attnpool.kinds import AttentionKind
from attnpool.kernels.registry import attention
from attnpool.plan.documents import ranges
from attnpool.plan.plan import Plan
from attnpool.plan.ulysses import heads_of
from attnpool.runtime.core_attention import agree_on_call, call_problem, kernel_backend


@dataclass(frozen=True)
class UlyssesLayout:
    """One rank's view of a ulysses plan: the ranks' token counts, and the batch's documents in the order the
    exchange gathers their tokens (rank by rank)."""

    rank: int
    world: int
    tokens: tuple[int, ...]  # per rank
    order: torch.Tensor | None  # gathered row of each document-ordered row; None where they coincide
    inverse: torch.Tensor | None
    cu_seqlens: torch.Tensor  # int32, documents whole, in document order
    max_seqlen: int
    kv_heads: torch.Tensor | None  # the KV head each rank's query heads read, rank after rank (W > H_kv)

    @classmethod
    def build(cls, plan: Plan, rank: int, device) -> "UlyssesLayout":
        t, W = plan.pieces, plan.num_ranks
        tokens = t.tokens_per_rank.astype(np.int64)
        gathered_start = np.r_[0, np.cumsum(tokens)[:-1]][t.rank] + t.offset
        by_doc = np.lexsort((t.start, t.doc))
        order = ranges(gathered_start[by_doc], t.length[by_doc])
        doc_lens = np.bincount(t.doc, weights=t.length, minlength=t.num_docs).astype(np.int64)
        assert np.array_equal(doc_lens, t.doc_len), "a ulysses plan needs every document whole in the batch"
        identity = np.array_equal(order, np.arange(len(order)))
        n_q, n_kv = heads_of(plan)
        kv_heads = None
        if W > n_kv:  # rank j's query heads [j n_q / W, ...) read KV head j n_q / W // (n_q / n_kv)
            kv_heads = torch.as_tensor((np.arange(W) * (n_q // W)) // (n_q // n_kv), device=device)
        as_index = lambda a: torch.as_tensor(a, dtype=torch.long, device=device)  # noqa: E731
        return cls(rank, W, tuple(int(n) for n in tokens),
                   None if identity else as_index(order), None if identity else as_index(np.argsort(order)),
                   torch.as_tensor(np.r_[0, np.cumsum(t.doc_len)], dtype=torch.int32, device=device),
                   int(t.doc_len.max()) if t.num_docs else 0, kv_heads)


def _to_heads(xs, L: UlyssesLayout, group) -> list[torch.Tensor]:
    """(T_r, W * h_i, D) tensors of this rank's tokens -> (T, h_i, D) of the batch's tokens, this rank's heads."""
    W, T_r = L.world, L.tokens[L.rank]
    widths = [x.shape[1] // W * x.shape[2] for x in xs]
    send = torch.cat([x.reshape(T_r, W, w).transpose(0, 1) for x, w in zip(xs, widths)], dim=2)
    C = sum(widths)
    recv = all_to_all_flat(send.reshape(-1), [T_r * C] * W, [n * C for n in L.tokens], group, tag="ulysses")
    parts = recv.view(-1, C).split(widths, dim=1)
    return [p.reshape(p.shape[0], x.shape[1] // W, x.shape[2]) for p, x in zip(parts, xs)]


def _to_tokens(ys, L: UlyssesLayout, group) -> list[torch.Tensor]:
    """The inverse of _to_heads: (T, h_i, D) of this rank's heads -> (T_r, W * h_i, D) of this rank's tokens."""
    W, T_r = L.world, L.tokens[L.rank]
    widths = [y.shape[1] * y.shape[2] for y in ys]
    C = sum(widths)
    send = torch.cat([y.reshape(y.shape[0], w) for y, w in zip(ys, widths)], dim=1)
    recv = all_to_all_flat(send.reshape(-1), [n * C for n in L.tokens], [T_r * C] * W, group, tag="ulysses")
    parts = recv.view(W, T_r, C).split(widths, dim=2)
    return [p.transpose(0, 1).reshape(T_r, W * y.shape[1], y.shape[2]) for p, y in zip(parts, ys)]


class _Exchange(torch.autograd.Function):
    """One of the two exchanges (``to_heads``: _to_heads, else _to_tokens); its backward is the other."""

    @staticmethod
    def forward(ctx, L, group, to_heads: bool, *xs):
        ctx.L, ctx.group, ctx.to_heads = L, group, to_heads
        return tuple((_to_heads if to_heads else _to_tokens)(xs, L, group))

    @staticmethod
    def backward(ctx, *grads):
        back = _to_tokens if ctx.to_heads else _to_heads
        return (None, None, None, *back([g.contiguous() for g in grads], ctx.L, ctx.group))


def _heads_problem(plan: Plan, q, k, world: int) -> str | None:
    n_q, n_kv = heads_of(plan)
    if (q.shape[1], k.shape[1]) != (n_q, n_kv):
        return (f"heads: the ulysses plan was made for {n_q} query and {n_kv} KV heads, and the call has "
                f"{q.shape[1]} and {k.shape[1]}")
    return None


class UlyssesAttention:
    """Core attention of one batch under a ulysses plan: ``attention(q, k, v)`` with this rank's tokens (in
    the order of its pieces), as :class:`CoreAttention` takes them; returns this rank's output. Every document
    runs whole, so a plan's sliding window (``plan.window``) and ``softcap`` go straight to the kernel."""

    def __init__(self, plan: Plan, group=None, *, backend: str | Backend | None = None, scale: float | None = None,
                 softcap: float | None = None):
        assert plan.head_parallel, f"a {plan.strategy} plan is served by CoreAttention"
        self.plan, self.group, self.backend, self.scale, self.softcap = plan, group, backend, scale, softcap

    def kind_of(self, layer: int | None = None) -> AttentionKind:
        """What it computes for any layer: its plan's window, its soft-cap (attnpool.kinds.check_layer_kind)."""
        return AttentionKind(self.plan.window, self.softcap)

    def layout(self, q, k, v) -> UlyssesLayout:
        rank, world = group_rank_size(self.group)
        problem = call_problem(q, k, v, self.plan, rank, world, self.group) or \
            _heads_problem(self.plan, q, k, world)
        agree_on_call(self.plan, q, problem, self.group)
        key = ("ulysses", rank, str(q.device), id(self.group))
        if key not in self.plan.runtime_cache:
            self.plan.runtime_cache[key] = UlyssesLayout.build(self.plan, rank, q.device)
        return self.plan.runtime_cache[key]

    def __call__(self, q, k, v, *, layer: int | None = None) -> torch.Tensor:
        with torch.profiler.record_function("ulysses_attention"):  # its copies in a trace (bench/trace_breakdown.py)
            return self._call(q, k, v)

    def _call(self, q, k, v) -> torch.Tensor:
        L = self.layout(q, k, v)
        if L.world == 1:
            qh, kh, vh = q, k, v
        else:
            if L.kv_heads is not None:  # each rank's KV head, once per rank that reads it
                k, v = k.index_select(1, L.kv_heads), v.index_select(1, L.kv_heads)
            qh, kh, vh = _Exchange.apply(L, self.group, True, q, k, v)
        if L.order is not None:  # the kernel takes each document's tokens together, in order
            qh, kh, vh = qh[L.order], kh[L.order], vh[L.order]
        backend = kernel_backend(self.backend, q, self.plan.window, self.softcap)
        out, _ = attention(qh, kh, vh, L.cu_seqlens, L.cu_seqlens, L.max_seqlen, L.max_seqlen, backend=backend,
                           scale=self.scale)
        if L.inverse is not None:
            out = out[L.inverse]
        return out if L.world == 1 else _Exchange.apply(L, self.group, False, out)[0]
