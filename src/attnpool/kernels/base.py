"""The contract every core-attention backend follows, and the checks they share.

A backend is a pair of plain functions over packed variable-length segments:

    forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=None) -> (out, lse)
    backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=None)
        -> (dq, dk, dv)
    (and, where ``Backend.backward_into``, a keyword ``into=(dq, dk, dv)`` to write them into;
    where ``Backend.takes_window`` / ``takes_softcap``, keywords ``window`` and ``softcap``)

q is (T_q, H_q, D), k and v are (T_k, H_kv, D) with H_q a multiple of H_kv
(query head h reads kv head h // (H_q // H_kv)). cu_q and cu_k are int32
segment boundaries of equal length S + 1, starting at 0. Segment i's queries
are the tail of its keys: query j (0-based) sees keys 0 .. k_len - q_len + j,
the causal mask aligned to the bottom right. Under a sliding window of w keys it sees only the
w keys ending there (k_len - q_len + j - w, k_len - q_len + j]; with a soft-cap c the scores
s = q.k * scale become c * tanh(s / c) before the softmax (Gemma 2). lse is (H_q, T_q), float32
(float64 from the reference backend for float64 inputs), natural log;
a row that sees no key has lse = -inf, out = 0 and zero gradients.

The pair is explicit (not only an autograd function) because the runtime calls
them inside its own autograd function and saves only what it needs.

A backend may also serve queries at given positions of one document against the document's keys
(``Backend.positions``, a PositionKernel): a server's non-adjacent shards of one document in one call
over its keys as they are, where the varlen contract needs each shard's prefix copied into its own
segment (or, for a few shards whose keys one shard's hold, a call per shard over the keys it reads,
which the runtime makes with any backend: runtime.dispatch.DocumentServing).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from attnpool.errors import ConfigError

ForwardFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
BackwardFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class PositionKernel:
    """Causal attention of one document's queries, given their positions in it, over the document's
    keys [0, num_keys): query row i sees keys 0 .. positions[i] (each position below num_keys).

        handle = prepare(positions, num_keys, device)   # increasing int positions (NumPy); once per layout
        forward(q, k, v, handle, scale=None) -> (out, lse)
        backward(dout, q, k, v, out, lse, handle, scale=None, into=None) -> (dq, dk, dv)
        supports(device, head_dim) -> bool              # where it runs; elsewhere the runtime copies

    q is (len(positions), H_q, D), k and v (num_keys, H_kv, D); out, lse and the gradients as in the
    varlen contract, ``into`` as ``Backend.backward_into``'s. ``handle`` is the backend's own (what its
    kernel reads besides the tensors), built once per layout and reused by every layer."""

    prepare: Callable[..., Any]
    forward: ForwardFn
    backward: BackwardFn
    supports: Callable[..., bool] = lambda device, head_dim: True
    takes_window: bool = False  # forward and backward take ``window`` (keys (position - w, position])
    takes_softcap: bool = False  # ... and ``softcap``
    # Whether the kernel compiles on its first call (per dtype, head_dim, GQA ratio; not per length): seconds that
    # would land in whichever step first serves a document in several shards, so the run compiles it before its
    # first step (compile_positions)
    compiles_on_first_call: bool = False


# The document compile_positions runs: keys [0, 2048) queried at [0, 512) and [1536, 2048), a head and a tail shard
# as a server of several shards of one document gets them (cad's). Several 128-row blocks of queries and of keys (FA4's compile cache keys on a call having
# a single block either way, so a smaller document would compile another kernel than a real call's).
COMPILE_KEYS = 2048
COMPILE_POSITIONS = np.r_[0:512, 1536:2048]


def compile_positions(kernel: PositionKernel, device, dtype: torch.dtype, n_q_heads: int, n_kv_heads: int,
                      head_dim: int) -> None:
    """Run ``kernel`` forward and backward once on a small document with the run's dtype, heads and head_dim: a
    kernel that compiles on its first call compiles there, milliseconds of work besides."""
    generator = torch.Generator().manual_seed(0)

    def random(rows: int, heads: int) -> torch.Tensor:
        return torch.randn(rows, heads, head_dim, generator=generator).to(device, dtype)

    handle = kernel.prepare(COMPILE_POSITIONS, COMPILE_KEYS, device)
    q, k, v = random(len(COMPILE_POSITIONS), n_q_heads), random(COMPILE_KEYS, n_kv_heads), random(COMPILE_KEYS, n_kv_heads)
    out, lse = kernel.forward(q, k, v, handle)
    # into=: the runtime's backward writes into rows of its gradient buffers (core_attention._documents_backward)
    kernel.backward(torch.ones_like(out), q, k, v, out, lse, handle,
                    into=(torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)))


@dataclass(frozen=True)
class Backend:
    """A named core-attention backend: its forward and backward functions."""

    name: str
    forward: ForwardFn
    backward: BackwardFn
    # Whether backward may run on any consecutive range of the segments (q, k, v, out, lse sliced to
    # their rows, cu_q/cu_k rebased) with the same result: true where each segment is computed on its
    # own from the arguments alone. The runtime then splits a large backward to bound its workspace; a
    # backend bound to one call's segments (a sparse pattern per segment) must leave it False.
    splits_by_segment: bool = False
    # Whether backward takes ``into=(dq, dk, dv)``: tensors (row ranges of a larger call's gradients) it
    # writes the gradients into and returns, so a split backward needs neither a zeroed buffer nor a copy
    # of each part's gradients (for the CA-task layout's expanded keys, gigabytes a step).
    backward_into: bool = False
    # Queries at given positions of one document against its keys, with no copies (None: not offered;
    # the runtime then copies each segment's prefix where a document has more segments than it serves as a
    # causal call each).
    positions: PositionKernel | None = None
    # Whether forward and backward take ``window`` (a sliding window's keys) and ``softcap``: see the contract.
    takes_window: bool = False
    takes_softcap: bool = False
    # The window and soft-cap this backend's functions are bound to (for_kind): (None, None) for plain causal.
    kind: tuple = (None, None)

    def for_kind(self, window: int | None = None, softcap: float | None = None) -> "Backend":
        """This backend computing attention under a sliding window of ``window`` keys and/or with scores
        soft-capped at ``softcap`` (None: neither): its functions bound to them, so that callers call it as
        any backend. A ConfigError names what the backend cannot compute. The position kernel goes with it
        where it takes them too, else is left out (the runtime then copies each segment's keys where a
        document would take a position call)."""
        if window is None and softcap is None:
            return self
        bound = self.__dict__.setdefault("_bound", {})  # (window, softcap) -> bound backend, made once, not per call
        if (window, softcap) not in bound:
            bound[window, softcap] = self._bind(window, softcap)
        return bound[window, softcap]

    def _bind(self, window: int | None, softcap: float | None) -> "Backend":
        if window is not None and not self.takes_window:
            raise ConfigError("window", window, f"the {self.name} backend does not compute sliding windows; "
                                                "use flash, fa4 or reference")
        if softcap is not None and not self.takes_softcap:
            raise ConfigError("softcap", softcap, f"the {self.name} backend does not soft-cap attention scores; "
                                                  "use fa4 or reference")
        bound = {"window": window, "softcap": softcap}
        positions = self.positions
        if positions is not None:
            fits = (window is None or positions.takes_window) and (softcap is None or positions.takes_softcap)
            positions = dataclasses.replace(positions, forward=functools.partial(positions.forward, **bound),
                                            backward=functools.partial(positions.backward, **bound)) if fits else None
        return dataclasses.replace(self, forward=functools.partial(self.forward, **bound),
                                   backward=functools.partial(self.backward, **bound), positions=positions,
                                   kind=(window, softcap))

    def serves_positions(self, device, head_dim: int) -> bool:
        """Whether this backend serves a server's shards of one document at their queries' positions on ``device``
        at ``head_dim``, without prefix copies however many shards: its PositionKernel supports them there, and its
        varlen runs split by segment (runtime.core_attention.serves_documents asks it where a document has more
        segments than causal calls serve; RunSpec.prefix_copies holds its answer for the memory model)."""
        return self.positions is not None and self.splits_by_segment and self.positions.supports(device, head_dim)


def default_scale(head_dim: int) -> float:
    """Softmax scale when none is given: 1 / sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x, or a contiguous copy where head_dim is not its unit-stride dimension: the GPU kernels
    read any other strides as given."""
    return x if x.stride(-1) == 1 else x.contiguous()


# The dtypes the FlashAttention kernels (flash, fa4) take.
HALF_DTYPES = (torch.float16, torch.bfloat16)


def check_half_inputs(q, k, v, cu_q, cu_k, backend: str) -> None:
    """check_inputs, and a dtype the FlashAttention kernels take."""
    check_inputs(q, k, v, cu_q, cu_k)
    if q.dtype not in HALF_DTYPES:
        raise ConfigError("dtype", q.dtype, f"the {backend} backend takes float16 or bfloat16; "
                          "cast the inputs or use backend='reference'")


def no_key_forward(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a call with no query or no key: every row sees no key."""
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    return torch.zeros_like(q), lse


def check_position_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_positions: int,
                          num_keys: int) -> None:
    """check_qkv, and for a PositionKernel call one query row per position and the handle's keys."""
    check_qkv(q, k, v)
    if q.shape[0] != num_positions:
        raise ConfigError("q.shape[0]", q.shape[0], f"expected one query row per position ({num_positions})")
    if k.shape[0] != num_keys:
        raise ConfigError("k.shape[0]", k.shape[0], f"expected the document's {num_keys} keys the positions were "
                          "prepared for")


def check_positions(positions, num_keys: int):
    """``positions`` as an int64 NumPy array, refused unless they increase and each is in [0, num_keys)."""
    positions = np.asarray(positions, dtype=np.int64)
    if positions.ndim != 1:
        raise ConfigError("positions.shape", positions.shape, "expected one position per query row")
    if len(positions) > 1 and not (np.diff(positions) > 0).all():
        raise ConfigError("positions", "not increasing", "query rows must come in increasing document positions")
    if len(positions) and (positions.min() < 0 or positions.max() >= num_keys):
        raise ConfigError("positions", (int(positions.min()), int(positions.max())),
                          f"each query's position must lie in [0, num_keys={num_keys})")
    return positions


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cu_q: torch.Tensor, cu_k: torch.Tensor) -> None:
    """Refuse inputs whose shapes break the contract.

    Only shapes and dtypes are checked: looking at the values of cu_q/cu_k
    would synchronise the device on every call.
    """
    check_qkv(q, k, v)
    for name, cu in (("cu_q", cu_q), ("cu_k", cu_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            raise ConfigError(name, (cu.dtype, tuple(cu.shape)),
                              "expected a 1-D int32 tensor of segment boundaries")
    if cu_q.numel() != cu_k.numel():
        raise ConfigError("cu_k", (cu_q.numel(), cu_k.numel()),
                          "cu_q and cu_k must describe the same number of segments")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Refuse q, k, v whose shapes or dtypes break the contract (check_inputs without segments)."""
    if q.dim() != 3:
        raise ConfigError("q.shape", tuple(q.shape), "expected (tokens, heads, head_dim)")
    if k.dim() != 3 or k.shape != v.shape:
        raise ConfigError("k.shape", (tuple(k.shape), tuple(v.shape)),
                          "k and v must both be (tokens, kv_heads, head_dim)")
    if k.shape[2] != q.shape[2]:
        raise ConfigError("head_dim", (q.shape[2], k.shape[2]), "q and k must share head_dim")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ConfigError("heads", (q.shape[1], k.shape[1]),
                          "query heads must be a positive multiple of kv heads")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ConfigError("dtype", (q.dtype, k.dtype, v.dtype),
                          "q, k and v must share one floating-point dtype")
