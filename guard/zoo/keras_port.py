"""A torch CNN and its Keras ports, faithful and with the three classic port bugs (CrossedWires,
arXiv 2108.12768: "syntactically equivalent, semantically disparate").

The torch model (the reference: TorchScript/ONNX/eager like every seeded zoo model) is
``conv3x3 -> BatchNorm -> ReLU -> conv3x3 stride 2, padding 1 -> ReLU -> Flatten -> Linear``
on NCHW images [-1, 3, 16, 16]. Its Keras port carries the same seeded weights (conv OIHW ->
HWIO, Linear W.T, BatchNorm [weight, bias, running_mean, running_var]) and takes the same NCHW
input (a Permute in front: guard compares what the two sides take, so the port keeps the
interface), computing in NHWC inside. Faithful, it agrees with torch within 1e-6 in fp32.

Variants (each a zoo model: ``keras_port``, ``keras_port_bn_epsilon``, ``keras_port_flatten``,
``keras_port_padding``):

- ``bn_epsilon``: Keras's BatchNormalization default epsilon (1e-3) instead of torch's 1e-5;
- ``flatten``: Flatten of the NHWC tensor, with the Linear weights in torch's CHW order (the
  first Dense after a Flatten must be permuted, or the tensor put back in CHW order first);
- ``padding``: the stride-2 conv written ``padding="same"``, which on an even input pads 0
  before and 1 after, where torch's ``padding=1`` pads 1 on every side (the faithful port pads
  explicitly with ZeroPadding2D and convolves ``valid``).

The Keras model's output is a dict ``{"logits": ...}``, so the ``.keras``, its SavedModel and
their LiteRT/ONNX conversions all name it ``logits``, as torch does. Building the ports needs
Keras on its TensorFlow backend (the SavedModel export): ``export`` imports TensorFlow.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from guard.backends.base import TensorSpec

NAME = "keras_port"
TASK = "classification"
INPUTS = [TensorSpec("image", "FP32", (-1, 3, 16, 16))]
OUTPUTS = [TensorSpec("logits", "FP32", (-1, 10))]
BUGS = ("bn_epsilon", "flatten", "padding")


def build(seed: int = 0):
    """The torch model, seeded, with BatchNorm statistics a trained model would have."""
    import torch
    from torch import nn

    from guard.zoo.export import spread_logits

    class PortCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(8)
            self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
            self.fc = nn.Linear(16 * 8 * 8, 10)

        def forward(self, image):
            x = torch.relu(self.bn1(self.conv1(image)))
            x = torch.relu(self.conv2(x))
            return self.fc(torch.flatten(x, 1))

    torch.manual_seed(seed)
    model = PortCNN().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        bn = model.bn1
        bn.weight.copy_(torch.empty(8).uniform_(0.5, 1.5, generator=generator))
        bn.bias.copy_(torch.empty(8).normal_(0.0, 0.1, generator=generator))
        mean, var = bn.running_mean, bn.running_var
        assert mean is not None and var is not None  # (track_running_stats)
        mean.copy_(torch.empty(8).normal_(0.0, 0.1, generator=generator))
        var.copy_(torch.empty(8).uniform_(0.05, 0.5, generator=generator))
        spread_logits(model.fc, model, torch.from_numpy(sample_inputs(64, seed + 2)))
    return model


def sample_inputs(n: int, seed: int = 0) -> np.ndarray:
    """Image-like NCHW inputs: smooth random fields plus noise, in [-1, 1]."""
    rng = np.random.default_rng(seed)
    smooth = np.kron(rng.normal(size=(n, 3, 4, 4)), np.ones((1, 1, 4, 4)))
    return np.clip(0.6 * smooth + 0.3 * rng.normal(size=(n, 3, 16, 16)), -1, 1).astype(np.float32)


def keras_port(torch_model, bug: str | None = None):
    """The Keras port of ``torch_model`` with its weights; ``bug``: one of ``BUGS`` or None."""
    import keras
    from keras import layers

    if bug not in (None, *BUGS):
        raise ValueError(f"unknown port bug '{bug}' (known: {', '.join(BUGS)})")
    image = keras.Input((3, 16, 16), name="image")
    x = layers.Permute((2, 3, 1), name="to_nhwc")(image)
    conv1 = layers.Conv2D(8, 3, padding="same", name="conv1")
    bn1 = layers.BatchNormalization(epsilon=1e-3 if bug == "bn_epsilon" else 1e-5, name="bn1")
    x = layers.ReLU(name="relu1")(bn1(conv1(x)))
    conv2 = layers.Conv2D(16, 3, strides=2, padding="same" if bug == "padding" else "valid",
                          name="conv2")
    if bug != "padding":
        x = layers.ZeroPadding2D(1, name="pad2")(x)
    x = layers.ReLU(name="relu2")(conv2(x))
    if bug != "flatten":
        x = layers.Permute((3, 1, 2), name="to_nchw")(x)  # flatten in torch's CHW order
    fc = layers.Dense(10, name="fc")
    model = keras.Model(image, {"logits": fc(layers.Flatten(name="flatten")(x))})
    state = {k: v.detach().numpy() for k, v in torch_model.state_dict().items()}
    conv1.set_weights([state["conv1.weight"].transpose(2, 3, 1, 0), state["conv1.bias"]])
    bn1.set_weights([state["bn1.weight"], state["bn1.bias"], state["bn1.running_mean"],
                     state["bn1.running_var"]])
    conv2.set_weights([state["conv2.weight"].transpose(2, 3, 1, 0), state["conv2.bias"]])
    fc.set_weights([state["fc.weight"].T, state["fc.bias"]])
    return model


def save_keras(folder: Path, stem: str, seed: int, make) -> tuple[Path, Path]:
    """``stem.keras`` and its SavedModel (``stem_saved_model``) from the Keras model ``make()``
    builds, saved once per ``seed`` (a stamp file beside them) and reused after. Needs Keras on
    its tensorflow backend (``model.export`` writes the SavedModel through TensorFlow)."""
    keras_path, saved_model = folder / f"{stem}.keras", folder / f"{stem}_saved_model"
    stamp = folder / f"{stem}.keras.seed"
    if not (stamp.exists() and stamp.read_text() == str(seed) and keras_path.exists()
            and (saved_model / "saved_model.pb").exists()):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        os.environ.setdefault("KERAS_BACKEND", "tensorflow")
        import keras

        if keras.backend.backend() != "tensorflow":
            raise RuntimeError("exporting Keras models needs Keras on its tensorflow backend "
                               f"(this process runs '{keras.backend.backend()}')")
        model = make()
        model.save(keras_path)
        model.export(str(saved_model), format="tf_saved_model", verbose=False)
        stamp.write_text(str(seed))
    return keras_path, saved_model


def _export_variant(bug: str | None, folder: str | Path, seed: int = 0) -> dict[str, Path]:
    """The torch artifacts (shared by the variants) and this variant's ``.keras`` and
    SavedModel, reused when already exported for ``seed``."""
    from guard.zoo.export import export_pair

    folder = Path(folder)
    torch_model = build(seed)
    paths = export_pair(NAME, torch_model, (_example(),), INPUTS, OUTPUTS, folder, seed)
    stem = NAME if bug is None else f"{NAME}_{bug}"
    keras_path, saved_model = save_keras(folder, stem, seed,
                                         lambda: keras_port(torch_model, bug))
    return {**paths, "keras": keras_path, "saved_model": saved_model}


def _example():
    import torch

    return torch.from_numpy(sample_inputs(2, 0))


def _variant(bug: str | None) -> SimpleNamespace:
    """One zoo model: the torch reference and this variant's Keras port."""
    return SimpleNamespace(
        NAME=NAME if bug is None else f"{NAME}_{bug}", TASK=TASK, INPUTS=INPUTS,
        OUTPUTS=OUTPUTS, build=build, sample_inputs=sample_inputs,
        export=lambda folder, seed=0: _export_variant(bug, folder, seed))


FAITHFUL = _variant(None)
BN_EPSILON = _variant("bn_epsilon")
FLATTEN = _variant("flatten")
PADDING = _variant("padding")
