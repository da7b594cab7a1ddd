"""Property-based fuzzing of guard's OpenAI-compatible HTTP edge (hypothesis), differential: each
case's bytes go to the upstream directly and through guard, and the two answers are held to
guard's contract (CONTRACT.md, "Generative models": the body is the upstream's answer).

The property, per case (:func:`verdict`):

- A call guard refuses on its own is one of the refusals it documents: a body that is not a
  JSON object (not JSON, not UTF-8, an array; a leading byte order mark is read past; nested
  or a number longer than Python's json reads), one naming ``model`` twice, a
  ``model`` that is not a string, a model guard does not serve (404), a body over
  ``server.max_message_bytes`` (413); each a 4xx in OpenAI's error shape
  (``{"error": {"message": ...}}``).
- Any other call is answered as the upstream answers it: the same status, a stream where the
  upstream streamed (its Content-Type), an answer that names the model the client asked for.
  A call its server answers and guard refuses is a call lost by putting guard in front; a 5xx
  the upstream did not give is guard's own failure.

Shared by tests/e2e/test_openai_fuzz.py (a seeded sample against llama.cpp's llama-server) and
benchmarks/reliability_llm.py (thousands of cases, with the processes' memory and descriptors
watched).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from guard.zoo.tool_chat import WEATHER_TOOL

SERVED = "smol"  # the model guard serves in front of the upstream
CHECKED_PATHS = ("/v1/completions", "/v1/chat/completions")
# Endpoints guard forwards unchecked (their body names the model, or none: the one served).
PASS_PATHS = ("/tokenize", "/detokenize", "/apply-template", "/completion", "/infill",
              "/v1/embeddings")
# Each valid-looking call asks for at most this many tokens; the upstream is also started with
# a cap (llama-server ``-n``) so that a call whose max_tokens the server ignores stays short.
MAX_TOKENS = 6

# -- JSON values --------------------------------------------------------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40),
                    st.floats(allow_nan=False, allow_infinity=False, width=32),
                    st.text(max_size=8))
json_values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                     st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)
texts = st.one_of(st.sampled_from(["The capital of France is", "Hello", "", " ", "1 + 1 =",
                                   "Écris un poème", "日本の首都は", "\u0000", "\ud7ff😀"]),
                  st.text(max_size=24))


def _sometimes(plausible: st.SearchStrategy, weird: st.SearchStrategy = json_values
               ) -> st.SearchStrategy:
    """Mostly a value a client would send, now and then any JSON value."""
    return st.one_of(plausible, plausible, plausible, weird)


# Tools (guard/zoo/tool_chat.py's weather tool, and any JSON now and then), and the messages of
# a conversation that called one: the assistant's call, the tool's answer.
tool_definitions = st.lists(st.one_of(st.just(WEATHER_TOOL), st.just(WEATHER_TOOL), json_values),
                            max_size=2)
tool_calls = st.lists(st.fixed_dictionaries({
    "id": st.sampled_from(["call-1", "c2"]), "type": st.just("function"),
    "function": st.fixed_dictionaries({
        "name": _sometimes(st.just("get_weather")),
        "arguments": _sometimes(st.sampled_from(['{"city": "Rome"}', "{}", "not json"]))})}),
    min_size=1, max_size=2)
plain_message = st.fixed_dictionaries(
    {"role": _sometimes(st.sampled_from(["user", "system", "assistant"])),
     "content": _sometimes(st.one_of(
         texts, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                         min_size=1, max_size=2)))})
messages_item = st.one_of(
    plain_message, plain_message, plain_message,
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.sampled_from([None, ""]),
                           "tool_calls": _sometimes(tool_calls)}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": texts,
                           "tool_call_id": _sometimes(st.just("call-1"))}))
messages = _sometimes(st.lists(messages_item, min_size=1, max_size=3),
                      st.one_of(st.just([]), st.text(max_size=6), json_values))
prompts = _sometimes(st.one_of(texts, st.lists(texts, min_size=1, max_size=2),
                               st.lists(st.integers(0, 49151), min_size=1, max_size=6)),
                     st.one_of(st.just([]), st.lists(st.integers(-5, 2**33), max_size=3),
                               json_values))

# The sampling and output fields OpenAI's API, vLLM and llama.cpp read, each with the values a
# client sends and now and then any JSON value.
OPTIONAL_FIELDS: dict[str, st.SearchStrategy] = {
    "temperature": _sometimes(st.sampled_from([0, 0.0, 0.2, 0.7, 1.0, 1.5])),
    "top_p": _sometimes(st.sampled_from([0.1, 0.5, 0.9, 1.0])),
    "top_k": _sometimes(st.sampled_from([0, 1, 5, 40, -1])),
    "min_p": _sometimes(st.sampled_from([0.0, 0.05, 0.3])),
    "seed": _sometimes(st.integers(0, 2**31)),
    "stream": _sometimes(st.booleans(), st.sampled_from([None, "true", 1, 0, "yes"])),
    "stream_options": _sometimes(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logprobs": _sometimes(st.one_of(st.booleans(), st.integers(0, 5))),
    "top_logprobs": _sometimes(st.integers(0, 5)),
    "n": _sometimes(st.sampled_from([1, 2])),
    "stop": _sometimes(st.one_of(st.sampled_from(["\n", ".", "Paris"]),
                                 st.lists(texts, max_size=2))),
    "echo": _sometimes(st.booleans()),
    "presence_penalty": _sometimes(st.sampled_from([0.0, 0.5, 1.5])),
    "frequency_penalty": _sometimes(st.sampled_from([0.0, 0.5])),
    "repeat_penalty": _sometimes(st.sampled_from([1.0, 1.1])),
    "logit_bias": _sometimes(st.dictionaries(st.integers(0, 49151).map(str),
                                             st.sampled_from([-100, 5]), max_size=2)),
    "response_format": _sometimes(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
    "n_probs": _sometimes(st.integers(0, 3)),
    "post_sampling_probs": _sometimes(st.booleans()),
    "return_tokens": _sometimes(st.booleans()),
    "cache_prompt": _sometimes(st.booleans()),
    "tools": _sometimes(tool_definitions),
    "tool_choice": _sometimes(st.sampled_from(
        ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}])),
    "parallel_tool_calls": _sometimes(st.booleans()),
    "user": _sometimes(texts),
    "suffix": _sometimes(texts),
}
unknown_fields = st.dictionaries(st.text(min_size=1, max_size=8).filter(
    lambda k: k not in OPTIONAL_FIELDS and k not in ("model", "prompt", "messages",
                                                      "max_tokens", "n_predict")),
    json_values, max_size=2)
models = st.one_of(st.just(SERVED), st.just(SERVED), st.just(SERVED), st.just(SERVED),
                   st.sampled_from([None, "", "nope", "SMOL", "smol\u0000", 7, ["smol"]]))
max_tokens = st.one_of(st.integers(1, MAX_TOKENS), st.integers(1, MAX_TOKENS),
                       st.sampled_from([0, -1, "3", None, 2.5, True]))


@dataclass(frozen=True)
class Case:
    """One call: its path, its body's bytes and the body as built (None for raw bytes)."""

    path: str
    data: bytes
    body: Any = None

    def describe(self) -> str:
        return f"POST {self.path} {self.data[:300]!r}"


@st.composite
def _bodies(draw, path: str) -> Case:
    body: dict[str, Any] = {}
    model = draw(models)
    if model is not None or draw(st.booleans()):
        body["model"] = model
    if path == "/v1/chat/completions":
        body["messages"] = draw(messages)
    elif path in ("/v1/completions", "/completion", "/infill"):
        body["prompt"] = draw(prompts)
    elif path in ("/tokenize", "/v1/embeddings"):
        body["content" if path == "/tokenize" else "input"] = draw(texts)
    elif path == "/detokenize":
        body["tokens"] = draw(st.lists(st.integers(0, 49151), max_size=4))
    elif path == "/apply-template":
        body["messages"] = draw(messages)
    body["max_tokens" if path.startswith("/v1") else "n_predict"] = draw(max_tokens)
    chosen = draw(st.lists(st.sampled_from(sorted(OPTIONAL_FIELDS)), max_size=5, unique=True))
    for name in chosen:
        body[name] = draw(OPTIONAL_FIELDS[name])
    body.update(draw(unknown_fields))
    if body and draw(st.integers(0, 9)) == 0:  # a member dropped: required fields too
        del body[draw(st.sampled_from(sorted(body)))]
    return Case(path, json.dumps(body, ensure_ascii=draw(st.booleans())).encode(), body)


def _raw(path: str) -> st.SearchStrategy:
    """Bytes that are not a JSON object: garbage, an array, JSON cut short, not UTF-8, a BOM."""
    valid = json.dumps({"model": SERVED, "prompt": "Hi", "max_tokens": 2,
                        "messages": [{"role": "user", "content": "Hi"}]}).encode()
    return st.one_of(
        st.binary(max_size=40),
        st.sampled_from([b"", b"[]", b"null", b"42", b'"smol"', b"{", valid[:-1],
                         b"\xef\xbb\xbf" + valid, valid.replace(b"Hi", b"\xff\xfe"),
                         b'{"model": "smol", "model": 3, "prompt": "x", "max_tokens": 1}',
                         b'{"model": "smol", "prompt": "x", "max_tokens": 1e400}'])
    ).map(lambda data: Case(path, data))


cases = st.one_of(
    st.sampled_from(CHECKED_PATHS).flatmap(_bodies),
    st.sampled_from(CHECKED_PATHS).flatmap(_bodies),
    st.sampled_from(CHECKED_PATHS).flatmap(_bodies),
    st.sampled_from(PASS_PATHS).flatmap(_bodies),
    st.sampled_from(CHECKED_PATHS + PASS_PATHS).flatmap(_raw),
)


# -- the property ---------------------------------------------------------------------------------
@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes

    @property
    def streamed(self) -> bool:
        return self.content_type.startswith("text/event-stream")


def guard_refuses(case: Case, several: bool = False) -> str:
    """Why guard answers this call itself (a documented refusal), "" where it forwards it.
    ``several``: guard serves several generation models, so a body naming none is refused
    (with one, it is that model's)."""
    try:  # (UTF-8 only; json.loads alone would also read UTF-16 and UTF-32)
        body = json.loads(case.data.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "not JSON guard reads"  # (nesting, or a number, past what Python reads)
    if not isinstance(body, dict):
        return "not an object"
    members: list[list] = []
    json.loads(case.data.decode("utf-8-sig"),
               object_pairs_hook=lambda pairs: members.append(pairs) or {})
    if [name for name, _ in members[-1]].count("model") > 1:
        return "model named twice"
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return "model not a string"
    if model and model != SERVED:
        return "model not served"
    if several and not model:
        return "no model named, several served"
    return ""


def _beyond_double(data: bytes) -> bool:
    """The body holds a number beyond a double's range (Python reads it as an infinity)."""
    found = []
    try:
        json.loads(data, parse_float=lambda text: found.append(math.isinf(float(text))),
                   parse_int=lambda text: found.append(math.isinf(float(text))))
    except (UnicodeDecodeError, ValueError, OverflowError):
        return False
    return any(found)


def _error_shape(answer: Answer) -> bool:
    try:
        error = json.loads(answer.body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def _names_served(answer: Answer) -> bool:
    """A 2xx answer names the model the client asked for wherever it names one."""
    if answer.streamed:
        for line in answer.body.split(b"\n"):
            if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
                try:
                    event = json.loads(line[5:])
                except ValueError:
                    return False
                if isinstance(event, dict) and event.get("model", SERVED) != SERVED:
                    return False
        return True
    try:
        whole = json.loads(answer.body)
    except ValueError:
        return True  # (a pass-through endpoint may answer text)
    return not isinstance(whole, dict) or whole.get("model", SERVED) == SERVED


def verdict(case: Case, direct: Answer, through: Answer, envoy: bool = False,
            several: bool = False) -> str:
    """"" where guard's answer keeps its contract, else what broke it. ``envoy``: guard in
    Envoy mode, where Envoy forwards whatever it can route: with one model every call (a call
    the Python edge refuses, not JSON or a model that is not a string, is the upstream's to
    answer there). ``several``: guard serves several generation models (:func:`guard_refuses`)."""
    refusal = guard_refuses(case, several)
    if not refusal and envoy and several and _beyond_double(case.data):
        refusal = "a number Envoy's JSON parser cannot read"  # (guard/envoy/openai_listener.py)
    if refusal:
        if through.status in (400, 404, 413) and _error_shape(through):
            return ""
        if not (envoy and not several and through.status == direct.status):
            return f"{refusal}: guard answered {through.status} {through.body[:200]!r}"
    if through.status != direct.status:
        return (f"guard answered {through.status} {through.body[:200]!r} where its upstream "
                f"answers {direct.status} {direct.body[:200]!r}")
    if 200 <= through.status < 300:
        if through.streamed != direct.streamed:
            return (f"guard's answer is {through.content_type!r}, its upstream's "
                    f"{direct.content_type!r}")
        if not _names_served(through):
            return f"the answer does not name {SERVED!r}: {through.body[:300]!r}"
    return ""


@dataclass
class Tally:
    """What a run saw: the statuses (direct, through guard) by path, and each broken case."""

    statuses: Counter = field(default_factory=Counter)
    broken: list[tuple[str, str]] = field(default_factory=list)

    def add(self, case: Case, direct: Answer, through: Answer, envoy: bool = False,
            several: bool = False) -> None:
        self.statuses[(case.path, direct.status, through.status)] += 1
        why = verdict(case, direct, through, envoy, several)
        if why:
            self.broken.append((case.describe(), why))
