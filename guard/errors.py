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
    """A backend that cannot be built or loaded (missing artifact, unsupported precision...).

    ``key``: the backend block's key the problem is about (``sha256``), so that whoever knows
    where the block sits names it in full: ``models[NAME].ROLE.sha256: ...`` (see ``at``)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key

    def at(self, prefix: str) -> "BackendError":
        """The same error located under ``prefix`` (``models[cnn].primary``)."""
        where = f"{prefix}.{self.key}" if self.key else prefix
        return BackendError(f"{where}: {self}")


def install_hint(extra: str, adds: str = "") -> str:
    """How to install an optional part, in the one install story there is: guard is installed
    from a checkout of its repository (README "Install"), so the command is ``pip install
    '.[EXTRA]'`` run there (asking pip for the ``guard`` distribution would ask PyPI, where guard
    is not). ``adds``: what the extra brings that the message is about (a package name).
    Every message that names an extra goes through here, so they all say the same thing."""
    what = f"the {extra} extra{f': {adds}' if adds else ''}"
    return f"pip install '.[{extra}]' in guard's checkout ({what})"
