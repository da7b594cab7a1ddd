"""The capture writer: records sampled traffic to segment files, off the request path.

What the request path pays: a sampling decision and a ``put_nowait`` of a small object holding
references to arrays it already has. Encoding (protobuf, CRC) and file I/O happen on the
writer's own thread. A full queue drops the record and counts it; nothing ever waits.

The writer works in bursts, so that it costs the request path as little as it can in a process
that shares one GIL: after each burst it sleeps ``_LINGER_S`` (not waiting on the queue, so a
``put`` wakes nobody), then takes whatever has queued (up to ``_BURST`` records), encodes it,
yielding the GIL every few records, and appends the frames with one ``write`` per segment. The
fields every record of a writer shares (model, backends, config hash, version) are serialized
once and prefixed to each record (protobuf concatenation is a merge).

Files: ``<capture.dir>/<model>/<UTC time>-<pid>-<n>.gcap``; names sort in creation order. A
segment is closed (flushed and fsynced) and the next one opened when it would pass
``max_segment_bytes`` or is older than ``max_segment_age_s`` (checked at least every second,
also when idle). After every write the folder is kept under ``max_total_bytes`` by deleting the
oldest closed segments (segments found there at start-up count too), each deletion counted in
``guard_capture_segments_deleted_total``.

Frames go to the OS in unbuffered ``write`` calls as soon as they are encoded: a crash of the
process loses at most what was still queued in memory and the frame being written (the reader
skips a torn frame). Records are not fsynced one by one (that
would cost a disk flush per request); a machine crash can lose what the OS had not written.

Failure: any error in the writer (full disk, unwritable folder, a folder that vanished, or a
bug: any exception, not only I/O errors) disables capture for this model: one
``capture_disabled`` event, ``guard_capture_enabled`` drops to 0, the records it could not
write and later ones count as ``disabled``, and serving goes on. The writer thread lives on
(draining the queue), so the gauge never says 1 while nothing is written. Capture stays off
until the sidecar restarts. A record that cannot be encoded counts as ``error`` and costs only
itself.

Permissions: records hold raw request payloads. Segment files are created 0600 and the capture
folders guard creates (``capture.dir`` when missing, and ``<dir>/<model>/``) 0700, whatever
the umask; an existing ``capture.dir`` keeps its mode.

Shutdown (``close``): no new records are taken; those already queued are written (bounded by a
timeout), and the open segment is flushed and fsynced.
"""

from __future__ import annotations

import fcntl
import io
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from guard import __version__
from guard.backends.base import BackendInfo
from guard.capture import records
from guard.capture.segment import SUFFIX, encode_frame
from guard.config import CaptureConfig
from guard.observe.events import emit
from guard.observe.metrics import GuardMetrics
from guard.runtime.sampling import sampled
from guard.v1 import capture_pb2 as pb

log = logging.getLogger("guard.capture")
_TICK_S = 1.0  # longest idle wait before checking segment age
_BURST = 256  # most records encoded and written per wake-up
_LINGER_S = 0.01  # pause after a burst: records gather instead of waking the writer one by one
_YIELD_EVERY = 8  # records encoded between GIL yields (bounds how long the request path waits)
_STOP = object()
_FILE_MODE = 0o600  # segment files hold raw request payloads: the owner's alone
_FOLDER_MODE = 0o700


def _private(path: str, flags: int) -> int:
    """``open`` opener: a new segment file is created 0600 whatever the umask."""
    fd = os.open(path, flags, _FILE_MODE)
    os.fchmod(fd, _FILE_MODE)
    return fd


@dataclass
class CaptureTag:
    """Rides with a request from the request path to the mirror's result (``MirrorSample.tag``)."""

    request_id: str
    unix_nanos: int
    request_seconds: float
    record: bool  # mode "all": this request was sampled for capture


@dataclass
class PendingRecord:
    """Everything a record needs, as the request path or mirror worker has it; encoded later."""

    tag: CaptureTag
    route: str
    epoch: int
    inputs: Mapping[str, np.ndarray]
    # Or a callable returning them (upstream mode decodes the answer only when it is needed:
    # here, on the writer thread).
    outputs: Mapping[str, np.ndarray] | Callable[[], Mapping[str, np.ndarray]]
    reference: Mapping[str, np.ndarray] | None = None
    tier_reports: Mapping[str, records.Verdict] = field(default_factory=dict)
    reference_seconds: float = 0.0
    probed: bool = False
    size: int = 0  # bytes of its tensors, set when queued (the queue's byte budget)


def _tensor_bytes(*groups) -> int:
    """Bytes of the arrays in these mappings (a callable that decodes later counts 0: its
    serialized answer is already held by the verifier's sample)."""
    return sum(getattr(a, "nbytes", 0) for g in groups if isinstance(g, Mapping)
               for a in g.values())


_LOCK_FILE = ".lock"  # in the model's folder: held by the one writer (_claim_folder)


def _whole_frames(frames: list[bytes], nbytes: int) -> int:
    """How many of ``frames``, written one after another, lie whole in the first ``nbytes``."""
    count = 0
    for frame in frames:
        nbytes -= len(frame)
        if nbytes < 0:
            break
        count += 1
    return count


@dataclass
class _Segment:
    path: Path
    size: int


class CaptureWriter:
    def __init__(
        self,
        model: str,
        config: CaptureConfig,
        metrics: GuardMetrics,
        backends: Mapping[str, BackendInfo],
        config_hash: str = "",
    ):
        self.model = model
        self.config = config
        self.metrics = metrics
        self.folder = Path(config.dir) / model
        self.enabled = True
        self._backends = dict(backends)
        self._config_hash = config_hash
        self._queue: queue.Queue = queue.Queue(maxsize=config.queue_size)
        self._queued_bytes = 0  # tensors' bytes of the queued records (config.queue_bytes)
        self._bytes_lock = threading.Lock()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name=f"guard-capture-{model}",
                                        daemon=True)
        self._claim: int | None = None  # the folder's lock file, held while writing
        self._closed: list[_Segment] = []  # oldest first
        self._current: _Segment | None = None
        self._file: io.FileIO | None = None  # the current segment's, open with it
        self._opened_at = 0.0
        self._sequence = 0
        self._written_before_error = 0  # frames of the current _write already on disk
        self._segment_count = 0
        static = pb.CaptureRecord(model=model, config_hash=config_hash,
                                  guard_version=__version__, source="sidecar")
        records.describe_backends(static.backends, self._backends)
        self._static = static.SerializeToString()
        metrics.declare_capture(model)
        metrics.capture_enabled.labels(model).set(1)
        metrics.capture_queue_depth.labels(model).set_function(self._queue.qsize)

    # -- sampling (request path and mirror worker) ---------------------------------------------
    def tag(self, request_id: str, request_seconds: float) -> CaptureTag:
        record = self.config.mode == "all" and sampled(request_id, self.config.sample_rate)
        return CaptureTag(request_id, time.time_ns(), request_seconds, record)

    def wants_failure(self, tag: CaptureTag) -> bool:
        """Mode "failures": is this failing sample recorded? (Same hash, so replicas agree.)"""
        return self.config.mode == "failures" and sampled(tag.request_id, self.config.sample_rate)

    def submit(self, pending: PendingRecord) -> None:
        """Non-blocking: queue the record, or count it as dropped (or disabled)."""
        if not self.enabled:
            self.metrics.capture_records.labels(self.model, "disabled").inc()
            return
        if not self._accepting:
            self.metrics.capture_records.labels(self.model, "dropped").inc()
            return
        pending.size = _tensor_bytes(pending.inputs, pending.outputs, pending.reference)
        with self._bytes_lock:
            room = self._queued_bytes + pending.size <= self.config.queue_bytes
            if room:
                self._queued_bytes += pending.size
        if room:
            try:
                self._queue.put_nowait(pending)
                return
            except queue.Full:
                self._taken([pending])
        self.metrics.capture_records.labels(self.model, "dropped").inc()

    def _taken(self, pendings) -> None:
        """Records left the queue: their bytes no longer count against queue_bytes."""
        size = sum(p.size for p in pendings if p is not _STOP)
        with self._bytes_lock:
            self._queued_bytes -= size

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        try:
            self.folder.parent.mkdir(mode=_FOLDER_MODE, parents=True, exist_ok=True)
            self.folder.mkdir(mode=_FOLDER_MODE, exist_ok=True)
            self._claim_folder()
            self._closed = sorted(
                (_Segment(p, p.stat().st_size) for p in self.folder.glob(f"*{SUFFIX}")),
                key=lambda s: s.path.name,
            )
            probe = self.folder / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except Exception as exc:
            self._disable(exc, "preparing the capture folder")
        else:
            self._enforce_cap()
            emit("capture_started", model=self.model, folder=str(self.folder),
                 mode=self.config.mode, sample_rate=self.config.sample_rate,
                 existing_segments=len(self._closed))
        self._thread.start()

    def _claim_folder(self) -> None:
        """One writer per folder: its segments are what it counts against max_total_bytes
        and deletes when over it, so a second writer (another replica's guard on a shared
        volume) would push the folder past the cap and delete the other's open segment. An
        exclusive lock on ``<folder>/.lock`` (flock: the kernel drops it when a process dies,
        a killed verifier's included); a folder another guard holds disables this capture."""
        fd = os.open(self.folder / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OSError(f"another guard writes to {self.folder}: one folder per replica "
                          "(Kubernetes: a volume mount's subPathExpr: $(POD_NAME))") from None
        self._claim = fd

    def _release_folder(self) -> None:
        if self._claim is not None:
            os.close(self._claim)  # (closing drops the lock)
            self._claim = None

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking records, write those queued (within ``timeout``), close the segment."""
        self._accepting = False
        if not self.started:  # never started (a reload that failed): nothing was written
            self._count_left()
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._queue.put(_STOP, timeout=max(0.01, deadline - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    break
        self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if self._thread.is_alive():
            log.warning("capture writer for %s did not finish within %.0fs", self.model, timeout)
            return
        self._release_folder()
        self._count_left()

    def _count_left(self) -> None:
        """Whatever the writer did not take (the join timed out, or it never got the stop)."""
        left = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                left += 1
                self._taken([item])
        if left:
            self.metrics.capture_records.labels(self.model, "dropped").inc(left)

    @property
    def segments(self) -> list[Path]:
        """Segment files of this writer's folder, oldest first (the open one last)."""
        out = [s.path for s in self._closed]
        return out + ([self._current.path] if self._current else [])

    # -- writer thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=_TICK_S)
                except queue.Empty:
                    self._guarded(self._rotate_if_old, "closing an old segment")
                    continue
                burst = [item]
                while len(burst) < _BURST and burst[-1] is not _STOP:
                    try:
                        burst.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                stop = burst[-1] is _STOP
                self._taken(burst)
                self._handle([p for p in burst if p is not _STOP])
                if stop:
                    return
                self._guarded(self._rotate_if_old, "closing an old segment")
                time.sleep(_LINGER_S)
        finally:
            self._guarded(self._close_segment, "closing the segment")

    def _guarded(self, step: Callable[[], None], doing: str) -> None:
        """Run a writer step; any exception disables capture instead of ending the thread."""
        try:
            step()
        except Exception as exc:
            self._disable(exc, doing)

    def _handle(self, burst: list[PendingRecord]) -> None:
        if not burst:
            return
        if not self.enabled:
            self.metrics.capture_records.labels(self.model, "disabled").inc(len(burst))
            return
        frames = []
        for n, pending in enumerate(burst, 1):
            if n % _YIELD_EVERY == 0:
                time.sleep(0)  # let request threads waiting for the GIL have it
            try:
                frames.append(encode_frame(self._static +
                                           self._encode(pending).SerializeToString()))
            except Exception as exc:  # a value that cannot be recorded: this record only
                self.metrics.capture_records.labels(self.model, "error").inc()
                log.warning("capture for %s cannot encode a record: %s: %s", self.model,
                            type(exc).__name__, exc)
        written = 0
        try:
            written = self._write(frames)
        except Exception as exc:  # I/O or anything else: capture stops, serving goes on
            written = self._written_before_error
            self._disable(exc, "writing records")
        self.metrics.capture_records.labels(self.model, "written").inc(written)
        if written < len(frames):
            self.metrics.capture_records.labels(self.model, "disabled").inc(
                len(frames) - written)

    def _encode(self, p: PendingRecord) -> pb.CaptureRecord:
        self._sequence += 1
        # Only what differs per record; ``self._static`` holds the rest. Mirrored: the
        # reference answered (a generation call's reference scores it and keeps no tensors:
        # its verdicts say so).
        record = pb.CaptureRecord(
            request_id=p.tag.request_id, unix_nanos=p.tag.unix_nanos,
            route=p.route, mirrored=p.reference is not None or bool(p.tier_reports),
            probed=p.probed,
            sequence=self._sequence, epoch=max(0, p.epoch),
        )
        records.add_tensors(record.inputs, p.inputs)
        records.add_tensors(record.outputs, p.outputs() if callable(p.outputs) else p.outputs)
        if p.reference is not None:
            records.add_tensors(record.reference_outputs, p.reference)
        records.add_tier_verdicts(record.verdicts, p.tier_reports)
        record.timings.request_seconds = p.tag.request_seconds
        record.timings.reference_seconds = p.reference_seconds
        return record

    def _write(self, frames: list[bytes]) -> int:
        """Append frames, rotating where a segment would pass its size; returns how many are
        on disk (all, unless an OSError is raised part way: then the ones before it)."""
        done = self._written_before_error = 0
        while done < len(frames):
            if self._current is None:
                self._open_segment()
            current, file = self._current, self._file
            assert current is not None and file is not None  # (opened together)
            # As many frames as fit in this segment (at least one: a record larger than
            # max_segment_bytes gets a segment of its own).
            room = self.config.max_segment_bytes - current.size
            end, size = done, 0
            while end < len(frames) and (size + len(frames[end]) <= room or
                                         (end == done and current.size == 0)):
                size += len(frames[end])
                end += 1
            if end == done:  # the next frame does not fit: rotate
                self._close_segment()
                continue
            view = memoryview(b"".join(frames[done:end]))
            try:
                while view:  # a raw file may write less than asked
                    written = file.write(view) or 0
                    view = view[written:]
            except OSError:
                # A full disk part way: the whole frames a short write put there before the
                # error are on disk (the reader reads them) and count as written.
                on_disk = size - len(view)
                current.size += on_disk
                self._written_before_error = done + _whole_frames(frames[done:end], on_disk)
                raise
            current.size += size
            done = self._written_before_error = end
            self._enforce_cap()
        return done

    def _open_segment(self) -> None:
        self._segment_count += 1
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        path = self.folder / f"{stamp}-{os.getpid()}-{self._segment_count:04d}{SUFFIX}"
        self._file = open(path, "ab", buffering=0, opener=_private)
        self._current = _Segment(path, 0)
        self._opened_at = time.monotonic()

    def _rotate_if_old(self) -> None:
        if self._current is not None and (
            time.monotonic() - self._opened_at >= self.config.max_segment_age_s
        ):
            self._close_segment()

    def _close_segment(self) -> None:
        if self._file is None:
            return
        handle, segment = self._file, self._current
        self._file = self._current = None
        try:
            os.fsync(handle.fileno())
            handle.close()
        except Exception as exc:
            self._disable(exc, "closing a segment")
        if segment is not None and segment.size > 0:
            self._closed.append(segment)
        elif segment is not None:
            segment.path.unlink(missing_ok=True)

    def _enforce_cap(self) -> None:
        total = sum(s.size for s in self._closed) + (self._current.size if self._current else 0)
        while total > self.config.max_total_bytes and self._closed:
            oldest = self._closed.pop(0)
            try:
                oldest.path.unlink(missing_ok=True)
            except Exception as exc:
                self._disable(exc, f"deleting the oldest segment {oldest.path.name}")
                return
            total -= oldest.size
            self.metrics.capture_segments_deleted.labels(self.model).inc()
        self.metrics.capture_bytes.labels(self.model).set(total)

    def _disable(self, exc: Exception, doing: str) -> None:
        if not self.enabled:
            return
        self.enabled = False
        self.metrics.capture_enabled.labels(self.model).set(0)
        if isinstance(exc, OSError):
            error = exc.strerror or str(exc)
        else:
            error = f"{type(exc).__name__}: {exc}"
        emit("capture_disabled", model=self.model, folder=str(self.folder),
             error=f"{doing}: {error}", errno=getattr(exc, "errno", None),
             note="capture stays off until the sidecar restarts; serving goes on")
        if self._file is not None:
            try:
                self._file.close()
            except Exception:
                pass
            self._file = None
            if self._current is not None and self._current.size:
                self._closed.append(self._current)
            self._current = None
