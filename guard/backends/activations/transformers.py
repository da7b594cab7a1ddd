"""A ``transformers`` causal LM's activations for tier 2: the torch side of a GGUF pair.

The model is loaded as the ``transformers`` scorer loads it (an HF folder, or a GGUF dequantized),
privately, with the KV cache off (a module re-run must not append to one), and captured as every
torch module is (forward hooks, guard/backends/activations/torch.py). Beside each call's
positional inputs it keeps the call's own arguments as torch passed them, keywords included (a
decoder layer gets its rotary embeddings and attention mask as keywords): tier 2 re-runs a module
on the other side's tensors with everything else as the forward gave it (``run_call``), since
the other side (llama.cpp) can only be observed (guard/verify/activation/gguf_align.py).
"""

from __future__ import annotations

import numpy as np

from guard.backends.activations.torch import TorchCapture, TorchSide, _tensors, _to_numpy
from guard.backends.base import Role


class TransformersSide(TorchSide):
    """A ``TorchSide`` over an HF causal LM, fed ``input_ids``; it remembers each call's
    arguments (``path#index`` -> (args, kwargs)) from its latest capture."""

    kind = "transformers"

    def __init__(self, module, label: str = "transformers"):
        module.config.use_cache = False
        super().__init__(module, ["input_ids"], label=label)
        self.arguments: dict[str, tuple[tuple, dict]] = {}

    def capture(self, inputs: dict[str, np.ndarray]) -> TorchCapture:
        counts: dict[str, int] = {}
        arguments: dict[str, tuple[tuple, dict]] = {}

        def remember(module, args, kwargs):
            path = self.paths.get(module)
            if path is not None:
                index = counts.get(path, 0)
                counts[path] = index + 1
                arguments[f"{path}#{index}"] = (args, kwargs)

        handles = [m.register_forward_pre_hook(remember, with_kwargs=True) for m in self.paths]
        try:
            capture = super().capture(inputs)
        finally:
            for handle in handles:
                handle.remove()
        self.arguments = arguments
        return capture

    def run_call(self, key: str, hidden: np.ndarray | None = None,
                 replace: dict[str, np.ndarray] | None = None,
                 read_input_of: str | None = None) -> np.ndarray:
        """Re-run module call ``key`` (``path#index``) of the latest capture with its own
        arguments, its hidden-state input (the first tensor argument, positional or
        ``hidden_states``) set to ``hidden``; the submodules in ``replace`` (by path) return the
        given tensor instead of computing (a tuple output keeps its other items). Returns the
        call's first output, or the first input submodule ``read_input_of`` received."""
        import torch

        recorded_args, recorded_kwargs = self.arguments[key]
        args, kwargs = list(recorded_args), dict(recorded_kwargs)
        if hidden is not None:
            tensor = self._tensor(hidden)
            if args and isinstance(args[0], torch.Tensor):
                args[0] = tensor.to(args[0].dtype)
            elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
                kwargs["hidden_states"] = tensor.to(kwargs["hidden_states"].dtype)
            else:
                raise ValueError(f"{key}: no hidden-state argument to feed")
        handles = []
        read: list = []
        substitutes = replace or {}

        def substitute(module, _args, output):
            value = self._tensor(substitutes[self.paths[module]])
            if isinstance(output, tuple):
                return (value.to(output[0].dtype), *output[1:])
            return value.to(output.dtype)

        def reader(_module, module_args, module_kwargs):
            found = _tensors(module_args) or _tensors(module_kwargs)
            if found and not read:
                read.append(_to_numpy(found[0]))

        try:
            for path in substitutes:
                handles.append(self.submodules[path].register_forward_hook(substitute))
            if read_input_of is not None:
                handles.append(self.submodules[read_input_of].register_forward_pre_hook(
                    reader, with_kwargs=True))
            path = key.rpartition("#")[0]
            with torch.inference_mode():
                output = self.submodules[path](*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        if read_input_of is not None:
            if not read:
                raise RuntimeError(f"{key}: {read_input_of} was not called")
            return read[0]
        return _to_numpy(_tensors(output)[0])

    def close(self) -> None:
        self.arguments = {}
        super().close()


def transformers_side(spec, role: Role, config, threads: int = 1, run_path=None,
                      label: str = "transformers") -> TransformersSide:
    """Tier 2's side for a ``transformers`` block (declared as its ``activations`` in
    guard/backends/transformers.py): the model loaded as the scorer loads it, a copy of its
    own, with torch's own linear modules (which it hooks and re-runs: not
    ``options.onednn_linear``'s)."""
    from guard.backends.onednn_linear import with_torch_kernels
    from guard.backends.transformers import TransformersScorer

    scorer = TransformersScorer(with_torch_kernels(spec), role, threads)
    scorer.load()
    return TransformersSide(scorer.model, label=label)
