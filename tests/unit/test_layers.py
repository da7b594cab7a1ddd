"""The layers hold (docs/architecture.md; the contracts are [tool.importlinter] in pyproject.toml).

import-linter builds its graph from every import statement of guard/, those inside functions
included, and a forbidden contract also refuses chains through other modules; this test runs it
as CI would and shows its report when a contract breaks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _contracts() -> list[dict]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]["contracts"]


def _lint_imports() -> str:
    beside = Path(sys.executable).with_name("lint-imports")
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    if found is None:
        pytest.fail("lint-imports is not installed (pip install import-linter: the dev extra)")
    return found


def test_import_contracts_are_kept():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    result = subprocess.run([_lint_imports(), "--no-cache", "--no-logo"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(_contracts())} kept, 0 broken." in result.stdout, result.stdout


def test_every_package_is_held_to_the_serve_rule():
    """A package added beside the others falls under "only the command line and serve/ import
    serve/" without anyone remembering to list it."""
    rule = next(c for c in _contracts() if c["forbidden_modules"] == ["guard.serve"])
    command_line = {"cli", "demo", "demo_llm", "serve", "__main__", "__init__"}
    packages = {p.stem if p.is_file() else p.name for p in (ROOT / "guard").iterdir()
                if (p.suffix == ".py" or (p / "__init__.py").exists())}
    listed = {m.removeprefix("guard.") for m in rule["source_modules"]}
    assert packages - command_line == listed


def test_registries_above_the_backends_name_real_backends():
    """The repair's strategies are keyed by backend name in their own layer: every key is a
    registered backend. What a backend captures for tier 2 it declares itself: every declared
    capture loads, and a backend declaring none gets none."""
    from guard.backends import BACKEND_NAMES, backend_kinds
    from guard.backends.activations import capturable, capture_side
    from guard.policy.keep_back import STRATEGIES, KeepBack

    assert set(STRATEGIES) <= set(BACKEND_NAMES)
    assert capturable() and all(callable(capture_side(name)) for name in capturable())
    assert capture_side("upstream") is None and not backend_kinds()["upstream"].activations
    assert all(issubclass(strategy, KeepBack) and strategy.option
               for by_precision in STRATEGIES.values() for strategy in by_precision.values())


def test_the_checks_capture_nothing_themselves():
    """Capturing a model's intermediate tensors is a backend capability: no module of verify/
    imports a backend's internals (its classes, its derived variants); tier 2 compares what a
    capture hands it."""
    import ast

    for path in (ROOT / "guard" / "verify").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "guard.backends."):
                assert node.module.startswith(("guard.backends.activations", "guard.backends.kind",
                                               "guard.backends.loading", "guard.backends.scoring",
                                               "guard.backends.signature_match",
                                               "guard.backends.signatures",
                                               "guard.backends.token_alignment")), \
                    (path, node.module)
