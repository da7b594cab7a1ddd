"""The TensorFlow family on the real runtimes: ``tensorflow`` (SavedModel), ``keras`` (.keras),
``litert`` (.tflite, and guard's own fp32/fp16/int8 conversions, cached by digest) and
``onnxruntime`` on a SavedModel through tf2onnx. One seeded CNN is built per module
(tests/tf_models.py); this process runs Keras on TensorFlow, and converts in this process where
the test says so, so that only one test starts a converting child process."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("ai_edge_litert")

from guard.backends import create_backend  # noqa: E402
from guard.backends.tf_convert import derive  # noqa: E402
from guard.backends.tf_runtime import tree_sha256  # noqa: E402
from guard.config import BackendConfig, ModelConfig  # noqa: E402
from guard.plan.complete import parse_config  # noqa: E402
from guard.errors import BackendError, ConfigError  # noqa: E402
from guard.verify.pair import CheckedPair  # noqa: E402

import tf_models  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return tf_models.build(tmp_path_factory.mktemp("tf"))


@pytest.fixture(scope="module")
def expected(models) -> np.ndarray:
    """The Keras model's own answer (Keras on TensorFlow, in this process)."""
    import keras

    model = keras.saving.load_model(models["keras"], compile=False)
    return np.asarray(model.predict_on_batch(tf_models.images(4)))


def loaded(block: dict, role: str = "primary", threads: int = 1):
    backend = create_backend(BackendConfig.model_validate(block), role, threads)
    backend.load()
    return backend


def drift(backend, expected: np.ndarray, name: str = "output_0") -> float:
    return float(np.abs(backend.infer({"image": tf_models.images(4)})[name] - expected).max())


def test_tensorflow_runs_the_signature_named_by_its_keys(models, expected):
    backend = loaded({"backend": "tensorflow", "path": str(models["saved_model"])}, "reference")
    info = backend.describe()
    assert [(s.name, s.datatype, s.shape) for s in info.inputs] == [
        ("image", "FP32", (-1, 8, 8, 3))]
    assert [(s.name, s.shape) for s in info.outputs] == [("output_0", (-1, 10))]
    assert info.details["signature"] == "serving_default"
    assert drift(backend, expected) < 2e-5


def test_tensorflow_names_a_missing_signature_and_checks_the_pin(models):
    with pytest.raises(BackendError, match=r"no signature 'nope'.*serving_default"):
        loaded({"backend": "tensorflow", "path": str(models["saved_model"]),
                "options": {"signature": "nope"}})
    with pytest.raises(BackendError, match="has sha256") as caught:
        loaded({"backend": "tensorflow", "path": str(models["saved_model"]), "sha256": "0" * 64})
    assert caught.value.key == "sha256"
    pinned = loaded({"backend": "tensorflow", "path": str(models["saved_model"]),
                     "sha256": tree_sha256(models["saved_model"])})
    assert pinned.describe().details["sha256"] == tree_sha256(models["saved_model"])


def test_keras_names_outputs_as_its_savedmodel_does(models, expected):
    backend = loaded({"backend": "keras", "path": str(models["keras"])})
    info = backend.describe()
    assert [s.name for s in info.inputs] == ["image"]
    assert [s.name for s in info.outputs] == ["output_0"]
    assert info.details["output_layers"] == "output_0=logits"
    assert info.details["keras_backend"] == "tensorflow"
    assert drift(backend, expected) == 0.0
    by_layer = loaded({"backend": "keras", "path": str(models["keras"]),
                       "options": {"output_names": "layers"}})
    assert [s.name for s in by_layer.describe().outputs] == ["logits"]
    assert drift(by_layer, expected, "logits") == 0.0


def test_keras_from_several_threads_agrees_with_one(models, expected):
    backend = loaded({"backend": "keras", "path": str(models["keras"])})
    answers: list[np.ndarray] = []
    threads = [threading.Thread(target=lambda: answers.append(
        backend.infer({"image": tf_models.images(4)})["output_0"])) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 4 and all(np.array_equal(a, expected) for a in answers)


def test_keras_on_another_backend_in_this_process_is_refused_naming_both(models):
    with pytest.raises(BackendError, match=r"keras_backend is 'torch' but Keras runs on "
                                           r"'tensorflow'") as caught:
        loaded({"backend": "keras", "path": str(models["keras"]),
                "options": {"keras_backend": "torch"}})
    assert caught.value.key == "options.keras_backend"


def test_litert_converts_by_precision_and_caches_by_digest(models, expected):
    source = str(models["saved_model"])
    drifts = {}
    for precision in ("fp32", "fp16", "int8"):
        path = derive(source, precision, in_process=True)  # the backend below hits this cache
        backend = loaded({"backend": "litert", "path": source, "precision": precision})
        assert backend.describe().artifact == str(path)
        assert [s.name for s in backend.describe().inputs] == ["image"]
        assert [s.name for s in backend.describe().outputs] == ["output_0"]
        drifts[precision] = drift(backend, expected)
    assert drifts["fp32"] < 1e-4
    assert drifts["fp32"] < drifts["int8"] and drifts["fp16"] < drifts["int8"]
    assert drifts["int8"] > 1e-3  # int8 weights: drift tier 1 must see
    # Same source, same precision: the same cached file, not converted again.
    mtime = Path(derive(source, "int8")).stat().st_mtime_ns
    assert Path(derive(source, "int8")).stat().st_mtime_ns == mtime


def test_litert_full_int8_is_calibrated_on_the_npz(models, expected):
    source = str(models["saved_model"])
    calibration = str(models["calibration"])
    derive(source, "int8", calibration, in_process=True)
    backend = loaded({"backend": "litert", "path": source, "precision": "int8",
                      "options": {"calibration_inputs": calibration}})
    assert backend.describe().details["derived"] == "full int8, calibrated"
    assert backend.describe().artifact != str(derive(source, "int8"))  # its own cache entry
    assert np.isfinite(drift(backend, expected))


def test_a_tflite_file_runs_as_given_from_several_threads(models, expected, tmp_path):
    tflite = tmp_path / "cnn.tflite"
    tflite.write_bytes(derive(str(models["keras"]), "fp32", in_process=True).read_bytes())
    backend = loaded({"backend": "litert", "path": str(tflite)}, "reference", threads=1)
    info = backend.describe()
    assert info.details["derived"] == "as given" and info.details["signature"] == "serving_default"
    x = {"image": tf_models.images(4)}
    answers: list[np.ndarray] = []
    threads = [threading.Thread(target=lambda: answers.append(backend.infer(x)["output_0"]))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 4 and all(np.array_equal(a, answers[0]) for a in answers)
    assert float(np.abs(answers[0] - expected).max()) < 1e-4
    assert backend.infer({"image": tf_models.images(1)})["output_0"].shape == (1, 10)


def test_onnxruntime_on_a_savedmodel_converts_with_tf2onnx_in_a_child(models, expected):
    backend = loaded({"backend": "onnxruntime", "path": str(models["saved_model"])})
    info = backend.describe()
    assert Path(info.artifact).suffix == ".onnx" and "tensorflow" in info.artifact
    assert [s.name for s in info.inputs] == ["image"]
    assert [s.name for s in info.outputs] == ["output_0"]
    assert drift(backend, expected) < 1e-4


def test_onnxruntime_on_a_keras_file_uses_the_cached_conversion(models, expected):
    converted = derive(str(models["keras"]), "onnx", in_process=True)
    backend = loaded({"backend": "onnxruntime", "path": str(models["keras"]),
                      "precision": "int8"})
    assert backend.describe().artifact != str(converted)  # int8, derived from the conversion
    assert converted.exists() and drift(backend, expected) < 1.0


def pair_config(primary: dict, reference: dict) -> ModelConfig:
    return ModelConfig.model_validate({"name": "m", "primary": primary, "reference": reference})


def test_a_layout_mismatch_is_a_load_error_naming_both_shapes(models):
    pair = CheckedPair(pair_config({"backend": "keras", "path": str(models["nchw_keras"])},
                                   {"backend": "tensorflow", "path": str(models["saved_model"])}))
    with pytest.raises(BackendError, match=r"models\[m\]: input 'image' has shape \[\?, 3, 8, 8\] "
                                           r"in the primary \(keras\) and \[\?, 8, 8, 3\] in the "
                                           r"reference \(tensorflow\)"):
        pair.load_backends()
    pair.close()


def test_a_naming_difference_is_matched_by_position_not_refused(models):
    """A .keras's output layer name against its SavedModel's output_0: one output each, the same
    shape and dtype: the reference's answer is compared under the primary's name (issue 28)."""
    pair = CheckedPair(pair_config(
        {"backend": "keras", "path": str(models["keras"]), "options": {"output_names": "layers"}},
        {"backend": "tensorflow", "path": str(models["saved_model"])}))
    try:
        pair.load_backends()
        assert pair.output_match.renamed == {"output_0": "logits"}
        inputs = {"image": tf_models.images(4)}
        check = pair.comparator.check(pair.reference.infer(inputs), pair.primary.infer(inputs))
        assert check.passed and not check.unmatched, check.summary()
    finally:
        pair.close()


def test_a_keras_primary_and_its_savedmodel_reference_pass_tier_1(models):
    pair = CheckedPair(pair_config({"backend": "keras", "path": str(models["keras"])},
                                   {"backend": "tensorflow", "path": str(models["saved_model"])}))
    try:
        pair.load_backends()
        x = {"image": tf_models.images(2)}
        assert pair.comparator.check(pair.reference.infer(x), pair.primary.infer(x), x).passed
    finally:
        pair.close()


# -- config validation (no TensorFlow needed) ------------------------------------------------
def guard_yaml(tmp_path: Path, *models: dict) -> dict:
    (tmp_path / "m.keras").write_bytes(b"")
    (tmp_path / "m.tflite").write_bytes(b"")
    return {"version": 1, "models": list(models)}


def test_two_keras_backends_in_one_config_are_refused_naming_both_keys(tmp_path):
    data = guard_yaml(
        tmp_path,
        {"name": "a", "primary": {"backend": "keras", "path": "m.keras",
                                  "options": {"keras_backend": "torch"}}},
        {"name": "b", "primary": {"backend": "litert", "path": "m.tflite"},
         "reference": {"backend": "keras", "path": "m.keras"}})
    with pytest.raises(ConfigError, match=r"models\[1\]\.reference\.options\.keras_backend is "
                                          r"'tensorflow' but models\[0\]\.primary\.options\."
                                          r"keras_backend is 'torch'"):
        parse_config(data, tmp_path)
    data["models"][0]["primary"]["options"]["keras_backend"] = "tensorflow"
    assert parse_config(data, tmp_path).models[1].reference.backend == "keras"


@pytest.mark.parametrize("block, message", [
    ({"backend": "litert", "path": "m.tflite", "precision": "int8"},
     "a .tflite runs as it is"),
    ({"backend": "tensorflow", "path": "m.keras"}, "a .keras file is backend 'keras'"),
    ({"backend": "keras", "path": "m.tflite"}, "loads a Keras 3 file"),
    ({"backend": "keras", "path": "m.keras", "options": {"keras_backend": "mxnet"}},
     "keras_backend"),
    ({"backend": "litert", "path": "m.keras", "precision": "fp16",
      "options": {"calibration_inputs": "c.npz"}}, "calibration_inputs is for precision int8"),
])
def test_blocks_that_cannot_load_are_config_errors(tmp_path, block, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(guard_yaml(tmp_path, {"name": "m", "primary": block}), tmp_path)


CHILD = """
import json, sys
import numpy as np
from guard.backends import create_backend
from guard.config import BackendConfig
spec = BackendConfig.model_validate({"backend": "keras", "path": sys.argv[1],
                                     "options": {"keras_backend": sys.argv[2]}})
backend = create_backend(spec, "reference", 1)
backend.load()
x = np.load(sys.argv[3])
out = backend.infer({"image": x})["output_0"]
print(json.dumps({"tensorflow": "tensorflow" in sys.modules,
                  "keras_backend": backend.describe().details["keras_backend"],
                  "outputs": [s.name for s in backend.describe().outputs],
                  "precision": backend.describe().details.get("inference_precision", "f32"),
                  "drift": float(np.abs(out - np.load(sys.argv[4])).max())}))
"""


@pytest.mark.parametrize("keras_backend", ["torch", "openvino"])
def test_a_keras_file_runs_on_another_keras_backend_in_its_own_process(
        models, expected, tmp_path, keras_backend):
    """Keras's backend is per process: a child process with this one's environment."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip(keras_backend)
    np.save(tmp_path / "x.npy", tf_models.images(4))
    np.save(tmp_path / "y.npy", expected)
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(models["keras"]), keras_backend,
                           str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["keras_backend"] == keras_backend and report["outputs"] == ["output_0"]
    assert not report["tensorflow"]  # only Keras on TensorFlow pays for TensorFlow
    # Keras's OpenVINO backend compiles at the plugin's default precision: bf16 on a CPU with
    # bf16 kernels (reported), 8 mantissa bits on logits of scale ~0.6.
    assert report["drift"] < (2e-2 if report["precision"] == "bf16" else 1e-4), report
