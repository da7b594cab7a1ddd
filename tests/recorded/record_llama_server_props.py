"""Record what llama.cpp's own server (llama-server) answers at GET /props, which guard reads
for an ``engine: llama.cpp`` primary's sampling defaults (tests/unit/test_generation_math.py
and tests/unit/test_llama_server.py read them): started on SmolLM2's F16 GGUF with its
built-in defaults, with sampling flags (as a model card's recommended settings are passed:
``--temp 0.6 --top-k 20 --min-p 0``) and with another sampler chain (``--samplers``); and its
answers to calls with logprobs that end at the end-of-generation token (its last logprobs
entry has an empty text and an id), plain and streamed; and answers in Japanese and Russian
whose characters the model sampled as several byte tokens (one logprobs entry per character).

llama-server is not part of guard's install (llama-cpp-python builds the library, not the
server): build it from the llama.cpp that llama-cpp-python vendors, e.g.
``cmake -S vendor/llama.cpp -B build -DLLAMA_CURL=OFF && cmake --build build -t llama-server``.

    .venv/bin/python tests/recorded/record_llama_server_props.py PATH/TO/llama-server

Writes tests/recorded/llama_server_props.json (the server's version line and the date with
each answer).
"""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # guard

# Calls with the logprobs guard adds to sampled calls, short enough to end on their own.
CALLS = (
    ("completions", {"prompt": "The capital of France is", "max_tokens": 40, "seed": 3,
                     "logprobs": 5, "temperature": 0.6}),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "seed": 4,
              "logprobs": True, "top_logprobs": 5, "temperature": 0}),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "seed": 4,
              "logprobs": True, "top_logprobs": 5, "temperature": 0, "stream": True}),
)
# Calls whose answer holds characters the model sampled as several byte tokens: llama-server
# writes each such character as one logprobs entry (the last piece's id), the others left out.
CALLS_IN_PIECES = (
    ("chat", {"messages": [{"role": "user", "content": "日本の首都はどこですか？"}],
              "max_tokens": 12, "seed": 0, "logprobs": True, "top_logprobs": 5}),
    ("chat", {"messages": [{"role": "user", "content": "Напиши короткую историю."}],
              "max_tokens": 12, "seed": 3, "logprobs": True, "top_logprobs": 5}),
)
STARTS = {
    "props": (),
    "props_with_flags": ("--temp", "0.6", "--top-k", "20", "--min-p", "0"),
    "props_with_chain": ("--samplers", "penalties;temperature;top_k;min_p;top_p"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(base: str, calls=CALLS) -> list[dict]:
    """``calls`` asked of the server: each request and its answer (a streamed one's
    events)."""
    recorded = []
    for endpoint, body in calls:
        body = dict(body, model="smol")
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as answer:
            text = answer.read().decode()
        if body.get("stream"):
            events = [json.loads(line[6:]) for line in text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            recorded.append({"endpoint": endpoint, "request": body, "events": events})
        else:
            recorded.append({"endpoint": endpoint, "request": body, "answer": json.loads(text)})
    return recorded


def _props(binary: str, gguf: Path, flags: tuple[str, ...],
           calls: list | None = None, pieces: list | None = None) -> dict:
    port = _free_port()
    log = Path(tempfile.mkdtemp()) / "llama-server.log"
    with log.open("w") as out:
        server = subprocess.Popen([binary, "-m", str(gguf), "--host", "127.0.0.1",
                                   "--port", str(port), "-c", "512", "-t", "1", *flags],
                                  stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/props",
                                            timeout=2) as answer:
                    props = json.loads(answer.read())
                props["model_path"] = Path(props.get("model_path", "")).name  # (this machine's)
                if calls is not None:
                    calls.extend(_answers(f"http://127.0.0.1:{port}"))
                    pieces.extend(_answers(f"http://127.0.0.1:{port}", CALLS_IN_PIECES))
                return props
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(log.read_text()[-3000:]) from None
                time.sleep(0.3)
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    from guard.zoo.llm import quant_ladder

    binary = sys.argv[1]
    version = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=60).stderr.strip().splitlines()
    gguf = quant_ladder(("F16",))["F16"]
    recorded: dict = {"llama_server": version[0] if version else "",
                      "recorded": datetime.date.today().isoformat(),
                      "model": "SmolLM2-135M-Instruct F16 (guard.zoo.llm.quant_ladder)"}
    answers: list = []
    pieces: list = []
    for name, flags in STARTS.items():
        recorded[name] = _props(binary, gguf, flags, answers if name == "props" else None,
                                pieces)
        recorded[name + "_flags"] = list(flags)
    for call in answers + pieces:  # (this machine's path, as the server names its model)
        for part in [call.get("answer")] + call.get("events", []):
            if isinstance(part, dict) and "model" in part:
                part["model"] = Path(part["model"]).name
    recorded["answers"] = answers
    recorded["answers_in_pieces"] = pieces
    out = HERE / "llama_server_props.json"
    out.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"wrote {out} ({recorded['llama_server']})")


if __name__ == "__main__":
    main()
