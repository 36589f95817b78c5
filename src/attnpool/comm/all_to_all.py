"""All-to-all over flat buffers with explicit split sizes, counted in bytes.

``torch.distributed.all_to_all_single`` on a 1-D tensor works on NCCL and on gloo
with uneven and zero splits. Every call made through
:func:`all_to_all_flat` adds to :data:`comm_stats`, so tests can check the bytes
that actually crossed against what the plan predicted. With
``comm_stats.timing = True`` it also adds up communication time (see
:class:`CommStats`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def covered_seconds(spans: list[tuple[float, float]]) -> float:
    """The time at least one of the (start, end) spans covers: spans in flight together count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


@dataclass
class CommStats:
    """Bytes this process sent to and received from other ranks (self-traffic excluded).

    Time is measured only while ``timing`` is True. On CPU it is the wall time
    the caller spends in the call and, for ``async_op``, in the handle's
    ``wait()``: the communication time not hidden behind compute. On CUDA it is
    measured by events on the current stream, from the launch to the return of
    ``wait()`` (or of a blocking call): for an async call that span includes any
    compute overlapped with it, and where calls are in flight together (ping-pong, head groups) the time counts
    once, as the union of their spans. Either way it includes waiting for the slowest peer.
    """

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    by_tag: dict = field(default_factory=dict)
    timing: bool = False
    _seconds: float = 0.0
    _events: list = field(default_factory=list)  # (start, end) CUDA events not yet read
    _origin: object = None  # the first start event since the last reset: every span is read from it

    def reset(self) -> None:
        self.calls = self.bytes_sent = self.bytes_received = 0
        self.by_tag = {}
        self._seconds = 0.0
        self._events = []
        self._origin = None

    def seconds(self) -> float:
        """Time inside timed calls since the last reset (waits for pending CUDA events)."""
        if self._events:
            # every event is on the current stream, so each span's offsets from the first start order them
            for _, end in self._events:
                end.synchronize()
            # (an exchange launched before the last reset and waited for after it leaves no origin: any event serves,
            # the offsets need only order the spans)
            origin = self._origin if self._origin is not None else self._events[0][0]
            self._seconds += covered_seconds([(origin.elapsed_time(start) / 1e3, origin.elapsed_time(end) / 1e3)
                                              for start, end in self._events])
            self._events = []
        return self._seconds

    def _finish(self, start, t0: float) -> None:
        """Close an interval opened at host time ``t0`` (CPU) or at CUDA event ``start``."""
        if start is None:
            self._seconds += time.perf_counter() - t0
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((start, end))

    def add(self, tag: str, sent: int, received: int) -> None:
        self.calls += 1
        self.bytes_sent += sent
        self.bytes_received += received
        t = self.by_tag.setdefault(tag, [0, 0, 0])
        t[0] += 1
        t[1] += sent
        t[2] += received


comm_stats = CommStats()


def group_rank_size(group=None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


_tiny_messages = False


@contextlib.contextmanager
def tiny_messages():
    """Benchmark ablation: every all-to-all sends one element per peer instead of its payload.

    Receivers get zeros of the right size, so results are meaningless but the
    schedule, launches and synchronisation are the real ones: the step time then
    shows how much communication was exposed. Byte counters still count the real
    payload.
    """
    global _tiny_messages
    before, _tiny_messages = _tiny_messages, True
    try:
        yield
    finally:
        _tiny_messages = before


def all_gather_flat(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's 1-D ``tensor``, concatenated in rank order."""
    out = tensor.new_empty(dist.get_world_size(group) * tensor.numel())
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; 2.11 has only the former.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(out, tensor.contiguous(), group=group)
    return out


def all_to_all_flat(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group=None,
                    tag: str = "", async_op: bool = False):
    """Exchange a flat buffer: ``send_splits[r]`` elements go to rank r, ``recv_splits[r]`` come from it.

    Returns the received flat buffer, or ``(buffer, work)`` with ``async_op`` (wait on
    ``work`` before reading the buffer).
    """
    me, _ = group_rank_size(group)
    recv = send.new_empty(sum(recv_splits))
    elem = send.element_size()
    comm_stats.add(tag, elem * (sum(send_splits) - send_splits[me]), elem * (sum(recv_splits) - recv_splits[me]))
    timed = comm_stats.timing
    start = None
    if timed and send.is_cuda:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        if comm_stats._origin is None:
            comm_stats._origin = start
    t0 = time.perf_counter()
    if _tiny_messages:
        recv.zero_()
        tiny_send, tiny_recv = [min(n, 1) for n in send_splits], [min(n, 1) for n in recv_splits]
        work = dist.all_to_all_single(send.new_empty(sum(tiny_recv)), send.new_zeros(sum(tiny_send)), tiny_recv,
                                      tiny_send, group=group, async_op=async_op)
    else:
        work = dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=group, async_op=async_op)
    if timed:
        if not async_op:
            comm_stats._finish(start, t0)
        else:
            if start is None:
                comm_stats._seconds += time.perf_counter() - t0  # the launch
            work = _TimedWork(work, start)
    return (recv, work) if async_op else recv


class _TimedWork:
    """An async call's work handle whose first ``wait()`` adds to comm_stats' time; otherwise the same."""

    def __init__(self, work, start):
        self._work, self._start, self._done = work, start, False

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        result = self._work.wait(*args, **kwargs)
        if not self._done:
            self._done = True
            comm_stats._finish(self._start, t0)
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)
