"""llama.cpp's own quantizer (``llama_model_quantize``), in-process: a GGUF written at another
file type, cached beside guard's other derived artifacts.

Two users: the zoo's quant ladder (guard/zoo/llm.py: the shipped SmolLM2 Q4_1 requantized to
F16, Q8_0, Q2_K ...) and the ``llama_cpp`` reference's ``upcast`` option (:func:`upcast_f32`):
a GGUF's weights held as F32 (exact: every F16, BF16 or quantized weight is an F32 value once
dequantized), which llama.cpp multiplies faster than F16 on a CPU without native 16-bit
products (measured on a 2-core AMD EPYC, AVX2: a 160-token teacher-forced pass of SmolLM2-135M
took 0.99 s of CPU from the F16 file, 0.63 s from its F32 copy, 0.80 s from Q8_0) and without
rounding the activations to F16 first (ggml's F16 products do), for twice the memory of F16.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from guard.backends.derive import cache_root, file_sha256

log = logging.getLogger(__name__)


@contextmanager
def _stderr_to_log(what: str):
    """llama.cpp's quantizer writes a line per tensor it cannot give the asked type straight to
    file descriptor 2 (past any log callback): kept in a temporary file, summed up in one log
    line (SmolLM2's 576-wide rows are not a multiple of the k-quants' 256: most of a "Q2_K"
    is q4_0, which the ladder's figures include)."""
    with tempfile.TemporaryFile() as kept:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(kept.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            kept.seek(0)
            lines = kept.read().decode(errors="replace").splitlines()
    fallbacks = sum("falling back" in line for line in lines)
    if fallbacks:
        log.info(
            "quantize %s: %d tensors fell back to another type (%s)", what, fallbacks,
            next((line.strip() for line in lines if "falling back" in line), ""))


def quantize(source: Path, target: Path, ftype_name: str, threads: int = 1,
             overrides: dict[str, str] | None = None) -> Path:
    """``source`` requantized to ``ftype_name`` (e.g. "Q8_0") at ``target``; ``overrides``:
    tensor name -> the ggml type it gets instead (``{"blk.3.ffn_down.weight": "Q2_K"}``, the
    quantizer's tensor-type overrides: a tensor already of the file's type is copied as it is).
    A file already there is kept (the name says what it holds). Written beside the target and
    renamed in, so a reader never sees half a file and two processes may race."""
    if target.is_file():
        return target
    with partial_file(target) as partial:
        quantize_into(source, partial, ftype_name, threads, overrides)
    return target


@contextmanager
def partial_file(target: Path) -> Iterator[Path]:
    """A temporary file beside ``target``, renamed to it when the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(handle)
    try:
        yield Path(partial)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def file_types() -> dict[str, int]:
    """llama.cpp's file types by name ("F16", "Q4_1", "Q2_K", ...: what ``general.file_type``
    records), from llama-cpp-python's constants: F32 is LLAMA_FTYPE_ALL_F32, the rest
    LLAMA_FTYPE_MOSTLY_*."""
    import llama_cpp

    return {name.removeprefix(prefix): getattr(llama_cpp, name) for name in dir(llama_cpp)
            for prefix in ("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_") if name.startswith(prefix)}


def file_type_name(code: int | str | None) -> str | None:
    """The name of the file type ``general.file_type`` records (a GGUF's metadata value), or
    None where llama.cpp has no name for it."""
    try:
        wanted = int(code)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return next((name for name, value in file_types().items() if value == wanted), None)


def quantize_into(source: Path, target: Path, ftype_name: str, threads: int,
                 overrides: dict[str, str] | None) -> None:
    import ctypes

    import llama_cpp

    from guard.backends.llama_cpp import quiet_llama_logs

    quiet_llama_logs()  # llama.cpp logs every tensor it converts
    ftype = file_types().get(ftype_name)
    if ftype is None:
        raise ValueError(f"llama.cpp knows no file type {ftype_name!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = threads
    if overrides:
        # llama.cpp reads {pattern (a regex), ggml type} pairs up to one with no pattern.
        table = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()
        for entry, (tensor, type_name) in zip(table, overrides.items()):
            ggml_type = getattr(llama_cpp, f"GGML_TYPE_{type_name}", None)
            if ggml_type is None:
                raise ValueError(f"ggml knows no tensor type {type_name!r}")
            entry.pattern = f"^{re.escape(tensor)}$".encode()
            entry.type = ggml_type
        params.tt_overrides = ctypes.cast(
            table, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    with _stderr_to_log(f"{source.name} -> {ftype_name}"):
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(),
                                                params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize {source.name} -> {ftype_name}: "
                           f"status {status}")


def upcast_f32(source: Path, digest: str | None = None, threads: int = 1) -> Path:
    """``source``'s weights as an F32 GGUF, cached in ``$GUARD_CACHE_DIR/gguf-f32/`` under the
    sha256 of ``source`` (``digest`` where the caller already has it, a pinned file's): keyed by
    content, so a changed file never loads a stale copy. Written beside its place and renamed
    in (a reader never sees half a file; two processes may race). Takes about a second per
    500 MB written."""
    digest = digest or file_sha256(source)
    target = cache_root() / "gguf-f32" / f"{digest}.F32.gguf"
    if not target.is_file():
        log.info("upcasting %s to F32 into %s", source, target)
    return quantize(source, target, "F32", threads)
