"""guard's child processes (the verifier, the extra serving processes of ``server.processes``,
Envoy) and the one supervisor that starts, watches, restarts and stops each of them.

One policy for all (``ChildSupervisor``): a child that exits (seen at once: a pidfd turns
readable) or that its kind calls hung (the verifier's heartbeat) is counted (the kind's
``*_restarts_total``), announced (``<kind>_lost``) and started again after a backoff; a start
that fails is announced (``<kind>_restart_failed``) and tried again after the next backoff; one
that comes up is announced (``<kind>_restarted``). The backoff starts at the kind's first wait,
doubles per failure in a row up to its ceiling, and starts over once a child has run for
``healthy_after_s``. The figures of every kind are here (``RESTART_POLICIES``), in one place.

What differs per kind is only how one process of it starts and stops (``Child``): the
verifier (guard/serve/supervisor.py), an extra serving process (guard/serve/processes.py),
Envoy (guard/envoy/process.py).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import NoReturn, Protocol

from guard.errors import GuardError
from guard.observe.events import emit


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


def end_process(process: subprocess.Popen | None, timeout: float) -> None:
    """Wait ``timeout`` seconds for ``process`` to exit, then SIGKILL it (and reap it)."""
    if process is None:
        return
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


# The signals that stop or reload guard. They are the first serving process's alone: it drains
# its calls, hands the verifier what they sampled, then stops its children over their control
# channels (a child sees its parent die as that channel closing). A signal sent to guard's whole
# process group (a terminal's Ctrl-C, systemd's default KillMode=control-group) must not stop a
# child first: a verifier gone before the drain loses the sampled calls it holds, which the
# shutdown promises to capture, and an extra serving process would go down the wrong path.
PARENTS_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def exit_at_once(code: int) -> NoReturn:
    """End a serving or verifier process once it has stopped: logs and output flushed, then
    ``os._exit``. A thread still inside work the stop no longer needs (a control request or a
    reload waiting on an upstream's ``ready_timeout_s``) must not keep the process alive past
    its grace, and Python's own exit joins every such thread."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_signals_to_the_parent() -> None:
    """In a Python child of ``guard serve`` (the verifier, an extra serving process): ignore
    :data:`PARENTS_SIGNALS` (Envoy, which cannot, runs in a process group of its own)."""
    for sig in PARENTS_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


@dataclass(frozen=True)
class RestartPolicy:
    """When a lost child starts again: after ``first_backoff_s`` (a kind's config may set it),
    doubling per failure in a row up to ``max_backoff_s``, from ``first_backoff_s`` again once
    a child has served for ``healthy_after_s``. ``watch_s``: the longest the watcher waits on
    one process before it looks again (a hang check, a hot restart's new process); an exit
    wakes it at once."""

    first_backoff_s: float
    max_backoff_s: float
    healthy_after_s: float = 60.0
    watch_s: float = 0.5

    def with_first(self, first_backoff_s: float) -> "RestartPolicy":
        return RestartPolicy(first_backoff_s, self.max_backoff_s, self.healthy_after_s,
                             self.watch_s)


# Every kind's figures. The verifier's first wait is server.verifier.restart_backoff_s and
# Envoy's server.envoy.restart_backoff_s (these are their defaults). Envoy's ceiling is lower:
# in Envoy mode it is the data plane, and every second it is down refuses connections; a
# verifier or an extra serving process down costs checks or capacity, not answers.
RESTART_POLICIES = {
    "verifier": RestartPolicy(first_backoff_s=0.5, max_backoff_s=30.0),
    "serving_process": RestartPolicy(first_backoff_s=1.0, max_backoff_s=30.0, watch_s=0.1),
    "envoy": RestartPolicy(first_backoff_s=0.2, max_backoff_s=10.0),
}


class Child(Protocol):
    """One kind of child process, as the supervisor drives it."""

    kind: str  # the events' prefix and the RESTART_POLICIES key
    fields: dict  # what every event about it adds (e.g. an extra serving process's index)

    def launch(self) -> subprocess.Popen:
        """Start one and wait until it serves; GuardError (the child's own message) when it
        cannot, with what was started already ended."""

    def hung(self, process: subprocess.Popen) -> str | None:
        """Why a running child counts as hung (it is then killed and restarted), or None."""

    def lost(self, process: subprocess.Popen, how: str) -> dict:
        """It died (or was killed hung): forget it, count what it took; the lost event's
        further fields."""

    def end(self, process: subprocess.Popen | None, grace: float) -> None:
        """End ``process`` gracefully (``grace`` for the work in flight), killing it past
        that; ``None`` when none runs (a stop during a restart)."""


class ChildSupervisor:
    """Starts a ``Child``, restarts it when it dies or hangs, stops it: one per child process
    (the verifier, each extra serving process, Envoy)."""

    def __init__(self, child: Child, policy: RestartPolicy, restarts=None):
        """``restarts``: the kind's restart counter (a prometheus Counter), or None."""
        self.child = child
        self.policy = policy
        self.restarts = restarts
        self.process: subprocess.Popen | None = None  # the one that serves now
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._backoff = policy.first_backoff_s
        self._started_at = 0.0
        self._watcher: threading.Thread | None = None

    # -- start / stop ------------------------------------------------------------------------
    def start(self) -> None:
        """The first start; GuardError when it does not come up (nothing is left running)."""
        self._serve(self.child.launch())
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name=f"guard-{self.child.kind}-watch")
        self._watcher.start()

    def _serve(self, process: subprocess.Popen) -> None:
        with self._lock:
            self.process, self._started_at = process, time.monotonic()

    def replace(self, process: subprocess.Popen) -> subprocess.Popen | None:
        """A process that took over from the current one (Envoy's hot restart): watched from
        now on; the old one, which ends by itself, is returned."""
        with self._lock:
            old, self.process = self.process, process
            self._started_at = time.monotonic()
        return old

    def stop(self, grace: float) -> None:
        """No restart from now on; the child ends gracefully (killed past its grace)."""
        with self._lock:
            self.stopping.set()
            process = self.process
        self.child.end(process, grace)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(5)

    @property
    def running(self) -> bool:
        process = self.process
        return process is not None and process.poll() is None

    # -- watching ----------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self.stopping.is_set():
            with self._lock:
                process = self.process
            assert process is not None, "the watcher starts after the first launch"
            code = wait_exit(process, self.policy.watch_s)  # wakes at the exit
            with self._lock:
                current = process is self.process  # a hot restart replaced it meanwhile
            if self.stopping.is_set() or not current:
                continue
            if code is None:
                how = self.child.hung(process)
                if how is None:
                    continue
                process.kill()
                process.wait(5)
            else:
                how = f"exited with {exit_reason(code)}"
            self._lost(process, how)
            self._restart()

    def _lost(self, process: subprocess.Popen, how: str) -> None:
        if self.restarts is not None:
            self.restarts.inc()
        fields = self.child.lost(process, how)
        if time.monotonic() - self._started_at > self.policy.healthy_after_s:
            self._backoff = self.policy.first_backoff_s
        emit(f"{self.child.kind}_lost", **self.child.fields, pid=process.pid, how=how,
             restart_in_s=round(self._backoff, 2), **fields)

    def _restart(self) -> None:
        while not self.stopping.wait(self._backoff):
            self._backoff = min(self.policy.max_backoff_s, self._backoff * 2)
            try:
                process = self.child.launch()
            except GuardError as exc:
                emit(f"{self.child.kind}_restart_failed", **self.child.fields,
                     error=str(exc), retry_in_s=round(self._backoff, 2))
                continue
            with self._lock:  # a stop while it started ends it at once, never orphans it
                stopped = self.stopping.is_set()
                if not stopped:
                    self.process, self._started_at = process, time.monotonic()
            if stopped:
                self.child.end(process, 0.0)
                return
            emit(f"{self.child.kind}_restarted", **self.child.fields, pid=process.pid)
            return
