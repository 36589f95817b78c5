"""Errors attnpool raises for bad input, and for runs that cannot go on; the checks of user files and directories
that every command shares.

Every check that refuses user input raises :class:`ConfigError` with a message
that names the field and the value. The CLI turns it into one line on stderr and
exit code 2; distributed code raises it on every rank before any collective.
"""

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
