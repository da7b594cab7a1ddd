"""Reading captures back: files and folders of segments -> CaptureRecord messages, with counts of
what had to be skipped (damaged or torn frames, frames whose payload is not a record)."""

from __future__ import annotations

import os
import stat
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
    # Listed, then gone before it was read: a live guard's retention deleted its oldest
    # segment while this read the folder (counted and named, the rest is read on).
    vanished: bool = False


def expand_paths(paths: Iterable[str | Path], suffixes: tuple[str, ...] = (SUFFIX,)) -> list[Path]:
    """Files as given; folders become their segment files (recursively, in name order, which is
    creation order). A path that does not exist is a usage error, and so is a folder (or a
    subfolder) that cannot be read: a capture that cannot be read whole is never summed up
    as if it were. A file named twice (a folder and a file in it) is read once."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if _is_dir(path):
            found = sorted(_files_under(path, suffixes))
            if not found:
                raise GuardError(f"{path}: no capture files ({', '.join(suffixes)}) in this folder")
            out += found
        elif path.is_file():
            out.append(path)
        else:
            raise GuardError(f"{path}: no such file or folder")
    unique, seen = [], set()
    for file in out:
        real = os.path.realpath(file)
        if real not in seen:
            seen.add(real)
            unique.append(file)
    return unique


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(path.stat().st_mode)
    except FileNotFoundError:
        return False
    except OSError as exc:  # a folder above it that this user cannot search
        raise GuardError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _files_under(folder: Path, suffixes: tuple[str, ...]) -> Iterator[Path]:
    def refused(exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError):  # (a folder removed while walking: gone)
            raise GuardError(f"{exc.filename}: cannot read this folder: "
                             f"{exc.strerror or exc}") from None

    for top, _, names in os.walk(folder, onerror=refused):
        for name in names:
            if os.path.splitext(name)[1] in suffixes:
                yield Path(top, name)


def read_records(path: str | Path, stats: FileStats) -> Iterator[pb.CaptureRecord]:
    """Every record of one segment file; what cannot be read is counted in ``stats``. A file
    that is gone (deleted since it was listed) yields nothing and says so in ``stats``."""
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
    except FileNotFoundError:
        stats.vanished = True
        stats.problems.append("deleted before it was read (a live guard's retention)")
    except OSError as exc:
        raise GuardError(f"{path}: cannot read: {exc.strerror or exc}") from None
