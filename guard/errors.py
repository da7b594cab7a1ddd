"""Errors that reach users.

A ``GuardError`` is a user error (bad config, missing artifact, bad input file): the CLI prints
its message as one line on stderr and exits 2, never with a traceback (``--debug`` shows one).
"""

from __future__ import annotations


class GuardError(Exception):
    """A problem the user can fix: printed as one line, exit code 2."""


class ConfigError(GuardError):
    """A config that does not validate; ``problems`` holds one ``dotted.path: message`` each."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(where + "; ".join(problems))


class BackendError(GuardError):
    """A backend that cannot be built or loaded (missing artifact, unsupported precision...)."""
