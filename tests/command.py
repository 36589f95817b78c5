"""The ``attnpool`` command run in the test's own process, reported as a finished process would be.

For commands that refuse their input or only plan (no worker process starts): a subprocess would spend two
seconds importing torch and the package for each, which the test process has done already.
"""

from __future__ import annotations

import contextlib
import io
import subprocess


def run_command(*args) -> subprocess.CompletedProcess:
    """``attnpool ARGS``: its exit code and what it printed to stdout and stderr. An exception the command does not
    turn into an exit code (a traceback, from a process) propagates."""
    from attnpool.cli.main import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(args))
        except SystemExit as exc:  # (argparse's refusals)
            code = exc.code
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())
