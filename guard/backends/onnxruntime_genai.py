"""An LLM run by ONNX Runtime GenAI, as a teacher-forcing scorer: the matrix's
``onnxruntime_genai`` columns (guard/matrix/generation.py). Not a ``backend:`` of the guard config
(CONTRACT.md names those); registering it is one line in guard/backends/__init__.py and a
``KINDS`` declaration here.

``path`` is a model folder as ONNX Runtime GenAI's model builder writes it (``genai_config.json``,
``model.onnx`` and its weights, the HF tokenizer files); it runs as it was built
(``precision`` stays fp32, the config's word for "as the artifact is": the builder's int4 is
block-wise 4-bit weights). guard/zoo/llm.py ``ort_genai_model`` builds one from a GGUF.

ONNX Runtime GenAI hands out the logits of the last position appended only, so the
teacher-forced pass appends the prompt, then the completion one token at a time, reading the
logits before each (one decoder step per completion token, with its KV cache). Prompts and
chat are tokenized by transformers from the folder's tokenizer files (as the ``transformers``
scorer does), so the two tokenize alike. Needs the ``ort-genai`` extra (``install_hint``).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from pydantic import Field

from guard.backends.base import BackendInfo, Role
from guard.backends.options import _Options
from guard.backends.scoring import LocalScorer, loaded
from guard.backends.transformers import HFTokenized
from guard.errors import BackendError, install_hint

if TYPE_CHECKING:
    from guard.config import BackendConfig


class OrtGenAIOptions(_Options):
    threads: int = Field(0, ge=0, description="intra-op threads of the decoder session; 0: the "
                         "reference's CPU budget (mirror.threads).")
    context_length: int = Field(0, ge=0, description="Longest prompt + completion scored; 0: "
                                "the folder's genai_config context_length.")


class OrtGenAIScorer(HFTokenized, LocalScorer):
    name = "onnxruntime_genai"

    def __init__(self, spec: "BackendConfig", role: Role, threads: int = 1):
        self.spec = spec
        self.role = role
        self.options = OrtGenAIOptions.model_validate(spec.options)
        self.threads = self.options.threads or threads
        self._model: Any | None = None  # an og.Model (onnxruntime_genai is untyped)
        self._og: ModuleType | None = None
        self._lock = threading.Lock()

    def load(self) -> None:
        try:
            # The package ships no type information (no py.typed, no stubs).
            import onnxruntime_genai as og  # type: ignore[import-untyped]
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise BackendError(f"backend onnxruntime_genai needs onnxruntime-genai and "
                               f"transformers ({install_hint('ort-genai', 'onnxruntime-genai')})"
                               f": {exc}") from None
        folder = Path(self.spec.artifact_path)
        declared = json.loads((folder / "genai_config.json").read_text())["model"]
        config = og.Config(str(folder))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": self.threads}}}}))
        try:
            self._model = og.Model(config)
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as exc:
            raise BackendError(f"onnxruntime_genai cannot load {folder}: {exc}") from None
        self._og = og
        self.attach_tokenizer(tokenizer, int(declared["vocab_size"]))
        self.context_length = self.options.context_length or int(declared["context_length"])

    def _generator(self, length: int):
        what = f"backend {self.name}: {self.spec.path}"
        og, model = loaded(self._og, what), loaded(self._model, what)
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=length)
        return og.Generator(model, params)

    def logits(self, ids: Sequence[int], prompt_length: int) -> np.ndarray:
        ids = [int(i) for i in ids]
        with self._lock:
            generator = self._generator(len(ids))
            generator.append_tokens(ids[:prompt_length])
            rows = [np.array(generator.get_logits()[0, -1], dtype=np.float32)]
            for token in ids[prompt_length:-1]:
                generator.append_tokens([token])
                rows.append(np.array(generator.get_logits()[0, -1], dtype=np.float32))
        return np.stack(rows)

    def greedy(self, ids: Sequence[int], max_tokens: int) -> list[int]:
        """ONNX Runtime GenAI's own greedy search from ``ids`` (at most ``max_tokens``,
        stopping at EOS): token ids only (``forward`` gives their distributions)."""
        out: list[int] = []
        with self._lock:
            generator = self._generator(len(ids) + max_tokens)
            generator.append_tokens([int(i) for i in ids])
            while len(out) < max_tokens and not generator.is_done():
                generator.generate_next_token()
                out.append(int(generator.get_next_tokens()[0]))
        return out

    def describe(self) -> BackendInfo:
        return BackendInfo(self.name, str(self.spec.path), "as built", "cpu", (), (),
                           {"vocabulary": str(self.vocab.size),
                            "context_length": str(self.context_length)})

    def close(self) -> None:
        self._model = None
