"""guard/backends/determinism.py: a torch reference pins determinism without loading torch's
compiler, and a compiler that is (or gets) loaded still follows the pin."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from guard.backends import determinism  # noqa: E402


def test_pinning_a_reference_sets_the_flags_and_leaves_the_compiler_unloaded():
    """In a fresh interpreter (the switches are process-wide, and the point is what gets
    imported): the flags are set and neither torch._dynamo nor torch._inductor is loaded."""
    code = """
import json, sys, torch
from guard.backends.determinism import pin_torch_reference
pin_torch_reference(2)
print(json.dumps({"deterministic": torch.are_deterministic_algorithms_enabled(),
                  "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
                  "tf32": torch.backends.cuda.matmul.allow_tf32,
                  "threads": torch.get_num_threads(),
                  "dynamo": "torch._dynamo" in sys.modules,
                  "inductor": "torch._inductor" in sys.modules}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == {
        "deterministic": True, "warn_only": True, "tf32": False, "threads": 2,
        "dynamo": False, "inductor": False}


@pytest.fixture
def inductor_config(monkeypatch):
    """torch's compiler config with its deterministic switch off, and guard's pin undone, for
    one test (both are put back after it). Imported here, in the test process: a suite that
    compiles (test_backends) has loaded it already."""
    import torch._inductor.config as config

    monkeypatch.setattr(determinism, "_pinned", False)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # keep this process's count
    with config.patch(deterministic=False):  # the config module's own save and restore
        yield config


def test_a_compiler_loaded_before_the_pin_follows_it(inductor_config):
    determinism.pin_torch_reference(0)
    assert inductor_config.deterministic is True
    assert torch.are_deterministic_algorithms_enabled()


def test_torch_compile_makes_the_compiler_follow_a_pin_and_only_a_pin(inductor_config):
    determinism.pin_compiler()  # no reference pinned: the compiler keeps its default
    assert inductor_config.deterministic is False
    determinism._pinned = True  # a reference pinned while the compiler was not loaded
    determinism.pin_compiler()
    assert inductor_config.deterministic is True
