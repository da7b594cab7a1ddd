"""guard/collector.py and its use by replay: what a load leaves alive is frozen out of the cyclic
collector while replay's runners live, and given back when they close."""

from __future__ import annotations

import gc

import pytest

from guard import collector
from guard.config import ModelConfig
from guard.replay.execute import Runners


@pytest.fixture(autouse=True)
def unfrozen():
    collector.thaw()
    yield
    collector.thaw()


def test_frozen_objects_are_not_walked_until_thawed():
    loaded = [[i] for i in range(50_000)]  # containers the collector tracks
    walked_before = len(gc.get_objects())
    assert collector.freeze_loaded().startswith("froze ")
    assert gc.get_freeze_count() >= len(loaded)
    assert len(gc.get_objects()) < walked_before - len(loaded)  # a full collection skips them
    collector.thaw()
    assert gc.get_freeze_count() == 0
    assert len(gc.get_objects()) >= len(loaded)


def test_garbage_cycles_are_collected_before_the_freeze():
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle only the collector frees
    del a, b
    collector.freeze_loaded()
    assert not [o for o in gc.get_objects() if type(o) is Node]


def test_off_switch(monkeypatch):
    monkeypatch.setenv("GUARD_GC_FREEZE", "off")
    assert collector.freeze_loaded() == "off (GUARD_GC_FREEZE)"
    assert gc.get_freeze_count() == 0


def test_replay_runners_freeze_on_load_and_thaw_on_close(zoo_classifier):
    onnx = str(zoo_classifier["onnx"])
    config = ModelConfig.model_validate({
        "name": "cnn", "primary": {"backend": "onnxruntime", "path": onnx},
        "reference": {"backend": "torch", "path": str(zoo_classifier["torchscript"])}})
    runners = Runners({"cnn": config})
    try:
        runner = runners.get("cnn")
        assert gc.get_freeze_count() > 0
        # the loaded backends are among the frozen: a full collection does not walk them
        walked = {id(o) for o in gc.get_objects()}
        assert id(runner.reference) not in walked and id(runner.primary) not in walked
    finally:
        runners.close()
    assert gc.get_freeze_count() == 0

