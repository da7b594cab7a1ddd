"""Asking a generative primary (an ``openai`` backend block) for a completion of a call, outside
the request path: the verifier's probe of a primary while its fallback serves, and ``guard
replay``'s generation of a JSONL prompt set.

The request is rebuilt from a :class:`GenerationSample` (prompt or messages, the sampling
transform the client asked for, ``max_tokens``) and asks for ``top_logprobs`` so that the tier
compares per token, and for the token ids where the block asks them of sampled calls
(``options.sample_token_ids``: the prompt as the server rendered it). An answer the edge would
not have compared (a prompt the server may have cut without saying what it kept, tools
without ids: :func:`guard.protocol.openai.unusable`) is an error of the probe, never scored.

It is not streamed (nobody waits for it token by token), it goes out with the upstream's key
(``options.api_key_env``) and never with anything a client sent: the sample carries no
headers. The standard library's HTTP client does it (guard/backends/openai.py ``post_json``):
one call at a time, on a thread the caller watches (the mirror's ``mirror.timeout_s``), so a
pooled asynchronous client would buy nothing here.
"""

from __future__ import annotations

import json
from dataclasses import replace

from guard.backends.openai import (REFUSALS, OpenAIOptions, UpstreamStatus, authorization,
                                  base_url, post_json)
from guard.errors import BackendError
from guard.observe.events import emit
from guard.protocol.generation import GenerationSample
from guard.protocol.openai import (CallShape, Completion, build_sample, gather, lists_tools,
                                   parse_request, unusable)

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PROBE_TOP_LOGPROBS = 5  # alternatives per token the probe asks for (the KL's top-k)
# What an operator does about a probe answer that cannot be compared, by unusable()'s reason.
UNUSABLE_ADVICE = {
    "input": "the call cuts its prompt (truncate_prompt_tokens): set the primary block's "
             "options.sample_token_ids so that the server says what it kept",
    "tools": "a chat with tools is compared on the server's token ids: set the primary "
             "block's options.sample_token_ids (vLLM)",
    "reasoning": "the answer's reasoning comes without its tokens",
    "echo": "the server's echo tokens do not spell its text (llama-cpp-python's are a "
            "position off)",
}


def probe_body(sample: GenerationSample, upstream_model: str, top: int,
               token_ids: bool = False) -> dict:
    """The request the probe sends: the client's call as the sample recorded it, with ``top``
    logprobs per token (0: those the client asked, if any) and, with ``token_ids``, the
    prompt's and the completion's token ids (vLLM's ``return_token_ids``)."""
    s = sample.sampling
    body: dict = {"model": upstream_model, "stream": False}
    top_logprobs = top or s.logprobs
    if sample.endpoint == "chat":
        body["messages"] = list(sample.messages or ())
        body.update(sample.tool_request or {})  # the tools offered: the same rendering
        # The client's arguments to the template (chat_template_kwargs ...): the same prompt.
        body.update(sample.chat_template_args or {})
        if top_logprobs is not None:
            body["logprobs"], body["top_logprobs"] = True, top_logprobs
    else:
        # A prompt the client gave as token ids has no text: its ids, as the server took them.
        body["prompt"] = sample.prompt if sample.prompt is not None else list(
            sample.prompt_token_ids or ())
        if top_logprobs is not None:
            body["logprobs"] = top_logprobs
    for key in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                "frequency_penalty", "seed"):
        value = getattr(s, key)
        if value is not None:
            body[key] = value
    # The repetition penalty under the name(s) the client used: vLLM reads repetition_penalty
    # and ignores repeat_penalty (with a warning), llama.cpp's servers the other way round, so
    # the probe is drawn with the penalty the client's call was (a record from before the two
    # were kept apart holds both: either server then applies it).
    for key in ("repetition_penalty", "repeat_penalty", "repeat_last_n"):
        if getattr(s, key) is not None:
            body[key] = getattr(s, key)
    # At most as many tokens as the primary's answer had: a probe costs what the call did (an
    # echo call's tokens are mostly its prompt's: the API's default of 16 where it said none).
    body["max_tokens"] = s.max_tokens if s.max_tokens is not None else (
        16 if sample.echo else max(len(sample.tokens), 1))
    if sample.echo:  # the prompt back with its tokens' logprobs, as the client asked
        body["echo"] = True
    if s.stop:
        body["stop"] = list(s.stop)
    if sample.prompt_truncation is not None:  # the prompt the server read was cut so
        body["truncate_prompt_tokens"] = sample.prompt_truncation
    if sample.add_special_tokens is not None:  # the prompt tokenized as the client asked
        body["add_special_tokens"] = sample.add_special_tokens
    if token_ids and not sample.echo:  # (vLLM then leaves the echoed prompt out of the text)
        body["return_token_ids"] = True
    return body


class PrimaryProbe:
    """Asks the primary upstream (an ``openai`` backend block) for a sampled call again."""

    def __init__(self, spec, timeout_s: float, top: int = PROBE_TOP_LOGPROBS):
        options = spec.options or {}
        self.base = base_url(spec.target)
        self.model = spec.model
        self.timeout_s = timeout_s
        self.top = top
        self.token_ids = bool(options.get("sample_token_ids"))  # as the edge asks them
        # The shapes of call (guard/protocol/openai/requests.py CallShape) the upstream refused
        # a probe's logprobs and token ids on, then took without them: never asked them again.
        self.refused: set[CallShape] = set()
        parsed = OpenAIOptions.model_validate(options)
        self._authorization = authorization(parsed)
        # A tool chat's prompt ids are asked of the server after the probe's answer
        # (llama-server: guard/backends/llama_server_prompts.py).
        self.prompt_ids_asked = parsed.asks_prompt_ids

    def __call__(self, sample: GenerationSample) -> GenerationSample:
        """The primary's completion of ``sample``'s call, as a sample of its own (route
        ``primary``); BackendError when the upstream fails or answers an error.

        A server that refuses the call with guard's logprobs or token ids (400, 422: a vLLM
        whose --max-logprobs is below the probe's; 500: llama-cpp-python's server started
        without --logits_all) is asked the client's call as it was;
        where that is answered, the probe asks them no more (said once, as the edge says it:
        ``openai_additions_refused``) and the answer is compared without them, per shape of
        call as the edge remembers it. Otherwise no probe ever succeeded, and a fallback would
        never route back."""
        # (A probe is never streamed; the tools it lists are the client's.)
        shape = CallShape(sample.endpoint, False,
                          lists_tools(sample.endpoint, sample.tool_request or {}))
        additions = shape not in self.refused
        try:
            data, answer = self._ask(sample, additions)
        except UpstreamStatus as refused:
            if refused.status not in REFUSALS or not additions:
                raise
            data, answer = self._ask(sample, False)
            additions = False
            self.refused.add(shape)
            emit("openai_additions_refused", model=sample.model, route="probe",
                 target=self.base, status=refused.status, error=refused.text,
                 options=["the probe's logprobs and token ids"], shape=shape.describe(),
                 note="the call as the client sent it was answered; the probe asks them no "
                 "more on calls of this shape (vLLM: --max-logprobs must be at least 5)")
        completion = Completion()
        gather(completion, sample.endpoint, answer, streamed=False)
        if completion.error:
            raise BackendError(f"primary {self.model}@{self.base} answered an error: "
                               f"{completion.error[:200]}")
        call = parse_request(sample.endpoint, data)
        why = unusable(completion, call, self.prompt_ids_asked)
        if why:
            advice = UNUSABLE_ADVICE.get(why)
            raise BackendError(f"primary {self.model}@{self.base}: its answer to the probe "
                               f"cannot be compared ({why}{': ' + advice if advice else ''})")
        probed = build_sample(call, completion, route="primary", request_id=sample.request_id,
                              guard_logprobs=additions)
        # The sample is the client's call: its name and transform, not the probe's.
        return replace(probed, model=sample.model, sampling=sample.sampling)

    def _ask(self, sample: GenerationSample, additions: bool) -> tuple[bytes, dict]:
        """POST the probe of ``sample`` (with guard's logprobs and token ids, or as the client
        asked): the body sent and the JSON answer. UpstreamStatus for an error status (400,
        422: a refusal), BackendError for any other failure."""
        body = probe_body(sample, self.model, self.top if additions else 0,
                          self.token_ids and additions)
        data = json.dumps(body).encode()
        return data, post_json(self.base + PATHS[sample.endpoint], data, self._authorization,
                               self.timeout_s, f"primary {self.model}@{self.base}")
