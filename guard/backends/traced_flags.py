"""cuDNN flags that ``torch.jit.trace`` bakes into a TorchScript model's convolutions.

Eager ``conv2d`` reads cuDNN's switches (``torch.backends.cudnn.benchmark``, ``deterministic``,
``enabled``, ``allow_tf32``) from the process on every call. A trace records the call as
``aten::_convolution`` with the four values the *tracing* process had as constants, and at run
time ATen uses those constants, not the running process's switches. torch's default for cuDNN
TF32 is on, so a model traced with the defaults runs every convolution in TF32 on an Ampere or
later GPU, whatever the serving process sets: in Triton's libtorch backend, in any
``torch.jit.load``, and in guard's torch backend before this module. Measured on an H200
(benchmarks/results/gpu_trace_calls.md): the zoo's ResNet traced with the defaults is 7e-3 from
the CPU on its logits with TF32 off in the process; traced with TF32 off, 3e-5, as the eager
module; the detector drops a box.

On the CPU the constants change nothing (its convolutions have no TF32 and no cuDNN).

Rewriting goes through TorchScript's graph API and a save/load round trip: a loaded module
caches the graphs its methods compile on first use (``inlined_graph``, the executor's plan), and
a fresh load from the rewritten bytes has nothing cached.
"""

from __future__ import annotations

import contextlib
import io
from typing import NamedTuple

CONVOLUTION = "aten::_convolution"
# aten::_convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding,
# groups, benchmark, deterministic, cudnn_enabled, allow_tf32): the four flags' positions.
_FLAG_INPUTS = range(9, 13)


class ConvFlags(NamedTuple):
    benchmark: bool
    deterministic: bool
    cudnn_enabled: bool
    allow_tf32: bool

    @classmethod
    def of_process(cls) -> ConvFlags:
        """What eager ``conv2d`` would pass in this process now (ATen's ``convolution``)."""
        import torch

        cudnn = torch.backends.cudnn
        return cls(bool(cudnn.benchmark),
                   bool(cudnn.deterministic or torch.are_deterministic_algorithms_enabled()),
                   bool(cudnn.enabled), bool(cudnn.allow_tf32))

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self._asdict().items())


# What torch.jit.trace bakes in a process that never touched the switches.
TORCH_DEFAULTS = ConvFlags(benchmark=False, deterministic=False, cudnn_enabled=True,
                           allow_tf32=True)


@contextlib.contextmanager
def tracing_flags(flags: ConvFlags):
    """The process's cuDNN switches (and torch's deterministic-algorithms switch, which counts as
    cuDNN's deterministic) set to ``flags`` for a trace, then put back: a trace made inside
    bakes ``flags`` whatever the process had set before (a reference's pin, say)."""
    import torch

    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(flags.deterministic, warn_only=True)
    try:
        with torch.backends.cudnn.flags(enabled=flags.cudnn_enabled, benchmark=flags.benchmark,
                                        deterministic=flags.deterministic,
                                        allow_tf32=flags.allow_tf32):
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _graphs(module):
    """The graph of every method of the module and its submodules (shared, not copies)."""
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if graph is not None:
            yield graph


def _node_flags(node) -> ConvFlags:
    inputs = list(node.inputs())
    return ConvFlags(*(bool(inputs[i].toIValue()) for i in _FLAG_INPUTS))


def traced_conv_flags(module) -> list[ConvFlags]:
    """The flags of each traced convolution, in graph order; [] for a model without any (or a
    scripted one whose convolutions call ``conv2d``, which reads the process's flags)."""
    return [_node_flags(node) for graph in _graphs(module)
            for node in graph.findAllNodes(CONVOLUTION)]


def with_conv_flags(module, flags: ConvFlags):
    """``module`` with every traced convolution's flags set to ``flags``, and how many changed.
    A new module (loaded from the rewritten bytes) when any did; ``module`` as it was when none
    did. ``module`` must not have run yet (see the module's docstring)."""
    import torch

    changed = 0
    for graph in _graphs(module):
        for node in graph.findAllNodes(CONVOLUTION):
            if _node_flags(node) == flags:
                continue
            for position, value in zip(_FLAG_INPUTS, flags):
                constant = graph.insertConstant(value)
                constant.node().moveBefore(node)
                node.replaceInput(position, constant)
            changed += 1
    if not changed:
        return module, 0
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)
    buffer.seek(0)
    return torch.jit.load(buffer, map_location="cpu"), changed
