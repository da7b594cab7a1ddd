"""The observer's gRPC framing: bodies cut anywhere by Envoy give back the exact messages."""

from __future__ import annotations

import pytest

from guard.envoy.observer import FramingError, UnsupportedMessage, grpc_messages


def framed(*messages: bytes, compressed: bool = False) -> bytes:
    return b"".join(bytes([compressed]) + len(m).to_bytes(4, "big") + m for m in messages)


def cut(data: bytes, points) -> list[bytes]:
    points = sorted(set(points))
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


def test_one_message_in_one_chunk():
    assert grpc_messages([framed(b"hello")]) == [b"hello"]


def test_messages_spanning_chunks_cut_anywhere(rng):
    messages = [rng.bytes(n) for n in (0, 1, 4, 5, 16384, 40000, 7)]
    data = framed(*messages)
    for _ in range(50):
        points = rng.integers(1, len(data), size=rng.integers(1, 40))
        assert grpc_messages(cut(data, points)) == messages
    # Cuts inside every prefix byte.
    assert grpc_messages(cut(data, range(1, 12))) == messages


def test_16k_chunks_of_a_large_message(rng):
    message = rng.bytes(100_000)
    data = framed(message)
    chunks = [data[i:i + 16384] for i in range(0, len(data), 16384)]
    assert len(chunks) == 7 and grpc_messages(chunks) == [message]


@pytest.mark.parametrize("data", [framed(b"abc")[:-1], framed(b"abc") + b"\0\0", b"\0\0\0"],
                         ids=["message-cut-short", "prefix-cut-short", "prefix-only"])
def test_truncated_bodies_are_framing_errors(data):
    with pytest.raises(FramingError, match="cut short|body ends"):
        grpc_messages(cut(data, [1]) if len(data) > 1 else [data])


def test_compressed_messages_are_unsupported():
    with pytest.raises(UnsupportedMessage, match="compressed"):
        grpc_messages([framed(b"x", compressed=True)])


def test_empty_body_has_no_messages():
    assert grpc_messages([b""]) == []
    assert grpc_messages([framed(b"")]) == [b""]
