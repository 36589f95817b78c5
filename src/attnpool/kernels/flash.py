"""Flash backend: PyTorch's FlashAttention-2 varlen kernel (CUDA, fp16/bf16).

Forward calls the public ``torch.nn.attention.varlen.varlen_attn``. Its keyword
arguments moved between releases, so one shim (``_varlen``) reads the signature
once: 2.10 has ``is_causal``; 2.11 has ``window_size`` ((-1, 0) is causal,
aligned bottom-right; it must be a tuple, 2.11 compares with ``==``); 2.12+ add
``enable_gqa``, required when H_q != H_kv. Without ``enable_gqa`` (2.11) grouped
kv heads go straight to the FA2 kernel, which supports them natively.

Backward calls the op that varlen_attn's own autograd registers,
``torch.ops.torch_attn._varlen_attn_backward`` (a custom op wrapping
``aten._flash_attention_backward``), with the argument list it has in 2.11 to
2.13: (grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k,
is_causal, rng_state, scale, window_size). A later main-branch snapshot
appends a defaulted ``backend`` argument, which we leave at its default. Where that op is
missing or its arguments differ, the backward recomputes the forward under
autograd and differentiates it: correct, but it pays one more forward.

A sliding window of w keys is FA2's ``window_size`` (w - 1, 0), forward and backward (2.11+; 2.10's
``is_causal`` has none, and a window is refused there). FA2 in torch has no soft-cap: the backend
refuses it (Backend.for_kind), and fa4 or reference compute it.

FA2 marks rows that see no key with lse = +inf; the contract wants -inf, so
forward flips +inf to -inf. Backward flips it back, so the kernel reads the
value it wrote itself (on 2.11 it gives the same gradients with -inf, checked
on an H200, but nothing promises that).
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import torch

from attnpool.errors import ConfigError
from attnpool.kernels.base import Backend, check_half_inputs, last_dim_contiguous, no_key_forward

# The leading arguments of torch_attn::_varlen_attn_backward that we pass, in order.
_BACKWARD_ARGUMENTS = (
    "grad_out", "query", "key", "value", "out", "lse", "cu_seq_q", "cu_seq_k",
    "max_q", "max_k", "is_causal", "rng_state", "scale", "window_size",
)
_CAUSAL_WINDOW = (-1, 0)


class _Varlen(NamedTuple):
    """varlen_attn and the keyword arguments this torch version wants."""

    function: object
    fixed_kwargs: dict
    has_enable_gqa: bool
    has_scale: bool
    has_window: bool


@functools.cache
def _varlen() -> _Varlen:
    """The one shim over varlen_attn's signature, read once per process."""
    try:
        from torch.nn.attention import varlen
    except ImportError as error:  # torch < 2.10
        raise ConfigError("backend", "flash",
                          f"torch {torch.__version__} has no torch.nn.attention.varlen") from error
    params = inspect.signature(varlen.varlen_attn).parameters
    fixed = {"return_aux": varlen.AuxRequest(lse=True)}
    if "window_size" in params:
        fixed["window_size"] = _CAUSAL_WINDOW
    else:
        fixed["is_causal"] = True
    return _Varlen(varlen.varlen_attn, fixed, "enable_gqa" in params, "scale" in params, "window_size" in params)


def _window_size(window: int | None) -> tuple[int, int]:
    """FA2's (left, right) window: causal, or the ``window`` keys ending at each query."""
    return _CAUSAL_WINDOW if window is None else (int(window) - 1, 0)


@functools.cache
def _backward_op():
    """torch_attn::_varlen_attn_backward if its arguments are the ones we pass, else None."""
    _varlen()  # importing torch.nn.attention.varlen registers the op
    try:
        op = torch.ops.torch_attn._varlen_attn_backward.default
    except (AttributeError, RuntimeError):
        return None
    arguments = op._schema.arguments
    names = tuple(a.name for a in arguments[:len(_BACKWARD_ARGUMENTS)])
    extra_have_defaults = all(a.has_default_value() for a in arguments[len(_BACKWARD_ARGUMENTS):])
    return op if names == _BACKWARD_ARGUMENTS and extra_have_defaults else None


def backward_path() -> str:
    """Which backward this torch uses: 'direct op' or 'recompute'."""
    return "direct op" if _backward_op() is not None else "recompute"


def problem(device) -> str | None:
    """Why the flash backend cannot run on `device`, or None where it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"needs a CUDA device, got {device}"
    try:
        _varlen()
    except ConfigError as error:
        return error.problem
    return None


def _check_flash_inputs(q, k, v, cu_q, cu_k, scale, window=None) -> None:
    check_half_inputs(q, k, v, cu_q, cu_k, "flash")
    if not q.is_cuda:
        raise ConfigError("backend", "flash", f"needs CUDA tensors, got {q.device}")
    if scale is not None and not _varlen().has_scale:
        raise ConfigError("scale", scale, f"varlen_attn of torch {torch.__version__} has no scale")
    if window is not None and not _varlen().has_window:
        raise ConfigError("window", window, f"varlen_attn of torch {torch.__version__} has no window_size")


def _run_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None):
    """varlen_attn's (out, lse) with FA2's +inf lse left as it is."""
    shim = _varlen()
    kwargs = dict(shim.fixed_kwargs)
    if window is not None:
        kwargs["window_size"] = _window_size(window)
    if scale is not None:
        kwargs["scale"] = scale
    if shim.has_enable_gqa and q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    if cu_k is cu_q:
        # Some torch versions may pick cuDNN when both are the same tensor; our
        # backward is FA2's, so make sure the forward is FA2's too.
        cu_k = cu_q.clone()
    return shim.function(q, k, v, cu_q, cu_k, int(max_q), int(max_k), **kwargs)


def forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window=None, softcap=None):
    """Causal varlen attention (under a sliding window where given); returns (out, lse) per the kernels
    contract. ``softcap`` is refused (Backend.for_kind refuses it before any call)."""
    _check_flash_inputs(q, k, v, cu_q, cu_k, scale, window)
    if softcap is not None:
        raise ConfigError("softcap", softcap, "the flash backend does not soft-cap attention scores")
    if q.shape[0] == 0 or k.shape[0] == 0:
        return no_key_forward(q)
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    out, lse = _run_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, window)
    return out, lse.masked_fill(lse == float("inf"), float("-inf"))


def _recompute_backward(dout, q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None):
    """Fallback: differentiate a fresh forward through varlen_attn's own autograd."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, _ = _run_varlen(*leaves, cu_q, cu_k, max_q, max_k, scale, window)
        return torch.autograd.grad(out, leaves, dout)


def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=None, window=None, softcap=None):
    """Gradients (dq, dk, dv) from the forward's out and lse."""
    _check_flash_inputs(q, k, v, cu_q, cu_k, scale, window)
    if softcap is not None:
        raise ConfigError("softcap", softcap, "the flash backend does not soft-cap attention scores")
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    q, k, v, out, dout = (last_dim_contiguous(x) for x in (q, k, v, out, dout.to(q.dtype)))
    op = _backward_op()
    if op is None:
        return tuple(_recompute_backward(dout, q, k, v, cu_q, cu_k, max_q, max_k, scale, window))
    kernel_lse = lse.float().masked_fill(lse == float("-inf"), float("inf")).contiguous()
    # Dropout is off, so the kernel never reads the rng state; varlen_attn passes zeros too.
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    dq, dk, dv = op(dout, q, k, v, out, kernel_lse, cu_q, cu_k, int(max_q), int(max_k),
                    True, rng_state, scale, list(_window_size(window)))
    return dq, dk, dv


BACKEND = Backend("flash", forward, backward, splits_by_segment=True, takes_window=True)
