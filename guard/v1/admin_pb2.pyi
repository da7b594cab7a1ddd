from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteOverride(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTE_OVERRIDE_UNSPECIFIED: _ClassVar[RouteOverride]
    AUTO: _ClassVar[RouteOverride]
    PRIMARY: _ClassVar[RouteOverride]
    FALLBACK: _ClassVar[RouteOverride]
ROUTE_OVERRIDE_UNSPECIFIED: RouteOverride
AUTO: RouteOverride
PRIMARY: RouteOverride
FALLBACK: RouteOverride

class GetStatusRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("guard_version", "models")
    GUARD_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    guard_version: str
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    def __init__(self, guard_version: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ...) -> None: ...

class SetRouteRequest(_message.Message):
    __slots__ = ("model", "route", "reason")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    model: str
    route: RouteOverride
    reason: str
    def __init__(self, model: _Optional[str] = ..., route: _Optional[_Union[RouteOverride, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class SetRouteResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: ModelStatus
    def __init__(self, status: _Optional[_Union[ModelStatus, _Mapping]] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("result", "problems", "changed", "added", "removed", "failed", "config_hash")
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RESULT_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    result: str
    problems: _containers.RepeatedScalarFieldContainer[str]
    changed: _containers.RepeatedScalarFieldContainer[str]
    added: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.ScalarMap[str, str]
    config_hash: str
    def __init__(self, result: _Optional[str] = ..., problems: _Optional[_Iterable[str]] = ..., changed: _Optional[_Iterable[str]] = ..., added: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ..., failed: _Optional[_Mapping[str, str]] = ..., config_hash: _Optional[str] = ...) -> None: ...

class WindowStatus(_message.Message):
    __slots__ = ("tier", "samples", "failures", "drift_ratio", "window", "min_samples", "since_unix_time")
    TIER_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    DRIFT_RATIO_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    MIN_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    tier: str
    samples: int
    failures: int
    drift_ratio: float
    window: int
    min_samples: int
    since_unix_time: float
    def __init__(self, tier: _Optional[str] = ..., samples: _Optional[int] = ..., failures: _Optional[int] = ..., drift_ratio: _Optional[float] = ..., window: _Optional[int] = ..., min_samples: _Optional[int] = ..., since_unix_time: _Optional[float] = ...) -> None: ...

class Transition(_message.Message):
    __slots__ = ("from_route", "to_route", "trigger", "reason", "unix_time")
    FROM_ROUTE_FIELD_NUMBER: _ClassVar[int]
    TO_ROUTE_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    from_route: str
    to_route: str
    trigger: str
    reason: str
    unix_time: float
    def __init__(self, from_route: _Optional[str] = ..., to_route: _Optional[str] = ..., trigger: _Optional[str] = ..., reason: _Optional[str] = ..., unix_time: _Optional[float] = ...) -> None: ...

class BackendStatus(_message.Message):
    __slots__ = ("role", "backend", "precision", "device", "artifact")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    role: str
    backend: str
    precision: str
    device: str
    artifact: str
    def __init__(self, role: _Optional[str] = ..., backend: _Optional[str] = ..., precision: _Optional[str] = ..., device: _Optional[str] = ..., artifact: _Optional[str] = ...) -> None: ...

class GenerationWindow(_message.Message):
    __slots__ = ("completions", "window", "mean_kld", "kld_p99", "top1_agreement", "not_comparable", "last_divergence_json", "not_comparable_by_reason", "sampled_completions", "z_pooled")
    class NotComparableByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    MEAN_KLD_FIELD_NUMBER: _ClassVar[int]
    KLD_P99_FIELD_NUMBER: _ClassVar[int]
    TOP1_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    NOT_COMPARABLE_FIELD_NUMBER: _ClassVar[int]
    LAST_DIVERGENCE_JSON_FIELD_NUMBER: _ClassVar[int]
    NOT_COMPARABLE_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    Z_POOLED_FIELD_NUMBER: _ClassVar[int]
    completions: int
    window: int
    mean_kld: float
    kld_p99: float
    top1_agreement: float
    not_comparable: int
    last_divergence_json: str
    not_comparable_by_reason: _containers.ScalarMap[str, int]
    sampled_completions: int
    z_pooled: float
    def __init__(self, completions: _Optional[int] = ..., window: _Optional[int] = ..., mean_kld: _Optional[float] = ..., kld_p99: _Optional[float] = ..., top1_agreement: _Optional[float] = ..., not_comparable: _Optional[int] = ..., last_divergence_json: _Optional[str] = ..., not_comparable_by_reason: _Optional[_Mapping[str, int]] = ..., sampled_completions: _Optional[int] = ..., z_pooled: _Optional[float] = ...) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("name", "route", "override", "action", "windows", "last_transition", "has_last_transition", "backends", "mirror", "requests", "probing", "ops_kept_back", "repairing", "outputs_matched", "generation", "has_generation", "tier_actions")
    class MirrorEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class OutputsMatchedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class TierActionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    LAST_TRANSITION_FIELD_NUMBER: _ClassVar[int]
    HAS_LAST_TRANSITION_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    MIRROR_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROBING_FIELD_NUMBER: _ClassVar[int]
    OPS_KEPT_BACK_FIELD_NUMBER: _ClassVar[int]
    REPAIRING_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_MATCHED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    HAS_GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIER_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    route: str
    override: str
    action: str
    windows: _containers.RepeatedCompositeFieldContainer[WindowStatus]
    last_transition: Transition
    has_last_transition: bool
    backends: _containers.RepeatedCompositeFieldContainer[BackendStatus]
    mirror: _containers.ScalarMap[str, int]
    requests: _containers.ScalarMap[str, int]
    probing: bool
    ops_kept_back: _containers.RepeatedScalarFieldContainer[str]
    repairing: bool
    outputs_matched: _containers.ScalarMap[str, str]
    generation: GenerationWindow
    has_generation: bool
    tier_actions: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., route: _Optional[str] = ..., override: _Optional[str] = ..., action: _Optional[str] = ..., windows: _Optional[_Iterable[_Union[WindowStatus, _Mapping]]] = ..., last_transition: _Optional[_Union[Transition, _Mapping]] = ..., has_last_transition: _Optional[bool] = ..., backends: _Optional[_Iterable[_Union[BackendStatus, _Mapping]]] = ..., mirror: _Optional[_Mapping[str, int]] = ..., requests: _Optional[_Mapping[str, int]] = ..., probing: _Optional[bool] = ..., ops_kept_back: _Optional[_Iterable[str]] = ..., repairing: _Optional[bool] = ..., outputs_matched: _Optional[_Mapping[str, str]] = ..., generation: _Optional[_Union[GenerationWindow, _Mapping]] = ..., has_generation: _Optional[bool] = ..., tier_actions: _Optional[_Mapping[str, str]] = ...) -> None: ...
