"""Shared fixtures. ``tests/`` is on sys.path (pytest rootdir conftest), so configs can name
``fixture_models:affine`` as a torch ``module:factory``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
MAX_WORKERS = 4  # each worker may load torch, TensorFlow and ONNX Runtime (1-2 GB)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject.toml's addopts): one worker per core, at most MAX_WORKERS. The e2e
    tests spend much of their time waiting for servers and child processes, so two workers on two
    cores nearly halve the suite's wall time; more than four would mostly add memory."""
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


@pytest.fixture(autouse=True, scope="session")
def _guard_cache(tmp_path_factory):
    """Derived models and compiler caches go to a per-session temp folder, not ~/.cache."""
    cache = tmp_path_factory.mktemp("guard-cache")
    os.environ["GUARD_CACHE_DIR"] = str(cache)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    yield cache


@pytest.fixture(scope="session")
def zoo_folder(_guard_cache) -> Path:
    """One folder for every seeded zoo export of the session: an export already there for its
    seed is reused (guard/zoo/export.py), so each model is exported once, whichever tests ask
    for it. It is the folder ``guard matrix`` exports zoo models to (guard.matrix.runner's
    ``zoo_dir``, under the session's cache), so a sweep reuses the tests' exports too."""
    from guard.matrix.runner import zoo_dir

    folder = zoo_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def zoo_classifier(zoo_folder) -> dict[str, Path]:
    """The seeded zoo CNN exported once per session: {'torchscript': .pt, 'onnx': .onnx}."""
    from guard.zoo import classifier

    return classifier.export(zoo_folder)


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(0)
