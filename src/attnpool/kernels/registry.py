"""The backends by name: which one runs where, and the differentiable call over any of them."""

from __future__ import annotations

import torch

from attnpool.errors import ConfigError
from attnpool.kernels import fa4, flash, reference
from attnpool.kernels.base import HALF_DTYPES, Backend
from attnpool.kernels.names import BACKENDS

_MODULES = {"reference": reference, "flash": flash, "fa4": fa4}


def backend_problem(name: str, device) -> str | None:
    """Why backend `name` cannot run on `device`, or None where it can (the reference runs anywhere)."""
    if name == "reference":
        return None
    return _MODULES[name].problem(device)


def auto_backend_name(device, dtype: torch.dtype | None = None) -> str:
    """What "auto" means: on CUDA for fp16/bf16 (or any dtype, with none given), fa4 where it runs
    (importable, sm90+), else flash; the reference elsewhere (the CPU, float32 on CUDA)."""
    device = torch.device(device)
    if device.type != "cuda" or (dtype is not None and dtype not in HALF_DTYPES):
        return "reference"
    return "fa4" if fa4.problem(device) is None else "flash"


def resolve_backend_name(name: str | None, device, dtype: torch.dtype | None = None, *, field: str = "backend") -> str:
    """The backend `name` ("auto" or None: auto_backend_name) stands for on `device`; ConfigError naming
    `field` where it is unknown or cannot run here."""
    if name is None or name == "auto":
        return auto_backend_name(device, dtype)
    if name not in BACKENDS:
        raise ConfigError(field, name, f"unknown attention backend; choose auto or one of {', '.join(BACKENDS)}")
    why = backend_problem(name, device)
    if why is not None:
        raise ConfigError(field, name, f"the {name} backend cannot run here: {why}")
    return name


def serves_positions(name: str | None, device, head_dim: int) -> bool:
    """Whether backend ``name`` serves queries at given positions of a document (Backend.positions) on
    ``device`` at ``head_dim``, so that core attention copies no prefixes there however many segments a document
    has (Backend.serves_positions); False for flash (which copies only for a document of more segments than causal
    calls serve), for "auto" or None (not resolved), and for fa4 where the device is not known (None)."""
    return name in _MODULES and _MODULES[name].BACKEND.serves_positions(device, head_dim)


def backend_named(name: str) -> Backend:
    """The backend object called ``name`` (one of BACKENDS), unchecked against any device: what it can compute
    (Backend.for_kind) is known without one."""
    return _MODULES[name].BACKEND


def get_backend(name: str | None, device, dtype: torch.dtype | None = None) -> Backend:
    """The backend called `name`, checked to run on `device`; None or "auto" picks as auto_backend_name."""
    return _MODULES[resolve_backend_name(name, device, dtype)].BACKEND


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
    `backend` is a name from BACKENDS, a Backend, or None (or "auto") to follow q's device and dtype.
    """
    if not isinstance(backend, Backend):
        backend = get_backend(backend, q.device, q.dtype)
    return _Attention.apply(q, k, v, cu_q, cu_k, max_q, max_k, backend, scale)
