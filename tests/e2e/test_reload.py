"""Hot reload: file changes (including a ConfigMap-style symlink swap) and SIGHUP-equivalent
reloads, with traffic flowing to the models that did not change."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from guard.plan.complete import load_config
from guard.serve.app import BackgroundServer
from support import (affine_backend, metric, model_block, scrape, wait_for, write_config,
                     x_input)
from free_ports import free_port

TESTS_DIR = Path(__file__).resolve().parents[1]


def configmap_layout(folder: Path, data: dict, version: int) -> None:
    """What the kubelet does: files in a timestamped dir, '..data' -> it, file -> ..data/file."""
    target = folder / f"..2026_11_29_{version}"
    target.mkdir()
    (target / "guard.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    tmp_link = folder / "..data_tmp"
    tmp_link.symlink_to(target.name)
    os.replace(tmp_link, folder / "..data")  # atomic swap
    if not (folder / "guard.yaml").is_symlink():
        (folder / "guard.yaml").symlink_to("..data/guard.yaml")


def server_section() -> dict:
    return {"host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0, "admin_port": 0,
            "reload_interval_s": 0.1}


def test_configmap_swap_reloads_changed_models_only_while_traffic_flows(tmp_path, rng):
    folder = tmp_path / "config"
    folder.mkdir()
    data = {"version": 1, "server": server_section(),
            "models": [model_block("a", mirror={"sample_rate": 0.0}),
                       model_block("b", mirror={"sample_rate": 0.0})]}
    configmap_layout(folder, data, 1)
    config = load_config(folder / "guard.yaml")
    with BackgroundServer(config) as srv:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
        model_a = srv.models["a"]
        errors, sent = [], [0]
        stop = threading.Event()

        def traffic():  # model 'a' must never notice that 'b' is reloaded
            own = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
            while not stop.is_set():
                try:
                    own.infer("a", [x_input(np.ones((1, 4)))])
                    sent[0] += 1
                except Exception as exc:  # recorded and asserted below
                    errors.append(exc)
            own.close()

        thread = threading.Thread(target=traffic)
        thread.start()
        try:
            old_b = srv.models["b"]
            data["models"][1]["mirror"] = {"sample_rate": 1.0}
            data["models"].append(model_block("c", mirror={"sample_rate": 0.0}))
            configmap_layout(folder, data, 2)
            wait_for(lambda: "c" in srv.models and srv.models["b"] is not old_b, timeout=60)
            assert srv.models["a"] is model_a  # untouched
            assert client.infer("c", [x_input(rng.normal(size=(1, 4)))]).as_numpy("y").shape == (
                1, 3)
            wait_for(lambda: not old_b.ready)  # the replaced model was closed

            # Invalid config: rejected, counted, and the old one stays in force.
            (folder / "..2026_11_29_3").mkdir()
            (folder / "..2026_11_29_3" / "guard.yaml").write_text(
                "version: 1\nmodels: [{name: a, primary: {backend: nope}}]\n")
            os.symlink("..2026_11_29_3", folder / "..data_tmp")
            os.replace(folder / "..data_tmp", folder / "..data")
            wait_for(lambda: metric(scrape(srv.metrics_port), "guard_config_reloads_total",
                                    result="rejected") == 1)
            assert client.infer("c", [x_input(np.ones((1, 4)))]).as_numpy("y").shape == (1, 3)

            # Removing a model: it answers NOT_FOUND afterwards.
            data["models"] = data["models"][:2]
            configmap_layout(folder, data, 4)
            wait_for(lambda: "c" not in srv.models)
            with pytest.raises(InferenceServerException) as err:
                client.infer("c", [x_input(np.ones((1, 4)))])
            assert err.value.status() == "StatusCode.NOT_FOUND"
        finally:
            stop.set()
            thread.join(30)
            client.close()
        assert errors == [] and sent[0] > 0
        values = scrape(srv.metrics_port)
        assert metric(values, "guard_config_reloads_total", result="applied") == 2


def test_a_model_that_fails_to_load_keeps_its_old_version(tmp_path):
    path = write_config(tmp_path, [model_block("a", mirror={"sample_rate": 0.0})])
    data = yaml.safe_load(path.read_text())
    data["server"]["reload_interval_s"] = 0.1
    path.write_text(yaml.safe_dump(data))
    with BackgroundServer(load_config(path)) as srv:
        old = srv.models["a"]
        # a factory the module does not have: the block parses, the load fails
        data["models"][0]["primary"] = {"backend": "torch", "path": "fixture_models:does_not_exist"}
        path.write_text(yaml.safe_dump(data))
        wait_for(lambda: metric(scrape(srv.metrics_port), "guard_config_reloads_total",
                                result="failed") == 1)
        assert srv.models["a"] is old and old.ready


def watched_config(tmp_path: Path, model: dict) -> tuple[Path, dict]:
    """A one-model config file that guard polls every 0.1 s, and its data to change."""
    path = write_config(tmp_path, [model])
    data = yaml.safe_load(path.read_text())
    data["server"]["reload_interval_s"] = 0.1
    path.write_text(yaml.safe_dump(data))
    return path, data


def apply(path: Path, data: dict, metrics_port: int, reloads: int) -> None:
    """Write ``data`` and wait until guard has applied its ``reloads``-th reload."""
    path.write_text(yaml.safe_dump(data))
    wait_for(lambda: metric(scrape(metrics_port), "guard_config_reloads_total",
                            result="applied") == reloads, timeout=60)


def test_a_reloaded_model_keeps_its_route_and_the_operators_pin(tmp_path, rng):
    """Pinned to the fallback (an incident), then a reload that changes the model's sampling:
    its calls stay on the fallback and the pin stays (a reload once built the model afresh,
    on the primary, and dropped the pin in silence). A reload that takes the fallback away
    puts it on the primary."""
    import grpc

    from guard.v1 import admin_pb2, admin_pb2_grpc

    model = model_block("a", fallback=affine_backend(), mirror={"sample_rate": 0.0},
                        policy={"action": "fallback_model", "window": 10, "min_samples": 5})
    path, data = watched_config(tmp_path, model)

    def reload(reloads: int) -> None:
        apply(path, data, srv.metrics_port, reloads)

    def route() -> str:
        result = client.infer("a", [x_input(rng.normal(size=(1, 4)))])
        return result.get_response().parameters["guard_route"].string_param

    with BackgroundServer(load_config(path)) as srv, \
            grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
        admin = admin_pb2_grpc.AdminStub(channel)
        admin.SetRoute(admin_pb2.SetRouteRequest(model="a", route=admin_pb2.FALLBACK,
                                                 reason="incident"))
        assert route() == "fallback"
        data["models"][0]["mirror"] = {"sample_rate": 0.5}
        reload(1)
        assert route() == "fallback"
        status = admin.GetStatus(admin_pb2.GetStatusRequest(model="a")).models[0]
        assert (status.route, status.override) == ("fallback", "fallback")
        assert metric(scrape(srv.metrics_port), "guard_fallback_active", model="a",
                      scope="model") == 1
        del data["models"][0]["fallback"]
        data["models"][0]["policy"] = {"action": "alert"}
        reload(2)
        assert route() == "primary"
        assert metric(scrape(srv.metrics_port), "guard_fallback_active", model="a",
                      scope="model") == 0
        client.close()


def test_a_reload_of_the_sampling_alone_keeps_the_detectors_evidence(tmp_path, rng):
    """An SRE raises (or lowers) ``mirror.sample_rate`` in an incident: the model reloads, and
    its window and detector go on from what they had seen (they once started from zero, so
    evidence gathered before the change was lost). A change to what the checks judge by (a
    tolerance) starts them afresh."""
    import grpc

    from guard.v1 import admin_pb2, admin_pb2_grpc

    # A sequential detector that needs more samples than are sent: the statistic and the
    # samples it counted are its evidence so far.
    model = model_block("a", policy={"action": "alert", "detector": "cusum", "window": 100,
                                     "min_samples": 50, "p0": 0.01})
    path, data = watched_config(tmp_path, model)

    def reload(reloads: int) -> None:
        apply(path, data, srv.metrics_port, reloads)

    def evidence() -> tuple[int, float]:
        status = admin.GetStatus(admin_pb2.GetStatusRequest(model="a")).models[0]
        values = scrape(srv.metrics_port)
        return (status.windows[0].samples,
                metric(values, "guard_detector_samples", model="a", tier="tensor"))

    with BackgroundServer(load_config(path)) as srv, \
            grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
        admin = admin_pb2_grpc.AdminStub(channel)
        for _ in range(12):
            client.infer("a", [x_input(rng.normal(size=(1, 4)))])
        wait_for(lambda: evidence() == (12, 12))
        old = srv.models["a"]
        data["models"][0]["mirror"] = {**data["models"][0]["mirror"], "sample_rate": 0.5}
        reload(1)
        assert srv.models["a"] is not old  # rebuilt, with the new rate
        assert evidence() == (12, 12)
        data["models"][0]["checks"] = {"tensor": {"atol": 1e-4, "rtol": 1e-4}}
        reload(2)
        assert evidence() == (0, 0)
        client.close()


def test_sighup_reloads_a_running_guard_serve(tmp_path):
    path = write_config(tmp_path, [model_block("a", mirror={"sample_rate": 0.0})])
    data = yaml.safe_load(path.read_text())
    data["server"].update(reload_interval_s=0, grpc_port=free_port())
    path.write_text(yaml.safe_dump(data))
    env = dict(os.environ, PYTHONPATH=str(TESTS_DIR))
    process = subprocess.Popen([sys.executable, "-m", "guard", "serve", "--config", str(path)],
                               stderr=subprocess.PIPE, text=True, env=env)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{data['server']['grpc_port']}")
    try:
        wait_for(lambda: _ready(client), timeout=60, interval=0.2)
        data["models"].append(model_block("b", mirror={"sample_rate": 0.0}))
        path.write_text(yaml.safe_dump(data))
        time.sleep(0.2)
        assert not client.is_model_ready("b")  # watching is off: only SIGHUP reloads
        process.send_signal(signal.SIGHUP)
        wait_for(lambda: client.is_model_ready("b"), timeout=60, interval=0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert '"event": "config_reloaded"' in process.stderr.read()
    finally:
        client.close()
        if process.poll() is None:
            process.kill()


def _ready(client) -> bool:
    try:
        return client.is_server_ready()
    except Exception:
        return False


def test_one_edit_and_a_sighup_are_one_reload_and_the_server_block_waits(tmp_path):
    """SIGHUP after an edit reloads once (the watcher, which polls the same file, does not
    reload it again), and a changed ``server`` block is said and left for the restart: the
    grace, ports and limits in force stay those guard started with."""
    import asyncio

    path, data = watched_config(tmp_path, model_block("a", mirror={"sample_rate": 0.0}))
    data["server"].update(reload_interval_s=0.3, shutdown_grace_s=30)
    path.write_text(yaml.safe_dump(data))
    background = BackgroundServer(load_config(path))
    with background as srv:
        data["models"].append(model_block("b", mirror={"sample_rate": 0.0}))
        data["server"]["shutdown_grace_s"] = 0.2

        async def edit_then_hang_up() -> bool:
            # On the server's loop, so that the watcher cannot look between the two.
            path.write_text(yaml.safe_dump(data))
            return (await srv.reloader.reload("SIGHUP")).applied

        assert asyncio.run_coroutine_threadsafe(edit_then_hang_up(), background._loop).result(60)
        time.sleep(1.5)  # five of the watcher's looks at the file
        values = scrape(srv.metrics_port)
        assert metric(values, "guard_config_reloads_total", result="applied") == 1
        assert srv.models["b"].ready
        assert srv.config.server.shutdown_grace_s == 30
        assert [m.name for m in srv.config.models] == ["a", "b"]


def test_the_admin_apis_reload_applies_the_file_and_says_what_it_did(tmp_path, capsys):
    """guard.v1.Admin/Reload, as SIGHUP (CONTRACT.md: the admin service reloads): what was
    added, a rejected file's problems naming the key (the config in force stays), a model
    that failed to load naming it (its old version stays)."""
    import grpc

    from guard.v1 import admin_pb2, admin_pb2_grpc

    path = write_config(tmp_path, [model_block("a", mirror={"sample_rate": 0.0})])
    data = yaml.safe_load(path.read_text())
    with BackgroundServer(load_config(path)) as srv, \
            grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
        admin = admin_pb2_grpc.AdminStub(channel)

        def reload(reason: str = "") -> admin_pb2.ReloadResponse:
            return admin.Reload(admin_pb2.ReloadRequest(reason=reason), timeout=120)

        same = reload()
        assert (same.result, list(same.changed), list(same.added)) == ("applied", [], [])
        data["models"].append(model_block("b", mirror={"sample_rate": 0.0}))
        path.write_text(yaml.safe_dump(data))
        added = reload("INC-1")
        assert (added.result, list(added.added)) == ("applied", ["b"])
        assert len(added.config_hash) == 16 and srv.models["b"].ready

        data["models"][1]["mirror"]["sample_ratee"] = 0.5
        path.write_text(yaml.safe_dump(data))
        rejected = reload()
        assert rejected.result == "rejected"
        assert list(rejected.problems) == ["models[1].mirror.sample_ratee: unknown key"]
        del data["models"][1]["mirror"]["sample_ratee"]

        kept = srv.models["b"]
        data["models"][1]["primary"] = {"backend": "torch",
                                        "path": "fixture_models:does_not_exist"}
        path.write_text(yaml.safe_dump(data))
        failed = reload()
        assert failed.result == "failed" and list(failed.failed) == ["b"]
        assert "does_not_exist" in failed.failed["b"] and srv.models["b"] is kept
        values = scrape(srv.metrics_port)
        assert metric(values, "guard_config_reloads_total", result="applied") == 2
        assert metric(values, "guard_config_reloads_total", result="rejected") == 1
        assert metric(values, "guard_config_reloads_total", result="failed") == 1

        # The command line: what the reload did, and its exit code.
        from guard.cli import main

        address = ["admin", "--admin", f"127.0.0.1:{srv.admin_port}", "reload"]
        assert main(address + ["--reason", "INC-2"]) == 1  # b still fails to load
        data["models"][1]["mirror"]["sample_ratee"] = 0.5
        path.write_text(yaml.safe_dump(data))
        assert main(address) == 2
        data["models"].pop(1)
        path.write_text(yaml.safe_dump(data))
        assert main(address) == 0
        assert "b" not in srv.models
        out, err = capsys.readouterr()
        assert "reload failed" in out and "b: kept its old version: " in out
        assert "guard: models[1].mirror.sample_ratee: unknown key" in err
        assert "reload applied" in out and "removed b" in out
