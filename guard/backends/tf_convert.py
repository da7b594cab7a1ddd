"""Conversions of a SavedModel or a ``.keras`` file that guard derives itself, cached by digest:
LiteRT (``.tflite``: fp32, fp16 weights, int8) and ONNX (tf2onnx, for ``backend: onnxruntime``).

Each conversion runs in a child process (``python -m guard.backends.tf_convert``): the
converters need TensorFlow (~5 s, 650-800 MB) and Keras on its TensorFlow backend, while the
process that asked may run Keras on another backend (one per process) or need no TensorFlow at
all (a LiteRT interpreter is 40 MB, ONNX Runtime has none). A cache hit starts no process.

- ``fp32``: ``TFLiteConverter.from_saved_model`` as it is.
- ``fp16``: float16 weights (``target_spec.supported_types = [float16]``), computed in fp32.
- ``int8`` without calibration inputs: dynamic-range quantisation (int8 weights, activations
  quantised at run time); with ``calibration_inputs`` (an ``.npz``, one array per input name,
  first axis = samples): full integer quantisation calibrated on them, float inputs and outputs.
- ``onnx``: tf2onnx's ``--saved-model`` conversion (opset 17); an NHWC model stays NHWC,
  with Transposes inside.

A ``.keras`` is exported to a SavedModel first (``model.export``), so its conversions name their
tensors as its SavedModel does. Cache: ``$GUARD_CACHE_DIR/derived/tensorflow/``, keyed by the
source's digest (guard/backends/tf_runtime.py ``tree_sha256``; a pinned ``.keras`` is converted
from the very bytes checked), the target, the calibration file's digest and the TensorFlow and
tf2onnx versions. Written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from guard.backends.derive import cache_dir
from guard.backends.tf_runtime import NOT_INSTALLED, tree_sha256
from guard.errors import BackendError

TARGETS = ("fp32", "fp16", "int8", "onnx")
ONNX_OPSET = 17


def is_tf_source(path: str | Path | None) -> bool:
    """A SavedModel directory or a ``.keras`` file (what this module converts)."""
    if not path:
        return False
    path = Path(path)
    return path.suffix == ".keras" or (path / "saved_model.pb").is_file()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        raise BackendError(NOT_INSTALLED.format(name="litert or onnxruntime on a TensorFlow "
                                                "model") + f" ({package} is missing)") from None


def derive(source: str | Path, target: str, calibration: str | None = None,
           sha256: str | None = None, in_process: bool = False) -> Path:
    """The cached conversion of ``source`` (a SavedModel directory or a ``.keras``) to
    ``target`` (``fp32``/``fp16``/``int8`` LiteRT, or ``onnx``). ``sha256``: the pinned digest
    of ``source``, checked here. ``in_process``: convert in this process (for a tool or test
    that has TensorFlow and Keras on TensorFlow imported already) instead of a child process."""
    from guard.backends.tf_runtime import check_pin

    source = Path(source)
    if target not in TARGETS:
        raise BackendError(f"cannot derive '{target}' from {source} (can: {', '.join(TARGETS)})")
    digest = check_pin(source, sha256)
    versions = {"tensorflow": _version("tensorflow")}
    if target == "onnx":
        versions["tf2onnx"] = _version("tf2onnx")
    key_parts = {"sha256": digest, "target": target, **versions,
                 "calibration": tree_sha256(calibration) if calibration else None}
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:20]
    suffix = ".onnx" if target == "onnx" else ".tflite"
    folder = cache_dir() / "tensorflow"
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{source.stem or source.name}.{target}.{key}{suffix}"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        given = source
        if source.is_file():  # convert the bytes checked, not a path that could change
            given = Path(tmp) / source.name
            given.write_bytes(source.read_bytes())
            if tree_sha256(given) != digest:
                raise BackendError(f"{source} changed while guard read it", key="sha256")
        partial = Path(tmp) / out.name
        job: dict[str, Any] = {"source": str(given), "target": target,
                               "calibration": calibration, "out": str(partial)}
        if in_process:
            convert(**job)
        else:
            _run_child(job, source)
        if not partial.exists() or partial.stat().st_size == 0:
            raise BackendError(f"converting {source} to {target} wrote nothing")
        os.replace(partial, out)
    return out


def _run_child(job: dict, source: Path) -> None:
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        done = subprocess.run([sys.executable, "-m", "guard.backends.tf_convert",
                               json.dumps(job)], env=env, capture_output=True, text=True,
                              timeout=1800)
    except subprocess.TimeoutExpired:
        raise BackendError(f"converting {source} to {job['target']} took over 30 minutes") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        last = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines
                    else f"exit status {done.returncode}")
        raise BackendError(f"converting {source} to {job['target']} failed: {last[:400]}")


# -- in the child process (TensorFlow imported) -----------------------------------------------
def convert(source: str, target: str, calibration: str | None, out: str) -> None:
    with tempfile.TemporaryDirectory(prefix="guard-convert-") as tmp:
        saved_model = _as_saved_model(Path(source), Path(tmp))
        if target == "onnx":
            _to_onnx(saved_model, Path(out))
        else:
            Path(out).write_bytes(_to_tflite(saved_model, target, calibration))


def _as_saved_model(source: Path, tmp: Path) -> Path:
    if source.is_dir():
        return source
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    if keras.backend.backend() != "tensorflow":
        raise BackendError("exporting a .keras to a SavedModel needs Keras on its tensorflow "
                           f"backend (this process runs '{keras.backend.backend()}')")
    model = keras.saving.load_model(source, compile=False, safe_mode=True)
    exported = tmp / "saved_model"
    model.export(str(exported), format="tf_saved_model", verbose=False)
    return exported


def _to_tflite(saved_model: Path, precision: str, calibration: str | None) -> bytes:
    import tensorflow as tf

    converter = tf.lite.TFLiteConverter.from_saved_model(str(saved_model))
    if precision == "fp16":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.target_spec.supported_types = [tf.float16]
    elif precision == "int8":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        if calibration:
            converter.representative_dataset = _representative(saved_model, calibration)
    return converter.convert()


def _representative(saved_model: Path, calibration: str):
    """Calibration samples (batch 1) keyed by the signature's input names."""
    import numpy as np
    import tensorflow as tf

    signature = tf.saved_model.load(str(saved_model)).signatures["serving_default"]
    names = sorted(signature.structured_input_signature[1])
    arrays = np.load(calibration)
    missing = [name for name in names if name not in arrays]
    if missing:
        raise BackendError(f"options.calibration_inputs: no array for input '{missing[0]}' "
                           f"(the signature's inputs: {', '.join(names)})")
    count = min(len(arrays[name]) for name in names)

    def samples():
        for i in range(count):
            yield {name: arrays[name][i:i + 1].astype(np.float32) for name in names}

    return samples


def _to_onnx(saved_model: Path, out: Path) -> None:
    """tf2onnx's own ``--saved-model`` path (its command line's steps, in this process):
    the signature's keys name the ONNX graph's inputs and outputs."""
    import tensorflow as tf
    from tf2onnx import tf_loader
    from tf2onnx.convert import _convert_common

    graph_def, inputs, outputs, tables, renames = tf_loader.from_saved_model(
        str(saved_model), None, None, None, ["serving_default"], None, False,
        return_initialized_tables=True, return_tensors_to_rename=True)
    with tf.device("/cpu:0"):
        _convert_common(graph_def, name=str(saved_model), opset=ONNX_OPSET,
                        input_names=inputs, output_names=outputs, tensors_to_rename=renames,
                        initialized_tables=tables, output_path=str(out))


def main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    try:
        convert(**job)
    except BackendError as exc:
        print(f"BackendError: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
