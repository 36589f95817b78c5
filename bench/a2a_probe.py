"""All-to-all bandwidth between the ranks as NCCL sets them up: what a benchmark's network measured, in its call.

    torchrun --nproc-per-node 4 bench/a2a_probe.py --out OUT/probe.json [--mib 256] [--iters 5]

Each rank sends ``--mib`` MiB split evenly over the ranks (its own share included, as all_to_all_single does);
the figure is the bytes it sends to the other ranks per second, median over the iterations, slowest rank. Run it
with the same NCCL_* settings as the runs it qualifies (an emulated inter-node link: NCCL_P2P_DISABLE=1
NCCL_SHM_DISABLE=1 ...).

Where the ranks span several nodes (torchrun's LOCAL_WORLD_SIZE below the world: real nodes, or bench/gpu_e2e.sh's
emulated ones), it also measures each tier alone, as the simulator's two links (``attnpool.sim.costs.Link``):
``intra_node``, an all-to-all inside every node at once, and ``inter_node``, one between the ranks of the same
local rank on every node, all local ranks at once (so a node's GPUs share its network, as in a real exchange).
Without CUDA it runs on gloo (the tests' check of its logic; the figures then say nothing about a network).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def bandwidth(mib: int, iters: int, device: torch.device, group=None) -> tuple[int, float]:
    """(bytes each rank sends to the others, seconds of the slowest rank's median) of an all-to-all over ``group``
    (default every rank): each rank sends ``mib`` MiB split evenly over the group, its own share included. Every
    rank of the world calls it (each in its own group), so that the slowest of all is taken."""
    size = dist.get_world_size(group)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # (gloo's all-to-all: no bfloat16)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = mib * 2**20 // itemsize // size * size
    send, recv = torch.ones(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % per_node:
        raise SystemExit(f"LOCAL_WORLD_SIZE={per_node}: does not divide the {world} ranks")
    result = {"world": world, "ranks_per_node": per_node, "backend": dist.get_backend()}
    tiers = [("", None)]
    if world > per_node:
        inside, across = tier_groups(world, per_node)
        # (every rank creates every group, in the same order, as new_group requires)
        mine = {name: dist.new_subgroups_by_enumeration(groups)[0] for name, groups in
                (("intra_node", inside), ("inter_node", across)) if len(groups[0]) > 1}
        tiers += [(f"{name}_", group) for name, group in mine.items()]
    for prefix, group in tiers:
        out_bytes, seconds = bandwidth(args.mib, args.iters, device, group)
        result.update({f"{prefix}bytes_out_per_rank": out_bytes, f"{prefix}median_s": seconds,
                       f"{prefix}GiBps_out_per_rank": out_bytes / seconds / 2**30})
    if rank == 0:
        result["nccl_env"] = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        tiers_text = "".join(f", {name.replace('_', ' ')} {result[f'{name}_GiBps_out_per_rank']:.1f}"
                             for name in ("intra_node", "inter_node") if f"{name}_GiBps_out_per_rank" in result)
        print(f"all-to-all: {result['GiBps_out_per_rank']:.1f} GiB/s out per rank{tiers_text} ({world} ranks, "
              f"{per_node} a node, {result['nccl_env'] or 'NCCL defaults'})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
