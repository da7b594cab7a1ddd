"""OpenAI-compatible requests as data: which calls guard checks (:data:`PATHS`), a client's
body parsed into a :class:`ParsedCall` (the model, whether it streams, why it cannot be
compared), the sampling transform it names, and the body of a sampled call with what the
comparison needs added (:func:`sampled_body`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Collection, Literal

from guard.protocol.generation import SamplingParams
from guard.protocol.openai.json_edits import read_json


# The checked endpoints: a call's kind by its path. A Responses API call (``/v1/responses``) is
# checked as the chat it renders: its instructions and input items are chat messages to the
# model's template (vLLM builds them so), its output text the completion.
Call = Literal["completions", "chat", "responses"]
PATHS: dict[str, Call] = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
                          "/v1/responses": "responses"}


class BadRequest(ValueError):
    """A request the edge cannot forward as an OpenAI call (HTTP 400); the message says why,
    ``param`` names the field at fault where one is (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def lists_tools(endpoint: Call, body: dict[str, Any]) -> bool:
    """A chat whose body lists tool definitions (``tools``, the older ``functions``), not only
    earlier tool turns: what llama-server refuses logprobs on when streamed."""
    return endpoint == "chat" and bool(body.get("tools") or body.get("functions"))


@dataclass(frozen=True)
class CallShape:
    """The shape of a call, as servers tell their refusals apart: a server may take guard's
    logprobs or token ids on one shape and refuse them on another (llama-server refuses
    logprobs on a streamed chat that lists tools alone), so what an upstream refused is
    remembered per shape (guard/serve/openai_edge.py)."""

    endpoint: Call
    streamed: bool
    tools: bool  # a chat that lists tool definitions (lists_tools)

    def describe(self) -> str:
        """``chat, streamed, with tools``: the shape as the event ``openai_additions_refused``
        names it."""
        return ", ".join((self.endpoint, "streamed" if self.streamed else "whole",
                          "with tools" if self.tools else "no tools"))


@dataclass
class ParsedCall:
    """What the edge needs from a client's request body (the body itself is forwarded)."""

    endpoint: Call
    body: dict[str, Any]
    model: str
    stream: bool
    # Why this call cannot be compared with a reference ("" when it can): best_of > 1 (the
    # best of several), echo (the prompt comes back as part of the text), tools on an endpoint
    # that cannot say its tokens, a batch of prompts with no first prompt (parse_request).
    not_comparable: str = ""
    # A completions call's prompt (first_prompt: its text, or its token ids; a batch's first,
    # that of choice 0), read once.
    prompt: str | tuple[int, ...] | None = None

    @property
    def offers_tools(self) -> bool:
        """A chat that offers the model tools, or carries earlier tool turns (an assistant
        message's ``tool_calls``, a ``tool`` or ``function`` message): comparable only where
        the answer says the prompt's token ids (the server's rendering of the tools and of
        those turns, each engine's own: a llama-server with a Hermes template writes a tool's
        result as a user turn, vLLM parses a call's arguments into an object for the template)
        and the output's tokens (:func:`unusable`)."""
        return self.endpoint == "chat" and _offers_tools(self.body)

    @property
    def defines_tools(self) -> bool:
        """A chat whose body lists tool definitions (:func:`lists_tools`)."""
        return lists_tools(self.endpoint, self.body)

    @property
    def shape(self) -> CallShape:
        return CallShape(self.endpoint, self.stream, self.defines_tools)

    @property
    def several_completions(self) -> bool:
        """The answer holds several completions (n > 1, a batch of prompts): a stream
        interleaves their tokens, so the gaps between its events are no one completion's."""
        n, prompt = self.body.get("n", 1), self.body.get("prompt")
        return (isinstance(n, int) and not isinstance(n, bool) and n > 1) or (
            self.endpoint == "completions" and isinstance(prompt, list) and len(prompt) > 1
            and not _token_ids(prompt))

    @property
    def prompt_truncation(self) -> int | None:
        """vLLM's ``truncate_prompt_tokens`` where the client gave it: the server may keep only
        that many of the prompt's tokens, so the call is compared only where the answer says
        the prompt's token ids (:func:`unusable`)."""
        value = self.body.get("truncate_prompt_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def echo(self) -> bool:
        """A completions call that asks for its prompt back with the logprobs of its tokens
        (lm-eval's loglikelihood shape): compared on the prompt's tokens after the first and
        the generated ones (:func:`unusable`, :func:`build_sample`)."""
        return self.endpoint == "completions" and self.body.get("echo") not in (None, False)

    @property
    def add_special_tokens(self) -> bool | None:
        """vLLM's ``add_special_tokens`` where the client gave it (None: the endpoint's
        default, True for completions and False for chat). A completions prompt asked without
        them has no BOS: the reference renders it so (guard/backends/scoring.py)."""
        value = self.body.get("add_special_tokens")
        return value if isinstance(value, bool) else None

    @property
    def tool_request(self) -> dict[str, Any] | None:
        """A chat's tool fields as the client sent them (None where it offers no tools): what
        a fallback's probe asks the primary again, so that the server renders the same
        prompt."""
        if not self.offers_tools:
            return None
        return {name: self.body[name] for name in TOOL_FIELDS if name in self.body}

    @property
    def asked_logprobs(self) -> bool:
        """The client asked for the primary's logprobs itself (:func:`_asks_logprobs`)."""
        return _asks_logprobs(self.endpoint, self.body)

    @property
    def asked_token_ids(self) -> bool:
        """The client asked for the token ids itself (vLLM's ``return_token_ids``)."""
        return self.body.get("return_token_ids") not in (None, False)


def _body_and_model(data: bytes) -> tuple[dict[str, Any], str]:
    """A request body as a JSON object and the model it names ("" for none: no ``model``, a
    null or an empty one); BadRequest otherwise."""
    # A leading byte order mark is read past (RFC 8259 8.1: a parser MAY ignore it), as
    # llama-server and Envoy's json_to_metadata read past it: the call goes on as the client
    # sent it, the upstream's to answer (refused here before, a call lost that llama-server
    # answers; found by benchmarks/reliability_llm.py in Envoy mode, which forwarded it).
    # UTF-8 only (RFC 8259 8.1), as the servers behind guard read it: json.loads would also
    # take UTF-16 and UTF-32, which guard cannot re-address byte for byte (json_edits).
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the body is not JSON in UTF-8: {exc}") from None
    try:
        body = read_json(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    except ValueError as exc:  # nesting deeper than the stack, an integer past int()'s digits
        raise BadRequest(f"the body is JSON guard cannot read: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if text.count('"model"') > 1 and _names_model_twice(text):
        # guard routes by one and re-addresses one; a server may read the other.
        raise BadRequest("the body names 'model' more than once", param="model")
    model = body.get("model")
    if model is None:
        return body, ""
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    return body, model


def _names_model_twice(text: str) -> bool:
    """The top-level object has two ``model`` members (RFC 8259: names SHOULD be unique;
    which one a reader takes is its own choice). Read again with every object's members
    kept in order: the outermost object is the last one decoded."""
    objects: list[list] = []

    def keep(members: list) -> dict:
        objects.append(members)
        return {}

    json.loads(text, object_pairs_hook=keep)
    return bool(objects) and [name for name, _ in objects[-1]].count("model") > 1


def model_of(data: bytes) -> str:
    """The model a call to an endpoint guard forwards unchecked (embeddings, /v1/messages,
    vLLM's ``/tokenize`` ...) names: what routes it ("" for none, see :func:`served_model`).
    BadRequest for a body that is not a JSON object."""
    return _body_and_model(data)[1]


def served_model(named: str, served: Collection[str]) -> str | None:
    """The model a call is for: the one it names; where it names none, the one generation
    model guard serves, as vLLM (its first served name) and llama.cpp's servers (their one
    model) answer a body without ``model``: a client written against them sends none, and a
    guard put in front must not turn its calls into 400s. None where it names none and guard
    serves several (the edge's 400 lists them)."""
    if named:
        return named
    return next(iter(served)) if len(served) == 1 else None


def parse_request(endpoint: Call, data: bytes) -> ParsedCall:
    """The client's body as a call; BadRequest for what guard cannot route (a body that is
    not a JSON object, a ``model`` that is not a string).

    Anything else is the upstream's to answer: a body without the field the endpoint reads
    (``messages``, ``prompt``, ``input``), or with it in a shape guard does not read (an empty
    ``messages``, which llama-server answers), or a ``stream`` that is not a boolean (vLLM's
    lax parsing reads ``"true"`` and 1 as true, llama-server reads them as false) is
    forwarded and its answer comes back as the server gave it, counted not comparable
    (``input``): guard refusing a call its server answers loses the call. ``stream`` null is
    false (OpenAI's API allows it)."""
    body, model = _body_and_model(data)
    stream = body.get("stream")
    prompt = first_prompt(body.get("prompt")) if endpoint == "completions" else None
    n, best_of = body.get("n", 1), body.get("best_of", 1)
    reason = _unreadable(endpoint, body)
    if reason:
        return ParsedCall(endpoint, body, model, stream is True, reason, prompt)
    stream = bool(stream)
    # Several completions (n > 1, a batch of prompts) are each sampled on their own path: the
    # first (choice 0) is compared. The best of several (best_of) is chosen by its score, no
    # sample of the model's distribution.
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or (
            best_of is not None and best_of != 1):
        reason = "n"
    elif body.get("echo") not in (None, False) and not (
            endpoint == "completions" and not stream and _asks_logprobs(endpoint, body)):
        # The answer's text begins with the prompt (or a chat's last message). A whole
        # completions answer with logprobs (lm-eval's loglikelihood calls) is compared on the
        # prompt's tokens and what follows them (ParsedCall.echo); a stream, or an echo
        # without logprobs, is not.
        reason = "echo"
    elif endpoint != "chat" and _offers_tools(body):
        reason = "tools"  # (a chat's tools are decided by its answer: ParsedCall.offers_tools)
    elif endpoint == "completions" and prompt is None:
        reason = "prompt_list"  # an empty or malformed batch: no first prompt
    elif endpoint == "completions" and body.get("suffix") is not None:
        # Fill-in-the-middle: llama-cpp-python wraps the prompt and the suffix in the model's
        # FIM tokens (for any suffix, "" too) and the completion is the middle; the reference
        # would score it after the prompt alone (vLLM refuses a suffix: an error answer).
        reason = "input"
    elif endpoint == "responses":
        reason = _responses_not_comparable(body)
    elif endpoint == "chat" and body.get("include_reasoning") is False:
        # vLLM leaves the reasoning out of the answer, and its logprobs and token ids with it:
        # the answer alone would be scored as if the model had begun with it.
        reason = "reasoning"
    elif endpoint == "chat":
        try:
            chat_messages(body["messages"])
        except ValueError:
            reason = "input"  # an image, audio or file part: the reference reads text
    return ParsedCall(endpoint, body, model, stream, reason, prompt)


def _unreadable(endpoint: Call, body: dict[str, Any]) -> str:
    """"input" where the body lacks what guard reads of a call to ``endpoint`` or has it in a
    shape guard does not read; "" otherwise."""
    if endpoint == "chat":
        readable = isinstance(body.get("messages"), list) and bool(body["messages"])
    elif endpoint == "responses":
        readable = isinstance(body.get("input"), (str, list)) and bool(body["input"])
    else:
        readable = "prompt" in body
    return "" if readable and isinstance(body.get("stream"), (bool, type(None))) else "input"


# A chat request's fields that offer the model tools, as OpenAI's API and vLLM name them.
TOOL_FIELDS = ("tools", "functions", "tool_choice", "parallel_tool_calls")


def _asks_logprobs(endpoint: Call, body: dict[str, Any]) -> bool:
    """Whether the client asked for the primary's logprobs itself, in any form a server reads:
    then guard neither adds its own nor strips the answer's. A completions call's
    ``logprobs: 0`` asks for the chosen tokens' logprobs without alternatives (servers answer
    them); a chat's ``top_logprobs`` without ``logprobs: true`` is the client's too (a server
    refuses it: guard's own ask would turn the refusal into an answer)."""
    if endpoint == "responses":
        return _responses_logprobs(body)
    value = body.get("logprobs")
    if endpoint == "completions":
        return value is not None and value is not False
    return value not in (None, False, 0) or body.get("top_logprobs") is not None


def _offers_tools(body: dict[str, Any]) -> bool:
    if bool(body.get("tools") or body.get("functions")) or body.get("tool_choice") not in (
            None, "none"):
        return True
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("tool_calls") is not None or m.get("function_call")
                                 is not None or m.get("role") in ("tool", "function"))
        for m in messages)


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)


def first_prompt(prompt: Any) -> str | tuple[int, ...] | None:
    """The prompt of a completions call's first completion (choice 0): its text, or its token
    ids (the prompt exactly as the server evaluates it: no BOS added, no template). A batch
    (``["text", ...]``, ``[[ids], ...]``: LangChain's completions client sends even one prompt
    so, lm-eval's several) is answered one choice per prompt, in order: its first. None for
    what is not a prompt (an empty batch, a batch of mixed or malformed items)."""
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(_token_ids(p) for p in prompt)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    return tuple(prompt) if _token_ids(prompt) else None


def chat_messages(messages: list[Any]) -> tuple[dict[str, Any], ...]:
    """A chat's messages as the reference renders them: a content given as text parts is one
    string, the parts joined by newlines, empty ones left out (as vLLM joins them for a
    template that reads strings, which text models' templates do); ValueError for a part that
    is not text."""
    rendered = []
    for message in messages:
        if not isinstance(message, dict):
            raise ValueError("messages: an item that is not an object")
        if isinstance(message.get("content"), list):
            message = {**message, "content": _text_of(message["content"])}
        rendered.append(message)
    return tuple(rendered)


def _responses_not_comparable(body: dict[str, Any]) -> str:
    """Why a Responses API call cannot be compared ("" when it can): a conversation the server
    keeps (``previous_response_id``, ``conversation``: the prompt is not all in the request),
    a background call (answered later, elsewhere), input guard cannot render as chat messages
    (images, files, earlier tool calls)."""
    if body.get("previous_response_id") or body.get("conversation") or \
            body.get("background") is True:
        return "stateful"
    try:
        responses_messages(body)
    except ValueError:
        return "input"
    return ""


def _text_of(content: Any) -> str:
    """A message's content as its text: a string, or its text parts joined by newlines, an
    empty part left out (as vLLM joins them for a template that reads strings: ``["", "x"]``
    is ``"x"``, found by benchmarks/reliability_llm.py --server vllm, where a newline before
    "x" read as template drift); ValueError for another part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("content: expected a string or a list of parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text",
                                                                   "text") \
                or not isinstance(part.get("text"), str):
            raise ValueError("content: a part that is not text")
        if part["text"]:
            texts.append(part["text"])
    return "\n".join(texts)


def responses_messages(body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """The chat messages a Responses API call renders: ``instructions`` as a system message
    first, then ``input`` (a string: one user message; a list: its message items, content
    parts as text), as vLLM builds them (its ``input_tokens`` count agrees: checked against a
    real vLLM). ValueError for input that is not text messages."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        return (*messages, {"role": "user", "content": given})
    for item in given if isinstance(given, list) else ():
        if not isinstance(item, dict) or item.get("type", "message") != "message" or \
                item.get("role") not in ("user", "assistant", "system", "developer"):
            raise ValueError("input: an item that is not a message")
        messages.append({"role": item["role"], "content": _text_of(item.get("content"))})
    if not messages or messages[-1]["role"] == "system":
        raise ValueError("input: no message to answer")
    return tuple(messages)


def _responses_logprobs(body: dict[str, Any]) -> bool:
    include = body.get("include")
    return isinstance(include, list) and "message.output_text.logprobs" in include


def _number(value: Any, kind=float):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return kind(value) if kind is float or float(value).is_integer() else None


def _positive(value: Any) -> bool:
    return _number(value) is not None and value > 0


def _given(value: Any) -> bool:
    return value is not None and value is not False and value != "" and value != {} \
        and value != []


# Request fields that restrict or bias which tokens the server may choose, and whether a value
# does: a grammar, a JSON schema or object, a regex, a choice list, a logit bias, an allow- or
# deny-list of tokens, a minimum length (which masks the end of text until it is reached). The
# server picks from a masked or shifted distribution the reference cannot rebuild, so the
# checks that read the sampling transform (sampled, greedy) cannot judge such a call; a
# server's logprobs are of the model's own distribution (vLLM's default raw_logprobs,
# llama.cpp's), so the per-token comparison still holds. Spellings: OpenAI's, vLLM's
# (guided_*, structured_outputs, structural_tag, allowed_token_ids, bad_words, min_tokens),
# llama.cpp's server and llama-cpp-python's (grammar, json_schema).
CONSTRAINT_FIELDS: dict[str, Callable[[Any], bool]] = {
    "response_format": lambda v: isinstance(v, dict) and v.get("type") not in (None, "text"),
    "logit_bias": _given, "grammar": _given, "json_schema": _given,
    "guided_json": _given, "guided_regex": _given, "guided_choice": _given,
    "guided_grammar": _given, "structural_tag": _given,
    "structured_outputs": lambda v: isinstance(v, dict) and any(
        _given(x) for k, x in v.items() if k not in ("backend", "disable_any_whitespace",
                                                     "disable_fallback",
                                                     "disable_additional_properties",
                                                     "whitespace_pattern")),
    "allowed_token_ids": _given, "bad_words": _given, "min_tokens": _positive,
    # llama.cpp's server masks the end-of-generation tokens with a logit bias (vLLM samples
    # on past EOS, masking nothing: ServerDefaults.distribution_fields tells them apart).
    "ignore_eos": lambda v: v is True,
    # The Responses API's structured output: text.format json_schema or json_object.
    "text": lambda v: isinstance(v, dict) and isinstance(v.get("format"), dict)
    and v["format"].get("type") not in (None, "text"),
}
# Samplers guard's transform does not model (guard/verify/generation/ applies temperature,
# top_k, top_p, min_p and the penalties), each with the test for a value that turns it on:
# llama.cpp's locally typical sampling, mirostat, tail-free sampling (llama-cpp-python), XTC,
# DRY, top-n-sigma, dynamic temperature, adaptive-p (negative: off), a sampler chain in another
# order (llama-server's ``samplers``); vLLM's beam search.
SAMPLER_FIELDS: dict[str, Callable[[Any], bool]] = {
    "typical_p": lambda v: _number(v) is not None and v < 1,
    "mirostat": _positive, "mirostat_mode": _positive,
    "tfs_z": lambda v: _number(v) is not None and v < 1,
    "xtc_probability": _positive, "dry_multiplier": _positive, "top_n_sigma": _positive,
    "dynatemp_range": _positive, "use_beam_search": lambda v: v is True,
    "adaptive_target": lambda v: _number(v) is not None and v >= 0, "samplers": _given,
}


def _fields_on(body: dict[str, Any], tests: dict[str, Callable[[Any], bool]]
               ) -> tuple[str, ...]:
    return tuple(name for name, on in tests.items() if name in body and on(body[name]))


def sampling_params(body: dict[str, Any], endpoint: Call = "chat") -> SamplingParams:
    """The sampling transform the request names (None where it says nothing: the server's
    declared default applies)."""
    logprobs = body.get("logprobs")
    if endpoint == "responses":  # include: [message.output_text.logprobs], top_logprobs: k
        logprobs = (body.get("top_logprobs") or 0) if _responses_logprobs(body) else None
    elif body.get("top_logprobs") is not None:  # chat: logprobs: true, top_logprobs: k
        logprobs = body.get("top_logprobs") if logprobs not in (None, False) else None
    elif logprobs is True:
        logprobs = 0
    stop = body.get("stop")
    # (a stop of another type, e.g. a number, is the server's to refuse or ignore: none here)
    stops = (stop,) if isinstance(stop, str) else tuple(
        s for s in stop if isinstance(s, str)) if isinstance(stop, list) else ()
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens",
                                                 body.get("max_output_tokens")))
    return SamplingParams(
        temperature=_number(body.get("temperature")), top_p=_number(body.get("top_p")),
        top_k=_number(body.get("top_k"), int), min_p=_number(body.get("min_p")),
        repetition_penalty=_number(body.get("repetition_penalty")),
        repeat_penalty=_number(body.get("repeat_penalty")),
        repeat_last_n=_number(body.get("repeat_last_n"), int),
        presence_penalty=_number(body.get("presence_penalty")),
        frequency_penalty=_number(body.get("frequency_penalty")),
        seed=_number(body.get("seed"), int), max_tokens=_number(max_tokens, int),
        logprobs=_number(logprobs, int), n=_number(body.get("n", 1), int) or 1, stop=stops,
        constraints=_fields_on(body, CONSTRAINT_FIELDS),
        other_samplers=_fields_on(body, SAMPLER_FIELDS))


def sampled_body(call: ParsedCall, top: int, token_ids: bool) -> dict[str, Any]:
    """The body of a sampled call with what the comparison needs and its client did not ask:
    the primary's logprobs (``top`` alternatives per token; 0: none added) and the token ids
    of the prompt and the completion (vLLM's ``return_token_ids``). ``answer_edits`` takes
    them out of the answer again."""
    body = dict(call.body)
    if top:
        if call.endpoint == "chat":
            body["logprobs"], body["top_logprobs"] = True, top
        else:
            body["logprobs"] = top
    if token_ids:
        body["return_token_ids"] = True
    return body
