"""torch side of tier 2: module inputs and outputs captured with forward hooks.

Hooks are registered on every named submodule for the duration of one capture and removed
afterwards, on a module loaded for tier 2 alone (never the module that serves requests). Each
call of a module is recorded in the order calls *finish* (a valid topological order: a module
finishes after everything it read), so a module called twice (a shared pooling layer) has
calls ``pool#0`` and ``pool#1``.

TorchScript and ``torch.export`` programs run their forward in C++: Python hooks cannot see
inside them (``register_forward_hook is not supported on ScriptModules``). For those the config
names an eager factory of the same architecture (``checks.activation.torch_factory``); the
artifact's own weights are loaded into it (``load_state_dict``, strict), so what is captured is
the artifact's arithmetic on the artifact's weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from guard.backends.artifact import import_factory
from guard.errors import GuardError


class CaptureUnsupported(GuardError):
    """This side cannot be captured as configured; the message says what to configure."""


@dataclass
class ModuleCall:
    path: str  # "layers.0.lin"
    index: int  # 0 for the first call of this module in the forward, 1 for the second...
    kind: str  # the module's class name
    inputs: list[np.ndarray]  # positional tensor arguments
    outputs: list[np.ndarray]  # tensor outputs, flattened (a tuple output gives several)

    @property
    def key(self) -> str:
        return f"{self.path}#{self.index}"


@dataclass
class TorchCapture:
    calls: list[ModuleCall] = field(default_factory=list)

    def by_path(self) -> dict[str, list[ModuleCall]]:
        out: dict[str, list[ModuleCall]] = {}
        for call in self.calls:
            out.setdefault(call.path, []).append(call)
        return out


def _tensors(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _to_numpy(tensor) -> np.ndarray:
    import torch

    tensor = tensor.detach()
    if tensor.dtype in (torch.float16, torch.bfloat16):
        tensor = tensor.float()  # numpy has no bf16; the comparison is in float64 anyway
    return tensor.cpu().numpy().copy()


def load_factory(ref: str, base_dir: Path | None = None):
    try:
        return import_factory(ref, base_dir)
    except (ImportError, AttributeError) as exc:
        raise CaptureUnsupported(f"cannot import torch_factory '{ref}': {exc}") from exc


def eager_module(module, factory: str | None, base_dir: Path | None = None, label: str = ""):
    """An eager ``nn.Module`` whose submodules hooks can see, equal in weights to ``module``."""
    import torch

    scripted = isinstance(module, torch.jit.ScriptModule)
    exported = isinstance(module, torch.fx.GraphModule) and not any(
        True for _ in module.named_children())
    if not scripted and not exported:
        return module
    what = "a TorchScript module" if scripted else "a torch.export program"
    if factory is None:
        raise CaptureUnsupported(
            f"{label}: {what} runs its forward in C++, where forward hooks cannot see; set "
            "checks.activation.torch_factory to an eager 'module:factory' of the same "
            "architecture (its weights are loaded from the artifact)")
    eager = load_factory(factory, base_dir)()
    try:
        eager.load_state_dict(module.state_dict(), strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else str(exc)
        raise CaptureUnsupported(
            f"{label}: torch_factory '{factory}' does not match the artifact's weights: "
            f"{first}") from exc
    return eager.eval()


class TorchSide:
    """An eager module plus the dtype/device its backend runs it in."""

    kind = "torch"

    def __init__(self, module, input_names: list[str], dtype=None, device: str = "cpu",
                 label: str = "torch"):
        import torch

        self.label = label
        self.module = module.eval()
        self.input_names = input_names
        self.dtype = dtype
        self.device = torch.device(device)
        if dtype is not None:
            self.module = self.module.to(dtype)
        self.precision = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")
        self.module = self.module.to(self.device)
        self.paths = {m: path for path, m in self.module.named_modules() if path}
        self.submodules = dict(self.module.named_modules())

    def _tensor(self, array: np.ndarray):
        import torch

        tensor = torch.from_numpy(np.array(array, copy=True))
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        return tensor.to(self.device)

    def capture(self, inputs: dict[str, np.ndarray]) -> TorchCapture:
        import torch

        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise ValueError(f"missing inputs: {', '.join(missing)}")
        capture = TorchCapture()
        counts: dict[str, int] = {}

        def hook(module, args, output):
            path = self.paths.get(module)
            if path is None:
                return
            index = counts.get(path, 0)
            counts[path] = index + 1
            capture.calls.append(ModuleCall(
                path, index, type(module).__name__,
                [_to_numpy(t) for t in _tensors(args)], [_to_numpy(t) for t in _tensors(output)],
            ))

        handles = [m.register_forward_hook(hook) for m in self.paths]
        try:
            with torch.inference_mode():
                self.module(*[self._tensor(inputs[n]) for n in self.input_names])
        finally:
            for handle in handles:
                handle.remove()
        return capture

    def tensors(self, inputs: dict[str, np.ndarray],
                threads: int | None = None) -> dict[str, np.ndarray]:
        """Every module call's outputs by ``path#index.j`` (tier 2's per-layer noise); with
        ``threads``, torch's process-wide thread count is changed for the run and restored."""
        import torch

        before = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            capture = self.capture(inputs)
        finally:
            torch.set_num_threads(before)
        return {f"{call.key}.{j}": out for call in capture.calls
                for j, out in enumerate(call.outputs)}

    def run_module(self, path: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """Call one submodule on given inputs (isolated error when torch is the primary)."""
        import torch

        with torch.inference_mode():
            result = self.submodules[path](*[self._tensor(a) for a in inputs])
        return [_to_numpy(t) for t in _tensors(result)]

    def close(self) -> None:
        self.module = None
        self.submodules.clear()
        self.paths.clear()


def torch_side(spec, role: str, config, threads: int = 1, run_path=None,
               label: str = "torch") -> TorchSide:
    """Tier 2's side for a torch block (registered in guard/verify/activation/sides.py): the module
    loaded as the backend loads it, hooked on a copy."""
    import torch

    from guard.backends.torch import TorchBackend

    backend = TorchBackend(spec.model_copy(), role, threads)  # the copy keeps spec.context
    backend.load()
    module = eager_module(backend.module, config.torch_factory, spec.context.base_dir, label)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(spec.precision)
    names = [s.name for s in backend.describe().inputs]
    return TorchSide(module, names, dtype=dtype, device=spec.device, label=label)
