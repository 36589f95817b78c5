"""SIGTERM, handled: a rank finishes its step and checkpoints (:class:`Preemption`); a launcher passes it on to
its workers (:class:`ForwardSigterm`)."""

from __future__ import annotations

import os
import signal
import threading


class OnSigterm:
    """A SIGTERM handler for the block (where signals can be handled: the main thread), the previous one
    restored after it."""

    def _handle(self, signum, frame):
        raise NotImplementedError

    def __enter__(self):
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class Preemption(OnSigterm):
    """SIGTERM asks for a stop: the rank finishes its step, and the ranks agree at the step's end (every
    step gathers each rank's flag) to checkpoint and leave."""

    requested = False

    def _handle(self, signum, frame):
        self.requested = True


class ForwardSigterm(OnSigterm):
    """The launcher passes a SIGTERM on to its workers (each finishes its step, checkpoints and leaves with
    0) instead of dying and leaving them to train on."""

    def __init__(self, processes):
        self.processes = processes
        self.forwarded = False

    def _handle(self, signum, frame):
        self.forwarded = True
        for p in self.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
