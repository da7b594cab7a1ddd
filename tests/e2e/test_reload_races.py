"""Reload races: a replaced model is never closed under a request still inside it."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient
import yaml

from fixture_models import SLEEP_TRIGGER
from guard.plan.complete import load_config
from guard.serve.app import BackgroundServer
from support import affine_backend, events, model_block, wait_for, write_config, x_input


def test_a_replaced_model_waits_for_its_last_request(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    block = model_block(primary=affine_backend(sleep_on_trigger=3.0), reference=None,
                        mirror={"sample_rate": 0.0})
    # inline_below_ms 0: the request sleeps inside the model; inline, it would hold the event
    # loop (and the reload with it) for the whole sleep.
    path = write_config(tmp_path, [block], reload_interval_s=0.1, inline_below_ms=0)
    with BackgroundServer(load_config(path)) as srv:
        srv.reloader.retire_report_s = 0.5  # report early; the wait itself has no limit
        old = srv.models["m"]
        answers, errors = [], []

        def slow_request():
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
            try:
                answers.append(client.infer("m", [x_input(np.full((1, 4), SLEEP_TRIGGER))]))
            except Exception as exc:  # asserted below
                errors.append(exc)
            finally:
                client.close()

        thread = threading.Thread(target=slow_request)
        thread.start()
        wait_for(lambda: old.requests_in_flight == 1)
        data = yaml.safe_load(path.read_text())
        data["models"][0]["checks"]["tensor"]["atol"] = 1e-3  # a change: 'm' is rebuilt
        path.write_text(yaml.safe_dump(data))
        wait_for(lambda: srv.models["m"] is not old)
        [waiting] = wait_for(lambda: events(caplog, "model_retire_waiting"))
        assert waiting["requests_in_flight"] == 1
        assert old.ready  # still open: the slow request is inside it
        thread.join(30)
        assert errors == [] and answers[0].as_numpy("y").shape == (1, 3)
        wait_for(lambda: not old.ready)  # closed once the request had finished


def test_an_extra_serving_process_waits_for_its_last_request_too(tmp_path, caplog):
    """server.processes: 2 and a request held inside the slow model of the other serving
    process across a reload: it completes, and that process closes the old model only after."""
    caplog.set_level(logging.INFO, logger="guard.events")
    block = model_block(primary=affine_backend(sleep_on_trigger=6.0), reference=None,
                        mirror={"sample_rate": 0.0})
    path = write_config(tmp_path, [block], reload_interval_s=0.1, inline_below_ms=0,
                        processes=2)
    with BackgroundServer(load_config(path)) as srv:
        srv.reloader.retire_report_s = 0.5  # sent with Commit: every process reports early
        client = _client_of_the_other_process(srv)
        answers, errors = [], []

        def slow_request():
            try:
                answers.append(client.infer("m", [x_input(np.full((1, 4), SLEEP_TRIGGER))]))
            except Exception as exc:  # asserted below
                errors.append(exc)

        thread = threading.Thread(target=slow_request)
        try:
            thread.start()
            time.sleep(0.5)  # the request is now inside the other process's model
            data = yaml.safe_load(path.read_text())
            data["models"][0]["checks"]["tensor"]["atol"] = 1e-3  # a change: 'm' is rebuilt
            path.write_text(yaml.safe_dump(data))
            # The primary's old version had no request inside: closed at once, no report.
            [waiting] = wait_for(lambda: events(caplog, "model_retire_waiting"))
            assert waiting["requests_in_flight"] == 1
            time.sleep(1.0)  # a version closed under the request would have said so by now
            retired_while_inside = events(caplog, "model_retired")
            still_inside = thread.is_alive()
            thread.join(30)
        finally:
            client.close()
        assert still_inside and retired_while_inside == []
        assert errors == [] and answers[0].as_numpy("y").shape == (1, 3)
        [retired] = wait_for(lambda: events(caplog, "model_retired"))
        assert retired["model"] == "m" and retired["waited_s"] >= waiting["waited_s"]


def _client_of_the_other_process(srv) -> grpcclient.InferenceServerClient:
    """A client whose connection the kernel gave to the other serving process: fresh
    connections until one request is counted there (SO_REUSEPORT picks the process)."""
    from prometheus_client.parser import text_string_to_metric_families

    def answered_there() -> float:
        (text,) = srv.serving.expositions()
        return sum(s.value for family in text_string_to_metric_families(text)
                   for s in family.samples if s.name == "guard_requests_total")

    for _ in range(64):
        before = answered_there()
        client = grpcclient.InferenceServerClient(
            f"127.0.0.1:{srv.grpc_port}", channel_args=[("grpc.use_local_subchannel_pool", 1)])
        client.infer("m", [x_input(np.zeros((1, 4)))])
        if answered_there() > before:
            return client
        client.close()
    raise AssertionError("no connection reached the other serving process")
