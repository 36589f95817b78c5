"""Run a function on N gloo processes on this machine and collect what each rank returns.

The processes are started once per world size and kept for the rest of the test session: each call opens a new
process group in them, runs the function and closes the group. Starting a process and importing torch and the
package in it costs 1.5-2 s of CPU per rank, as much as many of the tests themselves; over the suite's hundred-odd
calls that was a third of ``make test``. A call whose function fails on any rank retires the processes (the others
may be waiting in a collective, and the group is in no state to reuse), and the next call starts new ones;
``fresh=True`` runs a call in processes of its own, as ``mp.spawn`` would.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from attnpool.comm import end_process, free_port, process_group

CALL_TIMEOUT_S = 900  # a whole call (the tests' longest take a minute on 2 cores); a rank's collective gives up at 60 s


def _serve(rank: int, world: int, tasks, results) -> None:
    """A rank's process: one call after another from ``tasks`` until None, each in a process group of its own."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    torch.set_num_threads(1)
    faulthandler.enable(all_threads=True)  # a native abort in a rank prints every thread's Python stack
    while (task := tasks.get()) is not None:
        port, fn, args, outdir = task
        _forget_earlier_groups()
        os.environ["MASTER_PORT"] = str(port)
        # A short timeout turns a rank left waiting into a test failure instead of a hang.
        with process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60)):
            try:
                torch.save(fn(rank, world, *args), os.path.join(outdir, f"{rank}.pt"))
            except BaseException:
                # said before the group closes, which fails the other ranks' collectives: this error comes first
                results.put((rank, traceback.format_exc()))
                end_process(1)  # (the group may be broken: this process is not reused)
        results.put((rank, None))
    end_process(0)  # as the training processes do (attnpool.comm.process)


def _forget_earlier_groups() -> None:
    """DTensor's sharding propagation and redistribute planner cache their answers by mesh shape, and an answer holds
    the mesh it was computed on: an earlier call's, whose process groups are gone ("Could not resolve the process
    group registered under the name ..."). Cleared before every call (torch's own debug helpers, where it has them)."""
    from torch.distributed.tensor import _redistribute, debug

    for clear in (getattr(debug, "_clear_sharding_prop_cache", None),
                  getattr(_redistribute, "clear_redistribute_planner_cache", None),
                  getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None)):
        if clear is not None:
            clear()


class _Ranks:
    """``world`` processes serving calls (see the module docstring)."""

    def __init__(self, world: int):
        context = mp.get_context("spawn")
        self.world = world
        self.tasks = [context.SimpleQueue() for _ in range(world)]
        self.results = context.SimpleQueue()  # (written through at once: a rank may exit right after)
        self.processes = [context.Process(target=_serve, args=(rank, world, self.tasks[rank], self.results),
                                          daemon=True) for rank in range(world)]
        for p in self.processes:
            p.start()

    def call(self, fn, args) -> list:
        with tempfile.TemporaryDirectory() as outdir:
            port = free_port()
            for tasks in self.tasks:
                tasks.put((port, fn, args, outdir))
            done, deadline = set(), time.monotonic() + CALL_TIMEOUT_S
            while len(done) < self.world:
                if self.results.empty():
                    dead = [r for r, p in enumerate(self.processes) if not p.is_alive()]
                    if (dead and self.results.empty()) or time.monotonic() > deadline:
                        self.close()
                        raise RuntimeError(f"{fn.__name__} on {self.world} ranks: rank {dead[0]} exited with code "
                                           f"{self.processes[dead[0]].exitcode}" if dead else
                                           f"{fn.__name__} on {self.world} ranks: no answer in {CALL_TIMEOUT_S} s")
                    time.sleep(0.01)
                    continue
                rank, error = self.results.get()
                if error is not None:
                    self.close()
                    raise RuntimeError(f"{fn.__name__} failed on rank {rank} of {self.world}:\n{error}")
                done.add(rank)
            return [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False) for r in range(self.world)]

    def close(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.kill()
            p.join()


_ranks: dict[int, _Ranks] = {}


def run_distributed(fn, world: int, *args, fresh: bool = False) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes (kept for later calls unless ``fresh``); returns the
    per-rank results. A rank's exception is raised here as a RuntimeError with its traceback."""
    if fresh:
        ranks = _Ranks(world)
        try:
            return ranks.call(fn, args)
        finally:
            ranks.close()
    if world not in _ranks or not all(p.is_alive() for p in _ranks[world].processes):
        _ranks[world] = _Ranks(world)
    try:
        return _ranks[world].call(fn, args)
    except BaseException:
        _ranks.pop(world, None)  # (closed by call where a rank failed; a KeyboardInterrupt leaves them to atexit)
        raise


@atexit.register
def _close_all() -> None:
    for ranks in _ranks.values():
        for tasks in ranks.tasks:
            tasks.put(None)
    for ranks in _ranks.values():
        for p in ranks.processes:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
