"""The guard YAML config as typed models (pydantic v2).

Why pydantic: it gives typed settings, unknown-key rejection (``extra="forbid"``), error locations
we can turn into the ``dotted.path: message`` lines that CONTRACT.md promises, and the JSON Schema
for ``guard config schema``, all from one declaration. Every default is documented on its field.

Loading does only what needs no heavy imports: parse, validate, resolve relative paths against the
config file's folder, and check that artifacts exist. Building backends happens later.

By concern, each block beside the blocks it is made of:

- ``base``: the strict base model, value types, ``ConfigContext`` (where a config came from);
- ``server``: ``server:`` (listeners, TLS, the verifier process, the tap listener);
- ``backend``: a backend block; ``checks``: tiers 1-3 and the adapters; ``policy``: detectors,
  routing and the op repair; ``capture``: recording for replay;
- ``model``: one ``models:`` entry; ``document``: ``GuardConfig``, loading, error lines, schema.

Everything is importable from ``guard.config`` as before.
"""

from __future__ import annotations

from guard.backends import BACKEND_NAMES, backend_kinds
from guard.config.backend import BackendConfig
from guard.config.base import (
    FACTORY_REF,
    Action,
    BackendName,
    ConfigContext,
    Fraction,
    NonNegativeFloat,
    Port,
    PositiveFloat,
    PositiveInt,
    Precision,
    Strict,
    Task,
    WithContext,
)
from guard.config.capture import CaptureConfig
from guard.config.checks import (
    ActivationCheckConfig,
    AdapterConfig,
    ArbitrationConfig,
    ChecksConfig,
    ClassificationTaskConfig,
    DetectionTaskConfig,
    EmbeddingTaskConfig,
    NoiseFloorConfig,
    OutputTolerance,
    SegmentationTaskConfig,
    TaskCheckConfig,
    TensorCheckConfig,
    _adapter_entry,  # noqa: F401 (the matrix config reads adapter entries the same way)
)
from guard.config.generation import GenerationCheckConfig
from guard.config.document import (
    GuardConfig,
    config_json_schema,
    format_validation_error,
    load_config,
    parse_config,
    read_yaml,
)
from guard.config.model import MODEL_NAME, MirrorConfig, ModelConfig
from guard.config.policy import PolicyConfig, RepairConfig
from guard.config.server import (
    ClientAuthTlsConfig,
    ServerConfig,
    TapListenerConfig,
    TlsConfig,
    VerifierConfig,
    is_loopback,
)

__all__ = [
    "FACTORY_REF", "MODEL_NAME", "Action", "ActivationCheckConfig", "AdapterConfig",
    "ArbitrationConfig", "BackendConfig", "BackendName", "CaptureConfig", "ChecksConfig",
    "ClassificationTaskConfig", "ClientAuthTlsConfig", "ConfigContext", "DetectionTaskConfig",
    "EmbeddingTaskConfig", "Fraction", "GenerationCheckConfig", "GuardConfig", "MirrorConfig", "ModelConfig",
    "NoiseFloorConfig", "NonNegativeFloat", "OutputTolerance", "PolicyConfig", "Port",
    "PositiveFloat", "PositiveInt", "Precision", "RepairConfig", "SegmentationTaskConfig",
    "ServerConfig", "Strict", "TapListenerConfig", "Task", "TaskCheckConfig",
    "TensorCheckConfig", "TlsConfig", "VerifierConfig", "WithContext", "config_json_schema",
    "format_validation_error", "is_loopback", "load_config", "parse_config", "read_yaml",
]


def __getattr__(name: str):
    """Tables read from the registries that own them: the backends' declarations, tier 2's
    capture sides, the repair's strategies."""
    if name == "IMPLEMENTED_BACKENDS":
        return frozenset(BACKEND_NAMES)
    if name == "DERIVABLE_PRECISIONS":
        return {n: k.precisions for n, k in backend_kinds().items()}
    if name == "ACTIVATION_BACKENDS":
        from guard.verify.activation.sides import capturable

        return capturable()
    if name == "REPAIRABLE_PRIMARIES":
        from guard.policy.keep_back import repairable

        return {n: frozenset(p) for n, p in repairable().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
