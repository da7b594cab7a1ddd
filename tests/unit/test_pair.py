"""guard/verify/pair.py: the one assembly of a checked pair, shared by the verifier process and
``guard replay`` (real torch backends through the ``module:factory`` path)."""

from __future__ import annotations

import numpy as np
import pytest

from guard.config import ModelConfig
from guard.errors import BackendError
from guard.replay.execute import ModelRunner
from guard.verify.pair import CheckedPair


def config(**overrides) -> ModelConfig:
    block = {"name": "m",
             "primary": {"backend": "torch", "path": "fixture_models:affine"},
             "reference": {"backend": "torch", "path": "fixture_models:affine"},
             "checks": {"tensor": {"atol": 1e-5, "rtol": 1e-4}}}
    block.update(overrides)
    return ModelConfig.model_validate(block)


def test_pair_loads_measures_the_floor_and_the_verifier_allows_it():
    pair = CheckedPair(config()).load()
    try:
        floor = pair.noise_floor
        assert floor is not None and not floor.skipped
        assert pair.comparator.per_output["y"].floor == floor.per_output["y"]
        x = {"x": np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)}
        assert pair.comparator.check(pair.reference.infer(x), pair.primary.infer(x), x).passed
    finally:
        pair.close()


def test_replay_runs_on_the_same_assembly():
    runner = ModelRunner(config()).load()
    try:
        assert isinstance(runner.pair, CheckedPair)
        assert runner.comparator is runner.pair.comparator
        assert runner.noise_floor is runner.pair.noise_floor
    finally:
        runner.close()


def test_a_role_that_cannot_load_is_named():
    pair = CheckedPair(config(reference={"backend": "torch", "path": "fixture_models:nope"}))
    with pytest.raises(BackendError, match=r"models\[m\]\.reference"):
        pair.load()
    pair.close()


def test_no_reference_is_refused_with_the_reason():
    with pytest.raises(BackendError, match="reference"):
        CheckedPair(config(reference=None))
