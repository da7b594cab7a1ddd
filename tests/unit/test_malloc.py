"""guard/malloc.py: with the settings, a forward-like loop (several large blocks allocated,
written, freed, every call) stops page-faulting its memory back in on each call. Run in fresh
interpreters: malloc's settings are per process."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")

# Eight 4 MiB blocks per "call", 32 MiB in all: more than glibc's dynamic trim threshold
# (twice the largest block freed so far, 8 MiB here), so untuned glibc trims the heap at the end
# of each call and the next call faults it back in.
LOOP = """
import json, resource, sys
if sys.argv[1] == "tuned":
    from guard.malloc import tune_for_inference
    done = tune_for_inference()
else:
    done = "untuned"
import numpy as np
def call():
    blocks = [np.ones(1 << 20, np.float32) for _ in range(8)]
    return sum(float(b[0]) for b in blocks)
for _ in range(5):
    call()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    call()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"done": done, "faults_per_call": faults / 20}))
"""
PAGES_PER_CALL = 8 * (4 << 20) // 4096


def _run(mode: str, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", LOOP, mode], capture_output=True, text=True,
                         check=True, env={**os.environ, **env}, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tuned_loop_keeps_its_memory_mapped():
    tuned = _run("tuned")
    assert tuned["done"].startswith("glibc mmap threshold 32 MiB")
    # The blocks stay in the heap between calls: (almost) no page touched is faulted again.
    assert tuned["faults_per_call"] < 0.01 * PAGES_PER_CALL, tuned
    untuned = _run("untuned")
    print(f"faults per call: tuned {tuned['faults_per_call']}, untuned "
          f"{untuned['faults_per_call']} (of {PAGES_PER_CALL} pages touched)")


def test_off_switch_and_the_users_own_settings_win():
    assert _run("tuned", GUARD_MALLOC_TUNING="off")["done"] == "off (GUARD_MALLOC_TUNING)"
    assert _run("tuned", MALLOC_TRIM_THRESHOLD_="1000000")["done"] == (
        "left to the MALLOC_*_ environment variables")
