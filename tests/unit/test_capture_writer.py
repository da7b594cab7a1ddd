"""guard/capture/writer.py: records on disk, rotation, the disk cap, drops and I/O failures."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time

import numpy as np
import pytest

from guard.backends.base import BackendInfo, TensorSpec
from guard.capture.reader import FileStats, expand_paths, read_records
from guard.capture.records import tensors
from guard.capture.segment import encode_frame
from guard.capture.writer import CaptureWriter, PendingRecord
from guard.config import CaptureConfig
from guard.observe.metrics import GuardMetrics
from guard.config import ChecksConfig
from guard.verify.pipeline import Comparator

MODEL = "m"
INFO = {"primary": BackendInfo("onnxruntime", "/models/m.onnx", "int8", "cpu",
                               (TensorSpec("x", "FP32", (-1, 4)),), ())}


def value(metrics: GuardMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, {"model": MODEL, **labels}) or 0.0


def writer(tmp_path, **config) -> tuple[CaptureWriter, GuardMetrics]:
    metrics = GuardMetrics("test")
    cfg = CaptureConfig(dir=str(tmp_path / "cap"), **config)
    return CaptureWriter(MODEL, cfg, metrics, INFO, config_hash="cafe"), metrics


def pending(w: CaptureWriter, i: int, rows: int = 2, **extra) -> PendingRecord:
    x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + i
    return PendingRecord(w.tag(f"id-{i}", 0.002), "primary", 3, {"x": x},
                         {"y": x[:, :3] * 2}, **extra)


def wait_for(condition, timeout: float = 10.0) -> None:
    """Until the writer thread has got there (a generous bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the writer thread did not get there"
        time.sleep(0.02)


def read_all(folder) -> list:
    out = []
    for path in expand_paths([folder]):
        out += list(read_records(path, FileStats()))
    return out


def test_records_round_trip_with_tensors_and_metadata(tmp_path):
    w, metrics = writer(tmp_path)
    comparator = Comparator(ChecksConfig())
    w.start()
    ref = {"y": np.zeros((2, 3), np.float32)}
    check = comparator.check(ref, {"y": np.ones((2, 3), np.float32)})
    w.submit(pending(w, 0))
    w.submit(pending(w, 1, reference=ref, tier_reports=comparator.tier_reports(check),
                     reference_seconds=0.01))
    w.close()
    records = read_all(tmp_path / "cap")
    assert [r.request_id for r in records] == ["id-0", "id-1"]
    first, second = records
    np.testing.assert_array_equal(tensors(first.inputs)["x"],
                                  np.arange(8, dtype=np.float32).reshape(2, 4))
    assert tensors(first.outputs)["y"].shape == (2, 3)
    assert not first.mirrored and not first.verdicts
    assert second.mirrored and tensors(second.reference_outputs)["y"].sum() == 0
    (verdict,) = second.verdicts
    assert verdict.tier == "tensor" and not verdict.passed
    assert verdict.outputs[0].name == "y" and verdict.outputs[0].max_abs == 1.0
    assert json.loads(verdict.details_json) == {"max_abs_error": 1.0}
    assert second.timings.reference_seconds == pytest.approx(0.01)
    assert first.config_hash == "cafe" and first.source == "sidecar" and first.epoch == 3
    assert [(b.role, b.backend, b.precision) for b in first.backends] == [
        ("primary", "onnxruntime", "int8")]
    assert (first.sequence, second.sequence) == (1, 2)
    assert first.unix_nanos <= second.unix_nanos and abs(first.unix_nanos / 1e9 - time.time()) < 60
    assert value(metrics, "guard_capture_records_total", outcome="written") == 2
    assert value(metrics, "guard_capture_bytes") == sum(
        p.stat().st_size for p in expand_paths([tmp_path / "cap"]))


def test_segments_rotate_by_size(tmp_path):
    w, _ = writer(tmp_path, max_segment_bytes=1500, max_total_bytes=10**6)
    w.start()
    for i in range(30):
        w.submit(pending(w, i))
    w.close()
    files = expand_paths([tmp_path / "cap"])
    assert len(files) > 3
    assert all(p.stat().st_size <= 1500 for p in files)
    assert [r.sequence for r in read_all(tmp_path / "cap")] == list(range(1, 31))


def test_segments_rotate_by_age_even_when_idle(tmp_path):
    w, _ = writer(tmp_path, max_segment_age_s=0.2)
    w.start()
    w.submit(pending(w, 0))
    deadline = time.monotonic() + 10
    while len(w._closed) < 1 and time.monotonic() < deadline:  # closed by the idle tick
        time.sleep(0.05)
    assert len(w._closed) == 1
    w.submit(pending(w, 1))
    w.close()
    assert len(expand_paths([tmp_path / "cap"])) == 2


def test_disk_cap_deletes_oldest_segments_first(tmp_path):
    folder = tmp_path / "cap" / MODEL
    folder.mkdir(parents=True)
    old = folder / "20000101T000000000000Z-1-0001.gcap"  # left by an earlier run: counts too
    old.write_bytes(b"\0" * 2000)
    w, metrics = writer(tmp_path, max_segment_bytes=1000, max_total_bytes=3000)
    w.start()
    for i in range(40):
        w.submit(pending(w, i))
    w.close()
    assert not old.exists()
    files = expand_paths([tmp_path / "cap"])
    total = sum(p.stat().st_size for p in files)
    assert total <= 3000
    deleted = value(metrics, "guard_capture_segments_deleted_total")
    assert deleted >= 2
    assert value(metrics, "guard_capture_bytes") == total
    # What is left is the newest records, in order, ending with the last one written.
    sequences = [r.sequence for r in read_all(tmp_path / "cap")]
    assert sequences == list(range(sequences[0], 41))


def test_full_queue_drops_and_counts_without_blocking(tmp_path):
    w, metrics = writer(tmp_path, queue_size=4)
    started = time.perf_counter()
    for i in range(10):  # the writer thread is not running yet: the queue fills
        w.submit(pending(w, i))
    assert time.perf_counter() - started < 1.0
    assert value(metrics, "guard_capture_records_total", outcome="dropped") == 6
    w.start()
    w.close()
    assert value(metrics, "guard_capture_records_total", outcome="written") == 4


def test_unwritable_folder_disables_capture_with_event_and_metric(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the capture folder should be")
    metrics = GuardMetrics("test")
    cfg = CaptureConfig(dir=str(blocker / "cap"))
    w = CaptureWriter(MODEL, cfg, metrics, INFO)
    with caplog.at_level(logging.INFO, logger="guard.events"):
        w.start()
        w.submit(pending(w, 0))
        w.close()
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "guard.events"]
    disabled = [e for e in events if e["event"] == "capture_disabled"]
    assert len(disabled) == 1 and disabled[0]["model"] == MODEL
    assert "capture folder" in disabled[0]["error"]
    assert value(metrics, "guard_capture_enabled") == 0
    assert value(metrics, "guard_capture_records_total", outcome="disabled") == 1
    assert value(metrics, "guard_capture_records_total", outcome="written") == 0


def test_io_error_while_running_disables_capture(tmp_path, caplog):
    # One record per segment: every record opens a new file.
    w, metrics = writer(tmp_path, max_segment_bytes=1, max_total_bytes=10**6)
    w.start()
    w.submit(pending(w, 0))
    wait_for(lambda: value(metrics, "guard_capture_records_total", outcome="written") >= 1)
    # The folder vanishes and a file takes its place: the next segment cannot be opened.
    shutil.rmtree(w.folder)  # (its segments and the writer's lock file)
    w.folder.write_text("")
    with caplog.at_level(logging.INFO, logger="guard.events"):
        for i in range(1, 5):
            w.submit(pending(w, i))
        w.close()
    assert value(metrics, "guard_capture_enabled") == 0
    assert value(metrics, "guard_capture_records_total", outcome="disabled") == 4
    assert any('"capture_disabled"' in r.getMessage() for r in caplog.records)


class _FillingDisk:
    """A segment file on a disk with ``room`` bytes left: short writes, then ENOSPC, as a
    filesystem that fills up answers (the file itself is real)."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = min(len(data), self.room)
        self.room -= n
        return self.file.write(bytes(data[:n]))

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        self.file.close()


def test_a_disk_that_fills_mid_burst_counts_as_written_what_is_on_disk(tmp_path, monkeypatch):
    """Ten records in one burst (one write of their frames) on a disk with room for about
    five and a half: the short write puts five whole frames there before ENOSPC. Those are
    written (the reader reads them back; the torn sixth is its truncated tail), the rest
    disabled; before, the whole burst counted as disabled."""
    w, metrics = writer(tmp_path)
    one = len(encode_frame(w._static + w._encode(pending(w, 0)).SerializeToString()))
    opened = CaptureWriter._open_segment

    def on_a_filling_disk(self):
        opened(self)
        self._file = _FillingDisk(self._file, int(one * 5.5))

    monkeypatch.setattr(CaptureWriter, "_open_segment", on_a_filling_disk)
    for i in range(10):
        w.submit(pending(w, i))
    w.start()  # one burst: the ten were waiting
    w.close()
    written = value(metrics, "guard_capture_records_total", outcome="written")
    assert 0 < written < 10
    assert len(read_all(w.folder)) == written
    assert written + value(metrics, "guard_capture_records_total", outcome="disabled") == 10


def test_a_folder_another_writer_holds_is_refused_not_shared(tmp_path, caplog):
    """Two replicas' guards on one volume with the same capture.dir: each would keep the cap
    over its own segments only (past max_total_bytes together) and delete the other's. The
    second is refused (capture off, said, its records counted disabled); once the first has
    closed, the folder is free again (a reload's next version takes it)."""
    first, _ = writer(tmp_path)
    second, metrics = writer(tmp_path)
    first.start()
    with caplog.at_level(logging.INFO, logger="guard.events"):
        second.start()
    second.submit(pending(second, 0))
    second.close()
    assert value(metrics, "guard_capture_enabled") == 0
    assert value(metrics, "guard_capture_records_total", outcome="disabled") == 1
    assert any('"capture_disabled"' in r.getMessage() and "another guard writes" in
               r.getMessage() for r in caplog.records)
    first.submit(pending(first, 1))
    first.close()
    third, metrics = writer(tmp_path)
    third.start()
    third.submit(pending(third, 2))
    third.close()
    assert value(metrics, "guard_capture_records_total", outcome="written") == 1
    assert [r.request_id for r in read_all(first.folder)] == ["id-1", "id-2"]


def test_config_rejects_segment_larger_than_cap_and_failures_without_reference():
    from pathlib import Path

    from guard.plan.complete import parse_config
    from guard.errors import ConfigError

    with pytest.raises(ValueError, match="max_segment_bytes must not exceed"):
        CaptureConfig(dir="x", max_segment_bytes=10, max_total_bytes=5)
    data = {"version": 1, "models": [{
        "name": "m", "primary": {"backend": "torch", "path": "fixture_models:affine"},
        "capture": {"dir": "cap", "mode": "failures"}}]}
    with pytest.raises(ConfigError) as info:
        parse_config(data, Path("."))
    assert any("capture.mode 'failures' needs a 'reference'" in p for p in info.value.problems)


def test_segment_files_are_private_whatever_the_umask(tmp_path):
    """Records hold raw request payloads: 0600 files in 0700 folders, even under umask 0."""
    old = os.umask(0)
    try:
        w, metrics = writer(tmp_path)
        w.start()
        w.submit(pending(w, 0))
        w.close()
    finally:
        os.umask(old)
    (segment,) = expand_paths([tmp_path / "cap"])
    assert segment.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "cap").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "cap" / MODEL).stat().st_mode & 0o777 == 0o700
    assert value(metrics, "guard_capture_records_total", outcome="written") == 1


def test_any_exception_in_the_writer_disables_capture_and_keeps_the_thread(tmp_path, caplog):
    """Not only OSError: here the segment's handle is closed under the writer, so its next
    write raises ValueError. Capture stops (event, gauge 0, records counted), the thread goes
    on draining, and submitting never raises."""
    w, metrics = writer(tmp_path)
    w.start()
    w.submit(pending(w, 0))
    wait_for(lambda: value(metrics, "guard_capture_records_total", outcome="written") >= 1)
    w._file.close()  # what a stray close elsewhere would do to the open segment
    with caplog.at_level(logging.INFO, logger="guard.events"):
        for i in range(1, 4):
            w.submit(pending(w, i))
        wait_for(lambda: value(metrics, "guard_capture_enabled") == 0)
        assert w._thread.is_alive()
        w.submit(pending(w, 9))  # after the failure: counted, not queued
        w.close()
    assert not w._thread.is_alive()
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "guard.events"]
    (disabled,) = [e for e in events if e["event"] == "capture_disabled"]
    assert "ValueError" in disabled["error"] and disabled["model"] == MODEL
    assert value(metrics, "guard_capture_records_total", outcome="written") == 1
    assert value(metrics, "guard_capture_records_total", outcome="disabled") == 4
    assert [r.request_id for r in read_all(tmp_path / "cap")] == ["id-0"]


def test_bytes_outputs_of_an_upstream_are_recorded_and_read_back(tmp_path):
    w, metrics = writer(tmp_path)
    w.start()
    labels = np.array([[b"0.91:3:cat", b""], [b"\xff", b"0.5:1:dog"]], dtype=object)
    x = np.ones((2, 4), np.float32)
    w.submit(PendingRecord(w.tag("bytes", 0.001), "primary", 0, {"x": x}, {"labels": labels}))
    w.close()
    (record,) = read_all(tmp_path / "cap")
    (tensor,) = record.outputs
    assert tensor.datatype == "BYTES"
    back = tensors(record.outputs)["labels"]
    assert back.dtype == object and back.tolist() == labels.tolist()
    assert value(metrics, "guard_capture_records_total", outcome="written") == 1


def test_the_queue_is_bounded_in_bytes_too(tmp_path):
    """Before the writer starts, records queue up: past queue_bytes (not queue_size) they are
    dropped and counted; once written, their bytes are free again."""
    w, metrics = writer(tmp_path, queue_size=1000, queue_bytes=3 * 56)  # 56 bytes a record
    for i in range(5):
        w.submit(pending(w, i))
    assert value(metrics, "guard_capture_records_total", outcome="dropped") == 2
    w.start()
    wait_for(lambda: value(metrics, "guard_capture_records_total", outcome="written") == 3)
    w.submit(pending(w, 9))
    wait_for(lambda: value(metrics, "guard_capture_records_total", outcome="written") == 4)
    w.close()
