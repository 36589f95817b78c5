"""Errors attnpool raises for bad input, and for runs that cannot go on.

Every check that refuses user input raises :class:`ConfigError` with a message
that names the field and the value. The CLI turns it into one line on stderr and
exit code 2; distributed code raises it on every rank before any collective.
"""


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
