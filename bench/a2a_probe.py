"""All-to-all bandwidth between the ranks as NCCL sets them up: what a benchmark's network measured, in its call.

    torchrun --nproc-per-node 4 bench/a2a_probe.py --out OUT/probe.json [--mib 256] [--iters 5]

Each rank sends ``--mib`` MiB split evenly over the ranks (its own share included, as all_to_all_single does);
the figure is the bytes it sends to the other ranks per second, median over the iterations, slowest rank. Run it
with the same NCCL_* settings as the runs it qualifies (an emulated inter-node link: NCCL_P2P_DISABLE=1
NCCL_SHM_DISABLE=1 ...).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    n = args.mib * 2**20 // 2 // world * world
    send, recv = torch.ones(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dist.all_to_all_single(recv, send)  # connections set up outside the timing
    torch.cuda.synchronize()
    seconds = []
    for _ in range(args.iters):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    out_bytes = 2 * n * (world - 1) // world
    mine = torch.tensor([statistics.median(seconds)], device="cuda")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    if rank == 0:
        nccl = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        result = {"world": world, "bytes_out_per_rank": out_bytes, "median_s": float(mine),
                  "GiBps_out_per_rank": out_bytes / float(mine) / 2**30, "nccl_env": nccl}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"all-to-all: {result['GiBps_out_per_rank']:.1f} GiB/s out per rank ({world} ranks, "
              f"{nccl or 'NCCL defaults'})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
