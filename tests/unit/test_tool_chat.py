"""The Hermes-style template the tool-call tests serve (guard/zoo/tool_chat.py) renders a chat
without tools as SmolLM2's own template does, so that a healthy llama-server serving it is no
template drift; with tools it writes each definition into the system turn."""

from __future__ import annotations

import functools
import json

import pytest

jinja2 = pytest.importorskip("jinja2")
gguf = pytest.importorskip("gguf")

from guard.zoo.llm import smollm2_gguf  # noqa: E402
from guard.zoo.tool_chat import HERMES_TEMPLATE, WEATHER_TOOL, weather_chat  # noqa: E402

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "How are you?"}],
    [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Later rules."}],
    weather_chat("Paris"),
]


def render(template: str, messages: list[dict], tools: list | None = None) -> str:
    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    environment.filters["tojson"] = lambda value: json.dumps(value)
    return environment.from_string(template).render(messages=messages, tools=tools,
                                                    add_generation_prompt=True)


@functools.cache
def own_template() -> str:
    reader = gguf.GGUFReader(str(smollm2_gguf()))
    field = reader.fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


@pytest.mark.parametrize("messages", CHATS)
def test_a_chat_without_tools_renders_as_smollm2s_own_template(messages):
    assert render(HERMES_TEMPLATE, messages) == render(own_template(), messages)


def test_tools_are_written_into_the_system_turn():
    rendered = render(HERMES_TEMPLATE, weather_chat("Paris"), [WEATHER_TOOL])
    system = rendered.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou call the tool get_weather")
    assert json.dumps(WEATHER_TOOL) in system.split("<tools>\n")[1]
    assert rendered.endswith("Weather in Paris?<|im_end|>\n<|im_start|>assistant\n")
