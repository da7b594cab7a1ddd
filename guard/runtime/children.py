"""What both kinds of supervisor (guard/serve/ for the verifier and the extra serving processes,
guard/envoy/ for Envoy) need of a child process: how it ended, and a wait for its end."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time


def exit_reason(code: int) -> str:
    """How a child process ended, from its return code: ``exit code 3``, ``signal SIGKILL``."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def wait_exit(process: subprocess.Popen, timeout: float) -> int | None:
    """``process``'s return code once it has ended, waiting at most ``timeout`` seconds; None
    if it still runs. A watcher thread that calls this in a loop wakes when the child ends,
    not on a fixed tick: Linux's pidfd (5.3+) turns readable at the exit; without one, the
    wait is a plain sleep of ``min(timeout, 0.1)`` before looking."""
    code = process.poll()
    if code is not None:
        return code
    try:
        fd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # not Linux, an old kernel, or already reaped
        time.sleep(min(timeout, 0.1))
        return process.poll()
    try:
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    return process.poll()
