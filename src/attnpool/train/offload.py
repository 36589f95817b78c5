"""Activation offload: the tensors autograd saves for backward live in host memory between the passes.

    offload = ActivationOffload(device)
    with offload:
        loss = model(...)        # saved activations are copied to pinned host memory as forward goes
    loss.backward()              # and copied back, a little ahead of the layer that needs them

Built on autograd's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``). Under activation
checkpointing the tensors a checkpoint keeps (its inputs) pass through these hooks too, while what a
checkpointed region saves internally goes to the checkpoint's own hooks and is recomputed, so offload
composes with every ``activation_checkpointing`` mode: under ``full`` it moves each layer's input, under
``keep_attention`` also core attention's saved state, under ``none`` everything.

On CUDA, device-to-host copies run on a side stream as soon as a tensor is saved, overlapped with the
forward's compute; the GPU buffer is handed back to the allocator at once and reused once its copy is
done (``record_stream``). Forward stops running ahead of the copies by more than ``max_pending_bytes``
(the GPU would otherwise keep every not-yet-copied buffer). In backward, unpacking a tensor starts the
host-to-device copies of the tensors saved before it, up to ``prefetch_bytes`` ahead, in the reverse order
backward needs them.

Left on the GPU: parameters (FSDP gathers them again for backward), tensors under ``min_bytes``, tensors
on other devices, and non-contiguous ones (their strides would not survive the round trip). A region
saved twice (the same layer input kept by two checkpoints as views of one tensor) is copied once. A
DTensor (tensor parallelism's sequence-parallel activations) moves its local shard and is rebuilt around
it in backward.

A region's host copy is held in pieces whose sizes are powers of two: PyTorch's pinned-memory allocator
rounds every block up to a power of two and keeps freed blocks cached, so a 2.3 GiB layer input held
whole would take a 4 GiB block (twice the host memory the memory model counts). The pieces waste less
than ``PIECE_FLOOR_BYTES`` per region. A cached block serves only requests of its own power of two, so the
pieces are at most ``PIECE_CEILING_BYTES`` each: regions whose sizes change from step to step (``wlb``'s ranks
hold different token counts every step) reuse the same blocks, and the cache holds at most about a ceiling and a
floor per region beyond a step's own need (a block in each bin below the ceiling, two in the floor's). With whole powers of two a 2.1 GiB region (2 GiB + ...) and a 1.9 GiB one (1 GiB +
512 MiB + ...) in the next step would hold both, about twice the host memory: what killed `wlb` at 256K tokens
per rank with activation offload on a 251 GiB host of two H200 (bench/results/2026-11-29-h200x2-full-depth-baselines.md).

On a CPU run the "host copy" is a copy in the same memory (the same pieces, unpinned): the same
function, nothing saved; training turns offload on there only so that its path runs in tests.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
import weakref

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

DEFAULT_MIN_BYTES = 1 << 20
PIECE_FLOOR_BYTES = 16 << 20
PIECE_CEILING_BYTES = 128 << 20  # a 2 GiB layer input: 16 copies each way, a few microseconds each


def piece_sizes(numel: int, element_size: int, floor_bytes: int = PIECE_FLOOR_BYTES,
                ceiling_bytes: int = PIECE_CEILING_BYTES) -> list[int]:
    """Element counts of a region's host pieces: as many of ``ceiling_bytes`` as fit, then the powers of two
    (in bytes) of the rest down to ``floor_bytes``, largest first, then what is left in one piece (below
    ``floor_bytes``). ``ceiling_bytes``: a power of two."""
    assert ceiling_bytes & (ceiling_bytes - 1) == 0 and ceiling_bytes % element_size == 0, ceiling_bytes
    left = numel * element_size
    sizes = [ceiling_bytes // element_size] * (left // ceiling_bytes)
    left -= ceiling_bytes * len(sizes)
    piece = 1 << (left.bit_length() - 1) if left else 0
    while piece >= max(floor_bytes, element_size):
        if left >= piece:
            sizes.append(piece // element_size)
            left -= piece
        piece >>= 1
    if left:
        sizes.append(left // element_size)
    return sizes


def pin_host_ahead(region_bytes: int, regions: int) -> int:
    """Pin the ``PIECE_CEILING_BYTES`` pieces that ``regions`` offloaded regions of ``region_bytes`` each are held in,
    and free them into PyTorch's host-allocator cache, where those pieces find them (a cached block serves its own
    power of two): pinning (cudaHostAlloc maps and locks every page) then happens before the first step instead of
    inside it, as the first step's offloads would otherwise do for tens of GiB. A region's smaller remainder pieces
    are left to the step, so nothing pinned here goes unused. The pinned bytes (0 without CUDA)."""
    blocks = regions * (region_bytes // PIECE_CEILING_BYTES) if torch.cuda.is_available() else 0
    pinned = [torch.empty(PIECE_CEILING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(blocks)]
    del pinned  # (cached, not unpinned: release_host_cache hands them back)
    return blocks * PIECE_CEILING_BYTES


def release_host_cache() -> None:
    """Hand the pinned blocks PyTorch's host allocator keeps cached back to the system: a run after
    another in the same process (a benchmark's strategies) would otherwise allocate beside them."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
        if empty is None:
            warnings.warn("this torch has no way to free its cached pinned memory: a later run in this process "
                          "allocates beside it", RuntimeWarning, stacklevel=2)
        else:
            empty()


class _Saved:
    """One offloaded region: its host copy (flat pieces, see ``piece_sizes``), and its device copy while
    backward needs it."""

    __slots__ = ("pieces", "dtype", "numel", "nbytes", "device_copy", "ready", "users")

    def __init__(self, pieces: list[torch.Tensor]):
        self.pieces = pieces
        self.dtype = pieces[0].dtype
        self.numel = sum(p.numel() for p in pieces)
        self.nbytes = self.numel * pieces[0].element_size()
        self.device_copy: torch.Tensor | None = None
        self.ready = None  # CUDA event: the device copy is complete
        self.users = 0  # packs of this region not unpacked yet


class _Packed:
    """What autograd keeps for one saved tensor: the region holding it, where in the region it starts
    (elements) and its shape, and the place of this save in the pass."""

    __slots__ = ("saved", "offset", "shape", "position")

    def __init__(self, saved: _Saved, offset: int, shape: torch.Size, position: int):
        self.saved, self.offset, self.shape, self.position = saved, offset, shape, position


class _PackedDTensor:
    """A saved DTensor: its local shard as packed, and what rebuilds the DTensor around it."""

    __slots__ = ("local", "spec")

    def __init__(self, local, spec):
        self.local, self.spec = local, spec


class ActivationOffload:
    """Saved-tensor hooks that keep saved activations in host memory (see the module docstring).

    ``with offload:`` around a forward pass; the backward may run after the block. Entering again
    starts a new pass. ``offloaded_bytes``: what the last pass copied to the host.
    """

    def __init__(self, device: torch.device, *, min_bytes: int = DEFAULT_MIN_BYTES,
                 prefetch_bytes: int = 1 << 30, max_pending_bytes: int = 4 << 30,
                 piece_floor_bytes: int = PIECE_FLOOR_BYTES):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors say cuda:N: compare alike
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.piece_floor_bytes = piece_floor_bytes
        self.cuda = self.device.type == "cuda"
        self.min_bytes = min_bytes
        self.prefetch_bytes = prefetch_bytes
        self.max_pending_bytes = max_pending_bytes
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._reset()

    def _reset(self):
        self.offloaded_bytes = 0
        self._order: list[_Saved] = []  # the region of every save, in order of saving
        self._regions: dict = {}  # id of a base tensor -> (weak reference to it, [(start, end, _Saved)])
        self._pending: collections.deque = collections.deque()  # (event, bytes) of device-to-host copies
        self._pending_bytes = 0
        self._cursor = None  # backward: the lowest save position fetched so far
        self._fetched_bytes = 0  # backward: device copies made and not yet consumed by every user

    def __enter__(self):
        self._reset()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._regions.clear()  # only forward dedupes; the regions' bases may be freed from now on
        return self._hooks.__exit__(*exc)

    # --- forward ---------------------------------------------------------------------------------

    def _keeps_on_device(self, t: torch.Tensor) -> bool:
        return (t.device != self.device or isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
                or t.numel() == 0 or t.numel() * t.element_size() < self.min_bytes or not t.is_contiguous())

    def _pack(self, t: torch.Tensor):
        if isinstance(t, AsyncCollectiveTensor):
            # A collective's output not waited for yet (tensor parallelism redistributes asynchronously).
            # Wait here, on the compute stream: the first wait on a collective is the only one that
            # synchronises, and one from the copy's side stream would leave the forward unsynchronised.
            t = t.trigger_wait()
        if isinstance(t, DTensor) and not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            packed = self._pack(t._local_tensor)
            return t if isinstance(packed, torch.Tensor) else _PackedDTensor(packed, t._spec)
        if self._keeps_on_device(t):
            return t
        # A tensor saved whole and again as views (core attention's output, then its chunks in the
        # MLP's checkpoints; a layer's input chunks in two checkpoints) is copied once: a save inside a
        # region already copied from the same base is a slice of that copy. A live base pins its
        # storage, so its regions cannot belong to another tensor; the weak reference tells a live base
        # from a freed one whose id was reused.
        base = t if t._base is None else t._base
        start, end = t.storage_offset(), t.storage_offset() + t.numel()
        found = self._regions.get(id(base))
        if found is None or found[0]() is not base:
            found = self._regions[id(base)] = (weakref.ref(base), [])
        for region_start, region_end, saved in found[1]:
            if region_start <= start and end <= region_end and saved.dtype == t.dtype:
                break
        else:
            region_start, saved = start, _Saved(self._copy_to_host(t))
            found[1].append((start, end, saved))
        saved.users += 1
        self._order.append(saved)
        return _Packed(saved, start - region_start, t.shape, len(self._order) - 1)

    def _copy_to_host(self, t: torch.Tensor) -> list[torch.Tensor]:
        nbytes = t.numel() * t.element_size()
        self.offloaded_bytes += nbytes
        flat, start = t.detach().view(-1), 0
        pieces = [torch.empty(n, dtype=t.dtype, pin_memory=self.cuda)
                  for n in piece_sizes(t.numel(), t.element_size(), self.piece_floor_bytes)]
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            for piece in pieces:
                start += piece.copy_(flat[start:start + piece.numel()], non_blocking=self.cuda).numel()
            if not self.cuda:
                return pieces
            done = torch.cuda.Event()
            done.record()
        t.record_stream(self.stream)  # the allocator reuses t's memory only after the copy
        self._pending.append((done, nbytes))
        self._pending_bytes += nbytes
        while self._pending and (self._pending_bytes > self.max_pending_bytes or self._pending[0][0].query()):
            done, nbytes = self._pending.popleft()
            done.synchronize()  # forward waits here only when it runs too far ahead of the copies
            self._pending_bytes -= nbytes
        return pieces

    # --- backward --------------------------------------------------------------------------------

    def _fetch(self, saved: _Saved) -> None:
        if saved.device_copy is not None or saved.users <= 0:
            return
        self._fetched_bytes += saved.nbytes
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            saved.device_copy, start = torch.empty(saved.numel, dtype=saved.dtype, device=self.device), 0
            for piece in saved.pieces:
                start += saved.device_copy[start:start + piece.numel()].copy_(piece, non_blocking=self.cuda).numel()
            if self.cuda:
                saved.ready = torch.cuda.Event()
                saved.ready.record()

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _PackedDTensor):
            spec = packed.spec
            return DTensor.from_local(self._unpack(packed.local), spec.mesh, spec.placements, run_check=False,
                                      shape=spec.shape, stride=spec.stride)
        saved = packed.saved
        if saved.users <= 0:  # unpacked again after its last user (a retained graph): from the host anew
            saved.users = 1
        self._fetch(saved)
        # Backward consumes saves in about the reverse order of forward: fetch the ones saved just
        # before this one, up to prefetch_bytes of device copies waiting to be used.
        self._cursor = packed.position if self._cursor is None else min(self._cursor, packed.position)
        while self._cursor > 0 and self._fetched_bytes < self.prefetch_bytes:
            self._cursor -= 1
            self._fetch(self._order[self._cursor])
        t = saved.device_copy[packed.offset:packed.offset + packed.shape.numel()].view(packed.shape)
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(saved.ready)
            t.record_stream(current)  # allocated on the side stream, used and freed on this one
        saved.users -= 1
        if saved.users == 0:
            saved.device_copy = None  # autograd keeps it for as long as its node needs it
            self._fetched_bytes -= saved.nbytes
        return t
