"""The all-to-all rate of the links between ranks, as NCCL (or gloo) sets them up: what bench/a2a_probe.py records
beside a benchmark's runs, and what ``exchange_gibps: auto`` / ``inter_node_gibps: auto`` measure at a run's start.

A rank's rate is the bytes it sends to the other ranks per second, the median of several all-to-alls, the slowest
rank's: the figure ``exchange_gibps`` means (GiB/s per GPU). Where the ranks span several nodes each tier is
measured alone, as the simulator's two links (``attnpool.sim.costs.Link``): ``intra_node``, an all-to-all inside
every node at once, and ``inter_node``, one between the ranks of the same local rank on every node, all local
ranks at once (so a node's GPUs share its network, as in a real exchange). On gloo (CPU) the figures say nothing
about a network; they check the logic.
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from attnpool.errors import ConfigError

# Sizes per rank of a start-up measurement: large enough for NVLink's rate (its all-to-all reaches 77% of the
# rate of 256 MiB at 64 MiB, 44% at 16 MiB: the shipped H200 profile's comm table), small enough to take under a
# second on a slow link; on CPU (gloo, the tests) the rate means nothing, so a small one
START_UP_MIB = {"cuda": 256, "cpu": 4}
START_UP_ITERS = 5


def all_to_all_rate(mib: int, iters: int, device: torch.device, group=None) -> tuple[int, float]:
    """(bytes each rank sends to the others, seconds of the slowest rank's median) of an all-to-all over ``group``
    (default every rank): each rank sends ``mib`` MiB split evenly over the group, its own share included. Every
    rank of the world calls it (each in its own group), so that the slowest of all is taken."""
    size = dist.get_world_size(group)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # (gloo's all-to-all: no bfloat16)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = max(size, mib * 2**20 // itemsize // size * size)
    send, recv = torch.ones(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    dist.all_to_all_single(recv, send, group=group)  # connections set up outside the timing
    sync()
    seconds = []
    for _ in range(iters):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send, group=group)
        sync()
        seconds.append(time.perf_counter() - t0)
    slowest = torch.tensor([statistics.median(seconds)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return n * itemsize * (size - 1) // size, float(slowest)


def tier_groups(world: int, per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """(the ranks of each node, the ranks of each local rank across the nodes): torchrun numbers a node's ranks
    contiguously."""
    nodes = world // per_node
    inside = [list(range(node * per_node, (node + 1) * per_node)) for node in range(nodes)]
    across = [[node * per_node + local for node in range(nodes)] for local in range(per_node)]
    return inside, across


def rates_in_groups(groups: list[list[int]], mib: int, iters: int, device: torch.device,
                    timeout: timedelta | None = None) -> tuple[int, float]:
    """:func:`all_to_all_rate` inside each of ``groups`` (lists of ranks covering the world) at once, in process
    groups made for it and ended after it, so that no communicator keeps the all-to-all's buffers. Every rank calls
    it with the same ``groups``."""
    # (every rank makes every group, in the same order, as new_group requires)
    group, made = dist.new_subgroups_by_enumeration(groups, timeout=timeout)
    rate = all_to_all_rate(mib, iters, device, group)
    # (ended after it went through: after a failed collective the run stops, and ending a group mid-failure on
    # NCCL may hang or hide the first error)
    for each in made:
        dist.destroy_process_group(each)
    return rate


def tier_rates(device: torch.device, per_node: int, mib: int, iters: int) -> dict[str, tuple[int, float]]:
    """Every tier's (bytes out per rank, slowest median seconds), by name: "" the whole world, and where the ranks
    span nodes of ``per_node`` also "intra_node" (where a node has several ranks) and "inter_node". Every rank calls
    it."""
    world = dist.get_world_size()
    rates = {"": rates_in_groups([list(range(world))], mib, iters, device)}
    if world > per_node:
        inside, across = tier_groups(world, per_node)
        for name, groups in (("intra_node", inside), ("inter_node", across)):
            if len(groups[0]) > 1:
                rates[name] = rates_in_groups(groups, mib, iters, device)
    return rates


def same_ranks_per_node(per_node: int, device: torch.device) -> None:
    """Refuse, on every rank alike, a node size the ranks do not all take (torchrun's LOCAL_WORLD_SIZE where nodes
    run different numbers of ranks): they would make different groups, and wait in them until the timeout."""
    seen = torch.tensor([per_node, -per_node], dtype=torch.int64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    low, high = -int(seen[1]), int(seen[0])
    if (low, high) != (per_node, per_node):
        raise ConfigError("ranks_per_node", per_node, f"differs between ranks ({low} to {high}: torchrun's "
                                                      "LOCAL_WORLD_SIZE by node); set ranks_per_node")


def start_up_link_rates(device: torch.device, per_node: int, inside: bool, between: bool,
                        timeout: timedelta | None = None) -> tuple[float | None, float | None]:
    """(GiB/s per GPU of the link inside a node, GiB/s per GPU between nodes), each measured now where asked (else
    None), the same on every rank. Inside a node: the all-to-all of every node's ranks at once (on one node, all of
    them; where each node holds one rank, nothing is inside a node and the link between nodes stands for it).
    Between nodes: the all-to-all of each local rank's ranks across the nodes, every local rank at once."""
    world = dist.get_world_size()
    mib = START_UP_MIB["cuda" if device.type == "cuda" else "cpu"]
    node_ranks, across = tier_groups(world, per_node)

    def gibps(groups) -> float:
        sent, seconds = rates_in_groups(groups, mib, START_UP_ITERS, device, timeout)
        return sent / seconds / 2**30

    inside_gibps = gibps(node_ranks if per_node > 1 else across) if inside else None
    between_gibps = None
    if between and world > per_node:  # (a node of one rank: its "inside" figure was this link's already)
        between_gibps = inside_gibps if inside and per_node == 1 else gibps(across)
    rates = inside_gibps, between_gibps
    if device.type == "cuda":  # (the buffers' blocks back to the device before the model is built)
        torch.cuda.empty_cache()
    return rates
