"""Route words: how the verifier tells every serving process where to send each model's traffic.

One 64-byte slot per model (a cache line, so that two models' writers never share one), in a
``SharedBlock`` the serving process owns. Word 0 of a slot is the route word:

    bit 0     1 = the fallback answers (0 = the primary)
    bit 1     1 = probing: on the fallback and past the dwell, so sampled requests are still
              handed to the verifier (it runs the primary in the background on them)
    bits 2-3  the admin override (0 auto, 1 primary, 2 fallback), so that a restarted verifier
              keeps an operator's pin
    bits 8..  the policy epoch: a sample is attributed to the epoch it was routed in, and the
              verifier ignores samples of an epoch that is no longer current

The verifier stores a whole word at once; the request path reads it with one aligned 8-byte
load (``memoryview`` of format ``Q``). Aligned 8-byte loads and stores are single-copy atomic on
x86-64 and aarch64, so a reader sees the old word or the new one, never a mix: no lock, no
syscall. Word 1 counts samples the request path dropped because the ring was full (written by
the serving process only); word 2 is how many samples the verifier holds in memory (taken from
the ring, not yet accounted for): if it dies, that many were lost.

The block's header holds the verifier's heartbeat (``time.monotonic_ns()``, a clock shared by
all processes on Linux) and pid, so a serving process can tell a hung verifier from a busy one.
"""

from __future__ import annotations

from typing import Literal

from guard.ipc.memory import SharedBlock

SLOT_WORDS = 8
HEADER_WORDS = 8
MAGIC = 0x67756172645F7631  # "guard_v1"
_HEARTBEAT, _PID = 1, 2
ROUTE, DROPPED, IN_HAND = 0, 1, 2
FALLBACK, PROBING = 1, 2
# The words a route word holds (guard/policy/route.py ``Route`` and ``Override`` are the same).
RouteName = Literal["primary", "fallback"]
OverrideName = Literal["auto", "primary", "fallback"]
_OVERRIDES: tuple[OverrideName, ...] = ("auto", "primary", "fallback")


def pack(route: str, probing: bool, epoch: int, override: str = "auto") -> int:
    return ((epoch << 8) | (_OVERRIDES.index(override) << 2)
            | (FALLBACK if route == "fallback" else 0) | (PROBING if probing else 0))


def unpack(word: int) -> tuple[RouteName, bool, int]:
    """(route, probing, epoch) of a route word."""
    return ("fallback" if word & FALLBACK else "primary"), bool(word & PROBING), word >> 8


def override_of(word: int) -> OverrideName:
    return _OVERRIDES[(word >> 2) & 3]


class RouteTable:
    """``capacity`` model slots plus a header; ``slot(name)`` is fixed for a model's lifetime."""

    def __init__(self, capacity: int = 256, block: SharedBlock | None = None):
        self.capacity = capacity
        self.block = block or SharedBlock((HEADER_WORDS + capacity * SLOT_WORDS) * 8,
                                          name="guard-routes")
        self.words = memoryview(self.block.map).cast("Q")
        if block is None:
            self.words[0] = MAGIC
        elif self.words[0] != MAGIC:
            raise ValueError("shared block is not a guard route table")
        self._slots: dict[str, int] = {}

    @classmethod
    def attach(cls, fd: int, capacity: int) -> "RouteTable":
        size = (HEADER_WORDS + capacity * SLOT_WORDS) * 8
        return cls(capacity, SharedBlock.attach(fd, size))

    # -- slots (serving process: assigns; verifier: told) ---------------------------------------
    def assign(self, names) -> dict[str, int]:
        """Slots for these model names, keeping existing ones; new slots start at word 0."""
        for name in names:
            if name not in self._slots:
                used = set(self._slots.values())
                free = next((i for i in range(self.capacity) if i not in used), None)
                if free is None:
                    raise ValueError(f"more than {self.capacity} models")
                self._slots[name] = free
                self.reset(free)
        return dict(self._slots)

    def release(self, name: str) -> None:
        self._slots.pop(name, None)

    def adopt(self, slots: dict[str, int]) -> None:
        self._slots = dict(slots)

    def index(self, slot: int, word: int = ROUTE) -> int:
        return HEADER_WORDS + slot * SLOT_WORDS + word

    def reset(self, slot: int) -> None:
        for word in range(SLOT_WORDS):
            self.words[self.index(slot, word)] = 0

    # -- the words ---------------------------------------------------------------------------
    def read(self, slot: int) -> tuple[str, bool, int]:
        return unpack(self.words[HEADER_WORDS + slot * SLOT_WORDS])

    def publish(self, slot: int, route: str, probing: bool, epoch: int,
                override: str = "auto") -> None:
        self.words[HEADER_WORDS + slot * SLOT_WORDS] = pack(route, probing, epoch, override)

    def get(self, slot: int, word: int) -> int:
        return self.words[self.index(slot, word)]

    def set(self, slot: int, word: int, value: int) -> None:
        self.words[self.index(slot, word)] = value

    # -- the verifier's pulse ------------------------------------------------------------------
    def beat(self, monotonic_ns: int, pid: int) -> None:
        self.words[_PID] = pid
        self.words[_HEARTBEAT] = monotonic_ns

    def heartbeat(self) -> tuple[int, int]:
        """(monotonic ns of the last beat, pid that beat); (0, 0) before the first."""
        return self.words[_HEARTBEAT], self.words[_PID]

    def clear_heartbeat(self) -> None:
        self.words[_HEARTBEAT] = 0
        self.words[_PID] = 0

    def close(self) -> None:
        self.words.release()
        self.block.close()
