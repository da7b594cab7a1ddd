"""The sidecar serving LiteRT beside a Keras reference: real gRPC server, real tritonclient, the
LiteRT interpreter answering, the verifier process running the ``.keras`` on Keras's
TensorFlow backend. One model's primary is guard's own int8 conversion of the SavedModel
(dynamic-range int8 drifts 0.2-1.3% of the largest logit on this CNN): tier 1 fails it and the
route goes to the fp32 ``.tflite`` fallback. Another model's fp32 ``.tflite`` passes."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

pytest.importorskip("tensorflow")
pytest.importorskip("ai_edge_litert")

import tf_models  # noqa: E402
from support import metric, running, scrape, wait_for  # noqa: E402


def image_tensor(rows: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("image", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows)
    return tensor


def litert(path, rows: np.ndarray) -> np.ndarray:
    from ai_edge_litert.interpreter import Interpreter

    runner = Interpreter(model_path=str(path), num_threads=1).get_signature_runner()
    return runner(image=rows)["output_0"]


def test_a_drifting_litert_int8_primary_is_caught_and_falls_back(tmp_path):
    import keras

    from guard.backends.tf_convert import derive

    built = tf_models.build(tmp_path)
    saved_model = str(built["saved_model"])
    # Converted here once (TensorFlow is imported in this process already); the serving and
    # the verifier process find it in guard's cache by digest instead of converting twice.
    int8 = derive(saved_model, "int8", in_process=True)
    fp32 = tmp_path / "cnn.tflite"
    fp32.write_bytes(derive(saved_model, "fp32", in_process=True).read_bytes())
    reference = {"backend": "keras", "path": str(built["keras"])}
    common = {"mirror": {"sample_rate": 1.0, "queue_size": 64, "timeout_s": 30.0},
              "checks": {"tensor": {"atol": 0.0, "rtol": 1e-3}}}
    drifting = {"name": "int8", "primary": {"backend": "litert", "path": saved_model,
                                            "precision": "int8"},
                "reference": reference, "fallback": {"backend": "litert", "path": str(fp32)},
                "policy": {"action": "fallback_model", "detector": "window", "window": 10,
                           "min_samples": 5, "trip_ratio": 0.2, "dwell_s": 600},
                **common}
    clean = {"name": "fp32", "primary": {"backend": "litert", "path": str(fp32)},
             "reference": reference,
             "policy": {"action": "alert", "detector": "window", "window": 10, "min_samples": 5},
             **common}
    rows = tf_models.images(6, seed=11)
    truth = np.asarray(keras.saving.load_model(built["keras"]).predict_on_batch(rows))
    with running(tmp_path, [drifting, clean]) as (srv, client):
        meta = client.get_model_metadata("int8")
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
            ("image", "FP32", [-1, 8, 8, 3])]
        assert [t.name for t in meta.outputs] == ["output_0"]
        for i in range(6):
            for name in ("int8", "fp32"):
                result = client.infer(name, [image_tensor(rows[i:i + 1])])
                route = result.get_response().parameters["guard_route"].string_param
                # The detector trips on 5 compared samples (min_samples), each compared after
                # its call was answered: the first five int8 calls are the primary's; a quick
                # verifier may have switched before the sixth.
                if name == "fp32" or i < 5:
                    assert route == "primary"
                served = int8 if name == "int8" and route == "primary" else fp32
                np.testing.assert_array_equal(result.as_numpy("output_0"),
                                              litert(served, rows[i:i + 1]))
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_fallback_active", model="int8", scope="model") == 1 and metric(
            v, "guard_mirror_total", model="fp32", outcome="compared") == 6 and v, timeout=120)
        assert metric(values, "guard_checks_total", model="int8", tier="tensor",
                      result="fail") >= 5
        assert metric(values, "guard_fallback_transitions_total", model="int8",
                      to="fallback_model") == 1
        assert metric(values, "guard_checks_total", model="fp32", tier="tensor",
                      result="pass") == 6
        assert metric(values, "guard_fallback_active", model="fp32", scope="model") == 0
        # The fallback (the fp32 .tflite) answers now: the Keras model's answer up to float noise.
        result = client.infer("int8", [image_tensor(rows[:1])])
        assert result.get_response().parameters["guard_route"].string_param == "fallback"
        np.testing.assert_allclose(result.as_numpy("output_0"), truth[:1], rtol=1e-5, atol=1e-6)


def test_tier2_names_the_keras_port_padding_bug_in_the_route_transition(tmp_path, caplog):
    """The sidecar with a Keras port as the primary and the torch model it was ported from as
    the reference (TorchScript, its eager factory for the hooks): the stride-2
    ``padding="same"`` bug fails tier 1, the mirror worker runs tier 2 on the failures, and the
    route transition to the faithful port names the Keras layer, ``conv2``."""
    import logging

    from guard.zoo import zoo_entry
    from support import events

    caplog.set_level(logging.INFO, logger="guard.events")
    faulty = zoo_entry("keras_port_padding").export(tmp_path, 0)
    faithful = zoo_entry("keras_port").export(tmp_path, 0)
    model = {
        "name": "port", "task": "classification",
        "primary": {"backend": "keras", "path": str(faulty["keras"])},
        "reference": {"backend": "torch", "path": str(faulty["torchscript"])},
        "fallback": {"backend": "keras", "path": str(faithful["keras"])},
        "mirror": {"sample_rate": 1.0, "queue_size": 64, "timeout_s": 30.0},
        "checks": {"tensor": {"atol": 1e-5, "rtol": 1e-5},
                   "activation": {"on_failure": True, "max_queue_fill": 1.0,
                                  "torch_factory": "guard.zoo.keras_port:build"}},
        "policy": {"action": "fallback_model", "detector": "window", "window": 10,
                   "min_samples": 5, "trip_ratio": 0.2, "recover_ratio": 0.0, "dwell_s": 600},
    }
    rows = zoo_entry("keras_port").sample_inputs(6, 11)["image"]
    with running(tmp_path, [model]) as (srv, client):
        for i in range(6):
            client.infer("port", [image_tensor(rows[i:i + 1])])
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_fallback_active", model="port", scope="model") == 1 and v, timeout=120)
        assert metric(values, "guard_checks_total", model="port", tier="activation",
                      result="fail") >= 1
        result = client.infer("port", [image_tensor(rows[:1])])
        assert result.get_response().parameters["guard_route"].string_param == "fallback"
    (transition,) = [e for e in events(caplog, "route_transition") if e["trigger"] == "policy"]
    assert transition["evidence"]["first_divergence"]["layer"] == "conv2"
    assert transition["evidence"]["activation"]["suspects"][0]["layer"] == "conv2"
