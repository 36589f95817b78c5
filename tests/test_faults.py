"""Surviving failures, as a user meets them on the command line (gloo, tiny model, float32 on CPU).

Faults are injected from outside, as they happen: a worker killed with SIGKILL, a launcher stopped with
SIGTERM, a worker frozen with SIGSTOP, bytes of a checkpoint overwritten, a shard truncated or deleted,
a learning rate that sends the loss to NaN. In every case the run loses no step beyond its last
checkpoint, never loads a wrong model, and never hangs silently.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import background
import pytest

from attnpool.bench.faults import TINY_RUN, cpu_env, damage, losses, metrics_rows, wait_for_step, wait_gone, workers
from attnpool.cli.main import main
from attnpool.train.checkpoint import MANIFEST, finished_checkpoints, verify_checkpoint
from command import run_command

# The runs are background jobs (tests/background.py): started as the session starts, two at a time, each test
# reading its own. Only the stalled worker's, whose timing is what it checks, runs with nothing beside it.
ENV = cpu_env()  # (as the session started: no test's monkeypatch)


def train_cli(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """``attnpool train`` with the tiny run's settings and ``args``, to its end (attnpool.bench.faults.train_cli,
    with the session's environment)."""
    return subprocess.run([sys.executable, "-m", "attnpool.cli.main", "train", *TINY_RUN, *args], check=False,
                          capture_output=True, text=True, env=ENV, cwd=background.ROOT, timeout=timeout)


def start_train(*args, log, torchrun: tuple = ()) -> subprocess.Popen:
    """``attnpool train`` as :func:`train_cli`, in the background, its output to the open file ``log``; with
    ``torchrun`` (its arguments), under torchrun (attnpool.bench.faults.start_train)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", *torchrun] if torchrun else [sys.executable]
    return subprocess.Popen([*launcher, "-m", "attnpool.cli.main", "train", *TINY_RUN, *args], stdout=log,
                            stderr=subprocess.STDOUT, text=True, env=ENV, cwd=background.ROOT)


@background.job("test_checkpoints_have_a_manifest_and_the_newest_are_kept",
                "test_a_corrupted_checkpoint_is_skipped_and_the_run_continues_exactly",
                "test_sigterm_checkpoints_the_step_and_resume_continues_exactly",
                "test_killed_workers_restart_from_the_last_checkpoint_and_lose_nothing",
                "test_torchrun_restarts_resume_by_themselves")
def reference(tmp) -> str:
    """An uninterrupted run on 2 processes: 10 steps, the losses every faulty run must reproduce; a checkpoint every
    2 steps, the newest 2 kept. Its directory."""
    out = str(tmp / "reference")
    done = train_cli("--nproc", "2", "--steps", "10", "--checkpoint-every", "2", "--keep-checkpoints", "2",
                     "--out", out)
    assert done.returncode == 0, done.stderr
    return out


# --- Checkpoints: atomic, verified, kept ------------------------------------------------------------------


def test_checkpoints_have_a_manifest_and_the_newest_are_kept():
    out = reference.result()
    assert [step for step, _ in finished_checkpoints(out)] == [8, 10]
    assert not [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.endswith(".partial")]
    for _, path in finished_checkpoints(out):
        manifest = json.load(open(os.path.join(path, MANIFEST)))
        assert set(manifest["files"]) == set(os.listdir(path)) - {MANIFEST}
        assert manifest["config"]["steps"] == 10 and manifest["step"] == int(path[-6:])
        assert verify_checkpoint(path) is None


@background.job("test_a_corrupted_checkpoint_is_skipped_and_the_run_continues_exactly")
def corrupted_then_resumed(tmp):
    """A run stopped at step 6 of 10 (a checkpoint every 2 steps), its newest checkpoint overwritten in its middle,
    then resumed: its directory, the damaged file and the resume."""
    out = str(tmp / "run")
    first = train_cli("--nproc", "2", "--steps", "10", "--stop-at", "6", "--checkpoint-every", "2", "--out", out)
    assert first.returncode == 0, first.stderr
    bad = damage(os.path.join(out, "checkpoints", "step-000006"), "overwrite")
    resumed = train_cli("--nproc", "2", "--steps", "10", "--checkpoint-every", "2", "--resume", "--out", out)
    return out, bad, resumed


def test_a_corrupted_checkpoint_is_skipped_and_the_run_continues_exactly():
    """The newest checkpoint overwritten in its middle: resume says so, takes the one before, and the steps
    it then trains are the uninterrupted run's."""
    out, bad, resumed = corrupted_then_resumed.result()
    assert resumed.returncode == 0, resumed.stderr
    assert f"skipping {os.path.dirname(bad)}: {bad} does not match its SHA-256" in resumed.stdout
    assert "resumed from" in resumed.stdout and "step-000004" in resumed.stdout
    assert losses(out) == losses(reference.result())
    # The run wrote step 6 again: the damaged one is kept aside, for a look
    assert os.path.isdir(os.path.join(out, "checkpoints", "step-000006.damaged"))
    assert verify_checkpoint(os.path.join(out, "checkpoints", "step-000006")) is None


@background.job("test_the_only_checkpoint_damaged_is_refused_in_one_line_naming_the_file",
                "test_damaged_dcp_metadata_is_named_as_a_hash_mismatch",
                "test_a_checkpoint_without_manifest_resumes_only_when_allowed",
                "test_resume_that_changes_the_run_asks_for_allow_config_change")
def stopped_run(tmp) -> str:
    """A run of 2 processes stopped at step 2 of 4, its one checkpoint at step 2: each test damages a copy."""
    out = str(tmp / "run")
    done = train_cli("--nproc", "2", "--steps", "4", "--stop-at", "2", "--out", out)
    assert done.returncode == 0, done.stderr
    return out


def copy_of(run: str, where) -> tuple[str, str]:
    """A copy of ``run`` at ``where``, and its checkpoint's directory."""
    out = str(where)
    shutil.copytree(run, out)
    return out, os.path.join(out, "checkpoints", "step-000002")


def resume_in_process(out: str, capsys, *more) -> tuple[int, str]:
    """``attnpool train --resume`` in this process: what it refuses before starting any worker."""
    code = main(["train", *TINY_RUN, "--nproc", "2", "--steps", "4", "--resume", "--out", out, *more])
    return code, capsys.readouterr().err


@background.job("test_the_only_checkpoint_damaged_is_refused_in_one_line_naming_the_file", needs=(stopped_run,))
def overwritten_then_resumed(tmp):
    """The stopped run's only checkpoint overwritten in its middle (found by the files' hashes, which the workers
    share), then resumed: the damaged file and the resume."""
    out, checkpoint = copy_of(stopped_run.result(), tmp / "run")
    return damage(checkpoint, "overwrite"), train_cli("--nproc", "2", "--steps", "4", "--resume", "--out", out)


@pytest.mark.parametrize("how", ["overwrite", "truncate", "delete"])
def test_the_only_checkpoint_damaged_is_refused_in_one_line_naming_the_file(tmp_path, capsys, how):
    if how == "overwrite":  # found by the files' hashes, which the workers share
        bad, resumed = overwritten_then_resumed.result()
        code, err = resumed.returncode, resumed.stderr
    else:  # found by the files' sizes, before any worker starts
        out, checkpoint = copy_of(stopped_run.result(), tmp_path / "run")
        bad = damage(checkpoint, how)
        code, err = resume_in_process(out, capsys)
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert bad in err and "no valid checkpoint" in err


def test_damaged_dcp_metadata_is_named_as_a_hash_mismatch(tmp_path, capsys):
    """Not as "another model shape": DCP's metadata is read to check the shape, after its hash."""
    out, checkpoint = copy_of(stopped_run.result(), tmp_path / "run")
    metadata = os.path.join(checkpoint, ".metadata")
    with open(metadata, "r+b") as fh:
        fh.seek(os.path.getsize(metadata) // 2)
        fh.write(b"\x00" * 64)
    code, err = resume_in_process(out, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{metadata} does not match its SHA-256" in err and "model shape" not in err


def without_manifest(run: str, where) -> tuple[str, str]:
    out, checkpoint = copy_of(run, where)
    os.remove(os.path.join(checkpoint, MANIFEST))
    return out, checkpoint


def test_a_manifest_that_is_not_an_object_is_a_damaged_checkpoint(tmp_path):
    """Valid JSON but not the manifest's object ([] or null): a problem like any damage (a resume takes an older
    checkpoint or names it), not a crash."""
    _, checkpoint = copy_of(stopped_run.result(), tmp_path / "run")
    for text in ("[]", "null"):
        with open(os.path.join(checkpoint, MANIFEST), "w") as fh:
            fh.write(text)
        problem = verify_checkpoint(checkpoint, distributed=False)
        assert problem is not None and "manifest is unreadable" in problem, problem


def test_a_checkpoint_that_does_not_read_is_retried_and_never_passed_over(tmp_path, monkeypatch):
    """An I/O error is the storage's, not the checkpoint's: a read that fails once is tried again, and one that keeps
    failing stops the resume (restartable) instead of going back to an older checkpoint, which would redo the steps
    since and set this one aside as damaged at the next save."""
    import errno

    from attnpool.errors import TrainingError
    from attnpool.train import checkpoint as ckpt

    out, newest = copy_of(stopped_run.result(), tmp_path / "run")
    shutil.copytree(newest, os.path.join(out, "checkpoints", "step-000001"))  # an older, valid one
    hash_file, failures = ckpt._sha256, []
    monkeypatch.setattr(ckpt.time, "sleep", lambda s: None)

    def flaky(file, fail_times):
        if file.startswith(newest) and len(failures) < fail_times:
            failures.append(file)
            raise OSError(errno.EIO, "Input/output error")
        return hash_file(file)
    monkeypatch.setattr(ckpt, "_sha256", lambda file: flaky(file, fail_times=1))
    assert ckpt.select_checkpoint(out, distributed=False) == (newest, [])
    assert len(failures) == 1
    failures.clear()
    monkeypatch.setattr(ckpt, "_sha256", lambda file: flaky(file, fail_times=10 ** 6))
    with pytest.raises(TrainingError, match="a storage error, not a damaged checkpoint") as raised:
        ckpt.select_checkpoint(out, distributed=False)
    assert raised.value.restartable and "Input/output error" in str(raised.value) and newest in str(raised.value)
    assert len(failures) == ckpt.READ_ATTEMPTS
    # A look at a file that fails (a stale mount: os.stat's EIO) is not a missing file either, and a permission
    # error is final; what a rank found keeps that through the ranks' all-gather (pickled).
    monkeypatch.setattr(ckpt, "_sha256", hash_file)
    look = os.stat

    def failing_stat(path, *args, **kwargs):
        if str(path).startswith(newest) and str(path).endswith(MANIFEST):
            raise PermissionError(errno.EACCES, "Permission denied")
        return look(path, *args, **kwargs)
    monkeypatch.setattr(ckpt.os, "stat", failing_stat)
    problem = ckpt.verify_checkpoint(newest, distributed=False)
    assert isinstance(problem, ckpt.ReadFailure) and "Permission denied" in problem and not problem.restartable
    import pickle

    again = pickle.loads(pickle.dumps(problem))
    assert isinstance(again, ckpt.ReadFailure) and again == problem and again.restartable is False
    with pytest.raises(TrainingError, match="its files cannot be looked at") as raised:
        ckpt.select_checkpoint(out, distributed=False)
    assert not raised.value.restartable


def test_exports_are_never_lost_to_a_crash_or_to_their_names_order(tmp_path):
    """A crash between write_directory_aside's two renames left the previous export aside: the next export puts it
    back before anything else, so a failure then still leaves it in place. Per-checkpoint exports are pruned
    newest by step, not by name."""
    from attnpool.train.export import prune_exports, write_directory_aside

    target = tmp_path / "hf"
    (tmp_path / "hf.replaced").mkdir()
    (tmp_path / "hf.replaced" / "model.safetensors").write_text("previous")

    def disk_full(path):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_directory_aside(str(target), disk_full)
    assert (target / "model.safetensors").read_text() == "previous"
    write_directory_aside(str(target), lambda path: (os.makedirs(path), open(os.path.join(path, "x"), "w").close()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and os.listdir(target) == ["x"]
    exports = tmp_path / "hf-exports"
    for step in (999_998, 999_999, 1_000_000):
        (exports / f"step-{step:06d}").mkdir(parents=True)
    prune_exports(str(exports), 2)
    assert sorted(p.name for p in exports.iterdir()) == ["step-1000000", "step-999999"]


@background.job("test_a_checkpoint_without_manifest_resumes_only_when_allowed", needs=(stopped_run,))
def resumed_without_manifest(tmp):
    """Copies of the stopped run without their checkpoint's manifest, resumed with --allow-unverified: as it is (its
    directory and the resume), and with its first shard's first bytes overwritten (the resume)."""
    out, _ = without_manifest(stopped_run.result(), tmp / "run")
    resumed = train_cli("--nproc", "2", "--steps", "4", "--resume", "--allow-unverified", "--out", out)
    unreadable, checkpoint = without_manifest(stopped_run.result(), tmp / "unreadable")
    shard = sorted(n for n in os.listdir(checkpoint) if n.endswith(".distcp"))[0]
    # Its first bytes, zeros: the reader's unpickling fails on the first (random bytes would be another pickle
    # program on every run).
    with open(os.path.join(checkpoint, shard), "r+b") as fh:
        fh.write(b"\x00" * (1 << 16))
    refused = train_cli("--nproc", "2", "--steps", "4", "--resume", "--allow-unverified", "--out", unreadable)
    return out, resumed, refused


def test_a_checkpoint_without_manifest_resumes_only_when_allowed(tmp_path, capsys):
    """Written before manifests, or its manifest lost: refused unless --allow-unverified; then its files' sizes are
    checked against DCP's metadata, and files that do not read are refused in one line."""
    out, _ = without_manifest(stopped_run.result(), tmp_path / "run")
    code, err = resume_in_process(out, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "has no manifest.json" in err and "--allow-unverified" in err
    truncated = os.path.join(tmp_path, "truncated")
    shutil.copytree(out, truncated)
    bad = damage(os.path.join(truncated, "checkpoints", "step-000002"), "truncate")
    code, err = resume_in_process(truncated, capsys, "--allow-unverified")
    assert code == 2 and f"{bad} has " in err and "DCP's metadata needs" in err, err

    out, resumed, refused = resumed_without_manifest.result()
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and max(losses(out)) == 4
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "the checkpoint's files do not read" in refused.stderr


# --- Non-finite losses ------------------------------------------------------------------------------------


@background.job("test_nonfinite_losses_skip_the_step_then_end_the_run")
def diverged(tmp):
    """A run whose learning rate sends the loss to NaN: its directory and the run."""
    out = str(tmp / "run")
    return out, train_cli("--nproc", "2", "--steps", "12", "--lr", "1e9", "--warmup-steps", "0", "--grad-clip", "0",
                          "--checkpoint-every", "1", "--out", out)


def test_nonfinite_losses_skip_the_step_then_end_the_run():
    out, done = diverged.result()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "not finite" in done.stderr and "max_nonfinite_steps" in done.stderr
    rows = metrics_rows(out)  # valid JSON throughout: a NaN is written as null
    skipped = [r for r in rows if r["skipped_step"]]
    assert len(skipped) == 3 and [r["step"] for r in skipped] == list(range(rows[-1]["step"] - 2, rows[-1]["step"] + 1))
    assert all(r["loss"] is None or r["grad_norm"] is None for r in skipped)
    assert rows[-1]["nonfinite_steps"] == 3
    # No checkpoint of a skipped step: the last one is of the last step the optimizer took.
    assert finished_checkpoints(out)[-1][0] == skipped[0]["step"] - 1


# --- Resume with another config ---------------------------------------------------------------------------


@background.job("test_resume_that_changes_the_run_asks_for_allow_config_change", needs=(stopped_run,))
def resumed_with_more_steps(tmp):
    """A copy of the stopped run (4 steps, lr 3e-3) resumed with 5 steps, lr 1.5e-3 and --allow-config-change: its
    directory, the run."""
    out, _ = copy_of(stopped_run.result(), tmp / "run")
    return out, train_cli("--nproc", "2", "--steps", "5", "--lr", "1.5e-3", "--resume", "--allow-config-change",
                          "--out", out)


def test_resume_that_changes_the_run_asks_for_allow_config_change(tmp_path):
    out, _ = copy_of(stopped_run.result(), tmp_path / "run")
    config = open(os.path.join(out, "config.yaml")).read()
    refused = run_command("train", *TINY_RUN, "--nproc", "2", "--steps", "5", "--resume", "--out", out)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "steps" in refused.stderr and "--allow-config-change" in refused.stderr
    assert open(os.path.join(out, "config.yaml")).read() == config
    out, allowed = resumed_with_more_steps.result()  # (the same copy, resumed with the flag)
    assert allowed.returncode == 0, allowed.stderr
    assert "steps: 4 -> 5" in allowed.stdout and "lr: 0.003 -> 0.0015" in allowed.stdout and max(losses(out)) == 5
    # the new peak learning rate from the first resumed step (warm-up: step s at s/10 of it), not the checkpoint's
    assert [(r["step"], round(r["lr"], 12)) for r in metrics_rows(out)][2:] == [(3, 4.5e-4), (4, 6e-4), (5, 7.5e-4)]
    assert os.path.exists(os.path.join(out, "config.step-000002.yaml"))


def test_data_changed_on_purpose_is_not_compared_with_the_checkpoints(tmp_path):
    """With --allow-config-change and a data setting changed (another tokenizer, other data_args), the documents
    at the checkpoint's place differ by intent: the resume does not compare them (changes_data); a change of
    other settings alone still does."""
    from attnpool.train.config import load_config
    from attnpool.train.resume import changes_data

    out, checkpoint = copy_of(stopped_run.result(), tmp_path / "run")
    config = load_config(os.path.join(out, "config.yaml")).replace(out=out, allow_config_change=True)
    assert not changes_data(config, checkpoint)
    assert not changes_data(config.replace(lr=1e-3), checkpoint)
    assert changes_data(config.replace(data="synthetic"), checkpoint)


# --- Preemption, killed workers, stalled workers ----------------------------------------------------------


@background.job("test_sigterm_checkpoints_the_step_and_resume_continues_exactly")
def stopped_by_sigterm(tmp):
    """A run whose launcher gets a SIGTERM at step 3 or later, then resumed: its directory, its workers still alive
    after the launcher left, its last step and newest checkpoint's then, its log, and the resume."""
    out = str(tmp / "run")
    with open(tmp / "log", "w") as log:
        proc = start_train("--nproc", "2", "--steps", "10", "--checkpoint-every", "2", "--out", out, log=log)
        wait_for_step(out, 3, proc)
        pids = workers(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, open(tmp / "log").read()
    alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    stopped, checkpoint = max(losses(out)), finished_checkpoints(out)[-1][0]
    resumed = train_cli("--nproc", "2", "--steps", "10", "--checkpoint-every", "2", "--resume", "--out", out)
    return out, alive, stopped, checkpoint, open(tmp / "log").read(), resumed


def test_sigterm_checkpoints_the_step_and_resume_continues_exactly():
    out, alive, stopped, checkpoint, log, resumed = stopped_by_sigterm.result()
    assert not alive  # no orphans left training
    assert stopped < 10 and checkpoint == stopped
    assert "SIGTERM" in log
    assert resumed.returncode == 0, resumed.stderr
    assert losses(out) == losses(reference.result())


@background.job("test_killed_workers_restart_from_the_last_checkpoint_and_lose_nothing")
def killed_twice(tmp):
    """SIGKILL to a random worker at a random step, twice in one run: its directory and log."""
    out = str(tmp / "run")
    rng = random.Random(0)
    with open(tmp / "log", "w") as log:
        proc = start_train("--nproc", "2", "--steps", "10", "--checkpoint-every", "2", "--max-restarts", "3", "--out", out,
                           log=log)
        for at in (rng.randint(2, 4), rng.randint(6, 8)):
            wait_for_step(out, at, proc)
            pids = workers(proc.pid)
            os.kill(rng.choice(pids), signal.SIGKILL)
            assert wait_gone(pids)  # the whole attempt is gone before the next fault
        assert proc.wait(timeout=300) == 0, open(tmp / "log").read()
    return out, open(tmp / "log").read()


def test_killed_workers_restart_from_the_last_checkpoint_and_lose_nothing():
    """SIGKILL to a random worker at a random step, twice in one run: all workers restart from the latest
    checkpoint, and the per-step losses are the uninterrupted run's, bit for bit."""
    out, text = killed_twice.result()
    assert text.count("restart 1 of 3") == 1 and text.count("restart 2 of 3") == 1, text
    assert "resuming from" in text
    assert losses(out) == losses(reference.result())


def torchrun_config(tmp_path) -> tuple[str, str]:
    """The demo's config with nproc 1, as a run under torchrun takes it (its processes are torchrun's; a --nproc
    flag after the script would be torchrun's own --nproc-per-node to its parser)."""
    config = tmp_path / "torchrun.yaml"
    config.write_text(open(background.ROOT / "configs" / "demo-cpu.yaml").read().replace("nproc: 4", "nproc: 1"))
    return "--config", str(config)


@background.job("test_torchrun_restarts_resume_by_themselves")
def killed_under_torchrun(tmp):
    """Under torchrun --max-restarts 1, a worker killed at step 3 or later: the run's directory and log."""
    out = str(tmp / "run")
    with open(tmp / "log", "w") as log:
        proc = start_train(*torchrun_config(tmp), "--steps", "10", "--checkpoint-every", "2", "--out", out, log=log,
                           torchrun=("--standalone", "--nproc_per_node", "2", "--max-restarts", "1", "--monitor-interval", "0.5"))
        wait_for_step(out, 3, proc)
        pids = workers(proc.pid)
        assert len(pids) == 2
        os.kill(random.Random(1).choice(pids), signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, open(tmp / "log").read()
    return out, open(tmp / "log").read()


def test_torchrun_restarts_resume_by_themselves():
    """Under torchrun --max-restarts, a killed worker: torchrun starts the workers again, and they resume
    from the latest checkpoint without being told."""
    out, text = killed_under_torchrun.result()
    assert "torchrun's restart 1: resuming from" in text
    assert losses(out) == losses(reference.result())


def test_a_stalled_worker_is_named_instead_of_a_silent_hang(tmp_path):
    out = str(tmp_path / "run")
    with background.quiet(), open(tmp_path / "log", "w") as log:  # (timed: no background job beside it)
        proc = start_train("--nproc", "2", "--steps", "50", "--collective-timeout-s", "10", "--out", out, log=log)
        wait_for_step(out, 2, proc)
        stalled = workers(proc.pid)[1]
        os.kill(stalled, signal.SIGSTOP)
        t0 = time.time()
        try:
            rc = proc.wait(timeout=120)
        finally:
            if os.path.exists(f"/proc/{stalled}"):
                os.kill(stalled, signal.SIGKILL)
        detected_s = time.time() - t0
    text = open(tmp_path / "log").read()
    assert rc == 1, text
    assert f"(pid {stalled} on " in text and "collective_timeout_s" in text, text
    # named within collective_timeout_s + 10 s: the survivor's collective times out, it waits 5 s for the other
    # survivors to say so, and the launcher kills the stopped rank at once (no SIGTERM it could not act on)
    assert detected_s < 10 + 10, detected_s
    assert "Terminating process" not in text and "SIGKILL" not in text, text


# --- First contact ----------------------------------------------------------------------------------------


def _cli(*args):
    from command import run_command  # (each is refused before any worker: in this process)

    return run_command(*args)


def test_the_command_line_starts_without_torch():
    """The parser of every subcommand, and `attnpool plan` itself, load without torch (which takes seconds)."""
    import subprocess
    import sys

    code = ("import sys, attnpool.cli.main as m; m.build_parser(); import attnpool.cli.plan_cmd, attnpool.sparse, "
            "attnpool.model, attnpool.train; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


@pytest.mark.parametrize("args, typed", [
    (("plan", "--tokens-per-server", "abc"), "--tokens-per-server"),
    (("train", "--bogus"), "--bogus"),
    (("train", "--config", "configs/demo-cpu.yaml", "--data", "text", "--data-path", "/no/such/dir"), "data_path="),
    (("train", "--config", "configs/demo-cpu.yaml", "--attention-backend", "fa4"), "attention_backend='fa4'"),
    (("train", "--config", "configs/demo-cpu.yaml", "--kernel", "flash"), "attention_backend='flash'"),  # its old name
])
def test_command_line_errors_are_one_line_naming_what_was_typed(args, typed):
    out = _cli(*args)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert typed in out.stderr and "usage:" not in out.stderr


@background.job("test_a_run_with_skipped_steps_resumes_and_reports")
def skipped_then_resumed(tmp):
    """A run whose learning rate makes some steps' losses NaN (up to 20 in a row allowed), stopped at step 6 of 10,
    then resumed: its directory, whether the first part skipped a step, and the resume."""
    out = str(tmp / "run")
    args = ("--nproc", "2", "--steps", "10", "--lr", "1e6", "--warmup-steps", "0", "--grad-clip", "0",
            "--max-nonfinite-steps", "20", "--checkpoint-every", "1", "--out", out)
    first = train_cli(*args, "--stop-at", "6")
    assert first.returncode == 0, first.stderr
    skipped = any(r["skipped_step"] for r in metrics_rows(out))
    return out, skipped, train_cli(*args, "--resume")


def test_a_run_with_skipped_steps_resumes_and_reports():
    """Skipped steps leave null losses in metrics.jsonl; a resume reads them back and still summarises."""
    out, skipped, resumed = skipped_then_resumed.result()
    assert skipped
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr
    assert os.path.exists(os.path.join(out, "summary.json"))


@background.job("test_torchrun_does_not_restart_a_run_that_would_fail_the_same_way")
def diverged_under_torchrun(tmp):
    """A run that non-finite losses end, under torchrun --max-restarts 2: its exit code and log."""
    out = str(tmp / "run")
    with open(tmp / "log", "w") as log:
        proc = start_train(*torchrun_config(tmp), "--steps", "12", "--lr", "1e6", "--warmup-steps", "0", "--grad-clip", "0",
                           "--checkpoint-every", "1", "--out", out, log=log,
                           torchrun=("--standalone", "--nproc_per_node", "2", "--max-restarts", "2",
                                     "--monitor-interval", "0.5"))
        rc = proc.wait(timeout=300)
    return rc, open(tmp / "log").read()


def test_torchrun_does_not_restart_a_run_that_would_fail_the_same_way():
    """A run ended by non-finite losses is not started again by torchrun --max-restarts from its last
    checkpoint (it would diverge the same way): the restarted workers stop at once, saying why."""
    rc, text = diverged_under_torchrun.result()
    assert rc != 0 and "max_nonfinite_steps" in text, text
    assert "torchrun's restart 1 would repeat it" in text and "resuming from" not in text, text


def test_a_rank_aborted_by_nccls_watchdog_names_the_silent_one(tmp_path):
    """On NCCL a survivor does not get to name its silent peer: the watchdog takes it down (SIGABRT) once its collective
    waits past the timeout. The launcher names the ranks still there, silent, from their records; a rank killed from
    outside is named as such (its peers then time out)."""
    from attnpool.comm.watchdog import RankRecords
    from attnpool.train.launch import WorkerFailure, _lost_rank_or_raise, silent_ranks

    RankRecords(str(tmp_path), 1, 2).step(3)
    silent = silent_ranks(str(tmp_path), [1])
    assert silent == f"rank 1 (pid {os.getpid()} on {os.uname().nodename}, in step 3)"
    said = _lost_rank_or_raise({}, WorkerFailure(0, "SIGABRT", ""), False, silent)
    assert said.startswith(f"{silent} stopped responding: rank 0 was then ended by NCCL's watchdog"), said
    assert _lost_rank_or_raise({}, WorkerFailure(1, "SIGKILL", ""), False, "rank 0") == "rank 1 was killed by SIGKILL"


def test_workers_that_all_failed_before_the_launcher_looked_are_a_failure():
    """Every rank refusing at once (a ConfigError raised on every rank) can leave every worker gone before the
    launcher's first look: once that was taken for a run that finished, exit code 0 and nothing said (it failed
    two tests, one run in many)."""
    import multiprocessing

    from attnpool.train.launch import _wait_for_workers

    context = multiprocessing.get_context("fork")  # (nothing runs in the workers but their exit)
    workers = [context.Process(target=os._exit, args=(code,)) for code in (0, 2, 2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert _wait_for_workers(workers, 1.0) == (1, [])
    finished = [context.Process(target=os._exit, args=(0,)) for _ in range(2)]
    for worker in finished:
        worker.start()
        worker.join()
    assert _wait_for_workers(finished, 1.0) is None


# --- A checkpoint that cannot be written -----------------------------------------------------------------------


def _save_that_fails(rank, world, out, where):
    """save_checkpoint of a tiny model on every rank where ``where`` makes it fail: "disk" (its directory is under
    a file, so DCP's writer fails) or "hash" (reading back rank 1's share of the files fails); what each rank
    raised."""
    import torch

    import attnpool.train.checkpoint as checkpoint
    from attnpool.data import DocumentStream, make_source
    from attnpool.errors import TrainingError
    from attnpool.model import Transformer, model_config

    torch.manual_seed(0)
    model = Transformer(model_config("tiny", dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64))
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    stream = DocumentStream(make_source("synthetic", dist="prolong", vocab_size=64, seed=0), world, 256, 0)
    path = f"{out}/blocker/step-000001" if where == "disk" else f"{out}/checkpoints/step-000001"
    if where == "disk" and rank == 0:
        open(f"{out}/blocker", "w").close()
    torch.distributed.barrier()
    sha256 = checkpoint._sha256
    if where == "hash" and rank == 1:
        checkpoint._sha256 = lambda file: (_ for _ in ()).throw(OSError(f"cannot read {os.path.basename(file)}"))
    try:
        checkpoint.save_checkpoint(path, model, optimizer, scheduler, stream, 1)
    except TrainingError as exc:
        return str(exc) if exc.restartable else f"not restartable: {exc}"
    finally:
        checkpoint._sha256 = sha256  # (the harness keeps its processes)
    return None


@pytest.mark.parametrize("where", ["disk", "hash"])
def test_a_checkpoint_that_cannot_be_written_fails_on_every_rank(tmp_path, where):
    """A save that fails on one rank (or in DCP's writer, whose exception is a BaseException that passed every
    handler) is a TrainingError on every rank, naming the checkpoint and the cause, not a hang in the next
    collective; no checkpoint of it is left to resume from. A path through a file is final (a restart would fail
    the same way); a read that fails for no such reason may not be."""
    from dist_harness import run_distributed

    said = run_distributed(_save_that_fails, 2, str(tmp_path), where)
    assert all(s is not None and "step-000001: the checkpoint was not written" in s for s in said), said
    assert all(s.startswith("not restartable") == (where == "disk") for s in said), said
    if where == "hash":
        assert all("on rank 1 (OSError: cannot read" in s for s in said), said
        assert not os.path.isdir(tmp_path / "checkpoints" / "step-000001")


def test_a_metrics_log_cut_mid_line_resumes_and_one_damaged_before_is_named(tmp_path):
    """The last line of metrics.jsonl cut by a process that ended while writing it is dropped at a resume (its step
    is past the checkpoint); a line before it that does not parse is refused by number, not a JSON traceback."""
    from attnpool.errors import TrainingError
    from attnpool.train.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    log = MetricsLog(str(tmp_path), True, resume_step=2)
    assert [r["step"] for r in log.rows] == [1, 2]
    log.start()
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(TrainingError, match="metrics.jsonl: line 2 is not a metrics row"):
        MetricsLog(str(tmp_path), True, resume_step=2)


def test_a_run_file_that_cannot_be_written_is_one_error_and_a_full_disk_is_not_restarted(tmp_path, monkeypatch):
    """Rank 0's own writes (metrics.jsonl here; config.yaml and the summary alike) fail as a TrainingError naming
    the file, which the launcher reports in one line: final for a full disk or a path through a file (a restart
    would meet it again), restartable for an I/O error that may pass."""
    import errno

    from attnpool.errors import TrainingError
    from attnpool.train import metrics

    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    log = metrics.MetricsLog(str(blocker / "run"), True, resume_step=None)
    with pytest.raises(TrainingError, match=f"{blocker}/run/metrics.jsonl: Not a directory") as raised:
        log.start()
    assert not raised.value.restartable
    log = metrics.MetricsLog(str(tmp_path), True, resume_step=None)
    log.start()
    for code, restartable in ((errno.ENOSPC, False), (errno.EIO, True)):
        def failing_open(*args, code=code, **kwargs):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(metrics, "open", failing_open, raising=False)
        with pytest.raises(TrainingError, match=os.strerror(code)) as raised:
            log.append({"step": 1, "loss": 1.0})
        assert raised.value.restartable == restartable


def test_a_torchrun_restart_with_every_checkpoint_damaged_stops_saying_so(tmp_path, monkeypatch, capsys):
    """torchrun started the workers again and no checkpoint of the run is valid: a final error saying that (recorded,
    so that torchrun's next restart stops at once), not the advice for a new run into an old directory ("pass
    --resume")."""
    out, checkpoint = copy_of(stopped_run.result(), tmp_path / "run")
    damage(checkpoint, "truncate")
    for key, value in {"TORCHELASTIC_RUN_ID": "test", "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
                       "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(key, value)
    code = main(["train", *TINY_RUN, "--steps", "4", "--out", out, "--nproc", "1"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "torchrun's restart 1: no valid checkpoint to restart from" in err and "--resume" not in err
    from attnpool.train.launch import FINAL_ERROR, RANKS_DIR

    assert os.path.isfile(os.path.join(out, RANKS_DIR, FINAL_ERROR))  # (torchrun's next restart stops at once)


def test_checkpoints_set_aside_as_damaged_go_once_older_than_every_kept_one(tmp_path):
    """A run that meets damaged checkpoints again and again does not fill its disk with them: one set aside is
    deleted once every checkpoint the run keeps is newer."""
    from attnpool.train.checkpoint import checkpoint_root, prune_damaged

    root = checkpoint_root(str(tmp_path))
    for name in ("step-000004.damaged", "step-000006.damaged", "step-000006", "step-000008", "notes.damaged"):
        os.makedirs(os.path.join(root, name))
    prune_damaged(str(tmp_path), below_step=6)
    assert sorted(os.listdir(root)) == ["notes.damaged", "step-000006", "step-000006.damaged", "step-000008"]


def test_a_resume_that_writes_a_token_count_otherwise_changes_nothing(tmp_path):
    """model_args' token counts are compared as counts: the window written '4K' in the checkpoint's run and 4096 now
    is the same run; 2048 is a change, refused by name."""
    from attnpool.errors import ConfigError
    from attnpool.train.config import TrainConfig
    from attnpool.train.resume import config_changes

    def run(window):
        return TrainConfig(model="tiny", model_args={"sliding_window": window}, out=str(tmp_path), device="cpu")

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / MANIFEST).write_text(json.dumps({"config": run("4K").to_dict(), "files": {}}))
    assert config_changes(run(4096), str(checkpoint)) == []
    with pytest.raises(ConfigError, match="model_args"):
        config_changes(run(2048), str(checkpoint))
