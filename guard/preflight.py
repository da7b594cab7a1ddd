"""``guard config validate --load``: what ``guard serve`` would do at load, without serving.

Per model: every side (primary, reference, fallback) is built and loaded as the serving process
and the verifier load them (derivations included), the reference's outputs are matched to the
primary's (guard/backends/signature_match.py), and a fallback must take the primary's inputs
and give its outputs (guard/backends/signatures.py).
What would fail at serve fails here, one line per model: a ``tensorrt`` side on a machine
without CUDA, a ``torch`` side pointed at an ``.onnx`` file, outputs that cannot be matched.
Every side is closed after; nothing listens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from guard.config import GuardConfig, ModelConfig
from guard.errors import BackendError

# An artifact whose suffix says which backend reads it: the hint a load error gets when a side
# names another backend (torch.jit.load's own message on an .onnx file says nothing of it).
_READERS = {".onnx": ("onnxruntime", "openvino", "tensorrt"), ".pt": ("torch", "torch_compile"),
            ".pt2": ("torch", "torch_compile"), ".keras": ("keras", "onnxruntime"),
            ".tflite": ("litert",), ".xml": ("openvino",)}


@dataclass
class ModelReport:
    name: str
    sides: dict[str, str] = field(default_factory=dict)  # role -> BackendInfo.summary()
    renamed: dict[str, str] = field(default_factory=dict)  # reference output -> primary output
    error: str = ""

    def line(self) -> str:
        if self.error:
            return self.error
        sides = "; ".join(f"{role} {summary}" for role, summary in self.sides.items())
        matched = ("; outputs matched by position (reference -> primary): "
                   + ", ".join(f"{r} -> {p}" for r, p in self.renamed.items())
                   if self.renamed else "")
        return f"models[{self.name}]: loads ({sides}){matched}"


def _hint(model: ModelConfig, exc: BackendError) -> str:
    """The error, with which backend reads the artifact when the suffix says another."""
    message = str(exc)
    for role in ("primary", "reference", "fallback"):
        spec = getattr(model, role)
        if (spec is None or spec.is_factory
                or not message.startswith(f"models[{model.name}].{role}")):
            continue
        readers = _READERS.get(Path(str(spec.path)).suffix.lower(), ())
        if readers and spec.backend not in readers:
            message += (f" (a {Path(str(spec.path)).suffix} file is for backend "
                        f"{' or '.join(readers)}, not {spec.backend})")
    return message.replace("\n", " ")


def check_model(model: ModelConfig) -> ModelReport:
    """Load one model's sides as serve would; the report says what loaded or why not."""
    from guard.backends import create_backend
    from guard.backends.loading import load_all
    from guard.backends.signatures import check_fallback
    from guard.verify.pair import CheckedPair

    report = ModelReport(model.name)
    pair = CheckedPair(model) if model.reference is not None else None
    backends = dict(pair.backends) if pair is not None else {
        "primary": create_backend(model.primary, "primary")}
    if model.fallback is not None:
        backends["fallback"] = create_backend(model.fallback, "fallback")
    try:
        load_all(model.name, model, backends)
        if pair is not None:
            pair.match_outputs()
            report.renamed = dict(pair.output_match.renamed)
        fallback = backends.get("fallback")
        if fallback is not None:
            check_fallback(model.name, backends["primary"].describe(), fallback.describe())
        report.sides = {role: b.describe().summary() for role, b in backends.items()}
    except BackendError as exc:
        report.error = _hint(model, exc)
    finally:
        for backend in backends.values():
            try:
                backend.close()
            except Exception:  # closing a side that failed to load: nothing to keep
                pass
    return report


def check_config(config: GuardConfig) -> list[ModelReport]:
    return [check_model(model) for model in config.models]
