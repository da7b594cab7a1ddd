"""The reference's noise floor (guard/verify/noise.py) and fp64 arbitration
(guard/verify/arbitrate.py) on real torch and ONNX Runtime backends."""

from __future__ import annotations

import numpy as np
import pytest

from guard.backends import TensorSpec, create_backend
from guard.config import ArbitrationConfig, BackendConfig, ChecksConfig, NoiseFloorConfig
from guard.protocol.synthetic import CannotGenerate, generate_inputs
from guard.verify.adapters import AdapterChain
from guard.verify.arbitrate import Fp64Arbiter
from guard.verify.noise import measure_noise_floor
from guard.verify.pipeline import Comparator

AFFINE = {"backend": "torch", "path": "fixture_models:affine"}


def spec(**block) -> BackendConfig:
    return BackendConfig.model_validate(block)


def test_floor_of_a_torch_reference_compares_batches_and_thread_counts():
    s = spec(**AFFINE)
    reference = create_backend(s, "reference", 1)
    reference.load()
    floor = measure_noise_floor(reference, s, NoiseFloorConfig(samples=4))
    assert not floor.skipped
    assert floor.comparisons == ["batch 1 vs batch 4", "threads 1 vs 2"]
    assert set(floor.per_output) == {"y"} and 0.0 <= floor.per_output["y"] < 1e-5
    assert floor.source == "generated from the signature (seed 0)" and floor.samples == 4


def test_floor_of_an_onnx_reference_uses_a_second_session(zoo_classifier, tmp_path):
    from guard.zoo.classifier import sample_inputs

    np.savez(tmp_path / "in.npz", image=sample_inputs(3, seed=9))
    s = spec(backend="onnxruntime", path=str(zoo_classifier["onnx"]))
    reference = create_backend(s, "reference", 1)
    reference.load()
    floor = measure_noise_floor(reference, s, NoiseFloorConfig(
        inputs=str(tmp_path / "in.npz"), samples=8, thread_counts=[1, 2]))
    assert floor.samples == 3 and floor.source == "file in.npz"
    assert floor.comparisons == ["batch 1 vs batch 3", "threads 1 vs 2"]
    assert floor.per_output["logits"] < 1e-4


def test_floor_is_skipped_with_a_reason_when_inputs_cannot_be_generated():
    with pytest.raises(CannotGenerate, match="unknown dimensions"):
        generate_inputs((TensorSpec("x", "FP32", (-1, -1)),), 2)
    ints = generate_inputs((TensorSpec("ids", "INT64", (-1, 5)),), 3)["ids"]
    assert ints.shape == (3, 5) and ints.dtype == np.int64


def test_verifier_allows_the_floor_on_top_of_atol_and_rtol():
    checks = ChecksConfig.model_validate({"tensor": {"atol": 1e-6, "rtol": 0.0,
                                                     "noise_floor": {"multiplier": 2.0}}})
    comparator = Comparator(checks)
    ref, out = {"y": np.zeros(3)}, {"y": np.full(3, 5e-6)}
    assert not comparator.check(ref, out).passed
    comparator.set_noise_floor({"y": 2.5e-6})  # allowed: 1e-6 + 2 x 2.5e-6 = 6e-6
    result = comparator.check(ref, out)
    assert result.passed and result.outputs[0].allowed == pytest.approx(6e-6)


def affine_outputs(rows):
    import torch

    from fixture_models import Affine

    with torch.inference_mode():
        return Affine()(torch.from_numpy(rows)).numpy()


def test_arbiter_blames_the_primary_that_moved_away_from_fp64():
    rows = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)
    reference = {"y": affine_outputs(rows)}
    primary = {"y": reference["y"] + np.float32(1e-2)}
    checks = ChecksConfig.model_validate({"tensor": {"atol": 1e-5, "rtol": 0.0}})
    arbiter = Fp64Arbiter(spec(**AFFINE), ArbitrationConfig(enabled=True), atol=1e-5)
    result = Comparator(checks, arbiter=arbiter).check(reference, primary, inputs={"x": rows})
    verdict = result.arbitration
    assert not result.passed and verdict.wrong == "primary"
    assert verdict.primary_error == pytest.approx(1e-2, rel=1e-3)
    assert verdict.reference_error < 1e-6  # fp32 rounding only
    assert "primary is wrong" in result.summary()


def test_arbiter_finds_the_reference_wrong_and_can_forgive():
    rows = np.random.default_rng(1).normal(size=(4, 4)).astype(np.float32)
    truth = affine_outputs(rows.astype(np.float64).astype(np.float32))
    reference = {"y": truth + np.float32(1e-3)}  # the reference is the one that is off
    primary = {"y": truth.copy()}
    arbiter = Fp64Arbiter(spec(**AFFINE), ArbitrationConfig(enabled=True, forgive=True), 1e-5)
    checks = ChecksConfig.model_validate({"tensor": {"atol": 1e-5, "rtol": 0.0}})
    result = Comparator(checks, arbiter=arbiter).check(reference, primary, inputs={"x": rows})
    assert result.arbitration.wrong == "reference" and result.arbitration.forgiven
    assert result.passed and any("forgiven" in note for note in result.notes)


def test_arbiter_says_when_no_fp64_run_exists(zoo_classifier):
    s = spec(backend="onnxruntime", path=str(zoo_classifier["onnx"]))
    verdict = Fp64Arbiter(s, ArbitrationConfig(enabled=True), 1e-4).judge(
        {}, {"y": np.zeros(1)}, {"y": np.ones(1)}, None, AdapterChain())
    assert verdict.wrong == "undetermined"
    assert "no fp64 run for a reference on backend 'onnxruntime'" in verdict.reason
