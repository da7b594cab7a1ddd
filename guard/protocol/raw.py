"""Serialized ``ModelInferRequest``/``ModelInferResponse`` bytes, read and edited without a
parse: the upstream path forwards a client's bytes and the upstream's answer as they are.

Protocol buffers allow both tricks used here: a reader walks fields by tag and length without
building objects, and for a singular field the *last* occurrence wins when a message is parsed
(and concatenated messages merge), so appending ``model_name`` re-addresses a request, and
appending a ``parameters`` map entry adds ``guard_route`` to a response, byte for byte
otherwise unchanged. Triton (C++ protobuf), MLServer and KServe (Python protobuf) all parse by
these rules.
"""

from __future__ import annotations

# ModelInferRequest / ModelInferResponse field numbers (grpc_service.proto).
MODEL_NAME, MODEL_VERSION, ID = 1, 2, 3
_LENGTH_DELIMITED, _VARINT, _FIXED64, _FIXED32 = 2, 0, 1, 5


class MalformedMessage(ValueError):
    pass


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise MalformedMessage("truncated varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def peek(data: bytes) -> tuple[str, str, str]:
    """(model_name, model_version, id) of a serialized request, as a parser would see them
    (last occurrence wins); other fields are skipped by their length, never copied."""
    found = {MODEL_NAME: b"", MODEL_VERSION: b"", ID: b""}
    at, end = 0, len(data)
    while at < end:
        key, at = _varint(data, at)
        number, wire_type = key >> 3, key & 7
        if wire_type == _LENGTH_DELIMITED:
            length, at = _varint(data, at)
            if at + length > end:
                raise MalformedMessage("field runs past the end of the message")
            if number in found:
                found[number] = data[at:at + length]
            at += length
        elif wire_type == _VARINT:
            _, at = _varint(data, at)
        elif wire_type == _FIXED64:
            at += 8
        elif wire_type == _FIXED32:
            at += 4
        else:
            raise MalformedMessage(f"unsupported wire type {wire_type}")
    if at != end:
        raise MalformedMessage("truncated field")
    try:
        return found[MODEL_NAME].decode(), found[MODEL_VERSION].decode(), found[ID].decode()
    except UnicodeDecodeError:
        raise MalformedMessage("a string field is not UTF-8") from None


def string_field(number: int, value: str) -> bytes:
    """One length-delimited field, also when ``value`` is empty (which then clears the field:
    a serializer would omit it)."""
    encoded = value.encode()
    length, out = len(encoded), bytearray([(number << 3) | _LENGTH_DELIMITED])
    while length >= 0x80:
        out.append((length & 0x7F) | 0x80)
        length >>= 7
    out.append(length)
    return bytes(out) + encoded
