"""Which layer broke, online and in replay (issue 30): a real llama.cpp server (llama-server) serves
SmolLM2's GGUF with one tensor requantized to Q2_K, the transformers reference (the shipped file,
dequantized) scores it. Online: guard's OpenAI-compatible edge in front of the server, the `openai`
client as users call it; a completion fails the generation tier and tier 2 (``checks.activation``,
``on_failure``) runs in the mirror worker on that completion's tokens, llama.cpp running the file
the upstream serves (``primary_gguf``) with its eval callback: an ``activation_divergence`` event
and ``guard_checks_total{tier="activation"}`` name the layer. In replay: ``guard replay`` of a
prompt set (the primary generates over HTTP) names it in report.json."""

from __future__ import annotations

import json

import pytest

from llm_support import start_llama_cpp_upstream, stop_llama_server
from support import events, metric, scrape, wait_for, write_config
from test_llm_online import guard_in_front, openai_block

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
pytest.importorskip("transformers", reason="transformers (the llm extra) is not installed")
openai = pytest.importorskip("openai")
# A real server, a transformers reference and tier 2's own sides on a shared CPU: minutes.
pytestmark = pytest.mark.timeout(1200)

from guard.cli import main  # noqa: E402
from guard.zoo import llm  # noqa: E402

BROKEN = ("blk.3.ffn_down.weight", "Q2_K")
LAYER = "model.layers.3.mlp.down_proj"


@pytest.fixture(scope="module")
def broken():
    return llm.one_tensor_requantized(*BROKEN)


@pytest.fixture(scope="module")
def upstream(broken, tmp_path_factory):
    server = start_llama_cpp_upstream(tmp_path_factory.mktemp("llama"), broken, "smol-broken")
    try:
        yield server
    finally:
        stop_llama_server(server)


def _model(upstream, broken) -> dict:
    return {"name": "smol", "task": "generation",
            "primary": openai_block(upstream.url, "smol-broken"),
            "reference": {"backend": "transformers", "path": str(llm.smollm2_gguf())},
            "mirror": {"sample_rate": 1.0, "timeout_s": 300},
            # Every completion fails the generation tier, so that on_failure runs tier 2.
            "checks": {"generation": {"max_mean_kld": 1e-9},
                       "activation": {"on_failure": True, "primary_gguf": str(broken)}},
            "policy": {"action": "alert"}}


def test_the_verifier_names_the_broken_layer_of_the_served_gguf(upstream, broken, tmp_path,
                                                                 caplog):
    caplog.set_level("INFO", logger="guard.events")
    with guard_in_front(tmp_path, _model(upstream, broken)) as (server, client):
        raw = client.completions.with_raw_response.create(
            model="smol", prompt=llm.PROMPTS[0], max_tokens=8, temperature=0)
        assert raw.headers.get("guard-route") == "primary"
        wait_for(lambda: events(caplog, "activation_divergence"), timeout=900, interval=0.5)
        (event,) = events(caplog, "activation_divergence")
        first = event["first_divergence"]
        assert first["layer"] == LAYER
        assert first["basis"].startswith("isolated error stands out from its peers'")
        assert event["pair"] == "transformers/llama_cpp"
        values = scrape(server.metrics_port)
        assert metric(values, "guard_checks_total", model="smol", tier="activation",
                      result="fail") == 1
        assert metric(values, "guard_checks_total", model="smol", tier="generation",
                      result="fail") == 1


def test_replay_of_a_prompt_set_names_it_in_the_report(upstream, broken, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": llm.PROMPTS[0], "max_tokens": 8}) + "\n")
    config = write_config(tmp_path, [_model(upstream, broken)], http_port=0)
    out = tmp_path / "report"
    code = main(["replay", str(config), str(prompts), "--report-dir", str(out), "--quiet"])
    assert code == 1
    tiers = json.loads((out / "report.json").read_text())["models"]["smol"]["tiers"]
    assert tiers["generation"]["checks"] == 1 and tiers["generation"]["passed"] == 0
    activation = tiers["activation"]
    assert activation["checks"] == 1 and activation["passed"] == 0
    assert activation["first_divergence"]["layer"] == LAYER
    assert activation["first_divergence_layers"] == {LAYER: 1}
