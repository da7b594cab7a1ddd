"""The CrossedWires port cases (guard/zoo/keras_port.py): a torch CNN and its Keras ports with
the same seeded weights. The faithful port agrees with torch within 1e-6; each classic port bug
is caught by tier 1 against the torch reference, and the two that move the argmax by tier 3.
One process: torch and Keras on TensorFlow; the exports are built once per module."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from guard.config import ModelConfig  # noqa: E402
from guard.verify.pair import CheckedPair  # noqa: E402
from guard.zoo import zoo_entry  # noqa: E402
from guard.zoo.keras_port import BUGS  # noqa: E402

VARIANTS = ("keras_port", *(f"keras_port_{bug}" for bug in BUGS))


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ports")
    return {name: zoo_entry(name).export(folder, 0) for name in VARIANTS}


def checked(name: str, paths: dict, rows: int = 32) -> tuple:
    """Tiers 1 and 3 of the Keras port (primary) against the torch TorchScript (reference)."""
    config = ModelConfig.model_validate({
        "name": name, "task": "classification",
        "primary": {"backend": "keras", "path": str(paths["keras"])},
        "reference": {"backend": "torch", "path": str(paths["torchscript"])},
        "checks": {"tensor": {"atol": 1e-5, "rtol": 1e-5, "noise_floor": {"enabled": False}}}})
    pair = CheckedPair(config)
    try:
        pair.load_backends()
        x = zoo_entry(name).sample_inputs(rows, 7)
        reference, primary = pair.reference.infer(x), pair.primary.infer(x)
        return pair.comparator.check(reference, primary, x), reference, primary
    finally:
        pair.close()


def test_the_faithful_port_agrees_with_torch(exports):
    result, reference, primary = checked("keras_port", exports["keras_port"])
    assert result.passed, result.summary()
    assert float(np.abs(reference["logits"] - primary["logits"]).max()) < 1e-5
    assert len(set(reference["logits"].argmax(axis=1).tolist())) >= 4  # the argmax varies


@pytest.mark.parametrize("bug, moves_argmax", [("bn_epsilon", False), ("flatten", True),
                                               ("padding", True)])
def test_each_port_bug_is_caught(exports, bug, moves_argmax):
    name = f"keras_port_{bug}"
    result, reference, primary = checked(name, exports[name])
    assert not result.tiers["tensor"].passed, result.summary()
    flips = float((reference["logits"].argmax(1) != primary["logits"].argmax(1)).mean())
    if moves_argmax:
        assert not result.tiers["task"].passed and flips > 0
    print(name, float(np.abs(reference["logits"] - primary["logits"]).max()), flips)


def test_every_export_names_its_output_logits(exports):
    from guard.backends import create_backend
    from guard.config import BackendConfig

    paths = exports["keras_port_padding"]
    for block in ({"backend": "keras", "path": str(paths["keras"])},
                  {"backend": "tensorflow", "path": str(paths["saved_model"])}):
        backend = create_backend(BackendConfig.model_validate(block), "primary")
        backend.load()
        assert [s.name for s in backend.describe().outputs] == ["logits"]
        assert [(s.name, s.shape) for s in backend.describe().inputs] == [
            ("image", (-1, 3, 16, 16))]


def test_guard_replay_names_the_port_bug_on_an_input_set(exports, tmp_path):
    """``guard replay`` on an .npz of images: the faithful port's model passes, the padding
    bug's fails tiers 1 and 3 (the replay exits 1)."""
    import json

    import yaml

    from guard.cli import main

    def model(name: str, variant: str) -> dict:
        paths = exports[variant]
        return {"name": name, "task": "classification",
                "primary": {"backend": "keras", "path": str(paths["keras"])},
                "reference": {"backend": "torch", "path": str(paths["torchscript"])},
                "checks": {"tensor": {"atol": 1e-5, "rtol": 1e-5}},
                "policy": {"window": 10, "min_samples": 5, "trip_ratio": 0.2}}

    results = {}
    for name, variant in (("faithful", "keras_port"), ("padding", "keras_port_padding")):
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump({"version": 1, "models": [model(name, variant)]}))
        np.savez(tmp_path / "images.npz",
                 image=zoo_entry("keras_port").sample_inputs(12, 3)["image"])
        code = main(["replay", "--config", str(config), str(tmp_path / "images.npz"),
                     "--report-dir", str(tmp_path / name), "--quiet"])
        report = json.loads((tmp_path / name / "report.json").read_text())["models"][name]
        results[name] = (code, report["tiers"])
    assert results["faithful"][0] == 0
    assert results["faithful"][1]["tensor"]["passed"] == 12
    assert results["padding"][0] == 1
    assert results["padding"][1]["tensor"]["passed"] == 0
    assert results["padding"][1]["task"]["passed"] < 12
