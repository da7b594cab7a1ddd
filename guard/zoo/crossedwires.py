"""The CrossedWires architectures (arXiv 2108.12768): VGG16, ResNet50 and DenseNet121 as
``keras.applications`` builds them (``weights=None``), each with a torch twin written here that
carries the same seeded weights and agrees with the Keras model within 1e-5 in fp32.

torchvision's PyPI wheels need CUDA's libraries and do not import with the CPU torch, so the
twins are written out: the same layers in the same order, each torch module named as its Keras
layer (``conv2_block1_1_conv``), so that tier 2 aligns them by name. What Keras fuses into one
layer the twin computes in one module (VGG's ``Conv2D(activation="relu")`` is ``_ConvReLU``);
what torch writes as ``forward`` code (ReLUs, residual adds, concatenations) or folds into a
module (the ``ZeroPadding2D`` before a stride-2 convolution or pooling: ``padding=``) has no
module, so those Keras layers are the port's own (tier 2 runs them in the next layer's
segment). A twin takes the Keras model's NHWC images (``image``, [-1, 32, 32, 3]; 64x64 for
DenseNet121, see ``SIZES``) and computes NCHW inside; both name their output ``logits`` (10
classes, no softmax).

Weights: the torch twin is built seeded (torchvision's initialisation), its BatchNorm
statistics set from a probe batch (unit RMS per channel), its head scaled so that
logits spread like a trained model's; the Keras model (``keras.applications.X(weights=None,
input_tensor=keras.Input((size, size, 3), name="image"), classes=10,
classifier_activation=None)``) then gets those weights layer by layer (conv OIHW -> HWIO,
Linear W.T, BatchNorm [weight, bias, running_mean, running_var]). VGG16's Flatten sees a 1x1
map at 32x32, but the twin flattens NHWC as Keras does, so the port holds at any size.

Zoo models ``cw_vgg16``, ``cw_resnet50``, ``cw_densenet121``: the torch twin is the reference
(TorchScript/ONNX like every seeded model), the ``.keras`` and its SavedModel the ports.
Building the Keras side needs Keras on its TensorFlow backend.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from guard.backends.base import TensorSpec

CLASSES = 10
OUTPUTS = [TensorSpec("logits", "FP32", (-1, CLASSES))]
ARCHITECTURES = ("vgg16", "resnet50", "densenet121")
# Image sizes: the smallest keras.applications accepts (32), but 64 for DenseNet121, whose 120
# layers carry fp32 noise to 9e-6 of the logits at 32x32 (1.2e-5 with torch on one thread),
# 7e-6 at 64x64 (its last feature map then averages 2x2 positions, not one).
SIZES = {"vgg16": 32, "resnet50": 32, "densenet121": 64}


def inputs(arch: str) -> list[TensorSpec]:
    size = SIZES[arch]
    return [TensorSpec("image", "FP32", (-1, size, size, 3))]
_KERAS = {"vgg16": "VGG16", "resnet50": "ResNet50", "densenet121": "DenseNet121"}
_EPS = 1.001e-5  # keras.applications' BatchNormalization epsilon (torch's default is 1e-5)


def sample_inputs(n: int, seed: int = 0, size: int = 32) -> np.ndarray:
    """Image-like NHWC inputs: smooth random fields plus noise, in [-1, 1]."""
    rng = np.random.default_rng(seed)
    smooth = np.kron(rng.normal(size=(n, size // 4, size // 4, 3)), np.ones((1, 4, 4, 1)))
    noisy = 0.6 * smooth + 0.3 * rng.normal(size=(n, size, size, 3))
    return np.clip(noisy, -1, 1).astype(np.float32)


# -- the torch twins ----------------------------------------------------------------------------
def _modules():
    """The twins' building blocks (torch imported on first use)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class ConvReLU(nn.Conv2d):
        """``Conv2D(activation="relu")``: one Keras layer, one module."""

        def forward(self, x):
            return F.relu(super().forward(x))

    class LinearReLU(nn.Linear):
        def forward(self, x):
            return F.relu(super().forward(x))

    class FlattenNHWC(nn.Module):
        """Keras's Flatten of a channels-last tensor: channels vary fastest."""

        def forward(self, x):
            return torch.flatten(x.permute(0, 2, 3, 1), 1)

    class GlobalAvgPool(nn.Module):
        def forward(self, x):
            return x.mean(dim=(2, 3))

    return SimpleNamespace(torch=torch, nn=nn, F=F, ConvReLU=ConvReLU, LinearReLU=LinearReLU,
                           FlattenNHWC=FlattenNHWC, GlobalAvgPool=GlobalAvgPool)


def _vgg16():
    from torch import nn

    m = _modules()

    class VGG16(nn.Module):
        BLOCKS = ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))

        def __init__(self):
            super().__init__()
            channels = 3
            self.order = []
            for b, (filters, convs) in enumerate(self.BLOCKS, start=1):
                for c in range(1, convs + 1):
                    self._add(f"block{b}_conv{c}", m.ConvReLU(channels, filters, 3, padding=1))
                    channels = filters
                self._add(f"block{b}_pool", m.nn.MaxPool2d(2, 2))
            self._add("flatten", m.FlattenNHWC())
            self._add("fc1", m.LinearReLU(channels * (SIZES["vgg16"] // 32) ** 2, 4096))
            self._add("fc2", m.LinearReLU(4096, 4096))
            self._add("predictions", m.nn.Linear(4096, CLASSES))

        def _add(self, name, module):
            setattr(self, name, module)
            self.order.append(name)

        def forward(self, image):
            x = image.permute(0, 3, 1, 2)
            for name in self.order:
                x = getattr(self, name)(x)
            return x

    return VGG16()


def _resnet50():
    from torch import nn

    m = _modules()
    F = m.F

    class ResNet50(nn.Module):
        STAGES = ((2, 64, 3, 1), (3, 128, 4, 2), (4, 256, 6, 2), (5, 512, 3, 2))

        def __init__(self):
            super().__init__()
            self.conv1_conv = nn.Conv2d(3, 64, 7, stride=2, padding=3)  # conv1_pad folded in
            self.conv1_bn = nn.BatchNorm2d(64, eps=_EPS)
            self.pool1_pool = nn.MaxPool2d(3, 2, padding=1)  # after a ReLU: as zero padding
            channels = 64
            self.blocks = []
            for stage, filters, count, stride in self.STAGES:
                for b in range(1, count + 1):
                    name = f"conv{stage}_block{b}"
                    s = stride if b == 1 else 1
                    if b == 1:
                        setattr(self, f"{name}_0_conv", nn.Conv2d(channels, 4 * filters, 1, s))
                        setattr(self, f"{name}_0_bn", nn.BatchNorm2d(4 * filters, eps=_EPS))
                    setattr(self, f"{name}_1_conv", nn.Conv2d(channels, filters, 1, s))
                    setattr(self, f"{name}_1_bn", nn.BatchNorm2d(filters, eps=_EPS))
                    setattr(self, f"{name}_2_conv", nn.Conv2d(filters, filters, 3, padding=1))
                    setattr(self, f"{name}_2_bn", nn.BatchNorm2d(filters, eps=_EPS))
                    setattr(self, f"{name}_3_conv", nn.Conv2d(filters, 4 * filters, 1))
                    setattr(self, f"{name}_3_bn", nn.BatchNorm2d(4 * filters, eps=_EPS))
                    self.blocks.append((name, b == 1))
                    channels = 4 * filters
            self.avg_pool = m.GlobalAvgPool()
            self.predictions = nn.Linear(channels, CLASSES)

        def forward(self, image):
            x = image.permute(0, 3, 1, 2)
            x = self.pool1_pool(F.relu(self.conv1_bn(self.conv1_conv(x))))
            for name, projects in self.blocks:
                layer = lambda suffix, prefix=name: getattr(  # noqa: E731
                    self, f"{prefix}_{suffix}")
                shortcut = layer("0_bn")(layer("0_conv")(x)) if projects else x
                y = F.relu(layer("1_bn")(layer("1_conv")(x)))
                y = F.relu(layer("2_bn")(layer("2_conv")(y)))
                y = layer("3_bn")(layer("3_conv")(y))
                x = F.relu(shortcut + y)
            return self.predictions(self.avg_pool(x))

    return ResNet50()


def _densenet121():
    from torch import nn

    m = _modules()
    F, torch = m.F, m.torch

    class DenseNet121(nn.Module):
        BLOCKS = (6, 12, 24, 16)
        GROWTH = 32

        def __init__(self):
            super().__init__()
            self.conv1_conv = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
            self.conv1_bn = nn.BatchNorm2d(64, eps=_EPS)
            self.pool1 = nn.MaxPool2d(3, 2, padding=1)
            channels = 64
            self.stages = []
            for i, count in enumerate(self.BLOCKS):
                stage = i + 2
                blocks = []
                for b in range(1, count + 1):
                    name = f"conv{stage}_block{b}"
                    setattr(self, f"{name}_0_bn", nn.BatchNorm2d(channels, eps=_EPS))
                    setattr(self, f"{name}_1_conv",
                            nn.Conv2d(channels, 4 * self.GROWTH, 1, bias=False))
                    setattr(self, f"{name}_1_bn", nn.BatchNorm2d(4 * self.GROWTH, eps=_EPS))
                    setattr(self, f"{name}_2_conv",
                            nn.Conv2d(4 * self.GROWTH, self.GROWTH, 3, padding=1, bias=False))
                    blocks.append(name)
                    channels += self.GROWTH
                transition = None
                if stage < 5:
                    transition = f"pool{stage}"
                    setattr(self, f"{transition}_bn", nn.BatchNorm2d(channels, eps=_EPS))
                    setattr(self, f"{transition}_conv",
                            nn.Conv2d(channels, channels // 2, 1, bias=False))
                    setattr(self, f"{transition}_pool", nn.AvgPool2d(2, 2))
                    channels //= 2
                self.stages.append((blocks, transition))
            self.bn = nn.BatchNorm2d(channels, eps=_EPS)
            self.avg_pool = m.GlobalAvgPool()
            self.predictions = nn.Linear(channels, CLASSES)

        def forward(self, image):
            x = image.permute(0, 3, 1, 2)
            x = self.pool1(F.relu(self.conv1_bn(self.conv1_conv(x))))
            for blocks, transition in self.stages:
                for name in blocks:
                    layer = lambda suffix, prefix=name: getattr(  # noqa: E731
                        self, f"{prefix}_{suffix}")
                    y = layer("1_conv")(F.relu(layer("0_bn")(x)))
                    y = layer("2_conv")(F.relu(layer("1_bn")(y)))
                    x = torch.cat([x, y], dim=1)
                if transition is not None:
                    layer = lambda suffix, prefix=transition: getattr(  # noqa: E731
                        self, f"{prefix}_{suffix}")
                    x = layer("pool")(layer("conv")(F.relu(layer("bn")(x))))
            return self.predictions(self.avg_pool(F.relu(self.bn(x))))

    return DenseNet121()


_TWINS = {"vgg16": _vgg16, "resnet50": _resnet50, "densenet121": _densenet121}


def build_twin(arch: str, seed: int = 0):
    """The torch twin of ``arch``, seeded: default initialisation, BatchNorm statistics of a
    probe batch (a trained model's are its data's), the head scaled to spread the logits."""
    import torch

    from guard.zoo.export import spread_logits

    if arch not in _TWINS:
        raise ValueError(f"unknown architecture '{arch}' (known: {', '.join(ARCHITECTURES)})")
    torch.manual_seed(seed)
    model = _TWINS[arch]()
    with torch.no_grad():  # torchvision's initialisation: activations keep their scale in depth
        for module in model.modules():
            if isinstance(module, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(module.weight, mode="fan_out",
                                              nonlinearity="relu")
                if module.bias is not None:
                    torch.nn.init.normal_(module.bias, 0.0, 0.01)
            elif isinstance(module, torch.nn.Linear):
                torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                torch.nn.init.normal_(module.bias, 0.0, 0.01)
    probe = torch.from_numpy(sample_inputs(32, seed + 1, SIZES[arch]))
    named_norms = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    norms = [m for _, m in named_norms]
    generator = torch.Generator().manual_seed(seed + 2)

    def calibrate(bn, args):
        # Statistics that give each channel unit RMS on the probe: mean 0, variance its mean
        # square. Not the probe's own mean: subtracting a mean the values sit close to
        # cancels digits, and fp32 noise would then grow ~1.2x per block through ResNet50.
        (x,) = args
        bn.running_mean.zero_()
        bn.running_var.copy_((x.double() ** 2).mean(dim=(0, 2, 3)).float() + 1e-3)

    with torch.no_grad():
        for name, bn in named_norms:
            # A residual branch's last BatchNorm: small scales, as in trained ResNets (and
            # the zero-init recipe); the sum then does not double its noise every block.
            low, high = (0.1, 0.4) if name.endswith("_3_bn") else (0.5, 1.5)
            bn.weight.copy_(torch.empty_like(bn.weight).uniform_(low, high, generator=generator))
            bn.bias.copy_(torch.empty_like(bn.bias).normal_(0.0, 0.1, generator=generator))
        model.eval()
        hooks = [bn.register_forward_pre_hook(calibrate) for bn in norms]
        try:
            model(probe)  # in graph order: each BatchNorm sees what the calibrated ones give
        finally:
            for hook in hooks:
                hook.remove()
        spread_logits(model.predictions, model, probe)
    return model



# -- the Keras models ---------------------------------------------------------------------------
def keras_model(arch: str, torch_model=None, seed: int = 0):
    """``keras.applications`` builds ``arch`` (weights=None, ``SIZES``, 10 classes, logits out),
    then gets the torch twin's weights layer by layer. Output: ``{"logits": ...}``."""
    import keras

    if torch_model is None:
        torch_model = build_twin(arch, seed)
    size = SIZES[arch]
    image = keras.Input((size, size, 3), name="image")
    app = getattr(keras.applications, _KERAS[arch])(
        weights=None, input_tensor=image, classes=CLASSES, classifier_activation=None)
    model = keras.Model(image, {"logits": app.output}, name=f"cw_{arch}")
    copy_weights(torch_model, model)
    return model


def copy_weights(torch_model, model) -> None:
    """Every torch module named as a Keras layer gives that layer its weights; a Keras layer
    with weights and no such module is an error (the twin would not be faithful)."""
    import torch

    modules = dict(torch_model.named_modules())
    for layer in model.layers:
        if not layer.weights:
            continue
        module = modules.get(layer.name)
        if module is None:
            raise ValueError(f"the torch twin has no module for Keras layer '{layer.name}'")
        state = {k: v.detach().numpy() for k, v in module.state_dict().items()}
        if isinstance(module, torch.nn.Conv2d):
            weights = [state["weight"].transpose(2, 3, 1, 0)]
        elif isinstance(module, torch.nn.Linear):
            weights = [state["weight"].T]
        elif isinstance(module, torch.nn.BatchNorm2d):
            weights = [state["weight"], state["bias"], state["running_mean"],
                       state["running_var"]]
        else:
            raise ValueError(f"no weight mapping for {type(module).__name__} '{layer.name}'")
        if "bias" in state and not isinstance(module, torch.nn.BatchNorm2d):
            weights.append(state["bias"])
        layer.set_weights(weights)


# -- zoo entries --------------------------------------------------------------------------------
def _export(arch: str, folder: str | Path, seed: int = 0) -> dict[str, Path]:
    """The twin's torch artifacts and the Keras model's ``.keras`` and SavedModel, reused when
    already exported for ``seed``."""
    import torch

    from guard.zoo.export import export_pair
    from guard.zoo.keras_port import save_keras

    folder = Path(folder)
    name = f"cw_{arch}_{SIZES[arch]}"  # a cached export at another image size is not reused
    twin = build_twin(arch, seed)
    example = (torch.from_numpy(sample_inputs(2, 0, SIZES[arch])),)
    paths = export_pair(name, twin, example, inputs(arch), OUTPUTS, folder, seed)
    keras_path, saved_model = save_keras(folder, name, seed,
                                         lambda: keras_model(arch, twin, seed))
    return {**paths, "keras": keras_path, "saved_model": saved_model}


def _entry(arch: str) -> SimpleNamespace:
    return SimpleNamespace(
        NAME=f"cw_{arch}", TASK="classification", INPUTS=inputs(arch), OUTPUTS=OUTPUTS,
        build=lambda seed=0: build_twin(arch, seed),
        sample_inputs=lambda n, seed=0: sample_inputs(n, seed, SIZES[arch]),
        export=lambda folder, seed=0: _export(arch, folder, seed))


def vgg16(seed: int = 0):
    """The VGG16 twin (a ``module:factory`` for a torch block)."""
    return build_twin("vgg16", seed)


def resnet50(seed: int = 0):
    return build_twin("resnet50", seed)


def densenet121(seed: int = 0):
    return build_twin("densenet121", seed)


VGG16 = _entry("vgg16")
RESNET50 = _entry("resnet50")
DENSENET121 = _entry("densenet121")
