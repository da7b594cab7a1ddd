"""A sampled call (``Sample``) as bytes in the sample ring, and back: a fixed header, a few
strings, then the payload. The record encodes exactly a ``Sample``: ``decode(encode(s))`` equals
``s`` (with ``size``, the record's length, filled in). No pickle: the verifier never executes
anything a record says, and a record is only ever read as data.

A sample's payload is one of three kinds, each answering ``request()`` (the inputs and the
outputs the client asked for) and ``answer()`` (the primary's outputs) the same way:

- ``Tensors``: a local backend's answer, inputs and outputs as (name, dtype, shape, raw bytes);
- ``Messages``: an upstream's answer (and a tap observation) as the serialized OIP messages, so
  the serving process never decodes an answer it only forwarded: the verifier decodes them
  (``guard.protocol.codec``) when it checks the sample;
- ``Generation``: an LLM call (guard/protocol/generation.py ``GenerationSample``: prompt,
  completion tokens and logprobs, sampling parameters), as UTF-8 JSON: it is text, and a JSON
  body is what it came as.

The tensors' bytes are not copied into an intermediate buffer: ``encode`` returns a list of
parts (small headers and memoryviews of the arrays) that the ring copies in once.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, replace
from typing import Mapping, Union

import numpy as np

from guard.protocol import generation

MIRROR, CAPTURE = 1, 2  # flags: hand to the mirror; record it (capture mode "all")
TENSORS, MESSAGES, GENERATION = 0, 1, 2  # payload kinds

# flags, route (0 primary / 1 fallback), payload kind, slot, epoch, unix ns, request seconds
_FIXED = struct.Struct("<BBBxHxxQQd")
_U16 = struct.Struct("<H")
_TENSOR = struct.Struct("<HBB")  # name length, dtype length, ndim
_U64 = struct.Struct("<Q")
_OBJECT = "|O"  # BYTES tensors: elements as u32-length-prefixed byte strings
Arrays = Mapping[str, np.ndarray]


class NotTensors(ValueError):
    """A payload that has no tensors to compare (an LLM call: the generation tier's)."""


@dataclass(frozen=True, slots=True)
class Tensors:
    """A local backend's answer: every input and every output (all are compared)."""

    inputs: Arrays
    outputs: Arrays
    kind = TENSORS

    def request(self) -> tuple[Arrays, tuple[str, ...]]:
        return self.inputs, ()

    def answer(self) -> Arrays:
        return self.outputs


@dataclass(frozen=True, slots=True)
class Messages:
    """The serialized OIP ``ModelInferRequest`` and ``ModelInferResponse`` (an upstream's
    answer, a tap observation); the serving process may hand message objects, serialized only
    when the sample is encoded."""

    request_message: bytes
    response_message: bytes
    kind = MESSAGES

    def request(self) -> tuple[Arrays, tuple[str, ...]]:
        """The inputs, and the outputs the request asked for (an upstream answered just
        those, so only they are compared)."""
        from tritonclient.grpc import service_pb2 as pb

        from guard.protocol.codec import decode_request

        decoded = decode_request(pb.ModelInferRequest.FromString(self.request_message))
        return decoded.inputs, tuple(decoded.requested_outputs)

    def answer(self) -> Arrays:
        from tritonclient.grpc import service_pb2 as pb

        from guard.protocol.codec import decode_response

        return decode_response(pb.ModelInferResponse.FromString(self.response_message))


@dataclass(frozen=True, slots=True)
class Generation:
    """One LLM call (prompt, completion tokens with their logprobs, sampling parameters)."""

    call: generation.GenerationSample
    kind = GENERATION

    def request(self) -> tuple[Arrays, tuple[str, ...]]:
        raise NotTensors("an LLM call carries no tensors (the generation tier checks it)")

    def answer(self) -> Arrays:
        raise NotTensors("an LLM call carries no tensors (the generation tier checks it)")


Payload = Union[Tensors, Messages, Generation]


@dataclass(frozen=True, slots=True)
class Sample:
    """One sampled call, as a serving process hands it off and the verifier reads it."""

    model: str
    slot: int  # the model's route slot (guard/ipc/routes.py)
    route: str  # "primary" or "fallback": what answered the client
    epoch: int  # the route policy's epoch when it was routed
    flags: int  # MIRROR and/or CAPTURE
    request_id: str
    traceparent: str  # W3C trace context ("" without tracing)
    request_seconds: float  # the call as the serving process timed it
    payload: Payload
    unix_nanos: int = 0  # when it was handed off (stamped by ``hand_off``)
    size: int = 0  # the record's bytes (set by ``decode``: the queues' byte budgets)


def _string(value: str) -> bytes:
    data = value.encode()
    return _U16.pack(len(data)) + data


def _tensor_parts(name: str, array: np.ndarray, parts: list) -> None:
    array = np.asarray(array)
    data: bytes | memoryview
    if array.dtype == object:
        items = [v if isinstance(v, bytes) else str(v).encode() for v in array.ravel()]
        data = b"".join(struct.pack("<I", len(v)) + v for v in items)
        dtype = _OBJECT
    else:
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data  # (a memoryview)
        dtype = array.dtype.str
    encoded = name.encode()
    parts.append(_TENSOR.pack(len(encoded), len(dtype), array.ndim) + encoded + dtype.encode()
                 + struct.pack(f"<{array.ndim}Q", *array.shape) + _U64.pack(len(data)))
    parts.append(data)


def encode(sample: Sample) -> list:
    """The parts of one record, for ``SampleRing.put``."""
    payload = sample.payload
    kind = payload.kind
    head = (_FIXED.pack(sample.flags, 1 if sample.route == "fallback" else 0, kind, sample.slot,
                        sample.epoch, sample.unix_nanos, sample.request_seconds)
            + _string(sample.model) + _string(sample.request_id) + _string(sample.traceparent))
    parts: list = [head]
    if isinstance(payload, Tensors):
        for group in (payload.inputs, payload.outputs):
            parts.append(_U16.pack(len(group)))
            for name, array in group.items():
                _tensor_parts(name, array, parts)
    elif isinstance(payload, Messages):
        for message in (payload.request_message, payload.response_message):
            data = _serialized(message)
            parts += [_U64.pack(len(data)), data]
    else:
        data = json.dumps(generation.to_dict(payload.call), ensure_ascii=False,
                          separators=(",", ":")).encode()
        parts += [_U64.pack(len(data)), data]
    return parts


def _serialized(message) -> bytes | bytearray | memoryview:
    if isinstance(message, (bytes, bytearray, memoryview)):
        return message
    return message.SerializeToString() if message is not None else b""


def hand_off(ring, sample: Sample, mirror_dropped=None, capture_dropped=None) -> bool:
    """``sample`` into ``ring`` (a ``SampleRing``), stamped now; True when it went in.

    The one hand-off every producer shares (the data plane's ``ServedModel.hand_off``, the Tap
    service, Envoy mode's observer hand-off): a full ring never waits, it drops the sample and
    counts it on ``mirror_dropped`` / ``capture_dropped`` (counters with ``inc()``, or None),
    the one for each flag the sample carried."""
    if ring.put(encode(replace(sample, unix_nanos=time.time_ns()))):
        return True
    if sample.flags & MIRROR and mirror_dropped is not None:
        mirror_dropped.inc()
    if sample.flags & CAPTURE and capture_dropped is not None:
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


def decode(data: bytes) -> Sample:
    """The ``Sample`` a record holds; ValueError for a record that is not one."""
    reader = _Reader(data)
    flags, route, kind, slot, epoch, unix_nanos, seconds = reader.unpack(_FIXED)
    model, request_id, traceparent = reader.string(), reader.string(), reader.string()
    payload: Payload
    if kind == TENSORS:
        inputs = reader.tensors()
        payload = Tensors(inputs, reader.tensors())
    elif kind == MESSAGES:
        (n,) = reader.unpack(_U64)
        request = reader.bytes(n)
        (n,) = reader.unpack(_U64)
        payload = Messages(request, reader.bytes(n))
    elif kind == GENERATION:
        (n,) = reader.unpack(_U64)
        body = reader.bytes(n)
        try:
            payload = Generation(generation.from_dict(json.loads(body)))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"generation record: not JSON: {exc}") from None
    else:
        raise ValueError(f"unknown payload kind {kind}")
    return Sample(model, slot, "fallback" if route else "primary", epoch, flags, request_id,
                  traceparent, seconds, payload, unix_nanos, len(data))
