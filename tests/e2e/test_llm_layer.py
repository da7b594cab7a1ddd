"""Which layer broke, online (issue 30): a real llama-cpp-python server serves SmolLM2's GGUF with
one tensor requantized to Q2_K, guard's OpenAI-compatible edge in front of it, the `openai`
client as users call it, the transformers reference (the shipped file, dequantized) in the
verifier. A completion fails the generation tier; tier 2 (``checks.activation``, ``on_failure``)
runs in the mirror worker on that completion's tokens, llama.cpp running the file the upstream
serves (``primary_gguf``) with its eval callback, and names the layer: an
``activation_divergence`` event and ``guard_checks_total{tier="activation"}``."""

from __future__ import annotations

import pytest

from llm_support import start_llama_server, stop_llama_server
from support import events, metric, scrape, wait_for
from test_llm_online import guard_in_front, openai_block

pytest.importorskip("llama_cpp.server", reason="llama-cpp-python[server] is not installed")
pytest.importorskip("transformers", reason="transformers (the llm extra) is not installed")
openai = pytest.importorskip("openai")
# A real server, a transformers reference and tier 2's own sides on a shared CPU: minutes.
pytestmark = pytest.mark.timeout(1200)

from guard.zoo import llm  # noqa: E402

BROKEN = ("blk.3.ffn_down.weight", "Q2_K")


def test_the_broken_layer_of_the_served_gguf_is_named(tmp_path, caplog):
    caplog.set_level("INFO", logger="guard.events")
    broken = llm.one_tensor_requantized(*BROKEN)
    upstream = start_llama_server(tmp_path, gguf=broken, alias="smol-broken")
    try:
        model = {"name": "smol", "task": "generation",
                 "primary": openai_block(upstream.url, "smol-broken"),
                 "reference": {"backend": "transformers", "path": str(llm.smollm2_gguf())},
                 "mirror": {"sample_rate": 1.0, "timeout_s": 300},
                 # Every completion fails the generation tier, so that on_failure runs tier 2.
                 "checks": {"generation": {"max_mean_kld": 1e-9},
                            "activation": {"on_failure": True, "primary_gguf": str(broken)}},
                 "policy": {"action": "alert"}}
        with guard_in_front(tmp_path, model) as (server, client):
            raw = client.completions.with_raw_response.create(
                model="smol", prompt=llm.PROMPTS[0], max_tokens=8, temperature=0)
            assert raw.headers.get("guard-route") == "primary"
            wait_for(lambda: events(caplog, "activation_divergence"), timeout=900,
                     interval=0.5)
            (event,) = events(caplog, "activation_divergence")
            first = event["first_divergence"]
            assert first["layer"] == "model.layers.3.mlp.down_proj"
            assert first["basis"].startswith("isolated error stands out from its peers'")
            assert event["pair"] == "transformers/llama_cpp"
            values = scrape(server.metrics_port)
            assert metric(values, "guard_checks_total", model="smol", tier="activation",
                          result="fail") == 1
            assert metric(values, "guard_checks_total", model="smol", tier="generation",
                          result="fail") == 1
    finally:
        stop_llama_server(upstream)
