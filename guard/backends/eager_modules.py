"""``torch_compile`` ``options.eager_fp32_modules``: named submodules kept out of the compiled
graph and run eagerly in fp32.

Each named submodule is replaced, before the module is cast to the primary's precision and
compiled, by an :class:`EagerFp32` wrapper whose ``forward`` is ``torch.compiler.disable``-d (a
graph break: dynamo compiles what is before and after it, and calls it as plain Python). The
wrapper runs an fp32 copy of the submodule's original weights: floating inputs are cast to
fp32, floating outputs back to the dtype its inputs had, so the compiled graph around it sees
the tensors it would have seen without the wrapper. For an fp32 primary it only runs eagerly.

The fp32 copy is held outside the module tree (not a registered submodule), so the primary's
``module.to(float16)`` does not cast it; it is moved to the primary's device here instead.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils._pytree import tree_map

from guard.errors import BackendError


class EagerFp32(nn.Module):
    """Runs an fp32 copy of ``module`` eagerly, outside any compiled graph."""

    fp32: nn.Module  # (set past nn.Module's registration, below)

    def __init__(self, module: nn.Module, device: torch.device, dtype: torch.dtype | None):
        super().__init__()
        # Not registered: a dtype cast of the surrounding module must not reach it.
        object.__setattr__(self, "fp32", copy.deepcopy(module).float().to(device).eval())
        self.primary_dtype = dtype or torch.float32  # for a module fed no floating input

    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        dtype = next((t.dtype for t in _floating(args, kwargs)), self.primary_dtype)
        to_fp32 = lambda t: t.float() if _is_floating(t) else t  # noqa: E731
        result = self.fp32(*tree_map(to_fp32, args), **tree_map(to_fp32, kwargs))
        return tree_map(lambda t: t.to(dtype) if _is_floating(t) else t, result)


def _is_floating(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _floating(args, kwargs):
    leaves: list = []
    tree_map(leaves.append, (args, kwargs))
    return [t for t in leaves if _is_floating(t)]


def keep_eager_fp32(module: nn.Module, paths: list[str], device: torch.device,
                    dtype: torch.dtype | None = None) -> nn.Module:
    """Replace each submodule named in ``paths`` (``layers.0.attn``) by an :class:`EagerFp32`
    wrapper, in place (``dtype``: the primary's, for outputs of a submodule fed no floating
    input, e.g. an embedding). A path inside another listed path is covered by the outer one. An
    unknown path is a :class:`BackendError` naming it."""
    modules = dict(module.named_modules())
    unknown = [p for p in paths if not p or p not in modules]
    if unknown:
        raise BackendError(f"options.eager_fp32_modules: no submodule named "
                           f"{', '.join(repr(p) for p in unknown)} (a path such as "
                           "'layers.0.attn', from named_modules())")
    for path in outermost(paths):
        parent, _, attr = path.rpartition(".")
        setattr(modules[parent], attr, EagerFp32(modules[path], device, dtype))
    return module


def outermost(paths: list[str]) -> list[str]:
    """The paths with no listed ancestor, in the given order."""
    return [p for p in dict.fromkeys(paths)
            if not any(p.startswith(other + ".") for other in paths if other != p)]


def not_eager_fp32(module: nn.Module, paths: list[str]) -> list[str]:
    """Paths that ``module`` does not run eagerly in fp32: no :class:`EagerFp32` wrapper at the
    path or above it, or a wrapped copy with a parameter or buffer that is not fp32."""
    wrappers = {p: m for p, m in module.named_modules() if isinstance(m, EagerFp32)}
    missing = []
    for path in paths:
        owner = next((w for p, w in wrappers.items()
                      if path == p or path.startswith(p + ".")), None)
        tensors = [] if owner is None else [*owner.fp32.parameters(), *owner.fp32.buffers()]
        if owner is None or any(t.is_floating_point() and t.dtype != torch.float32
                                for t in tensors):
            missing.append(path)
    return missing
