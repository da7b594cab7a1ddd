"""deploy/kubernetes's kustomizations built as a user builds them (`kubectl kustomize`) and
validated with kubernetes-validate, for tests/deploy/test_manifests*.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_VERSIONS = ["1.29.0", "1.33.0"]
KUBECTL = shutil.which("kubectl")
KUBERNETES_VALIDATE = Path(sys.executable).with_name("kubernetes-validate")


def build(kustomization: str, folder: Path) -> tuple[Path, list[dict]]:
    """The rendered file (in ``folder``) and its documents."""
    assert KUBECTL is not None
    result = subprocess.run([KUBECTL, "kustomize", kustomization], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    path = folder / "built.yaml"
    path.write_text(result.stdout)
    return path, [d for d in yaml.safe_load_all(result.stdout) if d]


def validate(path: Path, version: str) -> subprocess.CompletedProcess:
    """kubernetes-validate, strict, against one Kubernetes version's schemas."""
    return subprocess.run([str(KUBERNETES_VALIDATE), "-k", version, "--strict", str(path)],
                          capture_output=True, text=True, timeout=300)


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    """The one document of ``kind`` (named ``name`` where several are)."""
    found = [d for d in docs if d["kind"] == kind
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]
