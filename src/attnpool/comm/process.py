"""A rank's process group, whether torchrun started it, and how a rank's process ends.

FSDP2 and DTensor leave references to the process group in PyTorch's own caches
(sharding propagation, redistribute planners), so ``destroy_process_group()``
does not free a gloo group: its worker threads live on until interpreter
teardown, which destroys them in no fixed order and can abort a process that
finished its work ("terminate called without an active exception", SIGABRT).
A 2-rank loop that keeps a reference to its group past ``destroy_process_group()``
aborted in 9 to 15 of 40 runs (two runs), and in none when each rank left through
:func:`end_process`.

So every process that opened a group through :func:`process_group` and owns its
own lifetime (a spawned rank, the ``attnpool`` command under torchrun) leaves
through :func:`end_process`, which skips that teardown.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn

import torch.distributed as dist

_opened = False


@contextlib.contextmanager
def process_group(backend: str, **kwargs):
    """``init_process_group(backend, **kwargs)`` for the block, destroyed after it whatever happens."""
    global _opened
    dist.init_process_group(backend, **kwargs)
    _opened = True
    try:
        yield
    finally:
        dist.destroy_process_group()


def under_torchrun() -> bool:
    """Whether this process is one of torchrun's workers (torchrun sets its rank and world in the environment)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def opened_process_group() -> bool:
    """Whether this process opened a group through :func:`process_group`."""
    return _opened


def end_process(code: int) -> NoReturn:
    """Flush what this process printed and logged, then exit with ``code`` without interpreter teardown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
