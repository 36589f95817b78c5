"""Reference backend: the attention math written out in plain PyTorch.

Runs on any device and float dtype; accumulates in float32 (float64 inputs stay
float64, and so does their lse, so double-precision gradient checks hold).
Memory stays bounded: it loops over segments and, inside one, over chunks of
query rows, so the largest temporary is one (heads x rows x keys) score block.
Speed is secondary, but each chunk is a few batched matmuls over all heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnpool.kernels.base import (Backend, PositionKernel, check_inputs, check_position_inputs, check_positions,
                                   default_scale)

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


def _probabilities(q_scaled: torch.Tensor, keys: torch.Tensor, row_lse: torch.Tensor | None, last_key: torch.Tensor,
                   window: int | None = None, softcap: float | None = None):
    """Masked scores of one chunk turned into probabilities.

    q_scaled is head-major (H_kv, group * rows, D), keys (H_kv, n_keys, D), ``last_key`` each row's last
    visible key; under a sliding window a row sees the ``window`` keys ending there. ``softcap``: scores
    become softcap * tanh(scores / softcap) before the mask. With row_lse None it is computed here
    (forward); the backward passes the forward's. Returns (P, row_lse, tanh of the capped scores or None),
    P of shape (H_kv, group * rows, n_keys).
    """
    n_kv, n_keys = keys.shape[0], keys.shape[1]
    scores = torch.bmm(q_scaled, keys.transpose(1, 2))
    capped = None
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        scores = capped * softcap
    key = torch.arange(n_keys, device=keys.device)[None, :]
    hidden = key > last_key[:, None]
    if window is not None:
        hidden |= key <= (last_key - window)[:, None]
    scores.view(n_kv, -1, len(last_key), n_keys).masked_fill_(hidden, float("-inf"))
    if row_lse is None:
        row_lse = torch.logsumexp(scores, dim=-1)
    # Rows that see no key have lse = -inf; shifting them by 0 instead keeps
    # exp(-inf) = 0 rather than exp(nan).
    shift = row_lse.masked_fill(torch.isinf(row_lse), 0.0)
    return torch.exp(scores - shift[..., None]), row_lse, capped


def _forward_rows(out, lse, q, k, v, chunks, scale, window=None, softcap=None):
    """out and lse of the query rows ``chunks`` names ((rows, n_keys, last key of each row), all over
    the keys ``k``, ``v``)."""
    acc = lse.dtype
    n_q, n_kv = q.shape[1], k.shape[1]
    keys, values = k.to(acc).transpose(0, 1), v.to(acc).transpose(0, 1)
    for rows, n_keys, last_key in chunks:
        q_scaled = _head_major(q[rows].to(acc) * scale, n_kv)
        p, row_lse, _ = _probabilities(q_scaled, keys[:, :n_keys], None, last_key, window, softcap)
        out[rows] = _token_major(torch.bmm(p, values[:, :n_keys]), len(last_key)).to(q.dtype)
        lse[:, rows] = row_lse.reshape(n_q, len(last_key))


def _backward_rows(dq, dout, q, k, v, out, lse, chunks, scale, window=None, softcap=None):
    """dq of the rows ``chunks`` names (written into ``dq``), and the gradients of ``k``, ``v`` they give."""
    acc = _accumulation_dtype(q.dtype)
    n_kv = k.shape[1]
    keys, values = k.to(acc).transpose(0, 1), v.to(acc).transpose(0, 1)
    dkeys, dvalues = torch.zeros_like(keys), torch.zeros_like(values)
    for rows, n_keys, last_key in chunks:
        q_scaled = _head_major(q[rows].to(acc) * scale, n_kv)
        grad_out = _head_major(dout[rows].to(acc), n_kv)
        row_lse = lse[:, rows].to(acc).reshape(n_kv, -1)
        p, _, capped = _probabilities(q_scaled, keys[:, :n_keys], row_lse, last_key, window, softcap)
        dp = torch.bmm(grad_out, values[:, :n_keys].transpose(1, 2))
        # D_i = rowsum(dout * out) = rowsum(P * dP): the softmax Jacobian's diagonal term.
        delta = (grad_out * _head_major(out[rows].to(acc), n_kv)).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        if capped is not None:  # d(c * tanh(s / c)) / ds = 1 - tanh^2
            ds = ds * (1.0 - capped * capped)
        dq[rows] = _token_major(torch.bmm(ds, keys[:, :n_keys]) * scale, len(last_key)).to(q.dtype)
        # Stacking a kv head's query group along rows makes these matmuls
        # sum over the group, which is GQA's gradient for the shared head.
        dkeys[:, :n_keys] += torch.bmm(ds.transpose(1, 2), q_scaled)
        dvalues[:, :n_keys] += torch.bmm(p.transpose(1, 2), grad_out)
    return dkeys.transpose(0, 1).to(k.dtype), dvalues.transpose(0, 1).to(v.dtype)


def _segment_chunks(q0, q_len, k_len, n_heads, device):
    """The chunks of one varlen segment whose queries start at row q0: its rows are its keys' tail."""
    for r0, r1, n_keys in _chunks(q_len, k_len, n_heads):
        yield slice(q0 + r0, q0 + r1), n_keys, torch.arange(r0, r1, device=device) + (k_len - q_len)


def forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window=None, softcap=None):
    """Causal varlen attention (under a sliding window, with soft-capped scores, where given); returns
    (out, lse) per the kernels contract."""
    check_inputs(q, k, v, cu_q, cu_k)
    scale = default_scale(q.shape[2]) if scale is None else scale
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=_accumulation_dtype(q.dtype), device=q.device)
    for q0, q_len, k0, k_len in _segments(cu_q, cu_k):
        _forward_rows(out, lse, q, k[k0:k0 + k_len], v[k0:k0 + k_len],
                      _segment_chunks(q0, q_len, k_len, q.shape[1], q.device), scale, window, softcap)
    return out, lse


def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=None, window=None, softcap=None):
    """Gradients (dq, dk, dv) of causal varlen attention, from the forward's out and lse."""
    check_inputs(q, k, v, cu_q, cu_k)
    scale = default_scale(q.shape[2]) if scale is None else scale
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q0, q_len, k0, k_len in _segments(cu_q, cu_k):
        dk[k0:k0 + k_len], dv[k0:k0 + k_len] = _backward_rows(
            dq, dout, q, k[k0:k0 + k_len], v[k0:k0 + k_len], out, lse,
            _segment_chunks(q0, q_len, k_len, q.shape[1], q.device), scale, window, softcap)
    return dq, dk, dv


# --- queries at given positions of one document (PositionKernel) ---

@dataclass(frozen=True, eq=False)
class Positions:
    """The reference's PositionKernel handle: the positions on the host (to size each chunk's keys) and on
    the device (its masks)."""

    host: np.ndarray
    device: torch.Tensor
    num_keys: int


def prepare_positions(positions, num_keys: int, device) -> Positions:
    host = check_positions(positions, num_keys)
    return Positions(host, torch.as_tensor(host, device=device), int(num_keys))


def _position_chunks(handle: Positions, n_heads: int):
    rows = max(1, min(MAX_CHUNK_ROWS, MAX_SCORE_ELEMENTS // max(1, n_heads * handle.num_keys)))
    for r0 in range(0, len(handle.host), rows):
        r1 = min(len(handle.host), r0 + rows)
        yield slice(r0, r1), int(handle.host[r0:r1].max()) + 1, handle.device[r0:r1]


def position_forward(q, k, v, handle: Positions, scale=None, window=None, softcap=None):
    check_position_inputs(q, k, v, len(handle.host), handle.num_keys)
    scale = default_scale(q.shape[2]) if scale is None else scale
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=_accumulation_dtype(q.dtype), device=q.device)
    _forward_rows(out, lse, q, k, v, _position_chunks(handle, q.shape[1]), scale, window, softcap)
    return out, lse


def position_backward(dout, q, k, v, out, lse, handle: Positions, scale=None, into=None, window=None, softcap=None):
    check_position_inputs(q, k, v, len(handle.host), handle.num_keys)
    scale = default_scale(q.shape[2]) if scale is None else scale
    dq = torch.zeros_like(q)
    dk, dv = _backward_rows(dq, dout, q, k, v, out, lse, _position_chunks(handle, q.shape[1]), scale, window, softcap)
    if into is None:
        return dq, dk, dv
    for target, grad in zip(into, (dq, dk, dv)):
        target.copy_(grad)
    return into


BACKEND = Backend("reference", forward, backward, splits_by_segment=True,
                  positions=PositionKernel(prepare_positions, position_forward, position_backward, takes_window=True,
                                           takes_softcap=True),
                  takes_window=True, takes_softcap=True)
