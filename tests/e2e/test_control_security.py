"""Control surfaces under attack: the Tap service (poisoning), the admin API (who may pin a
route), certificates renewed on disk. Real servers, real gRPC clients, real certificates."""

from __future__ import annotations

import logging
import shutil

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as oip
from tritonclient.utils import InferenceServerException

from fixture_models import DRIFT_TRIGGER
from guard.cli import main as guard_main
from guard.protocol.codec import decode_request, encode_request, encode_response
from guard.v1 import admin_pb2, admin_pb2_grpc, tap_pb2, tap_pb2_grpc
from pki import make_pki
from support import (affine_backend, events, metric, model_block, running, scrape,
                     wait_for, x_input)

TAP = {"host": "127.0.0.1", "port": 0}
FALLBACK_POLICY = {"action": "fallback_model", "detector": "window", "window": 10,
                   "min_samples": 5, "trip_ratio": 0.2, "recover_ratio": 0.0, "dwell_s": 60}


def invented(model: str, rows: np.ndarray, request_id: str) -> tap_pb2.ObserveRequest:
    """A real request with made-up logits: what a poisoner sends."""
    request = encode_request(model, {"x": rows.astype(np.float32)}, request_id=request_id)
    response = encode_response(decode_request(request),
                               {"y": np.full((rows.shape[0], 3), 1e6, np.float32)}, "primary")
    return tap_pb2.ObserveRequest(request=request.SerializeToString(),
                                  response=response.SerializeToString())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), clients={
        "operator": ["spiffe://cluster/ns/ml/sa/operator"],
        "stranger": ["spiffe://cluster/ns/other/sa/app"]})


def _channel(port: int, pki, who: str | None) -> grpc.Channel:
    ca = pki["ca"].read_bytes()
    if who is None:
        return grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca))
    return grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(
        ca, pki[f"{who}_key"].read_bytes(), pki[f"{who}_cert"].read_bytes()))


def test_tap_cannot_poison_a_model_guard_serves(tmp_path):
    """The attack of the hardening issue: many made-up Observe calls for a model guard serves in
    the path. Refused, never checked, and the route stays on the primary."""
    served = model_block("served", fallback=affine_backend(), policy=FALLBACK_POLICY)
    tapped = model_block("tapped", tap=True)
    with running(tmp_path, [served, tapped], tap=TAP) as (srv, client):
        with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as data_plane:
            with pytest.raises(grpc.RpcError) as err:  # not on the data-plane port any more
                tap_pb2_grpc.TapStub(data_plane).Observe(invented("served", np.ones((1, 4)), "a"))
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with grpc.insecure_channel(f"127.0.0.1:{srv.tap_port}") as channel:
            tap = tap_pb2_grpc.TapStub(channel)
            codes = set()
            for i in range(50):
                try:
                    tap.Observe(invented("served", np.full((1, 4), DRIFT_TRIGGER), f"p-{i}"))
                except grpc.RpcError as exc:
                    codes.add(exc.code())
                    assert "served by guard in the request path" in exc.details()
            assert codes == {grpc.StatusCode.FAILED_PRECONDITION}
            with pytest.raises(grpc.RpcError) as err:
                next(tap.WatchRoute(tap_pb2.WatchRouteRequest(model="served")))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # The tapped model is observed, and guard never answers it itself.
            assert tap.Observe(invented("tapped", np.ones((1, 4)), "t-1")).route == "primary"
            # A pair that parses but does not decode (the fuzzer's find: it used to kill the
            # verifier's ring reader, and with it every check) is refused up front.
            broken = invented("tapped", np.ones((1, 4)), "t-2")
            response = oip.ModelInferResponse.FromString(broken.response)
            response.outputs.add(name="extra", datatype="FP32", shape=[1])
            broken.response = response.SerializeToString()
            with pytest.raises(grpc.RpcError) as err:
                tap.Observe(broken)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "raw_output_contents" in err.value.details()
            tap.Observe(invented("tapped", np.ones((1, 4)), "t-3"))
            wait_for(lambda: metric(scrape(srv.metrics_port), "guard_checks_total",
                                    model="tapped", tier="tensor", result="fail") >= 2)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("tapped", [x_input(np.ones((1, 4)))])
        assert "FAILED_PRECONDITION" in str(refused.value.status())
        assert "tapped" in refused.value.message()
        result = client.infer("served", [x_input(np.ones((1, 4)))])
        assert result.get_response().parameters["guard_route"].string_param == "primary"
        values = scrape(srv.metrics_port)
        assert metric(values, "guard_checks_total", model="served", tier="tensor",
                      result="fail") == 0
        assert metric(values, "guard_requests_total", model="served", route="primary") == 1


def test_tap_mtls_allow_list(tmp_path, pki):
    tap = {"host": "127.0.0.1", "port": 0, "tls": {
        "cert_file": str(pki["server_cert"]), "key_file": str(pki["server_key"]),
        "client_ca_file": str(pki["ca"]),
        "allowed_identities": ["spiffe://cluster/ns/ml/sa/operator"]}}
    with running(tmp_path, [model_block(tap=True)], tap=tap) as (srv, _):
        observe = invented("m", np.ones((1, 4)), "r-1")
        with _channel(srv.tap_port, pki, "operator") as channel:
            assert tap_pb2_grpc.TapStub(channel).Observe(observe).route == "primary"
        with _channel(srv.tap_port, pki, "stranger") as channel:
            with pytest.raises(grpc.RpcError) as err:
                tap_pb2_grpc.TapStub(channel).Observe(observe)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "spiffe://cluster/ns/other/sa/app" in err.value.details()
        with _channel(srv.tap_port, pki, None) as channel:  # no client certificate
            with pytest.raises(grpc.RpcError) as err:
                tap_pb2_grpc.TapStub(channel).Observe(observe)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        values = scrape(srv.metrics_port)
        assert metric(values, "guard_requests_total", model="m", route="primary") == 1


def test_admin_mtls_names_the_caller(tmp_path, pki, caplog, capsys):
    caplog.set_level(logging.INFO, logger="guard.events")
    admin_tls = {"cert_file": str(pki["server_cert"]), "key_file": str(pki["server_key"]),
                 "client_ca_file": str(pki["ca"]),
                 "allowed_identities": ["spiffe://cluster/ns/ml/sa/operator"]}
    block = model_block(fallback=affine_backend(), policy=FALLBACK_POLICY)
    with running(tmp_path, [block], admin_tls=admin_tls) as (srv, client):
        address = f"127.0.0.1:{srv.admin_port}"
        tls_flags = ["--tls-ca", str(pki["ca"])]
        operator = [*tls_flags, "--tls-cert", str(pki["operator_cert"]),
                    "--tls-key", str(pki["operator_key"])]
        assert guard_main(["admin", "--admin", address, *operator, "route", "m", "fallback",
                           "--reason", "drill"]) == 0
        assert "route=fallback" in capsys.readouterr().out
        result = client.infer("m", [x_input(np.ones((1, 4)))])
        assert result.get_response().parameters["guard_route"].string_param == "fallback"
        [change] = events(caplog, "admin_route_set")
        assert change["caller"].startswith("spiffe://cluster/ns/ml/sa/operator (ipv4:127.0.0.1:")
        assert change["override"] == "fallback" and change["reason"] == "drill"

        stranger = [*tls_flags, "--tls-cert", str(pki["stranger_cert"]),
                    "--tls-key", str(pki["stranger_key"])]
        assert guard_main(["admin", "--admin", address, *stranger, "route", "m", "auto"]) == 2
        assert "PERMISSION_DENIED" in capsys.readouterr().err
        assert guard_main(["admin", "--admin", address, "status"]) == 2  # plaintext
        assert guard_main(["admin", "--admin", address, *tls_flags, "status"]) == 2  # no cert
        [denied] = events(caplog, "access_denied")
        assert denied["method"] == "SetRoute" and "other/sa/app" in denied["caller"]
        assert len(events(caplog, "admin_route_set")) == 1
        with _channel(srv.admin_port, pki, "operator") as channel:
            status = admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.GetStatusRequest())
        assert status.models[0].route == "fallback"


def test_certificates_renewed_on_disk_are_served(tmp_path):
    """The data plane's certificate is replaced on disk by one from another CA: new connections
    get the new one, without a restart."""
    old, new = make_pki(tmp_path / "old", ca_name="old-ca"), make_pki(tmp_path / "new",
                                                                      ca_name="new-ca")
    live = {"cert_file": tmp_path / "tls.crt", "key_file": tmp_path / "tls.key"}
    shutil.copy(old["server_cert"], live["cert_file"])
    shutil.copy(old["server_key"], live["key_file"])
    tls = {k: str(v) for k, v in live.items()}
    with running(tmp_path, [model_block(mirror={"sample_rate": 0.0})], tls=tls) as (srv, _):
        url = f"127.0.0.1:{srv.grpc_port}"

        def infer(ca: str):
            client = grpcclient.InferenceServerClient(url, ssl=True, root_certificates=ca)
            try:
                return client.infer("m", [x_input(np.ones((1, 4)))]).as_numpy("y").shape
            finally:
                client.close()

        assert infer(str(old["ca"])) == (1, 3)
        # cert-manager / a Secret update: both files replaced (new inodes).
        for key, source in (("key_file", new["server_key"]), ("cert_file", new["server_cert"])):
            staged = live[key].with_suffix(".tmp")
            shutil.copy(source, staged)
            staged.replace(live[key])
        assert infer(str(new["ca"])) == (1, 3)
        with pytest.raises(InferenceServerException):
            infer(str(old["ca"]))
