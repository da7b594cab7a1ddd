"""Shared fixtures. ``tests/`` is on sys.path (pytest rootdir conftest), so configs can name
``fixture_models:affine`` as a torch ``module:factory``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
MAX_WORKERS = 4  # each worker may load torch, TensorFlow and ONNX Runtime (1-2 GB)

# One OpenMP thread per process (torch's intra-op pool; the guards, verifiers and servers the
# tests start inherit it), unless the caller set another. The workers outnumber the cores
# (below), and an OpenMP team of one per core in each of them spins while its peers wait for a
# core. benchmarks/suite_cpu.py on a 2-core Xeon, the whole suite back to back: 519 s wall
# with torch's default of one thread per core, 471 s with this, the same CPU in all (867 s and
# 869 s). Tests that compare thread counts set their own (torch.set_num_threads goes past it).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject.toml's addopts): one worker per usable core and one more, at most
    MAX_WORKERS. The e2e tests spend much of their time waiting for servers and child processes:
    with one worker per core, 2 cores were 1.45 busy on average over the suite; a third worker
    fills the waits (benchmarks/suite_cpu.py on a 2-core Xeon, the whole suite: 2 workers 442 s,
    3 workers 400 s at 6% more CPU, 4 workers 403 s at 12% more)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_WORKERS, (cores or 1) + 1))


# The files that take longest (seconds of one worker, measured with --durations on 2 cores), run
# first: pytest-xdist hands out whole files (--dist loadfile) in collection order
# (--no-loadscope-reorder, pyproject.toml), and a long file dealt last leaves the other worker
# idle while it runs (longest-first is the classic fix for that tail). A stale or missing entry
# costs balance only, never a test.
LONGEST_FIRST = (
    "e2e/test_vllm.py",  # vLLM's own start, ~75 s, then three tests
    "e2e/test_llm_layer.py",
    "e2e/test_llm_online.py",
    "unit/test_generation_tier.py",
    "unit/test_activation_gguf.py",
    "unit/test_keras_activation.py",
    "e2e/test_serving_processes.py",
    "unit/test_crossedwires.py",
    "e2e/test_llm_replay.py",
    "e2e/test_prometheus_alerts.py",
    "e2e/test_fleet_alerts.py",
    "e2e/test_tensorflow_sidecar.py",
    "e2e/test_cli.py",  # both demos, the LLM one ~35 s
    "unit/test_matrix_generation.py",
    "e2e/test_replay_ray.py",
    "e2e/test_verifier_process.py",
    "e2e/test_ops_fallback_torch_sidecar.py",
    "unit/test_tensorflow_backends.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item) -> int:
        path = Path(str(item.fspath))
        return rank.get(f"{path.parent.name}/{path.name}", len(rank))

    items.sort(key=key)  # stable: the order within a file, and of the rest, is kept


# The parts of the cache every xdist worker of a run shares (each written atomically: a file
# is made beside its name and renamed in, so two workers may race for it and one wins): the
# dequantized GGUF folders (guard/backends/gguf_cache.py, ~20 s to convert), the F32 upcasts
# of GGUFs (guard/backends/gguf_quantize.py, 500 MB each, which each worker wrote again) and
# the LLM zoo's requantized ladder and one-tensor variants (guard/zoo/llm.py, 1-3 s of CPU per
# file, which each worker made again before).
SHARED_CACHE_PARTS = ("gguf-fp32", "gguf-f32", "llm")


@pytest.fixture(autouse=True, scope="session")
def _guard_cache(tmp_path_factory):
    """Derived models and compiler caches go to a per-session temp folder, not ~/.cache. Its
    parts named in SHARED_CACHE_PARTS are one folder for all xdist workers of the run, linked
    in, so that a model one worker converted the others load; the zoo's exports stay per
    worker (they are written in place)."""
    cache = tmp_path_factory.mktemp("guard-cache")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        for part in SHARED_CACHE_PARTS:
            shared = tmp_path_factory.getbasetemp().parent / part
            shared.mkdir(exist_ok=True)
            (cache / part).symlink_to(shared, target_is_directory=True)
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
