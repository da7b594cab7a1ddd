"""The Triton the e2e tests run is the one `make venv` installs, beside the venv, not in it."""

from __future__ import annotations

import re
from pathlib import Path

import triton_server

ROOT = Path(__file__).resolve().parents[2]


def test_makefile_installs_the_package_the_fixture_names():
    makefile = (ROOT / "Makefile").read_text()
    (pinned,) = re.findall(r"^TRITON_PACKAGE := (\S+)$", makefile, re.M)
    assert pinned == triton_server.TRITON_PACKAGE
    # --no-deps --target: its numpy<2 pin must not reach the venv (pip check stays clean).
    assert "--no-deps --upgrade --target $(VENV)/triton '$(TRITON_PACKAGE)'" in makefile


def test_model_config_names_the_python_backend_on_cpu():
    text = triton_server.model_config("m", [("image", "TYPE_FP32", [-1, 3, 32, 32])],
                                      [("logits", "TYPE_FP32", [-1, 10])])
    assert 'name: "m"\nbackend: "python"\nmax_batch_size: 0\n' in text
    assert '{ name: "image" data_type: TYPE_FP32 dims: [ -1, 3, 32, 32 ] }' in text
    assert "kind: KIND_CPU" in text


def test_a_missing_server_is_a_reason_that_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("GUARD_TRITON_HOME", str(tmp_path))
    reason = triton_server.unavailable_reason()
    assert reason.startswith(f"Triton server binary not found at {tmp_path}/pytriton/")
    assert "--no-deps --target" in reason and triton_server.TRITON_PACKAGE in reason
