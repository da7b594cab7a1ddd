"""The shipped matrix configs validate, and a backend's stated cause reaches the summary."""

from __future__ import annotations

from pathlib import Path

from guard.matrix.config import load_matrix_config
from guard.matrix.report import markdown, summarise

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "matrix"


def test_shipped_matrix_configs_validate():
    for name in ("cpu.yaml", "gpu.yaml"):
        config, _ = load_matrix_config(CONFIGS / name)
        assert config.backends and config.models
    gpu, _ = load_matrix_config(CONFIGS / "gpu.yaml")
    assert {b.device for b in gpu.backends} == {"cpu", "cuda"}
    assert all(b.cause for b in gpu.backends)  # every failure class has its cause named


def test_causes_are_printed_beside_failures():
    record = {"model": "resnet", "backend": "cuda_eager_tf32", "tier": "tensor", "atol": 1e-6,
              "rtol": 1e-5, "status": "fail", "failure_type": "numeric",
              "cause": "TF32 on: matmul/conv inputs rounded to 10 mantissa bits",
              "environment": {}}
    text = markdown(summarise([record]), "gpu")
    assert "| backend | numeric | cause |" in text
    assert ("| cuda_eager_tf32 | 1 | TF32 on: matmul/conv inputs rounded to 10 mantissa bits |"
            in text)


def write(tmp_path: Path, backends: list[dict]) -> Path:
    import yaml

    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({
        "version": 1, "models": [{"name": "p", "zoo": "keras_port"}], "backends": backends,
        "tolerances": {"atol": [1e-5], "rtol": [1e-5]}}))
    return path


def test_keras_columns_on_two_keras_backends_are_refused_naming_both(tmp_path):
    import pytest

    from guard.errors import ConfigError

    path = write(tmp_path, [{"name": "a", "backend": "keras"},
                            {"name": "b", "backend": "keras",
                             "options": {"keras_backend": "torch"}}])
    with pytest.raises(ConfigError,
                       match=r"backends\[1\]\.options\.keras_backend: 'torch', but "
                             r"backends\[0\] runs Keras on 'tensorflow'.*process: own"):
        load_matrix_config(path)
    path = write(tmp_path, [{"name": "a", "backend": "keras"},
                            {"name": "b", "backend": "keras", "process": "own",
                             "options": {"keras_backend": "torch"}}])
    assert load_matrix_config(path)[0].backends[1].process == "own"


def test_the_tensorflow_family_gets_the_keras_artifacts_and_others_skip(tmp_path):
    from guard.matrix.runner import PreparedModel, backend_spec

    config, base = load_matrix_config(write(tmp_path, [{"name": "k", "backend": "keras"}]))
    port = PreparedModel(config.models[0], "classification", [], torchscript="p.pt",
                         onnx="p.onnx", keras="p.keras", saved_model="p_saved_model")
    other = PreparedModel(config.models[0], "classification", [], torchscript="r.pt",
                          onnx="r.onnx")
    picks = {kind: backend_spec(port, kind, "fp32", {}, base).path
             for kind in ("keras", "tensorflow", "litert", "onnxruntime", "torch")}
    assert picks == {"keras": "p.keras", "tensorflow": "p_saved_model",
                     "litert": "p_saved_model", "onnxruntime": "p.onnx", "torch": "p.pt"}
    assert backend_spec(port, "onnxruntime", "fp32", {}, base, artifact="keras").path == "p.keras"
    assert backend_spec(other, "keras", "fp32", {}, base) == "no keras artifact for this model"
    assert backend_spec(other, "litert", "int8", {}, base) == (
        "no tf_saved_model or keras artifact for this model")


def test_artifact_factory_gives_torch_the_eager_module_instead_of_the_torchscript(tmp_path):
    """gpu.yaml's cuda_eager_module: the eager module on torch, beside the TorchScript column,
    so that the sweep tells TorchScript's own execution from the device's kernels."""
    from guard.matrix.runner import PreparedModel, backend_spec

    config, base = load_matrix_config(write(tmp_path, [
        {"name": "ts", "backend": "torch"},
        {"name": "module", "backend": "torch", "artifact": "factory"}]))
    zoo = PreparedModel(config.models[0], "classification", [], torchscript="r.pt",
                        onnx="r.onnx", eager_factory="guard.zoo:eager",
                        factory_kwargs={"name": "resnet", "seed": 0})
    assert backend_spec(zoo, "torch", "fp32", {}, base).path == "r.pt"
    eager = backend_spec(zoo, "torch", "fp32", {}, base, artifact="factory")
    assert eager.path == "guard.zoo:eager"
    assert eager.options["kwargs"] == {"name": "resnet", "seed": 0}
    gpu, _ = load_matrix_config(CONFIGS / "gpu.yaml")
    assert {b.name: b.artifact for b in gpu.backends}["cuda_eager_module"] == "factory"
    process = {b.name: b for b in gpu.backends}["cuda_eager_process"]
    assert backend_spec(zoo, "torch", "fp32", process.options, base).options == {
        "traced_conv_flags": "process"}
