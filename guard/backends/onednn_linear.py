"""``transformers`` ``options.onednn_linear``: a CPU reference's linear layers run by oneDNN.

Why: a teacher-forced pass is nearly all matrix products (88% of SmolLM2-135M's fp32 pass on
one core is ``aten::mm``), and torch's CPU wheel hands fp32 ``mm`` to MKL, which on AMD CPUs
takes its AVX2 path whatever the CPU has: about 100 GFLOP/s on one core of an AVX-512 EPYC,
where oneDNN (which torch also ships, and which picks its kernels by the CPU's features, not
its vendor) runs the same products at 157-221 GFLOP/s. Same fp32 arithmetic, another summation
order: the reference's log-probabilities move by ~1e-4 nats at most over 30 layers, never its
best token (benchmarks/results/llm_ladder.md has the pass's cost both ways).

How: each ``torch.nn.Linear`` of the model (the exact class, not subclasses, which may do more)
is replaced by :class:`OneDnnLinear`, which holds its weight once, reordered into oneDNN's
blocked layout, and runs the product on the dense activations as they are:
``torch.ops.mkldnn._linear_pointwise`` on a weight from ``_reorder_linear_weight``, the pair
torch's own compiler (inductor) emits for a CPU linear. Those ops are torch's internals: where a
torch lacks them or they disagree with ``F.linear`` on a small product (checked once per
process), the public ``torch._C._nn.mkldnn_linear`` runs instead (``torch.utils.mkldnn.
MkldnnLinear``'s kernel, which converts the activations to oneDNN's layout and back on every
call: 10-15% of the pass, and the LM head's product ~1.8x slower). ``MkldnnLinear`` itself is a
``ScriptModule``, on which forward hooks are refused; this is a plain ``nn.Module`` with the
same path in ``named_modules()``.
Memory: the dense weight is released with the replaced module, except where it is shared (a
tied LM head keeps the embedding's): that copy is held twice (SmolLM2-135M: +113 MB).

Only for a CPU model held in fp32 with a torch built with oneDNN (:func:`unusable` says why
not otherwise). Tier 2's copy of the model keeps torch's modules: it hooks and re-runs them
(guard/backends/activations/transformers.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


class OneDnnLinear(nn.Module):
    """``y = x W^T + b`` for an fp32 CPU tensor of any leading shape, by oneDNN."""

    packed_weight: torch.Tensor  # (buffers, registered below)
    packed_bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
        self.pointwise = _pointwise_works()
        # Buffers, not parameters: nothing trains them, and optimizers must not see them.
        if self.pointwise:
            self.register_buffer("packed_weight",
                                 torch.ops.mkldnn._reorder_linear_weight(weight, None))
            self.register_buffer("packed_bias", bias)
        else:
            self.register_buffer("packed_weight", weight.to_mkldnn())
            self.register_buffer("packed_bias", None if bias is None else bias.to_mkldnn())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pointwise:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.packed_bias,
                                                      "none", [], "")
        leading = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).contiguous().to_mkldnn()
        y = torch._C._nn.mkldnn_linear(flat, self.packed_weight, self.packed_bias)
        return y.to_dense().reshape(*leading, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.packed_bias is not None}, pointwise={self.pointwise}"


@functools.lru_cache(maxsize=1)
def _pointwise_works() -> bool:
    """Whether this torch has inductor's oneDNN linear ops and they compute ``F.linear`` (a
    3-D input, a strided view, a bias)."""
    try:
        generator = torch.Generator().manual_seed(0)
        weight, bias = torch.randn(6, 5, generator=generator), torch.randn(6, generator=generator)
        x = torch.randn(2, 7, 5, generator=generator)[:, ::2]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return bool(torch.allclose(got, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5))
    except (AttributeError, RuntimeError, TypeError):
        return False


def unusable(device: str, dtype: torch.dtype) -> str | None:
    """Why oneDNN's linear cannot run this model (None: it can)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch is built without oneDNN"
    if torch.device(device).type != "cpu":
        return f"device {device} (oneDNN's linear is the CPU's)"
    if dtype != torch.float32:
        return f"precision {dtype} (only fp32 is run by oneDNN here)"
    return None


def use_onednn_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` by an :class:`OneDnnLinear` in place; returns
    how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, OneDnnLinear(child))
                replaced += 1
    return replaced
