"""A torch module's activations for tier 2: module inputs and outputs captured with forward hooks.

Hooks are registered on every named submodule for the duration of one capture and removed
afterwards, on a module loaded for tier 2 alone (never the module that serves requests). Each
call of a module is recorded in the order calls *finish* (a valid topological order: a module
finishes after everything it read), so a module called twice (a shared pooling layer) has
calls ``pool#0`` and ``pool#1``. Each call also records where its inputs came from (the call
whose output each input tensor is, by identity) and the call it ran inside: the dataflow that
tells align.py which modules an exporter folded into one group of nodes.

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

from guard.backends.activations import CaptureUnsupported
from guard.backends.artifact import import_factory
from guard.backends.base import Role

__all__ = ["CaptureUnsupported", "ModuleCall", "TorchCapture", "TorchSide", "torch_side"]


@dataclass
class ModuleCall:
    path: str  # "layers.0.lin"
    index: int  # 0 for the first call of this module in the forward, 1 for the second...
    kind: str  # the module's class name
    inputs: list[np.ndarray]  # positional tensor arguments, as they were when the call began
    outputs: list[np.ndarray]  # tensor outputs, flattened (a tuple output gives several)
    # Dataflow between module calls, by tensor identity: for each input, the key of the leaf call
    # that computed it, else of the container whose own code did (None: a graph input).
    sources: list[str | None] = field(default_factory=list)
    parent: str | None = None  # the key of the call this one ran inside (None: the root's)
    leaf: bool = True  # the module has no submodules
    identity: bool = False  # returned its only input unchanged (Identity, eval-mode Dropout)
    order: int = 0  # position in finish order

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

    def by_key(self) -> dict[str, ModuleCall]:
        return {call.key: call for call in self.calls}

    def consumers(self) -> dict[str, list[ModuleCall]]:
        """Leaf calls reading each call's outputs (by tensor identity)."""
        out: dict[str, list[ModuleCall]] = {}
        for call in self.calls:
            if call.leaf:
                for source in dict.fromkeys(s for s in call.sources if s is not None):
                    out.setdefault(source, []).append(call)
        return out

    def descendants(self, key: str) -> list[ModuleCall]:
        """The calls made inside call ``key``, at any depth, in finish order."""
        inside = {key}
        out = []
        for call in sorted(self.calls, key=lambda c: c.order):
            if call.parent in inside:
                inside.add(call.key)
                out.append(call)
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
        self.has_children = {path: any(True for _ in m.children())
                             for path, m in self.submodules.items()}

    def _tensor(self, array: np.ndarray):
        import torch

        tensor = torch.from_numpy(np.array(array, copy=True))
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        return tensor.to(self.device)

    def capture(self, inputs: dict[str, np.ndarray]) -> TorchCapture:
        """One forward with hooks on every submodule: each call's inputs (a pre-hook, before an
        in-place module such as ``ReLU(inplace=True)`` overwrites them), outputs, the calls its
        inputs came from and the call it ran inside."""
        import torch

        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise ValueError(f"missing inputs: {', '.join(missing)}")
        capture = TorchCapture()
        counts: dict[str, int] = {}
        producer: dict[int, str] = {}  # id(tensor) -> the key of the leaf call that computed it
        returned: dict[int, str] = {}  # id(tensor) -> the last container call that returned it
        alive: list = []  # every tensor seen, so that no id is reused during the forward
        stack: list[tuple[str, list, list[np.ndarray], list[str | None], str | None]] = []

        def pre_hook(module, args):
            path = self.paths.get(module)
            if path is None:
                return
            index = counts.get(path, 0)
            counts[path] = index + 1
            tensors = _tensors(args)
            alive.extend(tensors)
            parent = stack[-1][0] if stack else None
            stack.append((f"{path}#{index}", tensors, [_to_numpy(t) for t in tensors],
                          [producer.get(id(t)) or returned.get(id(t)) for t in tensors],
                          parent))

        def hook(module, args, output):
            path = self.paths.get(module)
            if path is None or not stack:
                return
            key, in_tensors, in_arrays, sources, parent = stack.pop()
            outs = _tensors(output)
            alive.extend(outs)
            arrays = [_to_numpy(t) for t in outs]
            identity = (len(in_arrays) == 1 and len(arrays) == 1
                        and in_arrays[0].shape == arrays[0].shape
                        and in_arrays[0].dtype == arrays[0].dtype
                        and np.array_equal(in_arrays[0], arrays[0], equal_nan=True))
            leaf = not self.has_children[path]
            for tensor in outs:
                # An identity is transparent: its output still comes from its input's producer.
                # A container returning a child's tensor does not become its producer (the
                # dataflow is between the modules that compute); a tensor its own code computed
                # (a residual add) comes from the container.
                if identity:
                    if sources[0] is None:
                        producer.pop(id(tensor), None)
                    else:
                        producer[id(tensor)] = sources[0]
                elif leaf:
                    producer[id(tensor)] = key
                else:
                    returned[id(tensor)] = key
            name, _, index = key.rpartition("#")
            capture.calls.append(ModuleCall(
                name, int(index), type(module).__name__, in_arrays, arrays, sources, parent,
                leaf=leaf, identity=identity, order=len(capture.calls)))

        handles = [m.register_forward_pre_hook(pre_hook) for m in self.paths]
        handles += [m.register_forward_hook(hook) for m in self.paths]
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

    def weight(self, path: str) -> np.ndarray | None:
        """Module ``path``'s ``weight`` parameter as float numpy, or None (align.py matches a
        runtime's packed weights against it)."""
        import torch

        module = self.submodules.get(path)
        weight = getattr(module, "weight", None) if module is not None else None
        if not isinstance(weight, torch.Tensor):
            return None
        return weight.detach().float().cpu().numpy()

    def run_module(self, path: str, inputs: list[np.ndarray],
                   substitutes: dict[str, list[list[np.ndarray]]] | None = None
                   ) -> list[np.ndarray]:
        """Call one submodule on given inputs (isolated error when torch is the primary).

        ``substitutes``: for submodules of ``path``, the outputs each of their calls returns
        instead of computing (the k-th call gets the k-th entry): a container is then judged
        on its own code alone, its children fed and replaced by the reference's tensors."""
        import torch

        handles = []
        if substitutes:
            counts: dict[str, int] = {}

            def replace(module, args, output):
                sub = self.paths.get(module)
                if sub is None:
                    return None
                values = substitutes.get(sub)
                if values is None:
                    return None
                index = counts.get(sub, 0)
                counts[sub] = index + 1
                if index >= len(values):
                    return None
                arrays = values[index]
                if isinstance(output, torch.Tensor) and len(arrays) == 1:
                    return self._tensor(arrays[0]).to(output.dtype)
                if (isinstance(output, tuple) and len(output) == len(arrays)
                        and all(isinstance(o, torch.Tensor) for o in output)):
                    return tuple(self._tensor(a).to(o.dtype) for a, o in zip(arrays, output))
                return None

            root = self.submodules[path]
            handles = [m.register_forward_hook(replace) for name, m in root.named_modules()
                       if name and f"{path}.{name}" in substitutes]
        try:
            with torch.inference_mode():
                result = self.submodules[path](*[self._tensor(a) for a in inputs])
        finally:
            for handle in handles:
                handle.remove()
        return [_to_numpy(t) for t in _tensors(result)]

    def close(self) -> None:
        self.module = None
        self.submodules.clear()
        self.paths.clear()


def torch_side(spec, role: Role, config, threads: int = 1, run_path=None,
               label: str = "torch") -> TorchSide:
    """Tier 2's side for a torch block (declared as its ``activations`` in
    guard/backends/torch.py): the module loaded as the backend loads it, hooked on a copy."""
    import torch

    from guard.backends.onednn_linear import with_torch_kernels
    from guard.backends.torch import TorchBackend

    backend = TorchBackend(with_torch_kernels(spec), role, threads)
    backend.load()
    module = eager_module(backend.module, config.torch_factory, spec.context.base_dir, label)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(spec.precision)
    names = [s.name for s in backend.describe().inputs]
    return TorchSide(module, names, dtype=dtype, device=spec.device, label=label)
