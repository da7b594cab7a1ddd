"""What a backend is, declared once in its own module (no heavy imports here).

Each backend module ends with ``KINDS = {name: BackendKind(...)}``; ``guard.backends`` holds the
one registration (name -> module) and reads these declarations for config validation, tier 2,
the op repair and the matrix. No other module lists backend names.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from pydantic import BaseModel

    from guard.backends.base import Backend


def load_ref(ref: str) -> Any:
    """The object a ``"package.module:name"`` reference names (imported on first use)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class BackendKind:
    """One ``backend:`` name of the config.

    - ``backend``: the class built for a block (``Backend(spec, role, threads)``).
    - ``options``: the strict pydantic model of the block's ``options`` map.
    - ``precisions``: what it derives from an fp32 artifact by itself.
    - ``artifact``: True when the block names a file (``path``); False for a remote server
      (``target`` + ``model``).
    - ``formats``: artifact formats it loads (``onnx``, ``openvino_ir``, ``torchscript``,
      ``torch_export``, ``factory``): the matrix picks a model's artifact by them.
    - ``capture``: ``"module:function"`` building tier 2's capture side for a block
      (``(spec, role, config, threads, run_path, label) -> side``), or None: tier 2 cannot
      capture its intermediate tensors.
    - ``keep_back``: precision -> ``"module:Class"`` of the op repair's strategy
      (guard/policy/keep_back.py) for a primary of that precision; empty: not repairable.
    - ``forwards``: it forwards protocol messages itself (``forward``/``connect``, see
      ``guard.backends.base.Forwarding``): the data plane hands it the client's request.
    - ``check``: backend-specific checks of a block (raise ValueError; may normalise it, e.g.
      a device); ``check_model``: checks of a model block that involve this backend.
    - ``threaded``: one instance can be rebuilt with another intra-op thread count (the noise
      floor's thread comparison).
    """

    name: str
    backend: type["Backend"]
    options: type["BaseModel"]
    precisions: frozenset[str] = frozenset({"fp32"})
    artifact: bool = True
    formats: frozenset[str] = frozenset()
    capture: str | None = None
    keep_back: Mapping[str, str] = field(default_factory=dict)
    forwards: bool = False
    check: Callable[[Any], None] | None = None
    check_model: Callable[[Any], None] | None = None
    threaded: bool = False
    fp64: bool = False  # its model converts to float64 (the fp64 arbiter)

    def capture_side(self) -> Callable | None:
        return load_ref(self.capture) if self.capture else None

    def keep_back_strategy(self, precision: str) -> type | None:
        ref = self.keep_back.get(precision)
        return load_ref(ref) if ref else None
