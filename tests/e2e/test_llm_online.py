"""The generative loop online, end to end (issue 29): real llama.cpp servers (llama-server) on the
real SmolLM2 GGUF ladder (a Q2_K primary, a Q8_0 fallback), guard's OpenAI-compatible edge in front
of them, the `openai` client as users call it, and the real reference (llama.cpp's F16 of the
same model, in the verifier). A sampled call reaches the verifier, the reference scores it, the
generation tier judges it, the detector accumulates, the route switches to the fallback LLM and
the primary is probed; an agreeing primary raises no alarm. (The LLM demo's test runs the same
loop in front of llama-cpp-python's servers: tests/e2e/test_cli.py.)

Sampling is 1.0 and completions are short (max_tokens 32 / 16) to keep the runtime modest; the
detector, ARL0 and min_samples are the task's defaults."""

from __future__ import annotations

import time
import urllib.request
from contextlib import contextmanager

import pytest

from llm_support import start_llama_cpp_upstream, stop_llama_server
from support import events, metric, scrape, wait_for, write_config

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
openai = pytest.importorskip("openai")
# Real servers generating and a real reference scoring on a shared CPU: minutes, not seconds.
pytestmark = pytest.mark.timeout(900)

from guard.plan.serving import load_config  # noqa: E402
from guard.serve.app import BackgroundServer  # noqa: E402
from guard.zoo.llm import PROMPTS, quant_ladder  # noqa: E402

CONTRACT_SERIES = {  # name -> type, as CONTRACT.md "Generative models" names them
    "guard_generation_tokens": "counter",
    "guard_generation_kld": "histogram",
    "guard_generation_top1_agreement": "histogram",
    "guard_generation_first_divergence_position": "histogram",
}


@contextmanager
def llama_server(path, alias: str, log_dir):
    """llama-server on one GGUF (tests/e2e/llm_support.py ``start_llama_cpp_upstream``), its
    URL."""
    server = start_llama_cpp_upstream(log_dir, path, alias)
    try:
        yield server.url
    finally:
        stop_llama_server(server)


@pytest.fixture(scope="module")
def ladder():
    return quant_ladder(("F16", "Q8_0", "Q2_K"))


@pytest.fixture(scope="module")
def upstreams(ladder, tmp_path_factory):
    logs = tmp_path_factory.mktemp("llama")
    with llama_server(ladder["Q2_K"], "smol-q2", logs) as q2, \
            llama_server(ladder["Q8_0"], "smol-q8", logs) as q8:
        yield {"Q2_K": q2, "Q8_0": q8}


def openai_block(url: str, alias: str) -> dict:
    return {"backend": "openai", "target": url, "model": alias,
            # llama.cpp's sampler defaults and order (the tier needs them for sampled calls),
            # and the logprobs guard asks for on sampled calls.
            "options": {"sample_logprobs": 5, "engine": "llama.cpp"}}


@contextmanager
def guard_in_front(folder, model: dict):
    config = load_config(write_config(folder, [model], http_port=0))
    with BackgroundServer(config) as server:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                               api_key="client-key", max_retries=0, timeout=120)
        yield server, client


def complete(client, prompt: str, max_tokens: int):
    raw = client.completions.with_raw_response.create(model="smol", prompt=prompt,
                                                      max_tokens=max_tokens, temperature=0)
    answer = raw.parse()
    return raw.headers.get("guard-route"), answer


def compared(server) -> float:
    return metric(scrape(server.metrics_port), "guard_mirror_total", model="smol",
                  outcome="compared")


def test_a_q2k_primary_is_caught_switched_to_the_fallback_and_probed(
        upstreams, ladder, tmp_path, caplog):
    caplog.set_level("INFO", logger="guard.events")
    model = {"name": "smol", "task": "generation",
             "primary": openai_block(upstreams["Q2_K"], "smol-q2"),
             "reference": {"backend": "llama_cpp", "path": str(ladder["F16"])},
             "fallback": openai_block(upstreams["Q8_0"], "smol-q8"),
             "mirror": {"sample_rate": 1.0, "timeout_s": 120},
             "policy": {"action": "fallback_model", "dwell_s": 1.0}}
    with guard_in_front(tmp_path, model) as (server, client):
        routes = []
        for prompt in PROMPTS:
            route, answer = complete(client, prompt, 32)
            assert answer.model == "smol" and answer.choices[0].logprobs is None  # guard's own
            # The switch's event reaches this process's log a moment after the verdict's count
            # reaches /metrics: a call may find the route switched before the test saw it.
            if route == "fallback":
                break
            routes.append(route)  # logprobs were stripped: the client did not ask for them
            # One call at a time, each scored before the next (the verdicts arrive in order).
            wait_for(lambda: compared(server) >= len(routes), timeout=180)
            if events(caplog, "route_transition"):
                break
        (switch,) = wait_for(lambda: events(caplog, "route_transition"), timeout=30)
        assert switch["to_route"] == "fallback" and switch["trigger"] == "policy"
        assert switch["evidence"]["detector"]["samples"] <= 10  # caught within 10 completions
        assert len(routes) <= 10 and set(routes) == {"primary"}
        divergence = switch["evidence"]["last_failure"]
        assert divergence["mode"] == "logprobs" and divergence["mean_kld"] > 0.05
        first = divergence["first_divergence"]
        assert first["primary_token"] and len(first["reference_top"]) == 5

        # Afterwards the fallback answers; past the dwell the primary is probed on sampled
        # calls, its completions scored (it still drifts: the route stays on the fallback).
        time.sleep(1.5)  # past the dwell (policy.dwell_s): the fallback's sampled calls probe
        before = compared(server)
        failed_before = metric(scrape(server.metrics_port), "guard_checks_total", model="smol",
                               tier="generation", result="fail")
        for prompt in PROMPTS[:3]:
            route, answer = complete(client, prompt, 32)
            assert route == "fallback" and answer.model == "smol"
        # A call the fallback answered is compared only by probing the primary with it.
        wait_for(lambda: compared(server) >= before + 3, timeout=300)
        values = scrape(server.metrics_port)
        assert metric(values, "guard_checks_total", model="smol", tier="generation",
                      result="fail") > failed_before  # the probed Q2_K still drifts
        assert metric(values, "guard_fallback_active", model="smol", scope="model") == 1
        assert metric(values, "guard_fallback_transitions_total", model="smol",
                      to="fallback_model") == 1
        assert complete(client, PROMPTS[0], 8)[0] == "fallback"
        # llama-server renders the prompts (/tokenize): scored on the server's own tokens.
        assert not events(caplog, "llama_server_rendering_unavailable")
        # The evidence the fleet rules pool: every scored completion of the primary (probes
        # too) adds its detector step; a Q2_K's steps are all for drift, past the threshold.
        assert evidence(values) >= metric(values, "guard_detector_threshold", model="smol",
                                          tier="generation")
        _assert_contract_series(server)


def test_a_q8_primary_raises_no_alarm(upstreams, ladder, tmp_path, caplog):
    caplog.set_level("INFO", logger="guard.events")
    model = {"name": "smol", "task": "generation",
             "primary": openai_block(upstreams["Q8_0"], "smol-q8"),
             "reference": {"backend": "llama_cpp", "path": str(ladder["F16"])},
             "mirror": {"sample_rate": 1.0, "timeout_s": 120},
             "policy": {"action": "alert"}}
    with guard_in_front(tmp_path, model) as (server, client):
        # Every prompt once: a second round of the same greedy calls (as this test made) is the
        # same completions again, the same evidence counted twice.
        calls = 0
        for prompt in PROMPTS:
            route, _ = complete(client, prompt, 16)
            assert route == "primary"
            calls += 1
        wait_for(lambda: compared(server) >= calls, timeout=300)
        assert events(caplog, "drift_alert") == []
        values = scrape(server.metrics_port)
        statistic = metric(values, "guard_detector_statistic", model="smol", tier="generation")
        threshold = metric(values, "guard_detector_threshold", model="smol", tier="generation")
        assert 0 <= statistic < threshold
        kld_sum = metric(values, "guard_generation_kld_sum", model="smol")
        assert kld_sum / calls < 0.05  # the completions' mean KLD: an agreeing primary
        assert evidence(values) < 0  # its completions' pooled evidence speaks against drift


def evidence(values) -> float:
    """guard_detector_evidence_nats_total, "for" minus "against" (what --fleet pools)."""
    return (metric(values, "guard_detector_evidence_nats_total", model="smol",
                   tier="generation", direction="for")
            - metric(values, "guard_detector_evidence_nats_total", model="smol",
                     tier="generation", direction="against"))


def _assert_contract_series(server) -> None:
    """The contract's generation series, parsed with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=5).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in CONTRACT_SERIES.items():
        assert families[name].type == kind, name
    tokens = {s.labels["route"]: s.value for s in families["guard_generation_tokens"].samples
              if s.name.endswith("_total") and s.labels.get("model") == "smol"}
    assert tokens["primary"] > 0 and tokens["fallback"] > 0
    kld_count = next(s.value for s in families["guard_generation_kld"].samples
                     if s.name.endswith("_count") and s.labels["model"] == "smol")
    assert kld_count >= 1
    checks = {s.labels["result"]: s.value for s in families["guard_checks"].samples
              if s.name.endswith("_total") and s.labels.get("tier") == "generation"}
    assert checks["fail"] >= 1
    for gauge in ("guard_drift_ratio", "guard_detector_statistic"):
        assert any(s.labels.get("tier") == "generation" for s in families[gauge].samples)
