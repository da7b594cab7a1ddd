from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("name", "datatype", "shape", "raw")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    raw: bytes
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., raw: _Optional[bytes] = ...) -> None: ...

class BackendDescription(_message.Message):
    __slots__ = ("role", "backend", "artifact", "precision", "device")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    role: str
    backend: str
    artifact: str
    precision: str
    device: str
    def __init__(self, role: _Optional[str] = ..., backend: _Optional[str] = ..., artifact: _Optional[str] = ..., precision: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class OutputVerdict(_message.Message):
    __slots__ = ("name", "passed", "reason", "max_abs", "mean_abs", "p99_abs", "max_rel", "cosine_distance", "allowed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ABS_FIELD_NUMBER: _ClassVar[int]
    P99_ABS_FIELD_NUMBER: _ClassVar[int]
    MAX_REL_FIELD_NUMBER: _ClassVar[int]
    COSINE_DISTANCE_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    name: str
    passed: bool
    reason: str
    max_abs: float
    mean_abs: float
    p99_abs: float
    max_rel: float
    cosine_distance: float
    allowed: float
    def __init__(self, name: _Optional[str] = ..., passed: _Optional[bool] = ..., reason: _Optional[str] = ..., max_abs: _Optional[float] = ..., mean_abs: _Optional[float] = ..., p99_abs: _Optional[float] = ..., max_rel: _Optional[float] = ..., cosine_distance: _Optional[float] = ..., allowed: _Optional[float] = ...) -> None: ...

class TierVerdict(_message.Message):
    __slots__ = ("tier", "passed", "summary", "outputs", "details_json")
    TIER_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_JSON_FIELD_NUMBER: _ClassVar[int]
    tier: str
    passed: bool
    summary: str
    outputs: _containers.RepeatedCompositeFieldContainer[OutputVerdict]
    details_json: str
    def __init__(self, tier: _Optional[str] = ..., passed: _Optional[bool] = ..., summary: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[OutputVerdict, _Mapping]]] = ..., details_json: _Optional[str] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("request_seconds", "reference_seconds")
    REQUEST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_seconds: float
    reference_seconds: float
    def __init__(self, request_seconds: _Optional[float] = ..., reference_seconds: _Optional[float] = ...) -> None: ...

class CaptureRecord(_message.Message):
    __slots__ = ("model", "request_id", "unix_nanos", "route", "inputs", "outputs", "mirrored", "probed", "reference_outputs", "verdicts", "timings", "backends", "config_hash", "guard_version", "source", "sequence", "epoch")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    MIRRORED_FIELD_NUMBER: _ClassVar[int]
    PROBED_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    GUARD_VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: str
    unix_nanos: int
    route: str
    inputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    outputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    mirrored: bool
    probed: bool
    reference_outputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    verdicts: _containers.RepeatedCompositeFieldContainer[TierVerdict]
    timings: Timings
    backends: _containers.RepeatedCompositeFieldContainer[BackendDescription]
    config_hash: str
    guard_version: str
    source: str
    sequence: int
    epoch: int
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[str] = ..., unix_nanos: _Optional[int] = ..., route: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., mirrored: _Optional[bool] = ..., probed: _Optional[bool] = ..., reference_outputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., verdicts: _Optional[_Iterable[_Union[TierVerdict, _Mapping]]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., backends: _Optional[_Iterable[_Union[BackendDescription, _Mapping]]] = ..., config_hash: _Optional[str] = ..., guard_version: _Optional[str] = ..., source: _Optional[str] = ..., sequence: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...
