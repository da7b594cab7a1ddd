"""What a backend is, declared once in its own module (no heavy imports here).

Each backend module ends with ``KINDS = {name: BackendKind(...)}``; ``guard.backends`` holds the
one registration (name -> module) and reads these declarations for config validation, the
checks and the matrix. Capturing a model's intermediate tensors is one of a backend's
capabilities (``activations``, the code in guard/backends/activations/): tier 2 compares what a
capture hands it. What the layers above do with a backend they register themselves, keyed by its
name (the op repair's strategies in guard/policy/keep_back.py). A backend knows no checks,
policy or serving.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

if TYPE_CHECKING:
    from pydantic import BaseModel

    from guard.backends.base import Backend, Role
    from guard.config import BackendConfig


def load_ref(ref: str) -> Any:
    """The object a ``"package.module:name"`` reference names (imported on first use)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


class Unsupported(Exception):
    """A declared capability that this block cannot provide (e.g. no fp64 run of a program
    that runs as exported); the message says why."""


@dataclass(frozen=True)
class BackendKind:
    """One ``backend:`` name of the config.

    - ``backend``: the class built for a block (``Backend(spec, role, threads)``), or a
      function of the same arguments that picks the class by role (``openai``: a
      forwarder for the routes, a remote scorer for the reference).
    - ``options``: the strict pydantic model of the block's ``options`` map.
    - ``precisions``: what it derives from an fp32 artifact by itself.
    - ``artifact``: True when the block names a file (``path``); False for a remote server
      (``target`` + ``model``).
    - ``formats``: artifact formats it loads (``onnx``, ``openvino_ir``, ``torchscript``,
      ``torch_export``, ``factory``): the matrix picks a model's artifact by them.
    - ``activations``: ``"module:function"``, the builder of this backend's activation capture
      (``(spec, role, config, threads, run_path, label) -> side``, guard/backends/activations/;
      imported when a side is built); None: its intermediate tensors cannot be captured, and
      ``no_activations`` may say why (the config error repeats it).
    - ``activations_beside``: captured only beside one of these backends on the other side of
      the pair (their captures align); None: beside any capturable one. ``beside_why``: why
      (the config error says it).
    - ``capture_as``: ``(spec) -> spec``, the block tier 2 captures in this one's place to
      find the op repair's suspects, when it cannot hook this backend's own computation (e.g.
      an eager copy of a compiled module); None: the block itself.
    - ``forwards``: it forwards protocol messages itself (``forward``/``connect``, see
      ``guard.backends.base.Forwarding``): the data plane hands it the client's request.
    - ``check``: backend-specific checks of a block (raise ValueError; may normalise it, e.g.
      a device); ``check_model``: checks of a model block that involve this backend;
      ``check_config``: checks of the whole config that involve it (a process-wide setting
      two blocks must agree on, e.g. Keras's backend), given the validated ``GuardConfig``.
    - ``threaded``: it computes with another intra-op thread count on request (the noise
      floor's thread comparison, ``with_threads``); ``in_threads``: a context manager
      ``(backend, threads)`` in which the built backend itself computes with ``threads``
      (a process-wide setting, e.g. torch's); None: a second instance is built with them.
    - ``fp64``: ``(spec) -> Backend``, the block's model run in float64 (built, not loaded; the
      fp64 arbiter's truth), raising ``Unsupported`` for a block that has none; None: the
      backend has no fp64 run.
    - ``llm``: what it does for a generative model (``task: generation``): ``serve`` (an
      OpenAI-compatible server the HTTP edge forwards to: a primary or fallback), ``score`` (a
      teacher-forcing reference); empty: a tensor backend, which a generative model cannot
      use (and a backend with ``llm`` set serves no tensor model).
    - ``extra``: the optional dependency extra of pyproject.toml that installs its runtime
      (None: guard's core installs it, or it comes from elsewhere, as TensorRT): a load that
      fails on a missing module says how to install it (``guard.errors.install_hint``).
    """

    name: str
    backend: Callable[["BackendConfig", "Role", int], "Backend"]
    options: type["BaseModel"]
    precisions: frozenset[str] = frozenset({"fp32"})
    artifact: bool = True
    formats: frozenset[str] = frozenset()
    activations: str | None = None
    activations_beside: frozenset[str] | None = None
    beside_why: str = ""
    no_activations: str = ""
    capture_as: Callable[[Any], Any] | None = None
    forwards: bool = False
    check: Callable[[Any], None] | None = None
    check_model: Callable[[Any], None] | None = None
    check_config: Callable[[Any], None] | None = None
    threaded: bool = False
    in_threads: Callable[[Any, int], ContextManager[Any]] | None = None
    fp64: Callable[[Any], "Backend"] | None = None
    llm: frozenset[str] = frozenset()
    extra: str | None = None

    @contextlib.contextmanager
    def with_threads(self, built: "Backend", spec: Any, threads: int) -> Iterator["Backend"]:
        """A backend computing like ``built`` (the reference of ``spec``) but with ``threads``
        intra-op threads: ``built`` itself inside ``in_threads``, or a second instance, closed
        after."""
        if self.in_threads is not None:
            with self.in_threads(built, threads):
                yield built
            return
        other = self.backend(spec, "reference", threads)
        other.load()
        try:
            yield other
        finally:
            other.close()
