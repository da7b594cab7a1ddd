"""CaptureRecord messages <-> numpy arrays and guard's own result types."""

from __future__ import annotations

import json
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from guard.backends.base import (
    OIP_TO_NUMPY,
    BackendInfo,
    decode_bytes_elements,
    element_count,
    wire_contents,
)
from guard.protocol.generation import GenerationSample, from_dict, to_dict
from guard.protocol.openai.json_edits import read_json
from guard.v1 import capture_pb2 as pb

# A generative model's record: the sampled call (guard/protocol/generation.py, as UTF-8 JSON
# with its format_version) is the input of this name, one BYTES element; when the verifier
# compared a probe of the primary instead (the fallback answered the client), the probe's
# completion is the output of the other name. The call holds no HTTP header: nothing of a
# client's Authorization can be stored.
GENERATION_INPUT = "generation_sample_json"
PROBED_OUTPUT = "probed_sample_json"


def tensor_to_proto(name: str, array: np.ndarray, out: pb.Tensor) -> None:
    array = np.asarray(array)
    out.name = name
    out.datatype, out.raw = wire_contents(array)
    out.shape.extend(array.shape)


def add_tensors(field, arrays: Mapping[str, np.ndarray]) -> None:
    for name, array in arrays.items():
        tensor_to_proto(name, array, field.add())


class RecordError(ValueError):
    """A record that parsed but cannot be turned back into arrays (bad datatype, shape or
    size): the record is damaged, never a crash of its reader."""


def tensor_from_proto(tensor: pb.Tensor) -> np.ndarray:
    """The array of a record's tensor; anything malformed (an overflowing or negative shape
    included) raises RecordError, checked before anything is allocated."""
    where = f"tensor '{tensor.name}'"
    try:
        count = element_count(tensor.shape)
    except ValueError as exc:
        raise RecordError(f"{where}: {exc}") from None
    shape = tuple(tensor.shape)
    raw = tensor.raw  # each read of a bytes field builds a new bytes object: read it once
    if tensor.datatype == "BYTES":
        try:
            return decode_bytes_elements(raw, count).reshape(shape)
        except ValueError as exc:
            raise RecordError(f"{where}: {exc}") from None
    dtype = OIP_TO_NUMPY.get(tensor.datatype)
    if dtype is None:
        raise RecordError(f"{where}: unknown datatype '{tensor.datatype}'")
    if len(raw) != count * dtype.itemsize:
        raise RecordError(f"{where}: {len(raw)} bytes for shape "
                          f"{list(shape)} x {tensor.datatype}")
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(shape)


def tensors(field) -> dict[str, np.ndarray]:
    return {t.name: tensor_from_proto(t) for t in field}


def describe_backends(out, backends: Mapping[str, BackendInfo]) -> None:
    for role, info in backends.items():
        out.add(role=role, backend=info.backend, artifact=info.artifact,
                precision=info.precision, device=info.device)


class Verdict(Protocol):
    """One tier's report as a record keeps it: the shape of ``guard.verify.pipeline.TierReport``
    (a generative model's ``GenerationReport`` has it too)."""

    @property
    def passed(self) -> bool: ...
    @property
    def summary(self) -> str: ...
    @property
    def outputs(self) -> Sequence[Any]: ...  # the tensor tier's per-output checks
    @property
    def details(self) -> Mapping[str, Any]: ...


def add_tier_verdicts(out, results: Mapping[str, Verdict]) -> None:
    """Per-tier results from ``Comparator.tier_reports`` into ``TierVerdict`` messages."""
    for tier, result in results.items():
        verdict = out.add(tier=tier, passed=result.passed, summary=result.summary)
        for o in result.outputs:
            verdict.outputs.add(
                name=o.name, passed=o.passed, reason=o.reason, max_abs=o.max_abs,
                mean_abs=o.mean_abs, p99_abs=o.p99_abs, max_rel=o.max_rel,
                cosine_distance=o.cosine_distance, allowed=o.allowed,
            )
        if result.details:
            verdict.details_json = json.dumps(result.details, default=float, sort_keys=True)


def parse_record(payload: bytes) -> pb.CaptureRecord:
    record = pb.CaptureRecord()
    record.ParseFromString(payload)
    return record


def live_passed(record: pb.CaptureRecord) -> bool | None:
    """The sidecar's verdict on this record (all tiers), or None when it was not checked."""
    if not record.verdicts:
        return None
    return all(v.passed for v in record.verdicts)


def generation_tensor(sample: GenerationSample) -> np.ndarray:
    """A sampled LLM call as a record's tensor (one BYTES element of UTF-8 JSON)."""
    data = json.dumps(to_dict(sample), ensure_ascii=False).encode()
    return np.array([data], dtype=object)


def is_generation(record: pb.CaptureRecord) -> bool:
    return any(t.name == GENERATION_INPUT for t in record.inputs)


def _call(tensor: pb.Tensor) -> GenerationSample:
    array = tensor_from_proto(tensor)
    if array.size != 1 or not isinstance(array.flat[0], bytes):
        raise RecordError(f"tensor '{tensor.name}': expected one BYTES element")
    try:
        return from_dict(read_json(array.flat[0]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"tensor '{tensor.name}': not JSON: {exc}") from None
    except (ValueError, TypeError, KeyError) as exc:  # a field from_dict refuses
        raise RecordError(f"tensor '{tensor.name}': {exc}") from None


def generation_calls(record: pb.CaptureRecord) -> tuple[GenerationSample, GenerationSample | None]:
    """A generative record's call as the client made it and the primary's probed completion
    that was compared instead (None when the call's own answer was the one compared).
    RecordError for a damaged one, or one a newer guard wrote (its ``format_version``)."""
    call = next((t for t in record.inputs if t.name == GENERATION_INPUT), None)
    if call is None:
        raise RecordError(f"no input '{GENERATION_INPUT}': not a generative model's record")
    probed = next((t for t in record.outputs if t.name == PROBED_OUTPUT), None)
    return _call(call), None if probed is None else _call(probed)
