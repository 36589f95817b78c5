"""Fault injection from outside a run, as failures happen: what tests/test_faults.py and bench/faults.py share.

A run of ``attnpool train`` is watched through its ``metrics.jsonl``; its workers are the launcher's
children running Python's spawn entry point (Linux ``/proc``); a checkpoint file is damaged in place.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

# The tiny model on the standard-library corpus, on CPU: a few hundred milliseconds a step.
TINY_RUN = ("--config", "configs/demo-cpu.yaml", "--model-args", "dim=32", "n_layers=2", "n_heads=4", "n_kv_heads=2",
            "ffn_dim=64", "--tokens-per-rank", "256", "--no-progress")


def cpu_env() -> dict:
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", COLUMNS="200", PYTHONUNBUFFERED="1")


def train_cli(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """``attnpool train`` with the tiny run's settings and ``args``, to its end."""
    return subprocess.run([sys.executable, "-m", "attnpool.cli.main", "train", *TINY_RUN, *args], capture_output=True,
                          text=True, env=cpu_env(), timeout=timeout)


def start_train(*args, log, torchrun: tuple = ()) -> subprocess.Popen:
    """``attnpool train`` as :func:`train_cli`, in the background, its output to the open file ``log``;
    with ``torchrun`` (its arguments), under torchrun."""
    launcher = [sys.executable, "-m", "torch.distributed.run", *torchrun] if torchrun else [sys.executable]
    return subprocess.Popen([*launcher, "-m", "attnpool.cli.main", "train", *TINY_RUN, *args], stdout=log,
                            stderr=subprocess.STDOUT, text=True, env=cpu_env())


def metrics_rows(out: str) -> list[dict]:
    """The run's metrics.jsonl, refused where a line is not strict JSON (a bare NaN)."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []

    def refuse(constant):
        raise ValueError(f"metrics.jsonl holds {constant}, which is not JSON")

    with open(path) as fh:
        return [json.loads(line, parse_constant=refuse) for line in fh if line.strip()]


def losses(out: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics_rows(out)}


def wait_for_step(out: str, step: int, proc: subprocess.Popen, timeout: float = 240) -> int:
    """Wait until the run has logged ``step`` (returns the last logged step)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            rows = metrics_rows(out)
        except ValueError:  # a line being written
            rows = []
        if rows and rows[-1]["step"] >= step:
            return rows[-1]["step"]
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (rc {proc.returncode}) before step {step}")
        time.sleep(0.2)
    raise TimeoutError(f"no step {step} within {timeout} s")


def workers(launcher_pid: int) -> list[int]:
    """The pids of the launcher's training processes (the built-in launcher's spawned ranks, or torchrun's
    workers)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher_pid and (b"spawn_main" in cmdline or b"attnpool.cli.main" in cmdline):
            found.append(int(pid))
    return sorted(found)


def wait_gone(pids: list[int], timeout: float = 120) -> bool:
    deadline = time.time() + timeout
    while any(os.path.exists(f"/proc/{p}") for p in pids):
        if time.time() > deadline:
            return False
        time.sleep(0.2)
    return True


def damage(checkpoint: str, how: str) -> str:
    """Damage the first shard of a checkpoint: ``overwrite`` 8 KB in its middle (size unchanged),
    ``truncate`` it to half, or ``delete`` it. Returns the file's path."""
    shard = sorted(n for n in os.listdir(checkpoint) if n.endswith(".distcp"))[0]
    file = os.path.join(checkpoint, shard)
    if how == "overwrite":
        size = os.path.getsize(file)
        with open(file, "r+b") as fh:
            fh.seek(max(0, size // 2 - 4096))
            fh.write(os.urandom(8192))
    elif how == "truncate":
        with open(file, "r+b") as fh:
            fh.truncate(os.path.getsize(file) // 2)
    elif how == "delete":
        os.remove(file)
    else:
        raise ValueError(f"how={how!r}: overwrite, truncate or delete")
    return file
