"""``backend: openai`` as a reference: a remote OpenAI-compatible server scores a given text.

The topology of big LLMs: the model is too large to run beside guard, so the trusted
deployment (bf16 on its own GPUs) scores the primary's (int4) sampled calls. The block is the
forwarding one's (guard/backends/openai.py: ``target``, ``model``, ``api_key_env``, timeouts),
in the ``reference`` role::

    reference:
      backend: openai
      target: http://10.0.0.7:8000       # a vLLM server of the trusted build
      model: smol-bf16
      options: {scoring: auto, top_logprobs: 20}

One teacher-forced pass per completion, as the local scorers do, but over HTTP: the prompt's
ids and the primary's completion ids go to ``POST /v1/completions`` as a prompt of token ids
(so the server scores exactly those tokens, never a re-tokenized text), and the answer gives,
at every completion position, the reference's logprob of the primary's token and its
``top_logprobs`` best tokens. Two ways to ask, ``options.scoring``:

- ``prompt_logprobs`` (vLLM's extra field): per position a map ``token id -> {logprob, rank,
  decoded_token}`` holding the top-k and the actual token; ids and texts both known.
- ``echo`` (the legacy OpenAI completions API: ``echo: true, max_tokens: 0, logprobs: k``):
  per position the token's text, its logprob and the top-k as ``text -> logprob``; the
  alternatives' ids are not said (``top_ids`` holds -1 for them, the primary's token's id
  where the text is its text).
- ``auto`` (the default) tries them in that order.

Whichever is used is checked at load, never assumed: the server generates one token after a
probe prompt (its own distribution there, ``logprobs``), then scores the probe prompt plus one
token; the scored distribution at that position must be the generated one (same best token,
its logprob within ``_ALIGNMENT_TOLERANCE``). A server whose prompt scores sit one position off
(llama-cpp-python's ``echo``, upstream issue 1983) fails this and is refused, as is a server
that cannot score a given text at all (llama.cpp's own server cannot echo; llama-cpp-python's
takes only text prompts): a clear load error, never a reference that silently scores
something else.

Tokenization is the server's too (vLLM's ``/tokenize`` for a prompt or chat messages the
primary's server did not render into ids, and for a completion given as text only), and a
token's text is the one the server reports when scoring (``decoded_token``), so the checks of
guard/backends/scoring.py (BOS, the primary's tokens reproduced) run on the reference's own
vocabulary. A server answers only the top-k, so the scores are top-k only (``logprobs`` is
None): the generation tier then compares logprobs and greedy calls; a sampled call without the
primary's logprobs needs the full distribution and is not comparable (counted, not scored).

HTTP is the standard library's (urllib, on the mirror's worker thread): one call per scored
completion, plus one per batch of token texts not seen yet.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import urllib.error
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from guard.backends.base import BackendInfo, Role
from guard.backends.openai import (OpenAIOptions, authorization, base_url, ready_timeout,
                                   wait_ready)
from guard.backends.scoring import (
    ReferenceScores,
    Scorer,
    chat_rendering,
    loaded,
    unscored,
)
from guard.backends.token_alignment import (
    TokenizationMismatch,
    Vocabulary,
    comparable_text,
    names_its_alternatives,
)
from guard.errors import BackendError
from guard.protocol.generation import GenerationSample, shown_as_logits

# The probe of the load-time check: a prompt whose next token every instruction-tuned LLM is
# sure of, so that a one-position shift moves the best token (and its logprob by nats).
PROBE_TEXT = "The capital of France is"
# How far (nats) the scored logprob of the probe's best next token may sit from the one the
# server gave while generating it: the same weights and kernels on a prefix one token longer
# agree to ~1e-5 in fp32 and ~1e-2 in bf16; a shifted position is off by nats.
_ALIGNMENT_TOLERANCE = 0.1
_ENCODE_CACHE = 4096  # texts whose tokenization is kept (the completions being aligned)
SCORING_MODES = ("prompt_logprobs", "echo")
# What a load error says a reference server must do, and which servers cannot.
SERVERS = ("A reference server tokenizes (POST /tokenize) and scores a prompt of token ids "
           "with prompt_logprobs (vLLM) or echo with logprobs, aligned to the prompt's "
           "positions. llama-cpp-python's server takes text prompts only and its echo "
           "logprobs are shifted by one token (upstream issue 1983); llama.cpp's server "
           "cannot echo a prompt")


class ServerRefused(BackendError):
    """The server answered an HTTP error (``status``); its message is in the text."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Position:
    """The reference at one position: its logprob of the token there and its best tokens
    (id, or -1 where the server said only the text; text; logprob), best first."""

    token_text: str
    logprob: float
    top: tuple[tuple[int, str, float], ...]


class ScoringClient:
    """The server's endpoints this scorer uses, over urllib (JSON in, JSON out)."""

    def __init__(self, base: str, model: str, options: OpenAIOptions,
                 authorization_header: str | None):
        self.base, self.model, self.options = base, model, options
        self._authorization = authorization_header

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        if self._authorization:
            request.add_header("Authorization", self._authorization)
        try:
            with urllib.request.urlopen(request, timeout=self.options.read_timeout_s) as answer:
                data = json.loads(answer.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode(errors="replace")
            raise ServerRefused(f"POST {path}: HTTP {exc.code}: {detail}", exc.code) from None
        except (OSError, ValueError) as exc:
            raise BackendError(f"POST {self.base}{path}: {type(exc).__name__}: {exc}") from None
        if not isinstance(data, dict):
            raise BackendError(f"POST {path}: the answer is not a JSON object")
        return data

    def tokenize(self, text: str, special: bool) -> list[int]:
        return self._tokens(self.post("/tokenize", {"model": self.model, "prompt": text,
                                                    "add_special_tokens": special}))

    def tokenize_chat(self, messages: Sequence[dict],
                      template_args: Mapping[str, Any] | None = None) -> list[int]:
        # vLLM's /tokenize takes the chat template's arguments by the request's names.
        generation_prompt, continued, keywords = chat_rendering(template_args)
        return self._tokens(self.post("/tokenize", {
            "model": self.model, "messages": list(messages),
            "add_generation_prompt": generation_prompt, "continue_final_message": continued,
            **({"chat_template_kwargs": keywords} if keywords else {}),
            "add_special_tokens": False}))

    @staticmethod
    def _tokens(data: dict) -> list[int]:
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise BackendError("POST /tokenize: the answer has no list of token ids")
        return tokens

    def complete(self, ids: Sequence[int], **fields) -> dict[str, Any]:
        """``/v1/completions`` on a prompt of token ids; the answer's first choice."""
        data = self.post("/v1/completions", {"model": self.model, "prompt": list(ids),
                                             "temperature": 0.0, **fields})
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise BackendError("POST /v1/completions: the answer has no choices")
        return choices[0]


# -- the two ways of asking ----------------------------------------------------------------------
def _prompt_logprobs(client: ScoringClient, ids: Sequence[int], k: int) -> list[Position]:
    """Positions 1.. of ``ids`` from vLLM's ``prompt_logprobs`` (position 0 has none)."""
    return prompt_logprobs_positions(client.complete(ids, max_tokens=1, prompt_logprobs=k),
                                     ids, k)


def prompt_logprobs_positions(choice: dict, ids: Sequence[int], k: int) -> list[Position]:
    """The positions of a completion choice that carries ``prompt_logprobs`` for ``ids``."""
    entries = choice.get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(ids):
        raise BackendError("the server ignored prompt_logprobs (no list of one entry per "
                           "prompt token in its answer)")
    positions = []
    for j in range(1, len(ids)):
        entry = entries[j]
        if not isinstance(entry, dict) or str(ids[j]) not in entry:
            raise BackendError(f"prompt_logprobs[{j}] does not hold the prompt's token "
                               f"{ids[j]}")
        found = []
        for key, value in entry.items():
            found.append((int(key), str(value.get("decoded_token") or ""),
                          float(value["logprob"]), int(value.get("rank") or 0)))
        own = next(f for f in found if f[0] == ids[j])
        top = sorted((f for f in found if f[3] <= k), key=lambda f: -f[2])[:k]
        positions.append(Position(own[1], own[2], tuple((i, t, lp) for i, t, lp, _ in top)))
    return positions


def _echo(client: ScoringClient, ids: Sequence[int], k: int) -> list[Position]:
    """Positions 1.. of ``ids`` from an echoed prompt with ``logprobs`` (texts, not ids)."""
    return echo_positions(client.complete(ids, max_tokens=0, echo=True, logprobs=k), ids, k)


def echo_positions(choice: dict, ids: Sequence[int], k: int) -> list[Position]:
    """The positions of a completion choice that echoes the prompt ``ids`` with logprobs (as
    many tokens as ``ids``, each its logprob and top logprobs, the first without)."""
    logprobs = choice.get("logprobs") or {}
    texts, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    tops = logprobs.get("top_logprobs")
    if not (isinstance(texts, list) and isinstance(values, list) and isinstance(tops, list)) \
            or not len(texts) == len(values) == len(tops) == len(ids):
        raise BackendError("the server's echo does not give one logprob per prompt token "
                           f"({len(texts or ())} tokens echoed for {len(ids)} sent)")
    positions = []
    for j in range(1, len(ids)):
        if values[j] is None or not isinstance(tops[j], dict):
            raise BackendError(f"echo: no logprobs at prompt position {j}")
        ranked = sorted(((str(t), float(lp)) for t, lp in tops[j].items()),
                        key=lambda item: -item[1])[:k]
        positions.append(Position(str(texts[j]), float(values[j]), tuple(
            (ids[j] if text == texts[j] else -1, text, lp) for text, lp in ranked)))
    return positions


_ASK = {"prompt_logprobs": _prompt_logprobs, "echo": _echo}


# -- the vocabulary, the server's ----------------------------------------------------------------
class RemoteVocabulary(Vocabulary):
    """The server's tokenizer: ``encode`` through ``/tokenize`` (recent texts kept), a token's
    text as the server reports it when scoring (learnt from every answer; ids not seen yet
    are asked for in one scoring call)."""

    def __init__(self, client: ScoringClient, ask):
        self._client, self._ask = client, ask
        self._texts: dict[int, str] = {}
        self._encoded: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self._lock:
            if text in self._encoded:
                self._encoded.move_to_end(text)
                return list(self._encoded[text])
        ids = self._client.tokenize(text, special=False)
        with self._lock:
            self._encoded[text] = ids
            while len(self._encoded) > _ENCODE_CACHE:
                self._encoded.popitem(last=False)
        return list(ids)

    def learn(self, ids: Sequence[int], positions: Sequence[Position]) -> None:
        """Texts the server reported for ``ids[1:]`` (``positions``) and their alternatives."""
        with self._lock:
            for token_id, position in zip(ids[1:], positions):
                self._texts[int(token_id)] = position.token_text
                for top_id, text, _ in position.top:
                    if top_id >= 0:
                        self._texts.setdefault(top_id, text)

    def fetch(self, ids: Sequence[int]) -> None:
        """The texts of ``ids`` not known yet, in one scoring call (the first id repeated in
        front: a prompt's first token gets no score, hence no text)."""
        with self._lock:
            missing = list(dict.fromkeys(int(i) for i in ids if int(i) not in self._texts))
        if missing:
            sent = [missing[0]] + missing
            self.learn(sent, self._ask(self._client, sent, 1))

    def outside(self, ids: Sequence[int]) -> int | None:
        """The first of ``ids`` the server refuses as outside its vocabulary (None: it knows
        them all; their texts are then fetched)."""
        try:
            self.fetch(ids)
            return None
        except ServerRefused as exc:
            if exc.status != 400 or "vocabulary" not in str(exc):
                raise
        for token_id in ids:  # which one: rare (a primary of another model), one call each
            try:
                self.fetch([token_id])
            except ServerRefused as exc:
                if exc.status == 400 and "vocabulary" in str(exc):
                    return int(token_id)
                raise
        return None

    def token_text(self, token_id: int) -> str:
        self.fetch([token_id])
        return self._texts[int(token_id)]

    def detokenize(self, ids: Sequence[int]) -> str | None:
        """vLLM's ``POST /detokenize``; None from a server without it."""
        try:
            text = self._client.post("/detokenize", {"model": self._client.model,
                                                     "tokens": [int(i) for i in ids]})
        except ServerRefused:
            return None
        prompt = text.get("prompt")
        return prompt if isinstance(prompt, str) else None

    @property
    def size(self) -> int:
        # Not said by the server: the range check is the server's (it refuses an id outside
        # its vocabulary, an error counted by the mirror).
        return sys.maxsize

    def lookup(self, text: str) -> int | None:
        """The id whose text is ``text``: its tokenization, where that is one token whose text
        is ``text`` (a token of the vocabulary tokenizes to itself); None for a text that names
        no one token (``comparable_text``: a piece of a character, "")."""
        if not comparable_text(text):
            return None
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 and self.token_text(ids[0]) == text else None


class OpenAIScorer(Scorer):
    """A remote OpenAI-compatible server as the reference (module docstring)."""

    name = "openai"
    vocab: RemoteVocabulary

    def __init__(self, spec, role: Role, threads: int = 1):
        self.spec = spec
        self.role = role
        self.options = OpenAIOptions.model_validate(spec.options)
        self.base = base_url(spec.target)
        self.model = spec.model
        self.mode: str | None = None
        self.client: ScoringClient | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def load(self) -> None:
        header = authorization(self.options)
        wait_ready(self.base, self.model, header,
                   ready_timeout(self.base, self.options.ready_timeout_s))
        client = self.client = ScoringClient(self.base, self.model, self.options, header)
        try:
            probe = client.tokenize(PROBE_TEXT, special=True)
            plain = client.tokenize(PROBE_TEXT, special=False)
            self.context_length = int(client.post(
                "/tokenize", {"model": self.model, "prompt": "a"}).get("max_model_len") or 0)
        except BackendError as exc:
            raise BackendError(f"openai reference {self.model}@{self.base}: the server cannot "
                               f"tokenize (POST /tokenize, vLLM's): {exc}. {SERVERS}") from None
        self.adds_bos = len(probe) == len(plain) + 1 and probe[1:] == plain
        self.bos_id = probe[0] if self.adds_bos else None
        # The server scores one generated token past the prompt (max_tokens 1): it must fit.
        self.context_length = max(self.context_length - 1, 0)
        self.mode = self._choose_mode(client, probe)
        self.vocab = RemoteVocabulary(client, _ASK[self.mode])

    def _loaded(self) -> tuple[ScoringClient, str]:
        """The client and the way of asking, which ``load()`` set."""
        what = f"openai reference {self.model}@{self.base}"
        return loaded(self.client, what), loaded(self.mode, what)

    def _choose_mode(self, client: ScoringClient, probe: list[int]) -> str:
        """The first way of asking (``options.scoring``) that the server answers and whose
        positions are aligned; BackendError naming why each failed otherwise."""
        modes = SCORING_MODES if self.options.scoring == "auto" else (self.options.scoring,)
        k = self.options.top_logprobs
        try:
            generated = client.complete(probe, max_tokens=1, logprobs=min(k, 5))
        except BackendError as exc:
            raise BackendError(f"openai reference {self.model}@{self.base}: the server did not "
                               f"complete a prompt of token ids: {exc}. {SERVERS}") from None
        logits = returns_logits(generated)
        if logits is not None:
            raise BackendError(f"openai reference {self.model}@{self.base} returns logits, not "
                               f"log-probabilities ({logits}): a vLLM started with "
                               "--logprobs-mode raw_logits or processed_logits. A reference "
                               "scores with log-probabilities: start it with raw_logprobs "
                               "(vLLM's default)")
        why = []
        for mode in modes:
            try:
                positions = _ASK[mode](client, probe + probe[-1:], k)
            except ServerRefused as exc:
                if exc.status in (401, 403):
                    raise
                why.append(f"{mode}: {exc}")
                continue
            except BackendError as exc:
                why.append(f"{mode}: {exc}")
                continue
            misaligned = misalignment(generated, positions[-1])
            if misaligned is None:
                return mode
            why.append(f"{mode}: {misaligned}")
        hint, key = "", None
        if any("max allowed" in line or "max_logprobs" in line for line in why):
            hint = (f" (options.top_logprobs {k} is above the server's limit: lower it, or "
                    "start vLLM with a larger --max-logprobs)")
            key = "options.top_logprobs"
        raise BackendError(f"openai reference {self.model}@{self.base} cannot score a given "
                           f"text{hint}: " + "; ".join(why) + f". {SERVERS}", key=key)

    def describe(self) -> BackendInfo:
        return BackendInfo("openai", f"{self.model}@{self.base}", "as served", "remote", (), (),
                           {"scoring": str(self.mode), "top_logprobs":
                            str(self.options.top_logprobs),
                            "context_length": str(self.context_length)})

    # -- the shared steps' inputs ----------------------------------------------------------------
    def encode_prompt(self, text: str) -> list[int]:
        return self._loaded()[0].tokenize(text, special=True)

    def render_chat(self, messages: Sequence[dict],
                    template_args: Mapping[str, Any] | None = None) -> list[int]:
        return self._loaded()[0].tokenize_chat(messages, template_args)

    def score(self, sample: GenerationSample) -> ReferenceScores:
        # The texts of the primary's tokens (or of the completion's canonical tokenization)
        # in one call before the shared steps compare them token by token.
        if sample.tokens and all(t.token_id is not None for t in sample.tokens):
            ids = [int(t.token_id) for t in sample.tokens if t.token_id is not None]  # (all)
            outside = self.vocab.outside(ids)
            if outside is not None:  # ids the server refuses: another model's vocabulary
                position = ids.index(outside)
                return unscored(TokenizationMismatch(
                    position, sample.tokens[position].text, "", f"token id {outside} is "
                    "outside the reference server's vocabulary"),
                    **self.prompt_fields(self.render(sample)))
        else:
            # A reasoned completion's tokens spell the whole output, the reasoning first.
            text = ("".join(t.text for t in sample.tokens)
                    if sample.reasoning_text is not None else sample.completion_text)
            if text:
                self.vocab.fetch(self.vocab.encode(text))
        return super().score(sample)

    def teacher_force(self, sample: GenerationSample, prompt_ids: list[int], ids: list[int],
                      **fields) -> ReferenceScores:
        client, mode = self._loaded()
        sent = prompt_ids + ids
        positions = (_ASK[mode](client, sent, self.options.top_logprobs)
                     if ids else [])
        self.vocab.learn(sent, positions)
        scored = positions[len(prompt_ids) - 1:] if ids else []
        return scores_from_top(sample, ids, scored, self.options.top_logprobs, **fields)


def returns_logits(generated: dict) -> str | None:
    """What shows that a generated token's logprobs are logits (:func:`shown_as_logits`), or
    None. ``generated``: a completions choice."""
    logprobs = generated.get("logprobs") or {}
    top = (logprobs.get("top_logprobs") or [None])[0]
    return shown_as_logits([float(v) for v in top.values()] if isinstance(top, dict) else [])


def misalignment(generated: dict, scored: Position) -> str | None:
    """Why the scored distribution after the probe is not the one the server generated from
    (None: it is): the generated best token must be among the scored best, and every token of
    the generated top within ``_ALIGNMENT_TOLERANCE`` of its scored logprob (by text; a near
    tie may swap places, a shifted position is off by nats). ``generated`` is the first choice
    of a one-token completion with logprobs."""
    logprobs = generated.get("logprobs") or {}
    tops = logprobs.get("top_logprobs") or [None]
    if not isinstance(tops[0], dict) or not tops[0]:
        return "the server answered no top_logprobs for a generated token"
    wanted = {str(t): float(v) for t, v in tops[0].items()}
    best_text = max(wanted, key=wanted.__getitem__)
    found = {text: lp for _, text, lp in scored.top}
    found.setdefault(scored.token_text, scored.logprob)
    apart = [abs(found[t] - lp) for t, lp in wanted.items() if t in found]
    if best_text in found and max(apart) <= _ALIGNMENT_TOLERANCE:
        return None
    scored_best = scored.top[0] if scored.top else (-1, "", math.nan)
    return (f"its scores are not aligned with the prompt's positions: after the probe prompt "
            f"it generates {best_text!r} (logprob {wanted[best_text]:.3f}) but scores "
            f"{best_text!r} at {found.get(best_text, math.nan):.3f} there, its best being "
            f"{scored_best[1]!r} ({scored_best[2]:.3f})")


def scores_from_top(sample: GenerationSample, ids: Sequence[int],
                    positions: Sequence[Position], k: int, **fields) -> ReferenceScores:
    """:class:`ReferenceScores` from a remote scorer's top-k: ``logprobs`` None, the top-k
    arrays padded with id -1 / logprob -inf where the server returned fewer than ``k``."""
    n = len(ids)
    top_ids = np.full((n, k), -1, dtype=np.int64)
    top_lp = np.full((n, k), -np.inf, dtype=np.float32)
    alternatives = []
    for t, position in enumerate(positions):
        for j, (top_id, _, lp) in enumerate(position.top[:k]):
            top_ids[t, j], top_lp[t, j] = top_id, lp
        by_text = {text: lp for _, text, lp in position.top}
        by_text.setdefault(position.token_text, position.logprob)
        token = sample.tokens[t] if t < len(sample.tokens) else None
        named = token is not None and names_its_alternatives(token.text, position.token_text)
        alternatives.append(np.array(
            [by_text.get(text, np.nan) if named and comparable_text(text) else np.nan
             for text, _ in (token.top if token is not None else ())], dtype=np.float64))
    return ReferenceScores(
        token_ids=tuple(int(i) for i in ids),
        token_texts=tuple(p.token_text for p in positions),
        top_ids=top_ids, top_logprobs=top_lp,
        top_texts=tuple(tuple(text for _, text, _ in p.top[:5]) for p in positions),
        chosen_logprob=np.array([p.logprob for p in positions], dtype=np.float32),
        logprobs=None, primary_top_logprobs=tuple(alternatives), **fields)
