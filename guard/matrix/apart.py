"""One matrix column run in a process of its own (``process: own``), for backends whose settings
are process-wide: Keras picks its backend once per process, so Keras on torch, OpenVINO or jax
cannot share the sweep's process with Keras on TensorFlow (which exported the models).

The sweep writes the column's block and its samples to a folder; the child
(``python -m guard.matrix.apart FOLDER``) loads the backend there, runs every sample and writes
the outputs and timings back. The child's environment is the sweep's, less ``KERAS_BACKEND``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from guard.config import BackendConfig


def run_apart(spec: BackendConfig, role: str, threads: int, samples: list[dict]):
    """``run_backend`` of guard/matrix/runner.py, in a child process; returns its BackendRun."""
    from guard.matrix.runner import BackendRun

    with tempfile.TemporaryDirectory(prefix="guard-matrix-") as tmp:
        folder = Path(tmp)
        (folder / "job.json").write_text(json.dumps({
            "spec": spec.model_dump(mode="json"), "role": role, "threads": threads,
            "base_dir": str(spec.context.base_dir) if spec.context.base_dir else None}))
        # (numpy's stub lets **arrays bind savez's allow_pickle: a stub artefact, not ours)
        np.savez(folder / "samples.npz", **_flatten(samples))  # type: ignore[arg-type]
        env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
        done = subprocess.run([sys.executable, "-m", "guard.matrix.apart", str(folder)],
                              env=env, capture_output=True, text=True, timeout=1800)
        run = BackendRun()
        if done.returncode != 0 or not (folder / "run.json").exists():
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            run.error = "process failed: " + (lines[-1][:400] if lines
                                              else f"exit status {done.returncode}")
            return run
        result = json.loads((folder / "run.json").read_text())
        run.error, run.load_s, run.latency_ms = (result["error"], result["load_s"],
                                                 result["latency_ms"])
        run.details = result.get("details", {})
        with np.load(folder / "outputs.npz") as data:
            run.outputs = _unflatten({k: data[k] for k in data.files}, result["count"])
        return run


def _flatten(items: list[dict]) -> dict[str, np.ndarray]:
    return {f"{i}/{name}": np.asarray(value) for i, item in enumerate(items)
            for name, value in item.items()}


def _unflatten(arrays: dict[str, np.ndarray], count: int) -> list[dict]:
    items: list[dict] = [{} for _ in range(count)]
    for key, value in arrays.items():
        index, _, name = key.partition("/")
        items[int(index)][name] = value
    return items


def main(folder: str) -> int:
    from guard.config import ConfigContext
    from guard.matrix.runner import run_backend

    folder_path = Path(folder)
    job = json.loads((folder_path / "job.json").read_text())
    spec = BackendConfig.model_validate(job["spec"])
    spec.context = ConfigContext(base_dir=Path(job["base_dir"]) if job["base_dir"] else None)
    with np.load(folder_path / "samples.npz") as data:
        arrays = {k: data[k] for k in data.files}
    count = 1 + max((int(k.partition("/")[0]) for k in arrays), default=-1)
    samples = _unflatten(arrays, count)
    run = run_backend(spec, job["role"], job["threads"], samples)
    np.savez(folder_path / "outputs.npz", **_flatten(run.outputs))  # type: ignore[arg-type]
    (folder_path / "run.json").write_text(json.dumps({
        "error": run.error, "load_s": run.load_s, "latency_ms": run.latency_ms,
        "details": run.details, "count": len(run.outputs)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
