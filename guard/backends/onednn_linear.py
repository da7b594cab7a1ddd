"""``options.onednn_linear`` (``transformers``; ``torch`` references): a CPU reference's linear
layers run by oneDNN.

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

The ``torch`` backend's references come in three kinds, each rewritten its way by
:func:`use_onednn`: a factory's ``nn.Module`` as above; a ``torch.export`` program's module
(an FX graph: each ``aten.linear`` on a weight it holds becomes the oneDNN op on a reordered
copy); a TorchScript module, frozen (``torch.jit.freeze``: its weights become the graph's
constants) and each ``aten::linear`` on a constant weight replaced in the graph the same way
(a frozen module runs as before but cannot be saved again: guard never saves it).

Only for a CPU model held in fp32 with a torch built with oneDNN (:func:`unusable` says why
not otherwise). Tier 2's copy of the model keeps torch's modules: it hooks and re-runs them
(guard/backends/activations/transformers.py, torch.py).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

_log = logging.getLogger(__name__)


# Linear layers with fewer weights than this keep torch's kernels: oneDNN's call costs about
# 11 us on one core whatever the size, MKL's 3.5 us, and below this a product is too small to
# win that back at any row count (32 x 64 and 128 x 10 ran 0.3-0.6x as fast as MKL at 1-64
# rows; 576 x 576 at 0.8x for one row, 2x from eight; 4096 x 4096 at 1.8-2.9x).
MIN_WEIGHTS = 1 << 16


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


def for_reference(module, device: str, dtype: torch.dtype, what: str):
    """``module`` as a reference runs it where ``options.onednn_linear`` is on: (the module to
    run, how many linear layers oneDNN runs), or (``module``, None) where it cannot (said at
    debug level, naming ``what``)."""
    why_not = unusable(device, dtype)
    if why_not is not None:
        _log.debug("%s: torch's linear kernels: %s", what, why_not)
        return module, None
    return use_onednn(module)


def with_torch_kernels(spec):
    """A copy of a backend block with ``options.onednn_linear`` off: tier 2's copy of a model
    hooks and re-runs torch's own modules (the copy keeps ``spec.context``)."""
    return spec.model_copy(update={"options": {**spec.options, "onednn_linear": False}})


def use_onednn_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` (of at least MIN_WEIGHTS weights) by an
    :class:`OneDnnLinear` in place; returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.numel() >= MIN_WEIGHTS:
                setattr(parent, name, OneDnnLinear(child))
                replaced += 1
    return replaced


def use_onednn(module):
    """``module`` (an ``nn.Module``, a ``torch.export`` program's FX module, or a TorchScript
    module) with its fp32 linear products run by oneDNN: (the module to run, how many were
    replaced). A TorchScript module comes back frozen where any were replaced, else as it
    was."""
    if isinstance(module, torch.jit.ScriptModule):
        return _script_linears(module)
    if isinstance(module, torch.fx.GraphModule):
        return module, _graph_linears(module)
    return module, use_onednn_linears(module)


def _packable(weight) -> bool:
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and \
        weight.device.type == "cpu" and weight.dim() == 2 and not weight.is_mkldnn and \
        weight.numel() >= MIN_WEIGHTS


def _graph_linears(module: torch.fx.GraphModule) -> int:
    """Each ``aten.linear`` of an FX module whose weight is one of its attributes runs
    inductor's oneDNN op on a reordered copy; the attribute goes where nothing else reads it."""
    if not _pointwise_works():
        return 0
    graph, replaced = module.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        x, weight, *rest = node.args
        bias = rest[0] if rest else node.kwargs.get("bias")
        if not (isinstance(weight, torch.fx.Node) and weight.op == "get_attr") or \
                not _packable(held := _attribute(module, str(weight.target))):
            continue
        name = f"_onednn_weight_{replaced}"
        module.register_buffer(name, torch.ops.mkldnn._reorder_linear_weight(
            held.detach(), None))
        with graph.inserting_before(node):
            packed = graph.get_attr(name)
            product = graph.call_function(torch.ops.mkldnn._linear_pointwise.default,
                                          (x, packed, bias, "none", [], ""))
        node.replace_all_uses_with(product)
        graph.erase_node(node)
        if not weight.users:  # the dense weight, read by nothing else now
            graph.erase_node(weight)
            owner, _, leaf = str(weight.target).rpartition(".")
            delattr(module.get_submodule(owner) if owner else module, leaf)
        replaced += 1
    if replaced:
        graph.lint()
        module.recompile()
    return replaced


def _attribute(module: nn.Module, target: str):
    owner, _, leaf = target.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, leaf, None)


def _script_linears(module: torch.jit.ScriptModule):
    """A frozen copy of a TorchScript module with each ``aten::linear`` on a constant weight
    replaced by inductor's oneDNN op on a reordered constant (or the module as it was, where
    none is)."""
    if not _pointwise_works():
        return module, 0
    frozen = torch.jit.freeze(module.eval())
    graph, replaced = frozen.graph, 0
    for node in list(graph.findAllNodes("aten::linear")):
        weight = node.inputsAt(1).node()
        if weight.kind() != "prim::Constant" or not _packable(weight.output().toIValue()):
            continue
        with graph.insert_point_guard(node):
            packed = graph.create("prim::Constant")
            packed.t_("value", torch.ops.mkldnn._reorder_linear_weight(
                weight.output().toIValue(), None))
            packed.output().setType(torch._C.TensorType.get())
            graph.insertNode(packed)
            scalars = graph.insertNode(graph.create("prim::ListConstruct"))
            scalars.output().setType(torch._C.ListType(torch._C.OptionalType(
                torch._C.NumberType.get())))
            product = graph.create("mkldnn::_linear_pointwise", [
                node.inputsAt(0), packed.output(), node.inputsAt(2),
                graph.insertConstant("none"), scalars.output(), graph.insertConstant("")])
            graph.insertNode(product)
            product.output().setType(node.output().type())
        node.output().replaceAllUsesWith(product.output())
        node.destroy()
        replaced += 1
    if not replaced:
        return module, 0
    torch._C._jit_pass_dce(graph)  # the dense weights' constants
    torch._C._jit_pass_lint(graph)
    return frozen, replaced

