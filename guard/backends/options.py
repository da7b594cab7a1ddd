"""Per-backend ``options`` maps, validated when the config loads (no heavy imports here).

Each backend's options are a strict pydantic model, declared by its module (``KINDS``), so a
misspelt option is reported as
``models[0].primary.options.intra_op_thread: unknown key`` instead of being ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic.json_schema import JsonDict


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


# The mark of an option that describes the model rather than how an engine runs it (a forward()'s
# input and output names, a factory's arguments): the same for every backend that reads the same
# artifact, so `guard matrix` gives the reference's to every column that takes the option.
DESCRIBES_MODEL: JsonDict = {"describes": "model"}


class OnnxRuntimeOptions(_Options):
    providers: list[str] = Field(
        default_factory=lambda: ["CPUExecutionProvider"],
        description="Execution providers in priority order.",
    )
    intra_op_threads: int = Field(
        0, ge=0, description="0 lets ORT decide; the reference uses mirror.threads instead."
    )
    inter_op_threads: int = Field(0, ge=0, description="0 lets ORT decide.")
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = Field(
        "all", description="ORT graph optimisations; the reference always runs 'all' unless set."
    )
    execution_mode: Literal["sequential", "parallel"] = Field("sequential")
    nodes_to_exclude: list[str] = Field(
        default_factory=list,
        description="precision int8/fp16: node names kept at fp32 when deriving the variant.",
    )
    per_channel: bool = Field(False, description="precision int8: per-channel weight scales.")
    reduce_range: bool = Field(
        False,
        description="precision int8: 7-bit weights (quantize_dynamic's reduce_range). Worth "
        "trying on x86-64 CPUs without VNNI/AMX, whose int8 kernels saturate with 8-bit weights "
        "(the backend's describe() says int8_kernels: saturating there); it costs precision on "
        "layers with outlier weights.",
    )
    provider_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Per-provider settings passed through to ONNX Runtime, e.g. "
        "{TensorrtExecutionProvider: {trt_fp16_enable: true, trt_op_types_to_exclude: "
        "'LayerNormalization'}} (needs onnxruntime-gpu instead of onnxruntime).",
    )


class TorchOptions(_Options):
    threads: int = Field(0, ge=0, description="torch intra-op threads; 0 leaves torch's default.")
    input_names: list[str] | None = Field(
        None, description="Names of forward()'s positional inputs, in order.",
        json_schema_extra=DESCRIBES_MODEL,
    )
    output_names: list[str] | None = Field(
        None, description="Names of the outputs when forward() returns a tensor or a tuple.",
        json_schema_extra=DESCRIBES_MODEL,
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for a 'module:factory' path.",
        json_schema_extra=DESCRIBES_MODEL,
    )
    allow_tf32: bool = Field(
        False,
        description="cuda only, primary/fallback only: let matmul and cuDNN use TF32 (a "
        "legitimate production choice, and the usual cause of GPU-vs-CPU drift). torch's switch "
        "is process-wide: it cannot be combined with a torch reference on cuda in one guard.",
    )
    traced_conv_flags: Literal["as_traced", "process"] = Field(
        "as_traced",
        description="cuda only, TorchScript only: torch.jit.trace records each convolution "
        "with the tracing process's cuDNN flags (benchmark, deterministic, enabled, allow_tf32; "
        "torch's default has TF32 on) and they outrank this process's switches at run time. "
        "'as_traced' runs them as recorded, as Triton's libtorch backend and any torch.jit.load "
        "do (guard logs a warning when that means TF32 beside allow_tf32 off); 'process' "
        "rewrites them at load to this process's flags, so allow_tf32 means what it says. A "
        "torch reference is always 'process': its determinism pin holds.",
    )
    onednn_linear: bool = Field(
        True,
        description="backend torch, reference role, CPU, fp32: run the model's linear "
        "products by oneDNN (guard/backends/onednn_linear.py) instead of torch's default, MKL, "
        "whose fp32 products take their AVX2 path on AMD CPUs: the same fp32 arithmetic in "
        "another summation order, a MiniLM reference's forward 1.8-2.1x cheaper on an AVX-512 "
        "EPYC (benchmarks/reference_kernels.py). Layers of fewer than 65,536 weights keep "
        "torch's kernels (too small for oneDNN's per-call cost); a TorchScript module is "
        "frozen to do it. false: torch's kernels. No effect in other roles, on a GPU, at "
        "fp16/bf16, or for torch_compile (inductor picks its own).",
    )


class TorchCompileOptions(TorchOptions):
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = (
        "default"
    )
    compile_backend: str = Field("inductor", description="torch.compile(backend=...).")
    dynamic: bool | None = Field(None, description="torch.compile(dynamic=...).")
    fullgraph: bool = False
    eager_fp32_modules: list[str] = Field(
        default_factory=list,
        description="Submodule paths (as named_modules() names them, e.g. 'layers.0.attn') "
        "kept out of the compiled graph: each runs eagerly (torch.compiler.disable) on an fp32 "
        "copy of its weights, its floating inputs cast to fp32 and its outputs cast back to "
        "their dtype. policy.action fallback_ops sets it on a repaired primary. Incompatible "
        "with fullgraph (each is a graph break).",
    )

    @field_validator("eager_fp32_modules")
    @classmethod
    def _not_with_fullgraph(cls, paths: list[str], info: ValidationInfo) -> list[str]:
        if paths and info.data.get("fullgraph"):
            raise ValueError("needs fullgraph: false (each module kept eager is a graph break)")
        return paths


class UpstreamOptions(_Options):
    timeout_s: float = Field(
        10.0, gt=0, description="Deadline for a forwarded request when the client sent none; "
        "a client deadline is propagated as it is."
    )
    ready_timeout_s: float = Field(
        60.0, ge=0, description="At start-up, how long to wait for the upstream model to be "
        "ready (a sidecar may start before its model server)."
    )
    model_version: str = Field("", description="Model version to ask the upstream for.")
    tls: bool = Field(False, description="Connect with TLS (system roots unless root_ca_file).")
    root_ca_file: str | None = Field(None, description="PEM roots for the upstream's cert.")
    max_message_bytes: int = Field(64 * 1024 * 1024, gt=0)


class TensorRTOptions(_Options):
    workspace_mib: int = Field(1024, gt=0, description="Builder workspace memory limit.")
    profile: dict[str, list[list[int]]] = Field(
        default_factory=dict,
        description="Optimisation profile per dynamic input: {name: [min, opt, max] shapes}.",
    )
    fp32_layers: list[str] = Field(
        default_factory=list,
        description="precision fp16/int8: layers kept at fp32 (precision constraints).",
    )
    exclude_op_types: list[str] = Field(
        default_factory=list,
        description="precision fp16/int8: layer types kept at fp32 (e.g. 'NORMALIZATION').",
    )
    int8_calibration_cache: str | None = Field(
        None, description="precision int8: a TensorRT calibration cache file (required unless "
        "the ONNX carries Q/DQ nodes)."
    )


def model_options(backend: str) -> frozenset[str]:
    """The options of ``backend`` marked ``DESCRIBES_MODEL`` (none for an unknown backend)."""
    from guard.backends import BACKEND_NAMES, backend_kind

    if backend not in BACKEND_NAMES:
        return frozenset()
    fields = backend_kind(backend).options.model_fields
    return frozenset(name for name, field in fields.items()
                     if field.json_schema_extra == DESCRIBES_MODEL)


def parse_backend_options(backend: str, options: dict[str, Any]) -> BaseModel:
    """``options`` checked by the model the backend declares (``BackendKind.options``)."""
    from guard.backends import backend_kind

    return backend_kind(backend).options.model_validate(options)


def validate_backend_options(backend: str, options: dict[str, Any]) -> list[str]:
    """Problems as ``.key: message`` suffixes (the caller prefixes the dotted path)."""
    from guard.backends import BACKEND_NAMES

    if backend not in BACKEND_NAMES:
        return []
    try:
        parse_backend_options(backend, options)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
            msg = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
            msg = msg.removeprefix("Value error, ")
            lines.append(f"{loc}: {msg}")
        return lines
    return []
