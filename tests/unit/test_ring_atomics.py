"""The sample ring's counters on any CPU: guard/ipc/_atomics.c's acquire loads and release stores,
the ring's use of them, a producer and a consumer process passing records through shared memory,
and what happens where the extension did not build (plain stores on x86 only; a clear refusal
elsewhere)."""

from __future__ import annotations

import hashlib
import mmap
import multiprocessing
import os
import struct

import pytest

from guard.errors import GuardError
from guard.ipc import ring as ring_module
from guard.ipc.ring import SampleRing

if os.environ.get("GUARD_REQUIRE_KERNEL"):  # .ci/run: a build without it is a failure there
    from guard.ipc import _atomics
else:
    _atomics = pytest.importorskip("guard.ipc._atomics",
                                   reason="the ring's atomics are not built here (no C compiler?)")

_U64 = struct.Struct("=Q")


# -- the helpers -----------------------------------------------------------------------------------
def test_release_store_and_acquire_load_round_trip_every_bit_pattern_across_mappings():
    """A value stored with release in one mapping of shared memory is what an acquire load
    reads in a second mapping, and what a plain native-endian read sees: at both counter
    offsets, for the edge values of a u64."""
    fd = os.memfd_create("atomics-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    try:
        one = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        two = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        for offset in (0, 64, 4088):
            for value in (0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 0x0123456789ABCDEF):
                assert _atomics.store_release(one, offset, value) is None
                assert _atomics.load_acquire(two, offset) == value
                assert _U64.unpack_from(two, offset)[0] == value
                _U64.pack_into(two, offset, value ^ 0xFF)  # and the other way round
                assert _atomics.load_acquire(one, offset) == value ^ 0xFF
        view = memoryview(one)[:128].cast("Q")  # the ring hands the helpers a 'Q' view
        _atomics.store_release(view, 64, 77)
        assert view[8] == 77 and _atomics.load_acquire(view, 64) == 77
        view.release()
        one.close()
        two.close()
    finally:
        os.close(fd)


def test_helpers_refuse_bad_buffers_offsets_and_values_with_clear_errors():
    buf = bytearray(32)
    view = memoryview(buf)
    with pytest.raises(IndexError, match="outside a buffer of 32 bytes"):
        _atomics.load_acquire(buf, 32)
    with pytest.raises(IndexError):
        _atomics.store_release(buf, -8, 1)
    with pytest.raises(ValueError, match="not 8-byte aligned"):
        _atomics.load_acquire(view[1:17], 0)
    with pytest.raises(BufferError, match="not writable"):
        _atomics.store_release(bytes(16), 0, 1)  # read-only: nothing to store into
    with pytest.raises(OverflowError):
        _atomics.store_release(buf, 0, 2**64)
    with pytest.raises(OverflowError):
        _atomics.store_release(buf, 0, -1)
    with pytest.raises(TypeError):
        _atomics.load_acquire(buf)
    assert buf == bytearray(32)  # no refused call wrote anything


# -- the ring uses them ----------------------------------------------------------------------------
def test_ring_publishes_and_reads_its_counters_through_the_helpers(monkeypatch):
    """With the extension built, every counter access of put and take goes through the
    acquire/release pair, at the two counters' offsets: the producer reads the consumer's
    ``tail`` with acquire and publishes ``head`` with release after the record, and the other
    way round."""
    assert SampleRing(64)._load is _atomics.load_acquire
    assert SampleRing(64)._store is _atomics.store_release
    calls: list[tuple[str, int]] = []

    class Recording:
        @staticmethod
        def load_acquire(buffer, offset):
            calls.append(("load", offset))
            return _atomics.load_acquire(buffer, offset)

        @staticmethod
        def store_release(buffer, offset, value):
            calls.append(("store", offset))
            _atomics.store_release(buffer, offset, value)

    monkeypatch.setattr(ring_module, "_atomics", Recording)
    producer = SampleRing(1024)
    consumer = SampleRing.attach(os.dup(producer.block.fd), 1024)
    assert producer.put([b"abc", b"def"])
    assert calls == [("load", 0), ("load", 64), ("store", 0)]
    calls.clear()
    assert consumer.take() == b"abcdef"
    assert calls == [("load", 0), ("load", 64), ("store", 64)]
    calls.clear()
    assert consumer.take() is None and producer.used == 0
    assert set(calls) == {("load", 0), ("load", 64)}
    producer.close()
    consumer.close()


# -- without the extension -------------------------------------------------------------------------
@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le", "riscv64", "s390x"])
def test_without_the_extension_a_cpu_without_store_order_refuses_to_make_a_ring(monkeypatch,
                                                                                 machine):
    monkeypatch.setattr(ring_module, "_atomics", None)
    monkeypatch.setattr(ring_module.platform, "machine", lambda: machine)
    with pytest.raises(GuardError, match=rf"guard\.ipc\._atomics on this CPU \({machine}.*"
                                         r"install a C compiler"):
        SampleRing(1024)


@pytest.mark.parametrize("machine", ["x86_64", "AMD64"])
def test_without_the_extension_x86_keeps_plain_counters_and_round_trips(monkeypatch, machine):
    monkeypatch.setattr(ring_module, "_atomics", None)
    monkeypatch.setattr(ring_module.platform, "machine", lambda: machine)
    producer = SampleRing(1024)
    assert producer._load is ring_module._plain_load
    consumer = SampleRing.attach(os.dup(producer.block.fd), 1024)
    for i in range(300):  # several wrap-arounds
        assert producer.put([bytes([i % 256]) * (i % 50)])
        assert consumer.take() == bytes([i % 256]) * (i % 50)
    assert consumer.take() is None and producer.used == 0
    producer.close()
    consumer.close()


# -- two processes ---------------------------------------------------------------------------------
_RECORDS = 20000


def _record(i: int) -> bytes:
    """Record ``i``: its index, a length that varies (0-700 bytes of body, so records wrap and
    skip at many offsets) and a digest that a torn or stale read would not match."""
    body = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=64).digest() * (i % 11)
    body = body[:(i * 37) % 701]
    return i.to_bytes(8, "little") + hashlib.blake2b(body, digest_size=16).digest() + body


def _produce(fd: int, capacity: int) -> None:
    ring = SampleRing.attach(fd, capacity)
    i = 0
    while i < _RECORDS:
        record = _record(i)
        if ring.put([record[:8], memoryview(record)[8:]]):
            i += 1
        else:
            os.sched_yield()  # full: let the consumer catch up
    ring.close()


def _consume(fd: int, capacity: int, results) -> None:
    ring = SampleRing.attach(fd, capacity)
    expected, wrong = 0, []
    while expected < _RECORDS:
        got = ring.take()
        if got is None:
            os.sched_yield()
            continue
        if got != _record(expected) and len(wrong) < 5:
            wrong.append((expected, got[:8]))
        expected += 1
    results.put((expected, wrong, ring.take(), ring.used))
    ring.close()


def test_two_processes_pass_every_record_intact_in_order_none_lost_or_doubled():
    """A producer process and a consumer process (forked, each mapping the same memfd, as a
    serving process and the verifier do) through a small ring, so that it fills, wraps and
    skips thousands of times: the consumer sees records 0..N-1 in order, each byte-for-byte
    what was put, and nothing after them."""
    capacity = 4096
    owner = SampleRing(capacity)
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    consumer = ctx.Process(target=_consume, args=(os.dup(owner.block.fd), capacity, results))
    producer = ctx.Process(target=_produce, args=(os.dup(owner.block.fd), capacity))
    consumer.start()
    producer.start()
    try:
        count, wrong, after, used = results.get(timeout=300)
    finally:
        producer.join(timeout=60)
        consumer.join(timeout=60)
        for process in (producer, consumer):
            if process.is_alive():
                process.kill()
    assert (producer.exitcode, consumer.exitcode) == (0, 0)
    assert wrong == []
    assert count == _RECORDS and after is None and used == 0
    assert owner.used == 0
    owner.close()
