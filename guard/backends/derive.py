"""Derive reduced-precision ONNX variants from an fp32 artifact, cached on disk.

The guard derives the variant itself (rather than being handed an int8 file) so that it knows
how the variant was made and can later rebuild it with chosen nodes kept at fp32.

- int8: ``onnxruntime.quantization.quantize_dynamic`` (weights int8, activations quantised at run
  time). Note: it rewrites ``Gemm`` into ``MatMul`` + ``Add`` first, so ``nodes_to_exclude`` must
  name the rewritten node (``/fc/Gemm_MatMul``), not the exported ``/fc/Gemm``. ``reduce_range``
  (``options.reduce_range``, off by default as in ONNX Runtime): 7-bit weights. On an x86-64 CPU
  without VNNI/AMX (guard/machine.py) ONNX Runtime's U8S8 kernels add pairs of products in int16
  (AVX2's vpmaddubsw) and saturate when the weights use all 8 bits: measured on an AMD EPYC, a
  seeded MLP's 8-bit variant was 9.4% of the output's scale off fp32, 0.9% with reduce_range;
  but the zoo CNN (an outlier weight) was worse with 7 bits (median max-abs error 1.32 vs
  0.54). Which recipe is right depends on the model, so guard keeps ONNX Runtime's default and
  the backend's ``describe()`` says when this CPU's int8 kernels saturate.
- fp16: ``onnxconverter_common.float16.convert_float_to_float16`` with ``keep_io_types=True``,
  so clients keep sending and receiving fp32.

Cache: ``$GUARD_CACHE_DIR`` (default ``~/.cache/guard``) / ``derived/``, keyed by the sha256 of the
artifact, the precision, the exclusions and the onnxruntime version. Written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from guard.errors import BackendError


def cache_root() -> Path:
    """guard's cache: ``$GUARD_CACHE_DIR``, else ``~/.cache/guard``."""
    return Path(os.environ.get("GUARD_CACHE_DIR") or Path.home() / ".cache" / "guard")


def cache_dir() -> Path:
    path = cache_root() / "derived"
    path.mkdir(parents=True, exist_ok=True)
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def derive_onnx(
    artifact: str | Path,
    precision: str,
    nodes_to_exclude: list[str] | None = None,
    per_channel: bool = False,
    source: bytes | None = None,
    reduce_range: bool = False,
) -> Path:
    """Return the path of the ``precision`` variant of ``artifact`` (fp32 returns it unchanged).

    ``source``: the artifact's bytes as the caller read (and checked) them; the variant is then
    derived from, and its cache entry keyed by, those bytes, and the file is not opened again
    (external data files beside it are still read from its folder).
    ``reduce_range`` (int8): 7-bit weights (see the module docstring)."""
    artifact = Path(artifact)
    if precision == "fp32":
        return artifact
    import onnxruntime

    excluded = sorted(nodes_to_exclude or [])
    reduce_range = bool(reduce_range) and precision == "int8"
    key_parts = {
        "sha256": hashlib.sha256(source).hexdigest() if source is not None
        else file_sha256(artifact),
        "precision": precision,
        "exclude": excluded,
        "per_channel": per_channel,
        "onnxruntime": onnxruntime.__version__,
    }
    if reduce_range:  # only when on: variants cached before the option keep their keys
        key_parts["reduce_range"] = True
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:20]
    target = cache_dir() / f"{artifact.stem}.{precision}.{key}.onnx"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_path = Path(tmp) / target.name
        try:
            model_input = _model_input(artifact, source)
            if precision == "int8":
                _quantize_int8(model_input, tmp_path, excluded, per_channel, reduce_range)
            elif precision == "fp16":
                _convert_fp16(model_input, tmp_path, excluded)
            else:
                raise BackendError(f"onnxruntime cannot derive precision '{precision}'")
        except BackendError:
            raise
        except Exception as exc:  # the converters raise anything from ValueError to onnx errors
            raise BackendError(
                f"deriving {precision} from {artifact} failed: {type(exc).__name__}: {exc}"
            ) from exc
        _check_loadable(tmp_path, precision, artifact)
        os.replace(tmp_path, target)
    return target


def _model_input(artifact: Path, source: bytes | None):
    """What the converters read: the artifact's path, or a ModelProto parsed from ``source``
    (with any external data loaded from the artifact's folder)."""
    if source is None:
        return artifact
    import onnx
    from onnx.external_data_helper import load_external_data_for_model

    model = onnx.load_model_from_string(source)
    load_external_data_for_model(model, str(artifact.parent))
    return model


def _check_loadable(path: Path, precision: str, artifact: Path) -> None:
    """A converter can write a graph ONNX Runtime refuses (e.g. fp16 Cast type mismatches):
    catch it here, name it, and never cache the broken file."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    try:
        onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        first = str(exc).splitlines()[0][:300]
        raise BackendError(
            f"the {precision} variant derived from {artifact} does not load in ONNX Runtime "
            f"({first}); keep the offending nodes at fp32 with options.nodes_to_exclude"
        ) from None


def _quantize_int8(source, target: Path, excluded: list[str], per_channel: bool,
                   reduce_range: bool) -> None:
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    # quantize_dynamic logs a pre-processing hint on the root logger for every model: not news.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        _run_quantize(quantize_dynamic, QuantType, source, target, excluded, per_channel,
                      reduce_range)
    finally:
        root.setLevel(level)


def _run_quantize(quantize_dynamic, QuantType, source, target, excluded, per_channel,
                  reduce_range) -> None:
    quantize_dynamic(
        model_input=source if not isinstance(source, Path) else str(source),
        model_output=str(target),
        weight_type=QuantType.QInt8,
        per_channel=per_channel,
        reduce_range=reduce_range,
        nodes_to_exclude=excluded,
    )


def _convert_fp16(source, target: Path, excluded: list[str]) -> None:
    import onnx
    from onnxconverter_common import float16

    model = onnx.load(str(source)) if isinstance(source, Path) else source
    converted = float16.convert_float_to_float16(
        model, keep_io_types=True, node_block_list=excluded or None
    )
    onnx.save(converted, str(target))
