"""Where replay items come from: capture segment files (and folders of them), ``.npz`` input
sets and JSONL prompt sets, filtered by model, time and count, with everything skipped counted
for the report.

``.npz`` input sets: one array per input name, first axis = samples. Sample ``i`` of an array
becomes the input ``array[i:i+1]`` (a batch of one) when the model's input has as many
dimensions as the array, ``array[i]`` when it has one fewer. Which model: the one named by
``--models`` (exactly one), or the config's only model. Arrays are checked against the model's
inputs before anything runs; a mismatch is a usage error naming the array.

A generative model's capture record holds the sampled call (guard/capture/records.py): the
item is the completion that was compared live, the primary's own answer or, where the fallback
answered and the verifier probed the primary, the probe's. A call the fallback answered with no
probe holds no completion of the primary: it is left out and counted (filter
``no_primary_completion``). A record that cannot be read back (damaged, or written by a newer
guard: its ``format_version``) is skipped and counted as unreadable, its reason in the file's
problems. JSONL prompt sets (guard/replay/prompts.py) go to one generative model, chosen as
for ``.npz``; their items have no completion yet: the primary generates it.

Time filters (``--since``/``--until``) apply to records with a timestamp; ``.npz`` samples and
prompts have none and are kept.
"""

from __future__ import annotations

import zipfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from guard.backends.base import TensorSpec, oip_datatype
from guard.capture.reader import FileStats, expand_paths, read_records
from guard.capture.records import (
    RecordError,
    generation_calls,
    is_generation,
    live_passed,
    tensors,
)
from guard.errors import GuardError
from guard.replay.items import ReplayItem
from guard.replay.prompts import SUFFIX as JSONL
from guard.replay.prompts import PromptStats, read_prompts

NPZ = ".npz"


@dataclass
class Filters:
    models: frozenset[str] | None = None  # None: every model the config has
    since_nanos: int | None = None
    until_nanos: int | None = None
    max_records: int | None = None


@dataclass
class SourceStats:
    files: list[dict] = field(default_factory=list)
    records_read: int = 0
    replayed: int = 0
    unknown_models: Counter = field(default_factory=Counter)  # model the config lacks -> records
    filtered: Counter = field(default_factory=Counter)  # why -> records left out
    unreadable_records: int = 0  # parsed, but tensors could not be rebuilt
    stopped_at_max_records: bool = False  # --max-records reached: later records not read

    @property
    def skipped_bytes(self) -> int:
        return sum(f.get("skipped_bytes", 0) for f in self.files)

    @property
    def skipped_regions(self) -> int:
        return sum(f.get("skipped_regions", 0) for f in self.files)

    @property
    def vanished_files(self) -> list[str]:
        """Segment files deleted between listing and reading (a live guard's retention)."""
        return [f["path"] for f in self.files if f.get("vanished")]

    def as_dict(self) -> dict:
        return {
            "files": self.files,
            "records_read": self.records_read,
            "replayed": self.replayed,
            "skipped_bytes": self.skipped_bytes,
            "skipped_regions": self.skipped_regions,
            "vanished_files": len(self.vanished_files),
            "unreadable_records": self.unreadable_records,
            "filtered": dict(sorted(self.filtered.items())),
            "stopped_at_max_records": self.stopped_at_max_records,
        }


def _size(path: Path) -> int:
    """The file's size for the progress figures; 0 for one deleted since it was listed (a
    live guard's retention: the reader counts it)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class NpzInput:
    """An ``.npz`` input set, checked against one model's inputs on construction."""

    def __init__(self, path: Path, model: str, specs: tuple[TensorSpec, ...]):
        self.path = path
        self.model = model
        try:
            with np.load(path, allow_pickle=False) as data:
                self.arrays = {name: data[name] for name in data.files}
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise GuardError(f"{path}: not a readable .npz file: {exc}") from None
        self._check(specs)

    def _check(self, specs: tuple[TensorSpec, ...]) -> None:
        where = f"{self.path}"
        names = [s.name for s in specs]
        if not self.arrays:
            raise GuardError(f"{where}: holds no arrays")
        for name in self.arrays:
            if names and name not in names:
                raise GuardError(f"{where}: array '{name}' is not an input of model "
                                 f"'{self.model}' (its inputs: {', '.join(names)})")
        for name in names:
            if name not in self.arrays:
                raise GuardError(f"{where}: no array for input '{name}' of model '{self.model}'")
        counts = {name: (a.shape[0] if a.ndim else 0) for name, a in self.arrays.items()}
        if any(a.ndim == 0 for a in self.arrays.values()):
            bad = next(n for n, a in self.arrays.items() if a.ndim == 0)
            raise GuardError(f"{where}: array '{bad}' is a scalar; the first axis must count "
                             "samples")
        if len(set(counts.values())) > 1:
            first, *_ = counts
            odd = next(n for n in counts if counts[n] != counts[first])
            raise GuardError(f"{where}: array '{odd}' has {counts[odd]} samples, array "
                             f"'{first}' has {counts[first]} (first axis = samples)")
        self.count = next(iter(counts.values()))
        self._keep_axis: dict[str, bool] = {}
        by_name = {s.name: s for s in specs}
        for name, array in self.arrays.items():
            spec = by_name.get(name)
            keep = True
            if spec is not None and spec.shape:
                if len(spec.shape) == array.ndim:
                    keep = True
                elif len(spec.shape) == array.ndim - 1:
                    keep = False
                else:
                    raise GuardError(
                        f"{where}: array '{name}' of shape {list(array.shape)} does not fit "
                        f"input '{name}' of shape {list(spec.shape)} (first axis = samples)")
                sample_shape = array.shape[1:] if not keep else (1, *array.shape[1:])
                if any(w not in (-1, g) for w, g in zip(spec.shape, sample_shape)):
                    raise GuardError(
                        f"{where}: array '{name}': samples of shape {list(sample_shape)} do "
                        f"not fit input '{name}' of shape {list(spec.shape)} (-1 = any)")
            if spec is not None and spec.datatype:
                try:
                    datatype = oip_datatype(array.dtype)
                except TypeError:
                    datatype = str(array.dtype)
                if datatype != spec.datatype:
                    raise GuardError(f"{where}: array '{name}' holds {array.dtype} "
                                     f"({datatype}), input '{name}' takes {spec.datatype}")
            self._keep_axis[name] = keep

    @property
    def batched(self) -> bool:
        """Every array keeps its first axis as the input's batch axis (the arrays whole are
        one batch of the model's inputs)."""
        return all(self._keep_axis.values())

    def sample(self, i: int) -> dict[str, np.ndarray]:
        return {
            name: (a[i:i + 1] if self._keep_axis[name] else a[i])
            for name, a in self.arrays.items()
        }


class Source:
    """Yields ``ReplayItem``s from the given paths in order, applying the filters."""

    def __init__(
        self,
        paths: list[str],
        config_models: set[str],
        filters: Filters,
        npz_specs: Callable[[str], tuple[TensorSpec, ...]],
        npz_model: str | None,
        generative: frozenset[str] = frozenset(),
    ):
        """``npz_model``: the model ``.npz`` inputs and prompt sets go to (None: ask for
        --models); ``generative``: the config's generative models (prompt sets go to one)."""
        self.filters = filters
        self.config_models = config_models
        self.stats = SourceStats()
        self.files = expand_paths(paths, suffixes=(".gcap", NPZ, JSONL))
        self.npz: dict[Path, NpzInput] = {}
        self.prompt_model = npz_model
        for path in self.files:
            if path.suffix not in (NPZ, JSONL):
                continue
            if npz_model is None:
                raise GuardError(f"{path}: which model do these inputs go to? The config "
                                 "has several: pass --models NAME (one model)")
            if path.suffix == NPZ:
                self.npz[path] = NpzInput(path, npz_model, npz_specs(npz_model))
            elif npz_model not in generative:
                raise GuardError(f"{path}: a JSONL prompt set is generated by a generative "
                                 f"model's primary; model '{npz_model}' is not one (task: "
                                 "generation)")
        sizes = [_size(p) for p in self.files]
        self._total_bytes = max(1, sum(sizes))
        self._offsets = np.cumsum([0, *sizes]).tolist()

    def _wanted(self, model: str, unix_nanos: int) -> str:
        """'' to keep, else why the record is left out."""
        f = self.filters
        if f.models is not None and model not in f.models:
            return "model"
        if unix_nanos:
            if f.since_nanos is not None and unix_nanos < f.since_nanos:
                return "time"
            if f.until_nanos is not None and unix_nanos > f.until_nanos:
                return "time"
        return ""

    def items(self) -> Iterator[ReplayItem]:
        index = 0
        limit = self.filters.max_records
        for number, path in enumerate(self.files):
            if self._limit_reached(index, limit):
                break
            base = self._offsets[number]
            size = max(1, self._offsets[number + 1] - base)
            if path in self.npz:
                produced = yield from self._npz_items(path, index, base, size, limit)
                index += produced
            elif path.suffix == JSONL:
                produced = yield from self._prompt_items(path, index, base, limit)
                index += produced
            else:
                produced = yield from self._capture_items(path, index, base, limit)
                index += produced

    def _limit_reached(self, index: int, limit: int | None) -> bool:
        if limit is not None and index >= limit:
            self.stats.stopped_at_max_records = True
            return True
        return False

    def _npz_items(self, path: Path, index: int, base: int, size: int, limit):
        npz = self.npz[path]
        produced = 0
        entry = {"path": str(path), "kind": "npz", "model": npz.model, "records": npz.count,
                 "skipped_bytes": 0, "skipped_regions": 0}
        self.stats.files.append(entry)
        for i in range(npz.count):
            if self._limit_reached(index + produced, limit):
                break
            self.stats.records_read += 1
            why = self._wanted(npz.model, 0)
            if why:
                self.stats.filtered[why] += 1
                continue
            yield ReplayItem(
                index=index + produced, model=npz.model, inputs=npz.sample(i),
                request_id=f"{path.name}[{i}]", source=str(path),
                progress=(base + size * (i + 1) / npz.count) / self._total_bytes,
            )
            produced += 1
            self.stats.replayed += 1
        return produced

    def _prompt_items(self, path: Path, index: int, base: int, limit):
        stats = PromptStats()
        produced = 0
        model = self.prompt_model
        assert model is not None, "__init__ refuses a prompt set without its model"
        try:
            for call in read_prompts(path, model, stats):
                if self._limit_reached(index + produced, limit):
                    break
                self.stats.records_read += 1
                why = self._wanted(model, 0)
                if why:
                    self.stats.filtered[why] += 1
                    continue
                yield ReplayItem(index=index + produced, model=model, inputs={},
                                 request_id=call.request_id, source=str(path),
                                 progress=(base + stats.position) / self._total_bytes,
                                 generation=call, generate=True)
                produced += 1
                self.stats.replayed += 1
        except OSError as exc:
            raise GuardError(f"{path}: cannot read: {exc.strerror or exc}") from None
        finally:
            self.stats.records_read += stats.unreadable
            self.stats.unreadable_records += stats.unreadable
            self.stats.files.append({"path": str(path), "kind": "prompts", "model": model,
                                     "records": stats.records, "unreadable": stats.unreadable,
                                     "problems": stats.problems, "skipped_bytes": 0,
                                     "skipped_regions": 0})
        return produced

    @staticmethod
    def _generation_item(record) -> tuple[dict, str]:
        """(the item's generation fields, "") or ({}, why it is left out)."""
        call, probed = generation_calls(record)
        compared = probed if probed is not None else call
        if probed is None and (record.route or call.route) != "primary":
            return {}, "no_primary_completion"
        return {"generation": compared, "inputs": {}}, ""

    def _capture_items(self, path: Path, index: int, base: int, limit):
        stats = FileStats()
        produced = 0
        try:
            for record in read_records(path, stats):
                if self._limit_reached(index + produced, limit):
                    break  # (a record taken past the limit is not one read: counts add up)
                self.stats.records_read += 1
                model = record.model
                if model not in self.config_models:
                    if self.filters.models is None or model in self.filters.models:
                        self.stats.unknown_models[model] += 1
                    else:
                        self.stats.filtered["model"] += 1
                    continue
                why = self._wanted(model, record.unix_nanos)
                if why:
                    self.stats.filtered[why] += 1
                    continue
                try:
                    if is_generation(record):
                        fields, why = self._generation_item(record)
                    else:
                        fields, why = {"inputs": tensors(record.inputs)}, ""
                except RecordError as exc:
                    self.stats.unreadable_records += 1
                    if len(stats.problems) < 5:
                        stats.problems.append(f"record {stats.records}: {exc}")
                    continue
                if why:
                    self.stats.filtered[why] += 1
                    continue
                yield ReplayItem(
                    index=index + produced, model=model,
                    unix_nanos=record.unix_nanos, request_id=record.request_id,
                    source=str(path), live_passed=live_passed(record),
                    progress=(base + stats.position) / self._total_bytes, **fields,
                )
                produced += 1
                self.stats.replayed += 1
        finally:
            entry = asdict(stats)
            entry["kind"] = "capture"
            self.stats.files.append(entry)
        return produced
