"""Slow parts of tests that only run commands, started in the background as the session starts.

On 2 cores most of an ``attnpool train`` command's time is its processes importing torch, one core each at a time,
and the in-process tests leave a core idle too: two such commands side by side take little longer than one, and
beside the other tests they cost little. A :func:`job` is a function of a fresh directory that runs commands (a
run, a torchrun bench, a doc block) and returns what the test reads, asserting what must hold on the way; the
tests that read it are named with it. When the session starts (tests/conftest.py), the jobs of the selected tests
are queued in the tests' order and run two at a time; ``job.result()`` in a test waits for it (or runs it there,
where it was not queued) and raises what it raised. A job only starts processes and reads and writes files: it
runs beside a test in this process, so it must not print here (a test's output capture is not a thread's), run a
command in this process, or touch its global state (torch's random generator, os.environ, the working directory).

:func:`quiet` holds the queue and waits for the running jobs, for a test whose timing is what it checks.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from concurrent.futures import Future
from pathlib import Path

WORKERS = 2
ROOT = Path(__file__).resolve().parents[1]
# The environment as the session started: a test's monkeypatch (RANK, WORLD_SIZE, ...) must not reach a command a
# job starts meanwhile. Commands run in the repository, as the tests' own do, and torch's operations in one thread
# where the command does not set it (as torchrun does for its workers, and the built-in launcher for its ranks): two
# OpenMP threads on cores shared with other processes wait for each other.
ENV = dict(os.environ)
ENV.setdefault("OMP_NUM_THREADS", "1")

_jobs: list[Job] = []
_queue: list[Job] = []
_cond = threading.Condition()
_state = {"running": 0, "held": 0, "threads": [], "mktemp": None, "closed": False}


class Job:
    def __init__(self, fn, tests: tuple[str, ...], needs: tuple[Job, ...]):
        self.fn, self.tests, self.needs = fn, set(tests), needs
        self.future: Future | None = None
        self.tmp = None
        self.__doc__ = fn.__doc__

    def wanted_by(self, items) -> bool:
        """Whether one of ``items`` is a test that reads it (named alone, or with its parameters' id)."""
        return any((getattr(item, "originalname", None) in self.tests or item.name in self.tests)
                   and os.path.samefile(item.path, self.fn.__code__.co_filename) for item in items)

    def _run(self, future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(self.fn(self.tmp))
        except BaseException as exc:  # noqa: BLE001 (an assertion in the job: the test that reads it fails with it)
            future.set_exception(exc)

    def submit(self) -> None:
        """Queue it, after the jobs it needs (queued earlier, they are running or done when it starts)."""
        for need in self.needs:
            need.submit()
        with _cond:
            if self.future is None:
                self.future, self.tmp = Future(), _state["mktemp"](self.fn.__name__)
                _queue.append(self)
                _start_threads()
                _cond.notify_all()

    def result(self):
        """What the job returned (waiting for it), or the exception it raised."""
        with _cond:
            inline = self.future is None
            if inline:
                self.future, self.tmp = Future(), _state["mktemp"](self.fn.__name__)
        if inline:  # not queued (no test that reads it was selected when the session started): run here
            self._run(self.future)
        return self.future.result()


def job(*tests: str, needs: tuple[Job, ...] = ()):
    """Register ``fn(tmp_path)`` as a background job read by the named tests of the module defining it (a name, or
    a name with a parametrized case's id: ``test_x[a-1]``); it calls ``result()`` of the jobs it ``needs``."""
    def register(fn) -> Job:
        made = Job(fn, tests, needs)
        _jobs.append(made)
        return made
    return register


def run(cmd: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``cmd`` to its end in the repository, with the session's environment (and ``env`` on top), its output
    captured."""
    return subprocess.run(cmd, check=False, cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def start(items, mktemp) -> None:
    """Queue the jobs of the selected tests ``items``, in the order of the first test that reads each."""
    _state["mktemp"] = mktemp
    for item in items:
        for made in _jobs:
            if made.future is None and made.wanted_by([item]):
                made.submit()


def stop() -> None:
    """At the session's end: drop what was not started, wait for what was."""
    with _cond:
        _state["closed"] = True
        for made in _queue:
            made.future.cancel()
        _queue.clear()
        _cond.notify_all()
    for thread in _state["threads"]:
        thread.join()


@contextlib.contextmanager
def quiet():
    """No job running meanwhile: the queue held, those running finished first."""
    with _cond:
        _state["held"] += 1
        _cond.wait_for(lambda: _state["running"] == 0)
    try:
        yield
    finally:
        with _cond:
            _state["held"] -= 1
            _cond.notify_all()


def _start_threads() -> None:
    while len(_state["threads"]) < WORKERS:
        thread = threading.Thread(target=_work, name="background-job", daemon=True)
        _state["threads"].append(thread)
        thread.start()


def _work() -> None:
    while True:
        with _cond:
            _cond.wait_for(lambda: _state["closed"] or (_queue and not _state["held"]))
            if not _queue:
                return
            made = _queue.pop(0)
            _state["running"] += 1
        try:
            made._run(made.future)
        finally:
            with _cond:
                _state["running"] -= 1
                _cond.notify_all()
