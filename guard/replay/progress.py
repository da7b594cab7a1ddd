"""Progress on stderr: a bar redrawn in place on a terminal, plain lines otherwise (CI logs).

Progress is the share of input bytes behind the last finished record (or of ``--max-records``
when that is nearer), so the ETA needs no counting pass over the files first.
"""

from __future__ import annotations

import sys
import time

_REDRAW_S = 0.2  # terminal: at most 5 redraws a second
_LINE_S = 10.0  # plain output: one line every 10 s


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, stream=None, max_records: int | None = None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.max_records = max_records
        self.enabled = enabled
        self.records = 0
        self.started = time.monotonic()
        self._last = 0.0
        self._fraction = 0.0

    def update(self, records: int, fraction: float) -> None:
        self.records += records
        self._fraction = max(self._fraction, min(1.0, fraction))
        if self.max_records:
            self._fraction = max(self._fraction, self.records / self.max_records)
        now = time.monotonic()
        if self.enabled and now - self._last >= (_REDRAW_S if self.tty else _LINE_S):
            self._last = now
            self._draw(now)

    def _status(self, now: float) -> str:
        elapsed = now - self.started
        rate = self.records / elapsed if elapsed > 0 else 0.0
        f = self._fraction
        eta = elapsed * (1 - f) / f if f > 0 else float("inf")
        eta_text = _clock(eta) if eta != float("inf") else "?"
        return f"{f:6.1%}  {self.records} records  {rate:,.0f} records/s  ETA {eta_text}"

    def _draw(self, now: float) -> None:
        if self.tty:
            filled = int(30 * self._fraction)
            bar = "#" * filled + "." * (30 - filled)
            self.stream.write(f"\rreplay [{bar}] {self._status(now)}\x1b[K")
        else:
            self.stream.write(f"replay: {self._status(now)}\n")
        self.stream.flush()

    def finish(self) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        elapsed = now - self.started
        rate = self.records / elapsed if elapsed > 0 else 0.0
        end = "\r" if self.tty else ""
        self.stream.write(f"{end}replay: {self.records} records in {_clock(elapsed)} "
                          f"({rate:,.0f} records/s)" + ("\x1b[K\n" if self.tty else "\n"))
        self.stream.flush()
