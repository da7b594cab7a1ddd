"""HTTP errors of the OpenAI-compatible edge: OpenAI's error body, and the gRPC status name of
an HTTP status (the ``code`` label), so that the OIP and the HTTP data planes share one
vocabulary and one alert."""

from __future__ import annotations

import json


# HTTP status -> gRPC status name (google.rpc.Code's HTTP mapping), for the ``code`` label of
# guard_request_errors_total: one vocabulary for the OIP and the HTTP data planes.
_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
          404: "NOT_FOUND", 408: "DEADLINE_EXCEEDED", 409: "ABORTED", 413: "RESOURCE_EXHAUSTED",
          429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 501: "UNIMPLEMENTED",
          502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def status_code_name(status: int) -> str:
    """The gRPC status name of an HTTP error status (the ``code`` label)."""
    if status in _CODES:
        return _CODES[status]
    return "FAILED_PRECONDITION" if 400 <= status < 500 else "INTERNAL" if status == 500 \
        else "UNKNOWN"


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> bytes:
    """OpenAI's error JSON shape."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": code}}).encode()
