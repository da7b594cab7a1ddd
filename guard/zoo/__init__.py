"""The model zoo: seeded models built offline (no downloads) and real pretrained models that
ship inside PyPI wheels (optional extra ``guard[zoo]``).

``zoo_entry(name)`` gives one model's task, signature, input generator, adapters and exporter,
whatever kind it is. Seeded models: ``classifier`` (the demo's CNN), ``resnet``, ``vit``,
``detector``, ``segmenter``, ``keras_port`` with its port-bug variants (a torch CNN and its Keras
ports, guard/zoo/keras_port.py), and CrossedWires' ``cw_vgg16``, ``cw_resnet50``, ``cw_densenet121``
(keras.applications and torch twins, guard/zoo/crossedwires.py). Real models (``guard.zoo.real``):
``magika``, ``minilm``, ``silero_vad``; asking for one whose package is absent raises
``ZooExtraMissing`` with the install command.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from guard.backends.base import TensorSpec
from guard.errors import GuardError

SEEDED = {
    "classifier": "guard.zoo.classifier",
    "resnet": "guard.zoo.resnet",
    "vit": "guard.zoo.vit",
    "detector": "guard.zoo.detector",
    "segmenter": "guard.zoo.segmenter",
}
# Seeded too: a torch CNN and its Keras ports (faithful, and the three classic port bugs). Each
# exports the torch artifacts and its own .keras and SavedModel (needs guard[tensorflow]).
PORTS = {
    "keras_port": "guard.zoo.keras_port:FAITHFUL",
    "keras_port_bn_epsilon": "guard.zoo.keras_port:BN_EPSILON",
    "keras_port_flatten": "guard.zoo.keras_port:FLATTEN",
    "keras_port_padding": "guard.zoo.keras_port:PADDING",
    # CrossedWires' architectures: keras.applications and a torch twin with the same weights
    # (guard/zoo/crossedwires.py).
    "cw_vgg16": "guard.zoo.crossedwires:VGG16",
    "cw_resnet50": "guard.zoo.crossedwires:RESNET50",
    "cw_densenet121": "guard.zoo.crossedwires:DENSENET121",
}
REAL = ("magika", "minilm", "silero_vad")


class ZooExtraMissing(GuardError):
    """A real zoo model whose package is not installed."""


@dataclass
class ZooEntry:
    name: str
    task: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    sample_inputs: Callable[[int, int], dict[str, np.ndarray]]
    # -> {"torchscript": .pt, "onnx": .onnx}; the Keras ports add "keras" and "saved_model"
    export: Callable[[Path, int], dict[str, Path]]
    adapters: list[Any] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)  # task-tier settings that fit it
    kind: str = "seeded"  # "seeded" | "real"
    factory: str | None = None  # "module:function" building the eager module (torch backends)
    factory_kwargs: dict[str, Any] = field(default_factory=dict)


def _seeded(name: str):
    """A seeded model's module, or the object a ``module:NAME`` entry names (a variant that
    shares its module with others)."""
    module, _, attr = {**SEEDED, **PORTS}[name].partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attr) if attr else loaded


def eager(name: str, seed: int = 0):
    """A seeded zoo model as an eager ``nn.Module`` carrying its signature: the
    ``module:factory`` path ``guard.zoo:eager`` (torch.compile cannot compile TorchScript)."""
    import json

    from guard.backends.torch import signature_json

    module = _seeded(name)
    model = module.build(seed)
    model.guard_signature = json.loads(signature_json(module.INPUTS, module.OUTPUTS))
    return model


def names() -> list[str]:
    return list(SEEDED) + list(PORTS) + list(REAL)


def zoo_entry(name: str) -> ZooEntry:
    if name in SEEDED or name in PORTS:
        module = _seeded(name)
        first = module.INPUTS[0].name

        def sample_inputs(n: int, seed: int = 0) -> dict[str, np.ndarray]:
            return {first: module.sample_inputs(n, seed)}

        return ZooEntry(
            name=name,
            task=getattr(module, "TASK", "classification"),
            inputs=list(module.INPUTS),
            outputs=list(module.OUTPUTS),
            sample_inputs=sample_inputs,
            export=module.export,
            adapters=list(getattr(module, "ADAPTERS", [])),
            factory="guard.zoo:eager",
            factory_kwargs={"name": name, "seed": 0},
        )
    if name in REAL:
        from guard.zoo import real

        return real.entry(name)
    raise GuardError(f"unknown zoo model '{name}' (available: {', '.join(names())})")
