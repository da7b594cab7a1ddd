"""Standard architectures written the usual way, seeded, for tier 2's alignment at depth.

- :func:`encoder`: a pre-norm attention encoder laid out as timm's ViT and most Hugging Face
  encoders are, ``embed``, ``blocks.N.{ln1, attn.{q,k,v,out}, ln2, mlp.{fc1,act,fc2}}``,
  ``norm``, ``head``; ``blocks`` a ``Sequential`` (timm) the exporter sees called, or with
  ``module_list`` a ``ModuleList`` the forward loops over (Hugging Face), which it does not.
- :func:`resnet`: torchvision's ResNet layout (``conv1``, ``bn1``, ``relu``, ``maxpool``,
  ``layerK`` as ``Sequential`` of ``BasicBlock`` with ``downsample = Sequential(conv, bn)``,
  ``avgpool``, ``fc``), a BatchNorm after every convolution and one in-place ReLU reused twice
  per block. Hand-written: torchvision's PyPI wheels need CUDA's libraries and do not import
  with the CPU torch.
- :func:`recurrent`: a sequence classifier, ``embed`` (Linear) and ReLU, ``rnn`` (an
  ``nn.GRU`` or ``nn.LSTM``, batch first, which either exporter turns into one ONNX GRU/LSTM
  op), ``head`` on the last step.

Weights are seeded and the normalisation layers carry trained-looking statistics and affine
parameters (a fresh BatchNorm is the identity, which an exporter folds into nothing).
"""

from __future__ import annotations

import numpy as np

ENCODER_VOCAB = 64


def _sign(model, inputs: list[tuple[str, str, tuple]], outputs: list[tuple[str, str, tuple]]):
    """The ``guard_signature`` a torch backend reads off a factory's module."""
    import json

    from guard.backends.base import TensorSpec
    from guard.backends.torch import signature_json

    specs = [[TensorSpec(*item) for item in items] for items in (inputs, outputs)]
    model.guard_signature = json.loads(signature_json(*specs))
    return model


def _settle_norms(model, seed: int) -> None:
    """Running statistics and affine parameters as after training."""
    import torch
    from torch import nn

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
                n, mean, var = module.num_features, module.running_mean, module.running_var
                assert mean is not None and var is not None  # (track_running_stats)
                mean.copy_(0.1 * torch.randn(n, generator=generator))
                var.copy_(0.5 + torch.rand(n, generator=generator))
            if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm)):
                shape = module.weight.shape
                module.weight.copy_(0.8 + 0.4 * torch.rand(shape, generator=generator))
                module.bias.copy_(0.05 * torch.randn(shape, generator=generator))


def encoder(seed: int = 0, dim: int = 32, heads: int = 4, depth: int = 2, classes: int = 8,
            module_list: bool = False):
    """ids int64 [N, T] -> logits [N, T, classes]."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(dim, dim)
            self.k = nn.Linear(dim, dim)
            self.v = nn.Linear(dim, dim)
            self.out = nn.Linear(dim, dim)
            self.scale = (dim // heads) ** -0.5  # a constant, as timm writes it

        def forward(self, x):
            n, t, d = x.shape
            h = heads

            def split(y):
                return y.view(n, t, h, d // h).transpose(1, 2)

            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            weights = torch.softmax(q @ k.transpose(-1, -2) * self.scale, dim=-1)
            return self.out((weights @ v).transpose(1, 2).reshape(n, t, d))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(dim, 4 * dim)
            self.act = nn.GELU()
            self.fc2 = nn.Linear(4 * dim, dim)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(dim)
            self.attn = Attention()
            self.ln2 = nn.LayerNorm(dim)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(ENCODER_VOCAB, dim)
            blocks = [Block() for _ in range(depth)]
            self.blocks = nn.ModuleList(blocks) if module_list else nn.Sequential(*blocks)
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, classes)

        def forward(self, ids):
            x = self.embed(ids)
            if module_list:
                for block in self.blocks:
                    x = block(x)
            else:
                x = self.blocks(x)
            return self.head(self.norm(x))

    torch.manual_seed(seed)
    model = Encoder()
    _settle_norms(model, seed)
    return _sign(model.eval(), [("ids", "INT64", (-1, -1))],
                 [("logits", "FP32", (-1, -1, classes))])


def encoder_inputs(n: int = 4, tokens: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(500 + seed)
    return {"ids": rng.integers(0, ENCODER_VOCAB, size=(n, tokens), dtype=np.int64)}


def resnet(seed: int = 0, widths: tuple[int, ...] = (16, 32, 64), blocks: int = 2,
           classes: int = 10):
    """image [N, 3, 32, 32] -> logits [N, classes], torchvision's ResNet (BasicBlock) layout."""
    import torch
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                                nn.BatchNorm2d(cout))

        def forward(self, x):
            identity = x
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            if self.downsample is not None:
                identity = self.downsample(x)
            return self.relu(out + identity)

    class ResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(widths[0])
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            cin = widths[0]
            for i, width in enumerate(widths):
                stage = [BasicBlock(cin, width, 1 if i == 0 else 2)]
                stage += [BasicBlock(width, width, 1) for _ in range(blocks - 1)]
                setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
                cin = width
            self.stages = len(widths)
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(cin, classes)

        def forward(self, image):
            x = self.maxpool(self.relu(self.bn1(self.conv1(image))))
            for i in range(self.stages):
                x = getattr(self, f"layer{i + 1}")(x)
            return self.fc(torch.flatten(self.avgpool(x), 1))

    torch.manual_seed(seed)
    model = ResNet()
    _settle_norms(model, seed)
    return _sign(model.eval(), [("image", "FP32", (-1, 3, 32, 32))],
                 [("logits", "FP32", (-1, classes))])


def resnet_inputs(n: int = 4, seed: int = 0, size: int = 32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(600 + seed)
    return {"image": rng.standard_normal((n, 3, size, size)).astype(np.float32)}


def recurrent(kind: str = "gru", seed: int = 0, features: int = 8, hidden: int = 24,
              classes: int = 4):
    """x[N, T, features] -> embed -> ReLU -> rnn (GRU or LSTM) -> head(last step) -> logits."""
    import torch
    from torch import nn

    class SequenceClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(features, 16)
            self.rnn = {"gru": nn.GRU, "lstm": nn.LSTM}[kind](16, hidden, batch_first=True)
            self.head = nn.Linear(hidden, classes)

        def forward(self, x):
            sequence, _ = self.rnn(torch.relu(self.embed(x)))
            return self.head(sequence[:, -1])

    torch.manual_seed(seed)
    return _sign(SequenceClassifier().eval(), [("x", "FP32", (-1, 10, features))],
                 [("logits", "FP32", (-1, classes))])


def recurrent_inputs(n: int = 4, seed: int = 0, steps: int = 10,
                     features: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(700 + seed)
    return {"x": rng.standard_normal((n, steps, features)).astype(np.float32)}


def perturbed(model, module: str, share: float, seed: int = 0, tensor: str = "weight"):
    """A copy of ``model`` with one module's ``tensor`` changed by ``share`` of its spread:
    ``W + share * std(W) * N(0, 1)`` (a bias of zeros: the weight's spread; ``running_var``,
    a BatchNorm's statistics: the variance scaled by ``1 + share``)."""
    import copy

    import torch

    other = copy.deepcopy(model)
    target = other.get_submodule(module)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        value = getattr(target, tensor)
        if tensor == "running_var":
            value.mul_(1 + share)
        else:
            std = float(value.std()) if value.numel() > 1 else float(value.abs().mean())
            if std == 0.0:  # a bias initialised to zeros: the spread of the layer's weight
                weight = getattr(target, "weight", None)
                std = float(weight.std()) if weight is not None and weight.numel() > 1 else 1.0
            value.add_(share * std * torch.randn(value.shape, generator=generator))
    return other.eval()


def export(model, path, inputs: dict[str, np.ndarray], output: str = "logits",
           dynamo: bool = False):
    """ONNX export as a user would: the TorchScript exporter at opset 17, or the dynamo
    exporter (its own default opset); eval mode; the batch axis dynamic."""
    import contextlib
    import io
    import warnings

    import torch

    args = tuple(torch.from_numpy(a) for a in inputs.values())
    names = list(inputs)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        if dynamo:
            batch = torch.export.Dim("batch", max=4096)
            torch.onnx.export(model, args, str(path), dynamo=True, external_data=False,
                              input_names=names, output_names=[output],
                              dynamic_shapes=tuple({0: batch} for _ in names))
        else:
            torch.onnx.export(model, args, str(path), dynamo=False, opset_version=17,
                              input_names=names, output_names=[output],
                              dynamic_axes={n: {0: "batch"} for n in names + [output]})
    return path
