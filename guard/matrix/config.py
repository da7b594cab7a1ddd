"""The matrix YAML as typed models (strict like the guard config: unknown keys are errors).

```yaml
version: 1
name: cpu
output_dir: results/cpu          # relative to this file; --output-dir overrides
threads: 2                       # intra-op threads of every backend (the reference: 1)
reference: {backend: torch}      # the truth every backend is checked against; its model-
                                 # describing options (input_names...) reach the torch columns
models:
  - {name: resnet, zoo: resnet, inputs: {samples: 8, seed: 0, batch: 1}}
  - name: mine                   # or artifacts / a factory
    task: classification
    torchscript: models/mine.pt  # torch backends (a torch.export .pt2: torch_compile too)
    onnx: models/mine.onnx       # used by onnxruntime backends
    inputs: {file: inputs.npz}   # arrays batched on axis 0; default: generated (seeded)
    adapters: [float64_softmax]
    checks: {task: {classification: {top_k: 3}}}
backends:
  - {name: ort_int8, backend: onnxruntime, precision: int8}
tolerances: {atol: [1.0e-6, 1.0e-5, 1.0e-4, 1.0e-3], rtol: [1.0e-5]}
tiers: [tensor, task]
```
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from guard.backends import BACKEND_NAMES
from guard.config import (
    FACTORY_REF,
    AdapterConfig,
    Precision,
    Task,
    TaskCheckConfig,
    _adapter_entry,
    format_validation_error,
)
from guard.config.generation import GenerationCheckConfig
from guard.errors import ConfigError


# The matrix sits above the backends: its schema names them (the guard config's leaves that to
# the plan step, guard/plan/schema.py), and one engine that is a matrix column only: ONNX Runtime
# GenAI (guard/backends/onnxruntime_genai.py; not a backend of the guard config).
# (built from the registry's tuple at run time, which a type checker cannot read: str to it)
if TYPE_CHECKING:
    BackendName = str
else:
    BackendName = Literal[tuple(BACKEND_NAMES) + ("onnxruntime_genai",)]
GENERATION = "generation"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputSet(_Strict):
    samples: int = Field(8, ge=1, description="Inferences per backend (one check sample each); "
                         "task generation: prompts (one completion each).")
    batch: int = Field(1, ge=1, description="Rows per inference.")
    seed: int = Field(0, description="Seed of generated inputs.")
    file: str | None = Field(None, description=".npz of inputs batched on axis 0; task "
                             "generation: a text file of prompts, one per line (default: the "
                             "zoo's prompts, guard/zoo/llm.py).")
    max_tokens: int = Field(32, ge=1, description="task generation: tokens per greedy "
                            "completion.")
    top_logprobs: int = Field(20, ge=0, description="task generation: the alternatives each "
                              "token carries, as an OpenAI-compatible server returns them "
                              "(OpenAI and vLLM allow at most 20).")


class MatrixChecks(_Strict):
    task: TaskCheckConfig = Field(default_factory=TaskCheckConfig)
    generation: GenerationCheckConfig = Field(
        default_factory=GenerationCheckConfig,
        description="task generation: the generation tier's thresholds (max_mean_kld, ...).")


class MatrixModel(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$")
    zoo: str | None = Field(None, description="A guard zoo model (guard.zoo.names()); task "
                            "generation: an LLM of guard.zoo.llm.MODELS (smollm2).")
    gguf: str | None = Field(None, description="task generation: the model's GGUF; every "
                             "generative column is derived from it.")
    torchscript: str | None = Field(None, description="TorchScript/.pt2 for torch backends.")
    onnx: str | None = Field(None, description=".onnx for onnxruntime backends.")
    factory: str | None = Field(None, description="'module:factory' for torch backends.")
    factory_kwargs: dict[str, Any] = Field(default_factory=dict)
    task: Task | None = Field(None, description="Default: the zoo model's task, else generic.")
    inputs: InputSet = Field(default_factory=InputSet)
    adapters: list[Annotated[AdapterConfig, BeforeValidator(_adapter_entry)]] | None = Field(
        None, description="Default: the zoo model's adapters.")
    checks: MatrixChecks = Field(default_factory=MatrixChecks)
    reference: "ReferenceBackend | None" = Field(
        None, description="This model's reference, when not the matrix-wide one (e.g. an "
        "ONNX-only model)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> "MatrixModel":
        if self.zoo is None and not (self.torchscript or self.onnx or self.factory or self.gguf):
            raise ValueError("give 'zoo', or artifacts ('torchscript', 'onnx', 'gguf') or a "
                             "'factory'")
        if self.zoo is not None and (self.torchscript or self.onnx or self.factory or self.gguf):
            raise ValueError("'zoo' and artifacts/factory are exclusive")
        if self.gguf is not None and self.task != GENERATION:
            raise ValueError("'gguf' is an LLM's: set task: generation")
        if self.factory is not None and not FACTORY_REF.match(self.factory):
            raise ValueError("factory must look like 'package.module:function'")
        return self


class MatrixBackend(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$")
    backend: BackendName
    precision: Precision = "fp32"
    device: str = Field("cpu", description="cpu, cuda or cuda:N.")
    options: dict[str, Any] = Field(default_factory=dict)
    artifact: Literal["onnx", "torchscript", "factory", "keras", "tf_saved_model"] | None = Field(
        None, description="Which of the model's artifacts this backend gets, when not the one "
        "its kind's formats pick (e.g. onnxruntime on the Keras port: tf2onnx's conversion; "
        "torch on a zoo model's eager module, 'factory', instead of its TorchScript).")
    process: Literal["same", "own"] = Field(
        "same", description="'own': run this column in a child process (guard/matrix/apart.py), "
        "for a backend whose settings are process-wide, e.g. Keras on a backend other than the "
        "sweep's (Keras picks its backend once per process).")
    cause: str = Field(
        "", description="What makes this backend differ from the reference, when known (e.g. "
        "'TF32 on: matmul inputs rounded to 10 mantissa bits'): printed beside its failures."
    )
    quant: str | None = Field(
        None, description="Generative columns: the model's GGUF converted for this column: a "
        "llama.cpp file type for llama_cpp and openai (F16, Q8_0, Q4_K_M, Q2_K, ...; llama.cpp's "
        "quantizer, cached; default: the GGUF as it is), the model builder's precision for "
        "onnxruntime_genai (int4 default, int8, fp32).")
    serve: Literal["llama_cpp"] | None = Field(
        None, description="backend openai: the server the matrix starts for this column on the "
        "model's GGUF (llama-cpp-python's OpenAI-compatible server, loopback).")

    @model_validator(mode="after")
    def _served(self) -> "MatrixBackend":
        if (self.backend == "openai") != (self.serve is not None):
            raise ValueError("backend openai needs 'serve: llama_cpp' (the server the matrix "
                             "starts), and 'serve' needs backend openai")
        return self


class Tolerances(_Strict):
    atol: list[float] = Field(min_length=1)
    rtol: list[float] = Field(min_length=1)

    @model_validator(mode="after")
    def _non_negative(self) -> "Tolerances":
        if any(v < 0 for v in self.atol + self.rtol):
            raise ValueError("tolerances must be >= 0")
        return self


class ReferenceBackend(_Strict):
    backend: BackendName = Field("torch", description="A backend the matrix can give an "
                                 "artifact (its kind declares formats), run at fp32; task "
                                 "generation: a teacher-forcing scorer (transformers, "
                                 "llama_cpp, onnxruntime_genai).")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Its backend options. Those that describe the model "
        "rather than the engine (input_names, output_names, a factory's kwargs) also reach "
        "every column whose backend takes them and does not set them itself.")
    precision: Precision = Field("fp32", description="task generation: the scorer's precision.")
    quant: str | None = Field(None, description="task generation: as a column's 'quant' (e.g. "
                              "F32 for llama.cpp on the GGUF dequantized).")


# The reference of a generation model whose block names none.
GENERATION_REFERENCE = ReferenceBackend(backend="transformers")
GENERATION_REFERENCES = ("transformers", "llama_cpp", "onnxruntime_genai")


MatrixModel.model_rebuild()


class MatrixConfig(_Strict):
    version: Literal[1]
    name: str = "matrix"
    output_dir: str = "matrix-results"
    threads: int = Field(2, ge=1, description="Intra-op threads of the checked backends.")
    reference: ReferenceBackend = Field(default_factory=ReferenceBackend)
    models: list[MatrixModel] = Field(min_length=1)
    backends: list[MatrixBackend] = Field(min_length=1)
    tolerances: Tolerances
    tiers: list[str] = Field(
        default_factory=lambda: ["tensor", "task"],
        description="Registered tiers (guard/verify/tiers.py) each cell runs. activation: tier "
        "2 on each cell's first tier-1 failure, naming the first divergent layer "
        "(guard/matrix/localise.py); skipped where it cannot capture.")

    @field_validator("tiers")
    @classmethod
    def _registered(cls, tiers: list[str]) -> list[str]:
        from guard.verify.tiers import tier_names

        unknown = [t for t in tiers if t not in tier_names()]
        if unknown:
            raise ValueError(f"unknown tier '{unknown[0]}' (registered: "
                             f"{', '.join(tier_names())})")
        return tiers

    @model_validator(mode="after")
    def _unique(self) -> "MatrixConfig":
        for kind, items in (("model", self.models), ("backend", self.backends)):
            seen = set()
            for item in items:
                if item.name in seen:
                    raise ValueError(f"{kind} name '{item.name}' appears twice")
                seen.add(item.name)
        return self


def load_matrix_config(path: str | Path) -> tuple[MatrixConfig, Path]:
    """Parse and validate; returns the config and the folder relative paths resolve against."""
    from guard.backends.options import validate_backend_options
    from guard.backends import backend_kind
    from guard.config import read_yaml
    from guard.plan.complete import adapter_problems
    from guard.zoo import names as zoo_names

    path = Path(path)
    _, data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(["(top level): must be a mapping"], str(path))
    try:
        config = MatrixConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc), str(path)) from None
    base = path.resolve().parent
    problems = []
    references = [("reference", config.reference)] + [
        (f"models[{i}].reference", m.reference) for i, m in enumerate(config.models)
        if m.reference is not None and m.task != GENERATION]
    for i, m in enumerate(config.models):
        if m.task == GENERATION:
            problems += _generation_problems(m, f"models[{i}]", base)
    for where, ref in references:
        if not backend_kind(ref.backend).formats:
            problems.append(f"{where}.backend: the matrix gives {ref.backend} no artifact")
    keras_backends: dict[str, str] = {}
    for i, b in enumerate(config.backends):
        if b.backend in _GENERATIVE:
            problems += _generative_column_problems(b, f"backends[{i}]")
            continue
        if b.backend == "keras" and b.process == "same":
            keras_backends.setdefault(b.options.get("keras_backend", "tensorflow"),
                                      f"backends[{i}]")
        if b.precision not in backend_kind(b.backend).precisions:
            problems.append(f"backends[{i}].precision: {b.backend} cannot derive {b.precision}")
        else:
            problems += [f"backends[{i}].options{line}"
                         for line in validate_backend_options(b.backend, b.options)]
    if len(keras_backends) > 1:
        (engine, first), (other, second) = list(keras_backends.items())[:2]
        problems.append(f"{second}.options.keras_backend: '{other}', but {first} runs Keras on "
                        f"'{engine}': one sweep runs in one process, and Keras on one backend per "
                        "process; give the other Keras columns process: own")
    for i, m in enumerate(config.models):
        if m.task == GENERATION:
            continue
        problems += adapter_problems(m.adapters or [], f"models[{i}]")
        if m.zoo is not None and m.zoo not in zoo_names():
            problems.append(f"models[{i}].zoo: unknown zoo model '{m.zoo}' (available: "
                            f"{', '.join(zoo_names())})")
        for key in ("torchscript", "onnx"):
            value = getattr(m, key)
            if value is not None:
                resolved = (base / value).resolve()
                if not resolved.exists():
                    problems.append(f"models[{i}].{key}: file not found: {resolved}")
                setattr(m, key, str(resolved))
        if m.inputs.file is not None:
            resolved = (base / m.inputs.file).resolve()
            if not resolved.exists():
                problems.append(f"models[{i}].inputs.file: file not found: {resolved}")
            m.inputs.file = str(resolved)
    if problems:
        raise ConfigError(problems, str(path))
    return config, base


# Columns that run on a generation model (guard/matrix/columns.py), never on a tensor one.
_GENERATIVE = ("llama_cpp", "openai", "transformers", "onnxruntime_genai")


def _generative_column_problems(b: MatrixBackend, where: str) -> list[str]:
    """The keys a generative column would otherwise ignore in silence (guard/matrix/columns.py
    reads backend, precision, device, options, quant and serve, and runs every column in the
    sweep's process)."""
    problems = []
    if b.backend == "transformers" and b.precision not in ("fp32", "fp16", "bf16"):
        problems.append(f"{where}.precision: transformers runs fp32, fp16 or bf16")
    if b.device != "cpu" and b.backend != "transformers":
        problems.append(f"{where}.device: a {b.backend} column runs on the CPU (only transformers "
                        "runs on cuda)")
    if b.quant is not None and b.backend == "transformers":
        problems.append(f"{where}.quant: transformers runs the GGUF dequantized at 'precision'; "
                        "'quant' is for llama_cpp, openai and onnxruntime_genai columns")
    if b.process != "same":
        problems.append(f"{where}.process: generative columns run in the sweep's process")
    if b.artifact is not None:
        problems.append(f"{where}.artifact: a generative column's artifact is derived from the "
                        "model's GGUF ('quant' says how)")
    return problems


def generation_reference(model: MatrixModel, config: MatrixConfig) -> ReferenceBackend:
    """A generation model's reference: its own block, else transformers fp32 on its GGUF."""
    return model.reference or GENERATION_REFERENCE


def _generation_problems(model: MatrixModel, where: str, base: Path) -> list[str]:
    from guard.zoo.llm import MODELS

    problems = []
    if model.zoo is not None and model.zoo not in MODELS:
        problems.append(f"{where}.zoo: unknown LLM '{model.zoo}' (available: "
                        f"{', '.join(MODELS)})")
    if model.gguf is not None:
        resolved = (base / model.gguf).resolve()
        if not resolved.is_file():
            problems.append(f"{where}.gguf: file not found: {resolved}")
        model.gguf = str(resolved)
    if model.inputs.file is not None:
        resolved = (base / model.inputs.file).resolve()
        if not resolved.is_file():
            problems.append(f"{where}.inputs.file: file not found: {resolved}")
        model.inputs.file = str(resolved)
    if model.reference is not None and model.reference.backend not in GENERATION_REFERENCES:
        problems.append(f"{where}.reference.backend: a generation model's reference is a "
                        f"teacher-forcing scorer ({', '.join(GENERATION_REFERENCES)}), not "
                        f"'{model.reference.backend}'")
    return problems
