"""Does a rank whose gloo group outlives destroy_process_group() end cleanly? (attnpool.comm.process)

Each trial spawns 2 gloo ranks that exchange a few async all-to-alls, keep a
reference to their group (as PyTorch's DTensor caches do under FSDP2), destroy
the group and return: either normally (interpreter teardown) or through
attnpool.comm.end_process. Prints the aborted trials of each way.

    PYTHONPATH=src python bench/process_exit.py --trials 40
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnpool.comm import end_process, free_port, process_group

_KEPT = []


def _rank(rank: int, world: int, port: int, leave_through_end_process: bool) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    with process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60)):
        for _ in range(20):
            out = torch.empty(1000)
            dist.all_to_all_single(out, torch.ones(1000), async_op=True).wait()
        _KEPT.append(dist.distributed_c10d._get_default_group())
    if leave_through_end_process:
        end_process(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    args = parser.parse_args()
    for way in ("interpreter teardown", "end_process"):
        aborted = 0
        for _ in range(args.trials):
            try:
                mp.spawn(_rank, args=(2, free_port(), way == "end_process"), nprocs=2, join=True)
            except mp.ProcessExitedException:
                aborted += 1
        print(f"{way:22s} aborted {aborted} of {args.trials} trials", flush=True)


if __name__ == "__main__":
    main()
