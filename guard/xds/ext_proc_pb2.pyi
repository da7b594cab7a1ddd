from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HeaderValue(_message.Message):
    __slots__ = ("key", "value", "raw_value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    RAW_VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    raw_value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ..., raw_value: _Optional[bytes] = ...) -> None: ...

class HeaderMap(_message.Message):
    __slots__ = ("headers",)
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    headers: _containers.RepeatedCompositeFieldContainer[HeaderValue]
    def __init__(self, headers: _Optional[_Iterable[_Union[HeaderValue, _Mapping]]] = ...) -> None: ...

class HttpHeaders(_message.Message):
    __slots__ = ("headers", "end_of_stream")
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    END_OF_STREAM_FIELD_NUMBER: _ClassVar[int]
    headers: HeaderMap
    end_of_stream: bool
    def __init__(self, headers: _Optional[_Union[HeaderMap, _Mapping]] = ..., end_of_stream: _Optional[bool] = ...) -> None: ...

class HttpBody(_message.Message):
    __slots__ = ("body", "end_of_stream")
    BODY_FIELD_NUMBER: _ClassVar[int]
    END_OF_STREAM_FIELD_NUMBER: _ClassVar[int]
    body: bytes
    end_of_stream: bool
    def __init__(self, body: _Optional[bytes] = ..., end_of_stream: _Optional[bool] = ...) -> None: ...

class HttpTrailers(_message.Message):
    __slots__ = ("trailers",)
    TRAILERS_FIELD_NUMBER: _ClassVar[int]
    trailers: HeaderMap
    def __init__(self, trailers: _Optional[_Union[HeaderMap, _Mapping]] = ...) -> None: ...

class ProcessingRequest(_message.Message):
    __slots__ = ("request_headers", "response_headers", "request_body", "response_body", "request_trailers", "response_trailers", "observability_mode")
    REQUEST_HEADERS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BODY_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BODY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TRAILERS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TRAILERS_FIELD_NUMBER: _ClassVar[int]
    OBSERVABILITY_MODE_FIELD_NUMBER: _ClassVar[int]
    request_headers: HttpHeaders
    response_headers: HttpHeaders
    request_body: HttpBody
    response_body: HttpBody
    request_trailers: HttpTrailers
    response_trailers: HttpTrailers
    observability_mode: bool
    def __init__(self, request_headers: _Optional[_Union[HttpHeaders, _Mapping]] = ..., response_headers: _Optional[_Union[HttpHeaders, _Mapping]] = ..., request_body: _Optional[_Union[HttpBody, _Mapping]] = ..., response_body: _Optional[_Union[HttpBody, _Mapping]] = ..., request_trailers: _Optional[_Union[HttpTrailers, _Mapping]] = ..., response_trailers: _Optional[_Union[HttpTrailers, _Mapping]] = ..., observability_mode: _Optional[bool] = ...) -> None: ...

class ProcessingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
