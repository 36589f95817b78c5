"""Errors attnpool raises for bad input, and for runs that cannot go on; the checks of user files and directories
that every command shares.

Every check that refuses user input raises :class:`ConfigError` with a message
that names the field and the value. The CLI turns it into one line on stderr and
exit code 2; distributed code raises it on every rank before any collective.
"""

import errno
import json
import os
import tempfile
from pathlib import Path


class ConfigError(ValueError):
    """Bad input from a user: a field, a value and what is wrong with it."""

    def __init__(self, field: str, value, problem: str):
        self.field = field
        self.value = value
        self.problem = problem
        super().__init__(f"{field}={value!r}: {problem}")


class TrainingError(RuntimeError):
    """A run that cannot go on, not for bad input (losses that stay non-finite, a rank that stopped): the CLI
    prints one line and exits 1. ``restartable``: whether starting the workers again from the last
    checkpoint may get past it (a lost rank may; a diverged run will not)."""

    def __init__(self, message: str, restartable: bool = False):
        self.restartable = restartable
        super().__init__(message)


# An OSError for these is final (a restart would meet it again): no space, no permission, a read-only file system, a
# path through a file. Others may pass (a rank lost during a save fails it too; a network file system's hiccup).
PERMANENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR})


def restartable(exc: BaseException) -> bool:
    """Whether starting again may get past ``exc``: all but an OSError that PERMANENT_ERRNOS names."""
    return not (isinstance(exc, OSError) and exc.errno in PERMANENT_ERRNOS)


def storage_error(exc: OSError, what: str) -> TrainingError:
    """The TrainingError for ``exc``, met writing (or reading, to rewrite) ``what``, a file of the run, named: one
    line from the launcher instead of a traceback, and no restart into the same full disk."""
    return TrainingError(f"{what}: {exc.strerror or exc} (a storage error)", restartable=restartable(exc))


def read_json_file(field: str, path: "str | Path"):
    """The JSON value in the user's file ``path``, or a ConfigError naming ``field``: no such file, not text, not
    valid JSON."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(field, str(path), "no such file")
    try:
        return json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ConfigError(field, str(path), "not a JSON file (it is not text)") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(field, str(path), f"not valid JSON ({exc.msg} at line {exc.lineno})") from None


def check_checkpoint_source(run_dir: str | None, checkpoint: str | None) -> None:
    """Refuse a checkpoint to read (``checkpoint``, else the newest of ``run_dir``) whose directory does not exist:
    here, before a command that reads it loads torch (seconds)."""
    if checkpoint is not None:
        if not os.path.isdir(checkpoint):
            raise ConfigError("checkpoint", checkpoint, "no such directory")
    elif run_dir is None or not os.path.isdir(run_dir):
        raise ConfigError("run", run_dir, "no such run directory")


def check_output_directory(field: str, path: str) -> None:
    """Refuse a directory to write that cannot be: ``path`` a file, or where the nearest existing directory above it
    is not one this process may create entries in."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(field, path, "is a file, not a directory to write in")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:  # (tried, not asked of os.access: root passes that anywhere, read-only and special file systems included)
        os.rmdir(tempfile.mkdtemp(prefix=".attnpool-write-check-", dir=existing))
    except OSError as exc:
        raise ConfigError(field, path, f"cannot be written: nothing can be created in {existing} "
                                       f"({exc.strerror or exc})") from None
