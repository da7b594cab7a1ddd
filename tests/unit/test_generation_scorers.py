"""The scorer blocks as the config validates them (no model loaded, no heavy import)."""

from __future__ import annotations

import sys

import pytest

from guard.backends import backend_kind
from guard.backends.scoring import Scorer, bos_findings
from guard.config.backend import BackendConfig


def test_scorer_blocks_validate_and_import_nothing_heavy(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    before = {name for name in ("torch", "transformers", "llama_cpp") if name in sys.modules}
    for backend in ("transformers", "llama_cpp"):
        spec = BackendConfig(backend=backend, path=str(gguf))
        assert issubclass(backend_kind(backend).backend, Scorer)
        assert spec.describe().endswith("m.gguf")
    assert BackendConfig(backend="transformers", path=str(tmp_path)).path == str(tmp_path)
    assert {name for name in ("torch", "transformers", "llama_cpp") if name in sys.modules} \
        == before


@pytest.mark.parametrize("block, message", [
    ({"backend": "llama_cpp", "path": "m.onnx"}, "not a .gguf file"),
    ({"backend": "llama_cpp", "path": "m.gguf", "device": "cuda"}, "runs on cpu"),
    ({"backend": "llama_cpp", "path": "m.gguf", "options": {"n_ctx": 4}}, "n_ctx"),
    ({"backend": "llama_cpp", "path": "m.gguf", "options": {"context_length": 4}},
     "context_length"),
    ({"backend": "transformers", "path": "m.gguf", "precision": "int8"}, "int8"),
    ({"backend": "transformers"}, "needs 'path'"),
])
def test_bad_scorer_blocks_say_what_is_wrong(block, message, tmp_path):
    """Each block held against its backend's declaration, as guard serve plans a config."""
    from guard.config import ConfigContext
    from guard.errors import ConfigError
    from guard.plan.serving import backend_block

    with pytest.raises(ConfigError) as raised:
        backend_block(block, ConfigContext(tmp_path), "guard.yaml")
    assert any(message in line for line in raised.value.problems), raised.value.problems


def test_bos_findings():
    assert bos_findings([1, 1, 5], bos_id=1, adds_bos=False) == ("double_bos",)
    assert bos_findings([5, 6], bos_id=1, adds_bos=True) == ("missing_bos",)
    assert bos_findings([1, 5], bos_id=1, adds_bos=True) == ()
    assert bos_findings([5], bos_id=None, adds_bos=True) == ()
