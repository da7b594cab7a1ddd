"""The transformers backend keeps a GGUF dequantized (guard/backends/gguf_cache.py): the second
load reads the cached folder, and scores exactly as the GGUF's own load does."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers", reason="transformers (the llm extra) is not installed")
pytest.importorskip("gguf", reason="gguf (the llm extra) is not installed")

from guard.backends import create_backend, gguf_cache  # noqa: E402
from guard.backends.transformers import _keep_dequantized  # noqa: E402
from guard.config.backend import BackendConfig  # noqa: E402
from guard.zoo import llm  # noqa: E402

try:
    SHIPPED = llm.smollm2_gguf()
except FileNotFoundError as exc:  # pragma: no cover - depends on the install
    pytest.skip(str(exc), allow_module_level=True)


def _scored(backend):
    ids = backend.encode_prompt(llm.PROMPTS[0]) + backend.vocab.encode(" Paris, the capital")
    return backend.forward(ids, len(ids) - 4)


def test_a_gguf_is_parsed_once_then_loaded_from_its_cached_folder(caplog, tmp_path,
                                                                  monkeypatch):
    # A cache of its own: the session's is shared by the xdist workers (tests/conftest.py).
    monkeypatch.setenv("GUARD_CACHE_DIR", str(tmp_path))
    folder = gguf_cache.folder_for(SHIPPED)
    assert not folder.exists()
    spec = BackendConfig(backend="transformers", path=str(SHIPPED))

    parsed = create_backend(spec, "reference", 1)
    parsed.load()
    assert Path(parsed.model.name_or_path) == SHIPPED.parent  # from the GGUF itself
    assert gguf_cache.is_complete(folder)
    assert folder.name.startswith(gguf_cache.file_sha256(SHIPPED))
    written = (folder / "config.json").read_text()
    assert "quantization_config" not in written  # plain fp32 weights, for vLLM too

    cached = create_backend(spec, "reference", 1)
    cached.load()
    assert Path(cached.model.name_or_path) == folder
    assert parsed.encode_prompt(llm.PROMPTS[1]) == cached.encode_prompt(llm.PROMPTS[1])
    assert (parsed.render_chat([{"role": "user", "content": "Hi"}])
            == cached.render_chat([{"role": "user", "content": "Hi"}]))
    np.testing.assert_array_equal(_scored(parsed), _scored(cached))

    # A cache that cannot be written costs the next load its speed, never this one its model.
    blocked = folder.parent / "not-a-folder"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="guard.backends.transformers"):
        _keep_dequantized(blocked / "entry", cached.model, cached._loaded_tokenizer())
    assert "could not cache the dequantized GGUF" in caplog.text
    blocked.unlink()


def test_a_second_converter_waits_for_the_first(tmp_path):
    import threading

    folder = tmp_path / "gguf-fp32" / "entry"
    order: list[str] = []
    first_holds = threading.Event()

    def second() -> None:
        first_holds.wait()
        with gguf_cache.converting(folder):
            order.append("second")

    waiter = threading.Thread(target=second)
    waiter.start()
    with gguf_cache.converting(folder):
        first_holds.set()
        waiter.join(timeout=0.3)  # it cannot get in while the first holds the lock
        assert waiter.is_alive()
        order.append("first")
    waiter.join(timeout=10)
    assert order == ["first", "second"]


def _tiny_gguf(path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_token_list(["<s>", "a", "b"])
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_opened_again_within_parsed_once_is_the_same_parse(tmp_path):
    """transformers opens a GGUF three times per load and builds gguf's tensor-name map once per
    module (gguf_cache.parsed_once): within the block each is built once per argument, equal
    to what gguf builds, and gguf's own functions are back after the block, an error or not."""
    import gguf

    path = _tiny_gguf(tmp_path / "tiny.gguf")
    plain = gguf.GGUFReader(path)
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError), gguf_cache.parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # however the path is spelt
        assert gguf.GGUFReader(path, "c") is not first  # a copy-on-write map is never shared
        assert list(first.fields) == list(plain.fields)
        np.testing.assert_array_equal(first.tensors[0].data, plain.tensors[0].data)
        arch = gguf.MODEL_ARCH.LLAMA
        names = gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 2) is names
        assert gguf.get_tensor_name_map(arch, 3) is not names
        assert (names.get_name("model.layers.1.self_attn.q_proj")
                == name_map(arch, 2).get_name("model.layers.1.self_attn.q_proj"))
        raise RuntimeError("the load failed")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
