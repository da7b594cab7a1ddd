"""A GGUF's weights dequantized to fp32, kept as an HF model folder so that a load skips the parse.

transformers reads a ``.gguf`` (``from_pretrained(..., gguf_file=)``) by parsing the whole file
in Python three times (config, tokenizer, weights) and dequantizing every tensor: measured here
on SmolLM2-135M's 98 MB Q4_1 file, 21.5 s, against 0.23 s to load the same weights from the
folder this module writes (same logits bit for bit, same tokenization and chat template); the
parse within ``parsed_once`` reads the file once, 0.40x transformers' CPU. A
verifier restarted by its supervisor, ``guard replay`` and every test load the reference again,
so the transformers backend (``options.cache_dequantized``, on by default) keeps the folder.

Where: ``$GUARD_CACHE_DIR`` (default ``~/.cache/guard``) ``/gguf-fp32/<sha256 of the GGUF>-
transformers<version>/``: keyed by the file's content, never its name or mtime, so a changed
file can never load stale weights; the transformers version is in the key because its GGUF
conversion (tensor names, tokenizer) changes between releases. Size: 4 bytes per parameter
(about 540 MB for a 135M model): a model too large for that is better scored remotely anyway
(``backend: openai`` as the reference).

The folder is the one vLLM and ONNX Runtime GenAI's builder load too (guard/zoo/llm.py): plain
fp32 safetensors, no ``quantization_config`` (transformers records the GGUF's on the model; a
server would take the folder for a GGUF-quantized checkpoint). transformers refuses
``save_pretrained`` on a model it loaded from a GGUF, so the weights are handed to a model built
``from_config`` (on the meta device: no second copy in memory) and that one is saved. Written
beside its place and renamed in: a reader never sees half a folder, and two processes may race.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from guard.backends.derive import cache_root, file_sha256


def folder_for(gguf: Path, digest: str | None = None) -> Path:
    """Where ``gguf``'s dequantized folder is (or would be): ``digest`` is its sha256 where the
    caller already has it (a pinned file), else the file is hashed."""
    import transformers

    digest = digest or file_sha256(gguf)
    return cache_root() / "gguf-fp32" / f"{digest}-transformers{transformers.__version__}"


def is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()


@contextmanager
def converting(folder: Path) -> Iterator[None]:
    """Held while one process converts a GGUF into ``folder``: another process (a second
    verifier, a test worker) that wants the same folder waits, then finds it complete, instead
    of parsing the same file beside it (an flock on a file beside the folder; released when
    the holder exits, however it exits)."""
    import fcntl

    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def parsed_once() -> Iterator[None]:
    """Within this block a GGUF is parsed once, however often transformers opens it.

    One ``from_pretrained(gguf_file=)`` of a model and its tokenizer builds gguf's
    ``GGUFReader`` over the whole file three times (config, tokenizer, weights: the metadata's
    49,152 tokens and 48,900 merges are read one memmap slice at a time) and gguf's
    ``TensorNameMap`` once per module of the model (397 times for SmolLM2-135M): 14.4 s of CPU
    for that model's load on a 2-core Xeon, 5.8 s within this block, the same weights and
    tokenizer (benchmarks/gguf_load.py). Both are pure functions of their
    arguments over a file opened read-only, so the block hands out one of each per argument.
    transformers imports both from ``gguf`` when it calls them, which is where they are
    swapped; the originals are back when the block ends, however it ends. The memoized
    versions return what the originals would, so a thread that calls them meanwhile (nothing
    else parses a GGUF in a verifier while its reference loads) gets the same answers."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, Any] = {}

    def read_once(path: Any, mode: Any = "r") -> Any:
        if mode != "r":  # a writable or copy-on-write map is never shared
            return reader(path, mode)
        key = os.path.realpath(os.fspath(path))
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    def install(read: Any, names: Any) -> None:
        setattr(gguf, "GGUFReader", read)  # noqa: B010 - a class swapped for a function
        setattr(gguf, "get_tensor_name_map", names)  # noqa: B010

    install(read_once, functools.cache(name_map))  # one map per (arch, n_blocks)
    try:
        yield
    finally:
        install(reader, name_map)


def store(folder: Path, model: Any, tokenizer: Any) -> None:
    """Write ``model`` (fp32, loaded from a GGUF) and ``tokenizer`` as the HF folder ``folder``.
    A folder already complete is kept (another process wrote the same weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    if is_complete(folder):
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        config = type(model.config).from_dict(model.config.to_dict())
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict(), assign=True)
        plain.tie_weights()
        plain.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        written = json.loads((partial / "config.json").read_text())
        if written.pop("quantization_config", None) is not None:
            (partial / "config.json").write_text(json.dumps(written, indent=2))
        try:
            os.replace(partial, folder)
        except OSError:  # another process won the race: its folder holds the same weights
            if not is_complete(folder):
                raise
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)


def dequantized_folder(gguf: Path) -> Path:
    """``gguf`` as an HF folder of fp32 weights, written on first use (a server that loads HF
    folders: vLLM, ONNX Runtime GenAI's model builder)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = folder_for(gguf)
    with converting(folder):
        if is_complete(folder):
            return folder
        with parsed_once():
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                         local_files_only=True,
                                                         dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                      local_files_only=True)
        store(folder, model, tokenizer)
    return folder
