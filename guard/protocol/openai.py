"""The OpenAI-compatible HTTP API as data: requests, answers (plain JSON or Server-Sent Events),
the byte-exact edits the edge makes to them, and the :class:`GenerationSample` they add up to.

Protocol-free of any HTTP library: the edge (guard/serve/openai_edge.py) feeds it bytes and
gets bytes back, and so can any other observer of the same traffic (Envoy mode, capture
replay).

Byte-exact edits: the client's answer is the upstream's answer. The edge changes only the value
of the top-level ``"model"`` key (the upstream's name back to the client's), and, where guard
itself asked for logprobs on a sampled call, the value of each ``choices[i].logprobs`` back to
``null`` (what the server answers when nobody asked). Both edits splice the value's bytes in
place (:func:`replace_values`): every other byte (spacing, key order, number spelling, escapes)
stays as the server wrote it, which a ``json.loads``/``json.dumps`` round trip would not keep.

Server-Sent Events (https://html.spec.whatwg.org/multipage/server-sent-events.html): an event
ends at a blank line; lines end with CRLF, LF or CR. :class:`EventSplitter` reassembles events
across the chunks a connection delivers them in (an event can arrive in pieces, several can
arrive in one chunk) and hands back each complete event's bytes as they came.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

from guard.protocol.generation import (
    GenerationSample,
    SamplingParams,
    TokenLogprob,
    chat_template_args,
)

# The checked endpoints: a call's kind by its path. A Responses API call (``/v1/responses``) is
# checked as the chat it renders: its instructions and input items are chat messages to the
# model's template (vLLM builds them so), its output text the completion.
Call = Literal["completions", "chat", "responses"]
PATHS: dict[str, Call] = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
                          "/v1/responses": "responses"}
DONE = b"[DONE]"
# The Responses API's stream has no [DONE]: it ends with one of these events, whose
# ``response`` is the whole answer.
RESPONSE_ENDS = ("response.completed", "response.incomplete")
RESPONSE_FAILS = ("response.failed", "error")


# HTTP status -> gRPC status name (google.rpc.Code's HTTP mapping), for the ``code`` label of
# guard_request_errors_total: one vocabulary for the OIP and the HTTP data planes.
_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
          404: "NOT_FOUND", 408: "DEADLINE_EXCEEDED", 409: "ABORTED", 413: "RESOURCE_EXHAUSTED",
          429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 501: "UNIMPLEMENTED",
          502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def status_code_name(status: int) -> str:
    """The gRPC status name of an HTTP error status (the ``code`` label)."""
    if status in _CODES:
        return _CODES[status]
    return "FAILED_PRECONDITION" if 400 <= status < 500 else "INTERNAL" if status == 500 \
        else "UNKNOWN"


class BadRequest(ValueError):
    """A request the edge cannot forward as an OpenAI call (HTTP 400); the message says why."""


# -- requests --------------------------------------------------------------------------------------
@dataclass
class ParsedCall:
    """What the edge needs from a client's request body (the body itself is forwarded)."""

    endpoint: Call
    body: dict[str, Any]
    model: str
    stream: bool
    # Why this call cannot be compared with a reference ("" when it can): n > 1 or best_of >
    # 1 (several completions in one answer, or the best of several), echo (the prompt comes
    # back as part of the text), tools on an endpoint that cannot say its tokens, a batch of
    # prompts.
    not_comparable: str = ""
    # A completions call's one prompt (single_prompt: its text, or its token ids), read once.
    prompt: str | tuple[int, ...] | None = None

    @property
    def offers_tools(self) -> bool:
        """A chat that offers the model tools: comparable only where the answer says the
        prompt's token ids (the server's rendering of the tools) and the output's tokens
        (:func:`unusable`)."""
        return self.endpoint == "chat" and _offers_tools(self.body)

    @property
    def prompt_truncation(self) -> int | None:
        """vLLM's ``truncate_prompt_tokens`` where the client gave it: the server may keep only
        that many of the prompt's tokens, so the call is compared only where the answer says
        the prompt's token ids (:func:`unusable`)."""
        value = self.body.get("truncate_prompt_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def asked_logprobs(self) -> bool:
        """The client asked for the primary's logprobs itself."""
        if self.endpoint == "responses":
            return _responses_logprobs(self.body)
        value = self.body.get("logprobs")
        return value not in (None, False, 0)

    @property
    def asked_token_ids(self) -> bool:
        """The client asked for the token ids itself (vLLM's ``return_token_ids``)."""
        return self.body.get("return_token_ids") not in (None, False)


def _body_and_model(data: bytes) -> tuple[dict[str, Any], str]:
    """A request body as a JSON object and the model it names; BadRequest otherwise."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required (a string)")
    return body, model


def model_of(data: bytes) -> str:
    """The model a call to an endpoint guard forwards unchecked (embeddings, /v1/messages,
    vLLM's ``/tokenize`` ...) names: what routes it. BadRequest for a body that names none."""
    return _body_and_model(data)[1]


def parse_request(endpoint: Call, data: bytes) -> ParsedCall:
    """The client's body as a call; BadRequest for what is not an OpenAI request body."""
    body, model = _body_and_model(data)
    if endpoint == "chat":
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise BadRequest("'messages' is required (a non-empty list)")
    elif endpoint == "responses":
        if not isinstance(body.get("input"), (str, list)) or not body["input"]:
            raise BadRequest("'input' is required (a string or a non-empty list)")
    elif "prompt" not in body:
        raise BadRequest("'prompt' is required")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    prompt = single_prompt(body["prompt"]) if endpoint == "completions" else None
    n, best_of = body.get("n", 1), body.get("best_of", 1)
    reason = ""
    if not isinstance(n, int) or n != 1 or (best_of is not None and best_of != 1):
        reason = "n"  # several completions, or the best of several: not one sampled path
    elif body.get("echo") not in (None, False):
        reason = "echo"  # the answer's text begins with the prompt (or the last message)
    elif endpoint != "chat" and _offers_tools(body):
        reason = "tools"  # (a chat's tools are decided by its answer: ParsedCall.offers_tools)
    elif endpoint == "completions" and prompt is None:
        reason = "prompt_list"  # a batch of prompts: several completions
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


def _offers_tools(body: dict[str, Any]) -> bool:
    return bool(body.get("tools") or body.get("functions")) or body.get("tool_choice") not in (
        None, "none")


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)


def single_prompt(prompt: Any) -> str | tuple[int, ...] | None:
    """A completions ``prompt`` that asks for one completion: its text, or its token ids (the
    prompt exactly as the server evaluates it: no BOS added, no template); a batch of one
    (``["text"]``, ``[[ids]]``: LangChain's completions client sends every prompt so) is its
    one prompt. None for a batch of several, or what is not a prompt."""
    if isinstance(prompt, list) and len(prompt) == 1 and (
            isinstance(prompt[0], str) or _token_ids(prompt[0])):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    return tuple(prompt) if _token_ids(prompt) else None


def chat_messages(messages: list[Any]) -> tuple[dict[str, Any], ...]:
    """A chat's messages as the reference renders them: a content given as text parts is one
    string, the parts joined by newlines (as vLLM joins them for a template that reads
    strings, which text models' templates do); ValueError for a part that is not text."""
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
    """A message's content as its text: a string, or its text parts joined by newlines (as
    vLLM joins them for a template that reads strings); ValueError for another part."""
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
    # The Responses API's structured output: text.format json_schema or json_object.
    "text": lambda v: isinstance(v, dict) and isinstance(v.get("format"), dict)
    and v["format"].get("type") not in (None, "text"),
}
# Samplers guard's transform does not model (guard/verify/generation.py applies temperature,
# top_k, top_p, min_p and the penalties), each with the test for a value that turns it on:
# llama.cpp's locally typical sampling, mirostat, tail-free sampling (llama-cpp-python), XTC,
# DRY, top-n-sigma, dynamic temperature; vLLM's beam search.
SAMPLER_FIELDS: dict[str, Callable[[Any], bool]] = {
    "typical_p": lambda v: _number(v) is not None and v < 1,
    "mirostat": _positive, "mirostat_mode": _positive,
    "tfs_z": lambda v: _number(v) is not None and v < 1,
    "xtc_probability": _positive, "dry_multiplier": _positive, "top_n_sigma": _positive,
    "dynatemp_range": _positive, "use_beam_search": lambda v: v is True,
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
    stops = (stop,) if isinstance(stop, str) else tuple(s for s in stop or () if isinstance(s, str))
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens",
                                                 body.get("max_output_tokens")))
    return SamplingParams(
        temperature=_number(body.get("temperature")), top_p=_number(body.get("top_p")),
        top_k=_number(body.get("top_k"), int), min_p=_number(body.get("min_p")),
        repetition_penalty=_number(body.get("repetition_penalty", body.get("repeat_penalty"))),
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


# -- byte-exact edits of JSON ------------------------------------------------------------------
MODEL_PATH = ("model",)
LOGPROBS_PATH = ("choices", "*", "logprobs")
# Where vLLM puts the ids ``return_token_ids`` asks for: the prompt's at the top of a chat
# answer (its first chunk, streamed) and in each choice of a completions answer, the
# completion's in each choice. vLLM writes every one of them as null when they are not asked
# for, so null is the client's answer byte for byte (vLLM 0.32, checked by the e2e test).
TOKEN_ID_PATHS = (("prompt_token_ids",), ("choices", "*", "prompt_token_ids"),
                  ("choices", "*", "token_ids"))
# The scan walks the keys on the way to the wanted values and skips every other value with the
# json module's C scanner (``raw_decode``), so an edit costs a few microseconds per event.
_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")
# (CPython's C scanner; typeshed does not declare json.decoder.scanstring)
_scanstring = json.decoder.scanstring  # type: ignore[attr-defined]


def _skip_space(text: str, at: int) -> int:
    match = _SPACE.match(text, at)  # (always a match: the pattern takes an empty run too)
    return match.end() if match is not None else at


def _value_end(text: str, at: int) -> int:
    try:
        return _DECODER.raw_decode(text, at)[1]
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON at {exc.pos}: {exc.msg}") from None


def _spans(text: str, at: int, paths: tuple, prefix: tuple, found: list) -> int:
    """Scan the value at ``at`` (no leading space); append (start, end, path) of wanted values;
    return where the value ends."""
    if prefix in paths:
        end = _value_end(text, at)
        found.append((at, end, prefix))
        return end
    depth = len(prefix)
    wanted = [p for p in paths if len(p) > depth and p[:depth] == prefix]
    opener = text[at:at + 1]
    if not wanted or opener not in ("{", "["):
        return _value_end(text, at)
    closer = "}" if opener == "{" else "]"
    at = _skip_space(text, at + 1)
    if text[at:at + 1] == closer:
        return at + 1
    while True:
        if opener == "{":
            if text[at:at + 1] != '"':
                raise ValueError(f"not JSON at {at}: expected a key")
            key, at = _scanstring(text, at + 1)
            at = _skip_space(text, at)
            if text[at:at + 1] != ":":
                raise ValueError(f"not JSON at {at}: expected ':'")
            at = _skip_space(text, at + 1)
            step = key
        else:
            step = "*"
        if any(p[depth] == step for p in wanted):
            at = _spans(text, at, paths, (*prefix, step), found)
        else:
            at = _value_end(text, at)
        if depth == 0 and all("*" not in p for p in paths) and len(found) == len(paths):
            return len(text)  # every exact path found: the rest stays as it is
        at = _skip_space(text, at)
        sep = text[at:at + 1]
        if sep == closer:
            return at + 1
        if sep != ",":
            raise ValueError(f"not JSON at {at}: expected ',' or '{closer}'")
        at = _skip_space(text, at + 1)


def value_spans(data: bytes | str,
                paths: Iterable[tuple[str, ...]]) -> list[tuple[int, int, tuple]]:
    """(start, end, path) of every value at ``paths`` in the JSON ``data`` (character offsets
    of its UTF-8 text), in document order. Paths are tuples of keys, ``"*"`` standing for
    every element of an array. ValueError for data that is not JSON."""
    text = data.decode() if isinstance(data, (bytes, bytearray)) else data
    found: list = []
    _spans(text, _skip_space(text, 0), tuple(paths), (), found)
    return found


# The fast path of the one edit every answer needs: a top-level "model" key reached over
# top-level keys whose values are strings or scalars (how servers write their chunks: "id",
# "object", "created", "model", then "choices"), in one C-level regex match.
_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_SCALAR = rb"(?:" + _STRING + rb"|true|false|null|-?\d[\d.eE+-]*)"
_LEADING_MODEL = re.compile(rb"\{(?:\s*" + _STRING + rb"\s*:\s*" + _SCALAR + rb"\s*,)*?"
                            rb'\s*"model"\s*:\s*(' + _STRING + rb")\s*[,}]")


def replace_values(data: bytes, replacements: dict[tuple[str, ...], bytes]) -> bytes:
    """``data`` with the values at these paths replaced by the given JSON bytes; every other
    byte as it was. Paths that are not there are left out (nothing added). Once every exact
    path is found the rest of the document is not read: a document that breaks off after them
    is edited there and forwarded as it is."""
    if len(replacements) == 1 and MODEL_PATH in replacements:
        match = _LEADING_MODEL.match(data)
        if match is not None:
            return data[:match.start(1)] + replacements[MODEL_PATH] + data[match.end(1):]
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc}") from None
    spans = value_spans(text, replacements)
    if not spans:
        return data
    out, at = [], 0
    for start, end, path in spans:
        out += [text[at:start], replacements[path].decode()]
        at = end
    out.append(text[at:])
    return "".join(out).encode()


def answer_edits(client_model: str, upstream_model: str, strip_logprobs: bool,
                 strip_token_ids: bool = False) -> dict[tuple[str, ...], bytes]:
    """The edits an answer (or each streamed chunk) of this call needs; {} for none."""
    edits: dict[tuple[str, ...], bytes] = {}
    if client_model != upstream_model:
        edits[MODEL_PATH] = json.dumps(client_model, ensure_ascii=False).encode()
    if strip_logprobs:
        edits[LOGPROBS_PATH] = b"null"
    if strip_token_ids:
        edits.update(dict.fromkeys(TOKEN_ID_PATHS, b"null"))
    return edits


# -- Server-Sent Events --------------------------------------------------------------------------
_BLANK_LINE = re.compile(rb"(?:\r\n|\n|\r(?!\n))(?:\r\n|\n|\r(?!\n))")
_LINE_END = re.compile(rb"\r\n|\n|\r")


class EventSplitter:
    """Complete SSE events out of a byte stream cut anywhere."""

    __slots__ = ("_pending",)

    def __init__(self):
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The events completed by ``chunk``, each with its terminating blank line, as sent."""
        data = self._pending + chunk if self._pending else chunk
        events, at = [], 0
        while True:
            match = _BLANK_LINE.search(data, at)
            # A CR at the very end may be the first half of a CRLF still in flight.
            if match is None or (match.end() == len(data) and data.endswith(b"\r")):
                break
            events.append(data[at:match.end()])
            at = match.end()
        self._pending = data[at:]
        return events

    def rest(self) -> bytes:
        """What came after the last complete event (at the end of the stream)."""
        rest, self._pending = self._pending, b""
        return rest


def event_data(event: bytes) -> bytes | None:
    """The ``data`` of one event (its data lines joined by LF), None for an event without
    data (a comment, a retry)."""
    if event.startswith(b"data:"):  # the usual event: one data line
        payload = event[6 if event[5:6] == b" " else 5:].rstrip(b"\r\n")
        if b"\n" not in payload and b"\r" not in payload:
            return payload
    lines = []
    for line in _LINE_END.split(event):
        if line.startswith(b"data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(lines) if lines else None


_DATA_LINE = re.compile(rb"(?:^|\r\n|\n|\r)data:")


def edit_event(event: bytes, edits: dict[tuple[str, ...], bytes]) -> bytes:
    """One event with ``edits`` applied to its JSON data (a single ``data:`` line, as every
    OpenAI-compatible server sends, after an ``event:`` line in the Responses API's stream);
    any other event as it came."""
    if not edits:
        return event
    if event.startswith(b"data:"):  # the usual event: its data line first
        start = 5
    else:
        found = _DATA_LINE.search(event)
        if found is None:
            return event
        start = found.end()
    head = start + 1 if event[start:start + 1] == b" " else start
    line = _LINE_END.search(event, head)
    end = line.start() if line is not None else len(event)
    payload = event[head:end]
    if not payload.startswith(b"{") or _DATA_LINE.search(event, end) is not None:
        return event  # [DONE], or several data lines: not ours to edit
    try:
        edited = replace_values(payload, edits)
    except ValueError:  # not JSON after all: forwarded as it came
        return event
    return event[:head] + edited + event[end:]


# -- answers -> the sample -------------------------------------------------------------------------
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


def _token_id(text: str) -> int | None:
    # vLLM's return_tokens_as_token_ids spells a token "token_id:123".
    if text.startswith("token_id:") and text[9:].isdigit():
        return int(text[9:])
    return None


def _top(items) -> tuple[tuple[str, float], ...]:
    pairs: Iterable[tuple[Any, Any]]
    if isinstance(items, dict):  # completions: {token: logprob}
        pairs = items.items()
    else:  # chat: [{token, logprob}]
        pairs = ((t.get("token"), t.get("logprob")) for t in items or () if isinstance(t, dict))
    return tuple((str(t), float(lp)) for t, lp in pairs
                 if isinstance(lp, (int, float)) and not isinstance(lp, bool))


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
                    _token_id(item["token"])))
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
    ids = answer.get("prompt_token_ids")
    choices = answer.get("choices") or ()
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    ids = choice.get("prompt_token_ids", ids)
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


def unusable(completion: Completion, offers_tools: bool = False,
             prompt_truncation: int | None = None) -> str:
    """Why a completion that was answered cannot be compared, as the not-comparable reason
    ("" when it can): an error, tools it cannot hold, reasoning the sample cannot hold, a
    prompt the server may have cut (``prompt_truncation``, :attr:`ParsedCall.prompt_truncation`)
    without saying what it kept (its prompt token ids): ``input``.

    A chat that offers tools (``offers_tools``) is compared where the answer says the prompt's
    token ids (the server renders the tool definitions and a conversation's earlier calls into
    the prompt, each engine in its own way: the server's ids are the prompt, not the
    reference's rendering) and the output's token ids (a tool parser takes the call out of the
    text; the ids are the call as the model generated it, which the reference checks names each
    function called): vLLM with ``sample_token_ids``. Anything else with tools, or a tool call
    without them, is not comparable (``tools``).

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
    if prompt_truncation is not None and completion.prompt_token_ids is None:
        return "input"
    if offers_tools or completion.tool_calls:
        by_ids = completion.prompt_token_ids is not None and bool(completion.tokens) and all(
            t.token_id is not None for t in completion.tokens)
        named = completion.tool_names or not completion.tool_calls
        if not (by_ids and named):
            return "tools"
    if completion.reasoning or completion.reasoning_tokens > 0:
        if not (completion.reasoning_text and completion.tokens):
            return "reasoning"
    return ""


def gather_event(completion: Completion, endpoint: str, data: bytes, whole: bool = True) -> None:
    """Add one streamed event's JSON ``data`` to ``completion``: all of it (``whole``), or only
    what every call is counted by (an error, the usage). Data that is not a JSON object is
    left out (a server's keep-alive or a proprietary event)."""
    try:
        answer = json.loads(data)
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
            gather(completion, endpoint, json.loads(body), streamed=False)
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
    messages = (chat_messages(body["messages"]) if call.endpoint == "chat" else
                responses_messages(body) if call.endpoint == "responses" else None)
    prompt, prompt_ids = call.prompt, completion.prompt_token_ids
    if isinstance(prompt, tuple):  # the client's token ids: the prompt as the server read it
        if call.prompt_truncation is None:  # (else the server's, which it may have cut)
            prompt_ids = prompt_ids or prompt
        prompt = None
    return GenerationSample(
        model=call.model, endpoint="completions" if call.endpoint == "completions" else "chat",
        completion_text="".join(completion.text), tokens=tuple(completion.tokens),
        sampling=sampling, prompt=prompt,
        messages=messages, prompt_token_ids=prompt_ids,
        finish_reason=completion.finish_reason, upstream_model=completion.upstream_model,
        chat_template_args=chat_template_args(body) if call.endpoint == "chat" else None,
        reasoning_text="".join(completion.reasoning_text) if completion.reasoning_text
        else None, tools=call.offers_tools, tool_calls=tuple(completion.tool_names),
        prompt_truncation=call.prompt_truncation, **envelope)


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> bytes:
    """OpenAI's error JSON shape."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": code}}).encode()
