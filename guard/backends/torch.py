"""PyTorch backends: eager (``torch``) and ``torch_compile``.

Artifacts:
- ``.pt``: TorchScript (``torch.jit.save``). An extra file ``guard.json`` saved inside it
  (``_extra_files={"guard.json": ...}``) may carry the input/output names, datatypes and shapes.
- ``.pt2``: a ``torch.export`` program (``torch.export.save``), same optional extra file. Its
  loader can unpickle, so it loads only when pinned by ``sha256`` (guard/backends/artifact.py).
- Either file is read once, checked against its ``sha256`` when pinned, and loaded from those
  bytes.
- ``package.module:factory``: a Python callable returning an ``nn.Module``; the config file's
  folder is importable (appended to ``sys.path``), and ``options.kwargs`` are passed to the
  factory. The module may carry ``guard_signature`` (the ``guard.json`` dict) as an attribute.
  A factory is code, not an artifact: ``sha256`` does not apply to it (a config error).

Names: ``options.input_names``/``output_names`` win, then ``guard.json``, then forward()'s
parameter names and ``output0``, ``output1``... Outputs may be a tensor, a tuple/list or a dict,
nested: each leaf becomes one named output (``boxes``, ``aux.0``), so every output is compared.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from guard.backends.artifact import import_factory, read_artifact, require_pin
from guard.backends.base import Backend, BackendInfo, Role, TensorSpec, require_cuda
from guard.backends.determinism import pin_compiler, pin_torch_reference
from guard.backends.options import TorchCompileOptions, TorchOptions
from guard.backends.kind import BackendKind, Unsupported
from guard.errors import BackendError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

    from guard.config import BackendConfig

SIGNATURE_FILE = "guard.json"
_FACTORY_CALLS = threading.Lock()


def signature_json(inputs: list[TensorSpec], outputs: list[TensorSpec]) -> str:
    """The ``guard.json`` payload that zoo models save inside their TorchScript/.pt2 files."""

    def spec(s: TensorSpec) -> dict[str, Any]:
        return {"name": s.name, "datatype": s.datatype, "shape": list(s.shape)}

    return json.dumps({"inputs": [spec(s) for s in inputs], "outputs": [spec(s) for s in outputs]})


def _parse_signature(data: dict[str, Any] | None) -> tuple[tuple[TensorSpec, ...], ...]:
    if not data:
        return (), ()
    make = lambda items: tuple(  # noqa: E731
        TensorSpec(i["name"], i.get("datatype", ""), tuple(i.get("shape", ()))) for i in items
    )
    return make(data.get("inputs", [])), make(data.get("outputs", []))


def _flatten(value: Any, prefix: str, names: list[str] | None, out: dict[str, Any]) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        out[prefix or (names[0] if names else "output0")] = value
    elif isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), None, out)
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            if not prefix and names and len(names) == len(value):
                name = names[i]
            else:
                name = f"{prefix}.{i}" if prefix else f"output{i}"
            _flatten(item, name, None, out)
    elif value is None:
        return
    else:
        raise BackendError(f"model returned a {type(value).__name__}, not tensors")


class TorchBackend(Backend):
    name = "torch"
    options_model = TorchOptions
    follows_process_flags = False  # a truth (the fp64 twin) runs as this process says
    # A reference's linear layers may run by oneDNN (options.onednn_linear): not where
    # inductor picks the kernels (torch_compile) or the model runs in fp64 (the twin).
    ONEDNN_REFERENCE = True

    def __init__(self, spec: BackendConfig, role: Role, threads: int = 1):
        self.spec = spec
        self.role = role
        self.options = self.options_model.model_validate(spec.options)
        self.reference_threads = threads
        # Once loaded: the module (a factory's, TorchScript's or an exported program's), what
        # infer calls (it, or torch.compile's wrapper) and the dtype inputs are cast to.
        self.module: Any = None
        self._callable: Any = None
        self._details: dict[str, str] = {}  # describe()'s: what load found worth reporting
        self._dtype: torch.dtype | None = None

    # -- loading -----------------------------------------------------------------------------
    def _load_module(self):
        import torch

        path = self.spec.artifact_path
        if self.spec.is_factory:
            try:
                factory = import_factory(path, self.spec.context.base_dir)
            except (ImportError, AttributeError) as exc:
                raise BackendError(f"cannot import factory '{path}': {exc}") from exc
            # One factory call at a time in the process: a model's backends load on parallel
            # threads, and a factory that seeds torch's global generator and then initialises
            # weights would otherwise interleave with another's and build different models.
            with _FACTORY_CALLS:
                module = factory(**self.options.kwargs)
            signature = getattr(module, "guard_signature", None)
            return module, signature
        exported = Path(path).suffix == ".pt2"
        if exported:
            require_pin(path, self.spec.sha256)
        # Read once, hash, and load from those bytes: the file is never opened again.
        data, _ = read_artifact(path, self.spec.sha256)
        files = {SIGNATURE_FILE: ""}
        try:
            if exported:
                module = torch.export.load(io.BytesIO(data), extra_files=files).module()
            else:
                module = torch.jit.load(io.BytesIO(data), map_location="cpu",
                                        _extra_files=files)
        except Exception as exc:
            raise BackendError(f"torch cannot load {path}: {exc}") from exc
        raw = files.get(SIGNATURE_FILE) or ""
        if isinstance(raw, bytes):
            raw = raw.decode()
        return module, (json.loads(raw) if raw else None)

    def load(self) -> None:
        import torch

        if self.role == "reference":
            pin_torch_reference(self.options.threads or self.reference_threads)
        elif self.options.threads:
            torch.set_num_threads(self.options.threads)
        require_cuda(self.spec.device)
        if self.spec.device.startswith("cuda"):
            if self.role != "reference":
                # Set both ways: the switch is process-wide and an earlier backend may have
                # turned it on (the matrix loads TF32-on and TF32-off backends in turn).
                torch.backends.cuda.matmul.allow_tf32 = self.options.allow_tf32
                torch.backends.cudnn.allow_tf32 = self.options.allow_tf32
        module, signature = self._load_module()
        if self.spec.device.startswith("cuda") and isinstance(module, torch.jit.ScriptModule):
            module = self._settle_conv_flags(module)
        self._dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.spec.precision)
        device = torch.device(self.spec.device)
        module = self._keep_back(module, device)  # before the cast: fp32 copies of the originals
        # An exported program's module is frozen (no eval(), no .to()): it was exported in eval
        # mode, on its device and dtype, and runs as it was exported.
        if not str(self.spec.path).endswith(".pt2"):
            module.eval()
            if self._dtype is not None:
                module = module.to(self._dtype)
            module = module.to(device)
        if self.ONEDNN_REFERENCE and self.role == "reference" and self.options.onednn_linear:
            from guard.backends.onednn_linear import for_reference

            module, replaced = for_reference(module, self.spec.device,
                                             self._dtype or torch.float32,
                                             f"torch reference {self.spec.path}")
            if replaced is not None:
                self._details["linear_kernels"] = f"onednn, linear layers: {replaced}"
        self.device = device
        self.module = module
        inputs, outputs = _parse_signature(signature)
        input_names = self.options.input_names or [s.name for s in inputs] or self._forward_names()
        if inputs and [s.name for s in inputs] != input_names:
            inputs = ()
        self._inputs = inputs or tuple(TensorSpec(n) for n in input_names)
        self._output_names = self.options.output_names or [s.name for s in outputs] or None
        self._outputs = outputs or tuple(TensorSpec(n) for n in (self._output_names or []))
        self._callable = self._wrap(module)

    def _settle_conv_flags(self, module):
        """A trace's convolutions carry the tracing process's cuDNN flags, TF32 on by torch's
        default (guard/backends/traced_flags.py). A reference, and a primary or fallback with
        ``traced_conv_flags: process``, gets them rewritten to this process's; otherwise they
        run as traced, said once in the log and in describe()."""
        from guard.backends.traced_flags import ConvFlags, traced_conv_flags, with_conv_flags

        baked = traced_conv_flags(module)
        if not baked:
            return module
        process = ConvFlags.of_process()
        if (self.role == "reference" or self.follows_process_flags
                or self.options.traced_conv_flags == "process"):
            module, changed = with_conv_flags(module, process)
            self._details["traced_conv_flags"] = (
                f"process: {changed} of {len(baked)} traced convolutions rewritten to "
                f"{process.describe()}")
            return module
        tf32 = sum(flags.allow_tf32 for flags in baked)
        self._details["traced_conv_flags"] = (
            f"as traced: allow_tf32=True on {tf32} of {len(baked)} convolutions")
        if tf32 and not process.allow_tf32:
            log.warning(
                "%s (%s): %d of %d convolutions were traced with cuDNN allow_tf32=True and run "
                "in TF32 on this GPU although allow_tf32 is off (torch.jit.trace records the "
                "tracing process's cuDNN flags; Triton's libtorch backend runs them so too); "
                "options.traced_conv_flags: process runs them as allow_tf32 says",
                self.role, self.spec.path, tf32, len(baked))
        return module

    def _forward_names(self) -> list[str]:
        forward = getattr(self.module, "forward", self.module)
        schema = getattr(forward, "schema", None)  # TorchScript
        if schema is not None:
            return [a.name for a in schema.arguments[1:]]
        params = inspect.signature(forward).parameters.values()
        return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def _keep_back(self, module, device):
        """Submodules the options keep out of the primary's precision (torch_compile)."""
        return module

    def _wrap(self, module):
        return module

    # -- inference ---------------------------------------------------------------------------
    def _to_torch(self, array: np.ndarray):
        import torch

        if not array.flags.writeable:
            array = array.copy()  # torch.from_numpy wants writable memory
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            # Pinned host memory lets the copy run asynchronously; one copy per input.
            tensor = tensor.pin_memory().to(self.device, non_blocking=True)
        if self._dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self._dtype)
        # Only calls that do something (see _to_numpy); CUDA inputs were moved above, and
        # "cuda" vs "cuda:0" would read as a difference.
        if tensor.device.type != self.device.type:
            tensor = tensor.to(self.device)
        return tensor

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        missing = [n for n in (s.name for s in self._inputs) if n not in inputs]
        if missing:
            raise BackendError(f"missing inputs: {', '.join(missing)}")
        args = [self._to_torch(inputs[s.name]) for s in self._inputs]
        with torch.inference_mode():
            result = self._callable(*args)
        flat: dict[str, Any] = {}
        _flatten(result, "", self._output_names, flat)
        out = {}
        for name, tensor in flat.items():
            if self._dtype is not None and tensor.dtype == self._dtype:
                tensor = tensor.float()  # reduced precision inside, fp32 at the boundary
            out[name] = _to_numpy(tensor)
        return out

    def describe(self) -> BackendInfo:
        return BackendInfo(
            backend=self.name,
            artifact=str(self.spec.path),
            precision=self.spec.precision,
            device=self.spec.device,
            inputs=self._inputs,
            outputs=self._outputs,
            details=dict(self._details),
        )

    def close(self) -> None:
        self.module = None
        self._callable = None


class TorchCompileBackend(TorchBackend):
    """``torch.compile`` of the same module. Compiles lazily on the first call; the first call
    is serialised so that concurrent requests do not compile twice. Submodules named in
    ``options.eager_fp32_modules`` run eagerly in fp32 (guard/backends/eager_modules.py)."""

    name = "torch_compile"
    options_model = TorchCompileOptions
    ONEDNN_REFERENCE = False
    options: TorchCompileOptions  # (what options_model validates)

    def _keep_back(self, module, device):
        paths = self.options.eager_fp32_modules
        if not paths:
            return module
        from guard.backends.eager_modules import keep_eager_fp32

        return keep_eager_fp32(module, paths, device, self._dtype)

    def _wrap(self, module):
        import torch

        opts = self.options
        compiled = torch.compile(
            module,
            mode=None if opts.mode == "default" else opts.mode,
            backend=opts.compile_backend,
            dynamic=opts.dynamic,
            fullgraph=opts.fullgraph,
        )
        first_call = threading.Lock()
        warmed = threading.Event()

        def call(*args):
            if warmed.is_set():
                return compiled(*args)
            with first_call:
                pin_compiler()  # a reference may have pinned determinism since _wrap
                result = compiled(*args)
                warmed.set()
                return result

        return call


def _to_numpy(tensor) -> np.ndarray:
    """A host array of an output, with no tensor call that would do nothing. Each tensor call
    from Python gives the interpreter lock up and takes it back, and the taking back waits
    while another thread holds the lock: replay's reference made 8 such round trips per
    forward (``.detach()`` in inference mode, ``.cpu()`` and ``.to()`` on CPU tensors), now 2
    (the forward's own); with the collector's pauses (guard/collector.py), such waits had cost
    it 45-60 us per row of its 220."""
    if tensor.requires_grad:  # a parameter returned as is (made outside inference mode)
        tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()  # synchronises with the device
    return tensor.numpy()


class Fp64TorchBackend(TorchBackend):
    """The fp64 arbiter's truth: the block's module converted with ``.double()`` (inputs cast to
    float64 too); outputs stay float64."""

    follows_process_flags = True
    ONEDNN_REFERENCE = False

    def load(self) -> None:
        import torch

        super().load()
        self.module = self.module.double()
        self._callable = self.module
        self._dtype = torch.float64

    def infer(self, inputs):
        import torch

        args = [self._to_torch(inputs[s.name]) for s in self._inputs]
        with torch.inference_mode():
            result = self._callable(*args)
        flat: dict = {}
        _flatten(result, "", self._output_names, flat)
        return {k: _to_numpy(v) for k, v in flat.items()}


def fp64_twin(spec: "BackendConfig") -> Backend:
    """``BackendKind.fp64``: the block's model in float64 (built, not loaded)."""
    if str(spec.path).endswith(".pt2"):
        raise Unsupported("a torch.export program (.pt2) runs as exported: no fp64 run")
    twin = spec.model_copy(update={"precision": "fp32", "backend": "torch"})
    return Fp64TorchBackend(twin, "primary")


@contextlib.contextmanager
def _in_threads(backend: Backend, threads: int):
    """``BackendKind.in_threads``: torch's thread count is process-wide, so the built backend is
    rerun with it changed and restored after (the noise floor does this at load, before the
    model serves)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _check(spec) -> None:
    if spec.backend == "torch_compile" and spec.path.endswith(".pt"):
        raise ValueError("torch_compile cannot compile a TorchScript (.pt) module: give it "
                         "a torch.export program (.pt2) or a 'module:factory'")
    if spec.path.endswith(".pt2") and spec.precision != "fp32":
        raise ValueError("a torch.export program (.pt2) runs as it was exported: "
                         "precision must be fp32 (export it in the precision you want)")


def _check_model(model) -> None:
    """Checks of a model block with a torch backend in it."""
    ref, primary = model.reference, model.primary
    if model.policy.uses("fallback_ops") and primary.backend == "torch_compile":
        if ref.backend != "torch":
            raise ValueError(
                "policy.action 'fallback_ops' on a torch_compile primary names modules "
                "by tier 2's torch module calls: reference.backend must be torch, "
                f"not {ref.backend}")
        if primary.options.get("fullgraph"):
            raise ValueError(
                "policy.action 'fallback_ops' keeps modules eager (a graph break "
                "each): primary.options.fullgraph must be false")
    if ref is not None and ref.backend in KINDS and ref.device != "cpu":
        for role in ("primary", "fallback"):
            spec = getattr(model, role)
            if spec is not None and spec.options.get("allow_tf32"):
                raise ValueError(
                    f"{role}.options.allow_tf32 cannot hold beside a torch reference on "
                    f"{ref.device}: torch's TF32 switch is process-wide and the reference "
                    "pins it off (run the reference on cpu)")


def _eager_copy(spec: "BackendConfig") -> "BackendConfig":
    """``BackendKind.capture_as`` of torch_compile: the op repair captures an eager ``torch``
    copy of the module at the same precision (it locates precision drift; tier 2's own check
    captures the compiled code, guard/backends/activations/compiled.py)."""
    copy = spec.model_copy(deep=True)
    copy.backend = "torch"
    copy.options = {k: v for k, v in spec.options.items() if k in TorchOptions.model_fields}
    return copy


_TORCH_FORMATS = frozenset({"torchscript", "torch_export", "factory"})
KINDS = {
    "torch": BackendKind(
        name="torch", extra="torch", backend=TorchBackend, options=TorchOptions,
        precisions=frozenset({"fp32", "fp16", "bf16"}), formats=_TORCH_FORMATS,
        check=_check, check_model=_check_model, fp64=fp64_twin, threaded=True,
        in_threads=_in_threads, activations="guard.backends.activations.torch:torch_side",
    ),
    # Captured through hooks compiled into its graph, and only beside a torch side: their
    # calls align by module path; against an ONNX graph the exporter's folds are told from
    # tensor identities, which the compiled capture's clones lack. The op repair captures an
    # eager copy instead (capture_as).
    "torch_compile": BackendKind(
        name="torch_compile", extra="torch",
        backend=TorchCompileBackend, options=TorchCompileOptions,
        precisions=frozenset({"fp32", "fp16", "bf16"}),
        activations="guard.backends.activations.compiled:torch_compile_side",
        activations_beside=frozenset({"torch", "torch_compile"}),
        beside_why="its compiled capture aligns by module path",
        formats=frozenset({"torch_export", "factory"}), capture_as=_eager_copy,
        check=_check, check_model=_check_model, fp64=fp64_twin, threaded=True,
        in_threads=_in_threads,
    ),
}
