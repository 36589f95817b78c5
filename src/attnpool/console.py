"""Where the commands and a run print (rich's Console, wide enough that a log's lines stay whole), and when the
command started, which a run's reported wall time counts from."""

from __future__ import annotations

import os

# Without a terminal (a file, a pipe, CI) rich wraps at 80 columns unless COLUMNS says otherwise.
PIPED_WIDTH = 200


def text_console():
    """A terminal's own width; output to a file or a pipe COLUMNS, else PIPED_WIDTH columns."""
    from rich.console import Console

    console = Console()
    if console.is_terminal or "COLUMNS" in os.environ:
        return console
    return Console(width=PIPED_WIDTH)


# The command's start (time.time()), for the processes it starts: a run's wall time counts from it.
START_TIME_ENV = "ATTNPOOL_START_TIME"


def mark_start() -> None:
    """Record this command's start for the processes it starts, unless a parent command did (idempotent)."""
    import time

    os.environ.setdefault(START_TIME_ENV, repr(time.time()))
