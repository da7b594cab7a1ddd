"""``guard capture inspect``: what a capture holds, without replaying it."""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from guard.capture.reader import FileStats, expand_paths, read_records
from guard.capture.records import live_passed
from guard.errors import GuardError


def iso(unix_nanos: int) -> str:
    return datetime.fromtimestamp(unix_nanos / 1e9, timezone.utc).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class ModelSummary:
    records: int = 0
    mirrored: int = 0
    live_failed: int = 0
    routes: Counter = field(default_factory=Counter)
    first_nanos: int = 0
    last_nanos: int = 0
    config_hashes: set = field(default_factory=set)
    backends: set = field(default_factory=set)

    def add(self, record) -> None:
        self.records += 1
        self.mirrored += record.mirrored
        self.live_failed += live_passed(record) is False
        self.routes[record.route or "-"] += 1
        if record.unix_nanos:
            t = record.unix_nanos
            self.first_nanos = t if not self.first_nanos else min(self.first_nanos, t)
            self.last_nanos = max(self.last_nanos, t)
        if record.config_hash:
            self.config_hashes.add(record.config_hash)
        for b in record.backends:
            self.backends.add(f"{b.role}: {b.backend}/{b.precision}/{b.device} {b.artifact}")

    def as_dict(self) -> dict:
        return {
            "records": self.records, "mirrored": self.mirrored, "live_failed": self.live_failed,
            "routes": dict(sorted(self.routes.items())),
            "first": iso(self.first_nanos) if self.first_nanos else None,
            "last": iso(self.last_nanos) if self.last_nanos else None,
            "config_hashes": sorted(self.config_hashes), "backends": sorted(self.backends),
        }


def summarise(paths: list[str]) -> dict:
    files = []
    models: dict[str, ModelSummary] = {}
    for path in expand_paths(paths):
        stats = FileStats()
        per_file: Counter = Counter()
        for record in read_records(path, stats):
            models.setdefault(record.model, ModelSummary()).add(record)
            per_file[record.model] += 1
        entry = asdict(stats)
        entry["models"] = dict(sorted(per_file.items()))
        files.append(entry)
    totals = {key: sum(f[key] for f in files)
              for key in ("records", "size", "skipped_bytes", "skipped_regions", "undecodable")}
    totals["files"] = len(files)
    totals["truncated_files"] = sum(f["truncated_tail"] for f in files)
    totals["vanished_files"] = sum(f["vanished"] for f in files)
    return {"files": files, "models": {n: m.as_dict() for n, m in sorted(models.items())},
            "totals": totals}


def print_summary(summary: dict, out=None) -> None:
    out = out or sys.stdout
    t = summary["totals"]
    print(f"{t['files']} file(s), {t['size']} bytes: {t['records']} record(s); skipped "
          f"{t['skipped_bytes']} bytes in {t['skipped_regions']} region(s)"
          + (f", {t['truncated_files']} file(s) end inside a record" if t["truncated_files"]
             else "")
          + (f", {t['vanished_files']} file(s) deleted before they were read"
             if t["vanished_files"] else ""), file=out)
    for f in summary["files"]:
        models = ", ".join(f"{m}: {n}" for m, n in f["models"].items()) or "-"
        line = f"  {f['path']}: {f['records']} record(s) ({models})"
        if f["skipped_bytes"]:
            line += f"; skipped {f['skipped_bytes']} bytes in {f['skipped_regions']} region(s)"
        print(line, file=out)
        for problem in f["problems"]:
            print(f"    {problem}", file=out)
    for name, m in summary["models"].items():
        span = f"{m['first']} .. {m['last']}" if m["first"] else "no timestamps"
        routes = ", ".join(f"{r} {n}" for r, n in m["routes"].items())
        print(f"model {name}: {m['records']} record(s), {m['mirrored']} mirrored, "
              f"{m['live_failed']} failed live; routes: {routes}; {span}", file=out)
        if m["config_hashes"]:
            print(f"  config: {', '.join(m['config_hashes'])}", file=out)
        for backend in m["backends"]:
            print(f"  {backend}", file=out)


def inspect_command(paths: list[str], as_json: bool) -> int:
    summary = summarise(paths)
    t = summary["totals"]
    if not t["records"] and t["skipped_bytes"]:
        # Not one record in all those bytes: not capture files (a model file given by
        # mistake), rather than an empty capture; a usage error, said in one line.
        raise GuardError(f"no capture record in {t['files']} file(s) ({t['skipped_bytes']} "
                         "bytes, none of them a record's frame): are these capture segments "
                         "(.gcap)?")
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return 0

