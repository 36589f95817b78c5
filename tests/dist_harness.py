"""Run a function on N gloo processes on this machine and collect what each rank returns."""

from __future__ import annotations

import faulthandler
import os
import socket
import tempfile
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from attnpool.comm import end_process, process_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, outdir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    faulthandler.enable(all_threads=True)  # a native abort in a rank prints every thread's Python stack
    # A short timeout turns a rank left waiting into a test failure instead of a hang.
    with process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60)):
        torch.save(fn(rank, world, *args), os.path.join(outdir, f"{rank}.pt"))
    end_process(0)  # as the training processes do (attnpool.comm.process); an exception still reaches mp.spawn


def run_distributed(fn, world: int, *args) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; returns the per-rank results."""
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_entry, args=(world, _free_port(), fn, args, outdir), nprocs=world, join=True)
        return [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False) for r in range(world)]
