"""``backend: transformers``: a teacher-forcing reference for generative models (torch).

``path`` is an HF model folder, or a ``.gguf`` file that transformers dequantizes on load
(``from_pretrained(folder, gguf_file=NAME)``, which needs the ``gguf`` and ``accelerate``
packages): the reference is then the very weights the GGUF holds, in ``precision`` (fp32 by
default), run by torch's kernels instead of llama.cpp's. Files only: nothing is fetched from a
hub (``local_files_only``).

A scorer (guard/backends/scoring.py): one forward pass over prompt + completion gives the
reference's log-softmax at every completion position (the LM head runs on those positions
only: ``logits_to_keep``). The reference role pins torch's determinism and thread count as the
``torch`` backend's reference does. The prompt is cached as the llama_cpp scorer caches it
(``options.cache_prompt``): the keys and values of the last sequence scored are kept, and the
next forward pass runs only on what follows their common prefix.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

import numpy as np
from pydantic import Field

from guard.backends import gguf_cache
from guard.backends.base import BackendInfo, Role, require_cuda
from guard.backends.kind import BackendKind
from guard.backends.options import _Options
from guard.backends.scoring import (
    LocalScorer,
    chat_plan,
    common_prefix,
    loaded,
    template_failed,
)
from guard.backends.token_alignment import Vocabulary
from guard.errors import BackendError, install_hint

if TYPE_CHECKING:
    from guard.config import BackendConfig

_log = logging.getLogger(__name__)


class TransformersOptions(_Options):
    threads: int = Field(0, ge=0, description="torch intra-op threads; 0: the reference's "
                         "CPU budget (mirror.threads).")
    context_length: int = Field(0, ge=0, description="Longest prompt + completion scored; 0: "
                                "the model's max_position_embeddings.")
    cache_dequantized: bool = Field(
        True, description="A .gguf path: keep its weights dequantized to fp32 as an HF folder "
        "under $GUARD_CACHE_DIR/gguf-fp32 (4 bytes per parameter), keyed by the file's sha256, "
        "so that a later load skips transformers' GGUF parse (SmolLM2-135M: 21.5 s -> 0.2 s); "
        "false: parse the file on every load.")
    cache_prompt: bool = Field(
        True, description="keep the keys and values of the last sequence scored and run the "
        "next forward pass only on what follows its common prefix with it (a shared system "
        "prompt is evaluated once; memory: one sequence's KV cache); false: every score runs "
        "its whole sequence.")
    onednn_linear: bool = Field(
        True, description="A CPU model in fp32: run its linear layers by oneDNN, which picks "
        "its kernels by the CPU's features, instead of torch's default (MKL, whose fp32 "
        "products take their AVX2 path on AMD CPUs): the same fp32 arithmetic in another "
        "summation order, a pass 1.9x cheaper on an AVX-512 EPYC "
        "(guard/backends/onednn_linear.py). A tied LM head's weight is then held twice. "
        "false: torch's own modules and kernels. No effect on a GPU or at fp16/bf16.")


class _HFVocabulary(Vocabulary):
    def __init__(self, tokenizer, size: int):
        self._tokenizer = tokenizer
        self._size = size
        self._texts: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False)
            self._texts[token_id] = text
        return text

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True,
                                      clean_up_tokenization_spaces=False)

    @property
    def size(self) -> int:
        return self._size


class HFTokenized:
    """The tokenizer half of a scorer whose model folder carries an HF tokenizer
    (``tokenizer.json``): prompts, chat and the vocabulary as transformers tokenizes them.
    ``attach_tokenizer(tokenizer, size)`` after loading."""

    # What the scorer this mixes into holds (Scorer's fields, and its backend block).
    spec: "BackendConfig"
    vocab: Vocabulary
    bos_id: int | None
    adds_bos: bool
    # A transformers tokenizer (PreTrainedTokenizerBase), held as Any: its encode/decode/
    # apply_chat_template return unions that their keyword arguments decide.
    _tokenizer: Any | None = None

    def attach_tokenizer(self, tokenizer: Any, size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab = _HFVocabulary(tokenizer, size)
        self.bos_id = tokenizer.bos_token_id
        probe = tokenizer.encode("a")
        self.adds_bos = self.bos_id is not None and bool(probe) and probe[0] == self.bos_id

    def _loaded_tokenizer(self) -> Any:
        """The attached tokenizer; BackendError before ``load()`` attached one."""
        return loaded(self._tokenizer, f"{self.spec.path}: the tokenizer")

    def encode_prompt(self, text: str) -> list[int]:
        return list(self._loaded_tokenizer().encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids as text, as the model's servers detokenize a completion."""
        return self._loaded_tokenizer().decode(list(ids), skip_special_tokens=False,
                                               clean_up_tokenization_spaces=False)

    def render_chat(self, messages: Sequence[dict],
                    template_args: Mapping[str, Any] | None = None) -> list[int]:
        tokenizer = self._loaded_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise BackendError(f"{self.spec.path} has no chat template to render chat "
                               "messages with")
        messages, generation_prompt, continued, keywords, after = chat_plan(template_args,
                                                                            messages)
        try:
            text = tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=generation_prompt,
                continue_final_message=continued, tokenize=False, **keywords)
        except Exception as exc:  # noqa: BLE001 - the template's code: any failure says so
            raise template_failed(exc) from None
        text += after
        # The template writes the special tokens itself (BOS too, where it has one).
        return list(tokenizer.encode(text, add_special_tokens=False))


def _source(path: str) -> tuple[Path, dict[str, str]]:
    """``from_pretrained``'s folder and keyword arguments for an HF folder or a .gguf file."""
    location = Path(path)
    if location.suffix == ".gguf":
        return location.parent, {"gguf_file": location.name}
    return location, {}


@contextmanager
def _dequantized(path: str, sha256: str | None, cached: bool) -> Iterator[Path | None]:
    """The cache folder of the GGUF at ``path`` (None: not a GGUF, or ``cached`` off), held
    against another process converting the same file meanwhile (gguf_cache.converting)."""
    if not cached:
        yield None
        return
    folder: Path | None = None
    with ExitStack() as held:
        try:
            folder = gguf_cache.folder_for(Path(path), sha256)
            if not gguf_cache.is_complete(folder):
                held.enter_context(gguf_cache.converting(folder))
        except OSError as exc:  # a cache that cannot be written: this load parses the file
            _log.warning("transformers: cannot use the GGUF cache for %s: %s", path, exc)
            folder = None
        yield folder


def _keep_dequantized(folder: Path, model, tokenizer) -> None:
    """Write the GGUF just loaded to the cache; a failure (a full disk, a read-only cache) costs
    the next load its speed, never this one its model: logged, not raised."""
    try:
        gguf_cache.store(folder, model, tokenizer)
    except Exception as exc:  # noqa: BLE001 - any failure to write a cache is only logged
        _log.warning("transformers: could not cache the dequantized GGUF in %s: %s", folder,
                     exc)


def _verify_pin(path: str, sha256: str | None) -> None:
    """transformers reads paths, not bytes: a pinned GGUF is hashed right before the load."""
    if sha256 is None:
        return
    if Path(path).is_dir():
        raise BackendError("sha256 pins one file; an HF folder has several (pin a .gguf)",
                           key="sha256")
    from guard.backends.artifact import read_artifact

    read_artifact(path, sha256)


class TransformersScorer(HFTokenized, LocalScorer):
    name = "transformers"

    def __init__(self, spec: "BackendConfig", role: Role, threads: int = 1):
        self.spec = spec
        self.role = role
        self.options = TransformersOptions.model_validate(spec.options)
        self.threads = self.options.threads or threads
        # A transformers causal LM (PreTrainedModel), held as Any: from_pretrained is
        # unannotated and generate returns a union its keyword arguments decide.
        self._model: Any | None = None
        self._lock = threading.Lock()
        # The last sequence scored and its KV cache (options.cache_prompt), under _lock.
        self._cached: tuple[list[int], Any] | None = None
        self._names = _ForwardNames("past_key_values", False)  # (load() reads the model's)
        self.linear_kernels = "torch"  # or "onednn" (options.onednn_linear), set by load()

    def _loaded_model(self) -> Any:
        """The torch model; BackendError before ``load()`` or after ``close()``."""
        return loaded(self._model, f"backend {self.name}: {self.spec.path}")

    def load(self) -> None:
        import torch

        from guard.backends.determinism import pin_torch_reference

        if self.role == "reference":
            pin_torch_reference(self.threads)
        elif self.options.threads:
            torch.set_num_threads(self.options.threads)
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise BackendError(f"backend transformers needs transformers: {install_hint('llm')} "
                               f"({exc})") from None
        require_cuda(self.spec.device)  # before the weights: a GGUF takes seconds to load
        path = self.spec.artifact_path
        _verify_pin(path, self.spec.sha256)
        folder, extra = _source(path)
        dtype = {"fp32": torch.float32, "fp16": torch.float16,
                 "bf16": torch.bfloat16}[self.spec.precision]
        with _dequantized(path, self.spec.sha256,
                          bool(extra) and self.options.cache_dequantized) as cache:
            if cache is not None and gguf_cache.is_complete(cache):
                folder, extra, cache = cache, {}, None
            try:
                # A GGUF about to be cached loads at fp32 (the folder keeps fp32), cast after:
                # the same weights as loading it at ``dtype`` (transformers dequantizes to fp32
                # first).
                with gguf_cache.parsed_once() if extra else nullcontext():
                    model = AutoModelForCausalLM.from_pretrained(
                        folder, dtype=torch.float32 if cache else dtype, local_files_only=True,
                        **extra).eval()
                    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                                              **extra)
            except (OSError, ValueError, ImportError) as exc:
                raise BackendError(f"transformers cannot load {self.spec.path}: {exc}") from None
            if cache is not None:
                _keep_dequantized(cache, model, tokenizer)
        model = model.to(dtype=dtype, device=self.spec.device)
        self._names = _forward_names(model)
        config = model.config
        self.attach_tokenizer(tokenizer, int(model.get_output_embeddings().weight.shape[0]))
        if self.options.onednn_linear:
            from guard.backends.onednn_linear import for_reference

            model, replaced = for_reference(model, self.spec.device, dtype,
                                            f"transformers {path}")
            if replaced is not None:
                self.linear_kernels = "onednn"
        self._model = model
        self.context_length = (self.options.context_length
                               or int(getattr(config, "max_position_embeddings", 0) or 0))

    @property
    def model(self) -> Any:
        """The loaded torch model (tier 2 hooks a copy of its own: activations/transformers.py)."""
        return self._model

    def logits(self, ids: Sequence[int], prompt_length: int) -> np.ndarray:
        return self._logits(ids, prompt_length).cpu().numpy()

    def normalized(self, ids: Sequence[int], prompt_length: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        import torch

        # On the model's device: a GPU reference's [T, V] is normalized there, not on the CPU.
        logits = self._logits(ids, prompt_length)
        offsets = torch.logsumexp(logits, dim=-1)  # float32: ~1e-6 nats, what a penalty needs
        # log_softmax's own arithmetic, without a second pass over the vocabulary for its sum
        logprobs = logits - offsets.unsqueeze(-1)
        return logprobs.cpu().numpy(), offsets.cpu().numpy().astype(np.float64)

    def _logits(self, ids: Sequence[int], prompt_length: int):
        """The raw logits as a float32 tensor on the model's device."""
        import torch

        model = self._loaded_model()
        with self._lock, torch.inference_mode():
            (before, past), self._cached = self._cached or ((), None), None
            kept = min(common_prefix(before, ids), prompt_length - 1)
            extra: dict[str, Any] = {}
            if kept and past is not None:
                # The entries past the shared prefix go (a negative crop: that many removed,
                # in every transformers release that has DynamicCache.crop).
                past.crop(kept - past.get_seq_length())
                extra[self._names.cache] = past
            else:
                kept = 0
            tokens = torch.tensor([list(ids[kept:])], dtype=torch.long, device=self.spec.device)
            wanted = len(ids) - prompt_length + 1  # the positions that predict the completion,
            # and the last one (the LM head runs on these alone where the model can say so)
            if self._names.logits_to_keep:
                extra["logits_to_keep"] = wanted
            out = model(input_ids=tokens, use_cache=self.options.cache_prompt, **extra)
            kept_cache = getattr(out, self._names.cache, None)
            if self.options.cache_prompt and _croppable(kept_cache):
                self._cached = (list(ids), kept_cache)
            return out.logits[0, -wanted:-1].float()

    def greedy(self, ids: Sequence[int], max_tokens: int) -> list[int]:
        """The model's greedy continuation of ``ids`` (at most ``max_tokens``, stopping at
        EOS), as transformers generates it: token ids only (``forward`` gives their
        distributions)."""
        import torch

        model, tokenizer = self._loaded_model(), self._loaded_tokenizer()
        with self._lock, torch.inference_mode():
            tokens = torch.tensor([list(ids)], dtype=torch.long, device=self.spec.device)
            out = model.generate(tokens, attention_mask=torch.ones_like(tokens),
                                 max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        return [int(t) for t in out[0, len(ids):]]

    def describe(self) -> BackendInfo:
        return BackendInfo(self.name, str(self.spec.path), self.spec.precision,
                           self.spec.device, (), (),
                           {"vocabulary": str(self.vocab.size),
                            "context_length": str(self.context_length),
                            "linear_kernels": self.linear_kernels})

    def close(self) -> None:
        self._model = None
        self._cached = None


class _ForwardNames(NamedTuple):
    cache: str  # the KV cache's keyword and output field: "cache" (transformers 5.x), else
    # "past_key_values"
    logits_to_keep: bool  # whether forward takes logits_to_keep (transformers >= 4.50)


def _forward_names(model: Any) -> _ForwardNames:
    """The keywords ``model.forward`` takes, across the transformers releases the ``llm``
    extra allows (>= 4.40): the cache was renamed, and logits_to_keep came later."""
    parameters = inspect.signature(model.forward).parameters
    return _ForwardNames("cache" if "cache" in parameters else "past_key_values",
                         "logits_to_keep" in parameters)


def _croppable(cache: Any) -> bool:
    """Whether ``cache`` holds every past position of every layer (full attention), so that
    cutting it to a prefix leaves exactly that prefix's state; a sliding window's or a
    recurrent layer's state cannot be cut back (the prompt is then evaluated whole)."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:  # pragma: no cover - a transformers without per-layer caches
        return False
    return (type(cache) is DynamicCache
            and all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", ())))


def _check(spec: "BackendConfig") -> None:
    path = Path(spec.artifact_path)
    if path.suffix != ".gguf" and not path.is_dir() and path.exists():
        raise ValueError(f"path: {spec.path} is neither an HF model folder nor a .gguf file")


KINDS = {
    # Tier 2: forward hooks on a private copy, beside a GGUF run by llama.cpp (its modules
    # isolate llama.cpp's layers) or another transformers model (by module path).
    "transformers": BackendKind(
        name="transformers", extra="llm",
        backend=TransformersScorer, options=TransformersOptions,
        precisions=frozenset({"fp32", "fp16", "bf16"}), check=_check,
        llm=frozenset({"score"}),
        activations="guard.backends.activations.transformers:transformers_side",
        activations_beside=frozenset({"llama_cpp", "transformers"}),
        beside_why="its capture aligns with llama.cpp's graph or by module path",
    ),
}
