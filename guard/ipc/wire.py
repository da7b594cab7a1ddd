"""A sampled request as bytes in the sample ring, and back: a fixed header, a few strings, then
the tensors as (name, dtype, shape, raw bytes). No pickle: the verifier never executes anything
a record says, and a record is only ever read as data.

A local backend's answer travels as tensors. An upstream's answer (and a tap observation)
travels as the serialized protocol messages, so the serving process never decodes an answer it
only forwarded: the verifier decodes it (``guard.protocol.codec``) when it checks the sample.

The tensors' bytes are not copied into an intermediate buffer: ``encode`` returns a list of
parts (small headers and memoryviews of the arrays) that the ring copies in once.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field

import numpy as np

MIRROR, CAPTURE = 1, 2  # flags: hand to the mirror; record it (capture mode "all")
TENSORS, MESSAGES = 0, 1  # payload kinds

# flags, route (0 primary / 1 fallback), payload kind, slot, epoch, unix ns, request seconds
_FIXED = struct.Struct("<BBBxHxxQQd")
_U16 = struct.Struct("<H")
_TENSOR = struct.Struct("<HBB")  # name length, dtype length, ndim
_U64 = struct.Struct("<Q")
_OBJECT = "|O"  # BYTES tensors: elements as u32-length-prefixed byte strings


@dataclass
class HandedSample:
    """A record decoded in the verifier."""

    flags: int
    route: str
    slot: int
    epoch: int
    unix_nanos: int
    request_seconds: float
    model: str
    request_id: str
    traceparent: str
    requested_outputs: tuple[str, ...]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: dict[str, np.ndarray] | None = None  # TENSORS
    request_message: bytes = b""  # MESSAGES: a serialized ModelInferRequest...
    response_message: bytes = b""  # ...and ModelInferResponse
    size: int = 0


def _string(value: str) -> bytes:
    data = value.encode()
    return _U16.pack(len(data)) + data


def _tensor_parts(name: str, array: np.ndarray, parts: list) -> None:
    array = np.asarray(array)
    if array.dtype == object:
        items = [v if isinstance(v, bytes) else str(v).encode() for v in array.ravel()]
        data = b"".join(struct.pack("<I", len(v)) + v for v in items)
        dtype = _OBJECT
    else:
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        dtype = array.dtype.str
    encoded = name.encode()
    parts.append(_TENSOR.pack(len(encoded), len(dtype), array.ndim) + encoded + dtype.encode()
                 + struct.pack(f"<{array.ndim}Q", *array.shape) + _U64.pack(len(data)))
    parts.append(data)


def encode(flags: int, route: str, slot: int, epoch: int, unix_nanos: int,
           request_seconds: float, model: str, request_id: str, traceparent: str,
           requested_outputs, inputs: dict | None = None, outputs: dict | None = None,
           request_message: bytes = b"", response_message: bytes = b"") -> list:
    """The parts of one record, for ``SampleRing.put``."""
    kind = TENSORS if outputs is not None else MESSAGES
    head = (_FIXED.pack(flags, 1 if route == "fallback" else 0, kind, slot, epoch, unix_nanos,
                        request_seconds)
            + _string(model) + _string(request_id) + _string(traceparent)
            + _string("\0".join(requested_outputs or ())))
    parts: list = [head]
    if kind == TENSORS:
        for group in (inputs, outputs):
            parts.append(_U16.pack(len(group)))
            for name, array in group.items():
                _tensor_parts(name, array, parts)
    else:
        parts += [_U64.pack(len(request_message)), request_message,
                  _U64.pack(len(response_message)), response_message]
    return parts


def hand_off(ring, flags: int, route: str, slot: int, epoch: int, request_seconds: float,
             model: str, request_id: str, traceparent: str, inputs: dict | None = None,
             outputs: dict | None = None, request_message: bytes = b"",
             response_message: bytes = b"", mirror_dropped=None, capture_dropped=None) -> bool:
    """One sample into ``ring`` (a ``SampleRing``), stamped now; True when it went in.

    The one hand-off both producers share (the data plane's ``ServedModel.after_response``
    and Envoy mode's observer hand-off): a full ring never waits, it drops the sample and counts
    it on ``mirror_dropped`` / ``capture_dropped`` (counters with ``inc()``, or None), the one
    for each flag the sample carried."""
    parts = encode(flags, route, slot, epoch, time.time_ns(), request_seconds, model,
                   request_id, traceparent, (), inputs, outputs, request_message,
                   response_message)
    if ring.put(parts):
        return True
    if flags & MIRROR and mirror_dropped is not None:
        mirror_dropped.inc()
    if flags & CAPTURE and capture_dropped is not None:
        capture_dropped.inc()
    return False


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def unpack(self, fmt: struct.Struct) -> tuple:
        values = fmt.unpack_from(self.data, self.at)
        self.at += fmt.size
        return values

    def bytes(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise ValueError("record truncated")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def string(self) -> str:
        (n,) = self.unpack(_U16)
        return self.bytes(n).decode()

    def tensor(self) -> tuple[str, np.ndarray]:
        # One bounds check per tensor and no copy of its bytes: the array is a view on the
        # record (this runs for every sample the verifier takes).
        data, at = self.data, self.at
        name_len, dtype_len, ndim = _TENSOR.unpack_from(data, at)
        at += _TENSOR.size
        names_end = at + name_len + dtype_len
        if names_end > len(data):
            raise ValueError("record truncated")
        name = data[at:at + name_len].decode()
        dtype = data[at + name_len:names_end].decode()
        shape = struct.unpack_from(f"<{ndim}Q", data, names_end)
        at = names_end + 8 * ndim
        (nbytes,) = _U64.unpack_from(data, at)
        start = at + _U64.size
        self.at = end = start + nbytes
        if end > len(data):
            raise ValueError("record truncated")
        if dtype == _OBJECT:
            items, at = [], start
            while at < end:
                (n,) = struct.unpack_from("<I", data, at)
                items.append(data[at + 4:at + 4 + n])
                at += 4 + n
            return name, np.array(items, dtype=object).reshape(shape)
        numpy_dtype = np.dtype(dtype)
        array = np.frombuffer(data, dtype=numpy_dtype, count=nbytes // numpy_dtype.itemsize,
                              offset=start)
        return name, array.reshape(shape)

    def tensors(self) -> dict[str, np.ndarray]:
        (count,) = self.unpack(_U16)
        return dict(self.tensor() for _ in range(count))


def decode(data: bytes) -> HandedSample:
    reader = _Reader(data)
    flags, route, kind, slot, epoch, unix_nanos, seconds = reader.unpack(_FIXED)
    model, request_id, traceparent, requested = (reader.string(), reader.string(),
                                                 reader.string(), reader.string())
    sample = HandedSample(flags, "fallback" if route else "primary", slot, epoch, unix_nanos,
                          seconds, model, request_id, traceparent,
                          tuple(requested.split("\0")) if requested else (), size=len(data))
    if kind == TENSORS:
        sample.inputs = reader.tensors()
        sample.outputs = reader.tensors()
    else:
        (n,) = reader.unpack(_U64)
        sample.request_message = reader.bytes(n)
        (n,) = reader.unpack(_U64)
        sample.response_message = reader.bytes(n)
    return sample
