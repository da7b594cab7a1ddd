"""Re-export: the OIP codec moved to the protocol's ground floor (guard/protocol/codec.py),
used by backends and serve alike. Existing imports keep working."""

from guard.protocol.codec import (  # noqa: F401
    InferenceError,
    InferenceRequest,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
    invalid,
)
