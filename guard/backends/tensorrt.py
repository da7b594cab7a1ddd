"""Native TensorRT backend: an engine built from the ONNX artifact, on a CUDA device.

Where it ran: TensorRT cannot be installed on the project's CPU machines (the ``tensorrt-cu*``
wheels download from a vendor index that is unreachable there), so this module is imported only
when a ``tensorrt`` backend is configured, and its tests skip with that reason where
``import tensorrt`` fails. It has been exercised only where TensorRT imports (see the GPU notes
in benchmarks/README.md).

- ``precision``: fp32, fp16 (``BuilderFlag.FP16``) or int8 (``BuilderFlag.INT8`` with a
  calibration cache, or an ONNX that carries Q/DQ nodes).
- Selective fallback hooks: ``options.fp32_layers`` (layer names) and
  ``options.exclude_op_types`` (layer types) are pinned to fp32 with precision constraints
  (``OBEY_PRECISION_CONSTRAINTS``), so a rebuilt engine keeps those layers at full precision.
  ``policy.action: fallback_ops`` extends ``fp32_layers`` with the ONNX node names tier 2
  points at (TensorRT's ONNX parser names each layer after its node; guard/policy/keep_back.py);
  like the rest of this module, that path has run only where TensorRT imports.
- Engines are cached under ``$GUARD_CACHE_DIR/tensorrt``, keyed by the sha256 of the ONNX file,
  the TensorRT version, the GPU name, the precision and every build option.
- Device memory is handled with torch CUDA tensors (torch is already a dependency of the GPU
  paths), so no pycuda is needed.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import numpy as np

from guard.backends.base import Backend, BackendInfo, Role, TensorSpec
from guard.backends.artifact import read_artifact
from guard.backends.derive import cache_root
from guard.backends.options import TensorRTOptions
from guard.backends.kind import BackendKind
from guard.errors import BackendError

NOT_INSTALLED = (
    "TensorRT is not installed (pip install tensorrt-cu12 on a machine that can reach NVIDIA's "
    "index, or use the NGC TensorRT image)"
)

# TensorRT dtype name -> (OIP datatype, numpy dtype)
_TRT_TYPES = {
    "FLOAT": ("FP32", np.float32), "HALF": ("FP16", np.float16), "INT8": ("INT8", np.int8),
    "INT32": ("INT32", np.int32), "INT64": ("INT64", np.int64), "BOOL": ("BOOL", np.bool_),
    "UINT8": ("UINT8", np.uint8),
}


def _import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise BackendError(f"{NOT_INSTALLED}: {exc}") from None
    return trt


class TensorRTBackend(Backend):
    def __init__(self, spec, role: Role, threads: int = 1):
        self.spec = spec
        self.role = role
        self.options = TensorRTOptions.model_validate(spec.options)
        self._lock = threading.Lock()  # one execution context: calls are serialised
        self.engine_path: Path | None = None

    # -- build ---------------------------------------------------------------------------------
    def _cache_key(self, trt, gpu: str, digest: str) -> str:
        parts = {"onnx": digest, "trt": trt.__version__, "gpu": gpu,
                 "precision": self.spec.precision, "options": self.options.model_dump()}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]

    def _build(self, trt, logger, onnx_bytes: bytes) -> bytes:
        builder = trt.Builder(logger)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, logger)
        # path: where external weights (.onnx.data) are looked up; sha256 pins the .onnx only.
        if not parser.parse(onnx_bytes, path=str(self.spec.path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise BackendError(f"TensorRT cannot parse {self.spec.path}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE,
                                     self.options.workspace_mib << 20)
        if self.spec.precision == "fp16":
            config.set_flag(trt.BuilderFlag.FP16)
        elif self.spec.precision == "int8":
            config.set_flag(trt.BuilderFlag.INT8)
            if self.options.int8_calibration_cache:
                config.int8_calibrator = _CacheCalibrator(trt, self.options.int8_calibration_cache)
        self._pin_fp32_layers(trt, network, config)
        if self.options.profile:
            profile = builder.create_optimization_profile()
            for name, (low, opt, high) in self.options.profile.items():
                profile.set_shape(name, low, opt, high)
            config.add_optimization_profile(profile)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise BackendError(f"TensorRT failed to build an engine for {self.spec.path}")
        return bytes(serialized)

    def _pin_fp32_layers(self, trt, network, config) -> None:
        names = set(self.options.fp32_layers)
        types = {t.upper() for t in self.options.exclude_op_types}
        if not names and not types:
            return
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        found = set()
        for index in range(network.num_layers):
            layer = network.get_layer(index)
            if layer.name in names or layer.type.name in types:
                found.add(layer.name)
                layer.precision = trt.float32
                for out in range(layer.num_outputs):
                    layer.set_output_type(out, trt.float32)
        missing = names - found
        if missing:
            raise BackendError(f"options.fp32_layers: no layer named {sorted(missing)} in the "
                               "TensorRT network")

    # -- lifecycle ---------------------------------------------------------------------------
    def load(self) -> None:
        trt = _import_tensorrt()
        import torch

        if not torch.cuda.is_available():
            raise BackendError("tensorrt needs a CUDA device; none is available")
        self.device = torch.device(self.spec.device)
        logger = trt.Logger(trt.Logger.WARNING)
        gpu = torch.cuda.get_device_name(self.device)
        folder = cache_root() / "tensorrt"
        folder.mkdir(parents=True, exist_ok=True)
        # Read once and checked against sha256: the engine is built from, and cached under the
        # digest of, these bytes.
        onnx_bytes, digest = read_artifact(self.spec.path, self.spec.sha256)
        key = self._cache_key(trt, gpu, digest)
        self.engine_path = folder / f"{Path(self.spec.path).stem}.{key}.plan"
        if self.engine_path.exists():
            plan = self.engine_path.read_bytes()
        else:
            plan = self._build(trt, logger, onnx_bytes)
            tmp = self.engine_path.with_suffix(".tmp")
            tmp.write_bytes(plan)
            os.replace(tmp, self.engine_path)
        self.engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs: list[TensorSpec] = []
        outputs: list[TensorSpec] = []
        for name in names:
            datatype, _ = _TRT_TYPES[self.engine.get_tensor_dtype(name).name]
            spec = TensorSpec(name, datatype, tuple(self.engine.get_tensor_shape(name)))
            is_input = self.engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            (inputs if is_input else outputs).append(spec)
        self._inputs, self._outputs = tuple(inputs), tuple(outputs)
        self._stream = torch.cuda.Stream(self.device)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        with self._lock, torch.cuda.stream(self._stream):
            keep = []
            for spec in self._inputs:
                tensor = torch.from_numpy(np.ascontiguousarray(inputs[spec.name])).to(self.device)
                keep.append(tensor)
                self.context.set_input_shape(spec.name, tuple(tensor.shape))
                self.context.set_tensor_address(spec.name, tensor.data_ptr())
            results = {}
            for spec in self._outputs:
                shape = tuple(self.context.get_tensor_shape(spec.name))
                dtype = _TRT_TYPES[self.engine.get_tensor_dtype(spec.name).name][1]
                tensor = torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype,
                                     device=self.device)
                self.context.set_tensor_address(spec.name, tensor.data_ptr())
                results[spec.name] = tensor
            if not self.context.execute_async_v3(self._stream.cuda_stream):
                raise BackendError("TensorRT execution failed")
            self._stream.synchronize()
            return {name: t.cpu().numpy() for name, t in results.items()}

    def describe(self) -> BackendInfo:
        return BackendInfo(backend="tensorrt", artifact=str(self.engine_path or self.spec.path),
                           precision=self.spec.precision, device=self.spec.device,
                           inputs=getattr(self, "_inputs", ()),
                           outputs=getattr(self, "_outputs", ()))

    def close(self) -> None:
        self.context = None
        self.engine = None


class _CacheCalibrator:
    """An INT8 calibrator that only replays an existing calibration cache."""

    def __new__(cls, trt, path: str):
        class Calibrator(trt.IInt8EntropyCalibrator2):
            def __init__(self):
                super().__init__()
                self.path = path

            def get_batch_size(self):
                return 1

            def get_batch(self, names):
                return None  # no data: the cache must cover every tensor

            def read_calibration_cache(self):
                with open(self.path, "rb") as handle:
                    return handle.read()

            def write_calibration_cache(self, cache):
                return None

        return Calibrator()


def _check(spec) -> None:
    if spec.device == "cpu":
        spec.device = "cuda"  # TensorRT runs on a GPU only


def _onnx_variant(spec):
    """``BackendKind.capture_as``: tier 2 cannot hook an engine's layers, so it captures ONNX
    Runtime's variant of the same ONNX file at the same precision (TensorRT's ONNX parser names
    each layer after its node: the fp32 layers kept back are the nodes excluded there)."""
    from guard.config import BackendConfig

    return BackendConfig(backend="onnxruntime", path=spec.path, precision=spec.precision,
                         options={"nodes_to_exclude": list(spec.options.get("fp32_layers", []))})


KINDS = {
    "tensorrt": BackendKind(
        name="tensorrt", backend=TensorRTBackend, options=TensorRTOptions,
        precisions=frozenset({"fp32", "fp16", "int8"}), formats=frozenset({"onnx"}),
        capture_as=_onnx_variant,
        check=_check,
    ),
}
