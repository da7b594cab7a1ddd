"""guard/capture/segment.py and reader.py: frames, CRCs, and resynchronisation after damage."""

from __future__ import annotations

import zlib

import pytest

from guard.capture.reader import FileStats, expand_paths, read_records
from guard.capture.records import parse_record
from guard.capture.segment import HEADER_SIZE, MAGIC, ReadStats, encode_frame, iter_frames
from guard.errors import GuardError
from guard.v1 import capture_pb2 as pb


def payloads(n: int) -> list[bytes]:
    return [pb.CaptureRecord(model="m", request_id=f"r{i}", sequence=i + 1,
                             inputs=[pb.Tensor(name="x", datatype="UINT8", shape=[i + 1],
                                               raw=bytes(range(i + 1)))]).SerializeToString()
            for i in range(n)]


def frames(data: bytes) -> tuple[list[bytes], ReadStats]:
    stats = ReadStats()
    return [p for _, p in iter_frames(data, stats)], stats


def test_round_trip_keeps_every_payload_in_order():
    items = payloads(20)
    got, stats = frames(b"".join(encode_frame(p) for p in items))
    assert got == items
    assert stats.frames == 20 and stats.skipped_bytes == 0 and not stats.truncated_tail


def test_frame_layout_is_magic_length_crcs_payload():
    frame = encode_frame(b"hello")
    assert frame[:8] == MAGIC
    assert int.from_bytes(frame[8:12], "little") == 5
    assert int.from_bytes(frame[12:16], "little") == zlib.crc32(b"hello")
    assert int.from_bytes(frame[16:20], "little") == zlib.crc32(frame[:16])
    assert frame[HEADER_SIZE:] == b"hello"


def test_flipped_payload_byte_loses_that_record_only():
    items = payloads(10)
    encoded = [encode_frame(p) for p in items]
    data = bytearray(b"".join(encoded))
    start = sum(len(e) for e in encoded[:4])
    data[start + HEADER_SIZE + 3] ^= 0xFF  # inside record 4's payload
    got, stats = frames(bytes(data))
    assert got == items[:4] + items[5:]
    assert stats.skipped_regions == 1
    assert stats.skipped_bytes == len(encoded[4])
    assert "payload CRC" in stats.problems[0]


def test_damaged_length_is_caught_by_the_header_crc():
    items = payloads(6)
    encoded = [encode_frame(p) for p in items]
    data = bytearray(b"".join(encoded))
    start = len(encoded[0])
    data[start + 8:start + 12] = (10**6).to_bytes(4, "little")  # record 1 claims 1 MB
    got, stats = frames(bytes(data))
    assert got == [items[0]] + items[2:]  # the bogus length swallowed nothing after it
    assert stats.skipped_bytes == len(encoded[1])
    assert "header CRC" in stats.problems[0]


def test_garbage_in_the_middle_is_skipped_and_counted():
    items = payloads(8)
    encoded = [encode_frame(p) for p in items]
    garbage = bytes(range(256)) * 3 + MAGIC + b"not a header"  # even a false marker
    data = b"".join(encoded[:3]) + garbage + b"".join(encoded[3:])
    got, stats = frames(data)
    assert got == items
    assert stats.skipped_bytes == len(garbage)
    assert stats.skipped_regions == 2  # the garbage, then the false marker inside it


def test_truncated_tail_loses_only_the_torn_record():
    items = payloads(5)
    data = b"".join(encode_frame(p) for p in items)
    for cut in (3, HEADER_SIZE - 1, HEADER_SIZE + 2):  # inside header, at payload start
        torn = data[: len(data) - len(encode_frame(items[-1])) + cut]
        got, stats = frames(torn)
        assert got == items[:-1]
        assert stats.truncated_tail
        assert stats.skipped_bytes == cut


def test_payload_that_contains_the_marker_is_read_intact():
    tricky = MAGIC * 4 + encode_frame(b"inner")  # a frame inside a payload
    items = [b"a", tricky, b"b"]
    got, stats = frames(b"".join(encode_frame(p) for p in items))
    assert got == items and stats.skipped_bytes == 0


def test_reader_counts_frames_that_are_not_records(tmp_path):
    good = payloads(2)
    path = tmp_path / "s.gcap"
    path.write_bytes(encode_frame(good[0]) + encode_frame(b"\xff\xff\xff") + encode_frame(good[1]))
    stats = FileStats()
    records = list(read_records(path, stats))
    assert [r.request_id for r in records] == ["r0", "r1"]
    assert stats.records == 2 and stats.undecodable == 1 and stats.skipped_regions == 1
    assert parse_record(good[1]).sequence == 2


def test_expand_paths_lists_folders_in_name_order_and_rejects_missing(tmp_path):
    (tmp_path / "m").mkdir()
    for name in ("b.gcap", "a.gcap", "notes.txt"):
        (tmp_path / "m" / name).write_bytes(b"")
    assert [p.name for p in expand_paths([tmp_path])] == ["a.gcap", "b.gcap"]
    with pytest.raises(GuardError, match="no such file"):
        expand_paths([tmp_path / "nope.gcap"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(GuardError, match="no capture files"):
        expand_paths([tmp_path / "empty"])


def test_a_file_named_twice_is_read_once(tmp_path):
    """A folder and a file in it (or the same file by two spellings): one file, not twice its
    records in a replay or an inspect."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a.gcap").write_bytes(b"")
    twice = expand_paths([tmp_path, tmp_path / "m" / "a.gcap", tmp_path / "m" / ".." / "m"])
    assert [p.name for p in twice] == ["a.gcap"]


def test_a_folder_that_cannot_be_read_is_an_error_never_left_out(tmp_path, monkeypatch):
    """A model's subfolder another user's guard made (0700): the whole capture cannot be read,
    and saying so beats summing up the part that can (os.walk's default skips it silently).
    The kernel's refusal is what scandir raises (the tests may run as root, whom permissions
    do not stop)."""
    import os

    for model in ("readable", "secret"):
        (tmp_path / model).mkdir()
        (tmp_path / model / "a.gcap").write_bytes(b"")
    scandir = os.scandir

    def refusing(path="."):
        if os.fspath(path).endswith("secret"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    with pytest.raises(GuardError, match="secret: cannot read this folder: Permission denied"):
        expand_paths([tmp_path])


def test_a_segment_deleted_after_listing_is_counted_not_fatal(tmp_path):
    """A live guard's retention deletes its oldest segment while a replay reads the folder:
    that file yields nothing and says so; the others are read."""
    (tmp_path / "a.gcap").write_bytes(encode_frame(payloads(1)[0]))
    (tmp_path / "b.gcap").write_bytes(encode_frame(payloads(1)[0]))
    first, second = expand_paths([tmp_path])
    first.unlink()
    gone, kept = FileStats(), FileStats()
    assert list(read_records(first, gone)) == [] and gone.vanished and gone.problems
    assert len(list(read_records(second, kept))) == 1 and not kept.vanished
