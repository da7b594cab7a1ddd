"""The llama_cpp reference's ``upcast`` option (guard/backends/gguf_quantize.py): the GGUF's
weights held as F32. The copy must hold every weight of the file exactly (gguf's own
dequantization of each tensor, compared bit for bit), be written once per file content, and
score as the transformers fp32 reference on the same weights does (both dequantize them
exactly; what is left is llama.cpp's F16 KV cache and summation order), where the file as
stored (Q4_1: llama.cpp quantizes the activations to 8 bits for its products) does not."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
pytest.importorskip("gguf", reason="gguf is not installed")

from guard.backends import create_backend  # noqa: E402
from guard.backends.derive import cache_root  # noqa: E402
from guard.config.backend import BackendConfig  # noqa: E402
from guard.matrix.generation import kld_rows  # noqa: E402
from guard.zoo import llm  # noqa: E402

try:
    SHIPPED = llm.smollm2_gguf()
except FileNotFoundError as exc:  # pragma: no cover - depends on the install
    pytest.skip(str(exc), allow_module_level=True)


def _scorer(path, **options):
    scorer = create_backend(BackendConfig(backend="llama_cpp", path=str(path),
                                          options={"context_length": 256, **options}),
                            "reference")
    scorer.load()
    return scorer


def _copies() -> set[str]:
    folder = cache_root() / "gguf-f32"
    return set(os.listdir(folder)) if folder.is_dir() else set()


@pytest.fixture(scope="module")
def upcast():
    scorer = _scorer(SHIPPED, upcast=True)
    yield scorer
    scorer.close()


def test_the_copy_holds_every_weight_of_the_file_exactly(upcast):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    copy = Path(upcast.llm.model_path)
    assert copy.parent == cache_root() / "gguf-f32" and copy != SHIPPED
    assert upcast.describe().precision == "F32 (upcast)"
    source = {t.name: t for t in GGUFReader(SHIPPED).tensors}
    held = {t.name: t for t in GGUFReader(copy).tensors}
    assert held.keys() == source.keys()
    assert {t.tensor_type.name for t in source.values()} > {"F32"}  # Q4_1, Q8_0 and F32
    assert {t.tensor_type.name for t in held.values()} == {"F32"}
    for name, tensor in held.items():
        expected = dequantize(source[name].data, source[name].tensor_type)
        np.testing.assert_array_equal(np.asarray(tensor.data), expected.reshape(tensor.data.shape),
                                      err_msg=name)


def test_the_copy_is_written_once_and_an_f32_file_is_not_copied(upcast):
    copy = Path(upcast.llm.model_path)
    written = copy.stat().st_mtime_ns
    before = _copies()
    again = _scorer(SHIPPED, upcast=True)
    try:
        assert Path(again.llm.model_path) == copy and copy.stat().st_mtime_ns == written
    finally:
        again.close()
    as_f32 = _scorer(copy, upcast=True)  # already F32: loaded as it is
    try:
        assert Path(as_f32.llm.model_path) == copy
    finally:
        as_f32.close()
    assert _copies() == before


def test_it_scores_as_the_transformers_fp32_reference_does(upcast):
    pytest.importorskip("transformers", reason="transformers is not installed")
    fp32 = create_backend(BackendConfig(backend="transformers", path=str(SHIPPED)), "reference")
    fp32.load()
    stored = _scorer(SHIPPED)
    assert stored.describe().precision == "Q4_1"  # the file's type, as llama.cpp names it
    try:
        ids = upcast.encode_prompt(" ".join(llm.PROMPTS))
        assert ids == stored.encode_prompt(" ".join(llm.PROMPTS))
        reference = fp32.forward(ids, 5)
        held = upcast.forward(ids, 5)
        as_stored = stored.forward(ids, 5)
    finally:
        fp32.close()
        stored.close()
    # Measured: 1.7e-5 nats per token upcast (F16 KV cache), 4.2e-3 as stored (8-bit
    # activations: the kernel drift the quant ladder measures for Q4_1 in llama.cpp).
    assert kld_rows(reference, held).max() < 1e-3
    assert (reference.argmax(axis=1) == held.argmax(axis=1)).all()
    assert kld_rows(reference, held).mean() < kld_rows(reference, as_stored).mean() / 10


def test_a_cache_it_cannot_write_is_a_clear_error_naming_the_option(tmp_path, monkeypatch):
    from guard.errors import BackendError

    if os.geteuid() == 0:  # root writes into a read-only folder: a file stands in the way
        (tmp_path / "gguf-f32").write_text("not a folder")
    else:
        tmp_path.chmod(0o500)
    monkeypatch.setenv("GUARD_CACHE_DIR", str(tmp_path))
    with pytest.raises(BackendError, match="options.upcast: .*GUARD_CACHE_DIR") as raised:
        _scorer(SHIPPED, upcast=True)
    assert raised.value.key == "options.upcast"


def test_a_files_type_is_named_as_llama_cpp_names_it():
    from guard.backends.gguf_quantize import file_type_name, file_types

    assert [file_type_name(code) for code in ("0", 1, "32", "10")] == ["F32", "F16", "BF16",
                                                                      "Q2_K"]
    assert file_type_name(None) is None and file_type_name("x") is None
    assert file_type_name(max(file_types().values()) + 1) is None


def test_flash_attention_matches_a_server_that_runs_it_and_moves_the_scores_by_kernel_noise():
    """options.flash_attn reaches llama.cpp. Its F16 accumulation is a drift of its own
    (measured: mean KLD 0.003 per token, Q8_0's level): far above the F32 copy's 1.7e-5,
    below what a failing completion shows (checks.generation.max_mean_kld 0.05)."""
    plain, flash = _scorer(SHIPPED), _scorer(SHIPPED, flash_attn=True)
    try:
        assert (plain.llm.context_params.flash_attn_type,
                flash.llm.context_params.flash_attn_type) == (0, 1)
        ids = plain.encode_prompt(" ".join(llm.PROMPTS))
        kld = kld_rows(plain.forward(ids, 5), flash.forward(ids, 5))
    finally:
        plain.close()
        flash.close()
    assert 1e-4 < kld.mean() < 0.05
