"""Teacher-forcing scorers: the reference side of a generative model (no heavy imports here).

A scorer takes one :class:`~guard.protocol.generation.GenerationSample` (the prompt and the
primary's completion) and runs ONE forward pass of its own model over ``prompt + completion``;
it returns the reference's next-token distribution at every completion position
(:class:`ReferenceScores`). It knows no checks: the ``generation`` tier
(guard/verify/generation/) compares those distributions with what the primary did.

What every scorer does the same way lives here:

- **The prompt as the server rendered it.** Token ids the server returned are used as they
  are; otherwise the scorer renders the prompt with its own tokenizer (the chat template with
  the generation prompt for chat) and marks the result ``approximate``. Either way BOS is
  checked explicitly (:func:`bos_findings`): a doubled BOS (a template that writes it plus a
  tokenizer that adds it) or a missing one is a finding, the classic silent chat-path bug;
  a completions prompt the client asked without special tokens (vLLM's
  ``add_special_tokens: false``) is rendered, and expected, without BOS.
- **The primary's tokens, reproduced** (guard/backends/token_alignment.py
  :func:`align_completion`): the completion as the reference's token ids, or a
  :class:`TokenizationMismatch` (tokenizer or template drift) reported and never scored as
  noise.

Local scorers return the full-vocabulary log-softmax (float32 ``[T, V]``); a remote one (a
server's prompt logprobs) fills only the top-k arrays and the chosen token's logprob, so the
tier's math reads what is there (``has_full``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, TypeVar

import numpy as np

from guard.backends.base import Backend
from guard.backends.token_alignment import (
    TokenizationMismatch,
    Vocabulary,
    align_completion,
    names_its_alternatives,
)
from guard.errors import BackendError
from guard.protocol.generation import LLAMA_CPP_CONTINUATION, GenerationSample

# How many of the reference's best tokens are kept per position (for reports and for a
# top-k-only comparison); vLLM's max_logprobs default is 20 too.
TOP_K = 20
@dataclass
class ReferenceScores:
    """The reference's view of one completion, teacher-forced.

    ``token_ids`` are the completion's tokens in the reference's vocabulary (the primary's
    own where it said them); position ``t``'s arrays are the reference's distribution over the
    token at ``t`` given the prompt and tokens ``< t``. ``logprobs`` (float32 ``[T, V]``, the
    full log-softmax) is None for a remote scorer; ``top_ids``/``top_logprobs`` (``[T, k]``,
    best first) and ``chosen_logprob`` (``[T]``, the reference's logprob of the primary's
    token) are always there. ``primary_top_logprobs[t]`` holds the reference's logprob of each
    of the primary's ``top`` alternatives at ``t`` (NaN where the reference has no such
    token). ``mismatch`` set means nothing was scored (the arrays are empty).
    """

    token_ids: tuple[int, ...]
    token_texts: tuple[str, ...]
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    # The texts of top_ids' tokens: all k of a local scorer's (a text-only completion the
    # server split otherwise is matched against every kept candidate there, not the best five
    # alone: checks.py _split_otherwise), a remote scorer's five best.
    top_texts: tuple[tuple[str, ...], ...]
    chosen_logprob: np.ndarray
    logprobs: np.ndarray | None = None
    # A text-only completion's, from a local scorer: at each position the ids of the
    # vocabulary's tokens whose text begins the completion's text there (the canonical token
    # among them): the splits a server may have sampled where the text alone does not say its
    # tokens (checks.py _split_otherwise looks among them, not only among the top_texts).
    text_pieces: tuple[tuple[int, ...], ...] = ()
    # [T] float64, a local scorer's: the raw logits are ``logprobs + logit_offsets[:, None]``.
    # A repetition penalty acts on raw logits (vLLM, llama.cpp: a positive logit divided, a
    # negative one multiplied), which a log-softmax alone cannot give back.
    logit_offsets: np.ndarray | None = None
    primary_top_logprobs: tuple[np.ndarray, ...] = ()
    # A local scorer's: the reference's id of each of those alternatives (-1 where it has
    # none), for comparisons that need the alternatives' place in the full distribution.
    primary_top_ids: tuple[np.ndarray, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    approximate: bool = False  # the prompt was rendered by the reference, not told by the server
    # prompt findings: "double_bos", "missing_bos", PROMPT_RENDERED_OTHERWISE
    findings: tuple[str, ...] = ()
    # Where the server's prompt ids depart from the reference's own rendering of the same
    # messages or text (a sentence naming the first differing token); "" where they agree or
    # the server told no ids.
    prompt_difference: str = ""
    mismatch: TokenizationMismatch | None = None
    noncanonical: bool = False  # the primary's split is not the reference's canonical one
    scorer: str = ""

    @property
    def has_full(self) -> bool:
        return self.logprobs is not None

    @property
    def scored(self) -> bool:
        return self.mismatch is None


def bos_findings(prompt_ids: Sequence[int], bos_id: int | None, adds_bos: bool) -> tuple[str, ...]:
    """``double_bos`` where the prompt starts with BOS twice; ``missing_bos`` where the model
    expects a BOS (its tokenizer adds one) and the prompt does not start with it."""
    if bos_id is None or bos_id < 0:
        return ()
    if len(prompt_ids) >= 2 and prompt_ids[0] == bos_id and prompt_ids[1] == bos_id:
        return ("double_bos",)
    if adds_bos and (not prompt_ids or prompt_ids[0] != bos_id):
        return ("missing_bos",)
    return ()


# Vocabulary entries per block in largest_k: a block's maximum is a cheap reduction, and k
# blocks of this many leave a few thousand candidates of tens of thousands.
_BLOCK = 128


def largest_k(values: np.ndarray, k: int) -> np.ndarray:
    """The indices of the ``k`` largest entries along the last axis, in no order: what
    ``np.argpartition(-values, k - 1, axis=-1)[..., :k]`` gives (ties may pick other indices
    of equal value), at a fraction of its CPU over a vocabulary.

    The vocabulary is cut into blocks of ``_BLOCK``; the k largest entries lie in the k blocks
    whose maxima are largest (an entry in any other block is beaten by the k maxima above it),
    so one pass of block maxima and a partition of k blocks' entries replace a partition of
    the whole row: over 128 positions of a 49,152-token vocabulary, about 10x less CPU (that
    partition was an eighth of a llama.cpp F16 reference's score of a completion). Rows with a
    NaN go the plain way (a NaN maximum would hide its block)."""
    def whole_rows(of: np.ndarray) -> np.ndarray:
        return np.argpartition(-of, k - 1, axis=-1)[..., :k]

    n = values.shape[-1]
    k = min(k, n)
    head = n - n % _BLOCK
    blocks = head // _BLOCK
    if k <= 0 or blocks <= 2 * k:
        return whole_rows(values)
    lead = values.shape[:-1]
    maxima = values[..., :head].reshape(*lead, blocks, _BLOCK).max(axis=-1)
    if np.isnan(maxima).any():
        return whole_rows(values)
    best = whole_rows(maxima)
    candidates = (best[..., None] * _BLOCK + np.arange(_BLOCK)).reshape(*lead, k * _BLOCK)
    if head < n:  # the entries past the last whole block are always candidates
        tail = np.broadcast_to(np.arange(head, n), (*lead, n - head))
        candidates = np.concatenate([candidates, tail], axis=-1)
    picked = whole_rows(np.take_along_axis(values, candidates, axis=-1))
    return np.take_along_axis(candidates, picked, axis=-1)


def common_prefix(left: Sequence[int], right: Sequence[int]) -> int:
    """How many leading ids ``left`` and ``right`` share (a scorer's prompt cache keeps them)."""
    count = 0
    for a, b in zip(left, right):
        if a != b:
            break
        count += 1
    return count


def log_normalize(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise log-softmax of float32 logits, as float32, and each row's log-normalizer
    (float64: ``logits = logprobs + offsets[:, None]``). The shift and the exponentials in
    float32, the sum in float64 (within one float32 ulp of computing it all in float64, at a
    tenth of the CPU: this pass was a third of a teacher-forced score of 128 tokens)."""
    logits = np.asarray(logits, dtype=np.float32)
    peak = logits.max(axis=-1, keepdims=True)
    shifted = logits - peak
    log_total = np.log(np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float64))
    return shifted - log_total.astype(np.float32), (peak + log_total)[..., 0]


def top_of(logprobs: np.ndarray, k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best ids and logprobs per row of ``[T, V]`` log-probabilities, best first."""
    k = min(k, logprobs.shape[-1])
    part = largest_k(logprobs, k)
    values = np.take_along_axis(logprobs, part, axis=-1)
    order = np.argsort(-values, axis=-1, kind="stable")
    return (np.take_along_axis(part, order, axis=-1).astype(np.int64),
            np.take_along_axis(values, order, axis=-1).astype(np.float32))


def scores_from_full(sample: GenerationSample, vocab: Vocabulary, logprobs: np.ndarray,
                     ids: Sequence[int], **fields) -> ReferenceScores:
    """:class:`ReferenceScores` from a local scorer's full ``[T, V]`` log-softmax."""
    logprobs = np.ascontiguousarray(logprobs, dtype=np.float32)
    top_ids, top_lp = top_of(logprobs)
    positions = np.arange(len(ids))
    chosen = logprobs[positions, np.asarray(ids, dtype=np.int64)] if len(ids) else \
        np.zeros(0, np.float32)
    alternatives, alternative_ids = [], []
    for t, token in enumerate(sample.tokens[:len(ids)]):
        named = names_its_alternatives(token.text, vocab.token_text(int(ids[t])))
        found = [vocab.lookup(text) if named else None for text, _ in token.top]
        alternatives.append(np.array([logprobs[t, i] if i is not None else np.nan
                                      for i in found], dtype=np.float64))
        alternative_ids.append(np.array([i if i is not None else -1 for i in found],
                                        dtype=np.int64))
    texts = tuple(vocab.token_text(int(i)) for i in ids)
    return ReferenceScores(
        token_ids=tuple(int(i) for i in ids), token_texts=texts,
        text_pieces=() if sample.tokens else _text_pieces(vocab, texts),
        top_ids=top_ids, top_logprobs=top_lp,
        top_texts=tuple(tuple(vocab.token_text(int(i)) for i in row) for row in top_ids),
        chosen_logprob=chosen.astype(np.float32), logprobs=logprobs,
        primary_top_logprobs=tuple(alternatives), primary_top_ids=tuple(alternative_ids),
        **fields)


def _text_pieces(vocab: Vocabulary, texts: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """For each position of a completion tokenized as ``texts``: the tokens whose text begins
    the completion's text from there (:meth:`Vocabulary.pieces_beginning`)."""
    text = "".join(texts)
    starts = np.cumsum([0, *(len(piece) for piece in texts)])
    return tuple(tuple(vocab.pieces_beginning(text[int(start):])) for start in starts[:-1])


def unscored(mismatch: TokenizationMismatch, **fields) -> ReferenceScores:
    """The scores of a completion the reference could not align: nothing but the finding."""
    empty = np.zeros((0, 0), np.float32)
    return ReferenceScores((), (), empty.astype(np.int64), empty, (), np.zeros(0, np.float32),
                           mismatch=mismatch, **fields)


# The finding of a prompt whose ids, as the server rendered them, are not the reference's own
# rendering of the same messages or text: chat template or tokenizer drift (a server started
# with another --chat-template, an engine upgrade that renders otherwise, a client's template).
PROMPT_RENDERED_OTHERWISE = "prompt_rendered_otherwise"


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt as token ids, and how they were obtained."""

    ids: list[int]
    approximate: bool
    findings: tuple[str, ...] = field(default=())
    difference: str = ""  # ReferenceScores.prompt_difference


def chat_rendering(template_args: Mapping[str, Any] | None
                   ) -> tuple[bool, bool, dict[str, Any]]:
    """A chat request's (add_generation_prompt, continue_final_message, the template's own
    keyword arguments), with the servers' defaults for the first two: the generation prompt
    added and the final message closed, or the final message continued and no generation
    prompt (the two exclude each other: vLLM refuses a call that sets both)."""
    args = template_args or {}
    continued = bool(args.get("continue_final_message", False))
    return (bool(args.get("add_generation_prompt", True)) and not continued, continued,
            dict(args.get("chat_template_kwargs") or {}))


def template_messages(messages: Sequence[dict]) -> tuple[dict, ...]:
    """A sample's messages (content parts as the client sent them) as a text model's template
    reads them: each content of text parts one string, the parts joined by newlines, as vLLM
    joins them for a template that concatenates strings (SmolLM2's raises on a list).
    llama-server joins them otherwise: its samples come here joined its way
    (guard.protocol.generation ``rendered_as_served``)."""
    from guard.protocol.openai import chat_messages

    try:
        return chat_messages(list(messages))
    except ValueError as exc:  # (such calls are not comparable at the edge: a record's only)
        raise BackendError(f"the chat's messages cannot be rendered: {exc}") from None


def chat_plan(template_args: Mapping[str, Any] | None, messages: Sequence[dict]
              ) -> tuple[list, bool, bool, dict[str, Any], str]:
    """How a local scorer renders ``messages`` with a request's ``template_args``: the
    messages its template renders, add_generation_prompt, continue_final_message, the
    template's keyword arguments (:func:`chat_rendering`), and the text written after what
    the template renders (a final message continued as llama.cpp's server continues it:
    :func:`continued_after_generation_prompt`; "" otherwise)."""
    generation_prompt, continued, keywords = chat_rendering(template_args)
    after = continued_after_generation_prompt(template_args, messages)
    if after is None:
        return list(messages), generation_prompt, continued, keywords, ""
    return after[0], True, False, keywords, after[1]


def template_failed(exc: Exception) -> BackendError:
    """A chat template's failure on a sample's messages, as the scorer's error: any exception
    of the template's code (a final message it does not write: ValueError; content it cannot
    concatenate: jinja's TypeError; its raise_exception: TemplateError)."""
    return BackendError(f"the chat template cannot render these messages: "
                        f"{type(exc).__name__}: {exc}")


def continued_after_generation_prompt(template_args: Mapping[str, Any] | None,
                                      messages: Sequence[dict]) -> tuple[list, str] | None:
    """Where the final message is continued as llama.cpp's server continues it
    (:data:`~guard.protocol.generation.LLAMA_CPP_CONTINUATION`): the messages to render with
    the generation prompt, and the text that follows it (the final message's content, its
    text parts joined by blank lines where ``rendered_as_served`` set the argument). None
    otherwise."""
    if not (template_args or {}).get(LLAMA_CPP_CONTINUATION) or not messages:
        return None
    content = messages[-1].get("content")
    return list(messages[:-1]), content if isinstance(content, str) else ""


def continue_final_message(text: str, messages: Sequence[dict]) -> str:
    """``text`` (the messages rendered without a generation prompt) cut after the final
    message's content, so that the model continues that message: transformers'
    ``continue_final_message`` (what vLLM applies), for a renderer without it. BackendError
    where the template did not write the content."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):  # content parts: the last text part is continued
        content = next((part.get("text") for part in reversed(content)
                        if isinstance(part, dict) and isinstance(part.get("text"), str)), None)
    if not isinstance(content, str) or not content.strip() or content.strip() not in text:
        raise BackendError("continue_final_message: the final message's text is not in the "
                           "rendered chat")
    at = text.rindex(content.strip())
    # Its trailing whitespace stays where the template kept it, as transformers keeps it.
    kept = content.lstrip() if text[at:at + len(content.lstrip())] == content.lstrip() \
        else content.strip()
    return text[:at + len(kept)]


def rendering_difference(server: Sequence[int], own: Sequence[int], vocab: Vocabulary) -> str:
    """A sentence naming the first token where the server's prompt ids leave the reference's
    rendering, or "" where they are the same."""
    if list(server) == list(own):
        return ""
    at = next((i for i, (a, b) in enumerate(zip(server, own)) if a != b),
              min(len(server), len(own)))

    def text(ids: Sequence[int]) -> str:
        return repr(vocab.token_text(ids[at])) if at < len(ids) else "(the end)"

    return (f"the server rendered the prompt otherwise than the reference renders it "
            f"({len(server)} tokens vs {len(own)}), from token {at}: server {text(server)}, "
            f"reference {text(own)}")


_Handle = TypeVar("_Handle")


def loaded(handle: _Handle | None, what: str) -> _Handle:
    """``handle`` as a scorer's ``load()`` set it (its model, tokenizer, client); BackendError
    "``what`` is not loaded" before ``load()`` or after ``close()``: one message for every
    scorer, instead of an AttributeError on None."""
    if handle is None:
        raise BackendError(f"{what} is not loaded")
    return handle


class Scorer(Backend):
    """A backend that teacher-forces generations instead of mapping tensors (``score``).

    Subclasses give the tokenizer (``vocab``, ``bos_id``, ``adds_bos``, ``encode_prompt``,
    ``render_chat``), the context length and the teacher-forced pass itself
    (``teacher_force``: a local scorer's forward pass, :class:`LocalScorer`, or a remote
    server's prompt logprobs); the steps every scorer shares (render, check BOS, align, check
    the context) are here.
    """

    name = "scorer"
    vocab: Vocabulary
    bos_id: int | None = None
    adds_bos: bool = False
    context_length: int = 0

    @abc.abstractmethod
    def encode_prompt(self, text: str) -> list[int]:
        """A completions prompt as the server tokenizes it (BOS where the model adds one,
        special-token text parsed)."""

    @abc.abstractmethod
    def render_chat(self, messages: Sequence[dict],
                    template_args: Mapping[str, Any] | None = None) -> list[int]:
        """Chat messages through the model's chat template with the request's arguments to
        it (``GenerationSample.chat_template_args``; none: the generation prompt added, as
        servers default)."""

    @abc.abstractmethod
    def teacher_force(self, sample: GenerationSample, prompt_ids: list[int], ids: list[int],
                      **fields) -> ReferenceScores:
        """The reference's scores of the completion ``ids`` after ``prompt_ids`` (both
        aligned and checked; ``ids`` may be empty); ``fields`` go into the result."""

    def render(self, sample: GenerationSample) -> RenderedPrompt:
        """The prompt's ids: the server's where it told them (compared with this scorer's own
        rendering of the same messages or text: a difference is a finding), else rendered
        here. An echo call's tokens begin after the prompt's first token: its prompt is
        checked whole (BOS, rendering) and scored from that first token on."""
        prompt = self._whole_prompt(sample)
        if sample.echo:
            return RenderedPrompt(prompt.ids[:1], prompt.approximate, prompt.findings,
                                  prompt.difference)
        return prompt

    def _whole_prompt(self, sample: GenerationSample) -> RenderedPrompt:
        if sample.tools and sample.prompt_token_ids is None:
            raise BackendError("a chat that offered tools is scored on the server's prompt "
                               "token ids, which this sample does not have")
        if sample.prompt_token_ids is not None:
            ids = list(sample.prompt_token_ids)
            try:
                # Tools: each engine renders their definitions and earlier calls its own way
                # (vLLM parses a call's arguments, llama.cpp's server rewrites templates): the
                # server's ids are the prompt, no rendering of the reference's to compare.
                own = None if sample.tools else self._own_rendering(sample, ids)
            except BackendError:  # nothing to render from, or no template: nothing to compare
                own = None
            # The server kept part of the prompt, as the client asked (vLLM's
            # truncate_prompt_tokens): what it kept is the prompt, and the cut is no lost BOS.
            # It is a slice of the server's rendering (the last tokens, or the first where
            # truncation_side is right), compared with the same slice of the reference's.
            cut = sample.prompt_truncation is not None and (own is None or len(ids) < len(own))
            if cut and own is not None:
                kept = len(ids)
                own = own[:kept] if ids == own[:kept] else own[len(own) - kept:]
            difference = "" if own is None else rendering_difference(ids, own, self.vocab)
            findings = () if cut or self._client_ids(sample) else bos_findings(
                ids, self.bos_id, self._expects_bos(sample))
            if difference:
                findings += (PROMPT_RENDERED_OTHERWISE,)
            return RenderedPrompt(ids, False, findings, difference)
        ids = self._own_rendering(sample)
        return RenderedPrompt(ids, True, bos_findings(ids, self.bos_id,
                                                      self._expects_bos(sample)))

    def _without_special_tokens(self, sample: GenerationSample) -> bool:
        """A completions prompt the client asked tokenized without special tokens (vLLM's
        ``add_special_tokens: false``): the server adds no BOS to it."""
        return sample.endpoint == "completions" and sample.add_special_tokens is False

    def _expects_bos(self, sample: GenerationSample) -> bool:
        """Whether the prompt should start with BOS: where the model adds one, unless the
        client asked for none (the client's choice of input, no drift; a doubled BOS is
        still found)."""
        return self.adds_bos and not self._without_special_tokens(sample)

    @staticmethod
    def _client_ids(sample: GenerationSample) -> bool:
        """A completions prompt the client gave as token ids (lm-eval's tokenized requests):
        the servers read them as given (vLLM, llama.cpp's), so their BOS, one, none or two,
        is the client's choice of input, never a finding."""
        return sample.endpoint == "completions" and sample.prompt is None

    def _own_rendering(self, sample: GenerationSample,
                       server_ids: Sequence[int] | None = None) -> list[int]:
        """The prompt as this scorer renders it: chat messages through the model's template,
        a completions prompt through its tokenizer (without the BOS it adds where the client
        asked for no special tokens, unless the server's ids, ``server_ids``, say it added one
        all the same: llama.cpp's servers do not read the field)."""
        if sample.endpoint == "chat":
            if not sample.messages:
                raise BackendError("a chat sample without messages cannot be scored")
            return self.render_chat(template_messages(sample.messages),
                                    sample.chat_template_args)
        if sample.prompt is None:
            raise BackendError("a completions sample without a prompt cannot be scored")
        ids = self.encode_prompt(sample.prompt)
        server_added = server_ids is not None and list(server_ids[:1]) == [self.bos_id]
        if self._without_special_tokens(sample) and self.adds_bos and not server_added \
                and ids[:1] == [self.bos_id]:
            return ids[1:]
        return ids

    def prompt_fields(self, prompt: RenderedPrompt) -> dict:
        """The fields of a :class:`ReferenceScores` that the prompt decides."""
        return dict(prompt_token_ids=tuple(prompt.ids), approximate=prompt.approximate,
                    findings=prompt.findings, prompt_difference=prompt.difference,
                    scorer=self.name)

    def score(self, sample: GenerationSample) -> ReferenceScores:
        """The reference's distributions over ``sample``'s completion positions; raises
        BackendError for a sample it cannot score at all (longer than its context)."""
        prompt = self.render(sample)
        common = self.prompt_fields(prompt)
        ids, noncanonical, mismatch = align_completion(sample, self.vocab, prompt.ids)
        if mismatch is not None:
            return unscored(mismatch, **common)
        if ids:
            total = len(prompt.ids) + len(ids)
            if self.context_length and total > self.context_length:
                raise BackendError(f"prompt ({len(prompt.ids)} tokens) and completion "
                                   f"({len(ids)}) exceed the reference's context of "
                                   f"{self.context_length} tokens")
            if not prompt.ids:
                raise BackendError("an empty prompt (no BOS either) gives no position to "
                                   "score the first token from")
        return self.teacher_force(sample, prompt.ids, ids, noncanonical=noncanonical, **common)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise BackendError(f"backend {self.name} scores generations (score()); it has no "
                           "tensor inputs to infer on")


class LocalScorer(Scorer):
    """A scorer whose model runs in this process: ONE forward pass gives the full-vocabulary
    logits at every completion position (``logits``)."""

    @abc.abstractmethod
    def logits(self, ids: Sequence[int], prompt_length: int) -> np.ndarray:
        """One teacher-forced pass over ``ids``: the raw logits (float32 ``[T, V]``) at the
        ``T = len(ids) - prompt_length`` positions that predict ``ids[prompt_length:]``."""

    def normalized(self, ids: Sequence[int], prompt_length: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`logits` as :func:`log_normalize` gives them (log-softmax, normalizers); a
        scorer on an accelerator overrides it to normalize there."""
        return log_normalize(self.logits(ids, prompt_length))

    def forward(self, ids: Sequence[int], prompt_length: int) -> np.ndarray:
        """:meth:`logits`, log-softmaxed (float32 ``[T, V]``)."""
        return self.normalized(ids, prompt_length)[0]

    def teacher_force(self, sample: GenerationSample, prompt_ids: list[int], ids: list[int],
                      **fields) -> ReferenceScores:
        if not ids:
            return scores_from_full(sample, self.vocab,
                                    np.zeros((0, self.vocab.size), np.float32), ids,
                                    logit_offsets=np.zeros(0), **fields)
        logprobs, offsets = self.normalized(prompt_ids + ids, len(prompt_ids))
        return scores_from_full(sample, self.vocab, logprobs, ids, logit_offsets=offsets,
                                **fields)
