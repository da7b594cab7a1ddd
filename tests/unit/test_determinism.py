"""guard/backends/determinism.py: a torch reference pins determinism without loading torch's
compiler, and a compiler that is (or gets) loaded still follows the pin. Each case runs in a
fresh interpreter: the switches are process-wide, and the point is what gets imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_pinning_a_reference_sets_the_flags_and_leaves_the_compiler_unloaded():
    seen = _run("""
import json, sys, torch
from guard.backends.determinism import pin_compiler, pin_torch_reference
pin_torch_reference(2)
seen = {"deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "tf32": torch.backends.cuda.matmul.allow_tf32, "threads": torch.get_num_threads(),
        "dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules}
pin_compiler()  # what a torch_compile backend calls before it compiles
import torch._inductor.config as inductor_config
seen["inductor_deterministic"] = inductor_config.deterministic
print(json.dumps(seen))
""")
    assert seen == {"deterministic": True, "warn_only": True, "tf32": False, "threads": 2,
                    "dynamo": False, "inductor": False, "inductor_deterministic": True}


def test_a_compiler_loaded_before_the_pin_follows_it_and_none_follows_without_a_pin():
    seen = _run("""
import json, torch
import torch._inductor.config as inductor_config
from guard.backends.determinism import pin_compiler, pin_torch_reference
pin_compiler()  # no reference pinned in this process: the compiler keeps its default
before = inductor_config.deterministic
pin_torch_reference(0)
print(json.dumps({"before": before, "after": inductor_config.deterministic}))
""")
    assert seen == {"before": False, "after": True}
