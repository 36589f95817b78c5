"""Reference backend: the attention math written out in plain PyTorch.

Runs on any device and float dtype; accumulates in float32 (float64 inputs stay
float64, and so does their lse, so double-precision gradient checks hold).
Memory stays bounded: it loops over segments and, inside one, over chunks of
query rows, so the largest temporary is one (heads x rows x keys) score block.
Speed is secondary, but each chunk is a few batched matmuls over all heads.
"""

from __future__ import annotations

import torch

from attnpool.kernels.base import Backend, check_inputs, default_scale

# Upper bounds on one chunk: at most this many query rows, and at most this many
# elements in its score block (64 MiB in float32), whichever is smaller.
MAX_CHUNK_ROWS = 1024
MAX_SCORE_ELEMENTS = 1 << 24


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor):
    """(q_start, q_len, k_start, k_len) of every segment."""
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bounds_q) - 1):
        yield (bounds_q[i], bounds_q[i + 1] - bounds_q[i],
               bounds_k[i], bounds_k[i + 1] - bounds_k[i])


def _chunks(q_len: int, k_len: int, n_heads: int):
    """(first_row, end_row, n_keys) of each chunk of rows that sees a key.

    Row j sees keys 0 .. k_len - q_len + j, so a chunk ending at row r1 needs
    only the first k_len - q_len + r1 keys; chunks that see none are skipped.
    """
    rows = max(1, min(MAX_CHUNK_ROWS, MAX_SCORE_ELEMENTS // max(1, n_heads * k_len)))
    for r0 in range(0, q_len, rows):
        r1 = min(q_len, r0 + rows)
        n_keys = min(k_len, k_len - q_len + r1)
        if n_keys > 0:
            yield r0, r1, n_keys


def _head_major(x: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(rows, H_q, D) -> (H_kv, group * rows, D): query heads that share a kv
    head stacked along rows, so one bmm per kv head covers the whole group."""
    rows, n_q, dim = x.shape
    return x.reshape(rows, n_kv, n_q // n_kv, dim).permute(1, 2, 0, 3).reshape(n_kv, -1, dim)


def _token_major(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of _head_major: (H_kv, group * rows, D) -> (rows, H_q, D)."""
    n_kv, _, dim = x.shape
    return x.reshape(n_kv, -1, rows, dim).permute(2, 0, 1, 3).reshape(rows, -1, dim)


def _probabilities(q_scaled: torch.Tensor, keys: torch.Tensor, row_lse: torch.Tensor | None,
                   q_len: int, k_len: int, r0: int, r1: int):
    """Masked scores of one chunk turned into probabilities.

    q_scaled is head-major (H_kv, group * rows, D), keys (H_kv, n_keys, D).
    With row_lse None it is computed here (forward); the backward passes the
    forward's. Returns (P, row_lse), P of shape (H_kv, group * rows, n_keys).
    """
    n_kv, n_keys = keys.shape[0], keys.shape[1]
    scores = torch.bmm(q_scaled, keys.transpose(1, 2))
    last_key = torch.arange(r0, r1, device=keys.device) + (k_len - q_len)
    hidden = torch.arange(n_keys, device=keys.device)[None, :] > last_key[:, None]
    scores.view(n_kv, -1, r1 - r0, n_keys).masked_fill_(hidden, float("-inf"))
    if row_lse is None:
        row_lse = torch.logsumexp(scores, dim=-1)
    # Rows that see no key have lse = -inf; shifting them by 0 instead keeps
    # exp(-inf) = 0 rather than exp(nan).
    shift = row_lse.masked_fill(torch.isinf(row_lse), 0.0)
    return torch.exp(scores - shift[..., None]), row_lse


def forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=None):
    """Causal varlen attention; returns (out, lse) per the kernels contract."""
    check_inputs(q, k, v, cu_q, cu_k)
    scale = default_scale(q.shape[2]) if scale is None else scale
    acc = _accumulation_dtype(q.dtype)
    n_q, n_kv = q.shape[1], k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((n_q, q.shape[0]), float("-inf"), dtype=acc, device=q.device)
    for q0, q_len, k0, k_len in _segments(cu_q, cu_k):
        keys = k[k0:k0 + k_len].to(acc).transpose(0, 1)
        values = v[k0:k0 + k_len].to(acc).transpose(0, 1)
        for r0, r1, n_keys in _chunks(q_len, k_len, n_q):
            rows = slice(q0 + r0, q0 + r1)
            q_scaled = _head_major(q[rows].to(acc) * scale, n_kv)
            p, row_lse = _probabilities(q_scaled, keys[:, :n_keys], None, q_len, k_len, r0, r1)
            out[rows] = _token_major(torch.bmm(p, values[:, :n_keys]), r1 - r0).to(q.dtype)
            lse[:, rows] = row_lse.reshape(n_q, r1 - r0)
    return out, lse


def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=None):
    """Gradients (dq, dk, dv) of causal varlen attention, from the forward's out and lse."""
    check_inputs(q, k, v, cu_q, cu_k)
    scale = default_scale(q.shape[2]) if scale is None else scale
    acc = _accumulation_dtype(q.dtype)
    n_q, n_kv = q.shape[1], k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q0, q_len, k0, k_len in _segments(cu_q, cu_k):
        keys = k[k0:k0 + k_len].to(acc).transpose(0, 1)
        values = v[k0:k0 + k_len].to(acc).transpose(0, 1)
        dkeys = torch.zeros_like(keys)
        dvalues = torch.zeros_like(values)
        for r0, r1, n_keys in _chunks(q_len, k_len, n_q):
            rows = slice(q0 + r0, q0 + r1)
            q_scaled = _head_major(q[rows].to(acc) * scale, n_kv)
            grad_out = _head_major(dout[rows].to(acc), n_kv)
            row_lse = lse[:, rows].to(acc).reshape(n_kv, -1)
            p, _ = _probabilities(q_scaled, keys[:, :n_keys], row_lse, q_len, k_len, r0, r1)
            dp = torch.bmm(grad_out, values[:, :n_keys].transpose(1, 2))
            # D_i = rowsum(dout * out) = rowsum(P * dP): the softmax Jacobian's diagonal term.
            delta = (grad_out * _head_major(out[rows].to(acc), n_kv)).sum(-1, keepdim=True)
            ds = p * (dp - delta)
            dq[rows] = _token_major(torch.bmm(ds, keys[:, :n_keys]) * scale, r1 - r0).to(q.dtype)
            # Stacking a kv head's query group along rows makes these matmuls
            # sum over the group, which is GQA's gradient for the shared head.
            dkeys[:, :n_keys] += torch.bmm(ds.transpose(1, 2), q_scaled)
            dvalues[:, :n_keys] += torch.bmm(p.transpose(1, 2), grad_out)
        dk[k0:k0 + k_len] = dkeys.transpose(0, 1).to(k.dtype)
        dv[k0:k0 + k_len] = dvalues.transpose(0, 1).to(v.dtype)
    return dq, dk, dv


BACKEND = Backend("reference", forward, backward, splits_by_segment=True)
