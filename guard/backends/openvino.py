"""OpenVINO backend (``openvino`` 2026.x from PyPI, CPU plugin): ``.onnx`` or OpenVINO IR.

``precision: int8`` is NNCF's post-training quantisation of the model (calibrated on
``options.calibration_inputs`` or on inputs generated from the signature), cached as IR.
``precision`` fp32, fp16 or bf16 is the compiled model's inference precision hint
(``INFERENCE_PRECISION_HINT``): the weights stay as given and the CPU plugin runs its kernels at
that precision where it has them. The CPU plugin lowers precision on its own: on a CPU with
bf16 support (AMX, avx512_bf16) its default for an fp32 model is bf16. guard pins ``f32`` for
``precision: fp32`` unless ``options.plugin_precision`` lets the plugin choose, and
``describe()`` reports what the compiled model actually runs: ``details.inference_precision``
(the compiled model's hint) and ``details.runtime_precisions`` (its executed nodes counted by
``runtimePrecision``).

Threads: one InferRequest per calling thread (a request is not thread-safe, the compiled
model is). The reference pins ``INFERENCE_NUM_THREADS`` to its budget, one stream and
``EXECUTION_MODE_HINT: ACCURACY``.

Tier 2 captures a private copy (guard/backends/activations/openvino.py: every ONNX value
added as a result, compiled at the same precision). Ops kept back at fp32 (``policy.action:
fallback_ops``): not offered. OpenVINO marks nodes with the ``disable_fp16_compression`` runtime
attribute, but openvino 2026.4's Python API cannot set it (a string in ``rt_info`` is ignored by
the CPU plugin, and the IR reader drops the attribute from ``<rt_info>``): measured in
tests/unit/test_openvino.py::test_no_per_node_fp32_keep_back_from_python.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from guard.backends.artifact import read_artifact
from guard.backends.base import Backend, BackendInfo, Role, TensorSpec
from guard.backends.kind import BackendKind
from guard.errors import BackendError, install_hint

if TYPE_CHECKING:
    from guard.config import BackendConfig

NOT_INSTALLED = ("backend 'openvino' needs the openvino package: "
                 + install_hint("openvino"))

log = logging.getLogger("guard.backends.openvino")

# guard precision -> OpenVINO element type name of the inference precision hint. int8 is an
# NNCF-quantised model (its quantised ops run int8 whatever the hint; the rest f32).
HINTS = {"fp32": "f32", "fp16": "f16", "bf16": "bf16", "int8": "f32"}
NNCF_NOT_INSTALLED = ("backend 'openvino' with precision int8 quantises with NNCF: "
                      + install_hint("openvino", "nncf"))
# OpenVINO element type names -> OIP datatypes.
_OV_TYPES = {
    "boolean": "BOOL", "u8": "UINT8", "u16": "UINT16", "u32": "UINT32", "u64": "UINT64",
    "i8": "INT8", "i16": "INT16", "i32": "INT32", "i64": "INT64",
    "f16": "FP16", "f32": "FP32", "f64": "FP64", "bf16": "BF16", "string": "BYTES",
}


class OpenVinoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    threads: int = Field(0, ge=0, description="INFERENCE_NUM_THREADS; 0 lets OpenVINO decide. "
                         "The reference uses mirror.threads instead.")
    performance_hint: Literal["LATENCY", "THROUGHPUT"] = Field(
        "LATENCY", description="PERFORMANCE_HINT of the compiled model (primary/fallback).")
    plugin_precision: bool = Field(
        False, description="precision fp32 only: let the CPU plugin choose its inference "
        "precision (bf16 on CPUs with AMX/avx512_bf16) instead of pinning f32; the precision "
        "it runs is reported (describe: inference_precision).")
    properties: dict[str, str] = Field(
        default_factory=dict, description="Further compile properties passed through as "
        "they are, e.g. {CPU_DENORMALS_OPTIMIZATION: 'YES'}.")
    calibration_samples: int = Field(
        64, ge=1, description="precision int8: samples NNCF calibrates on (post-training "
        "quantisation, its default preset), generated from the model's signature (seeded) "
        "unless calibration_inputs names an .npz of real inputs (one array per input name, "
        "first axis = samples). Real inputs calibrate better.")
    calibration_inputs: str | None = Field(
        None, description="precision int8: an .npz of calibration inputs (absolute path, or "
        "relative to the working folder).")


def _import_openvino():
    try:
        import openvino
    except ImportError:
        raise BackendError(NOT_INSTALLED) from None
    return openvino


def _spec(port) -> TensorSpec:
    shape = tuple(d.get_length() if d.is_static else -1 for d in port.get_partial_shape())
    return TensorSpec(port.get_any_name(), _OV_TYPES.get(port.get_element_type().get_type_name(),
                                                         ""), shape)


def compile_properties(spec: "BackendConfig", options: OpenVinoOptions, role: str,
                       threads: int) -> dict[str, str]:
    """What the model is compiled with (the backend and tier 2's copy alike)."""
    props: dict[str, str] = {}
    if not (options.plugin_precision and spec.precision == "fp32" and role != "reference"):
        props["INFERENCE_PRECISION_HINT"] = HINTS[spec.precision]
    if role == "reference":
        props.update(INFERENCE_NUM_THREADS=str(threads), NUM_STREAMS="1",
                     EXECUTION_MODE_HINT="ACCURACY")
    else:
        props["PERFORMANCE_HINT"] = options.performance_hint
        if options.threads:
            props["INFERENCE_NUM_THREADS"] = str(options.threads)
    props.update(options.properties)
    return props


def read_model(core, spec: "BackendConfig"):
    """The model of a block: an ONNX file from the bytes pinned by sha256, or an IR (``.xml``
    with its ``.bin`` beside it, both pinned only by the .xml's digest when given)."""
    data, _ = read_artifact(spec.path, spec.sha256)
    path = Path(spec.path)
    try:
        if path.suffix == ".xml":
            weights = path.with_suffix(".bin")
            return core.read_model(data, weights.read_bytes() if weights.exists() else None)
        if spec.sha256 is None:
            return core.read_model(str(path))  # external data (.onnx.data) read beside it
        return core.read_model(data)
    except Exception as exc:
        raise BackendError(f"openvino cannot read {path}: {exc}") from exc


class OpenVinoBackend(Backend):
    def __init__(self, spec: "BackendConfig", role: Role, threads: int = 1):
        self.spec = spec
        self.role = role
        self.options = OpenVinoOptions.model_validate(spec.options)
        self.reference_threads = threads
        self.compiled = None
        self._local = threading.local()
        self._details: dict[str, str] = {}

    def load(self) -> None:
        ov = _import_openvino()
        core = ov.Core()
        model = read_model(core, self.spec)
        if self.spec.precision == "int8":
            model = quantised(core, model, self.spec, self.options)
        props = compile_properties(self.spec, self.options, self.role, self.reference_threads)
        try:
            self.compiled = core.compile_model(model, "CPU", props)
        except Exception as exc:
            raise BackendError(f"openvino cannot compile {self.spec.path}: {exc}") from exc
        self._inputs = tuple(_spec(p) for p in self.compiled.inputs)
        self._outputs = tuple(_spec(p) for p in self.compiled.outputs)
        self._output_names = [s.name for s in self._outputs]
        self._details = {"version": ov.get_version(), **self.runtime_precision(),
                         "properties": ",".join(f"{k}={v}" for k, v in sorted(props.items()))}
        asked = props.get("INFERENCE_PRECISION_HINT")
        ran = self._details["inference_precision"]
        if asked not in (None, ran):  # the CPU lacks the kernels: the hint is dropped silently
            self._details["precision_note"] = (
                f"asked {asked}, runs {ran}: this CPU's plugin has no {asked} kernels "
                f"({','.join(core.get_property('CPU', 'OPTIMIZATION_CAPABILITIES'))})")
            log.warning("openvino %s (%s, precision %s): %s", self.role, self.spec.path,
                        self.spec.precision, self._details["precision_note"])

    def runtime_precision(self) -> dict[str, str]:
        """What the compiled model runs: its inference precision and its executed nodes'
        precisions (``{'f32': 8, 'bf16': 2}`` written ``bf16:2,f32:8``)."""
        hint = self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        counts = Counter()
        for op in self.compiled.get_runtime_model().get_ordered_ops():
            info = op.get_rt_info()
            if op.get_type_name() == "ExecutionNode" and "runtimePrecision" in info:
                counts[info["runtimePrecision"].astype(str)] += 1
        return {"inference_precision": hint,
                "runtime_precisions": ",".join(f"{k}:{v}" for k, v in sorted(counts.items()))}

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.compiled.create_infer_request()
        results = request.infer({name: np.asarray(value) for name, value in inputs.items()})
        # The request reuses its output buffers: copy before the next call.
        return {name: np.array(value, copy=True)
                for name, value in zip(self._output_names, results.to_tuple())}

    def describe(self) -> BackendInfo:
        return BackendInfo(
            backend="openvino", artifact=str(self.spec.path), precision=self.spec.precision,
            device=self.spec.device, inputs=self._inputs, outputs=self._outputs,
            details=dict(self._details),
        )

    def close(self) -> None:
        self._local = threading.local()
        self.compiled = None


def quantised(core, model, spec: "BackendConfig", options: OpenVinoOptions):
    """The NNCF post-training int8 quantisation of ``model``, cached as IR under
    ``$GUARD_CACHE_DIR/openvino`` by the artifact's digest, the calibration settings and the
    OpenVINO and NNCF versions (quantising takes seconds; a restart reuses it)."""
    import hashlib
    import json

    from guard.backends.derive import cache_dir

    try:
        import nncf
    except ImportError:
        raise BackendError(NNCF_NOT_INSTALLED) from None
    ov = _import_openvino()
    data, _ = read_artifact(spec.path, spec.sha256)
    key = hashlib.sha256(json.dumps({
        "sha256": hashlib.sha256(data).hexdigest(), "samples": options.calibration_samples,
        "inputs": options.calibration_inputs, "openvino": ov.get_version(),
        "nncf": nncf.__version__}, sort_keys=True).encode()).hexdigest()[:20]
    target = cache_dir() / "openvino" / f"{Path(spec.path).stem}.int8.{key}.xml"
    if target.exists():
        return core.read_model(str(target))
    samples = _calibration(model, options)
    quantised_model = nncf.quantize(model, nncf.Dataset(samples))
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.stem + ".partial.xml")
    ov.save_model(quantised_model, str(partial))
    partial.with_suffix(".bin").replace(target.with_suffix(".bin"))
    partial.replace(target)
    return quantised_model


def _calibration(model, options: OpenVinoOptions) -> list[dict[str, np.ndarray]]:
    """Calibration feeds, one sample (batch 1) each."""
    names = [p.get_any_name() for p in model.inputs]
    if options.calibration_inputs:
        arrays = np.load(options.calibration_inputs)
        missing = [n for n in names if n not in arrays]
        if missing:
            raise BackendError(f"options.calibration_inputs: no array for input '{missing[0]}'")
        count = min(len(arrays[n]) for n in names)
        return [{n: arrays[n][i:i + 1] for n in names} for i in range(count)]
    from guard.protocol.synthetic import CannotGenerate, generate_inputs

    specs = tuple(_spec(p) for p in model.inputs)
    try:
        return [generate_inputs(specs, rows=1, seed=i)
                for i in range(options.calibration_samples)]
    except CannotGenerate as exc:
        raise BackendError(f"precision int8: cannot generate calibration inputs ({exc}); "
                           "give options.calibration_inputs") from None


def _check(spec) -> None:
    if spec.device != "cpu":
        raise ValueError("backend 'openvino' runs on the CPU plugin here: device must be cpu")
    if not spec.path.endswith((".onnx", ".xml")):
        raise ValueError("backend 'openvino' loads an ONNX file (.onnx) or OpenVINO IR (.xml)")
    if spec.precision == "int8" and spec.path.endswith(".xml"):
        raise ValueError("precision int8 quantises an ONNX file with NNCF; give the .onnx "
                         "(an IR that is already quantised runs as it is with precision fp32)")
    if spec.options.get("plugin_precision") and spec.precision != "fp32":
        raise ValueError("options.plugin_precision is for precision fp32 (the hint is "
                         f"{HINTS[spec.precision]} already)")


KINDS = {
    "openvino": BackendKind(
        name="openvino", extra="openvino", backend=OpenVinoBackend, options=OpenVinoOptions,
        precisions=frozenset(HINTS), formats=frozenset({"onnx", "openvino_ir"}),
        activations="guard.backends.activations.openvino:openvino_side",
        check=_check, threaded=True,
    ),
}
