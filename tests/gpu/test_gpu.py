"""GPU paths. The CPU part runs everywhere; the CUDA part needs a GPU machine (run
benchmarks/gpu_check.sh there) and skips here with that reason; TensorRT tests additionally need
`import tensorrt` to work, which it cannot on the project's CPU machines."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from guard.backends import create_backend
from guard.config import BackendConfig
from guard.plan.complete import parse_config
from guard.errors import BackendError, ConfigError
from guard.zoo.classifier import sample_inputs

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device here: run "
                                "benchmarks/gpu_check.sh on a GPU machine")
try:
    import tensorrt  # noqa: F401

    HAS_TRT = True
except ImportError:
    HAS_TRT = False


def planned(spec: dict) -> BackendConfig:
    """A block planned as a config's is (TensorRT's declaration puts it on the GPU)."""
    from guard.config import ConfigContext
    from guard.plan.serving import backend_block

    return backend_block(spec, ConfigContext(), "a block")


def load(spec: dict, role: str = "primary"):
    backend = create_backend(planned(spec), role)
    backend.load()
    return backend


# -- everywhere ---------------------------------------------------------------------------------
def test_tensorrt_backend_defaults_to_cuda_and_reports_a_missing_install(zoo_classifier):
    spec = planned({"backend": "tensorrt", "path": str(zoo_classifier["onnx"]),
                    "precision": "fp16", "options": {"fp32_layers": ["/fc1/Gemm"]}})
    assert spec.device == "cuda"
    if HAS_TRT and CUDA:
        pytest.skip("TensorRT and CUDA are present: the CUDA tests below exercise it")
    with pytest.raises(BackendError, match="TensorRT is not installed|needs a CUDA device"):
        create_backend(spec, "primary").load()


def test_torch_on_cuda_without_cuda_is_a_clear_error(zoo_classifier):
    if CUDA:
        pytest.skip("this machine has CUDA")
    with pytest.raises(BackendError, match="has no CUDA"):
        load({"backend": "torch", "path": str(zoo_classifier["torchscript"]), "device": "cuda"})


def test_tf32_primary_beside_a_cuda_torch_reference_is_rejected(tmp_path):
    (tmp_path / "m.pt").touch()
    doc = {"version": 1, "models": [{
        "name": "m",
        "primary": {"backend": "torch", "path": "m.pt", "device": "cuda",
                    "options": {"allow_tf32": True}},
        "reference": {"backend": "torch", "path": "m.pt", "device": "cuda"}}]}
    with pytest.raises(ConfigError) as err:
        parse_config(doc, tmp_path)
    assert "allow_tf32" in err.value.problems[0] and "process-wide" in err.value.problems[0]
    doc["models"][0]["reference"]["device"] = "cpu"
    assert parse_config(doc, tmp_path).models[0].primary.options["allow_tf32"] is True


# -- on a GPU -------------------------------------------------------------------------------------
@needs_cuda
def test_cuda_eager_agrees_with_cpu_eager_at_fp32(zoo_classifier):
    images = sample_inputs(32, seed=4)
    cpu = load({"backend": "torch", "path": str(zoo_classifier["torchscript"])}, "reference")
    gpu = load({"backend": "torch", "path": str(zoo_classifier["torchscript"]),
                "device": "cuda"})
    a, b = gpu.infer({"image": images})["logits"], cpu.infer({"image": images})["logits"]
    assert np.abs(a - b).max() < 1e-3


@needs_cuda
def test_tf32_is_the_gpu_drift(tmp_path):
    """A matmul-heavy pair: TF32 on drifts far more than TF32 off (the paper's GPU finding)."""
    torch.manual_seed(0)
    a = torch.randn(512, 2048, device="cuda")
    b = torch.randn(2048, 512, device="cuda")
    exact = (a.double() @ b.double()).float()
    torch.backends.cuda.matmul.allow_tf32 = False
    off = a @ b
    torch.backends.cuda.matmul.allow_tf32 = True
    on = a @ b
    torch.backends.cuda.matmul.allow_tf32 = False
    assert (on - exact).abs().max() > 10 * (off - exact).abs().max()


@needs_cuda
def test_a_traces_baked_tf32_runs_as_traced_unless_the_backend_follows_the_process(tmp_path):
    """torch.jit.trace bakes the tracing process's cuDNN allow_tf32 (on by default) into each
    convolution: as traced, TF32 convs with allow_tf32 off; 'process' rewrites them (the H200
    measured 6.8e-3 against 4.6e-5: benchmarks/results/gpu_trace_calls.md)."""
    from guard.backends.traced_flags import traced_conv_flags
    from guard.zoo import eager, zoo_entry

    entry = zoo_entry("resnet")
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=False,
                                    allow_tf32=True):
        path = entry.export(tmp_path, 0)["torchscript"]
    assert all(flags.allow_tf32 for flags in traced_conv_flags(torch.jit.load(str(path))))
    images = entry.sample_inputs(16, 0)["image"]
    with torch.no_grad():
        cpu = eager("resnet").eval()(torch.from_numpy(images)).numpy()

    def run(option: str):
        backend = load({"backend": "torch", "path": str(path), "device": "cuda",
                        "options": {"traced_conv_flags": option}})
        error = float(np.abs(backend.infer({"image": images})["logits"] - cpu).max())
        return error, backend.describe().details["traced_conv_flags"]

    as_traced, said_as_traced = run("as_traced")
    process, said_process = run("process")
    assert said_as_traced.startswith("as traced: allow_tf32=True on")
    assert said_process.startswith("process:") and "allow_tf32=False" in said_process
    assert process < 1e-3
    if torch.cuda.get_device_capability() >= (8, 0):  # TF32 exists from Ampere on
        assert as_traced > 10 * process


@needs_cuda
def test_onnxruntime_cuda_provider_when_installed(zoo_classifier):
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is not installed (it replaces onnxruntime)")
    images = sample_inputs(8, seed=5)
    cpu = load({"backend": "onnxruntime", "path": str(zoo_classifier["onnx"])})
    gpu = load({"backend": "onnxruntime", "path": str(zoo_classifier["onnx"]), "device": "cuda",
                "options": {"provider_options": {"CUDAExecutionProvider": {"device_id": 0}}}})
    assert "CUDAExecutionProvider" in gpu.describe().details["providers"]
    np.testing.assert_allclose(gpu.infer({"image": images})["logits"],
                               cpu.infer({"image": images})["logits"], atol=1e-3)


@needs_cuda
@pytest.mark.skipif(not HAS_TRT, reason="TensorRT does not import here")
def test_tensorrt_fp16_engine_with_an_fp32_layer(zoo_classifier):
    images = sample_inputs(4, seed=6)
    profile = {"image": [[1, 3, 32, 32], [4, 3, 32, 32], [64, 3, 32, 32]]}
    fp32 = load({"backend": "tensorrt", "path": str(zoo_classifier["onnx"]),
                 "options": {"profile": profile}})
    fp16 = load({"backend": "tensorrt", "path": str(zoo_classifier["onnx"]), "precision": "fp16",
                 "options": {"profile": profile, "exclude_op_types": ["CONVOLUTION"]}})
    a = fp16.infer({"image": images})["logits"]
    b = fp32.infer({"image": images})["logits"]
    assert a.shape == (4, 10) and np.abs(a - b).max() < 0.1


@needs_cuda
@pytest.mark.skipif(not HAS_TRT, reason="TensorRT does not import here")
def test_tensorrt_fp16_repair_pins_the_overflowing_layer_norm_to_fp32(tmp_path):
    """fallback_ops on a TensorRT fp16 primary (guard/policy/keep_back.py TensorRTLayers): the
    pressure model's input LayerNorm overflows fp16; tier 2 finds it on ONNX Runtime's fp16
    variant, and the engine is rebuilt with that ONNX node name in fp32_layers. Which other
    layers a TensorRT build runs too coarsely depends on the GPU and the TensorRT version, so
    the test holds what holds on any: the LayerNorm is kept, the repaired engine passes, and
    the kept set is minimal (tests/repair_cases.py, as the CPU repair tests do)."""
    import fp16_models
    from repair_cases import assert_minimal, failing, make_repair, repair_case

    onnx_path = str(fp16_models.export(tmp_path)["onnx"])
    profile = {"x": [[1, 16], [1, 16], [8, 16]]}
    model = {"name": "pressure",
             "primary": {"backend": "tensorrt", "path": onnx_path, "precision": "fp16",
                         "options": {"profile": profile}},
             "reference": {"backend": "onnxruntime", "path": onnx_path},
             "fallback": {"backend": "onnxruntime", "path": onnx_path},
             "checks": {"tensor": {"atol": 0.0, "rtol": 0.05}},
             "policy": {"action": "fallback_ops"}}
    case = repair_case(model, tmp_path, "x", fp16_models.sample_inputs(8, seed=21))
    fp16 = create_backend(case["config"].primary, "primary")
    fp16.load()
    if failing(case, fp16) == 0:
        pytest.skip("this TensorRT runs the LayerNorm at fp32 by itself: nothing to repair")
    outcome = make_repair(case).run(case["samples"])
    assert outcome.ok, outcome.reason
    assert "node_layer_norm" in outcome.kept, outcome.evidence()
    assert failing(case, outcome.backend) == 0
    assert_minimal(case, outcome.kept)
