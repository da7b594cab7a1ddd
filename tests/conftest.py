"""Shared fixtures. ``tests/`` is on sys.path (pytest rootdir conftest), so configs can name
``fixture_models:affine`` as a torch ``module:factory``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture(autouse=True, scope="session")
def _guard_cache(tmp_path_factory):
    """Derived models and compiler caches go to a per-session temp folder, not ~/.cache."""
    cache = tmp_path_factory.mktemp("guard-cache")
    os.environ["GUARD_CACHE_DIR"] = str(cache)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    yield cache


@pytest.fixture(scope="session")
def zoo_classifier(tmp_path_factory) -> dict[str, Path]:
    """The seeded zoo CNN exported once per session: {'torchscript': .pt, 'onnx': .onnx}."""
    from guard.zoo import classifier

    return classifier.export(tmp_path_factory.mktemp("zoo"))


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(0)
