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
        return pair.verifier.check(reference, primary, x), reference, primary
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
