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
  tokenizer that adds it) or a missing one is a finding, the classic silent chat-path bug.
- **The primary's tokens, reproduced** (:func:`align_completion`). Where the primary said its
  token ids they are checked against their texts in the reference's vocabulary; where it said
  texts only, the reference's tokenization of the completion text must give the same texts
  (or, for a sampled, non-canonical split, every text must be one token of the vocabulary).
  Ids whose texts cannot be checked one by one (the server said ids only, or a token is a
  piece of a character) must together spell the completion text. A difference is a
  :class:`TokenizationMismatch` (tokenizer or template drift), reported with its position and
  never scored as noise.

Local scorers return the full-vocabulary log-softmax (float32 ``[T, V]``); a remote one (a
server's prompt logprobs) fills only the top-k arrays and the chosen token's logprob, so the
tier's math reads what is there (``has_full``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence, TypeVar

import numpy as np

from guard.backends.base import Backend
from guard.errors import BackendError
from guard.protocol.generation import GenerationSample

# How many of the reference's best tokens are kept per position (for reports and for a
# top-k-only comparison); vLLM's max_logprobs default is 20 too.
TOP_K = 20
# Prefix the OpenAI servers put on a token text that is not valid UTF-8 by itself (vLLM
# writes "bytes:\\xe2\\x80"); such texts, texts with U+FFFD and empty ones (llama-cpp-python
# drops the bytes) are partial characters whose text cannot be compared byte for byte.
_BYTES_PREFIX = "bytes:"


@dataclass(frozen=True)
class TokenizationMismatch:
    """The reference does not reproduce the primary's tokens from position ``position`` on.

    ``drift`` False: not a difference between the two tokenizers but what the primary's
    answer cannot say (the texts of a character's byte pieces, which name no token): the
    completion is not comparable (counted), never a failure."""

    position: int
    primary: str  # the primary's token text there ("" past its end)
    reference: str  # the reference's token text there ("" past its end)
    reason: str
    drift: bool = True

    def as_dict(self) -> dict[str, object]:
        return {"position": self.position, "primary": self.primary,
                "reference": self.reference, "reason": self.reason, "drift": self.drift}


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
    top_texts: tuple[tuple[str, ...], ...]
    chosen_logprob: np.ndarray
    logprobs: np.ndarray | None = None
    # [T] float64, a local scorer's: the raw logits are ``logprobs + logit_offsets[:, None]``.
    # A repetition penalty acts on raw logits (vLLM, llama.cpp: a positive logit divided, a
    # negative one multiplied), which a log-softmax alone cannot give back.
    logit_offsets: np.ndarray | None = None
    primary_top_logprobs: tuple[np.ndarray, ...] = ()
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


def comparable_text(text: str) -> bool:
    """Can this token text be compared byte for byte? (Not a partial UTF-8 character, and not
    empty: llama-cpp-python drops a partial character's bytes from its ``top_logprobs`` keys,
    leaving "", which names no one token.)"""
    return bool(text) and not text.startswith(_BYTES_PREFIX) and "\ufffd" not in text


def names_its_alternatives(token_text: str, reference_text: str) -> bool:
    """Do the primary's ``top_logprobs`` texts at a position name tokens? Not where its chosen
    token is a piece of a character (the reference's text of it is not comparable): servers
    then write each alternative as the character it would complete (vLLM writes "ι" for the
    byte 0xB9 after 0xCE), a text that names another token of the vocabulary."""
    return comparable_text(reference_text) and token_text == reference_text


def _texts_equal(primary: str, reference: str) -> bool:
    return primary == reference or not (comparable_text(primary) and comparable_text(reference))


class Vocabulary(abc.ABC):
    """The tokenizer operations the shared steps need; each scorer wraps its own tokenizer."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """``text`` as tokens, no BOS/EOS added, special-token text not parsed."""

    @abc.abstractmethod
    def token_text(self, token_id: int) -> str:
        """One token's text (bytes decoded with replacement)."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """The number of token ids."""

    def detokenize(self, ids: Sequence[int]) -> str | None:
        """``ids`` as the text a server writes for them (control tokens as nothing), or None
        where this vocabulary cannot say (the spelling check is then left out)."""
        return None

    _by_text: dict[str, int] | None = None

    def lookup(self, text: str) -> int | None:
        """The id whose text is ``text`` (built on first use: one decode per id); None for a
        text that names no one token (``comparable_text``: "" is the text of control tokens and
        of partial characters alike)."""
        if not comparable_text(text):
            return None
        if self._by_text is None:
            table: dict[str, int] = {}
            for token_id in range(self.size):
                token_text = self.token_text(token_id)
                if comparable_text(token_text):
                    table.setdefault(token_text, token_id)
            self._by_text = table
        return self._by_text.get(text)


def align_completion(sample: GenerationSample, vocab: Vocabulary
                     ) -> tuple[list[int], bool, TokenizationMismatch | None]:
    """The primary's completion as reference token ids: ``(ids, noncanonical, mismatch)``.

    With the primary's ids: each id's reference text must be the primary's text. With texts
    only: the reference's canonical tokenization of ``completion_text`` must give the same
    texts; where it does not, a sampled split is accepted when every text is one token of the
    vocabulary and they join to the completion text (``noncanonical``); anything else is a
    mismatch at the first position where the reference's tokens part from the primary's.

    A stopped completion may carry, after the tokens that make its text, the stop token the
    server sampled and left out of the text (vLLM reports EOS, ``<|im_end|>``, in the logprobs
    of a call that ``finish_reason: stop``): each such token is one token of the vocabulary,
    aligned by its text, and scored like the others (the reference's probability of
    stopping there).

    A completion whose reasoning or tool calls the server gave apart (``reasoning_text``,
    ``tool_calls``) is aligned as the whole output its tokens are (:func:`_align_parsed`).
    """
    if sample.reasoning_text is not None or sample.tool_calls:
        return _align_parsed(sample, vocab)
    tokens = sample.tokens
    stopped = _stop_tokens(sample)
    if stopped:
        head, noncanonical, mismatch = align_completion(
            replace(sample, tokens=tokens[:len(tokens) - stopped]), vocab)
        if mismatch is not None:
            return [], False, mismatch
        tail = []
        for position in range(len(tokens) - stopped, len(tokens)):
            token = tokens[position]
            found = token.token_id if token.token_id is not None else vocab.lookup(token.text)
            if found is None or not _texts_equal(token.text, vocab.token_text(int(found))):
                return [], False, TokenizationMismatch(
                    position, token.text, "", "the stop token after the completion's text is "
                    "not a token of the reference's vocabulary")
            tail.append(int(found))
        return head + tail, noncanonical, None
    if tokens and all(t.token_id is not None for t in tokens):
        ids = [int(t.token_id) for t in tokens]  # type: ignore[arg-type]
        wrong = _ids_named_otherwise(tokens, ids, vocab)
        if wrong is not None:
            return [], False, wrong
        if any(not comparable_text(t.text) for t in tokens):
            # Texts that could not be checked one by one (ids without texts, pieces of a
            # character): the ids together must spell the completion the client received.
            return ids, False, _misspelt(sample, ids, vocab)
        return ids, False, None
    texts = [t.text for t in tokens]
    joined = "".join(texts)
    if tokens and joined != sample.completion_text and all(comparable_text(t) for t in texts):
        position = next((i for i in range(len(texts))
                         if not sample.completion_text.startswith("".join(texts[:i + 1]))),
                        len(texts) - 1)
        return [], False, TokenizationMismatch(
            position, texts[position], "", "the tokens' texts do not join to the completion text")
    replaced = _replaced_bytes(sample)
    if replaced is not None:
        return [], False, replaced
    canonical = vocab.encode(sample.completion_text)
    canonical_texts = [vocab.token_text(i) for i in canonical]
    if not tokens:
        return canonical, False, None
    if len(canonical) == len(texts) and all(map(_texts_equal, texts, canonical_texts)):
        return canonical, False, None
    split = [vocab.lookup(text) for text in texts]
    if all(i is not None for i in split):
        return [int(i) for i in split], True, None  # type: ignore[arg-type]
    position = next((i for i, (p, r) in enumerate(zip(texts, canonical_texts))
                     if not _texts_equal(p, r)), min(len(texts), len(canonical)))
    pieces = {i for i, text in enumerate(texts) if not comparable_text(text)}
    # Texts that are no token of the reference's vocabulary, pieces aside (and the text right
    # after a run of pieces: vLLM writes the character the run completes on its last piece).
    strays = [i for i, found in enumerate(split)
              if found is None and i not in pieces and i - 1 not in pieces]
    if pieces and not strays:
        # A character sampled as several byte tokens, split otherwise than the reference's
        # own tokenization would: each piece's text alone is not UTF-8, so it names no token,
        # and the positions after the run cannot be matched one to one. Named: the run where
        # the tokenizations part (or the first run); the completion is not comparable.
        start = max((i for i in pieces if i <= position), default=min(pieces))
        while start - 1 in pieces:
            start -= 1
        return [], False, TokenizationMismatch(
            start, texts[start], "",
            f"token {start} is a piece of a character the primary sampled as several "
            "tokens, split otherwise than the reference tokenizes it (or held back from the "
            "text at its end); a piece's text names no token (a server that reports token ids "
            "would)", drift=False)
    if pieces:
        position = strays[0]
        return [], False, TokenizationMismatch(
            position, texts[position], "", f"token {position} ({texts[position]!r}) is no "
            "token of the reference's vocabulary")
    return [], False, TokenizationMismatch(
        position, texts[position] if position < len(texts) else "",
        canonical_texts[position] if position < len(canonical_texts) else "",
        "the reference's tokenization of the completion differs from the primary's tokens")


def _ids_named_otherwise(tokens: Sequence[Any], ids: Sequence[int], vocab: Vocabulary
                         ) -> TokenizationMismatch | None:
    """The first of the primary's ids outside the reference's vocabulary, or whose text there
    is not the primary's text of it; None where each is what the primary said."""
    for position, (token, token_id) in enumerate(zip(tokens, ids)):
        if not 0 <= token_id < vocab.size:
            return TokenizationMismatch(
                position, token.text, "", f"token id {token_id} is outside the reference's "
                f"vocabulary of {vocab.size}")
        reference = vocab.token_text(token_id)
        if not _texts_equal(token.text, reference):
            return TokenizationMismatch(
                position, token.text, reference,
                f"token id {token_id} is {reference!r} in the reference's vocabulary")
    return None


def _align_parsed(sample: GenerationSample, vocab: Vocabulary
                  ) -> tuple[list[int], bool, TokenizationMismatch | None]:
    """Align a completion whose reasoning or tool calls the server gave apart from its answer.

    A reasoning parser (vLLM's ``--reasoning-parser``) splits the output the model generated
    into the reasoning and the answer, taking out its tags (``<think>``, ``</think>``) and
    sometimes the whitespace around them; the answer's tokens (logprobs, token ids) are those
    of the whole output. So the tokens are the completion: where their texts say it, the
    output they spell must hold the reasoning and then the answer, and is aligned as any
    completion (up to the answer's end; what a stopped one sampled after it, the stop token,
    as its stop tokens); where they are ids alone (or pieces of characters), the reference's
    detokenization of the ids must hold them so. Anything else (tokens that cover the answer
    alone, as a server might report them) is not comparable: never drift, the sample cannot
    say which tokens the reasoning was.

    A tool call (a tool parser's ``tool_calls``: the function's name and its arguments, which
    the parser re-serialises) is aligned by its ids alone (a chat with tools is compared where
    the server said them): their detokenization must name each function called, in order,
    and hold the reasoning and the answer as above."""
    tokens = sample.tokens
    texts = [t.text for t in tokens]
    if not sample.tool_calls and texts and all(comparable_text(t) for t in texts):
        output = "".join(texts)
        end = _answer_end(output, sample)
        if end is not None:
            if sample.finish_reason == "stop":  # the tokens past the answer: stop tokens
                output = "".join(texts[:_tokens_in(texts, end)])
            return align_completion(replace(sample, completion_text=output,
                                            reasoning_text=None), vocab)
    if tokens and all(t.token_id is not None for t in tokens):
        ids = [int(t.token_id) for t in tokens]  # type: ignore[arg-type]
        wrong = _ids_named_otherwise(tokens, ids, vocab)
        if wrong is not None:
            return [], False, wrong
        text = vocab.detokenize(ids)
        if text is None or (_answer_end(text.replace("\ufffd", ""), sample, clean=True)
                            is not None and _names_in_order(text, sample.tool_calls)):
            return ids, False, None
    return [], False, TokenizationMismatch(
        0, texts[0] if texts else "", "", "the completion's tokens do not spell its reasoning, "
        "its tool calls and its answer: the server's tokens may cover the answer alone, or "
        "ids are missing, so the sample cannot say which tokens the model generated",
        drift=False)


def _names_in_order(output: str, names: Sequence[str]) -> bool:
    """Does ``output`` name each of ``names`` (the functions called), in order?"""
    at = 0
    for name in names:
        found = output.find(name, at)
        if found < 0:
            return False
        at = found + len(name)
    return True


def _tokens_in(texts: Sequence[str], length: int) -> int:
    """How many of ``texts``, joined, cover the first ``length`` characters."""
    count = total = 0
    while total < length:
        total += len(texts[count])
        count += 1
    return count


def _answer_end(output: str, sample: GenerationSample, clean: bool = False) -> int | None:
    """Where the answer ends in the whole ``output``: after the reasoning, found in it, and
    then the answer (each without the whitespace a parser may strip); None where ``output``
    does not hold them in that order. ``clean``: U+FFFD left out of both (a detokenization's
    cut character)."""
    reasoning, answer = (sample.reasoning_text or "").strip(), sample.completion_text.strip()
    if clean:
        reasoning, answer = reasoning.replace("\ufffd", ""), answer.replace("\ufffd", "")
    start = output.find(reasoning)
    if start < 0:
        return None
    after = start + len(reasoning)
    found = output.find(answer, after)
    return None if found < 0 else found + len(answer)


def _spells(text: str, sample: GenerationSample, whole: bool) -> bool:
    """Does the reference's ``text`` of the primary's ids (all of them: ``whole``; else a
    prefix) agree with the completion text? Agreement allows what detokenizers differ in
    without changing the text: a leading space of the first token (SentencePiece decoders drop
    it), bytes that are no UTF-8 (U+FFFD in the reference's detokenization: a character cut at
    the end, or a piece of one sampled and never completed, which a server writes as U+FFFD,
    as vLLM does, or leaves out, as llama-cpp-python does: the ids say which tokens they were),
    and, in a stopped completion, the stop string or stop token the server sampled and left out
    of the text."""
    completion = sample.completion_text
    if text.startswith(" ") != completion.startswith(" "):
        text, completion = text.removeprefix(" "), completion.removeprefix(" ")
    text, completion = text.replace("\ufffd", ""), completion.replace("\ufffd", "")
    if sample.finish_reason == "stop" and text.startswith(completion):
        return True
    return text == completion if whole else completion.startswith(text)


def _replaced_bytes(sample: GenerationSample) -> TokenizationMismatch | None:
    """A completion text that holds U+FFFD where the primary's texts cannot say which tokens
    made it: the server wrote the replacement character for bytes that were no UTF-8 (a
    character's pieces sampled out of order). The reference's tokenization of the text encodes
    the replacement character itself, never the bytes sampled: scored so, a healthy model's
    completion took another token's logprob there (a vLLM fp32 Arabic completion: mean KLD
    0.033 against 5e-11 by its ids). Not comparable, not drift; ids would have said."""
    offset = sample.completion_text.find("\ufffd")
    texts = [t.text for t in sample.tokens]
    if offset < 0 or (texts and all(comparable_text(t) for t in texts)):
        return None
    position = next((i for i, text in enumerate(texts) if not comparable_text(text)), 0)
    return TokenizationMismatch(
        position, texts[position] if texts else "", "\ufffd",
        f"the completion text holds U+FFFD at character {offset}: the server replaced bytes "
        "that are no UTF-8, and its texts do not say which tokens they were (a server that "
        "reports token ids would)", drift=False)


def _misspelt(sample: GenerationSample, ids: Sequence[int], vocab: Vocabulary
              ) -> TokenizationMismatch | None:
    """None where the reference's detokenization of ``ids`` is the completion text (or the
    vocabulary cannot detokenize); else a mismatch at the first token where it departs."""
    text = vocab.detokenize(ids)
    if text is None or _spells(text, sample, whole=True):
        return None
    # A completion cut inside a character: a server writes a character once its bytes are
    # whole (vLLM's detokenizer), so the text ends before the tokens of the last, unfinished
    # one. They were sampled all the same, and are scored.
    whole, head = len(ids), text
    while whole > 0 and head.endswith("\ufffd"):
        whole -= 1
        head = vocab.detokenize(ids[:whole]) or ""
    if whole < len(ids) and _spells(head, sample, whole=True):
        return None
    position = next((count - 1 for count in range(1, len(ids) + 1)
                     if not _spells(vocab.detokenize(ids[:count]) or "", sample, whole=False)),
                    len(ids) - 1)
    return TokenizationMismatch(
        position, sample.tokens[position].text if position < len(sample.tokens) else "",
        vocab.token_text(int(ids[position])),
        "the primary's token ids, detokenized by the reference, depart from the completion "
        "text here: the reference's vocabulary is not the primary's")


def _stop_tokens(sample: GenerationSample) -> int:
    """How many trailing tokens of a stopped completion lie past its text (0: none)."""
    if sample.finish_reason != "stop" or not sample.tokens:
        return 0
    texts = [t.text for t in sample.tokens]
    if "".join(texts) == sample.completion_text:
        return 0
    joined = ""
    for count, text in enumerate(texts):
        if joined == sample.completion_text and all(texts[count:]):
            return len(texts) - count
        joined += text
    return 0


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
    alternatives = []
    for t, token in enumerate(sample.tokens[:len(ids)]):
        named = names_its_alternatives(token.text, vocab.token_text(int(ids[t])))
        found = [vocab.lookup(text) if named else None for text, _ in token.top]
        alternatives.append(np.array([logprobs[t, i] if i is not None else np.nan
                                      for i in found], dtype=np.float64))
    return ReferenceScores(
        token_ids=tuple(int(i) for i in ids),
        token_texts=tuple(vocab.token_text(int(i)) for i in ids),
        top_ids=top_ids, top_logprobs=top_lp,
        top_texts=tuple(tuple(vocab.token_text(int(i)) for i in row[:5]) for row in top_ids),
        chosen_logprob=chosen.astype(np.float32), logprobs=logprobs,
        primary_top_logprobs=tuple(alternatives), **fields)


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
        here."""
        if sample.tools and sample.prompt_token_ids is None:
            raise BackendError("a chat that offered tools is scored on the server's prompt "
                               "token ids, which this sample does not have")
        if sample.prompt_token_ids is not None:
            ids = list(sample.prompt_token_ids)
            try:
                # Tools: each engine renders their definitions and earlier calls its own way
                # (vLLM parses a call's arguments, llama.cpp's server rewrites templates): the
                # server's ids are the prompt, no rendering of the reference's to compare.
                own = None if sample.tools else self._own_rendering(sample)
            except BackendError:  # nothing to render from, or no template: nothing to compare
                own = None
            if sample.prompt_truncation is not None and (own is None or len(ids) < len(own)):
                # The server kept part of the prompt, as the client asked (vLLM's
                # truncate_prompt_tokens): what it kept is the prompt, and the cut is neither
                # another template nor a lost BOS. A prompt it did not cut is checked as any.
                return RenderedPrompt(ids, False, ())
            difference = "" if own is None else rendering_difference(ids, own, self.vocab)
            findings = bos_findings(ids, self.bos_id, self.adds_bos)
            if difference:
                findings += (PROMPT_RENDERED_OTHERWISE,)
            return RenderedPrompt(ids, False, findings, difference)
        ids = self._own_rendering(sample)
        return RenderedPrompt(ids, True, bos_findings(ids, self.bos_id, self.adds_bos))

    def _own_rendering(self, sample: GenerationSample) -> list[int]:
        """The prompt as this scorer renders it: chat messages through the model's template,
        a completions prompt through its tokenizer."""
        if sample.endpoint == "chat":
            if not sample.messages:
                raise BackendError("a chat sample without messages cannot be scored")
            return self.render_chat(sample.messages, sample.chat_template_args)
        if sample.prompt is None:
            raise BackendError("a completions sample without a prompt cannot be scored")
        return self.encode_prompt(sample.prompt)

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
        ids, noncanonical, mismatch = align_completion(sample, self.vocab)
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
