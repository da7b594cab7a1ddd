"""JSONL prompt sets: the input of a generative model's replay when there is no capture.

One JSON object per line, either a completion prompt or a chat::

    {"prompt": "The capital of France is"}
    {"messages": [{"role": "user", "content": "Name three primary colours."}], "max_tokens": 24}
    {"prompt": "Water boils at 100 degrees Celsius at sea level.", "echo": true}

Replay then asks the model's primary (its ``openai`` upstream) for each completion, with the
top-5 logprobs per token, and scores it with the reference, as llama-perplexity scores a
quantized model on a text. A line may also set ``id`` (the request id the report shows) and
the OpenAI request's sampling fields (``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``seed``, ``stop``, ``repeat_penalty``/``repetition_penalty``, ``repeat_last_n``,
``presence_penalty``, ``frequency_penalty``). Defaults (where a line does not say): greedy
(``temperature`` 0: the same completion every run, so two replays of a set compare) and
``max_tokens`` 32 (SmolLM2's calibration ladder, docs/generation.md).

``"echo": true`` (a completions prompt) scores the text itself, as ``llama-perplexity
--kl-divergence`` scores a corpus: the primary is asked for the prompt back with its tokens'
logprobs (``echo``, as lm-eval's loglikelihood calls ask; ``max_tokens`` 0 unless the line
says) and every token after the first is compared with the reference's distribution there.
The server must echo as vLLM does (docs/generation.md, "Echo calls"): llama-cpp-python's echo
is refused as not comparable.

A line that is not such an object (not JSON, neither or both of ``prompt`` and ``messages``,
an unknown key: a misspelt ``max_token`` must not silently do nothing) is skipped and counted,
its line number kept for the report; blank lines are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from guard.protocol.generation import GenerationSample
from guard.protocol.openai import sampling_params
from guard.protocol.openai.json_edits import read_json

SUFFIX = ".jsonl"
DEFAULT_MAX_TOKENS = 32
DEFAULT_TEMPERATURE = 0.0
SAMPLING_KEYS = frozenset({
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "repeat_penalty",
    "repetition_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty"})
_KEYS = SAMPLING_KEYS | {"prompt", "messages", "id", "echo"}
ECHO_MAX_TOKENS = 0  # an echo line scores its text: nothing generated unless it says
_PROBLEMS_KEPT = 5


@dataclass
class PromptStats:
    path: str = ""
    lines: int = 0
    position: int = 0  # bytes read so far (progress)
    records: int = 0
    unreadable: int = 0
    problems: list[str] = field(default_factory=list)  # the first few, for humans

    def bad(self, line: int, why: str) -> None:
        self.unreadable += 1
        if len(self.problems) < _PROBLEMS_KEPT:
            self.problems.append(f"line {line}: {why}")


def _message_problem(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or \
                not isinstance(message.get("content"), str):
            return f"messages[{k}]: expected an object with string 'role' and 'content'"
    return ""


def parse_line(text: str, model: str, request_id: str) -> GenerationSample:
    """One line as a call without a completion; ValueError saying why it is not one."""
    try:
        body = read_json(text, strict=True)  # (guard writes the request from it)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError("expected a JSON object")
    unknown = sorted(set(body) - _KEYS)
    if unknown:
        raise ValueError(f"unknown key '{unknown[0]}' (a line holds 'prompt' or 'messages', "
                         f"'id' and sampling fields: {', '.join(sorted(SAMPLING_KEYS))})")
    if ("prompt" in body) == ("messages" in body):
        raise ValueError("give either 'prompt' (a string) or 'messages' (a chat)")
    if "prompt" in body and not isinstance(body["prompt"], str):
        raise ValueError("'prompt' must be a string")
    problem = _message_problem(body["messages"]) if "messages" in body else ""
    if problem:
        raise ValueError(problem)
    if "id" in body and not isinstance(body["id"], (str, int)):
        raise ValueError("'id' must be a string or an integer")
    echo = body.get("echo", False)
    if not isinstance(echo, bool) or (echo and "prompt" not in body):
        raise ValueError("'echo' must be true or false, and only with 'prompt' (a text to "
                         "score)")
    asked = {"temperature": DEFAULT_TEMPERATURE,
             "max_tokens": ECHO_MAX_TOKENS if echo else DEFAULT_MAX_TOKENS,
             **{k: v for k, v in body.items() if k in SAMPLING_KEYS}}
    sampling = sampling_params(asked)
    for key in ("temperature", "max_tokens"):
        if getattr(sampling, key) is None:
            raise ValueError(f"'{key}' must be a number")
    chat = "messages" in body
    return GenerationSample(
        model=model, endpoint="chat" if chat else "completions", completion_text="", tokens=(),
        sampling=sampling, prompt=None if chat else body["prompt"],
        messages=tuple(body["messages"]) if chat else None,
        request_id=str(body.get("id", request_id)), echo=echo)


def read_prompts(path: Path, model: str, stats: PromptStats) -> Iterator[GenerationSample]:
    """The calls of one prompt set, in line order; bad lines are counted in ``stats``."""
    stats.path = str(path)
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            stats.position += len(raw)
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            stats.lines += 1
            try:
                call = parse_line(line, model, f"{path.name}:{number}")
            except ValueError as exc:
                stats.bad(number, str(exc))
                continue
            stats.records += 1
            yield call
