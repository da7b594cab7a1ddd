"""guard/ipc/: the route table, the sample ring, the record layout, each through a second
mapping of the same shared memory (as the verifier process maps it), and the control channel
with its typed messages."""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import socket
import threading

import numpy as np
import pytest

from guard.config import BackendConfig, ConfigContext
from guard.ipc import messages, routes, wire
from guard.ipc.channel import Channel, ChannelClosed
from guard.ipc.config import backend_from_wire, backend_to_wire
from guard.ipc.messages import (Done, Event, Exposition, Failed, Handlers, Metrics, SetRoute,
                                Status, UsePrimary)
from guard.ipc.ring import SampleRing


# -- route words -----------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["primary", "fallback"])
@pytest.mark.parametrize("probing", [False, True])
@pytest.mark.parametrize("epoch", [0, 1, 255, 2**40])
@pytest.mark.parametrize("override", ["auto", "primary", "fallback"])
def test_route_word_round_trip(route, probing, epoch, override):
    word = routes.pack(route, probing, epoch, override)
    assert routes.unpack(word) == (route, probing, epoch)
    assert routes.override_of(word) == override


def test_route_words_written_in_one_mapping_are_read_in_another():
    table = routes.RouteTable(capacity=8)
    other = routes.RouteTable.attach(os.dup(table.block.fd), 8)
    slots = table.assign(["a", "b"])
    assert slots["a"] != slots["b"]
    other.publish(slots["b"], "fallback", True, 7)
    assert table.read(slots["b"]) == ("fallback", True, 7)
    assert table.read(slots["a"]) == ("primary", False, 0)
    other.beat(123, 456)
    assert table.heartbeat() == (123, 456)
    assert table.assign(["a", "c"])["a"] == slots["a"]  # slots are stable
    with pytest.raises(ValueError):
        table.assign([f"m{i}" for i in range(9)])
    other.close()
    table.close()


# -- the ring --------------------------------------------------------------------------------------
def _ring_pair(capacity: int) -> tuple[SampleRing, SampleRing]:
    producer = SampleRing(capacity)
    return producer, SampleRing.attach(os.dup(producer.block.fd), capacity)


def test_ring_round_trips_records_across_mappings_in_order_with_wraps():
    """A seeded random mix of puts and takes against a plain deque: every record comes out
    once, intact and in order, across many wrap-arounds; a put that does not fit writes
    nothing."""
    producer, consumer = _ring_pair(4096)
    rng = random.Random(7)
    model: collections.deque[bytes] = collections.deque()
    refused = 0
    for step in range(5000):
        if rng.random() < 0.55:
            data = rng.randbytes(rng.randrange(0, 900))
            parts = [data[:len(data) // 3], memoryview(data)[len(data) // 3:]]
            if producer.put(parts):
                model.append(data)
            else:
                refused += 1
        else:
            got = consumer.take()
            assert got == (model.popleft() if model else None), step
    while model:
        assert consumer.take() == model.popleft()
    assert consumer.take() is None and producer.used == 0
    assert refused > 0  # the budget was reached and honoured
    producer.close()
    consumer.close()


def test_full_ring_refuses_without_waiting_and_frees_as_it_is_read():
    producer, consumer = _ring_pair(1024)
    record = [bytes(200)]
    taken = 0
    while producer.put(record):
        taken += 1
    assert taken == 1024 // 208  # 8-byte header + 200 bytes each
    assert not producer.put([bytes(2000)])  # larger than the ring: never fits
    assert consumer.take() == bytes(200)
    assert producer.put(record)


# -- records ---------------------------------------------------------------------------------------
def test_record_round_trip_keeps_every_tensor_bit_for_bit():
    rng = np.random.default_rng(3)
    inputs = {"x": rng.standard_normal((2, 3)).astype(np.float32),
              "ids": rng.integers(-5, 5, (4,)).astype(np.int64),
              "mask": np.array([[True, False]]),
              "half": rng.standard_normal((3,)).astype(np.float16),
              "empty": np.zeros((0, 5), np.float32),
              "big_endian": np.arange(3, dtype=">i4"),
              "strided": rng.standard_normal((4, 4)).astype(np.float64)[:, ::2]}
    outputs = {"labels": np.array([[b"cat", b""], [b"\x00dog", b"e"]], dtype=object),
               "logits": rng.standard_normal((2, 10)).astype(np.float32)}
    sent = wire.Sample("m", 5, "fallback", 2**33, wire.MIRROR | wire.CAPTURE, "req-1",
                       "00-abc-def-01", 0.25, wire.Tensors(inputs, outputs), unix_nanos=99)
    data = b"".join(bytes(p) for p in wire.encode(sent))
    sample = wire.decode(data)
    # The record is exactly the Sample: every field comes back, the record's size added.
    assert sample.payload.kind == wire.TENSORS and sample.size == len(data)
    assert dataclasses.replace(sample, payload=sent.payload, size=0) == sent
    assert sample.payload.request() == (sample.payload.inputs, ())
    for sent_group, got in ((inputs, sample.payload.inputs), (outputs, sample.payload.answer())):
        assert list(got) == list(sent_group)
        for name in sent_group:
            assert got[name].shape == sent_group[name].shape
            assert np.array_equal(got[name], np.asarray(sent_group[name])), name
            if sent_group[name].dtype != object:
                assert got[name].dtype == sent_group[name].dtype.newbyteorder("<")


def _sample(payload, flags=wire.MIRROR, **fields) -> wire.Sample:
    return wire.Sample(**{"model": "m", "slot": 0, "route": "primary", "epoch": 1,
                          "flags": flags, "request_id": "", "traceparent": "",
                          "request_seconds": 0.0, "payload": payload, **fields})


def test_record_of_protocol_messages_keeps_the_bytes_and_decodes_them_when_asked():
    from tritonclient.grpc import service_pb2 as oip

    from guard.protocol.codec import InferenceRequest, encode_response

    request = oip.ModelInferRequest(model_name="m", id="r-1")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    tensor.contents.fp32_contents.extend([1.0, 2.0])
    request.outputs.add(name="y")  # the client asked for y only
    response = encode_response(InferenceRequest("m", "", "r-1", {}),
                               {"y": np.array([[3.0]], np.float32)}, "primary")
    # Message objects are serialized only when the sample is encoded.
    sample = wire.decode(b"".join(bytes(p) for p in wire.encode(
        _sample(wire.Messages(request, response)))))
    assert sample.payload == wire.Messages(request.SerializeToString(),
                                           response.SerializeToString())
    inputs, requested = sample.payload.request()
    np.testing.assert_array_equal(inputs["x"], [[1.0, 2.0]])
    assert requested == ("y",)
    np.testing.assert_array_equal(sample.payload.answer()["y"], [[3.0]])


def test_record_of_an_llm_call_carries_the_generation_sample_whole():
    from guard.protocol.generation import GenerationSample, SamplingParams, TokenLogprob

    call = GenerationSample(
        model="llm", endpoint="chat", completion_text="Hi there",
        tokens=(TokenLogprob("Hi", -0.1, (("Hi", -0.1), ("Hey", -2.5)), 17),
                TokenLogprob(" there", -0.7)),
        sampling=SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, stop=("\n",)),
        messages=({"role": "user", "content": "Say hi"},), prompt_token_ids=(1, 5, 9),
        finish_reason="stop", request_id="r-9", streamed=True, first_token_seconds=0.05)
    sample = wire.decode(b"".join(bytes(p) for p in wire.encode(
        _sample(wire.Generation(call), flags=wire.CAPTURE, request_id="r-9"))))
    assert sample.payload == wire.Generation(call) and sample.request_id == "r-9"
    with pytest.raises(wire.NotTensors):
        sample.payload.request()


def test_hand_off_puts_a_stamped_record_or_counts_a_drop_per_flag():
    class Counter:
        value = 0

        def inc(self):
            self.value += 1

    producer, consumer = _ring_pair(1024)
    mirror, capture = Counter(), Counter()
    assert wire.hand_off(producer, _sample(wire.Messages(b"q", b"a"), route="fallback",
                                           slot=3, epoch=7, request_seconds=0.5),
                         mirror, capture)
    sample = wire.decode(bytes(consumer.take()))
    assert (sample.flags, sample.route, sample.slot, sample.epoch) == (wire.MIRROR, "fallback",
                                                                       3, 7)
    assert sample.unix_nanos > 0 and sample.request_seconds == 0.5
    assert sample.payload == wire.Messages(b"q", b"a")
    too_big = wire.Messages(bytes(2000), b"")  # never fits: the ring refuses it at once
    assert not wire.hand_off(producer, _sample(too_big, flags=wire.MIRROR | wire.CAPTURE),
                             mirror, capture)
    assert not wire.hand_off(producer, _sample(too_big, flags=wire.CAPTURE), mirror, capture)
    assert (mirror.value, capture.value) == (1, 2)
    assert not wire.hand_off(producer, _sample(too_big))  # no counter: the drop is only refused
    assert consumer.take() is None


def test_truncated_record_is_an_error_not_a_crash():
    data = b"".join(bytes(p) for p in wire.encode(_sample(wire.Tensors(
        {"x": np.ones((64,), np.float32)}, {"y": np.ones((2,), np.float32)}))))
    for cut in (10, len(data) // 2, len(data) - 1):
        with pytest.raises((ValueError, Exception)):
            wire.decode(data[:cut])


# -- the control channel -------------------------------------------------------------------------
def test_channel_calls_replies_one_way_messages_and_close():
    a, b = socket.socketpair()
    seen: list = []
    got_event = threading.Event()

    def note(message):
        seen.append(message)
        got_event.set()

    handlers = Handlers("server", {Metrics: lambda m: Exposition("x 5"), Event: note,
                                   Status: lambda m: None})
    closed = threading.Event()
    server = Channel(b, handlers, "server").start()
    client = Channel(a, Handlers("client", {}), "client", on_close=closed.set).start()
    assert client.call(Metrics()) == Exposition("x 5")
    assert client.call(Status("m")) == Done()  # a handler that returns nothing
    client.send(Event("hi"))
    assert got_event.wait(5) and seen == [Event("hi")]
    pending = client.call_async(Event("no reply expected"))
    server.close()
    assert closed.wait(5)
    # A call in flight at the close either got its answer before the server closed (a race the
    # server may win under load) or fails with ChannelClosed: never hangs, never another error.
    try:
        assert pending.result(5) == Done()
    except ChannelClosed:
        pass
    with pytest.raises(ChannelClosed):
        client.call(Metrics())
    client.close()


def test_a_call_whose_send_fails_as_the_reader_sees_the_close_fails_once():
    """The interleaving a scrape of /metrics met while the verifier was SIGKILLed: the call is
    registered, the reader sees the other side go and fails every pending call, then the
    call's own send fails too. The caller gets ChannelClosed (it got InvalidStateError from
    failing the same future twice, and /metrics answered 500)."""
    a, b = socket.socketpair()

    class ReaderFirst(Channel):
        def _send(self, wire: dict) -> None:
            self._closed()  # the reader's turn comes between the registration and the send
            raise ChannelClosed("client: [Errno 32] Broken pipe")

    client = ReaderFirst(a, Handlers("client", {}), "client")
    try:
        with pytest.raises(ChannelClosed):
            client.call(Metrics(), timeout=5)
    finally:
        a.close()
        b.close()


def test_a_message_without_a_handler_or_of_an_unknown_type_gets_an_error_naming_it():
    import json
    import struct

    a, b = socket.socketpair()
    server = Channel(b, Handlers("the verifier", {Metrics: lambda m: Exposition("")}),
                     "server").start()
    client = Channel(a, Handlers("client", {}), "client").start()
    try:
        reply = client.call(SetRoute("m", "auto"))
        assert isinstance(reply, Failed)
        assert reply.error == "the verifier: no handler for message type SetRoute"
    finally:
        client.close()
    # A type no class names, sent as raw frames: the reply is Failed, naming it.
    raw, b = socket.socketpair()
    server = Channel(b, Handlers("the verifier", {}), "server").start()
    try:
        data = json.dumps({"type": "Reticulate", "splines": 3, "id": 7}).encode()
        raw.sendall(struct.pack("<I", len(data)) + data)
        (length,) = struct.unpack("<I", raw.recv(4, socket.MSG_WAITALL))
        answer = json.loads(raw.recv(length, socket.MSG_WAITALL))
        assert answer["re"] == 7 and answer["type"] == "Failed"
        assert "unknown message type 'Reticulate'" in answer["error"]
    finally:
        raw.close()
        server.close()
    with pytest.raises(messages.UnknownMessage, match="unknown fields"):
        messages.from_wire({"type": "Metrics", "extra": 1})


def test_every_message_goes_through_the_wire_form_unchanged():
    import json

    examples = {
        "Init": messages.Init({"config": {}}, {"m": 0}, {"m": ["a"]}, {"m": {"backend": "x"}},
                              {"m": 5}, 8001),
        "UsePrimary": UsePrimary("m", ["conv1"], {"backend": "onnxruntime", "path": "/a"}),
        "RouteChanged": messages.RouteChanged("m", "fallback", "drift", 1.5),
        "Commit": messages.Commit(["m"], ["old"], 0.5),
    }
    for name, cls in messages.message_types().items():
        msg = examples.get(name)
        if msg is None:  # the others have defaults or one plain field
            import dataclasses

            required = [f for f in dataclasses.fields(cls)
                        if f.default is dataclasses.MISSING
                        and f.default_factory is dataclasses.MISSING]
            msg = cls(*["text" if f.type == "str" else {} for f in required])
        wire_form = json.loads(json.dumps(messages.to_wire(msg)))
        assert wire_form["type"] == name
        assert messages.from_wire(wire_form) == msg


def test_a_rebuilt_backend_block_crosses_as_its_wire_form(tmp_path):
    artifact = tmp_path / "m.onnx"
    artifact.write_bytes(b"not read here")
    spec = BackendConfig(backend="onnxruntime", path=str(artifact), precision="int8",
                         options={"nodes_to_exclude": ["conv1"]})
    context = ConfigContext(base_dir=tmp_path, source_hash="abc")
    import json

    back = backend_from_wire(json.loads(json.dumps(backend_to_wire(spec))), context)
    assert back.model_dump() == spec.model_dump() and back.context is context
    with pytest.raises(Exception, match="backend"):
        backend_from_wire({"backend": "tensorflow"}, context)
