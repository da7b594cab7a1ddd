"""Which sampled calls guard asks llama-server to render (guard/backends/llama_server_prompts.py),
and for which primaries. What the server answers is tested against a real llama-server in
tests/e2e/test_llama_cpp_server.py."""

from __future__ import annotations

import pytest

from guard.backends.llama_server_prompts import LlamaServerPrompts, for_primary
from guard.config.backend import BackendConfig
from guard.protocol.generation import GenerationSample

CHAT = GenerationSample(model="m", endpoint="chat", completion_text="", tokens=(),
                        messages=({"role": "user", "content": "Hi"},))
TEXT = GenerationSample(model="m", endpoint="completions", completion_text="", tokens=(),
                        prompt="Once upon a time")


def primary(**options) -> BackendConfig:
    return BackendConfig(backend="openai", target="http://127.0.0.1:1", model="m",
                         options=options)


def test_only_a_llama_server_primary_is_asked_and_only_while_the_option_is_on():
    assert isinstance(for_primary(primary(engine="llama.cpp"), 5.0), LlamaServerPrompts)
    assert for_primary(primary(engine="llama.cpp", tokenize_prompts=False), 5.0) is None
    for engine in ("vllm", "llama-cpp-python", "openai", "unknown"):
        assert for_primary(primary(engine=engine), 5.0) is None
    assert for_primary(None, 5.0) is None


@pytest.mark.parametrize("sample,asked", [
    (CHAT, True),
    (TEXT, True),
    (GenerationSample(model="m", endpoint="chat", completion_text="", tokens=(), messages=()),
     False),  # nothing to render
    (GenerationSample(model="m", endpoint="completions", completion_text="", tokens=(),
                      prompt=None, prompt_token_ids=(1, 2)), False),  # the client's own ids
    (GenerationSample(model="m", endpoint="chat", completion_text="", tokens=(),
                      messages=CHAT.messages, prompt_token_ids=(1, 2)), False),  # told
    (GenerationSample(model="m", endpoint="chat", completion_text="", tokens=(),
                      messages=CHAT.messages, tools=True,
                      tool_request={"tools": [{"type": "function"}]}), True),  # rendered so
    (GenerationSample(model="m", endpoint="chat", completion_text="", tokens=(),
                      messages=CHAT.messages, tools=True), False),  # its tool fields unkept
    (GenerationSample(model="m", endpoint="completions", completion_text="", tokens=(),
                      prompt="x", echo=True), False),
    (GenerationSample(model="m", endpoint="completions", completion_text="", tokens=(),
                      prompt="x", prompt_truncation=8), False),  # the server does not cut
    (GenerationSample(model="m", endpoint="completions", completion_text="", tokens=(),
                      prompt="x", add_special_tokens=False), False),  # nor read this
])
def test_what_is_asked(sample, asked):
    assert LlamaServerPrompts.asks(sample) is asked


def test_a_server_that_cannot_be_reached_leaves_the_sample_to_the_reference():
    """A call that fails (nothing listens on the port) returns the sample as it came, and the
    next one is asked again (only a server without the endpoints is not)."""
    ask = LlamaServerPrompts(primary(engine="llama.cpp"), timeout_s=2.0)
    assert ask(CHAT) is CHAT
    assert ask.unavailable is None
