"""A sampled LLM call, protocol-free: what the OpenAI-compatible edge hands off and what the
`generation` tier checks.

The edge (guard/serve/, OpenAI-compatible HTTP, plain or SSE) turns one client call and the
primary's answer into a :class:`GenerationSample`; the verifier's reference scores
``prompt + completion`` teacher-forced and the tier compares per position. Nothing here knows
HTTP, JSON field spellings of one server, tensors or torch: it is the envelope both processes,
capture and replay agree on, so a second generative edge (Envoy's observer, a capture file)
builds the same value.

Encoding: :func:`to_dict` / :func:`from_dict` give plain JSON-able dicts (the ring and capture
records carry them as UTF-8 JSON: an LLM call is text, and a JSON body is what it came as; the
tensor samples' binary layout buys nothing here). ``from_dict`` rejects what it cannot read with
``ValueError`` naming the field, so a corrupt record is counted, never half-read.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

Endpoint = Literal["completions", "chat"]
ENDPOINTS: tuple[str, ...] = ("completions", "chat")
FORMAT_VERSION = 5  # bump when a field's meaning changes; readers refuse newer versions
# Version 2 added ``reasoning_text``, ``tools`` and ``tool_calls`` (the tokens of such a sample
# are more than its completion_text, which a version-1 reader would take for a tokenizer
# mismatch) and ``prompt_truncation`` (its prompt ids may be a cut rendering, which a version-1
# reader would report as template drift). Version 3 added ``add_special_tokens`` (a prompt
# without BOS as asked, which a version-2 reader would score with one and report as a missing
# BOS) and ``echo`` (tokens that begin inside the prompt, which a version-2 reader would score
# after the whole prompt). Version 4 keeps a request's ``repeat_penalty`` (llama.cpp's name)
# apart from its ``repetition_penalty`` (vLLM's): each server reads one of them and ignores the
# other, and a version-3 ``repetition_penalty`` is either (a version-3 reader would take a
# llama.cpp penalty for vLLM's); and it added ``repeat_last_n`` (llama.cpp's penalty window).
# A sample is written with the lowest version that holds it, so that records without the newer
# fields stay readable by the guards that wrote them before.


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token as the primary returned it.

    ``text`` is the token's text (OpenAI's ``token``); ``token_id`` where the server said it
    (vLLM's ``return_tokens_as_token_ids``, llama.cpp's ``tokens``); ``logprob`` the primary's
    log-probability of it (None where the client did not ask and guard did not add it); ``top``
    the server's ``top_logprobs`` as (token text, logprob), best first, as returned.
    """

    text: str
    logprob: float | None = None
    top: tuple[tuple[str, float], ...] = ()
    token_id: int | None = None


@dataclass(frozen=True)
class SamplingParams:
    """The sampling transform the server applied, as far as the request and the backend block's
    declared server defaults tell. ``None`` is "not said": the tier then uses the server's
    declared default, and a sampled completion whose transform stays unknown is not comparable.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    # The repetition penalty under each of its two request names, as the client sent them:
    # vLLM (and SGLang, transformers) read ``repetition_penalty`` and ignore
    # ``repeat_penalty``; llama.cpp's servers read ``repeat_penalty`` and ignore the other.
    # Which one the server applied is the engine's to say (ServerDefaults.penalty_fields).
    repetition_penalty: float | None = None
    repeat_penalty: float | None = None
    # llama.cpp's server's penalty window (its request field: the last that many tokens, -1
    # the context, 0 no penalty); other engines take theirs from a launch flag or not at all.
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    logprobs: int | None = None  # top-k the client asked for (None: no logprobs asked)
    n: int = 1
    stop: tuple[str, ...] = ()
    # Request fields outside the transform guard models (guard/protocol/openai/requests.py
    # names them): constraints on which tokens may come (a grammar, a JSON schema, a logit
    # bias ...) and samplers of other kinds (mirostat, typical_p, beam search ...). Either
    # makes a completion without logprobs not comparable: its server chose from a
    # distribution the reference cannot rebuild.
    constraints: tuple[str, ...] = ()
    other_samplers: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        """Temperature 0 (OpenAI's convention for argmax decoding)."""
        return self.temperature is not None and self.temperature <= 0.0


# The chat request fields that are arguments of the model's own template (vLLM's and
# transformers' apply_chat_template names), with the type each must have.
CHAT_TEMPLATE_ARGS: dict[str, type] = {"add_generation_prompt": bool,
                                       "continue_final_message": bool,
                                       "chat_template_kwargs": dict}


# guard's own template argument (never read from a request): the final message is continued
# as llama.cpp's server continues it, its content after the template's generation prompt for
# the messages before it (llama.cpp common/chat.cpp: messages[:-1] rendered, then the
# generation prompt, then the content, text parts joined by a blank line), where
# transformers and vLLM render every message and cut after the last one's content. The two
# differ where the template writes something for the first message only (SmolLM2's adds a
# system prompt before a first message that is not one).
LLAMA_CPP_CONTINUATION = "continue_after_generation_prompt"


def rendered_as_served(sample: "GenerationSample", engine: str) -> "GenerationSample":
    """``sample`` as its server rendered it, where the engine decides how: llama.cpp's
    llama-server

    - joins a message's text parts its own way (:func:`llama_cpp_text`: ``["", "x"]`` is
      ``"x"``, where vLLM's newline join, the reference's default, writes ``"\nx"``);
    - continues a chat whose last message is the assistant's (``--prefill-assistant``, its
      default), where vLLM and OpenAI's API open a new assistant turn unless asked
      (``continue_final_message``), and it continues a final message its own way
      (:data:`LLAMA_CPP_CONTINUATION`; its parts joined by blank lines), answering the
      continued content again before what the model generated (taken off the completion
      here: it is the prompt's). Rendered with a new turn and scored with the content, a
      healthy llama-server's prefilled chats read as drift (z 5 to 10,
      benchmarks/results/reliability_llm.md).

    A server started with ``--no-prefill-assistant`` is not told apart by the reference's own
    rendering (its /props does not say); the server's token ids, where guard asked for them
    (guard/backends/llama_server_prompts.py), say what it read, and this rendering is then the
    reference's to compare them with. Applied twice, it changes nothing more."""
    if engine != "llama.cpp" or sample.endpoint != "chat" or not sample.messages:
        return sample
    args = dict(sample.chat_template_args or {})
    last = sample.messages[-1]
    prefilled = "continue_final_message" not in args and isinstance(last, dict) and \
        last.get("role") == "assistant"
    rendered = bool(args.get(LLAMA_CPP_CONTINUATION))  # (by an earlier call of this)
    continues = not rendered and (prefilled or args.get("continue_final_message") is True)
    final = len(sample.messages) - 1
    messages = tuple(
        _with_text(message, "\n\n" if k == final and (continues or rendered) else "\n")
        for k, message in enumerate(sample.messages))
    if not continues:
        return sample if messages == sample.messages else replace(sample, messages=messages)
    args.update({"add_generation_prompt": False, "continue_final_message": True,
                 LLAMA_CPP_CONTINUATION: True})
    # Its answer repeats the continued content before what the model generated ("Hello" then
    # ", and welcome ..."): the content is the prompt's, the rest the completion.
    content = messages[-1].get("content") if isinstance(messages[-1], dict) else None
    text = sample.completion_text
    if isinstance(content, str) and content and text.startswith(content):
        text = text[len(content):]
    return replace(sample, messages=messages, chat_template_args=args, completion_text=text)


def llama_cpp_text(content: Any, separator: str) -> Any:
    """A message's content as llama-server writes it for its template: text parts each after
    ``separator`` once there is text before it (its /apply-template: a user's ``["a", "",
    "b"]`` is ``"a\n\nb"``, ``["", "x"]`` ``"x"``; a continued answer's parts take a blank
    line, ``"\n\n"``); any other content as it is."""
    if not isinstance(content, list):
        return content
    joined = ""
    for part in content:
        if isinstance(part, dict) and part.get("type", "text") == "text" and \
                isinstance(part.get("text"), str):
            joined += (separator if joined else "") + part["text"]
    return joined


def _with_text(message: Any, separator: str) -> Any:
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    return {**message, "content": llama_cpp_text(message["content"], separator)}


def chat_template_args(body: dict[str, Any]) -> dict[str, Any] | None:
    """The template arguments a chat request sets (values of another type left out: the
    server refuses those calls), None for none."""
    found = {name: body[name] for name, kind in CHAT_TEMPLATE_ARGS.items()
             if isinstance(body.get(name), kind)}
    return found or None


# What a server's logprobs can be: vLLM's --logprobs-mode choices, the names a primary block's
# options.logprobs_mode takes. raw_logprobs: the model's own distribution (every other engine's
# too); processed_logprobs: after the request's sampling transform; the others: logits.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
# A token the sampling transform masked (log 0), as vLLM writes it in a JSON answer.
MASKED_LOGPROB = -9999.0


def shown_as_logits(values: list[float]) -> str | None:
    """What shows that one position's logprobs (the chosen token's, or its top-k) are logits,
    not log-probabilities: a value above 0, or a top-k holding more than all the mass (float
    slack allowed); None where nothing does. What a vLLM started with --logprobs-mode
    raw_logits or processed_logits answers."""
    if not values:
        return None
    mass = math.fsum(math.exp(min(v, 50.0)) for v in values)
    if max(values) > 1e-3 or mass > 1.01:
        return f"best {max(values):.4g}, a top-{len(values)} mass of {mass:.4g}"
    return None


# The sampling transform's fields: what a request may set and a server defaults. They are also
# the fields of a generation_config.json that vLLM applies to a request that does not set them
# (ModelConfig.get_diff_sampling_param; it does not read do_sample, and max_new_tokens is a
# length, not part of the transform).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty")


def generation_config_defaults(source: str) -> dict[str, float]:
    """The sampling defaults vLLM takes from ``source``: a generation_config.json, or a
    folder holding one (an HF model folder), as vLLM's ``--generation-config`` names it;
    "vllm" (vLLM's neutral defaults): none. ValueError naming the file and the problem."""
    if source == "vllm":
        return {}
    path = Path(source)
    if path.is_dir():
        path = path / "generation_config.json"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"generation_config: cannot read {path}: {exc.strerror or exc}") \
            from None
    except ValueError as exc:
        raise ValueError(f"generation_config: {path} is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ValueError(f"generation_config: {path} is not a JSON object")
    found: dict[str, float] = {}
    for name in SAMPLING_FIELDS:
        value = document.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"generation_config: {path}: {name} {value!r} is not a number")
        found[name] = value
    if found.get("top_k", 0) < 0:
        found["top_k"] = 0  # vLLM's -1: off, as guard's 0
    return found



@dataclass(frozen=True)
class GenerationSample:
    """One compared LLM call: the request as the client sent it, the prompt as the server
    rendered it where the server told, and the primary's completion token by token.

    ``prompt`` is /v1/completions' prompt text; ``messages`` the chat messages (roles and
    contents as sent). ``prompt_token_ids`` are the server's own rendering of the prompt (BOS
    included) where it returned them; None means the reference renders it (with the model's
    chat template for chat) and marks the score an approximation. ``tokens`` are the primary's
    completion tokens; ``completion_text`` their concatenation as the client received it.
    """

    model: str
    endpoint: Endpoint
    completion_text: str
    tokens: tuple[TokenLogprob, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    finish_reason: str | None = None
    route: str = "primary"
    request_id: str = ""
    streamed: bool = False
    unix_nanos: int = 0
    request_seconds: float = 0.0  # the whole call as the edge measured it
    first_token_seconds: float | None = None  # time to first token (streamed calls)
    upstream_model: str = ""  # the name the upstream served it under
    # A chat request's arguments to the model's own template, as the client sent them
    # (CHAT_TEMPLATE_ARGS: add_generation_prompt, continue_final_message,
    # chat_template_kwargs); None for none. The reference renders the messages with them, as
    # the server did. A template of the request's own (``chat_template``) is not among them:
    # the reference renders with the model's template, so another one is drift it reports.
    chat_template_args: dict[str, Any] | None = None
    # The reasoning a server's reasoning parser gave apart from the answer (a chat's
    # ``reasoning`` or ``reasoning_content``), as the client received it; None: none. The
    # tokens are then the whole output the model generated (the reasoning, the tags the parser
    # took out, the answer) and ``completion_text`` the answer alone: the reference checks that
    # they spell the reasoning and then the answer, and scores them all.
    reasoning_text: str | None = None
    # The chat offered the model tools: the prompt is the server's rendering (its token ids;
    # each engine renders tool definitions and earlier calls its own way), not compared with
    # the reference's own. ``tool_calls``: the functions the answer called, in order (a tool
    # parser took them out of the text): the output's token ids must spell them.
    tools: bool = False
    tool_calls: tuple[str, ...] = ()
    # The request's tool fields as the client sent them (tools, tool_choice ...; None: none
    # offered, or a record written before they were kept): a fallback's probe asks them again,
    # so that the primary renders the prompt it rendered for the client. Information a reader
    # may ignore (the scores come from the server's ids): no new format version.
    tool_request: dict[str, Any] | None = None
    # The client's ``truncate_prompt_tokens`` (vLLM: keep that many of the prompt's tokens, -1
    # the model's context; None: not asked). Such a sample is compared on the server's prompt
    # token ids, the prompt the model read; where the server cut the prompt, the cut is no
    # template drift and no missing BOS.
    prompt_truncation: int | None = None
    # The client's ``add_special_tokens`` (vLLM: tokenize the prompt with the model's special
    # tokens, its BOS; None: not asked, the endpoint's default). A completions prompt asked
    # without them is compared as the server read it, without BOS, and no missing BOS.
    add_special_tokens: bool | None = None
    # A completions call that asked its prompt back with logprobs (``echo``: lm-eval's
    # loglikelihood calls): ``tokens`` are the prompt's tokens after the first and then the
    # generated ones, each with the primary's logprob, and ``completion_text`` their text;
    # the reference scores them after the prompt's first token.
    echo: bool = False
    # What the primary's server reported it samples with where a request does not say
    # (llama-server's GET /props, the keys guard reads: guard.verify.generation
    # llama_server_sampling), as the live verifier read it at load; None: not read (another
    # engine, or a call on its way from the edge). The verifier puts it into the call's capture
    # record, so that a replay scores the call with the defaults it was compared under live,
    # not the engine's preset (format version 5: an older reader, which would score it with
    # the preset, refuses it instead).
    server_settings: dict[str, Any] | None = None

    @property
    def has_logprobs(self) -> bool:
        """Every token carries the primary's logprob (the per-token comparison applies)."""
        return bool(self.tokens) and all(t.logprob is not None for t in self.tokens)


# The request fields of the repetition penalty, kept apart from version 4 on, and the sampling
# fields version 4 added.
_PENALTY_NAMES = ("repetition_penalty", "repeat_penalty", "repeat_last_n")
_VERSION_4_FIELDS = ("repeat_penalty", "repeat_last_n")


def divergent_token_phrase(first: dict[str, Any]) -> str:
    """How a report names the primary's token at a completion's first divergent token (a
    ``first_divergence`` object: the verdict's, an event's, a report's): "the primary wrote
    ' Paris'", or, where the server said its text alone (``split_known`` false), that the
    text reads so there as the reference splits it, which the server may not have."""
    before, after = divergent_token_words(first)
    return f"{before}{first.get('primary_token')!r}{after}"


def divergent_token_words(first: dict[str, Any]) -> tuple[str, str]:
    """:func:`divergent_token_phrase`'s words before and after the token, for a layout that
    sets the token apart."""
    if first.get("split_known", True):
        return "the primary wrote ", ""
    return "the primary's text reads ", " there (as the reference splits it: the server said " \
        "no tokens)"


def to_dict(sample: GenerationSample) -> dict[str, Any]:
    """A JSON-able dict of ``sample`` (tuples as lists), with the oldest format version that
    holds it (a record an older guard can read, where it needs nothing newer)."""
    data = asdict(sample)
    if sample.server_settings is None:
        del data["server_settings"]
    else:
        data["format_version"] = 5
        return data
    if any(getattr(sample.sampling, name) is not None for name in _PENALTY_NAMES):
        data["format_version"] = 4  # (an older reader takes either for both)
        return data
    for name in _VERSION_4_FIELDS:  # (fields an older reader refuses)
        del data["sampling"][name]
    if sample.add_special_tokens is not None or sample.echo:
        data["format_version"] = 3
    elif sample.reasoning_text is not None or sample.tools or sample.tool_calls or \
            sample.prompt_truncation is not None:
        data["format_version"] = 2
    else:
        data["format_version"] = 1
    return data


def _tuple(value: Any, name: str) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}: expected a list, got {type(value).__name__}")
    return tuple(value)


def _token(item: Any, index: int) -> TokenLogprob:
    if not isinstance(item, dict) or not isinstance(item.get("text"), str):
        raise ValueError(f"tokens[{index}]: expected an object with a string 'text'")
    logprob = item.get("logprob")
    if logprob is not None and not (isinstance(logprob, (int, float)) and not math.isnan(logprob)):
        raise ValueError(f"tokens[{index}].logprob: expected a number or null")
    top = tuple((str(t), float(lp))
                for t, lp in _tuple(item.get("top", ()), f"tokens[{index}].top"))
    token_id = item.get("token_id")
    if token_id is not None and not isinstance(token_id, int):
        raise ValueError(f"tokens[{index}].token_id: expected an integer or null")
    return TokenLogprob(item["text"], None if logprob is None else float(logprob), top, token_id)


_NAME_LISTS = ("stop", "constraints", "other_samplers")  # SamplingParams' tuples of strings


def from_dict(data: Any) -> GenerationSample:
    """The sample ``to_dict`` wrote; ValueError naming the field for anything else."""
    if not isinstance(data, dict):
        raise ValueError("generation sample: expected an object")
    version = data.get("format_version", FORMAT_VERSION)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(f"format_version: {version!r} is newer than this guard reads "
                         f"({FORMAT_VERSION})")
    for key in ("model", "endpoint", "completion_text"):
        if not isinstance(data.get(key), str):
            raise ValueError(f"{key}: expected a string")
    if data["endpoint"] not in ENDPOINTS:
        raise ValueError(f"endpoint: {data['endpoint']!r} is not one of {', '.join(ENDPOINTS)}")
    tokens = tuple(_token(t, i) for i, t in enumerate(_tuple(data.get("tokens", ()), "tokens")))
    sampling_data = data.get("sampling") or {}
    if not isinstance(sampling_data, dict):
        raise ValueError("sampling: expected an object")
    known = SamplingParams.__dataclass_fields__
    unknown = sorted(set(sampling_data) - set(known))
    if unknown:
        raise ValueError(f"sampling.{unknown[0]}: unknown field")
    sampling_data = dict(sampling_data)
    for name in _NAME_LISTS:
        names = _tuple(sampling_data.get(name) or (), f"sampling.{name}")
        if not all(isinstance(item, str) for item in names):
            raise ValueError(f"sampling.{name}: expected a list of strings")
        sampling_data[name] = names
    if version < 4 and sampling_data.get("repeat_penalty") is None:
        # Before version 4 one field held the penalty under either request name: say both, so
        # that every engine applies it, as the guard that wrote it did.
        sampling_data["repeat_penalty"] = sampling_data.get("repetition_penalty")
    sampling = SamplingParams(**sampling_data)
    messages = data.get("messages")
    ids = data.get("prompt_token_ids")
    template_args = data.get("chat_template_args")
    recorded = {**CHAT_TEMPLATE_ARGS, LLAMA_CPP_CONTINUATION: bool}
    if template_args is not None and (not isinstance(template_args, dict) or any(
            k not in recorded or not isinstance(v, recorded[k])
            for k, v in template_args.items())):
        raise ValueError("chat_template_args: expected an object of "
                         + ", ".join(CHAT_TEMPLATE_ARGS))
    reasoning = data.get("reasoning_text")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError("reasoning_text: expected a string or null")
    if not isinstance(data.get("tools", False), bool):
        raise ValueError("tools: expected a boolean")
    truncation = data.get("prompt_truncation")
    if truncation is not None and (not isinstance(truncation, int) or isinstance(truncation, bool)
                                   or truncation < -1):
        raise ValueError("prompt_truncation: expected an integer >= -1 or null")
    offered = data.get("tool_request")
    if offered is not None and not isinstance(offered, dict):
        raise ValueError("tool_request: expected an object or null")
    if not isinstance(data.get("echo", False), bool):
        raise ValueError("echo: expected a boolean")
    if not isinstance(data.get("add_special_tokens"), (bool, type(None))):
        raise ValueError("add_special_tokens: expected a boolean or null")
    reported = data.get("server_settings")
    if reported is not None and not isinstance(reported, dict):
        raise ValueError("server_settings: expected an object or null")
    called = _tuple(data.get("tool_calls", ()), "tool_calls")
    if not all(isinstance(name, str) for name in called):
        raise ValueError("tool_calls: expected a list of strings")
    rest = {k: data[k] for k in ("prompt", "finish_reason", "route", "request_id", "streamed",
                                  "unix_nanos", "request_seconds", "first_token_seconds",
                                  "upstream_model", "reasoning_text", "tools",
                                  "prompt_truncation", "add_special_tokens", "tool_request",
                                  "echo", "server_settings")
            if k in data}
    return GenerationSample(
        model=data["model"], endpoint=data["endpoint"], completion_text=data["completion_text"],
        tokens=tokens, sampling=sampling, tool_calls=called,
        messages=None if messages is None else tuple(_tuple(messages, "messages")),
        prompt_token_ids=(None if ids is None
                          else tuple(int(i) for i in _tuple(ids, "prompt_token_ids"))),
        chat_template_args=template_args, **rest)
