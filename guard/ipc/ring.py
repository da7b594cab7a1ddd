"""A bounded byte ring in shared memory: one producer (a serving process), one consumer (the
verifier). The request path's half, ``put``, never waits: it copies a record in, or finds no
room and returns False (the caller counts a drop). The budget is bytes, not items, so a flood of
large requests cannot take more memory than the ring has.

Layout of the ``SharedBlock``: the producer's ``head`` (bytes ever written) in the first cache
line, the consumer's ``tail`` (bytes ever consumed) in the second, then ``capacity`` bytes of
records. A record is an 8-byte header (u32 length, u32 marker) and its payload, padded to 8
bytes; a record never wraps: when it does not fit before the end, a skip marker fills the rest
and it starts at offset 0. Each side writes only its own counter, after the bytes it covers, so
neither needs a lock.

That takes an order between the bytes and the counters that every CPU keeps: each side
publishes its counter with a release store and reads the other's with an acquire load
(guard/ipc/_atomics.c), so a consumer that sees a new ``head`` sees the record it covers, and a
producer that sees a new ``tail`` knows the bytes it frees are read. Where that extension did
not build (no C compiler at install), plain loads and stores are used on x86 only, whose stores
become visible in program order (TSO) and so give the same guarantee; on any other CPU (arm64
nodes: Graviton, Ampere) making a ring is refused with a GuardError that says how to fix it,
rather than passing samples through a ring that could hand the verifier a half-written record.
There is no correct pure-Python fallback to offer instead: Python exposes no memory fence.

If the consumer dies while holding a record it had not yet released (``tail`` not advanced),
the next consumer reads that record again: at most one sample is checked twice, none is lost.
"""

from __future__ import annotations

import platform
import struct
import threading
from types import ModuleType

from guard.errors import GuardError
from guard.ipc.memory import SharedBlock

_atomics: ModuleType | None
try:
    from guard.ipc import _atomics
except ImportError:  # not built: see _counter_ops
    _atomics = None

_HEADER = struct.Struct("<II")
_RECORD, _SKIP = 0x52454331, 0x534B4950  # "REC1", "SKIP"
_DATA = 128  # two cache lines of counters before the records
_HEAD, _TAIL = 0, 64  # byte offsets of the producer's and the consumer's counter
_TSO = {"x86_64", "amd64", "i386", "i686"}  # platform.machine() of CPUs that keep store order


def _padded(n: int) -> int:
    return (n + 7) & ~7


def _plain_load(counters: memoryview, offset: int) -> int:
    return counters[offset >> 3]


def _plain_store(counters: memoryview, offset: int, value: int) -> None:
    counters[offset >> 3] = value


def _counter_ops(machine: str | None = None):
    """``(load, store)`` for the counters: ``load(counters, offset)`` and ``store(counters,
    offset, value)`` on the counters' buffer, at a byte offset. The extension's acquire/release
    pair where it is built; else plain accesses where the CPU keeps store order (see the module
    docstring); else a GuardError."""
    if _atomics is not None:
        return _atomics.load_acquire, _atomics.store_release
    machine = (platform.machine() if machine is None else machine).lower()
    if machine in _TSO:
        return _plain_load, _plain_store
    raise GuardError(
        f"the sample ring needs guard's C extension guard.ipc._atomics on this CPU ({machine}: "
        "its stores may become visible out of order), and it was not built: install a C "
        "compiler (e.g. apt-get install gcc python3-dev) and reinstall guard")


class SampleRing:
    def __init__(self, capacity: int, block: SharedBlock | None = None):
        self._load, self._store = _counter_ops()  # before anything is mapped: it may refuse
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
        return self._load(self._counters, _HEAD) - self._load(self._counters, _TAIL)

    # -- producer ------------------------------------------------------------------------------
    def put(self, parts) -> bool:
        """Copy the concatenation of ``parts`` (bytes-like, format ``B``) in as one record;
        False when there is no room (nothing is written then)."""
        length = sum(len(p) for p in parts)
        need = _HEADER.size + _padded(length)
        if need > self.capacity:
            return False
        load, counters = self._load, self._counters
        with self._lock:
            head, tail = load(counters, _HEAD), load(counters, _TAIL)
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
            self._store(counters, _HEAD, head + skip + need)  # after the bytes it covers
        return True

    # -- consumer ------------------------------------------------------------------------------
    def take(self) -> bytes | None:
        """The oldest record's payload (a copy), or None when the ring is empty."""
        load, store, counters = self._load, self._store, self._counters
        while True:
            head, tail = load(counters, _HEAD), load(counters, _TAIL)
            if tail == head:
                return None
            pos = tail % self.capacity
            length, marker = _HEADER.unpack_from(self._data, pos)
            if marker == _SKIP:
                store(counters, _TAIL, tail + (self.capacity - pos))
                continue
            if marker != _RECORD:  # cannot happen with one producer; never spin on it
                store(counters, _TAIL, head)
                raise ValueError(f"sample ring corrupt at offset {pos}: dropped "
                                 f"{head - tail} bytes")
            start = pos + _HEADER.size
            payload = bytes(self._data[start:start + length])
            store(counters, _TAIL, tail + _HEADER.size + _padded(length))  # after the copy
            return payload

    def close(self) -> None:
        self._counters.release()
        self._data.release()
        self.block.close()
