"""guard/protocol/raw.py: reading and re-addressing serialized OIP messages agrees with
protobuf's own parser, and bad bytes are a MalformedMessage, never another exception."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from guard.protocol import raw


def _request(rng: random.Random) -> pb.ModelInferRequest:
    text = lambda: "".join(rng.choice("abcé_-9/") for _ in range(rng.randrange(0, 40)))  # noqa: E731
    request = pb.ModelInferRequest(model_name=text(), model_version=text(), id=text())
    request.parameters["p"].int64_param = rng.randrange(-5, 2**40)
    for i in range(rng.randrange(0, 3)):
        tensor = request.inputs.add(name=f"in{i}", datatype="FP32", shape=[1, rng.randrange(300)])
        tensor.contents.fp32_contents.extend([1.5] * rng.randrange(3))
        request.raw_input_contents.append(np.ones(rng.randrange(2000), np.float32).tobytes())
    return request


def test_peek_agrees_with_the_parser_on_seeded_messages():
    rng = random.Random(11)
    for _ in range(300):
        request = _request(rng)
        data = request.SerializeToString()
        assert raw.peek(data) == (request.model_name, request.model_version, request.id)
        # Concatenated messages merge, last field wins: so does peek.
        other = _request(rng)
        merged = pb.ModelInferRequest.FromString(data + other.SerializeToString())
        assert raw.peek(data + other.SerializeToString()) == (
            merged.model_name, merged.model_version, merged.id)


def test_readdressing_by_appending_changes_only_the_model():
    request = _request(random.Random(3))
    request.model_name, request.model_version = "client-name", "7"
    data = request.SerializeToString()
    moved = pb.ModelInferRequest.FromString(
        data + raw.string_field(raw.MODEL_NAME, "upstream-name")
        + raw.string_field(raw.MODEL_VERSION, ""))
    assert (moved.model_name, moved.model_version) == ("upstream-name", "")
    moved.model_name, moved.model_version = request.model_name, request.model_version
    assert moved == request
    long_name = "x" * 300  # a length that needs a two-byte varint
    assert pb.ModelInferRequest.FromString(
        data + raw.string_field(raw.MODEL_NAME, long_name)).model_name == long_name


@pytest.mark.parametrize("seed", range(5))
def test_random_and_truncated_bytes_are_malformed_or_parsed_never_a_crash(seed):
    rng = random.Random(seed)
    valid = _request(rng).SerializeToString()
    samples = [rng.randbytes(rng.randrange(1, 64)) for _ in range(300)]
    samples += [valid[:cut] for cut in range(1, len(valid), max(1, len(valid) // 50))]
    for data in samples:
        try:
            raw.peek(data)
        except raw.MalformedMessage:
            pass
