"""Launching a run: its ranks' processes, their process group, restarts, and SIGTERM.

Under torchrun, this process is one rank (one per GPU), and torchrun restarts lost workers (``--max-restarts``):
a restarted worker resumes from the latest valid checkpoint by itself. Otherwise :func:`run` starts ``nproc``
processes here (gloo on CPU, NCCL on CUDA) and starts them all again from the latest valid checkpoint when one
is lost, up to ``max_restarts`` times. Bad input is refused before any process starts (attnpool.train.setup);
what can only be checked on a rank is checked on every rank and agreed on before the first collective that
depends on it. A SIGTERM to the launcher reaches every worker, which finishes its step, checkpoints and leaves.
"""

from __future__ import annotations

import os
import pickle
import signal
import tempfile
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnpool.comm import end_process, free_port, portable, process_group, under_torchrun
from attnpool.comm.watchdog import RANKS_DIR, describe_rank
from attnpool.errors import ConfigError, TrainingError
from attnpool.train.checkpoint import checkpoint_root, finished_checkpoints, select_checkpoint
from attnpool.train.config import TrainConfig
from attnpool.train.loop import train
from attnpool.train.resume import refuse_overwriting_a_run
from attnpool.train.setup import prepare
from attnpool.train.signals import ForwardSigterm
from attnpool.train.spec import configured_device_type, rank_device

FINAL_ERROR = "final-error.txt"  # under OUT/ranks: a run's end that a restart cannot get past


def run(config: TrainConfig) -> int:
    """Train ``config``: under torchrun in this process (one of torchrun's); otherwise in ``nproc`` processes,
    started again from the latest valid checkpoint up to ``max_restarts`` times when one is lost.

    Returns 0; bad input raises ConfigError and a run that cannot go on TrainingError (in this process,
    whichever rank found it).
    """
    use_growable_segments()
    quiet_warnings()
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    if under_torchrun():
        return _run_under_torchrun(config)
    nproc = config.run.nproc
    if configured_device_type(config) == "cuda" and nproc > torch.cuda.device_count():
        raise ConfigError("nproc", nproc, f"one process per GPU, and this machine has {torch.cuda.device_count()}")
    refuse_overwriting_a_run(config)
    prepare(config, nproc)  # refuse bad input before any process starts
    if nproc == 1:
        _run_rank(config, 0, 1, f"tcp://127.0.0.1:{free_port()}")
        return 0
    restarts, max_restarts = 0, config.faults.max_restarts
    while (lost := _launch(config)) is not None:
        if restarts >= max_restarts:
            raise TrainingError(f"{lost}; no restarts left (max_restarts={max_restarts})" if max_restarts else lost)
        restarts += 1
        path, _ = select_checkpoint(config.run.out, checksum=False, distributed=False,
                                    allow_unverified=config.checkpoint.allow_unverified)
        if path is None and finished_checkpoints(config.run.out):
            raise TrainingError(f"{lost}; no valid checkpoint to restart from in {checkpoint_root(config.run.out)}")
        print(f"attnpool train: {lost}; restart {restarts} of {max_restarts}, resuming from "
              f"{path or 'the first step (no checkpoint yet)'}", flush=True)
        config = config.replace(resume=path is not None)
    return 0


def _run_under_torchrun(config: TrainConfig) -> int:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if config.run.nproc not in (1, world):
        raise ConfigError("nproc", config.run.nproc, f"under torchrun the processes are torchrun's ({world}); "
                                                     "leave nproc at 1")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    final = os.path.join(config.run.out, RANKS_DIR, FINAL_ERROR)
    if restart and os.path.isfile(final):  # what ended the last attempt would end this one too
        with open(final) as fh:
            raise TrainingError(f"{fh.read().strip()} (torchrun's restart {restart} would repeat it)")
    if not restart:
        refuse_overwriting_a_run(config)
    if not restart and rank == 0 and os.path.isfile(final):
        os.remove(final)  # an earlier run's
    try:
        if restart and not config.checkpoint.resume:  # torchrun --max-restarts started this worker again
            config = _resumed_by_restart(config, restart, rank)
        _run_rank(config, rank, world, None)
    except (ConfigError, TrainingError) as exc:  # bad input, or a run that cannot go on: final
        if not getattr(exc, "restartable", False):
            # Every rank that has it writes it (each whole, then renamed into place): torchrun may stop rank 0
            # before it gets here, and a restart would then repeat the failure.
            os.makedirs(os.path.dirname(final), exist_ok=True)
            with open(f"{final}.{rank}.tmp", "w") as fh:
                fh.write(str(exc))
            os.replace(f"{final}.{rank}.tmp", final)
        raise
    return 0


def _resumed_by_restart(config: TrainConfig, restart: int, rank: int) -> TrainConfig:
    """``config`` for torchrun's restart ``restart`` of a worker: resumed from the run's latest valid checkpoint, or
    as it was where the run has none yet; a run whose every checkpoint is damaged cannot restart."""
    path, _ = select_checkpoint(config.run.out, checksum=False, distributed=False,
                                allow_unverified=config.checkpoint.allow_unverified)
    if path is not None:
        if rank == 0:
            print(f"attnpool train: torchrun's restart {restart}: resuming from {path}", flush=True)
        return config.replace(resume=True)
    if finished_checkpoints(config.run.out):  # (not an earlier run's, which --resume would continue: this one's)
        raise TrainingError(f"torchrun's restart {restart}: no valid checkpoint to restart from in "
                            f"{checkpoint_root(config.run.out)}")
    return config


# Warnings that tell a user of attnpool nothing they can act on, by message (a regular expression of its start)
QUIET_WARNINGS = (
    # a step whose loss was not finite skips the optimizer's update, and on purpose not the schedule's
    r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`",
    # the CUTLASS DSL, on every compilation of FlashAttention-4's kernels (fa4): flash_attn.cute passes its
    # auxiliary tensors as an object the DSL does not convert, and says so (text as vLLM's logs show it)
    r"Argument aux_data \(position \d+\) cannot be converted to a JitArgument",
)
# ... and in the processes multiprocessing starts beside the ranks (PYTHONWARNINGS): its resource tracker's count of
# the semaphores torch's workers leave for it to clean up at exit
QUIET_CHILD_WARNINGS = ("ignore:resource_tracker:UserWarning",)


# NCCL's watchdog, when a collective waits past its timeout, sleeps four times TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC
# (15 s by default) for the ranks' debug dumps before it takes the process down: a silent peer was named a minute
# late (bench/results/2026-11-28-h100x2-gpu-faults.md). 4 s here; a user's own setting wins.
NCCL_ENV = {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000"}


def quiet_warnings() -> None:
    """Silence QUIET_WARNINGS here, and QUIET_CHILD_WARNINGS in the processes started from here."""
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    present = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    os.environ["PYTHONWARNINGS"] = ",".join(present + [w for w in QUIET_CHILD_WARNINGS if w not in present])


def _run_rank(config: TrainConfig, rank: int, world: int, init_method: str | None) -> None:
    quiet_warnings()
    device = rank_device(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and config.memory.optimizer_offload:
        # FSDP2's host-resident gradients meet collectives too (tensor parallelism's gradient norm): gloo carries those
        backend = "cuda:nccl,cpu:gloo"
    timeout = timedelta(seconds=config.faults.collective_timeout_s)
    store = _torchrun_attempt_store(world, timeout) if init_method is None else None
    with process_group(backend, init_method=init_method, store=store, rank=rank, world_size=world, timeout=timeout,
                       device_id=device if device.type == "cuda" else None):
        train(config)


def _torchrun_attempt_store(world: int, timeout: timedelta):
    """Under torchrun, the agent's store with a prefix of this attempt (None where the agent hosts none).
    The agent keeps one store across restarts, and the process group's keys of an attempt that died stay
    in it: a restarted worker would read its dead peers' addresses and hang or fail connecting."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"attnpool/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def _die_with_parent(launcher: int) -> None:
    """Linux: a SIGTERM to this worker when its launcher (pid ``launcher``) dies (even by SIGKILL), so that no
    worker trains on as an orphan; it checkpoints and leaves as on any SIGTERM. A launcher already gone before
    this was asked for sends none: then the worker leaves at once."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher:
        os._exit(1)


def _spawned(index: int, config: TrainConfig, world: int, init_method: str, errors_dir: str, launcher: int) -> None:
    _die_with_parent(launcher)
    os.environ["LOCAL_RANK"] = str(index)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        _run_rank(config, index, world, init_method)
    except (ConfigError, TrainingError) as exc:
        report = ("config", *portable(exc)) if isinstance(exc, ConfigError) else \
            ("training", str(exc), exc.restartable)
        with open(os.path.join(errors_dir, f"{index}.tmp"), "wb") as fh:
            pickle.dump(report, fh)
        os.replace(os.path.join(errors_dir, f"{index}.tmp"), os.path.join(errors_dir, f"{index}.err"))
        end_process(2 if isinstance(exc, ConfigError) else 1)
    end_process(0)  # see attnpool.comm.process: no interpreter teardown with a group still referenced


def _reported_errors(errors_dir: str) -> dict[int, tuple]:
    found = {}
    for name in sorted(os.listdir(errors_dir)):
        if name.endswith(".err"):
            with open(os.path.join(errors_dir, name), "rb") as fh:
                found[int(name[:-4])] = pickle.load(fh)
    return found


def use_growable_segments() -> None:
    """Every step's shapes differ (documents are packed anew): growable segments keep the caching allocator
    from fragmenting (attnpool.train.memory's calibration is measured with them). Takes effect where it
    runs before CUDA starts in the process (the allocator reads its settings then); a user's own
    PYTORCH_CUDA_ALLOC_CONF wins. Set after CUDA started, it would be silently off: warned of here."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if torch.cuda.is_initialized():
        warnings.warn("growable segments asked for after CUDA started in this process: the allocator keeps the "
                      "settings it started with (call use_growable_segments() before anything touches the GPU)",
                      stacklevel=2)


def _launch(config: TrainConfig) -> str | None:
    """One start of ``nproc`` workers. None when they all finished; bad input and runs that cannot go on are
    raised; a worker lost (killed, crashed, or named by its peers as stopped) comes back as one line saying
    which, for the caller to restart from."""
    nproc = config.run.nproc
    init_method = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as errors_dir:
        context = mp.start_processes(_spawned, args=(config, nproc, init_method, errors_dir, os.getpid()),
                                     nprocs=nproc, join=False, start_method="spawn")
        try:
            with ForwardSigterm(context.processes) as forward:
                ended = _wait_for_workers(context.processes, LEAVE_GRACE_S)
        finally:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        if ended is None:
            return None
        failed, silent = ended
        errors = _reported_errors(errors_dir)
        first = WorkerFailure.of(failed, context.processes[failed].exitcode, context.error_files[failed])
    return _lost_rank_or_raise(errors, first, forward.forwarded, silent_ranks(config.run.out, silent))


# After a worker fails, how long the others have to leave on their own (their collectives with the lost rank fail,
# and they agree on which rank stopped: comm.watchdog's SURVIVOR_GRACE_S), before they are killed.
LEAVE_GRACE_S = 10.0


def _wait_for_workers(processes, grace_s: float) -> tuple[int, list[int]] | None:
    """Wait for the workers; None when every one exited with 0. Else the index of the first that failed and those
    of the silent ones, once the others have left: on their own within ``grace_s``, but a process stopped by a
    signal (SIGSTOP: it never acts on anything) is not waited for; what is left then is silent, and killed."""
    import multiprocessing.connection

    while True:
        # One look at every exit code (each read of exitcode asks the system anew), a failure first: workers that
        # all fail at once (a refusal raised on every rank) may all have left by the time they are looked at, and
        # were once taken for a run that finished.
        codes = [p.exitcode for p in processes]
        failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
        if failed is not None:
            break
        running = [p for p, code in zip(processes, codes) if code is None]
        if not running:
            return None
        multiprocessing.connection.wait([p.sentinel for p in running], timeout=1.0)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.is_alive() and not _stopped(p.pid) for p in processes):
        time.sleep(0.1)
    silent = [i for i, p in enumerate(processes) if p.is_alive()]
    for p in processes:
        if p.is_alive():
            p.kill()  # (SIGKILL: a stopped process never acts on SIGTERM)
        p.join()
    return failed, silent


def _stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (Linux: its state in /proc; elsewhere: not known, so no)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


@dataclass(frozen=True)
class WorkerFailure:
    """The first worker that failed: its index, the signal that killed it (if one did), and what it raised."""

    error_index: int
    signal_name: str | None
    said: str

    @classmethod
    def of(cls, index: int, exitcode: int, error_file: str) -> "WorkerFailure":
        name = None
        if exitcode is not None and exitcode < 0:
            try:
                name = signal.Signals(-exitcode).name
            except ValueError:
                name = f"signal {-exitcode}"
        said = f"exit code {exitcode}"
        try:  # what torch's spawn wrapper wrote where the worker raised: its traceback
            with open(error_file, "rb") as fh:
                said = str(pickle.load(fh))
        except (OSError, EOFError, pickle.UnpicklingError):
            pass
        return cls(index, name, said)

    def __str__(self) -> str:
        return self.said


def silent_ranks(out: str, ranks: list[int]) -> str:
    """The silent ranks by name, pid, host and step, from their records (attnpool.comm.watchdog)."""
    return ", ".join(describe_rank(out, r) for r in ranks)


def _lost_rank_or_raise(errors: dict[int, tuple], first: WorkerFailure, forwarded: bool, silent: str = "") -> str:
    """What ended a start that failed: bad input first, then a run that cannot go on (both raised); else the
    rank that was lost, in one line: where the first to fail was aborted (NCCL's watchdog takes a rank down with
    SIGABRT when its collective waits past the timeout) while others had fallen silent, the silent ones."""
    for kind, *said in errors.values():
        if kind == "config":
            raise ConfigError(*said) from None
    for kind, *said in errors.values():
        if kind == "training" and not said[1]:
            raise TrainingError(said[0]) from None
    if forwarded:  # stopped on request: no restart
        raise TrainingError(f"stopped by SIGTERM, and rank {first.error_index} did not leave cleanly ({first})")
    if first.signal_name == "SIGABRT" and silent:  # (a rank killed from outside leaves its peers to time out)
        return (f"{silent} stopped responding: rank {first.error_index} was then ended by NCCL's watchdog (SIGABRT), "
                "its collective having waited collective_timeout_s")
    if first.signal_name:
        return f"rank {first.error_index} was killed by {first.signal_name}"
    lost = [said[0] for kind, *said in errors.values() if kind == "training"]
    if lost:
        return lost[0]
    return f"rank {first.error_index} failed: {str(first).strip().splitlines()[-1][:200]}"
