"""The primary's completion as the reference's token ids, or why it cannot be
(:func:`align_completion`, :class:`TokenizationMismatch`), over a scorer's tokenizer
(:class:`Vocabulary`).

Where the primary said its token ids they are checked against their texts in the reference's
vocabulary; where it said texts only, the reference's tokenization of the completion text must
give the same texts (or, for a sampled, non-canonical split, every text must be one token of
the vocabulary). Ids whose texts cannot be checked one by one (the server said ids only, or a
token is a piece of a character) must together spell the completion text. A reasoning answer
(a server's reasoning parser split it) or a tool call must be held by the tokens: the
reasoning, then the answer; the functions called, by name. A difference is a
:class:`TokenizationMismatch` (tokenizer or template drift), reported with its position and
never scored as noise.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, replace
from typing import Any, Sequence

from guard.protocol.generation import GenerationSample


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
    _longest: int = 0  # the longest text in _by_text, in characters

    def lookup(self, text: str) -> int | None:
        """The id whose text is ``text`` (built on first use: one decode per id); None for a
        text that names no one token (``comparable_text``: "" is the text of control tokens and
        of partial characters alike)."""
        if not comparable_text(text):
            return None
        return self._table().get(text)

    def pieces_beginning(self, text: str) -> list[int]:
        """The ids of the tokens whose text begins ``text`` (its prefixes that are one token
        each), shortest first: the tokens a server may have sampled where ``text`` is what it
        wrote from there on."""
        table = self._table()
        found = (table.get(text[:n]) for n in range(1, min(len(text), self._longest) + 1))
        return [token_id for token_id in found if token_id is not None]

    def _table(self) -> dict[str, int]:
        if self._by_text is None:
            table: dict[str, int] = {}
            for token_id in range(self.size):
                token_text = self.token_text(token_id)
                if comparable_text(token_text):
                    table.setdefault(token_text, token_id)
            self._longest = max(map(len, table), default=0)
            self._by_text = table
        return self._by_text


def align_completion(sample: GenerationSample, vocab: Vocabulary,
                     prompt_ids: Sequence[int] = ()
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

    ``prompt_ids``: the prompt as the reference scores it; where it ends inside a character (a
    client's token ids cut between a character's bytes), a server's text of the completion
    begins with that whole character (:func:`_misspelt`).
    """
    if sample.reasoning_text is not None or sample.tool_calls:
        return _align_parsed(sample, vocab)
    tokens = sample.tokens
    stopped = _stop_tokens(sample)
    if stopped:
        head, noncanonical, mismatch = align_completion(
            replace(sample, tokens=tokens[:len(tokens) - stopped]), vocab, prompt_ids)
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
        merged = _merged_pieces(sample, ids, vocab, prompt_ids)
        if merged is not None:
            return [], False, merged
        if any(not comparable_text(t.text) for t in tokens):
            # Texts that could not be checked one by one (ids without texts, pieces of a
            # character): the ids together must spell the completion the client received.
            return ids, False, _misspelt(sample, ids, vocab, prompt_ids)
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


def _merged_pieces(sample: GenerationSample, ids: Sequence[int], vocab: Vocabulary,
                   prompt_ids: Sequence[int] = ()) -> TokenizationMismatch | None:
    """llama-server writes a character the model sampled as several byte tokens as one
    logprobs entry once its bytes are whole: the character's text, the *last* piece's id and
    logprob, the earlier pieces left out (a Japanese chat of 6 tokens answered 3 entries, each
    id one byte: ``{"id": 119, "token": "ど", "bytes": [227, 129, 169]}``). The ids then miss
    tokens the model sampled, and scored as they stand a healthy pair's completion read as a
    mean KLD of 8 nats. Told by an entry whose text is a whole character while its id is a
    piece of one in the reference's vocabulary, and ids that do not spell the completion: not
    comparable (which tokens the left-out pieces were the answer does not say), never drift."""
    tokens = sample.tokens
    position = next((i for i, (token, token_id) in enumerate(zip(tokens, ids))
                     if comparable_text(token.text)
                     and not comparable_text(vocab.token_text(token_id))), None)
    if position is None or _misspelt(sample, ids, vocab, prompt_ids) is None:
        return None
    return TokenizationMismatch(
        position, tokens[position].text, vocab.token_text(ids[position]),
        f"token {position} ({tokens[position].text!r}) names the id of one piece of that "
        "character (a server that writes a character sampled as several tokens as one "
        "logprobs entry, as llama-server does, leaves the other pieces out): the answer does "
        "not say every token the model sampled", drift=False)


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


def _misspelt(sample: GenerationSample, ids: Sequence[int], vocab: Vocabulary,
              prompt_ids: Sequence[int] = ()) -> TokenizationMismatch | None:
    """None where the reference's detokenization of ``ids`` is the completion text (or the
    vocabulary cannot detokenize); else a mismatch at the first token where it departs."""
    text = vocab.detokenize(ids)
    if text is None or _spells(text, sample, whole=True) or \
            _ends_a_prompts_character(sample, ids, vocab, prompt_ids):
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


def _ends_a_prompts_character(sample: GenerationSample, ids: Sequence[int],
                              vocab: Vocabulary, prompt_ids: Sequence[int]) -> bool:
    """The completion text as vLLM writes it after a prompt that ends inside a character (a
    client's token ids cut between a character's bytes: found by the fuzzer). Its incremental
    detokenizer holds back the prompt's last tokens while their text is unfinished and writes
    them out with the completion: the text begins with the character the prompt began, and
    may carry the prompt's text before it (measured on vLLM 0.32: ``"prompt": [1064, 230,
    180, 227]``, "ality" and three bytes, answered "ality\ufffd鉛化只"). Whether ``ids``,
    after the prompt's last tokens (up to five, the window vLLM's detokenizer looks back),
    spell it so: from those tokens' first whole character, or with them whole."""
    if not prompt_ids:
        return False
    last = vocab.detokenize([int(prompt_ids[-1])])
    if last is None or not last.endswith("\ufffd"):  # the prompt ends on a whole character
        return False
    for count in range(1, min(5, len(prompt_ids)) + 1):
        tail = [int(i) for i in prompt_ids[-count:]]
        head = vocab.detokenize(tail) or ""
        text = vocab.detokenize(tail + [int(i) for i in ids])
        if text is not None and any(_spells(written, sample, whole=True) for written in (
                text, text[len(head.rstrip("\ufffd")):])):
            return True
    return False


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
