"""Tool calls for the generative tests and benchmarks: a Hermes-style chat template and a
weather tool SmolLM2 calls when shown how.

SmolLM2's own template renders no tools (llama-server reports ``supports_tools: false`` and
ignores them). Served with :data:`HERMES_TEMPLATE` (``llama-server --jinja
--chat-template-file``), llama-server renders the tool definitions into the system turn (Qwen
2.5's form, on SmolLM2's ChatML tokens) and, reading ``<tool_call>`` in the template, parses
the calls out of the answer (``message.tool_calls``) under its lazy tool-call grammar, as it
does for the Hermes-form models people serve. :func:`weather_chat` is the few-shot chat
(a system prompt and one answer in the form) after which the model calls
``get_weather`` for the city asked.

A chat without tools renders as SmolLM2's own template renders it (its default system prompt
before a chat that opens without one included), token for token: only the tools are new, so a
healthy server behind guard is not template drift (tests/unit/test_tool_chat.py holds the two
equal).
"""

from __future__ import annotations

import json
from pathlib import Path

# SmolLM2's own system prompt, which its template writes before a chat that opens without one.
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

HERMES_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- else %}{%- set system = '" + DEFAULT_SYSTEM + "' %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures "
    "within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n'
    "</tool_call>' }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- for call in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + "
    "'\", \"arguments\": ' }}"
    "{{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

def llama_server_flags(folder: Path) -> tuple[str, ...]:
    """llama-server's flags to serve :data:`HERMES_TEMPLATE` (written into ``folder``)."""
    template = folder / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    return ("--jinja", "--chat-template-file", str(template))


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

CITIES = ("Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Delhi", "Sydney", "Toronto", "Madrid",
          "Nairobi", "Berlin", "Seoul")


def tool_call_text(city: str) -> str:
    """An answer that calls ``get_weather`` for ``city``, in Hermes' form."""
    call = json.dumps({"name": "get_weather", "arguments": {"city": city}})
    return f"<tool_call>\n{call}\n</tool_call>"


def weather_chat(city: str) -> list[dict]:
    """The few-shot chat that asks for ``city``'s weather (the example asks for Rome's)."""
    return [{"role": "system",
             "content": "You call the tool get_weather(city) in <tool_call> tags."},
            {"role": "user", "content": "Weather in Rome?"},
            {"role": "assistant", "content": tool_call_text("Rome")},
            {"role": "user", "content": f"Weather in {city}?"}]
