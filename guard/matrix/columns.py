"""The engines of the matrix's generative columns (guard/matrix/generation.py).

A column is one LLM in one engine, derived from the model's GGUF, that can do two things:
``complete(prompt, max_tokens, top_logprobs)``, a greedy completion carrying each token's
logprob and its ``top_logprobs`` best alternatives as an OpenAI-compatible server returns them
(a :class:`~guard.protocol.generation.GenerationSample`), and ``logprobs(ids, prompt_length)``,
its full next-token distributions over given tokens (teacher-forced), or None where the engine
gives no such thing (a server).

- ``llama_cpp``: llama-cpp-python in-process on the GGUF at ``quant`` (a llama.cpp file type,
  requantized by llama.cpp's own quantizer, cached; default the GGUF as it is). Completions
  through ``create_completion(logprobs=k)``, the code its server answers with.
- ``openai`` with ``serve: llama_cpp``: llama-cpp-python's OpenAI-compatible server started on
  that GGUF (loopback, a free port), asked over HTTP ``/v1/completions`` with ``logprobs: k``,
  stopped after the column.
- ``transformers``: torch on the GGUF dequantized, at the column's ``precision`` (fp32, bf16,
  fp16); greedy by ``generate``, the logprobs from one teacher-forced pass.
- ``onnxruntime_genai``: ONNX Runtime GenAI on the folder its model builder writes from the
  GGUF (through an HF folder) at ``quant`` (int4, int8, fp32), cached; greedy by its own
  search, the logprobs teacher-forced.
"""

from __future__ import annotations

import json
import tempfile
import urllib.request
from typing import cast
from pathlib import Path

import numpy as np

from guard.backends.base import Role
from guard.backends.scoring import Scorer
from guard.config import BackendConfig
from guard.matrix.config import MatrixBackend, MatrixConfig, MatrixModel
from guard.protocol.generation import GenerationSample, SamplingParams, TokenLogprob

GREEDY = SamplingParams(temperature=0.0)


def _scorer(kind: str, path: Path, role: Role, threads: int, precision: str = "fp32",
            options: dict | None = None, device: str = "cpu") -> Scorer:
    """A loaded scorer backend (guard/backends/scoring.py) of ``kind`` on ``path``, on
    ``device`` (a kind that runs on the CPU alone refuses cuda in BackendConfig's check)."""
    spec = BackendConfig(backend=kind, path=str(path), precision=precision, device=device,
                         options=dict(options or {}))
    if kind == "onnxruntime_genai":
        # Not a config backend (CONTRACT.md): built directly.
        from guard.backends.onnxruntime_genai import OrtGenAIScorer

        built: Scorer = OrtGenAIScorer(spec, role, threads)
    else:
        from guard.backends import create_backend

        built = cast(Scorer, create_backend(spec, role, threads))  # a scorer kind (the schema's)
    built.load()
    return built


def _artifact(gguf: Path, kind: str, quant: str | None) -> Path:
    """The column's model file or folder, derived from the model's GGUF (cached)."""
    from guard.zoo.llm import ort_genai_model, requantized

    if kind == "onnxruntime_genai":
        return ort_genai_model(gguf, quant or "int4")
    if kind in ("llama_cpp", "openai") and quant:
        return requantized(gguf, quant)
    return gguf


def sample_from_distributions(prompt: str, ids: list[int], logprobs: np.ndarray, vocab,
                              top_logprobs: int, decode) -> GenerationSample:
    """The completion an OpenAI-compatible server would return for greedy ``ids`` drawn
    from ``logprobs`` (``[T, V]``): per token its text, id, logprob and best alternatives."""
    tokens = []
    for t, token_id in enumerate(ids):
        row = logprobs[t]
        best = (np.argpartition(-row, top_logprobs - 1)[:top_logprobs] if top_logprobs
                else np.zeros(0, np.int64))
        top = tuple(sorted(((vocab.token_text(int(i)), float(row[i])) for i in best),
                           key=lambda item: -item[1]))
        tokens.append(TokenLogprob(vocab.token_text(int(token_id)), float(row[token_id]), top,
                                   token_id=int(token_id)))
    return GenerationSample(model="matrix", endpoint="completions", prompt=prompt,
                            completion_text=decode(ids), tokens=tuple(tokens),
                            sampling=GREEDY)


class ScorerColumn:
    """An in-process engine with ``greedy`` and ``forward`` (transformers, ONNX Runtime
    GenAI): its greedy ids, and the sample built from its teacher-forced distributions."""

    def __init__(self, scorer):
        self.scorer = scorer

    def complete(self, prompt: str, max_tokens: int, top_logprobs: int) -> GenerationSample:
        prompt_ids = self.scorer.encode_prompt(prompt)
        ids = self.scorer.greedy(prompt_ids, max_tokens)
        logprobs = self.scorer.forward(prompt_ids + ids, len(prompt_ids)) if ids else \
            np.zeros((0, self.scorer.vocab.size), np.float32)
        return sample_from_distributions(prompt, ids, logprobs, self.scorer.vocab, top_logprobs,
                                         self.scorer.decode)

    def logprobs(self, ids: list[int], prompt_length: int) -> np.ndarray | None:
        return self.scorer.forward(ids, prompt_length)

    def close(self) -> None:
        self.scorer.close()


class LlamaColumn:
    """llama-cpp-python in-process: completions from ``create_completion`` (its server's
    code) on a model of their own, loaded with ``logits_all`` as a server answering logprobs
    is (the scorer's evaluates only the positions it scores); distributions from the llama_cpp
    scorer's teacher-forced pass."""

    def __init__(self, scorer):
        self.scorer = scorer
        self._generator = None

    def complete(self, prompt: str, max_tokens: int, top_logprobs: int) -> GenerationSample:
        from guard.zoo.llm import complete

        if self._generator is None:
            from guard.backends.llama_cpp import open_llama

            options = self.scorer.options
            self._generator = open_llama(self.scorer.spec.artifact_path,
                                         options.context_length, self.scorer.threads,
                                         options.batch, logits_all=True)
        return complete(self._generator, prompt, max_tokens, GREEDY, logprobs=top_logprobs)

    def logprobs(self, ids: list[int], prompt_length: int) -> np.ndarray | None:
        return self.scorer.forward(ids, prompt_length)

    def close(self) -> None:
        if self._generator is not None:
            self._generator.close()
            self._generator = None
        self.scorer.close()


class ServerColumn:
    """llama-cpp-python's OpenAI-compatible server on the column's GGUF, over HTTP: top-k
    logprobs only, no distributions over a given text."""

    def __init__(self, path: Path, threads: int):
        from guard.zoo.llm import start_llama_server, wait_http

        self._logs = tempfile.TemporaryDirectory(prefix="guard-matrix-server-")
        self.alias = path.stem
        self.process, self.url = start_llama_server(path, self.alias,
                                                    Path(self._logs.name) / "server.log",
                                                    threads=threads)
        try:
            wait_http(self.url + "/v1/models", self.process, "llama_cpp.server")
        except Exception:
            self.close()
            raise

    def complete(self, prompt: str, max_tokens: int, top_logprobs: int) -> GenerationSample:
        from guard.zoo.llm import sample_from_response

        body = json.dumps({"model": self.alias, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0.0, "logprobs": top_logprobs}).encode()
        request = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as answer:
            response = json.loads(answer.read())
        return sample_from_response(prompt, response, GREEDY)

    def logprobs(self, ids: list[int], prompt_length: int) -> np.ndarray | None:
        return None

    def close(self) -> None:
        from guard.zoo.llm import stop_process

        stop_process(self.process)
        self._logs.cleanup()


def open_column(model: MatrixModel, backend: MatrixBackend, threads: int):
    """The column ``backend`` of ``model``, loaded (its artifact derived first)."""
    from guard.matrix.generation import model_gguf

    path = _artifact(model_gguf(model), backend.backend, backend.quant)
    if backend.backend == "openai":
        return ServerColumn(path, threads)
    scorer = _scorer(backend.backend, path, "primary", threads, backend.precision,
                     backend.options, backend.device)
    return LlamaColumn(scorer) if backend.backend == "llama_cpp" else ScorerColumn(scorer)


def open_reference(model: MatrixModel, config: MatrixConfig):
    """The model's reference scorer (``greedy``, ``forward``, ``score``), loaded."""
    from guard.matrix.config import generation_reference
    from guard.matrix.generation import model_gguf

    ref = generation_reference(model, config)
    path = _artifact(model_gguf(model), ref.backend, ref.quant)
    return _scorer(ref.backend, path, "reference", 1, ref.precision, ref.options)
