"""Reading captures back: files and folders of segments -> CaptureRecord messages, with counts of
what had to be skipped (damaged or torn frames, frames whose payload is not a record)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from google.protobuf.message import DecodeError

from guard.capture.records import parse_record
from guard.capture.segment import SUFFIX, ReadStats, read_file
from guard.errors import GuardError
from guard.v1 import capture_pb2 as pb


@dataclass
class FileStats(ReadStats):
    records: int = 0
    undecodable: int = 0  # frames with a good CRC whose payload is not a CaptureRecord


def expand_paths(paths: Iterable[str | Path], suffixes: tuple[str, ...] = (SUFFIX,)) -> list[Path]:
    """Files as given; folders become their segment files (recursively, in name order, which is
    creation order). A path that does not exist is a usage error."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
            if not found:
                raise GuardError(f"{path}: no capture files ({', '.join(suffixes)}) in this folder")
            out += found
        elif path.is_file():
            out.append(path)
        else:
            raise GuardError(f"{path}: no such file or folder")
    return out


def read_records(path: str | Path, stats: FileStats) -> Iterator[pb.CaptureRecord]:
    """Every record of one segment file; what cannot be read is counted in ``stats``."""
    try:
        frames = read_file(path, stats)
        for offset, payload in frames:
            try:
                record = parse_record(payload)
            except DecodeError:
                stats.undecodable += 1
                stats.skip(offset, offset + len(payload), "frame payload is not a capture record")
                continue
            stats.records += 1
            yield record
    except OSError as exc:
        raise GuardError(f"{path}: cannot read: {exc.strerror or exc}") from None
