"""What both kinds of supervisor (guard/serve/ for the verifier and the extra serving processes,
guard/envoy/ for Envoy) say about a child process that ended."""

from __future__ import annotations

import signal


def exit_reason(code: int) -> str:
    """How a child process ended, from its return code: ``exit code 3``, ``signal SIGKILL``."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
