"""``backend: llama_cpp``: a GGUF run in-process by llama.cpp (llama-cpp-python), as a
teacher-forcing scorer.

``path`` is the ``.gguf`` file; it runs as it is quantized (``precision`` stays fp32: the
config's word for "as the artifact is"), or with its weights held as F32 (``options.upcast``,
guard/backends/gguf_quantize.py: the cheaper pass on a CPU without native 16-bit products, for
twice an F16 file's memory). One evaluation of prompt + completion asks llama.cpp
for the logits of only the positions that predict the completion (``completion_logits``): the
LM head (a fifth of a small model's work per token) is not run on the prompt, and no
``[n_ctx, n_vocab]`` array of every position is kept (llama-cpp-python's ``logits_all``: about
200 MB for SmolLM2's 49152 tokens at the default ``context_length`` 1024).

The prompt is cached as llama.cpp's server caches it (``options.cache_prompt``, on by default):
the keys and values of the last sequence scored stay in the context, and the next one evaluates
only what follows their common prefix (a chat's system prompt and template, a prompt set's
shared preamble). A row's logits come from the same per-token work either way (the test holds
them to a full evaluation's); a 270-token prompt shared by two samples costs the second 0.11 s
of CPU instead of 1.09 s here.

llama.cpp reads a path, not bytes: a pinned file (``sha256``) is hashed right before the load.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence, cast

import numpy as np
from pydantic import Field

from guard.backends.base import BackendInfo, Role
from guard.backends.gguf_quantize import file_type_name, upcast_f32
from guard.backends.kind import BackendKind
from guard.backends.options import _Options
from guard.backends.scoring import (
    LocalScorer,
    chat_plan,
    common_prefix,
    continue_final_message,
    loaded,
    template_failed,
)
from guard.backends.token_alignment import Vocabulary
from guard.errors import BackendError, install_hint

if TYPE_CHECKING:
    from llama_cpp import Llama
    from llama_cpp.llama_types import ChatCompletionRequestMessage

    from guard.config import BackendConfig


class LlamaCppOptions(_Options):
    threads: int = Field(0, ge=0, description="llama.cpp threads; 0: the reference's CPU "
                         "budget (mirror.threads).")
    context_length: int = Field(1024, ge=16, description="n_ctx: the longest prompt + "
                                "completion scored (memory: n_ctx x n_vocab x 4 bytes).")
    batch: int = Field(512, ge=1, description="n_batch: tokens per llama.cpp decode call.")
    cache_prompt: bool = Field(True, description="keep the keys and values of the last "
                               "sequence scored and evaluate only what follows its common "
                               "prefix with the next (llama.cpp's server option of that name); "
                               "false: every score evaluates its whole sequence.")
    flash_attn: bool = Field(False, description="score with llama.cpp's flash attention, "
                             "as a llama-server started with its default --flash-attn auto "
                             "generates on a CPU: its F16 accumulation moves SmolLM2's "
                             "logprobs by up to 0.23 nats (mean KLD 0.003 per token, Q8_0's "
                             "level) from the attention without it. On: a reference on the "
                             "server's own file agrees with it to kernel noise. Off (the "
                             "default): the more exact attention; start the server with "
                             "--flash-attn off for the same agreement.")
    upcast: bool = Field(False, description="score with the file's weights held as F32 (a "
                         "copy written once into the cache, exact: F16, BF16 and quantized "
                         "weights are F32 values once dequantized): on a CPU without native "
                         "16-bit products llama.cpp may multiply F32 faster than F16 (0.64x "
                         "the CPU per pass on one AVX2-bound EPYC host, no faster on a Zen 5 "
                         "EPYC: measure on yours), and the activations are not rounded to "
                         "F16; twice an F16 file's memory. Off: the file runs as stored.")


class _LlamaVocabulary(Vocabulary):
    def __init__(self, llm: "Llama"):
        self._llm = llm
        self._texts: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._llm.detokenize([token_id], special=True).decode("utf-8", "replace")
            self._texts[token_id] = text
        return text

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._llm.detokenize(list(ids), special=False).decode("utf-8", "replace")

    @property
    def size(self) -> int:
        return int(self._llm.n_vocab())


def completion_logits(llm: "Llama", ids: Sequence[int], prompt_length: int,
                      cached: Sequence[int] = ()) -> np.ndarray:
    """float32 ``[len(ids) - prompt_length, n_vocab]``: the logits at the positions that predict
    ``ids[prompt_length:]``, from one teacher-forced evaluation of ``ids``, ``n_batch`` tokens
    per decode call. Only those positions are marked for output in the batches (llama.cpp runs
    the LM head on marked positions only), through llama-cpp-python's own context and batch
    (``Llama.eval`` marks all or only the last).

    ``cached``: the ids whose keys and values the context holds from the last evaluation (its
    sequence 0, from position 0); their common prefix with ``ids``, up to the first position
    whose logits are wanted, is kept and not evaluated again. Empty (the default), or where
    llama.cpp cannot cut the cache there (a recurrent model's state), the evaluation starts
    from an empty cache."""
    context, batch = llm._ctx, llm._batch
    first, last = prompt_length - 1, len(ids) - 2  # positions whose logits are kept
    n_vocab, step = int(llm.n_vocab()), int(llm.n_batch)
    llm.reset()  # llama-cpp-python's own count of evaluated tokens: none (it does not read it)
    kept = min(common_prefix(cached, ids), max(first, 0))
    if not (kept and context.kv_cache_seq_rm(0, kept, -1)):
        kept = 0
        context.kv_cache_clear()
    rows = []
    for start in range(kept, len(ids), step):
        chunk = [int(t) for t in ids[start:start + step]]
        batch.set_batch(chunk, n_past=start, logits_all=False)
        marked = 0
        for i in range(len(chunk)):
            wanted = first <= start + i <= last
            batch.batch.logits[i] = wanted
            marked += wanted
        context.decode(batch)
        if marked:  # llama.cpp lays the marked positions' logits out in order
            rows.append(np.ctypeslib.as_array(context.get_logits(),
                                              shape=(marked, n_vocab)).copy())
    if not rows:
        return np.zeros((0, n_vocab), np.float32)
    return rows[0] if len(rows) == 1 else np.concatenate(rows)


def build_features() -> frozenset[str]:
    """The CPU features the installed llama.cpp was built for and turned on (``AVX2``,
    ``AVX512_BF16`` ...; the Makefile's LLAMA_CPP_ISA), from llama.cpp's system info."""
    import re

    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    return frozenset(name for name, on in re.findall(r"(\w+) = (\d)", info) if on == "1")


def _stored_type(llm: "Llama") -> str | None:
    """The loaded GGUF's file type as llama.cpp names it (``F16``, ``Q4_1``, ``F32`` ...)."""
    return file_type_name(llm.metadata.get("general.file_type"))


def quiet_llama_logs() -> None:
    """llama.cpp logs every graph reserve and tensor it converts through the
    "llama-cpp-python" logger (its log callback prints what that logger's level lets
    through): quiet, as ``Llama(verbose=False)`` makes it, unless the application set a level."""
    logger = logging.getLogger("llama-cpp-python")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.ERROR)


def open_llama(path: str | Path, context_length: int = 1024, threads: int = 1,
               batch: int = 512, logits_all: bool = True, flash_attn: bool = False) -> "Llama":
    """A llama_cpp.Llama on ``path``, quiet; BackendError where it cannot be loaded."""
    try:
        from llama_cpp import Llama
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise BackendError(f"backend llama_cpp needs llama-cpp-python: "
                           f"{install_hint('llm', 'llama-cpp-python')} ({exc})") from None
    try:
        return Llama(model_path=str(path), n_ctx=context_length, n_batch=batch,
                     n_threads=threads, n_threads_batch=threads, logits_all=logits_all,
                     flash_attn=flash_attn, verbose=False)
    except (ValueError, RuntimeError) as exc:
        raise BackendError(f"llama.cpp cannot load {path}: {exc}") from None


class LlamaCppScorer(LocalScorer):
    name = "llama_cpp"

    def __init__(self, spec: "BackendConfig", role: Role, threads: int = 1):
        self.spec = spec
        self.role = role
        self.options = LlamaCppOptions.model_validate(spec.options)
        self.threads = self.options.threads or threads
        self.llm: Llama | None = None
        self._lock = threading.Lock()
        # The ids whose keys and values the context holds (options.cache_prompt), under _lock.
        self._in_cache: list[int] = []

    def _loaded(self) -> "Llama":
        """The llama.cpp model; BackendError before ``load()`` or after ``close()``."""
        return loaded(self.llm, f"backend {self.name}: {self.spec.path}")

    def load(self) -> None:
        path = self.spec.artifact_path
        if self.spec.sha256 is not None:
            from guard.backends.artifact import read_artifact

            read_artifact(path, self.spec.sha256)
        llm = self._open(path)
        if self.options.upcast and _stored_type(llm) != "F32":
            llm.close()
            llm = self._open(self._upcast(Path(path)))
        self.llm = llm
        self.vocab = _LlamaVocabulary(llm)
        bos_id = self.bos_id = int(llm.token_bos())
        probe = llm.tokenize(b"a", add_bos=True, special=False)
        self.adds_bos = bool(probe) and probe[0] == bos_id
        self.context_length = int(llm.n_ctx())

    def _upcast(self, path: Path) -> Path:
        """The F32 copy of ``path`` (options.upcast), written into the cache once; BackendError
        naming the option where it cannot be (a read-only cache: a Pod's root filesystem)."""
        try:
            return upcast_f32(path, self.spec.sha256, self.threads)
        except (OSError, RuntimeError) as exc:
            raise BackendError(f"options.upcast: cannot write {path.name}'s F32 copy into "
                               f"the cache (set GUARD_CACHE_DIR to a writable folder): {exc}",
                               key="options.upcast") from None

    def _open(self, path: str | Path) -> "Llama":
        return open_llama(path, self.options.context_length, self.threads, self.options.batch,
                          logits_all=False, flash_attn=self.options.flash_attn)

    def encode_prompt(self, text: str) -> list[int]:
        # As llama.cpp's servers tokenize a completions prompt: BOS where the model adds one,
        # special-token text parsed.
        return list(self._loaded().tokenize(text.encode("utf-8"), add_bos=True, special=True))

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids as text, as llama.cpp's servers detokenize a completion."""
        return self._loaded().detokenize(list(ids)).decode("utf-8", "replace")

    def render_chat(self, messages: Sequence[dict],
                    template_args: Mapping[str, Any] | None = None) -> list[int]:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        llm = self._loaded()
        template = llm.metadata.get("tokenizer.chat_template")
        if not template:
            raise BackendError(f"{self.spec.path} has no chat template to render chat "
                               "messages with")
        messages, generation_prompt, continued, keywords, after = chat_plan(template_args,
                                                                            messages)
        vocab = self.vocab
        formatter = Jinja2ChatFormatter(
            template=template, eos_token=vocab.token_text(int(llm.token_eos())),
            bos_token=vocab.token_text(int(llm.token_bos())),
            add_generation_prompt=generation_prompt)
        # OpenAI chat messages, as llama-cpp-python's TypedDicts describe them; the template's
        # own arguments (chat_template_kwargs) go to the template as the formatter's keywords.
        try:
            rendered = formatter(
                messages=cast("list[ChatCompletionRequestMessage]", list(messages)), **keywords)
        except Exception as exc:  # noqa: BLE001 - the template's code: any failure says so
            raise template_failed(exc) from None
        prompt = rendered.prompt + after
        if continued:
            prompt = continue_final_message(prompt, messages)
        # llama-cpp-python's chat handler: BOS added unless the template wrote it.
        return list(llm.tokenize(prompt.encode("utf-8"),
                                 add_bos=not rendered.added_special, special=True))

    def logits(self, ids: Sequence[int], prompt_length: int) -> np.ndarray:
        llm = self._loaded()
        with self._lock:
            # Empty while the cache is off, and until the decode succeeds.
            cached, self._in_cache = self._in_cache, []
            logits = completion_logits(llm, ids, prompt_length, cached)
            if self.options.cache_prompt:
                self._in_cache = list(ids)
        return logits

    def greedy(self, ids: Sequence[int], max_tokens: int) -> list[int]:
        """llama.cpp's greedy continuation of ``ids`` (at most ``max_tokens``, stopping at
        EOS): token ids only (``forward`` gives their distributions)."""
        out: list[int] = []
        llm = self._loaded()
        with self._lock:
            self._in_cache = []  # llama-cpp-python's generate reuses and overwrites the cache
            llm.reset()
            eos = int(llm.token_eos())
            for token in llm.generate(list(ids), temp=0.0, top_k=1, repeat_penalty=1.0):
                if token == eos or len(out) >= max_tokens:
                    break
                out.append(int(token))
        return out

    def describe(self) -> BackendInfo:
        """The precision is the GGUF's file type as llama.cpp names it (F16, BF16, Q4_1 ...),
        "as quantized" where the file says none."""
        stored = _stored_type(self.llm) if self.llm else None
        precision = "F32 (upcast)" if self.options.upcast else stored or "as quantized"
        return BackendInfo(self.name, str(self.spec.path), precision, "cpu", (), (),
                           {"vocabulary": str(self.vocab.size),
                            "context_length": str(self.context_length)})

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None
        self._in_cache = []


def _check(spec: "BackendConfig") -> None:
    if Path(spec.artifact_path).suffix != ".gguf":
        raise ValueError(f"path: {spec.path} is not a .gguf file")
    if spec.device != "cpu":
        raise ValueError("device: this build of llama_cpp runs on cpu")


KINDS = {
    # Tier 2 captures its graph's nodes through llama.cpp's eval callback, which only observes:
    # the layers are isolated on a transformers reference's modules (gguf_align.py).
    "llama_cpp": BackendKind(
        name="llama_cpp", extra="llm", backend=LlamaCppScorer, options=LlamaCppOptions,
        check=_check, llm=frozenset({"score"}),
        activations="guard.backends.activations.llama_cpp:llama_cpp_side",
        activations_beside=frozenset({"transformers"}),
        beside_why="llama.cpp's eval callback only observes, so its layers are isolated on a "
        "transformers reference's modules"),
}
