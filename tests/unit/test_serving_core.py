"""The serving core, constructed directly (no gRPC server, no child guard process): the data plane
over a ``ModelRegistry`` (real torch backends, a real route table and sample ring), the
registry's hooks (load, prepare + commit, use_primary) and the one ``ChildSupervisor`` on real
child processes that are killed. The end-to-end versions over real servers are in
tests/e2e/test_serving_processes.py, test_reload*.py and test_verifier_process.py."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading

import numpy as np
import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter

from fixture_models import DRIFT_TRIGGER, SLEEP_TRIGGER
from guard.plan.serving import load_config
from guard.errors import GuardError
from guard.ipc import routes, wire
from guard.ipc.config import backend_to_wire
from guard.ipc.messages import UsePrimary
from guard.ipc.ring import SampleRing
from guard.observe.metrics import GuardMetrics
from guard.protocol.codec import InferenceRequest
from guard.runtime.children import ChildSupervisor, RestartPolicy
from guard.serve.dataplane import DataPlane
from guard.serve.registry import ModelRegistry

AFFINE = "fixture_models:affine"


def _config(tmp_path, path: str = AFFINE, **primary_kwargs):
    block = {"name": "m", "primary": {"backend": "torch", "path": path,
                                      "options": {"kwargs": primary_kwargs}},
             "reference": {"backend": "torch", "path": AFFINE},
             "mirror": {"sample_rate": 1.0}}
    path = tmp_path / "guard.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "server": {"inline_below_ms": 0},
                                    "models": [block]}))
    return load_config(path)


class Core:
    """A registry and a data plane as a serving process holds them."""

    def __init__(self):
        self.metrics = GuardMetrics("test")
        self.table = routes.RouteTable()
        self.ring = SampleRing(1 << 20)
        self.registry = ModelRegistry(self.metrics, self.table, self.ring)
        self.plane = DataPlane(self.registry.models, self.metrics, workers=2)

    def load(self, config) -> None:
        self.registry.load(config, self.table.assign(m.name for m in config.models))
        self.plane.models_changed()
        self.plane.loading = False

    async def infer(self, first: float, request_id: str = "r") -> np.ndarray:
        x = np.array([[first, 0.0, 0.0, 0.0]], dtype=np.float32)
        result = await self.plane.infer(InferenceRequest("m", "", request_id, {"x": x}))
        return result.outputs["y"]

    def close(self) -> None:
        self.plane.close()
        self.registry.close()
        self.ring.close()
        self.table.close()


@pytest.fixture
def core():
    made = Core()
    yield made
    made.close()


def test_the_data_plane_answers_from_the_registry_and_hands_the_sample_off(tmp_path, core):
    core.load(_config(tmp_path))
    answer = asyncio.run(core.infer(1.0, "r-1"))
    handed = wire.decode(core.ring.take())
    assert (handed.model, handed.request_id, handed.route) == ("m", "r-1", "primary")
    np.testing.assert_array_equal(handed.payload.answer()["y"], answer)
    assert handed.slot == core.registry.models["m"].slot
    # The route word the verifier publishes is what the next request reads.
    core.table.publish(handed.slot, "fallback", False, 1)
    asyncio.run(core.infer(1.0, "r-2"))
    assert wire.decode(core.ring.take()).route == "primary"  # no fallback configured


def test_use_primary_serves_the_variant_from_its_block_and_the_configured_one_back(tmp_path,
                                                                                   core):
    config = _config(tmp_path)
    core.load(config)
    before = asyncio.run(core.infer(DRIFT_TRIGGER))
    variant = {**backend_to_wire(config.models[0].primary),
               "options": {"kwargs": {"drift_on_trigger": True}}}
    assert core.registry.use_primary(UsePrimary("m", ["linear"], variant)) == ""
    assert core.registry.models["m"].kept == ["linear"]
    np.testing.assert_allclose(asyncio.run(core.infer(DRIFT_TRIGGER)), before + 1.0, rtol=1e-6)
    refused = core.registry.use_primary(UsePrimary("m", ["linear"], None))
    assert "without the rebuilt primary" in refused
    assert "unknown model 'x'" in core.registry.use_primary(UsePrimary("x", []))
    assert core.registry.use_primary(UsePrimary("m", [])) == ""
    np.testing.assert_allclose(asyncio.run(core.infer(DRIFT_TRIGGER)), before, rtol=1e-6)


def test_a_commit_swaps_the_prepared_model_and_retires_the_old_one_after_its_last_request(
        tmp_path, core, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    core.load(_config(tmp_path, sleep_on_trigger=1.0))
    old = core.registry.models["m"]
    new_config = _config(tmp_path, drift_on_trigger=True)

    async def scenario():
        slow = asyncio.ensure_future(core.infer(SLEEP_TRIGGER))
        while not old.requests_in_flight:
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        failed = await loop.run_in_executor(
            None, core.registry.prepare, new_config, core.table.assign(["m"]), ["m"])
        assert failed == {}
        assert core.registry.models["m"] is old  # prepared beside it, not yet in
        await core.registry.commit(["m"], [], report_s=0.2)
        assert core.registry.models["m"] is not old
        drifted = await core.infer(DRIFT_TRIGGER)  # the next request: the new version
        assert old.ready  # still open: the slow request is inside it
        await slow
        while old.ready:
            await asyncio.sleep(0.05)
        return drifted

    drifted = asyncio.run(scenario())
    assert drifted.shape == (1, 3)
    names = [json.loads(r.getMessage())["event"] for r in caplog.records
             if r.name == "guard.events"]
    assert "model_retire_waiting" in names and "model_retired" in names


def test_a_prepare_that_fails_keeps_the_old_model(tmp_path, core):
    core.load(_config(tmp_path))
    old = core.registry.models["m"]
    broken = _config(tmp_path, path="fixture_models:no_such_factory")
    failed = core.registry.prepare(broken, core.table.assign(["m"]), ["m"])
    assert list(failed) == ["m"] and failed["m"].startswith("serving process 0: ")
    asyncio.run(core.registry.commit([], []))
    assert core.registry.models["m"] is old and old.ready


# -- the supervisor ------------------------------------------------------------------------------
class SleepingChild:
    """A real child process (a sleeping Python) under the supervisor: what a kind of child
    implements, and a log of what the supervisor asked of it."""

    kind = "test_child"
    fields = {"index": 7}

    def __init__(self, failures: int = 0):
        self.failures = failures  # launches that fail before one comes up
        self.launched: list[int] = []
        self.lost_how: list[str] = []
        self.ended: list[int | None] = []
        self.hang: str | None = None

    def launch(self) -> subprocess.Popen:
        if self.failures:
            self.failures -= 1
            raise GuardError("not this time")
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.launched.append(process.pid)
        return process

    def hung(self, process):
        return self.hang

    def lost(self, process, how):
        self.lost_how.append(how)
        self.hang = None
        return {"extra": "field"}

    def end(self, process, grace):
        self.ended.append(process.pid if process is not None else None)
        if process is not None:
            process.terminate()
            process.wait(grace)


def _events(caplog, prefix: str) -> list[dict]:
    return [e for e in (json.loads(r.getMessage()) for r in caplog.records
                        if r.name == "guard.events") if e["event"].startswith(prefix)]


def _wait(predicate, timeout: float = 20.0):
    done = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        done.wait(0.02)
    raise AssertionError("condition not met")


@pytest.fixture
def restarts():
    return Counter("test_child_restarts", "restarts", registry=CollectorRegistry())


def test_a_killed_child_is_counted_announced_and_started_again(caplog, restarts):
    caplog.set_level(logging.INFO, logger="guard.events")
    child = SleepingChild()
    supervisor = ChildSupervisor(child, RestartPolicy(0.05, 0.2, watch_s=0.05), restarts)
    supervisor.start()
    try:
        first = supervisor.process
        first.kill()
        # The new process is in place a moment before its `restarted` event is emitted.
        _wait(lambda: len(child.launched) == 2 and supervisor.process is not first
              and len(_events(caplog, "test_child_")) == 2)
        assert supervisor.running and restarts._value.get() == 1
        assert child.lost_how == ["exited with signal SIGKILL"]
        lost, restarted = _events(caplog, "test_child_")
        assert lost["event"] == "test_child_lost" and lost["index"] == 7
        assert lost["pid"] == first.pid and lost["extra"] == "field"
        assert lost["restart_in_s"] == 0.05
        assert restarted == {**restarted, "event": "test_child_restarted",
                             "pid": supervisor.process.pid, "index": 7}
    finally:
        supervisor.stop(5)
    assert child.ended == [child.launched[-1]] and not supervisor.running


def test_failed_restarts_back_off_doubling_up_to_the_ceiling(caplog, restarts):
    caplog.set_level(logging.INFO, logger="guard.events")
    child = SleepingChild()
    supervisor = ChildSupervisor(child, RestartPolicy(0.02, 0.08, watch_s=0.05), restarts)
    supervisor.start()
    try:
        child.failures = 3
        supervisor.process.kill()
        _wait(lambda: len(child.launched) == 2)
        failed = [e for e in _events(caplog, "test_child_") if e["event"].endswith("_failed")]
        assert [e["retry_in_s"] for e in failed] == [0.04, 0.08, 0.08]  # 0.02 doubling
        assert all(e["error"] == "not this time" for e in failed)
    finally:
        supervisor.stop(5)


def test_a_hung_child_is_killed_and_restarted(caplog, restarts):
    caplog.set_level(logging.INFO, logger="guard.events")
    child = SleepingChild()
    supervisor = ChildSupervisor(child, RestartPolicy(0.02, 0.1, watch_s=0.05), restarts)
    supervisor.start()
    try:
        hung = supervisor.process
        child.hang = "hung: no heartbeat"
        _wait(lambda: len(child.launched) == 2)
        assert hung.returncode == -9  # SIGKILL
        assert child.lost_how == ["hung: no heartbeat"]
    finally:
        supervisor.stop(5)


def test_a_first_start_that_fails_raises_and_leaves_nothing_running(restarts):
    child = SleepingChild(failures=1)
    supervisor = ChildSupervisor(child, RestartPolicy(0.02, 0.1), restarts)
    with pytest.raises(GuardError, match="not this time"):
        supervisor.start()
    assert supervisor.process is None and child.launched == []


def test_a_stopped_child_is_not_started_again(restarts):
    child = SleepingChild()
    supervisor = ChildSupervisor(child, RestartPolicy(0.02, 0.1, watch_s=0.05), restarts)
    supervisor.start()
    supervisor.stop(5)
    threading.Event().wait(0.3)
    assert len(child.launched) == 1 and restarts._value.get() == 0
