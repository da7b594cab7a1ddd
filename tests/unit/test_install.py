"""The install story (issue 28, item 3): `make demo` installs the demo extra only; `make test`
the development set (a superset); the README says which extra serves which backend."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def recipe(target: str, venv: Path) -> str:
    """What `make TARGET` would run on a machine without the venv (make -n: nothing runs)."""
    result = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def installs(text: str) -> set[str]:
    return set(re.findall(r"pip install -q -e '\.\[([a-z,]+)\]'", text))


@needs_make
def test_make_demo_installs_the_demo_extra_only(tmp_path):
    assert installs(recipe("demo", tmp_path / "venv")) == {"demo"}
    demo = recipe("demo", tmp_path / "venv")
    assert "pytriton" not in demo and "kserve" not in demo
    assert installs(recipe("test", tmp_path / "venv")) == {"dev"}


def extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]


def test_the_demo_extra_is_within_the_development_set():
    dev = extras()["dev"][0]  # "guard[a,b,...]"
    included = set(dev[dev.index("[") + 1:dev.index("]")].split(","))
    demo = extras()["demo"][0]
    assert set(demo[demo.index("[") + 1:demo.index("]")].split(",")) <= included


def test_the_readme_install_section_names_every_backend_extra():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Install"):readme.index("\n## ", readme.index("## Install") + 1)]
    assert "pip install ." in section
    for extra in ("onnxruntime", "torch", "openvino", "tensorflow", "envoy", "demo", "dev"):
        assert extra in extras(), extra
        assert f"[{extra}]" in section or f"`{extra}`" in section, extra
