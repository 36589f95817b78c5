"""Which rank stopped: when a collective fails (a peer died, or stalled past ``collective_timeout_s``), the
survivors name the rank they waited for instead of a transport's message.

Every rank keeps a small record in the run directory, ``OUT/ranks/rank-N.json``: its pid, host and the
step it last started. A file rather than the process group's store, so that the record survives whichever
process stopped (the store lives in rank 0's process). A rank whose collective fails marks itself as a
survivor, waits a little for the other survivors to do the same, and names the ranks that did not: those
stopped (killed, frozen, or hung in other work). The directory must be one every rank sees, as
checkpoints already require.
"""

from __future__ import annotations

import json
import os
import socket
import time

import torch.distributed as dist

RANKS_DIR = "ranks"
SURVIVOR_GRACE_S = 5.0  # how long a survivor waits for the others to say they are alive


def is_collective_failure(exc: BaseException) -> bool:
    """A failure of the transport under a collective (a dead or stalled peer), as opposed to a failure of
    the computation (which the rank's own traceback explains)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in (
        "gloo", "Connection closed", "Connection reset", "Timed out", "timed out", "NCCL"))


class RankRecords:
    """This rank's record, and what the survivors of a failed collective make of everyone's."""

    def __init__(self, out: str, rank: int, world: int):
        self.dir = os.path.join(out, RANKS_DIR)
        self.rank, self.world = rank, world
        os.makedirs(self.dir, exist_ok=True)
        self._started = time.time()
        try:  # an earlier attempt's word that this rank was alive
            os.remove(self._path(rank, "alive"))
        except FileNotFoundError:
            pass
        self.step(0)

    def _path(self, rank: int, kind: str = "rank") -> str:
        return os.path.join(self.dir, f"{kind}-{rank}.json")

    def _write(self, path: str, record: dict) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, path)

    def step(self, step: int) -> None:
        """Record that this rank started ``step`` (0: set up)."""
        self._write(self._path(self.rank), {"pid": os.getpid(), "host": socket.gethostname(), "step": step,
                                            "time": time.time(), "started": self._started})

    def _read(self, path: str) -> dict | None:
        try:
            with open(path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    def stopped_ranks(self, grace_s: float = SURVIVOR_GRACE_S) -> list[tuple[int, dict | None]]:
        """Mark this rank a survivor (of this attempt), wait up to ``grace_s`` for the others, and return
        (rank, its record) of those that did not say so."""
        self._write(self._path(self.rank, "alive"), {"time": time.time(), "started": self._started})
        deadline = time.time() + grace_s
        while True:
            silent = []
            for r in range(self.world):
                alive, record = self._read(self._path(r, "alive")), self._read(self._path(r))
                if alive is None or record is None or alive["started"] != record["started"]:
                    silent.append(r)
            if not silent or time.time() >= deadline:
                return [(r, self._read(self._path(r))) for r in silent]
            time.sleep(0.1)

    def describe_failure(self, exc: BaseException, step: int, timeout_s: float) -> str:
        """One line: which ranks stopped and where, for the error every survivor raises."""
        stopped = self.stopped_ranks()
        what = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        if not stopped:
            return (f"step {step}: a collective failed on rank {self.rank} ({what}), and every rank is still "
                    "running; see the other ranks' output")
        names = [describe_record(r, record) for r, record in stopped]
        return (f"step {step}: {', '.join(names)} stopped responding; rank {self.rank}'s collective failed "
                f"({what}); a rank that is alive but silent is waited for collective_timeout_s={timeout_s:g} s")


def describe_record(rank: int, record: dict | None) -> str:
    """``rank N (pid P on HOST, in step S)``, or ``rank N`` where it left no record."""
    if record is None:
        return f"rank {rank}"
    return f"rank {rank} (pid {record['pid']} on {record['host']}, in step {record['step']})"


def describe_rank(out: str, rank: int) -> str:
    """A rank named from its record in the run directory ``out`` (for the launcher, which holds no RankRecords)."""
    try:
        with open(os.path.join(out, RANKS_DIR, f"rank-{rank}.json")) as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        record = None
    return describe_record(rank, record)
