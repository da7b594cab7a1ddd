"""TLS and mutual TLS on the data plane, artifact pinning by sha256, OpenTelemetry spans."""

from __future__ import annotations

import hashlib

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from tritonclient.utils import InferenceServerException

from guard.plan.complete import load_config
from guard.errors import BackendError
from guard.observe import tracing
from guard.serve.app import GuardServer
from pki import make_pki
from support import model_block, running, wait_for, write_config, x_input


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_mutual_tls(tmp_path, pki):
    tls = {"cert_file": str(pki["server_cert"]), "key_file": str(pki["server_key"]),
           "client_ca_file": str(pki["ca"])}
    with running(tmp_path, [model_block(mirror={"sample_rate": 0.0})], tls=tls) as (srv, _):
        url = f"127.0.0.1:{srv.grpc_port}"
        client = grpcclient.InferenceServerClient(
            url, ssl=True, root_certificates=str(pki["ca"]),
            private_key=str(pki["client_key"]), certificate_chain=str(pki["client_cert"]))
        assert client.infer("m", [x_input(np.ones((1, 4)))]).as_numpy("y").shape == (1, 3)
        client.close()
        anonymous = grpcclient.InferenceServerClient(url, ssl=True,
                                                     root_certificates=str(pki["ca"]))
        with pytest.raises(InferenceServerException):
            anonymous.infer("m", [x_input(np.ones((1, 4)))])
        anonymous.close()
        plaintext = grpcclient.InferenceServerClient(url)
        with pytest.raises(InferenceServerException):
            plaintext.infer("m", [x_input(np.ones((1, 4)))])
        plaintext.close()


def test_artifact_sha256_is_checked_before_loading(tmp_path, zoo_classifier):
    onnx = str(zoo_classifier["onnx"])
    digest = hashlib.sha256(open(onnx, "rb").read()).hexdigest()
    good = {"name": "cnn", "primary": {"backend": "onnxruntime", "path": onnx, "sha256": digest},
            "mirror": {"sample_rate": 0.0}}
    server = GuardServer(load_config(write_config(tmp_path, [good])))
    server.load_models()
    server.close_models()
    bad = dict(good, primary={**good["primary"], "sha256": "0" * 64})
    server = GuardServer(load_config(write_config(tmp_path, [bad])))
    with pytest.raises(BackendError, match=r"models\[cnn\]\.primary\.sha256: .* has sha256 "
                                           + digest):
        server.load_models()


def test_traces_model_infer_and_the_mirrored_comparison(tmp_path):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    try:
        with running(tmp_path, [model_block()]) as (srv, client):
            client.infer("m", [x_input(np.ones((1, 4)))],
                         headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
            with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            client.is_server_live()
            spans = wait_for(lambda: len(exporter.get_finished_spans()) >= 2 and
                             exporter.get_finished_spans())
    finally:
        tracing.use_provider(None)
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"ModelInfer", "guard.mirror.compare"}  # health/liveness untraced
    infer, compare = by_name["ModelInfer"], by_name["guard.mirror.compare"]
    assert infer.kind == SpanKind.SERVER
    assert format(infer.context.trace_id, "032x") == trace_id  # continues the client's trace
    assert infer.attributes["guard.model"] == "m" and infer.attributes["guard.route"] == "primary"
    assert compare.parent.span_id == infer.context.span_id
    assert compare.attributes["guard.verdict"] == "pass"
    assert compare.attributes["guard.tier.tensor.max_abs_error"] == 0.0


def test_trace_context_reaches_the_upstream(tmp_path):
    """guard -> guard: the upstream's ModelInfer span is a child of the front guard's span, so
    the client's metadata (here its traceparent) travels with the forwarded request."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    try:
        (tmp_path / "back").mkdir()
        (tmp_path / "front").mkdir()
        with running(tmp_path / "back", [model_block(mirror={"sample_rate": 0.0})]) as (back, _):
            front_model = {"name": "m", "mirror": {"sample_rate": 0.0},
                           "primary": {"backend": "upstream", "model": "m",
                                       "target": f"127.0.0.1:{back.grpc_port}"}}
            with running(tmp_path / "front", [front_model]) as (_, client):
                client.infer("m", [x_input(np.ones((1, 4)))])
                spans = wait_for(lambda: len(exporter.get_finished_spans()) >= 2 and
                                 exporter.get_finished_spans())
    finally:
        tracing.use_provider(None)
    infer_spans = [s for s in spans if s.name == "ModelInfer"]
    assert len(infer_spans) == 2
    outer = next(s for s in infer_spans if s.parent is None)
    inner = next(s for s in infer_spans if s.parent is not None)
    assert inner.context.trace_id == outer.context.trace_id
    assert inner.parent.span_id == outer.context.span_id
