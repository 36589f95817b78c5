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
  there is no public one. Its preprocess reads lse = -inf rows as rows without keys. Under torch's
  deterministic algorithms (the run's ``deterministic``) it passes ``deterministic=True``: dQ (and, with
  GQA, dK and dV) added in a fixed order, behind semaphores.

- A sliding window of w keys is ``window_size=(w - 1, 0)`` (forward) and ``window_size_left=w - 1,
  window_size_right=0`` (backward), aligned bottom-right as the causal mask is; a soft-cap c is
  ``softcap=c`` in both (FA4 turns it into its score_mod and that mod's backward). The position
  kernel below takes neither (its block tables assume the whole prefix): with a window or a soft-cap
  the runtime copies each segment's keys where a document would take a position call (Backend.for_kind
  leaves it out).

- Queries at given positions of one document (``Backend.positions``) run the non-varlen
  ``_flash_attn_fwd`` / ``_flash_attn_bwd`` with one batch entry, ``causal=False``, a ``mask_mod``
  that reads each query's position from ``aux_tensors`` (key n visible to query row m where
  n <= positions[m]), and ``block_sparse_tensors`` built from the (increasing) positions as ranges,
  on the device, once per layout: per 128-row query block, the 128-key blocks every row sees in full
  (no mask evaluated) and those it sees in part; the rest are skipped, so the work is the visible
  pairs' as in a causal call. The backward takes the same blocks transposed (per key block, its query
  blocks). Varlen block sparsity has no backward in this version, hence one call per document. 128 is
  the block both directions use on sm90 at head_dim <= 128 (forward tile 128 x 128; backward 64 x 128
  with two query tiles per block), the only place it runs (supports_positions).

The kernels are compiled on their first call per configuration (dtype, head_dim, GQA ratio,
tile choice; not the sequence lengths): seconds each, so time only after a warm-up.
Importing ``flash_attn.cute`` loads the CUTLASS DSL (a few seconds), so it happens on first use.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import numpy as np
import torch

from attnpool.kernels.base import (HALF_DTYPES, Backend, PositionKernel, check_half_inputs, check_position_inputs,
                                   check_positions, last_dim_contiguous, no_key_forward)
from attnpool.errors import ConfigError

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


def deterministic_problem(device) -> str | None:
    """Why FA4's backward cannot run deterministically on ``device`` (a CUDA GPU it runs on), or None: 4.0.0b36 has
    no deterministic backward on sm120 (it asserts so); sm90 and sm100 have one."""
    capability = torch.cuda.get_device_capability(torch.device(device))
    if capability[0] == 12:
        return (f"FlashAttention-4 has no deterministic backward on compute capability {capability[0]}."
                f"{capability[1]} ({torch.cuda.get_device_name(device)})")
    return None


def _loaded():
    interface, import_problem = _interface()
    if interface is None:
        raise ImportError(f"flash_attn.cute is not importable ({import_problem}); {INSTALL_HINT}")
    return interface


def forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window=None, softcap=None):
    """Causal varlen attention (under a sliding window, soft-capped, where given); returns (out, lse) per the
    kernels contract."""
    check_half_inputs(q, k, v, cu_q, cu_k, "fa4")
    if q.shape[0] == 0 or k.shape[0] == 0:
        return no_key_forward(q)
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    interface = _loaded()
    out, lse = interface.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q), max_seqlen_k=int(max_k),
        softmax_scale=scale, causal=True, return_lse=True,
        window_size=(None, None) if window is None else (int(window) - 1, 0), softcap=float(softcap or 0.0))
    return out, lse


def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=None, into=None, window=None, softcap=None):
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
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q), max_seqlen_k=int(max_k), dq=dq, dk=dk, dv=dv,
        softcap=float(softcap or 0.0), window_size_left=None if window is None else int(window) - 1,
        window_size_right=None if window is None else 0,
        deterministic=torch.are_deterministic_algorithms_enabled())[:3])


# --- queries at given positions of one document ---

# Query rows and keys per block of the block-sparse tables (see the module's docstring).
POSITION_BLOCK = 128


def position_block_ranges(positions: np.ndarray, num_keys: int, block: int = POSITION_BLOCK):
    """The blocks each query block sees, for increasing positions, as ranges: query block m sees key blocks
    [0, full_end[m]) in full (complete blocks whose last key is at most its first position) and
    [full_end[m], seen_end[m]) in part; key block n is seen in part by query blocks
    [partial_start[n], full_start[n]) and in full by [full_start[n], query blocks) (the positions
    increase, so both per-block bounds do, and each set is a range). Returns (full_end, seen_end,
    partial_start, full_start)."""
    m_blocks, n_blocks = -(-len(positions) // block), -(-num_keys // block)
    first = positions[::block]
    last = positions[np.minimum(np.arange(1, m_blocks + 1) * block, len(positions)) - 1]
    full_end = np.minimum((first + 1) // block, num_keys // block)
    seen_end = last // block + 1
    keys = np.arange(n_blocks)
    return (full_end, seen_end, np.searchsorted(seen_end, keys, side="right"),
            np.searchsorted(full_end, keys, side="right"))


def range_table(start: np.ndarray, end: np.ndarray, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4's (count, index) pair for rows that each list the columns [start, end), ascending: counts
    (1, 1, rows) and indices (1, 1, rows, width), built on ``device`` (entries past a row's count, unread,
    are clamped to a valid column)."""
    start_t = torch.as_tensor(np.asarray(start, dtype=np.int64), device=device).to(torch.int32)
    count = torch.as_tensor(np.asarray(end, dtype=np.int64) - start, device=device).to(torch.int32)
    columns = torch.arange(width, dtype=torch.int32, device=device)
    index = (start_t[:, None] + columns[None, :]).clamp_(max=max(width - 1, 0))
    return count[None, None].contiguous(), index[None, None].contiguous()


def supports_positions(device, head_dim: int) -> bool:
    """Where the position kernel runs as checked (bench/gpu_fa4.py, one H100 and one H200): sm90 with
    head_dim <= 128. Elsewhere FA4 picks tiles the 128 x 128 tables do not fit (sm100's forward takes
    256-row query blocks; sm90's backward at head_dim 192 and forward at 256 other key tiles), so the
    runtime copies prefixes there. ``device`` None: not known, False. Nor under torch's deterministic algorithms
    (``deterministic``): FA4's deterministic block-sparse backward needs write orders the tables do not carry."""
    if device is None or torch.device(device).type != "cuda" or torch.are_deterministic_algorithms_enabled():
        return False
    return _capability(torch.device(device))[0] == 9 and head_dim <= 128


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability, asked once (supports_positions is asked at every layer's call)."""
    return torch.cuda.get_device_capability(device)


@dataclass(frozen=True, eq=False)
class PositionTables:
    """fa4's PositionKernel handle: the positions (the mask's aux tensor, padded to whole query blocks with
    the last position, as the kernel reads a block's padded rows too) and the block-sparse tables, forward
    (per query block) and backward (per key block), on the device."""

    positions: torch.Tensor  # int32
    num_queries: int
    num_keys: int
    forward_blocks: object  # flash_attn.cute.block_sparsity.BlockSparseTensorsTorch
    backward_blocks: object


def prepare_positions(positions, num_keys: int, device) -> PositionTables:
    positions = check_positions(positions, num_keys)
    if num_keys >= 2**31:
        raise ConfigError("num_keys", num_keys, "more keys than int32 positions hold")
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    m_blocks, n_blocks = -(-len(positions) // POSITION_BLOCK), -(-num_keys // POSITION_BLOCK)
    full_end, seen_end, partial_start, full_start = position_block_ranges(positions, num_keys)

    def tables(partial, full):
        return BlockSparseTensorsTorch(*partial, *full, block_size=(POSITION_BLOCK, POSITION_BLOCK))

    zeros_m, ends_n = np.zeros(m_blocks, dtype=np.int64), np.full(n_blocks, m_blocks)
    forward = tables(range_table(full_end, seen_end, n_blocks, device), range_table(zeros_m, full_end, n_blocks, device))
    backward = tables(range_table(partial_start, full_start, m_blocks, device),
                      range_table(full_start, ends_n, m_blocks, device))
    padded = np.full(m_blocks * POSITION_BLOCK, positions[-1] if len(positions) else 0, dtype=np.int32)
    padded[:len(positions)] = positions
    return PositionTables(torch.as_tensor(padded, device=device), len(positions), int(num_keys), forward, backward)


@functools.cache
def _position_mask():
    """The mask_mod: key ``kv_idx`` is visible to query row ``q_idx`` where kv_idx <= positions[q_idx]
    (positions: the first aux tensor). Made on first use: it is CuTe DSL, imported with FA4."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def position_causal(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        position = utils.scalar_to_ssa(aux_tensors[0][q_idx[0]], cutlass.Int32)
        return kv_idx <= position

    return position_causal


def _check_position_call(q, k, v, handle: PositionTables):
    check_position_inputs(q, k, v, handle.num_queries, handle.num_keys)
    if q.dtype not in HALF_DTYPES:
        raise ConfigError("dtype", q.dtype, "the fa4 backend takes float16 or bfloat16")


def position_forward(q, k, v, handle: PositionTables, scale=None):
    _check_position_call(q, k, v, handle)
    if q.shape[0] == 0:
        return no_key_forward(q)
    q, k, v = (last_dim_contiguous(x)[None] for x in (q, k, v))
    out, lse = _loaded()._flash_attn_fwd(
        q, k, v, softmax_scale=scale, causal=False, mask_mod=_position_mask(), aux_tensors=[handle.positions],
        block_sparse_tensors=handle.forward_blocks, return_lse=True)[:2]
    return out[0], lse[0]


def position_backward(dout, q, k, v, out, lse, handle: PositionTables, scale=None, into=None):
    _check_position_call(q, k, v, handle)
    if q.shape[0] == 0:
        return tuple(t.zero_() for t in into) if into is not None else (
            torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    q, k, v, out, dout = (last_dim_contiguous(x)[None] for x in (q, k, v, out, dout.to(q.dtype)))
    dq, dk, dv = (t[None] for t in into) if into is not None else (None, None, None)
    grads = _loaded()._flash_attn_bwd(
        q, k, v, out, dout, lse.float().contiguous()[None], softmax_scale=scale, causal=False,
        mask_mod=_position_mask(), aux_tensors=[handle.positions], block_sparse_tensors=handle.backward_blocks,
        dq=dq, dk=dk, dv=dv)[:3]
    return tuple(g[0] for g in grads)


BACKEND = Backend("fa4", forward, backward, splits_by_segment=True, backward_into=True,
                  positions=PositionKernel(prepare_positions, position_forward, position_backward, supports_positions,
                                           compiles_on_first_call=True),
                  takes_window=True, takes_softcap=True)
