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
    import copy

    import torch

    twin, model = models[arch]
    x = cw.sample_inputs(8, 7, cw.SIZES[arch])
    with torch.no_grad():
        reference = twin(torch.from_numpy(x)).numpy()
        exact = copy.deepcopy(twin).double()(torch.from_numpy(x).double()).numpy()
    port = np.asarray(model.predict_on_batch(x)["logits"])
    assert port.shape == reference.shape == (8, cw.CLASSES)

    def off(a: np.ndarray) -> tuple[float, float]:  # relative L2 and max from the exact answer
        return (float(np.linalg.norm(a - exact) / np.linalg.norm(exact)),
                float(np.abs(a - exact).max() / np.abs(exact).max()))

    # Both are fp32 against the twin run in float64: the port is within 1e-5 of the exact
    # answer, or within twice what torch's own fp32 misses it by (summation-order noise,
    # which is the kernels' and so the CPU's). Measured: port 5e-6 / torch 1.2e-5 (VGG16),
    # 2.6e-6 / 3.6e-6 (ResNet50), 5e-6 / 7e-6 (DenseNet121 at 64x64) on an AVX2 EPYC; port
    # against torch 5e-6, 4e-6, 7e-6 on an AVX-512 one.
    for port_off, torch_off in zip(off(port), off(reference)):
        assert port_off < max(1e-5, 2 * torch_off), (port_off, torch_off)
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


def _check(keras_path, arch: str, max_isolated: int = 64):
    config = ModelConfig.model_validate({
        "name": arch, "task": "classification",
        "primary": {"backend": "keras", "path": str(keras_path)},
        "reference": {"backend": "torch", "path": f"guard.zoo.crossedwires:{arch}"},
        "checks": {"tensor": {"atol": 1e-5, "rtol": 1e-5},
                   "activation": {"on_failure": True, "max_isolated": max_isolated}}})
    checker = ActivationChecker.for_model(config)
    try:
        return checker.check({"image": cw.sample_inputs(2, 3, cw.SIZES[arch])})
    finally:
        checker.close()


# Aligned layers: VGG16's 13 convolutions, 5 pools, Flatten and 3 Dense; ResNet50's 53
# convolutions, 53 BatchNorms, pool1_pool, avg_pool and the head; DenseNet121's 120
# convolutions, 121 BatchNorms, 3 transition pools, pool1, avg_pool and the head.
ALIGNED = {"vgg16": 22, "resnet50": 109, "densenet121": 247}


@pytest.mark.parametrize("arch", cw.ARCHITECTURES)
def test_tier2_aligns_each_twin_with_its_keras_model_by_name(models, tmp_path, arch):
    twin, model = models[arch]
    path = tmp_path / f"{arch}.keras"
    model.save(path)
    report = _check(path, arch)
    assert report.passed and report.first_divergence is None, report.summary()
    assert not report.unaligned  # every torch module has its Keras layer
    assert len(report.layers) == ALIGNED[arch]
    isolated = [layer.isolated.rel_error for layer in report.layers if layer.isolated]
    assert len(isolated) >= min(64, ALIGNED[arch]) and max(isolated) < 1e-5


def test_tier2_names_a_bn_epsilon_port_bug_in_resnet50(models, tmp_path):
    """One BatchNormalization of the Keras ResNet50 at Keras's default epsilon (1e-3, where
    keras.applications and the twin have 1.001e-5): named at that layer among 109."""
    twin, model = models["resnet50"]
    layer = model.get_layer("conv3_block2_2_bn")
    layer.epsilon = 1e-3
    try:
        faulty = tmp_path / "resnet50_bn_epsilon.keras"
        model.save(faulty)
    finally:
        layer.epsilon = 1.001e-5
    report = _check(faulty, "resnet50", max_isolated=200)  # every layer isolated
    assert not report.passed
    assert report.first_divergence.name == "conv3_block2_2_bn"
    assert report.suspects[0].name == "conv3_block2_2_bn"
    # The Keras layers torch writes as forward code: ReLUs, the residual adds, the paddings.
    assert {"conv1_pad", "conv2_block1_add", "conv2_block1_out"} <= set(report.primary_only)
