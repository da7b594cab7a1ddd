"""The guard YAML config as typed models (pydantic v2).

Why pydantic: it gives typed settings, unknown-key rejection (``extra="forbid"``), error locations
we can turn into the ``dotted.path: message`` lines that CONTRACT.md promises, and the JSON Schema
for ``guard config schema``, all from one declaration. Every default is documented on its field.

config/ is a leaf: it validates the document's own schema and imports nothing of guard but
errors. Loading does only that: parse, validate, resolve relative paths against the config
file's folder, and check that artifacts exist. What the layers above declare (a backend's
precisions and options, what tier 2 can capture, what the repair can rebuild, the adapters) the
plan step checks a config against (guard/plan/): a config is loaded through it.

By concern, each block beside the blocks it is made of:

- ``base``: the strict base model, value types, ``ConfigContext`` (where a config came from);
- ``server``: ``server:`` (listeners, TLS, the verifier process, the tap listener);
- ``backend``: a backend block; ``checks``: tiers 1-3 and the adapters; ``policy``: detectors,
  routing and the op repair; ``capture``: recording for replay;
- ``model``: one ``models:`` entry; ``document``: ``GuardConfig``, loading, error lines, schema.

Everything is importable from ``guard.config`` as before.
"""

from __future__ import annotations

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
    document_json_schema,
    format_validation_error,
    load_document,
    parse_document,
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
    "EmbeddingTaskConfig", "Fraction", "GenerationCheckConfig", "GuardConfig", "MirrorConfig",
    "ModelConfig",
    "NoiseFloorConfig", "NonNegativeFloat", "OutputTolerance", "PolicyConfig", "Port",
    "PositiveFloat", "PositiveInt", "Precision", "RepairConfig", "SegmentationTaskConfig",
    "ServerConfig", "Strict", "TapListenerConfig", "Task", "TaskCheckConfig",
    "TensorCheckConfig", "TlsConfig", "VerifierConfig", "WithContext", "document_json_schema",
    "format_validation_error", "is_loopback", "load_document", "parse_document", "read_yaml",
]

