"""torch.compile side of tier 2: per-module tensors of the compiled code, not of eager.

Hooks added to an eager module after ``torch.compile`` wrapped it would never run inside the
compiled graph; hooks registered *before* compiling are traced by dynamo into the graph like the
module's own code (a ``list.append`` of a clone is a side effect dynamo replays after the graph
runs). So the side compiles a private copy of the module, with a pre-hook and a hook on every
submodule that stash clones of its inputs and outputs, with the backend's own compile options
(mode, backend, dynamic, fullgraph). The clones are outputs of the compiled graph: inductor's
kernels computed them, at their own summation order.

Measured on the zoo's encoder (guard.zoo.layouts, inductor, CPU): every captured module output
differs from eager's by 1e-7 relative (summation order) and not at all from the same module
compiled without hooks (its output bit-identical), with no graph break
(tests/unit/test_activation_compiled.py). The capture is a compilation of its own, though:
that inductor fuses the same way with the extra graph outputs is measured on that model, not
guaranteed for every graph.

Isolation (the primary's module fed the reference's inputs) compiles the leaf alone, on a
hook-free copy, with the same options: the compiled arithmetic of that module. A container is
not re-run apart from its children (its children would have to return the reference's
tensors inside a compiled graph): its isolation note says so and tier 2 names leaves.

Sources (which call computed each input) come from identical tensor values, not identities:
the clones have none of their own.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any, Callable

import numpy as np

from guard.backends.activations.torch import (
    CaptureUnsupported,
    ModuleCall,
    TorchCapture,
    TorchSide,
    _tensors,
    _to_numpy,
    eager_module,
)
from guard.backends.base import Role


def _digest(array: np.ndarray) -> tuple:
    return (array.shape, array.dtype.str, hashlib.blake2b(array.tobytes(), digest_size=16).digest())


class CompiledTorchSide(TorchSide):
    """A torch.compile'd module captured through hooks compiled into its graph."""

    kind = "torch_compile"

    def __init__(self, module, input_names: list[str], compile_options: dict | None = None,
                 dtype=None, device: str = "cpu", label: str = "torch_compile"):
        super().__init__(module, input_names, dtype=dtype, device=device, label=label)
        self.compile_options = dict(compile_options or {})
        self._plain = copy.deepcopy(self.module)  # hook-free: the leaves compiled for isolation
        self._plain_modules = dict(self._plain.named_modules())
        self._leaves: dict[str, Callable[..., Any]] = {}  # torch.compile'd leaves
        self._events: list[tuple[str, str, list]] = []
        self._compiled = None

    def _compile(self, module):
        import torch

        from guard.backends.determinism import pin_compiler

        pin_compiler()
        return torch.compile(module, **self.compile_options)

    def _hooked(self):
        """The module with its stash hooks, compiled once (the hooks are part of the graph)."""
        if self._compiled is not None:
            return self._compiled
        events = self._events

        def hooks(path: str):
            def pre(module, args):
                events.append(("pre", path, [t.detach().clone() for t in _tensors(args)]))

            def post(module, args, output):
                events.append(("post", path, [t.detach().clone() for t in _tensors(output)]))

            return pre, post

        for path, module in self.submodules.items():
            if path:
                pre, post = hooks(path)
                module.register_forward_pre_hook(pre)
                module.register_forward_hook(post)
        self._compiled = self._compile(self.module)
        return self._compiled

    def capture(self, inputs: dict[str, np.ndarray]) -> TorchCapture:
        """One compiled forward; the calls rebuilt from the stashed events (pre and post in
        call order: a stack gives each call its parent)."""
        import torch

        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise ValueError(f"missing inputs: {', '.join(missing)}")
        compiled = self._hooked()
        self._events.clear()
        with torch.inference_mode():
            compiled(*[self._tensor(inputs[n]) for n in self.input_names])
        events = list(self._events)
        self._events.clear()
        capture = TorchCapture()
        counts: dict[str, int] = {}
        producer: dict[tuple, str] = {}  # a value's digest -> the leaf call that computed it
        stack: list[tuple[str, list[np.ndarray], list[str | None], str | None]] = []
        for kind, path, tensors in events:
            arrays = [_to_numpy(t) for t in tensors]
            if kind == "pre":
                index = counts.get(path, 0)
                counts[path] = index + 1
                parent = stack[-1][0] if stack else None
                stack.append((f"{path}#{index}", arrays,
                              [producer.get(_digest(a)) for a in arrays], parent))
                continue
            if not stack or stack[-1][0].rpartition("#")[0] != path:
                raise CaptureUnsupported(
                    f"{self.label}: the compiled graph replayed module hooks out of call order "
                    f"at {path}; its per-module tensors cannot be attributed")
            key, in_arrays, sources, parent = stack.pop()
            leaf = not self.has_children[path]
            identity = (len(in_arrays) == 1 and len(arrays) == 1
                        and in_arrays[0].shape == arrays[0].shape
                        and in_arrays[0].dtype == arrays[0].dtype
                        and np.array_equal(in_arrays[0], arrays[0], equal_nan=True))
            if leaf and not identity:
                for array in arrays:
                    producer[_digest(array)] = key
            name, _, number = key.rpartition("#")
            capture.calls.append(ModuleCall(
                name, int(number), type(self.submodules[path]).__name__, in_arrays, arrays,
                sources, parent, leaf=leaf, identity=identity, order=len(capture.calls)))
        return capture

    def run_module(self, path: str, inputs: list[np.ndarray],
                   substitutes: dict[str, list[list[np.ndarray]]] | None = None
                   ) -> list[np.ndarray]:
        """A leaf compiled on its own (hook-free copy, the same options) on given inputs."""
        import torch

        if self.has_children.get(path):
            raise CaptureUnsupported(
                f"{self.label}: a compiled container ({path}) is not re-run apart from its "
                "children; its leaves are isolated instead")
        leaf = self._leaves.get(path)
        if leaf is None:
            leaf = self._leaves[path] = self._compile(self._plain_modules[path])
        with torch.inference_mode():
            result = leaf(*[self._tensor(a) for a in inputs])
        return [_to_numpy(t) for t in _tensors(result)]

    def close(self) -> None:
        super().close()
        self._compiled = None
        self._leaves.clear()
        self._plain_modules.clear()
        self._plain = None


def torch_compile_side(spec, role: Role, config, threads: int = 1, run_path=None,
                       label: str = "torch_compile") -> CompiledTorchSide:
    """Tier 2's side for a torch_compile block (declared as its ``activations`` in
    guard/backends/torch.py): the module loaded as the backend loads it (eager_fp32_modules kept
    back as it serves them), compiled again with the stash hooks and the block's compile
    options."""
    import torch

    from guard.backends.options import TorchCompileOptions
    from guard.backends.torch import TorchCompileBackend

    backend = TorchCompileBackend(spec.model_copy(), role, threads)
    backend.load()  # compiles lazily: loading builds the module, not the kernels
    module = eager_module(backend.module, config.torch_factory, spec.context.base_dir, label)
    opts = TorchCompileOptions.model_validate(spec.options)
    options = {"mode": None if opts.mode == "default" else opts.mode,
               "backend": opts.compile_backend, "dynamic": opts.dynamic,
               "fullgraph": opts.fullgraph}
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(spec.precision)
    names = [s.name for s in backend.describe().inputs]
    return CompiledTorchSide(module, names, options, dtype=dtype, device=spec.device,
                             label=label)
