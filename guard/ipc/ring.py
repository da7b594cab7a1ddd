"""A bounded byte ring in shared memory: one producer (a serving process), one consumer (the
verifier). The request path's half, ``put``, never waits: it copies a record in, or finds no
room and returns False (the caller counts a drop). The budget is bytes, not items, so a flood of
large requests cannot take more memory than the ring has.

Layout of the ``SharedBlock``: the producer's ``head`` (bytes ever written) in the first cache
line, the consumer's ``tail`` (bytes ever consumed) in the second, then ``capacity`` bytes of
records. A record is an 8-byte header (u32 length, u32 marker) and its payload, padded to 8
bytes; a record never wraps: when it does not fit before the end, a skip marker fills the rest
and it starts at offset 0. Each side writes only its own counter, after the bytes it covers, so
neither needs a lock. This relies on stores becoming visible in program order (x86-64's TSO;
a weaker memory model would need a fence between the payload and the counter).

If the consumer dies while holding a record it had not yet released (``tail`` not advanced),
the next consumer reads that record again: at most one sample is checked twice, none is lost.
"""

from __future__ import annotations

import struct
import threading

from guard.ipc.memory import SharedBlock

_HEADER = struct.Struct("<II")
_RECORD, _SKIP = 0x52454331, 0x534B4950  # "REC1", "SKIP"
_DATA = 128  # two cache lines of counters before the records


def _padded(n: int) -> int:
    return (n + 7) & ~7


class SampleRing:
    def __init__(self, capacity: int, block: SharedBlock | None = None):
        capacity = _padded(capacity)
        self.capacity = capacity
        self.block = block or SharedBlock(_DATA + capacity, name="guard-ring")
        self._counters = memoryview(self.block.map)[:_DATA].cast("Q")
        self._data = memoryview(self.block.map)[_DATA:_DATA + capacity]
        self._lock = threading.Lock()  # producers on several threads of one process (tap, infer)

    @classmethod
    def attach(cls, fd: int, capacity: int) -> "SampleRing":
        capacity = _padded(capacity)
        return cls(capacity, SharedBlock.attach(fd, _DATA + capacity))

    @property
    def used(self) -> int:
        return self._counters[0] - self._counters[8]

    # -- producer ------------------------------------------------------------------------------
    def put(self, parts) -> bool:
        """Copy the concatenation of ``parts`` (bytes-like, format ``B``) in as one record;
        False when there is no room (nothing is written then)."""
        length = sum(len(p) for p in parts)
        need = _HEADER.size + _padded(length)
        if need > self.capacity:
            return False
        with self._lock:
            head, tail = self._counters[0], self._counters[8]
            pos = head % self.capacity
            skip = self.capacity - pos if pos + need > self.capacity else 0
            if self.capacity - (head - tail) < skip + need:
                return False
            data = self._data
            if skip:
                _HEADER.pack_into(data, pos, 0, _SKIP)
                pos = 0
            _HEADER.pack_into(data, pos, length, _RECORD)
            at = pos + _HEADER.size
            for part in parts:
                end = at + len(part)
                data[at:end] = part
                at = end
            self._counters[0] = head + skip + need  # published after the bytes it covers
        return True

    # -- consumer ------------------------------------------------------------------------------
    def take(self) -> bytes | None:
        """The oldest record's payload (a copy), or None when the ring is empty."""
        while True:
            head, tail = self._counters[0], self._counters[8]
            if tail == head:
                return None
            pos = tail % self.capacity
            length, marker = _HEADER.unpack_from(self._data, pos)
            if marker == _SKIP:
                self._counters[8] = tail + (self.capacity - pos)
                continue
            if marker != _RECORD:  # cannot happen with one producer; never spin on it
                self._counters[8] = head
                raise ValueError(f"sample ring corrupt at offset {pos}: dropped "
                                 f"{head - tail} bytes")
            start = pos + _HEADER.size
            payload = bytes(self._data[start:start + length])
            self._counters[8] = tail + _HEADER.size + _padded(length)
            return payload

    def close(self) -> None:
        self._counters.release()
        self._data.release()
        self.block.close()
