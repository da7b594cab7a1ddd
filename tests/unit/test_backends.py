"""Backends on real runtimes: ONNX Runtime (with derived int8/fp16), torch eager, torch.compile."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from guard.backends import create_backend
from guard.backends.torch import SIGNATURE_FILE, signature_json
from guard.config import BackendConfig, ConfigContext
from guard.errors import BackendError
from guard.zoo.classifier import INPUTS, OUTPUTS, build, sample_inputs


def load(spec: dict, role: str = "primary"):
    backend = create_backend(BackendConfig(**spec), role)
    backend.load()
    return backend


def op_types(path: str | Path) -> set[str]:
    return {node.op_type for node in onnx.load(str(path)).graph.node}


@pytest.fixture(scope="module")
def images():
    return sample_inputs(16, seed=11)


def test_onnxruntime_fp32_matches_a_plain_session(zoo_classifier, images):
    backend = load({"backend": "onnxruntime", "path": str(zoo_classifier["onnx"])})
    expected = ort.InferenceSession(str(zoo_classifier["onnx"])).run(None, {"image": images})[0]
    np.testing.assert_array_equal(backend.infer({"image": images})["logits"], expected)
    info = backend.describe()
    assert [(s.name, s.datatype, s.shape) for s in info.inputs] == [
        ("image", "FP32", (-1, 3, 32, 32))]
    assert info.outputs[0].name == "logits"


def test_int8_is_derived_by_the_guard_and_really_quantised(zoo_classifier, images):
    fp32 = load({"backend": "onnxruntime", "path": str(zoo_classifier["onnx"])})
    int8 = load({"backend": "onnxruntime", "path": str(zoo_classifier["onnx"]),
                 "precision": "int8"})
    derived = Path(int8.describe().artifact)
    assert derived != Path(zoo_classifier["onnx"]) and derived.exists()
    assert {"MatMulInteger", "DynamicQuantizeLinear"} & op_types(derived)
    drift = np.abs(int8.infer({"image": images})["logits"]
                   - fp32.infer({"image": images})["logits"])
    assert drift.max() > 1e-2  # the outlier weight makes per-tensor int8 visibly wrong
    # A second build reuses the cached variant instead of quantising again.
    mtime = derived.stat().st_mtime_ns
    again = load({"backend": "onnxruntime", "path": str(zoo_classifier["onnx"]),
                  "precision": "int8"})
    assert Path(again.describe().artifact) == derived and derived.stat().st_mtime_ns == mtime


def _largest_int8_weight(path) -> int:
    """The largest |quantised weight| of an int8 variant: 127 with 8-bit weights, at most 64
    with reduce_range's 7."""
    from onnx import numpy_helper

    model = onnx.load(str(path))
    weights = [np.abs(numpy_helper.to_array(t).astype(np.int32)).max()
               for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8]
    assert weights, "no int8 weights in the variant"
    return int(max(weights))


def test_int8_reduce_range_is_an_option_and_describe_says_how_int8_runs(zoo_classifier,
                                                                          images):
    """ONNX Runtime's recipe by default (8-bit weights); reduce_range: 7-bit, its own cached
    variant; describe() says which, and whether this CPU's int8 kernels saturate."""
    from guard.machine import int8_kernels_saturate

    path = str(zoo_classifier["onnx"])
    default = load({"backend": "onnxruntime", "path": path, "precision": "int8"})
    on = load({"backend": "onnxruntime", "path": path, "precision": "int8",
               "options": {"reduce_range": True}})
    assert default.describe().details["reduce_range"] == "false"
    assert on.describe().details["reduce_range"] == "true"
    assert _largest_int8_weight(default.describe().artifact) > 64
    assert _largest_int8_weight(on.describe().artifact) <= 64
    assert on.describe().artifact != default.describe().artifact
    kernels = default.describe().details["int8_kernels"]
    assert kernels.startswith("saturating") == int8_kernels_saturate()
    for backend in (default, on):
        assert backend.infer({"image": images})["logits"].shape == (len(images), 10)
    fp32 = load({"backend": "onnxruntime", "path": path})
    assert "int8_kernels" not in fp32.describe().details


def test_the_int8_saturation_rule_reads_the_cpu_flags():
    import platform

    from guard.machine import cpu_flags, int8_kernels_saturate, saturating_int8

    assert int8_kernels_saturate() == saturating_int8(cpu_flags(), platform.machine())
    int8_kernels_saturate = saturating_int8  # noqa: N806 - the rule, on given flags
    avx2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
    assert int8_kernels_saturate(avx2, "x86_64")  # e.g. AMD Zen 3: vpmaddubsw saturates
    assert int8_kernels_saturate(avx2 | {"avx512f", "avx512bw"}, "x86_64")  # Skylake-SP
    assert not int8_kernels_saturate(avx2 | {"avx512f", "avx512_vnni"}, "x86_64")
    assert not int8_kernels_saturate(avx2 | {"avx_vnni"}, "AMD64")  # Alder Lake and later
    assert not int8_kernels_saturate(avx2 | {"amx_int8"}, "x86_64")
    assert not int8_kernels_saturate(frozenset({"asimd"}), "aarch64")  # ARM: no such kernel
    assert not int8_kernels_saturate(None, "x86_64")  # flags unreadable: ORT's default


def test_int8_nodes_to_exclude_keeps_those_nodes_fp32(zoo_classifier):
    model = onnx.load(str(zoo_classifier["onnx"]))
    matmuls = [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm")]
    assert matmuls, "the zoo classifier has a MatMul/Gemm head"
    all_int8 = load({"backend": "onnxruntime", "path": str(zoo_classifier["onnx"]),
                     "precision": "int8"})
    # quantize_dynamic renames a Gemm's MatMul to <name>_MatMul before quantising (STACK.md).
    excluded = [n if n.endswith("MatMul") or "MatMul" in n else f"{n}_MatMul" for n in matmuls]
    kept = load({"backend": "onnxruntime", "path": str(zoo_classifier["onnx"]),
                 "precision": "int8", "options": {"nodes_to_exclude": excluded + matmuls}})
    count = lambda path, op: sum(  # noqa: E731
        n.op_type == op for n in onnx.load(str(path)).graph.node)
    assert count(kept.describe().artifact, "MatMulInteger") < count(
        all_int8.describe().artifact, "MatMulInteger")


def test_fp16_keeps_fp32_io_and_stays_close(zoo_classifier, images):
    fp32 = load({"backend": "onnxruntime", "path": str(zoo_classifier["onnx"])})
    fp16 = load({"backend": "onnxruntime", "path": str(zoo_classifier["onnx"]),
                 "precision": "fp16"})
    assert fp16.describe().inputs[0].datatype == "FP32"
    assert "Cast" in op_types(fp16.describe().artifact)
    out16 = fp16.infer({"image": images})["logits"]
    out32 = fp32.infer({"image": images})["logits"]
    assert out16.dtype == np.float32
    assert 0 < np.abs(out16 - out32).max() < 0.1


def test_missing_provider_is_a_clear_error(zoo_classifier):
    with pytest.raises(BackendError, match="no provider TensorrtExecutionProvider"):
        load({"backend": "onnxruntime", "path": str(zoo_classifier["onnx"]),
              "options": {"providers": ["TensorrtExecutionProvider"]}})


def test_torchscript_with_signature_matches_eager(zoo_classifier, images):
    backend = load({"backend": "torch", "path": str(zoo_classifier["torchscript"])}, "reference")
    info = backend.describe()
    assert [s.name for s in info.inputs] == ["image"]
    assert info.inputs[0].shape == (-1, 3, 32, 32) and info.outputs[0].name == "logits"
    with torch.inference_mode():
        expected = build().eval()(torch.from_numpy(images)).numpy()
    np.testing.assert_allclose(backend.infer({"image": images})["logits"], expected,
                               rtol=1e-5, atol=1e-5)
    assert torch.are_deterministic_algorithms_enabled()  # the reference pinned determinism


def test_torch_export_pt2_loads_with_its_signature(tmp_path, images):
    model = build().eval()
    program = torch.export.export(model, (torch.from_numpy(images[:2]),),
                                  dynamic_shapes=({0: torch.export.Dim("batch", max=1024)},))
    path = tmp_path / "classifier.pt2"
    torch.export.save(program, str(path), extra_files={SIGNATURE_FILE: signature_json(INPUTS,
                                                                                      OUTPUTS)})
    backend = load({"backend": "torch", "path": str(path), "sha256": sha256_of(path)})
    assert [s.name for s in backend.describe().outputs] == ["logits"]
    with torch.inference_mode():
        expected = model(torch.from_numpy(images)).numpy()
    np.testing.assert_allclose(backend.infer({"image": images})["logits"], expected,
                               rtol=1e-5, atol=1e-5)


def test_factory_with_nested_outputs_flattens_every_leaf():
    backend = load({"backend": "torch", "path": "fixture_models:nested"})
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    out = backend.infer({"x": x})
    assert set(out) == {"sum", "parts.0", "parts.1"}
    np.testing.assert_array_equal(out["parts.0"], x * 2)
    assert [s.name for s in backend.describe().inputs] == ["x"]  # from forward()'s signature


def test_factory_kwargs_and_missing_factory():
    backend = load({"backend": "torch", "path": "fixture_models:affine",
                    "options": {"kwargs": {"repeat": 3}}})
    assert backend.infer({"x": np.ones((1, 4), np.float32)})["y"].shape == (1, 3)
    with pytest.raises(BackendError, match="cannot import factory"):
        load({"backend": "torch", "path": "fixture_models:does_not_exist"})


@pytest.mark.parametrize("precision,tolerance", [("fp16", 5e-2), ("bf16", 2e-1)])
def test_torch_reduced_precision_returns_fp32(zoo_classifier, images, precision, tolerance):
    fp32 = load({"backend": "torch", "path": str(zoo_classifier["torchscript"])})
    low = load({"backend": "torch", "path": str(zoo_classifier["torchscript"]),
                "precision": precision})
    a, b = low.infer({"image": images})["logits"], fp32.infer({"image": images})["logits"]
    assert a.dtype == np.float32
    assert 0 < np.abs(a - b).max() < tolerance * np.abs(b).max()


def test_torch_compile_matches_eager(zoo_classifier, images):
    eager = load({"backend": "torch", "path": str(zoo_classifier["torchscript"])})
    compiled = load({"backend": "torch_compile", "path": "guard.zoo.classifier:build",
                     "options": {"input_names": ["image"], "output_names": ["logits"]}})
    out = compiled.infer({"image": images})["logits"]
    np.testing.assert_allclose(out, eager.infer({"image": images})["logits"], rtol=1e-4,
                               atol=1e-4)
    assert compiled.describe().backend == "torch_compile"


def test_seeded_factories_loaded_on_parallel_threads_build_the_same_model():
    """A model's backends load on parallel threads; a factory that seeds torch's global
    generator and then initialises weights (tests/fp16_models.py's ``build``) must still build
    the same model in each of them."""
    import threading

    x = {"x": np.full((2, 16), 101_325.0, np.float32)}
    backends = [create_backend(BackendConfig(backend="torch", path="fp16_models:build"), "primary")
                for _ in range(8)]
    start = threading.Barrier(len(backends))

    def load_one(backend):
        start.wait()
        backend.load()

    threads = [threading.Thread(target=load_one, args=(b,)) for b in backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (first,) = backends[0].infer(x).values()
    for backend in backends[1:]:
        (answer,) = backend.infer(x).values()
        np.testing.assert_array_equal(answer, first)


# -- artifacts: pinned by sha256 on the bytes loaded; pickle-capable formats only when pinned ----
def sha256_of(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def export_pt2(path: Path, images) -> Path:
    program = torch.export.export(build().eval(), (torch.from_numpy(images[:2]),))
    torch.export.save(program, str(path), extra_files={SIGNATURE_FILE: signature_json(INPUTS,
                                                                                      OUTPUTS)})
    return path


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_onnx_sha256_pins_the_bytes_it_loads(zoo_classifier, images, precision):
    onnx_path = str(zoo_classifier["onnx"])
    good = load({"backend": "onnxruntime", "path": onnx_path, "precision": precision,
                 "sha256": sha256_of(onnx_path)})
    assert good.infer({"image": images})["logits"].shape == (16, 10)
    with pytest.raises(BackendError) as info:
        load({"backend": "onnxruntime", "path": onnx_path, "precision": precision,
              "sha256": "0" * 64})
    assert info.value.key == "sha256"
    assert f"has sha256 {sha256_of(onnx_path)}, the config expects {'0' * 64}" in str(info.value)
    assert str(info.value.at("models[cnn].primary")).startswith("models[cnn].primary.sha256: ")


def test_onnx_with_external_data_loads_from_its_bytes(tmp_path, zoo_classifier, images):
    # Loaded from bytes, a model has no folder: its external weights come from the artifact's.
    model = onnx.load(str(zoo_classifier["onnx"]))
    target = tmp_path / "external.onnx"
    onnx.save(model, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
              location="external.onnx.data", size_threshold=1024)  # weights, not shapes
    assert (tmp_path / "external.onnx.data").stat().st_size > 0
    backend = load({"backend": "onnxruntime", "path": str(target),
                    "sha256": sha256_of(target)})
    expected = ort.InferenceSession(str(zoo_classifier["onnx"])).run(None, {"image": images})[0]
    np.testing.assert_array_equal(backend.infer({"image": images})["logits"], expected)


def test_torchscript_sha256_mismatch_is_refused(zoo_classifier):
    with pytest.raises(BackendError, match="has sha256 .* the config expects") as info:
        load({"backend": "torch", "path": str(zoo_classifier["torchscript"]),
              "sha256": "f" * 64})
    assert info.value.key == "sha256"


def test_pt2_loads_only_when_pinned(tmp_path, images):
    path = export_pt2(tmp_path / "classifier.pt2", images)
    # The plan refuses an unpinned .pt2 ...
    from guard.config import ConfigContext
    from guard.errors import ConfigError
    from guard.plan.serving import backend_block

    with pytest.raises(ConfigError, match="unpickle"):
        backend_block({"backend": "torch", "path": str(path)}, ConfigContext(), "a block")
    # ... and so does the backend, for a spec built around the config (model_construct).
    unpinned = create_backend(BackendConfig.model_construct(
        backend="torch", path=str(path), precision="fp32", device="cpu", options={},
        sha256=None, target=None, model=None), "primary")
    with pytest.raises(BackendError, match="unpickle") as info:
        unpinned.load()
    assert info.value.key == "sha256"
    with pytest.raises(BackendError, match="the config expects"):
        load({"backend": "torch", "path": str(path), "sha256": "0" * 64})
    pinned = load({"backend": "torch", "path": str(path), "sha256": sha256_of(path)})
    assert pinned.infer({"image": images[:2]})["logits"].shape == (2, 10)


def test_factory_folder_is_appended_to_sys_path_and_shadows_nothing(tmp_path, monkeypatch):
    """A module in the config's folder must not shadow one already importable."""
    name = "guard_probe_shadowed_factory"
    installed, config_dir = tmp_path / "installed", tmp_path / "config"
    for folder, width in ((installed, 2), (config_dir, 5)):
        folder.mkdir()
        (folder / f"{name}.py").write_text(
            "import torch\n\n\ndef build():\n"
            f"    return torch.nn.Linear(4, {width})\n")
    monkeypatch.syspath_prepend(str(installed))
    monkeypatch.delitem(sys.modules, name, raising=False)
    spec = BackendConfig(backend="torch", path=f"{name}:build")
    spec.context = ConfigContext(base_dir=config_dir)
    backend = create_backend(spec, "primary")
    try:
        backend.load()
        assert backend.infer({"input": np.ones((1, 4), np.float32)})["output0"].shape == (1, 2)
        assert sys.path[-1] == str(config_dir)
    finally:
        sys.modules.pop(name, None)


def test_torch_backend_detaches_a_parameter_returned_as_is():
    """infer() detaches only what requires grad (outputs made in inference mode need not be)."""
    backend = create_backend(BackendConfig(backend="torch", path="fixture_models:"
                                           "with_parameter_output"), "primary")
    backend.load()
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    out = backend.infer({"x": x})
    np.testing.assert_array_equal(out["scale"], np.full(3, 2.0, np.float32))
    np.testing.assert_array_equal(out["y"], x[:, :3] * 2.0)


@pytest.mark.parametrize("ready_timeout_s, shown", [(0.5, "0.5s"), (0, "0s")])
def test_an_upstream_never_ready_names_its_wait_as_configured(ready_timeout_s, shown):
    import socket

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    backend = create_backend(BackendConfig(
        backend="upstream", target=f"127.0.0.1:{port}", model="absent",
        options={"ready_timeout_s": ready_timeout_s}), "primary")
    with pytest.raises(BackendError) as error:
        backend.load()
    backend.close()
    assert f"absent@127.0.0.1:{port} not ready after {shown} (" in str(error.value)
