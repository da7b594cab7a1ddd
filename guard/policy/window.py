"""A count window: the last N pass/fail results and their failing share."""

from __future__ import annotations

from collections import deque


class CountWindow:
    def __init__(self, size: int):
        self.size = size
        self._results: deque[bool] = deque(maxlen=size)  # True = failed
        self._failures = 0

    def add(self, failed: bool) -> None:
        if len(self._results) == self.size and self._results[0]:
            self._failures -= 1
        self._results.append(failed)
        self._failures += failed

    def clear(self) -> None:
        self._results.clear()
        self._failures = 0

    @property
    def samples(self) -> int:
        return len(self._results)

    @property
    def failures(self) -> int:
        return self._failures

    @property
    def ratio(self) -> float:
        return self._failures / len(self._results) if self._results else 0.0
