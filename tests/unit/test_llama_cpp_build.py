"""llama.cpp as `make` builds it: the version pyproject.toml pins, for x86-64-v3, not the build
machine's CPU (a native build's AMX matmul crashed on a VM whose CPU advertises AMX)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _makefile_variable(name: str) -> str:
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    (value,) = re.findall(rf"^{name} := (.+)$", text, re.M)
    return " ".join(value.split())


def test_the_makefile_builds_the_version_pyproject_pins():
    pins = re.findall(r'"llama-cpp-python\[server\]==([^"]+)"',
                      (ROOT / "pyproject.toml").read_text())
    assert pins and set(pins) == {_makefile_variable("LLAMA_CPP_VERSION")}


def test_the_build_is_not_native_and_has_no_amx():
    flags = _makefile_variable("LLAMA_CPP_CMAKE_ARGS").split()
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX2=ON" in flags
    assert not any("AMX" in flag or "AVX512" in flag for flag in flags)


def test_the_installed_engine_was_built_so():
    llama_cpp = pytest.importorskip("llama_cpp")
    info = llama_cpp.llama_print_system_info().decode()
    features = dict(re.findall(r"(\w+) = (\d)", info))
    assert features.get("AVX2") == "1", info
    assert not {name for name, on in features.items()
                if on == "1" and (name.startswith("AMX") or name.startswith("AVX512"))}, info
