"""The tap reader's parts that need no Envoy: Envoy's streaming admin output cut into traces,
and a trace turned into an observed call (or an outcome that says why not). What a real Envoy
sends is tests/e2e/test_envoy_observer.py's."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from guard.envoy.tap_filter import TraceStream, observe_trace, tap_request

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


def framed(message: bytes) -> bytes:
    return b"\0" + len(message).to_bytes(4, "big") + message


def headers(**values) -> list[dict]:
    return [{"key": k.replace("_", "-"), "value": v, "raw_value": ""} for k, v in values.items()]


def trace(request: bytes, response: bytes | None, *, status: str = "0", truncated=False,
          trailers_only=False) -> dict:
    answer_headers = {":status": "200", "guard-route": "fallback",
                      "x-envoy-upstream-service-time": "12"}
    if trailers_only:
        answer_headers["grpc-status"] = status
    return {"http_buffered_trace": {
        "request": {"headers": headers(**{":path": MODEL_INFER, "x_request_id": "id-1",
                                          "traceparent": "00-ab-cd-01"}),
                    "body": {"as_bytes": base64.b64encode(request).decode(),
                             "truncated": truncated},
                    "trailers": []},
        "response": {"headers": [{"key": k, "value": v} for k, v in answer_headers.items()],
                     "body": ({"as_bytes": base64.b64encode(response).decode()}
                              if response is not None else {}),
                     "trailers": [] if trailers_only else headers(grpc_status=status)}}}


def as_envoy_writes(traces: list[dict]) -> bytes:
    """As Envoy's streaming admin sink writes them: indented JSON, one after another."""
    return b"\n".join(json.dumps(t, indent=1).encode() for t in traces)


def test_traces_are_cut_out_of_a_stream_split_anywhere(rng):
    traces = [trace(framed(bytes(rng.integers(0, 256, n, dtype=np.uint8))), framed(b"a"))
              for n in (10, 20000, 3)]
    data = as_envoy_writes(traces)
    for _ in range(20):
        cuts = sorted(rng.integers(0, len(data), 6))
        stream, out = TraceStream(limit=1 << 20), []
        for a, b in zip([0, *cuts], [*cuts, len(data)]):
            out += stream.feed(data[a:b])
        assert [json.loads(t) for t in out] == traces


def test_a_stream_that_is_not_envoys_trace_format_is_refused_not_buffered():
    stream = TraceStream(limit=1000)
    with pytest.raises(ValueError, match="without a trace's end"):
        stream.feed(b"{" + b" " * 2000)
    assert stream.feed(as_envoy_writes([{"a": 1}])) == [b'{\n "a": 1\n}']


def test_a_trace_becomes_the_call_the_client_made():
    request = pb.ModelInferRequest(model_name="cnn", id="id-1").SerializeToString()
    response = pb.ModelInferResponse(model_name="cnn", id="id-1").SerializeToString()
    calls = []
    assert observe_trace(trace(framed(request), framed(response)), calls.append) == "complete"
    (call,) = calls
    assert (call.path, call.request_id, call.traceparent, call.route) == (
        MODEL_INFER, "id-1", "00-ab-cd-01", "fallback")
    assert call.request == request and call.response == response
    assert call.grpc_status == 0 and call.seconds == pytest.approx(0.012)


def test_outcomes_of_traces_that_are_not_handed_on():
    request = framed(pb.ModelInferRequest(model_name="cnn").SerializeToString())
    calls = []
    assert observe_trace(trace(request, None, truncated=True), calls.append) == "too_large"
    assert observe_trace(trace(request + request, framed(b"x")), calls.append) == "unsupported"
    assert observe_trace(trace(b"\1" + request[1:], framed(b"x")), calls.append) == \
        "unsupported"  # compressed
    assert observe_trace(trace(request[:-2], framed(b"x")), calls.append) == "error"  # cut
    assert observe_trace({"http_buffered_trace": "?"}, calls.append) == "error"
    assert calls == []
    # A trailers-only answer: its status is in the answer's headers.
    assert observe_trace(trace(request, None, status="3", trailers_only=True),
                         calls.append) == "complete"
    assert calls[0].grpc_status == 3 and calls[0].response == b""


def test_the_tap_taps_what_it_is_given_and_buffers_bodies_up_to_the_bound():
    body = tap_request(1234)
    assert body["config_id"] == "guard"
    # What the sampled twins mark (the only calls whose filters have the tap, where the
    # route is final at the headers; every call's, where it is chosen again from the body).
    assert body["tap_config"]["match"] == {"http_response_headers_match": {"headers": [
        {"name": "guard-sampled", "present_match": True}]}}
    output = body["tap_config"]["output_config"]
    assert output["sinks"] == [{"format": "JSON_BODY_AS_BYTES", "streaming_admin": {}}]
    assert output["max_buffered_rx_bytes"] == output["max_buffered_tx_bytes"] == 1234
