"""FA4 backend: FlashAttention-4 (``flash_attn.cute``, CuTe DSL kernels), Hopper and newer, fp16/bf16.

Installed by the ``hopper`` extra (``pip install 'attnpool[hopper]'``). Read against flash-attn-4
4.0.0b36, the version that extra pins:

- Forward is the public ``flash_attn.cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q=,
  cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=, softmax_scale=, causal=True, return_lse=True)``,
  which returns ``(out, lse)``: lse of shape (H_q, T_q), float32, natural log, the contract's
  layout as it is. Its causal mask is aligned bottom-right (a row's last key is
  ``row + seqlen_k - seqlen_q``), K/V heads may be fewer than Q heads (GQA, no repeated K/V),
  and a row that sees no key gets out = 0 and lse = -inf, the contract's values (FA2 writes
  +inf there, which the flash backend flips; nothing to flip here).
- Backward is ``flash_attn.cute.interface._flash_attn_bwd(q, k, v, out, dout, lse,
  softmax_scale=, causal=True, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=)``
  -> ``(dq, dk, dv)``: the function the package's own autograd calls from the saved out and lse;
  there is no public one. Its preprocess reads lse = -inf rows as rows without keys.

The kernels are compiled on their first call per configuration (dtype, head_dim, GQA ratio,
tile choice; not the sequence lengths): seconds each, so time only after a warm-up.
Importing ``flash_attn.cute`` loads the CUTLASS DSL (a few seconds), so it happens on first use.
"""

from __future__ import annotations

import functools
import importlib

import torch

from attnpool.kernels.base import Backend, check_half_inputs, last_dim_contiguous, no_key_forward

# Hopper (sm90) and newer: FA4's backward has no sm8x path, and its speed is why it is here.
MIN_CAPABILITY = (9, 0)
INSTALL_HINT = "pip install 'attnpool[hopper]'"


@functools.cache
def _interface():
    """(flash_attn.cute.interface, None), or (None, why it does not import); tried once per process."""
    try:
        return importlib.import_module("flash_attn.cute.interface"), None
    except Exception as error:  # ImportError, or the CUTLASS DSL failing to load its libraries
        return None, f"{type(error).__name__}: {error}"


def problem(device) -> str | None:
    """Why the fa4 backend cannot run on `device`, or None where it can.

    The device is asked first: on a CPU or a pre-Hopper GPU nothing is imported."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"FlashAttention-4 needs a CUDA device, got {device}"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"FlashAttention-4 needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Hopper, sm90) "
                f"or newer; {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}")
    _, import_problem = _interface()
    if import_problem is not None:
        return f"flash_attn.cute is not importable ({import_problem}); {INSTALL_HINT}"
    return None


def _loaded():
    interface, import_problem = _interface()
    if interface is None:
        raise ImportError(f"flash_attn.cute is not importable ({import_problem}); {INSTALL_HINT}")
    return interface


def forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=None):
    """Causal varlen attention; returns (out, lse) per the kernels contract."""
    check_half_inputs(q, k, v, cu_q, cu_k, "fa4")
    if q.shape[0] == 0 or k.shape[0] == 0:
        return no_key_forward(q)
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    interface = _loaded()
    out, lse = interface.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q), max_seqlen_k=int(max_k),
        softmax_scale=scale, causal=True, return_lse=True)
    return out, lse


def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=None, into=None):
    """Gradients (dq, dk, dv) from the forward's out and lse; written into ``into`` (three contiguous
    tensors shaped and typed as q, k, v) where given."""
    check_half_inputs(q, k, v, cu_q, cu_k, "fa4")
    if into is not None and any(t.shape != x.shape or t.dtype != x.dtype or not t.is_contiguous()
                                for t, x in zip(into, (q, k, v))):
        raise ValueError("into: three contiguous tensors of q's, k's and v's shapes and dtype")
    if q.shape[0] == 0 or k.shape[0] == 0:
        return tuple(t.zero_() for t in into) if into is not None else (
            torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    q, k, v, out, dout = (last_dim_contiguous(x) for x in (q, k, v, out, dout.to(q.dtype)))
    interface = _loaded()
    dq, dk, dv = into if into is not None else (None, None, None)
    return tuple(interface._flash_attn_bwd(
        q, k, v, out, dout, lse.float().contiguous(), softmax_scale=scale, causal=True,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q), max_seqlen_k=int(max_k), dq=dq, dk=dk, dv=dv)[:3])


BACKEND = Backend("fa4", forward, backward, splits_by_segment=True, backward_into=True)
