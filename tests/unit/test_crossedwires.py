"""CrossedWires' architectures (guard/zoo/crossedwires.py): VGG16, ResNet50 and DenseNet121 as
keras.applications builds them, each with a torch twin carrying the same seeded weights. The
twins agree with Keras within 1e-5 in fp32, and tier 2 aligns a twin with its Keras model by
layer name: a faithful port is blamed nowhere, a port with one BatchNormalization at Keras's
default epsilon is named at that layer. One process: torch and Keras on TensorFlow."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from guard.config import ModelConfig  # noqa: E402
from guard.verify.activation import ActivationChecker  # noqa: E402
from guard.zoo import crossedwires as cw  # noqa: E402


@pytest.fixture(scope="module")
def models():
    """arch -> (torch twin, Keras model), built once."""
    import keras  # noqa: F401  (Keras on TensorFlow, as the zoo exports it)

    out = {}
    for arch in cw.ARCHITECTURES:
        twin = cw.build_twin(arch, 0)
        out[arch] = (twin, cw.keras_model(arch, twin))
    return out


@pytest.mark.parametrize("arch", cw.ARCHITECTURES)
def test_each_twin_agrees_with_keras_within_1e5(models, arch):
    import torch

    twin, model = models[arch]
    x = cw.sample_inputs(8, 7, cw.SIZES[arch])
    with torch.no_grad():
        reference = twin(torch.from_numpy(x)).numpy()
    port = np.asarray(model.predict_on_batch(x)["logits"])
    assert port.shape == reference.shape == (8, cw.CLASSES)
    # Measured here: relative L2 5e-6 (VGG16), 4e-6 (ResNet50), 7e-6 (DenseNet121 at 64x64),
    # the same with torch on one thread or two.
    assert np.linalg.norm(port - reference) / np.linalg.norm(reference) < 1e-5
    assert np.abs(port - reference).max() < 1e-5 * np.abs(reference).max()
    assert (port.argmax(1) == reference.argmax(1)).all()
    assert len(set(reference.argmax(1).tolist())) >= 3  # the argmax varies: tier 3 means something


def test_every_keras_layer_with_weights_has_its_torch_module(models):
    """The twin is complete: copy_weights found a module for every weighted Keras layer (it
    raises otherwise), and the counts agree."""
    import torch

    for arch, (twin, model) in models.items():
        weighted = sum(1 for layer in model.layers if layer.weights)
        modules = sum(1 for m in twin.modules()
                      if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear, torch.nn.BatchNorm2d)))
        assert weighted == modules, arch


def _check(keras_path, arch: str):
    config = ModelConfig.model_validate({
        "name": arch, "task": "classification",
        "primary": {"backend": "keras", "path": str(keras_path)},
        "reference": {"backend": "torch", "path": f"guard.zoo.crossedwires:{arch}"},
        "checks": {"tensor": {"atol": 1e-5, "rtol": 1e-5},
                   "activation": {"on_failure": True, "max_isolated": 200}}})
    checker = ActivationChecker.for_model(config)
    try:
        return checker.check({"image": cw.sample_inputs(2, 3, cw.SIZES[arch])})
    finally:
        checker.close()


def test_tier2_aligns_resnet50_by_name_and_names_a_bn_epsilon_port_bug(models, tmp_path):
    twin, model = models["resnet50"]
    faithful = tmp_path / "resnet50.keras"
    model.save(faithful)
    report = _check(faithful, "resnet50")
    assert report.passed and report.first_divergence is None, report.summary()
    assert not report.unaligned  # every torch module has its Keras layer
    assert len(report.layers) == 53 + 53 + 3  # convs, BatchNorms, pool1_pool, avg_pool, head
    # The Keras layers torch writes as forward code: ReLUs, the residual adds, the paddings.
    assert {"conv1_pad", "conv2_block1_add", "conv2_block1_out"} <= set(report.primary_only)

    layer = model.get_layer("conv3_block2_2_bn")
    layer.epsilon = 1e-3  # Keras's default, where the original has 1.001e-5
    try:
        faulty = tmp_path / "resnet50_bn_epsilon.keras"
        model.save(faulty)
    finally:
        layer.epsilon = 1.001e-5
    report = _check(faulty, "resnet50")
    assert not report.passed
    assert report.first_divergence.name == "conv3_block2_2_bn"
    assert report.suspects[0].name == "conv3_block2_2_bn"
