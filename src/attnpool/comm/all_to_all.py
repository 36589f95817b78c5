"""All-to-all over flat buffers with explicit split sizes, counted in bytes.

``torch.distributed.all_to_all_single`` on a 1-D tensor works on NCCL and on gloo
with uneven and zero splits (DESIGN.md platform facts). Every call made through
:func:`all_to_all_flat` adds to :data:`comm_stats`, so tests can check the bytes
that actually crossed against what the plan predicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Bytes this process sent to and received from other ranks (self-traffic excluded)."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    by_tag: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.calls = self.bytes_sent = self.bytes_received = 0
        self.by_tag = {}

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
    work = dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=group, async_op=async_op)
    return (recv, work) if async_op else recv
