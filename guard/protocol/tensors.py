"""The protocol's ground floor: tensor specs, OIP datatypes and tensors' wire contents.

Used by backends, the serving process and the verifier alike; imports numpy only.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: OIP datatype name (``FP32``...) and shape with -1 for any size."""

    name: str
    datatype: str = ""  # "" when the backend cannot tell (e.g. TorchScript without metadata)
    shape: tuple[int, ...] = ()  # () with datatype "" means unknown



# OIP datatype names <-> numpy dtypes of fixed-size elements. BYTES and BF16 have no such dtype:
# on the wire they are decoded by the helpers below (BYTES to an object array of ``bytes``, BF16
# widened exactly to float32).
OIP_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
NUMPY_TO_OIP: dict[np.dtype, str] = {v: k for k, v in OIP_TO_NUMPY.items()}


def oip_datatype(dtype: np.dtype) -> str:
    """OIP name of a numpy dtype, whatever its byte order (the wire is little-endian); strings,
    bytes and objects are BYTES."""
    name = NUMPY_TO_OIP.get(dtype)  # the common case: a native-order dtype, one dict lookup
    if name is not None:
        return name
    key = np.dtype(dtype)
    if key.kind in "OSU":
        return "BYTES"
    if key.byteorder not in ("=", "|"):
        key = key.newbyteorder("=")
    try:
        return NUMPY_TO_OIP[key]
    except KeyError:
        raise TypeError(f"numpy dtype {dtype} has no Open Inference Protocol datatype") from None


# -- tensors on the wire (OIP requests and responses, capture records) --------------------------
# Caps on what a shape may describe before anything is allocated. Elements: a tensor's bytes are
# bounded by the gRPC message (2 GiB at most), so no real tensor of 1-byte elements has more;
# a zero-sized tensor's other dimensions are held to the same cap (numpy must index them).
MAX_RANK = 32
MAX_ELEMENTS = 1 << 31
_LENGTH = struct.Struct("<I")  # BYTES elements: a little-endian u32 length, then the bytes


def element_count(shape) -> int:
    """Elements of ``shape``; ValueError (a message for the sender) when the shape is
    malformed: too many dimensions, a negative one, or more than MAX_ELEMENTS elements."""
    shape = tuple(shape)
    if len(shape) > MAX_RANK:
        raise ValueError(f"shape has {len(shape)} dimensions, more than {MAX_RANK}")
    count = math.prod(shape)
    if 0 < count <= MAX_ELEMENTS and (not shape or min(shape) > 0):  # the common case
        return count
    if shape and min(shape) < 0:
        raise ValueError(f"shape {list(shape)} has a negative dimension")
    if math.prod(d for d in shape if d) > MAX_ELEMENTS:
        raise ValueError(f"shape {list(shape)} describes more than {MAX_ELEMENTS} elements")
    return count


def decode_bytes_elements(raw: bytes, count: int) -> np.ndarray:
    """``count`` BYTES elements from Triton's raw encoding (u32 length + bytes, each) as a 1-D
    object array of ``bytes``; ValueError when ``raw`` does not hold exactly that."""
    if count * _LENGTH.size > len(raw):
        raise ValueError(f"{len(raw)} bytes cannot hold {count} BYTES elements "
                         f"({_LENGTH.size}-byte length each)")
    out = np.empty(count, dtype=object)
    view, pos = memoryview(raw), 0
    for i in range(count):
        if pos + _LENGTH.size > len(raw):
            raise ValueError(f"BYTES contents end before element {i} of {count}")
        (length,) = _LENGTH.unpack_from(raw, pos)
        pos += _LENGTH.size
        if pos + length > len(raw):
            raise ValueError(f"BYTES element {i} of {length} bytes runs past the contents")
        out[i] = bytes(view[pos:pos + length])
        pos += length
    if pos != len(raw):
        raise ValueError(f"{len(raw) - pos} bytes left after {count} BYTES elements")
    return out


def widen_bf16(raw: bytes) -> np.ndarray:
    """Little-endian bfloat16 values as float32: exact (bf16 is float32's top 16 bits)."""
    if len(raw) % 2:
        raise ValueError(f"{len(raw)} bytes is not a whole number of BF16 values")
    halves = np.frombuffer(raw, dtype="<u2").astype(np.uint32)
    return (halves << 16).view(np.float32)


def wire_contents(array: np.ndarray) -> tuple[str, bytes]:
    """(OIP datatype, raw contents) of an array: little-endian elements, or Triton's BYTES
    encoding for strings, bytes and objects (str is sent as UTF-8)."""
    array = np.asarray(array)
    datatype = oip_datatype(array.dtype)
    if datatype == "BYTES":
        parts = []
        for item in array.ravel():
            if isinstance(item, str):
                item = item.encode()
            if not isinstance(item, (bytes, bytearray, np.bytes_)):
                raise TypeError(f"a BYTES tensor holds a {type(item).__name__}, not bytes/str")
            parts += [_LENGTH.pack(len(item)), bytes(item)]
        return datatype, b"".join(parts)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return datatype, np.ascontiguousarray(array).tobytes()
