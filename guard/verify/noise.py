"""The reference's noise floor: how far it disagrees with itself (Diffy's idea, for tensors).

Measured once per model at load, before the mirror starts:

- batch 1 vs batched: each input row run alone, and all rows in one batch (kernels pick other
  blockings, reductions run in another order);
- thread counts: the batched run repeated at each of ``thread_counts`` (another reduction split).

Per output, the floor is the largest absolute difference seen in any of these comparisons.
Tier 1 then allows ``atol + rtol * max|ref| + multiplier * floor`` (``checks.tensor.noise_floor``):
drift is judged beyond what the reference does on its own.

Inputs: an ``.npz`` named in the config, else generated from the model's signature (seeded):
float inputs standard normal, integer inputs in [0, 10), booleans at random. A signature
without datatypes or with unknown non-batch dimensions cannot generate inputs: the floor is then
not measured and the report says why (name an .npz instead).

Thread counts: the reference backend's declaration says how (``BackendKind.with_threads``):
torch's thread count is process-wide, so the torch reference itself is rerun with it changed
for the measurement and restored after (this happens at load, before the model serves); ONNX
Runtime gets a second session with the other thread count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from guard.backends import Backend
from guard.config import BackendConfig, NoiseFloorConfig
from guard.protocol.synthetic import CannotGenerate, generate_inputs


@dataclass
class NoiseFloor:
    per_output: dict[str, float] = field(default_factory=dict)
    comparisons: list[str] = field(default_factory=list)
    samples: int = 0
    source: str = ""
    skipped: str = ""  # why the floor was not measured ("" when it was)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"per_output": dict(self.per_output), "comparisons": list(self.comparisons),
                "samples": self.samples, "source": self.source, "skipped": self.skipped,
                "notes": list(self.notes)}




def _max_abs(a: np.ndarray, b: np.ndarray) -> float | None:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or not np.issubdtype(a.dtype, np.number):
        return None
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    both = np.isfinite(a64) & np.isfinite(b64)
    return float(np.max(np.abs(a64[both] - b64[both]))) if both.any() else 0.0


def _fold(floor: NoiseFloor, label: str, a: dict, b: dict) -> None:
    floor.comparisons.append(label)
    for name in sorted(set(a) & set(b)):
        err = _max_abs(a[name], b[name])
        if err is None:
            floor.notes.append(f"{label}: output '{name}' not comparable (shape/dtype)")
            continue
        floor.per_output[name] = max(floor.per_output.get(name, 0.0), err)


def _load_inputs(config: NoiseFloorConfig, specs) -> tuple[dict[str, np.ndarray], str]:
    if config.inputs:
        with np.load(config.inputs) as data:
            arrays = {k: data[k] for k in data.files}
        return arrays, f"file {Path(config.inputs).name}"
    return generate_inputs(specs, config.samples), "generated from the signature (seed 0)"


def measure_noise_floor(reference: Backend, spec: BackendConfig,
                        config: NoiseFloorConfig, input_specs=None) -> NoiseFloor:
    """``input_specs``: the signature to generate inputs from (default: the reference's own;
    the checked pair passes the primary's when the reference's cannot generate, e.g. a
    TorchScript file without guard.json)."""
    floor = NoiseFloor()
    try:
        inputs, floor.source = _load_inputs(
            config, reference.describe().inputs if input_specs is None else input_specs)
    except CannotGenerate as exc:
        floor.skipped = f"{exc}: set checks.tensor.noise_floor.inputs to an .npz"
        return floor
    lengths = {a.shape[0] if a.ndim else None for a in inputs.values()}
    rows = min(config.samples, min((n for n in lengths if n), default=0))
    floor.samples = rows
    batched_inputs = {k: v[:rows] if v.ndim else v for k, v in inputs.items()}
    batched = reference.infer(batched_inputs)
    if len(lengths) == 1 and None not in lengths and rows > 1:
        singles = [reference.infer({k: v[i:i + 1] for k, v in inputs.items()})
                   for i in range(rows)]
        stacked = {}
        for name in batched:
            try:
                stacked[name] = np.concatenate([s[name] for s in singles], axis=0)
            except (ValueError, KeyError):
                floor.notes.append(f"output '{name}' does not stack along axis 0: left out of "
                                   f"the batch comparison")
        _fold(floor, f"batch 1 vs batch {rows}", stacked, batched)
    else:
        floor.notes.append("inputs do not share a batch axis of 2 or more: batch comparison "
                           "skipped")
    counts = list(dict.fromkeys(config.thread_counts))
    from guard.backends import backend_kind

    kind = backend_kind(spec.backend)
    if not kind.threaded:
        floor.notes.append(f"thread counts do not apply to a {spec.backend} reference")
        counts = []
    runs = []
    for threads in counts:
        with kind.with_threads(reference, spec, threads) as backend:
            runs.append((threads, backend.infer(batched_inputs)))
    for (t0, first), (t1, other) in zip(runs, runs[1:]):
        _fold(floor, f"threads {t0} vs {t1}", first, other)
    for name in batched:
        floor.per_output.setdefault(name, 0.0)
    return floor


# -- per-layer noise (tier 2) --------------------------------------------------------------------
def _rel_l2(a: np.ndarray, b: np.ndarray) -> float | None:
    """||a - b|| / ||b|| over positions finite on both sides (None: not comparable)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or not np.issubdtype(a.dtype, np.number):
        return None
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    both = np.isfinite(a64) & np.isfinite(b64)
    norm = float(np.linalg.norm(b64[both]))
    diff = float(np.linalg.norm(a64[both] - b64[both]))
    return 0.0 if diff == 0.0 else (diff / norm if norm > 0 else None)


def layer_noise(run, inputs: dict[str, np.ndarray], samples: int,
                thread_counts: list[int]) -> tuple[dict[str, float], list[str]]:
    """The reference's own noise on every intermediate tensor, as tier 1's floor is measured
    on outputs: rows one at a time vs batched, then the batched run at each thread count.

    ``run(inputs, threads)`` returns the reference's tensors by key (threads None: as built).
    Returns the largest relative L2 difference per key, and the comparisons made."""
    per_key: dict[str, float] = {}
    comparisons: list[str] = []

    def fold(label: str, a: dict, b: dict) -> None:
        comparisons.append(label)
        for key in set(a) & set(b):
            err = _rel_l2(a[key], b[key])
            if err is not None:
                per_key[key] = max(per_key.get(key, 0.0), err)

    lengths = {v.shape[0] if v.ndim else None for v in inputs.values()}
    rows = min(samples, min((n for n in lengths if n), default=0))
    batched_inputs = {k: v[:rows] if v.ndim else v for k, v in inputs.items()}
    batched = run(batched_inputs, None)
    if len(lengths) == 1 and None not in lengths and rows > 1:
        singles = [run({k: v[i:i + 1] for k, v in inputs.items()}, None) for i in range(rows)]
        stacked = {}
        for key in batched:
            parts = [s.get(key) for s in singles]
            if all(p is not None and p.ndim and p.shape[0] == 1 for p in parts):
                stacked[key] = np.concatenate(parts, axis=0)
        fold(f"batch 1 vs batch {rows}", stacked, batched)
    runs = [(t, run(batched_inputs, t)) for t in dict.fromkeys(thread_counts)]
    for (t0, first), (t1, other) in zip(runs, runs[1:]):
        fold(f"threads {t0} vs {t1}", first, other)
    for key in batched:
        per_key.setdefault(key, 0.0)
    return per_key, comparisons
