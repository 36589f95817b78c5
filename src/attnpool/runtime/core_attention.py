"""``core_attention``: causal attention of this rank's tokens over their documents, wherever they live.

One autograd function per call (per layer):

forward   dispatch all-to-all (Q and KV out) -> one fused kernel call over every
          CA-task this rank serves -> return all-to-all (O back)
backward  dispatch all-to-all (dO out) -> kernel backward -> return all-to-all
          (dQ and dKV back; KV gradients of every copy summed once at the source)

Saved for backward: this rank's own q, k, v, the Q and unique KV it received,
and its server outputs and LSE. The per-task KV prefixes are expanded only
transiently around each kernel call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from attnpool.comm import agree_on_plan, all_to_all_flat, group_rank_size
from attnpool.errors import ConfigError
from attnpool.kernels import get_backend
from attnpool.kernels.base import Backend
from attnpool.plan.plan import Plan
from attnpool.runtime.dispatch import DispatchLayout


def _pack(a: torch.Tensor, b: torch.Tensor, a_splits: list[int], b_splits: list[int]):
    """Interleave per peer: [a rows for peer 0 | b rows for peer 0 | a rows for peer 1 | ...]."""
    a_parts, b_parts = torch.split(a, a_splits), torch.split(b, b_splits)
    flat = torch.cat([part.reshape(-1) for pair in zip(a_parts, b_parts) for part in pair])
    sizes = [na * a.shape[1] + nb * b.shape[1] for na, nb in zip(a_splits, b_splits)]
    return flat, sizes


def _unpack(flat: torch.Tensor, a_splits: list[int], b_splits: list[int], a_width: int, b_width: int):
    sizes = [x for na, nb in zip(a_splits, b_splits) for x in (na * a_width, nb * b_width)]
    parts = torch.split(flat, sizes)
    return torch.cat(parts[0::2]).view(-1, a_width), torch.cat(parts[1::2]).view(-1, b_width)


def _exchange(a, b, a_send, b_send, a_recv, b_recv, group, tag):
    """Send per-peer rows of two kinds in one all-to-all; returns the received (a, b)."""
    flat, send_sizes = _pack(a, b, a_send, b_send)
    recv_sizes = [na * a.shape[1] + nb * b.shape[1] for na, nb in zip(a_recv, b_recv)]
    recv = all_to_all_flat(flat, send_sizes, recv_sizes, group, tag=tag)
    return _unpack(recv, a_recv, b_recv, a.shape[1], b.shape[1])


def _server_inputs(L: DispatchLayout, q, k, v, q_recv, kv_recv):
    """The server's Q in task order and its unique K, V buffers."""
    H_q, D = q.shape[1], q.shape[2]
    H_kv = k.shape[1]
    q_srv = q.new_empty(L.num_server_q, H_q, D)
    q_srv[L.local_q_pos] = q[L.local_q_rows]
    q_srv[L.recv_q_pos] = q_recv.view(-1, H_q, D)
    k_u = k.new_empty(L.num_unique_kv, H_kv, D)
    v_u = v.new_empty(L.num_unique_kv, H_kv, D)
    k_u[L.local_kv_pos] = k[L.local_kv_rows]
    v_u[L.local_kv_pos] = v[L.local_kv_rows]
    kv = kv_recv.view(-1, 2, H_kv, D)
    k_u[L.recv_kv_pos] = kv[:, 0]
    v_u[L.recv_kv_pos] = kv[:, 1]
    return q_srv, k_u, v_u


class _CoreAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, L: DispatchLayout, backend: Backend, scale, group):
        T, H_q, D = q.shape
        H_kv = k.shape[1]
        if L.any_traffic:
            q_out = q[L.q_send_rows].reshape(-1, H_q * D)
            kv_out = torch.stack([k[L.kv_send_rows], v[L.kv_send_rows]], 1).reshape(-1, 2 * H_kv * D)
            q_recv, kv_recv = _exchange(q_out, kv_out, L.q_send_splits, L.kv_send_splits,
                                        L.q_recv_splits, L.kv_recv_splits, group, "dispatch")
        else:
            q_recv, kv_recv = q.new_empty(0, H_q * D), k.new_empty(0, 2 * H_kv * D)
        q_srv, k_u, v_u = _server_inputs(L, q, k, v, q_recv, kv_recv)
        out_srv, lse = backend.forward(q_srv, k_u[L.kv_expand], v_u[L.kv_expand],
                                       L.cu_q, L.cu_k, L.max_q, L.max_k, scale=scale)
        out = q.new_empty(T, H_q, D)
        out[L.local_q_rows] = out_srv[L.local_q_pos]
        if L.any_traffic:
            o_send = out_srv[L.recv_q_pos].reshape(-1)
            o_recv = all_to_all_flat(o_send, [n * H_q * D for n in L.q_recv_splits],
                                     [n * H_q * D for n in L.q_send_splits], group, tag="return")
            out[L.q_send_rows] = o_recv.view(-1, H_q, D)
        ctx.save_for_backward(q, k, v, q_recv, kv_recv, out_srv, lse)
        ctx.layout, ctx.backend, ctx.scale, ctx.group = L, backend, scale, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, q_recv, kv_recv, out_srv, lse = ctx.saved_tensors
        L, backend, group = ctx.layout, ctx.backend, ctx.group
        H_q, D = q.shape[1], q.shape[2]
        H_kv = k.shape[1]
        dout = dout.contiguous()
        dout_srv = dout.new_empty(L.num_server_q, H_q, D)
        dout_srv[L.local_q_pos] = dout[L.local_q_rows]
        if L.any_traffic:
            d_recv = all_to_all_flat(dout[L.q_send_rows].reshape(-1), [n * H_q * D for n in L.q_send_splits],
                                     [n * H_q * D for n in L.q_recv_splits], group, tag="dispatch_grad")
            dout_srv[L.recv_q_pos] = d_recv.view(-1, H_q, D)
        q_srv, k_u, v_u = _server_inputs(L, q, k, v, q_recv, kv_recv)
        dq_srv, dk_exp, dv_exp = backend.backward(dout_srv, q_srv, k_u[L.kv_expand], v_u[L.kv_expand], out_srv, lse,
                                                  L.cu_q, L.cu_k, L.max_q, L.max_k, scale=ctx.scale)
        # Each unique KV row may feed several tasks: sum the copies' gradients once here.
        dk_u = torch.zeros_like(k_u).index_add_(0, L.kv_expand, dk_exp)
        dv_u = torch.zeros_like(v_u).index_add_(0, L.kv_expand, dv_exp)
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        dq[L.local_q_rows] = dq_srv[L.local_q_pos]
        dk.index_add_(0, L.local_kv_rows, dk_u[L.local_kv_pos])
        dv.index_add_(0, L.local_kv_rows, dv_u[L.local_kv_pos])
        if L.any_traffic:
            dq_back = dq_srv[L.recv_q_pos].reshape(-1, H_q * D)
            dkv_back = torch.stack([dk_u[L.recv_kv_pos], dv_u[L.recv_kv_pos]], 1).reshape(-1, 2 * H_kv * D)
            dq_recv, dkv_recv = _exchange(dq_back, dkv_back, L.q_recv_splits, L.kv_recv_splits,
                                          L.q_send_splits, L.kv_send_splits, group, "return_grad")
            dq[L.q_send_rows] = dq_recv.view(-1, H_q, D)
            # A KV row sent to several servers gets every server's gradient summed.
            dkv = dkv_recv.view(-1, 2, H_kv, D)
            dk.index_add_(0, L.kv_send_rows, dkv[:, 0])
            dv.index_add_(0, L.kv_send_rows, dkv[:, 1])
        return dq, dk, dv, None, None, None, None


def _local_problem(q, k, v, plan: Plan, rank: int, world: int, group) -> str | None:
    """What is wrong with this rank's call, or None. Checked on every rank before any collective."""
    if plan.num_ranks != world:
        return f"plan.num_ranks={plan.num_ranks}: the plan was made for {plan.num_ranks} ranks but the group has {world}"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return f"q, k, v must be (tokens, heads, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    T = int(plan.pieces.tokens_per_rank[rank])
    if q.shape[0] != T or k.shape[0] != T or v.shape[0] != T:
        return f"q.shape[0]={q.shape[0]} (k {k.shape[0]}, v {v.shape[0]}): the plan gives rank {rank} {T} tokens"
    if k.shape != v.shape:
        return f"k.shape={tuple(k.shape)} differs from v.shape={tuple(v.shape)}"
    if q.shape[2] != k.shape[2]:
        return f"head_dim: q has {q.shape[2]}, k has {k.shape[2]}"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"heads: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads"
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        return f"dtype: q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.device == k.device == v.device):
        return f"device: q, k, v must be on one device; got {q.device}, {k.device}, {v.device}"
    if world > 1 and dist.get_backend(group) == "nccl" and q.device.type != "cuda":
        return f"device={q.device}: the NCCL group needs CUDA tensors"
    return None


def default_backend(q: torch.Tensor) -> Backend:
    """flash for fp16/bf16 on CUDA, reference otherwise (float32 on CUDA included)."""
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        return get_backend("flash", q.device)
    return get_backend("reference", q.device)


def dispatch_layout(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None) -> DispatchLayout:
    """This rank's layout for ``plan``: checked and agreed on once, then cached on the plan."""
    rank, world = group_rank_size(group)
    key = (rank, str(q.device), id(group))
    problem = _local_problem(q, k, v, plan, rank, world, group)
    layout = plan.runtime_cache.get(key)
    if layout is not None:
        if problem:
            raise ConfigError("core_attention", f"rank {rank}", problem)
        return layout
    # First use of this plan: every rank checks and compares fingerprints before the first
    # collective that depends on the plan. A fully local plan launches none, so needs none.
    if not (plan.num_ranks == world and plan.is_fully_local()) or problem:
        device = q.device if world > 1 and dist.get_backend(group) == "nccl" else torch.device("cpu")
        agree_on_plan(plan.fingerprint(), problem, group, device)
    layout = DispatchLayout.build(plan, rank, q.device)
    plan.runtime_cache[key] = layout
    return layout


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, group=None, *,
                   backend: str | Backend | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention of every token over its own document's earlier tokens, wherever they live.

    q (T_r, H_q, D), k and v (T_r, H_kv, D) hold this rank's tokens in the order of its
    pieces in ``plan``; returns (T_r, H_q, D). Differentiable in q, k and v.
    """
    layout = dispatch_layout(plan, q, k, v, group)
    if backend is None:
        backend = default_backend(q)
    elif not isinstance(backend, Backend):
        backend = get_backend(backend, q.device)
    return _CoreAttention.apply(q, k, v, layout, backend, scale, group)
