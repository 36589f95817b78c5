"""Errors attnpool raises for bad input.

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
