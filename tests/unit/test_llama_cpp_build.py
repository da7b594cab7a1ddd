"""llama.cpp as `make` builds it: the version pyproject.toml pins, with named flags, never AMX (a
native build's AMX matmul crashed on a VM whose CPU advertises AMX): x86-64-v3 and the AVX-512
and AVX-VNNI extensions the CPU lists (LLAMA_CPP_ISA=host), or x86-64-v3 alone."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from guard.backends.llama_cpp import build_features
from guard.machine import cpu_flags

ROOT = Path(__file__).resolve().parents[2]
# llama.cpp's name for a feature in llama_print_system_info -> the /proc/cpuinfo flag it needs.
CPU_FLAG_OF = {"AVX512": "avx512bw", "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni",
               "AVX512_BF16": "avx512_bf16", "AVX_VNNI": "avx_vnni"}


def _makefile_variable(name: str) -> str:
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    (value,) = re.findall(rf"^{name} := (.+)$", text, re.M)
    return " ".join(value.split())


def _cpu_flags() -> frozenset[str]:
    return cpu_flags() or frozenset()


def _make(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("make") is None:
        pytest.skip("no make here")
    return subprocess.run(["make", "-s", "--no-print-directory", "llama-cpp-flags", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)


def _make_flags(*args: str) -> list[str]:
    done = _make(*args)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_makefile_builds_the_version_pyproject_pins():
    pins = re.findall(r'"llama-cpp-python\[server\]==([^"]+)"',
                      (ROOT / "pyproject.toml").read_text())
    assert pins and set(pins) == {_makefile_variable("LLAMA_CPP_VERSION")}


def test_the_portable_build_is_x86_64_v3_alone():
    flags = _make_flags("LLAMA_CPP_ISA=x86-64-v3")
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX2=ON" in flags
    assert not any("AMX" in flag or "AVX512" in flag or "VNNI" in flag for flag in flags)


def test_the_host_build_adds_what_this_cpu_has_and_never_amx():
    flags = _make_flags()
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX2=ON" in flags
    assert not any("AMX" in flag for flag in flags)
    cpu = _cpu_flags()
    for feature, cpu_flag in CPU_FLAG_OF.items():
        assert (f"-DGGML_{feature}=ON" in flags) <= (cpu_flag in cpu), feature
    avx512 = {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"} <= cpu
    assert ("-DGGML_AVX512=ON" in flags) == avx512


def test_an_unknown_isa_is_refused_by_name():
    done = _make("LLAMA_CPP_ISA=native")
    assert done.returncode != 0 and "LLAMA_CPP_ISA=native: host or x86-64-v3" in done.stderr


def test_the_installed_engine_uses_no_amx_and_nothing_this_cpu_lacks():
    pytest.importorskip("llama_cpp")
    features = build_features()
    assert "AVX2" in features, features
    assert not {name for name in features if name.startswith("AMX")}, features
    cpu = _cpu_flags()
    assert {name for name in features if name in CPU_FLAG_OF
            and CPU_FLAG_OF[name] not in cpu} == set(), features
