from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ObserveRequest(_message.Message):
    __slots__ = ("request", "response", "served_by")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_FIELD_NUMBER: _ClassVar[int]
    request: bytes
    response: bytes
    served_by: str
    def __init__(self, request: _Optional[bytes] = ..., response: _Optional[bytes] = ..., served_by: _Optional[str] = ...) -> None: ...

class ObserveResponse(_message.Message):
    __slots__ = ("sampled", "route")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    sampled: bool
    route: str
    def __init__(self, sampled: _Optional[bool] = ..., route: _Optional[str] = ...) -> None: ...

class WatchRouteRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class RouteUpdate(_message.Message):
    __slots__ = ("model", "route", "reason", "unix_time")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    model: str
    route: str
    reason: str
    unix_time: float
    def __init__(self, model: _Optional[str] = ..., route: _Optional[str] = ..., reason: _Optional[str] = ..., unix_time: _Optional[float] = ...) -> None: ...
