"""Asking llama.cpp's server (llama-server) how it rendered and tokenized a sampled call's prompt.

The reference must score the prompt the server read (issue: template and tokenizer drift are
findings of their own, never noise). vLLM tells the prompt's token ids in its answer
(``options.sample_token_ids``); llama-server tells them in no answer, but it answers the two
steps it took, through the same code its completion endpoints run:

- ``POST /apply-template`` renders a chat's messages as ``/v1/chat/completions`` does (the
  template it serves: its jinja engine on the GGUF's template, a ``--chat-template``, or a
  built-in one under ``--no-jinja``; a final assistant message continued, its
  ``--prefill-assistant``; the request's ``chat_template_kwargs``), answering ``{"prompt"}``;
- ``POST /tokenize`` with ``add_special`` and ``parse_special`` tokenizes a text as its
  completion endpoints tokenize a prompt (BOS where the model adds one, special-token text
  read as the special token), answering ``{"tokens"}``.

The sample then carries those ids (``prompt_token_ids``): the reference scores them and
compares them with its own rendering (guard/backends/scoring.py ``Scorer.render``), so a server
that renders otherwise is the finding ``prompt_rendered_otherwise`` with the first token that
differs, where before the reference scored its own rendering and said ``approximate``.

It runs off the request path, in the verifier's mirror worker (and for ``guard replay``'s
generated prompts), with the standard library's HTTP client on the thread the mirror watches:
two small calls per sampled call, which llama-server answers on its HTTP threads without a
generation slot. A server that does not answer them (404, 405, 501: an older llama-server, a
proxy that passes only ``/v1``) is not asked again (event ``llama_server_rendering_unavailable``,
once) and the reference renders alone, as before; a call that fails otherwise (a timeout, a
restart) leaves that one sample to the reference's rendering.

A chat that offers tools is asked with its tool fields as the client sent them
(``GenerationSample.tool_request``: llama-server renders the definitions into the prompt with
its template, under ``--jinja``); it is compared only on the ids asked here and the output's ids
from the answer's logprobs (each entry's ``id``), so one whose ask fails is not comparable
(``tools``), never scored on the reference's own rendering.

Not asked: a sample whose ids the answer told already, a tool chat whose tool fields the sample
does not hold (a record written before they were kept), a prompt the client asked cut
(``truncate_prompt_tokens``) or tokenized without special tokens (``add_special_tokens``:
llama-server reads neither; the reference's rendering follows the request, as before), and an
echo call.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from guard.backends.openai import (OpenAIOptions, UpstreamStatus, authorization, base_url,
                                  post_json)
from guard.errors import BackendError
from guard.observe.events import emit
from guard.protocol.generation import GenerationSample

# Statuses that say the server has no such endpoint (not that this one call failed).
ABSENT = frozenset({404, 405, 501})


class LlamaServerPrompts:
    """``prompts(sample)``: ``sample`` with the prompt's token ids as the primary's llama-server
    rendered and tokenized it, or ``sample`` unchanged where they are not asked or not told.
    Built for a primary block with ``options.engine: llama.cpp`` and ``tokenize_prompts`` on
    (:func:`for_primary`)."""

    def __init__(self, spec, timeout_s: float):
        self.base = base_url(spec.target or "")
        self.model = spec.model
        self.timeout_s = timeout_s
        self._authorization = authorization(OpenAIOptions.model_validate(spec.options or {}))
        self.unavailable: str | None = None  # why the server is not asked any more

    def __call__(self, sample: GenerationSample) -> GenerationSample:
        if self.unavailable is not None or not self.asks(sample):
            return sample
        try:
            if sample.endpoint == "chat":
                text = self._rendered_chat(sample)
            else:
                assert sample.prompt is not None  # (asks)
                text = sample.prompt
            ids = self._tokens(text)
        except _Absent as absent:
            self.unavailable = str(absent)
            emit("llama_server_rendering_unavailable", model=sample.model, target=self.base,
                 error=self.unavailable, note="the reference renders the prompts itself "
                 "(approximate) until a reload; set options.tokenize_prompts: false to stop "
                 "asking")
            return sample
        except BackendError:
            return sample  # this one call: the reference's own rendering, marked approximate
        return replace(sample, prompt_token_ids=ids)

    @staticmethod
    def asks(sample: GenerationSample) -> bool:
        """Whether the server is asked for ``sample``'s prompt (see the module's docs)."""
        if sample.prompt_token_ids is not None or sample.echo or \
                sample.prompt_truncation is not None or sample.add_special_tokens is not None:
            return False
        if sample.tools and sample.tool_request is None:
            return False
        if sample.endpoint == "chat":
            return bool(sample.messages)
        return isinstance(sample.prompt, str)

    def _rendered_chat(self, sample: GenerationSample) -> str:
        body: dict[str, Any] = {"model": self.model, "messages": list(sample.messages or ())}
        body.update(sample.chat_template_args or {})  # (the fields as the client sent them)
        body.update(sample.tool_request or {})
        prompt = self._post("/apply-template", body).get("prompt")
        if not isinstance(prompt, str):
            raise BackendError(f"{self._where('/apply-template')}: no prompt in the answer")
        return prompt

    def _tokens(self, text: str) -> tuple[int, ...]:
        tokens = self._post("/tokenize", {"content": text, "add_special": True,
                                          "parse_special": True}).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise BackendError(f"{self._where('/tokenize')}: no list of token ids in the "
                               "answer")
        return tuple(tokens)

    def _where(self, path: str) -> str:
        return f"primary {self.model}@{self.base}: POST {path}"

    def _post(self, path: str, body: dict) -> dict:
        where = self._where(path)
        try:
            answer = post_json(self.base + path, json.dumps(body).encode(),
                               self._authorization, self.timeout_s, where)
        except UpstreamStatus as exc:
            if exc.status in ABSENT:
                raise _Absent(str(exc), exc.status, exc.text) from None
            raise
        if not isinstance(answer, dict):
            raise BackendError(f"{where}: the answer is no JSON object")
        return answer


def for_primary(spec, timeout_s: float) -> LlamaServerPrompts | None:
    """The asker for a primary block whose server is llama-server (``options.engine:
    llama.cpp``) with ``options.tokenize_prompts`` on; None for any other."""
    if spec is None or spec.backend != "openai":
        return None
    options = OpenAIOptions.model_validate(spec.options or {})
    if not options.asks_prompt_ids:
        return None
    return LlamaServerPrompts(spec, timeout_s)


class _Absent(UpstreamStatus):
    """The server has no such endpoint."""
