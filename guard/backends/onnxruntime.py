"""ONNX Runtime backend (CPU by default; any installed execution provider by name).

A SavedModel directory or a ``.keras`` file is converted to ONNX with tf2onnx first, in a child
process, cached by digest (guard/backends/tf_convert.py); the precision variants are derived
from that conversion.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from guard.backends.artifact import read_artifact
from guard.backends.base import Backend, BackendInfo, Role, TensorSpec
from guard.backends.derive import derive_onnx
from guard.backends.options import OnnxRuntimeOptions
from guard.backends.kind import BackendKind
from guard.errors import BackendError
from guard.machine import int8_kernels_saturate

if TYPE_CHECKING:
    from guard.config import BackendConfig

def derived_variant(spec: "BackendConfig", source: bytes | None = None) -> Path:
    """The file an onnxruntime block runs: its artifact, or the ``precision`` variant derived
    with the block's options (nodes_to_exclude, per_channel, reduce_range). The backend, tier 2's
    ONNX side and the int8 repair all ask here, so they see one variant."""
    options = OnnxRuntimeOptions.model_validate(spec.options)
    path, _ = onnx_source(spec)
    return derive_onnx(path, spec.precision, options.nodes_to_exclude, options.per_channel,
                       source=source, reduce_range=options.reduce_range)


def onnx_source(spec: "BackendConfig") -> tuple[str, str | None]:
    """The ONNX file of a block and the digest it is pinned by: its own path, or tf2onnx's
    conversion of a SavedModel or ``.keras`` (pinned by the source's digest, checked there)."""
    from guard.backends.tf_convert import is_tf_source

    if not is_tf_source(spec.path):
        return spec.path, spec.sha256
    from guard.backends.tf_convert import derive

    return str(derive(spec.path, "onnx", sha256=spec.sha256)), None


# ORT type strings -> OIP datatypes.
_ORT_TYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(bfloat16)": "BF16",
    "tensor(string)": "BYTES",
}

_OPT_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


def _spec(node) -> TensorSpec:
    shape = tuple(d if isinstance(d, int) else -1 for d in (node.shape or ()))
    return TensorSpec(node.name, _ORT_TYPES.get(node.type, ""), shape)


class OnnxRuntimeBackend(Backend):
    def __init__(self, spec: BackendConfig, role: Role, threads: int = 1):
        self.spec = spec
        self.role = role
        self.options = OnnxRuntimeOptions.model_validate(spec.options)
        self.reference_threads = threads
        self.session = None
        self.model_path: Path | None = None

    def load(self) -> None:
        import onnxruntime as ort

        # The artifact is read once and checked against its sha256; fp32 loads from those very
        # bytes, a derived variant is derived from them (and cached under their digest).
        data, _ = read_artifact(*onnx_source(self.spec))
        self.model_path = derived_variant(self.spec, source=data)
        so = ort.SessionOptions()
        if self.spec.precision == "fp32":
            model: bytes | str = data
            # A model given as bytes has no folder of its own: external data files (.onnx.data)
            # are read from the artifact's folder. sha256 pins the .onnx file, not those files.
            so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                        str(Path(self.spec.path).parent))
        else:
            model = str(self.model_path)  # guard's own derived file in its cache
        so.graph_optimization_level = getattr(
            ort.GraphOptimizationLevel, _OPT_LEVELS[self.options.graph_optimization_level]
        )
        so.log_severity_level = 3  # warnings from the optimiser are not the user's business
        if self.role == "reference":
            # Determinism: a fixed, small thread pool and sequential execution.
            so.intra_op_num_threads = self.reference_threads
            so.inter_op_num_threads = 1
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        else:
            so.intra_op_num_threads = self.options.intra_op_threads
            so.inter_op_num_threads = self.options.inter_op_threads
            so.execution_mode = (
                ort.ExecutionMode.ORT_PARALLEL
                if self.options.execution_mode == "parallel"
                else ort.ExecutionMode.ORT_SEQUENTIAL
            )
        providers = list(self.options.providers)
        if self.spec.device.startswith("cuda") and "CUDAExecutionProvider" not in providers:
            providers.insert(0, "CUDAExecutionProvider")
        missing = [p for p in providers if p not in ort.get_available_providers()]
        if missing:
            raise BackendError(
                f"onnxruntime has no provider {', '.join(missing)} here "
                f"(available: {', '.join(ort.get_available_providers())})"
            )
        provider_options = [self.options.provider_options.get(p, {}) for p in providers]
        try:
            self.session = ort.InferenceSession(model, so, providers=providers,
                                                provider_options=provider_options)
        except Exception as exc:
            raise BackendError(f"onnxruntime cannot load {self.model_path}: {exc}") from exc
        self._inputs = tuple(_spec(i) for i in self.session.get_inputs())
        self._outputs = tuple(_spec(o) for o in self.session.get_outputs())
        self._output_names = [o.name for o in self._outputs]

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        results = self.session.run(self._output_names, dict(inputs))
        return dict(zip(self._output_names, results))

    def describe(self) -> BackendInfo:
        return BackendInfo(
            backend="onnxruntime",
            artifact=str(self.model_path or self.spec.path),
            precision=self.spec.precision,
            device=self.spec.device,
            inputs=self._inputs,
            outputs=self._outputs,
            details=self._details(),
        )

    def _details(self) -> dict[str, str]:
        if self.session is None:
            return {}
        details = {"providers": ",".join(self.session.get_providers())}
        if self.spec.precision == "int8":  # how the variant was quantised, and how it runs
            details["reduce_range"] = str(self.options.reduce_range).lower()
            details["int8_kernels"] = ("saturating (x86-64 without VNNI/AMX: 8-bit weights "
                                       "can overflow; see options.reduce_range)"
                                       if int8_kernels_saturate() else "exact")
        return details

    def close(self) -> None:
        self.session = None


KINDS = {
    "onnxruntime": BackendKind(
        name="onnxruntime", extra="onnxruntime",
        backend=OnnxRuntimeBackend, options=OnnxRuntimeOptions,
        precisions=frozenset({"fp32", "fp16", "int8"}), formats=frozenset({"onnx"}),
        activations="guard.backends.activations.onnx:onnxruntime_side", threaded=True,
    ),
}
