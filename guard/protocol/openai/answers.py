"""OpenAI-compatible answers as data: a whole answer or its streamed events gathered into a
:class:`Completion` (text, tokens and their logprobs and ids, reasoning, tool calls, the
outcome), whether it can be compared (:func:`unusable`), and the :class:`GenerationSample` a
call and its answer add up to (:func:`build_sample`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from guard.protocol.generation import GenerationSample, TokenLogprob, chat_template_args
from guard.protocol.openai.requests import (
    ParsedCall,
    responses_messages,
    sampling_params,
)
from guard.protocol.openai.json_edits import read_json
from guard.protocol.openai.sse import EventSplitter, event_data


DONE = b"[DONE]"
# The Responses API's stream has no [DONE]: it ends with one of these events, whose
# ``response`` is the whole answer.
RESPONSE_ENDS = ("response.completed", "response.incomplete")
RESPONSE_FAILS = ("response.failed", "error")



@dataclass
class Completion:
    """The primary's completion of one call, gathered from its answer or its chunks."""

    text: list[str] = field(default_factory=list)
    tokens: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    upstream_model: str = ""
    prompt_token_ids: tuple[int, ...] | None = None
    completion_tokens: int | None = None  # usage.completion_tokens, where the server said
    error: str = ""  # an error object in the answer or a chunk
    tool_calls: bool = False
    # The functions the answer calls (a server's tool parser took them out of the text), in
    # order: the output's tokens spell them.
    tool_names: list[str] = field(default_factory=list)
    # The answer holds reasoning its text leaves out (a chat's reasoning field, from a server's
    # reasoning parser; a Responses reasoning item).
    reasoning: bool = False
    # A chat's reasoning as the client received it (vLLM's ``reasoning``, earlier
    # ``reasoning_content``). The answer's tokens are the whole output, reasoning first: where
    # they are in the answer (logprobs, token ids), the completion is scored whole.
    reasoning_text: list[str] = field(default_factory=list)
    # usage's completion_tokens_details.reasoning_tokens (output_tokens_details in the
    # Responses API), where the server counted them: reasoning the model generated even where
    # the answer leaves it out (vLLM's include_reasoning false).
    reasoning_tokens: int = 0
    ended: bool = False  # a Responses API stream's terminal event came (it has no [DONE])


def _token_id(text: str, item: dict[str, Any] | None = None) -> int | None:
    """A token's id where the answer says it: vLLM's return_tokens_as_token_ids spells a token
    "token_id:123"; llama-server gives each logprobs entry an ``id`` (its last token at a
    natural end is the end-of-generation token, whose text is empty: only its id names it)."""
    if text.startswith("token_id:") and text[9:].isdigit():
        return int(text[9:])
    told = item.get("id") if item is not None else None
    return told if isinstance(told, int) and not isinstance(told, bool) and told >= 0 else None


def _top(items) -> tuple[tuple[str, float], ...]:
    """A token's alternatives, best first. Servers do not all list them so: vLLM's completions
    answer puts the chosen token first whatever its rank (a sampled " France" at -2.44 before
    " the" at -2.18), which read as the primary's top-1 would count a disagreement the model
    never had. Sorted by logprob (stable: ties keep the server's order)."""
    pairs: Iterable[tuple[Any, Any]]
    if isinstance(items, dict):  # completions: {token: logprob}
        pairs = items.items()
    else:  # chat: [{token, logprob}]
        pairs = ((t.get("token"), t.get("logprob")) for t in items or () if isinstance(t, dict))
    found = [(str(t), float(lp)) for t, lp in pairs
             if isinstance(lp, (int, float)) and not isinstance(lp, bool)]
    return tuple(sorted(found, key=lambda pair: -pair[1]))


def _logprob_tokens(endpoint: str, logprobs: Any) -> list[TokenLogprob]:
    if not isinstance(logprobs, dict):
        return []
    out = []
    if endpoint == "chat" or "content" in logprobs:
        for item in logprobs.get("content") or ():
            if isinstance(item, dict) and isinstance(item.get("token"), str):
                lp = item.get("logprob")
                out.append(TokenLogprob(item["token"], float(lp) if isinstance(
                    lp, (int, float)) else None, _top(item.get("top_logprobs")),
                    _token_id(item["token"], item)))
        return out
    tokens = logprobs.get("tokens") or ()
    values = logprobs.get("token_logprobs") or ()
    tops = logprobs.get("top_logprobs") or ()
    for i, token in enumerate(tokens):
        if not isinstance(token, str):
            continue
        lp = values[i] if i < len(values) else None
        out.append(TokenLogprob(token, float(lp) if isinstance(lp, (int, float)) else None,
                                _top(tops[i]) if i < len(tops) and tops[i] else (),
                                _token_id(token)))
    return out


def _gather_head(completion: Completion, answer: dict[str, Any], tokens_key: str,
                 failed: bool = False) -> bool:
    """What every answer shape says at its top: an error (False: the answer is one; ``failed``
    a status that says so without an error object), the model the upstream served, and the
    completion's token count (``usage[tokens_key]``)."""
    error = answer.get("error")
    if error is not None or failed:
        completion.error = (str(error.get("message") if isinstance(error, dict) else error)
                            if error is not None else "the response failed")
        return False
    if isinstance(answer.get("model"), str):
        completion.upstream_model = answer["model"]
    usage = answer.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get(tokens_key), int):
        completion.completion_tokens = usage[tokens_key]
    details = usage.get(tokens_key + "_details") if isinstance(usage, dict) else None
    if isinstance(details, dict) and isinstance(details.get("reasoning_tokens"), int):
        completion.reasoning_tokens = details["reasoning_tokens"]
    return True


def _function_names(calls: Any) -> list[str]:
    """The functions a chat answer's ``tool_calls`` name, in order (a stream names each call
    in its first delta only)."""
    functions = (c.get("function") for c in calls if isinstance(c, dict)) \
        if isinstance(calls, list) else ()
    return [f["name"] for f in functions
            if isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"]]


def _gather_response(completion: Completion, response: Any) -> None:
    """A whole Responses API answer (a ``response`` object): its message items' output text
    and logprobs; a reasoning item or a tool call marked."""
    if not isinstance(response, dict) or not _gather_head(
            completion, response, "output_tokens", failed=response.get("status") == "failed"):
        return
    for item in response.get("output") or ():
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "message":
            for part in item.get("content") or ():
                if isinstance(part, dict) and part.get("type") == "output_text" and \
                        isinstance(part.get("text"), str):
                    completion.text.append(part["text"])
                    completion.tokens.extend(
                        _logprob_tokens("chat", {"content": part.get("logprobs") or []}))
        elif kind == "reasoning":
            completion.reasoning = True
        elif kind is not None:  # a function call, a web search ...
            completion.tool_calls = True
    status = response.get("status")
    details = response.get("incomplete_details")
    completion.finish_reason = "stop" if status == "completed" else "length" if (
        isinstance(details, dict) and details.get("reason") == "max_output_tokens") else None


def _first_choice(choices: Any) -> dict[str, Any]:
    """The choice a sample is made of: index 0. A call with n > 1 or a batch of prompts is
    answered with several choices (streamed interleaved, a chunk per choice); each is a
    completion of its own, and the first is compared. {} for a chunk of another choice."""
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return {}


def gather(completion: Completion, endpoint: str, answer: Any, streamed: bool) -> None:
    """Add one answer (non-streamed) or one chunk (streamed) to ``completion``; a Responses
    API answer is its ``response`` object, whole."""
    if not isinstance(answer, dict):
        return
    if endpoint == "responses":
        _gather_response(completion, answer)
        return
    if not _gather_head(completion, answer, "completion_tokens"):
        return
    choice = _first_choice(answer.get("choices"))
    ids = choice.get("prompt_token_ids", answer.get("prompt_token_ids"))
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        completion.prompt_token_ids = tuple(ids)
    if endpoint == "chat":
        part = choice.get("delta" if streamed else "message") or {}
        content = part.get("content") if isinstance(part, dict) else None
        if isinstance(part, dict) and part.get("tool_calls"):
            completion.tool_calls = True
            completion.tool_names.extend(_function_names(part["tool_calls"]))
        reasoning = part.get("reasoning") or part.get("reasoning_content") \
            if isinstance(part, dict) else None
        if isinstance(reasoning, str) and reasoning:
            completion.reasoning = True
            completion.reasoning_text.append(reasoning)
    else:
        content = choice.get("text")
    if isinstance(content, str):
        completion.text.append(content)
    tokens = _logprob_tokens(endpoint, choice.get("logprobs"))
    token_ids = choice.get("token_ids")
    if isinstance(token_ids, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                           for i in token_ids):
        if len(token_ids) == len(tokens):
            tokens = [TokenLogprob(t.text, t.logprob, t.top, i)
                      for t, i in zip(tokens, token_ids)]
        elif not tokens and not choice.get("logprobs"):
            # Ids without logprobs (return_token_ids alone): a token's own text is not in the
            # answer (a chunk's text is the detokenizer's, which may hold a character back),
            # so it is left unsaid; the reference checks that the ids spell the completion.
            tokens = [TokenLogprob("", token_id=i) for i in token_ids]
    completion.tokens.extend(tokens)
    if choice.get("finish_reason") is not None:
        completion.finish_reason = str(choice["finish_reason"])


# A streamed chunk's completion text, found in its bytes without parsing it: a non-empty string
# value of the choice's "text" (completions) or "content" (chat's delta) key, or of the chat
# delta's reasoning (a reasoning parser's split: its tokens are generated tokens too, and time
# to first token is the first of them, as the server's own metric counts it). The key's value
# in a chat chunk's logprobs ("content": [...]) is a list, the role announcement's is "" or
# null, and a finish- or usage-only chunk has neither: none of them match.
_TEXT_VALUE = {"completions": re.compile(rb'"text"\s*:\s*"[^"]'),
               "chat": re.compile(rb'"(?:content|reasoning|reasoning_content)"\s*:\s*"[^"]')}
# A Responses API event that carries text: an output_text.delta or a reasoning_text.delta (not
# a tool call's arguments delta, whose type differs) whose delta is not empty.
_OUTPUT_TEXT_DELTA = re.compile(
    rb'"type"\s*:\s*"response\.(?:output_text|reasoning_text)\.delta"')
_DELTA_VALUE = re.compile(rb'"delta"\s*:\s*"[^"]')


def data_has_content(data: bytes, endpoint: str) -> bool:
    """Whether a streamed chunk's JSON ``data`` carries completion text (a token, for TTFT and
    the gaps), read from its bytes: what :func:`chunk_has_content` says of the parsed chunk
    for every chunk an OpenAI-compatible server sends, at a regex search's cost instead of a
    parse's (the edge's unsampled calls parse no event)."""
    if endpoint == "responses":
        return _OUTPUT_TEXT_DELTA.search(data) is not None and \
            _DELTA_VALUE.search(data) is not None
    return _TEXT_VALUE[endpoint].search(data) is not None


_OUTCOME_KEY = re.compile(rb'"(?:error|usage)"\s*:\s*[{"]')


_RESPONSE_END = re.compile(rb'"type"\s*:\s*"(?:response\.(?:completed|incomplete|failed)|error)"')


def data_needs_parse(data: bytes, endpoint: str = "chat") -> bool:
    """Whether an unsampled call's chunk may hold what the edge reads from every call: an error
    (the call's outcome) or ``usage`` (its token count), as an object or a string; a
    ``"usage": null`` that some servers put in every chunk does not count. A Responses API
    stream's terminal event is read too (its stream has no [DONE])."""
    return _OUTCOME_KEY.search(data) is not None or (
        endpoint == "responses" and _RESPONSE_END.search(data) is not None)


def unusable(completion: Completion, call: ParsedCall | None = None,
             prompt_ids_asked: bool = False, probed_if_streamed: bool = False) -> str:
    """Why a completion that was answered to ``call`` (None: a call that asked nothing
    special) cannot be compared, as the not-comparable reason ("" when it can): an error,
    tools it cannot hold, reasoning the sample cannot hold, a prompt the server may have cut
    (:attr:`ParsedCall.prompt_truncation`) without saying what it kept (its prompt token ids):
    ``input``.

    A chat that offers tools (:attr:`ParsedCall.offers_tools`) is compared where the answer
    says the prompt's token ids (the server renders the tool definitions and a conversation's
    earlier calls into the prompt, each engine in its own way: the server's ids are the prompt,
    not the reference's rendering) and the output's token ids (a tool parser takes the call out
    of the text; the ids are the call as the model generated it, which the reference checks
    names each function called): vLLM with ``sample_token_ids``. ``prompt_ids_asked``: the
    prompt's ids are asked of the server after the answer (llama-server,
    ``OpenAIOptions.asks_prompt_ids``), so the output's ids suffice here (llama-server's
    logprobs entries carry them). ``probed_if_streamed``: a streamed chat that lists tools,
    whose answer cannot say them (llama-server gives no logprobs there), is probed by the
    verifier instead (``OpenAIOptions.probes_streamed_tool_chats``). Anything else with tools,
    or a tool call without them, is not comparable (``tools``).

    Reasoning a chat's answer gives apart from its text (a reasoning parser's split) is
    compared where the answer has the output's tokens (logprobs or token ids: servers report
    every generated token, the reasoning's too), which the reference scores whole; the
    reference checks that they spell the reasoning and then the answer
    (guard/backends/scoring.py). Without tokens, or as a Responses reasoning item (whose
    logprobs cover the message text alone), it is not comparable; so is an answer whose
    usage counts reasoning tokens it does not give (hidden: the completion would be scored
    as if the answer had come first)."""
    if completion.error:
        return "upstream_error"
    if call is not None:
        if call.echo and not _echoed(completion):
            return "echo"
        if call.prompt_truncation is not None and completion.prompt_token_ids is None:
            return "input"
    if (call is not None and call.offers_tools) or completion.tool_calls:
        by_ids = (prompt_ids_asked or completion.prompt_token_ids is not None) and \
            bool(completion.tokens) and all(t.token_id is not None for t in completion.tokens)
        named = completion.tool_names or not completion.tool_calls
        probed = probed_if_streamed and call is not None and call.stream and call.defines_tools
        if not (by_ids and named) and not probed:
            return "tools"
    if completion.reasoning or completion.reasoning_tokens > 0:
        if not (completion.reasoning_text and completion.tokens):
            return "reasoning"
    return ""


def _echoed(completion: Completion) -> bool:
    """An echo answer whose tokens are the prompt's and the generated ones, as vLLM gives
    them: the first without a logprob (nothing predicts it), every other with one, and their
    texts spelling the answer's text (the first's included, or not where it is a special token
    the tokenizer added, a BOS: the answer's text is the prompt as sent). llama-cpp-python's
    (0.3.36) is not: its tokens stop at the prompt and their logprobs sit a position off
    (upstream issue 1983)."""
    tokens = completion.tokens
    if len(tokens) < 2 or tokens[0].logprob is not None or \
            any(t.logprob is None for t in tokens[1:]):
        return False
    text, rest = "".join(completion.text), "".join(t.text for t in tokens[1:])
    return text in (rest, tokens[0].text + rest)


def gather_event(completion: Completion, endpoint: str, data: bytes, whole: bool = True) -> None:
    """Add one streamed event's JSON ``data`` to ``completion``: all of it (``whole``), or only
    what every call is counted by (an error, the usage). Data that is not a JSON object is
    left out (a server's keep-alive or a proprietary event)."""
    try:
        answer = read_json(data)
    except ValueError:
        return
    if not isinstance(answer, dict):
        return
    if endpoint == "responses":
        _gather_response_event(completion, answer, whole)
    elif whole or answer.get("error") is not None:
        gather(completion, endpoint, answer, streamed=True)
    elif isinstance(answer.get("usage"), dict):
        gather(completion, endpoint, {"usage": answer["usage"]}, streamed=True)


def _gather_response_event(completion: Completion, event: dict[str, Any], whole: bool) -> None:
    """One Responses API event: the terminal one carries the whole answer (the deltas before
    it say nothing it does not); a failure event is the call's error."""
    kind = event.get("type")
    if kind in RESPONSE_ENDS:
        completion.ended = True
        response = event.get("response")
        if whole:
            _gather_response(completion, response)
        elif isinstance(response, dict) and isinstance(response.get("usage"), dict):
            _gather_response(completion, {"usage": response["usage"]})
    elif kind in RESPONSE_FAILS:
        completion.ended = True
        response = event.get("response")
        error = event if kind == "error" else (response.get("error") if isinstance(
            response, dict) else None)
        if isinstance(error, dict):
            completion.error = str(error.get("message") or kind)
        else:
            completion.error = str(kind)


CUT_SHORT = "the stream ended before [DONE]"  # gather_answer's error for a stream cut short


def gather_answer(endpoint: str, body: bytes, streamed: bool) -> Completion:
    """The completion of a whole answer as it came: its JSON, or (``streamed``) its
    Server-Sent Events, every event's data gathered in order. ``completion.error`` says why
    an answer cannot be compared: not JSON, an error object, or a stream that ended before
    ``[DONE]`` (cut short)."""
    completion = Completion()
    if not streamed:
        try:
            gather(completion, endpoint, read_json(body), streamed=False)
        except ValueError:
            completion.error = "the answer is not JSON"
        return completion
    splitter, done = EventSplitter(), False
    for event in (*splitter.feed(body), splitter.rest()):
        data = event_data(event) if event else None
        if data is None:
            continue
        if data == DONE:
            done = True
            continue
        gather_event(completion, endpoint, data)
    if not (done or completion.ended) and not completion.error:
        completion.error = CUT_SHORT
    return completion


def chunk_has_content(answer: Any, endpoint: str) -> bool:
    """A streamed chunk that carries completion text, or reasoning (a token, for TTFT and the
    gaps): not the chat role announcement, not a usage-only or finish-only chunk."""
    if not isinstance(answer, dict):
        return False
    if endpoint == "responses":
        return answer.get("type") in ("response.output_text.delta",
                                      "response.reasoning_text.delta") and \
            bool(answer.get("delta"))
    choices = answer.get("choices") or ()
    if not choices or not isinstance(choices[0], dict):
        return False
    if endpoint == "chat":
        delta = choices[0].get("delta")
        return isinstance(delta, dict) and any(
            isinstance(delta.get(key), str) and delta[key]
            for key in ("content", "reasoning", "reasoning_content"))
    return bool(choices[0].get("text"))


def build_sample(call: ParsedCall, completion: Completion, **envelope) -> GenerationSample:
    """The sample of one call: the request as the client sent it and the primary's
    completion. ``envelope``: route, request_id, streamed, unix_nanos, request_seconds,
    first_token_seconds, ``guard_logprobs`` (guard asked for them: the client did not)."""
    guard_logprobs = envelope.pop("guard_logprobs", False)
    sampling = sampling_params(call.body, call.endpoint)
    if guard_logprobs:  # the transform the client asked for: without guard's logprobs
        from dataclasses import replace

        sampling = replace(sampling, logprobs=None)
    body = call.body
    # A chat's messages as the client sent them, content parts kept: each engine joins them
    # its own way (a probe and llama-server's /apply-template are sent them as they came; the
    # reference joins them as the engine does, guard/backends/scoring.py template_messages,
    # guard.protocol.generation rendered_as_served). parse_request checked them already.
    messages = (tuple(body["messages"]) if call.endpoint == "chat" else
                responses_messages(body) if call.endpoint == "responses" else None)
    prompt, prompt_ids = call.prompt, completion.prompt_token_ids
    if isinstance(prompt, tuple):  # the client's token ids: the prompt as the server read it
        if call.prompt_truncation is None:  # (else the server's, which it may have cut)
            prompt_ids = prompt_ids or prompt
        prompt = None
    tokens = tuple(completion.tokens)
    text = "".join(completion.text)
    if call.echo:  # scored from the prompt's first token on (unusable: _echoed)
        tokens = tokens[1:]
        text = "".join(t.text for t in tokens)
    return GenerationSample(
        model=call.model, endpoint="completions" if call.endpoint == "completions" else "chat",
        completion_text=text, tokens=tokens, echo=call.echo,
        sampling=sampling, prompt=prompt,
        messages=messages, prompt_token_ids=prompt_ids,
        finish_reason=completion.finish_reason, upstream_model=completion.upstream_model,
        chat_template_args=chat_template_args(body) if call.endpoint == "chat" else None,
        reasoning_text="".join(completion.reasoning_text) if completion.reasoning_text
        else None, tools=call.offers_tools, tool_calls=tuple(completion.tool_names),
        tool_request=call.tool_request,
        prompt_truncation=call.prompt_truncation, add_special_tokens=call.add_special_tokens,
        **envelope)
