"""All-to-all bandwidth between the ranks as NCCL sets them up: what a benchmark's network measured, in its call.

    torchrun --nproc-per-node 4 bench/a2a_probe.py --out OUT/probe.json [--mib 256] [--iters 5]

Each rank sends ``--mib`` MiB split evenly over the ranks (its own share included, as all_to_all_single does);
the figure is the bytes it sends to the other ranks per second, median over the iterations, slowest rank. Run it
with the same NCCL_* settings as the runs it qualifies (an emulated inter-node link: NCCL_P2P_DISABLE=1
NCCL_SHM_DISABLE=1 ...).

Where the ranks span several nodes (torchrun's LOCAL_WORLD_SIZE below the world: real nodes, or bench/gpu_e2e.sh's
emulated ones), it also measures each tier alone (``intra_node``, ``inter_node``: ``attnpool.comm.probe``, which
``exchange_gibps: auto`` measures with at a run's start). Without CUDA it runs on gloo (the tests' check of its
logic; the figures then say nothing about a network).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from attnpool.comm.probe import tier_rates


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
    for name, (out_bytes, seconds) in tier_rates(device, per_node, args.mib, args.iters).items():
        prefix = f"{name}_" if name else ""
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
