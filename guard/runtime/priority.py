"""Background work yields the CPU to the request path: per-thread niceness (Linux).

The mirror (reference inference, the checks) and the op repair are work the guard can do later;
answering clients is not. On a machine without spare cores they compete for the same CPUs, and
the request path's tail latency pays for it. Linux schedules threads as tasks with their own
nice value, so the guard raises the niceness of the threads that do background work, and only
those: under contention the kernel's fair scheduler gives a nice-0 thread ~10x the CPU share of
a nice-10 one, while an idle CPU still goes to the background thread at once. Threads a
background thread starts (an intra-op pool created lazily from it) inherit its niceness.

Raising niceness needs no privilege. Where it is not available (not Linux, a seccomp profile
that forbids setpriority) the work runs at normal priority and the reason is logged once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("guard.priority")
_warned = threading.Event()


def lower_current_thread(nice: int) -> bool:
    """Run the calling thread ``nice`` steps below the process's main thread (0: leave it);
    True when applied. Relative to the main thread, not to the caller's current niceness: a
    thread started by a background thread has inherited its niceness already."""
    if nice <= 0:
        return False
    if not sys.platform.startswith("linux"):
        _warn_once(f"per-thread niceness needs Linux (this is {sys.platform})")
        return False
    tid = threading.get_native_id()
    try:
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:  # only ever lower it
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError as exc:
        _warn_once(f"setpriority refused: {exc}")
        return False
    return True


def thread_niceness() -> int:
    """The calling thread's niceness (Linux), for status and tests."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _warn_once(reason: str) -> None:
    if not _warned.is_set():
        _warned.set()
        log.warning("background threads run at normal priority: %s", reason)
