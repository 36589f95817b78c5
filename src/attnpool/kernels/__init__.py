"""Core attention backends behind one contract (see kernels.base).

    out, lse = attention(q, k, v, cu_q, cu_k, max_q, max_k)   # differentiable
    backend = get_backend("flash", device)                     # explicit pair
    out, lse = backend.forward(q, k, v, cu_q, cu_k, max_q, max_k)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k)
"""

from __future__ import annotations

import torch

from attnpool.errors import ConfigError
from attnpool.kernels import flash, reference
from attnpool.kernels.base import Backend

BACKENDS = ("reference", "flash")

__all__ = ["BACKENDS", "Backend", "attention", "get_backend"]


def get_backend(name: str | None, device) -> Backend:
    """The backend called `name`; None picks flash on CUDA and reference elsewhere."""
    device = torch.device(device)
    if name is None:
        name = "flash" if device.type == "cuda" else "reference"
    if name == "reference":
        return reference.BACKEND
    if name == "flash":
        flash.check_available(device)
        return flash.BACKEND
    raise ConfigError("backend", name, f"unknown attention backend; choose one of {', '.join(BACKENDS)}")


class _Attention(torch.autograd.Function):
    """Autograd over a backend's explicit forward/backward pair; lse gets no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, backend, scale):
        out, lse = backend.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.mark_non_differentiable(lse)
        ctx.args = (max_q, max_k, backend, scale)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, backend, scale = ctx.args
        dq, dk, dv = backend.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=scale)
        return dq, dk, dv, None, None, None, None, None, None


def attention(q, k, v, cu_q, cu_k, max_q, max_k, *, backend: str | Backend | None = None,
              scale: float | None = None):
    """Causal varlen attention (bottom-right per segment), differentiable in q, k, v.

    Returns (out, lse); lse is (H_q, T_q) float32 and not differentiable.
    `backend` is a name from BACKENDS, a Backend, or None to follow q's device.
    """
    if not isinstance(backend, Backend):
        backend = get_backend(backend, q.device)
    return _Attention.apply(q, k, v, cu_q, cu_k, max_q, max_k, backend, scale)
