"""``task: generation`` in the config: checks.generation, its policy defaults, and what a
generation model block may not hold (guard/config/generation.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from guard.plan.serving import parse_config
from guard.errors import ConfigError

LINE = re.compile(r"^\S.*?: \S.*$")
OPENAI = {"backend": "openai", "target": "http://127.0.0.1:8081", "model": "smol-q2"}
FALLBACK = {"backend": "openai", "target": "http://127.0.0.1:8082", "model": "smol-q8"}


@pytest.fixture
def base(tmp_path: Path) -> Path:
    (tmp_path / "m.onnx").touch()
    (tmp_path / "smol.gguf").touch()
    return tmp_path


def problems(data, base_dir: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, base_dir, "guard.yaml")
    lines = info.value.problems
    assert lines and all(LINE.match(line) for line in lines), lines
    return lines


def generation_doc(**overrides) -> dict:
    model = {"name": "smol", "task": "generation", "primary": dict(OPENAI),
             "reference": {"backend": "transformers", "path": "smol.gguf"},
             "fallback": dict(FALLBACK), "policy": {"action": "fallback_model"}}
    model.update(overrides)
    return {"version": 1, "server": {"http_port": 8080}, "models": [model]}


def test_a_tensor_primary_is_refused_for_generation(base):
    doc = {"version": 1, "models": [{"name": "smol", "task": "generation",
                                      "primary": {"backend": "onnxruntime", "path": "m.onnx"}}]}
    (line,) = problems(doc, base)
    assert line.startswith("models[0].primary.backend: a generation model's primary is served "
                           "by an OpenAI-compatible server (backend openai), not 'onnxruntime'")


def test_tensor_checks_are_refused_for_generation(base):
    doc = {"version": 1, "models": [{
        "name": "smol", "task": "generation",
        "primary": {"backend": "onnxruntime", "path": "m.onnx"},
        "checks": {"tensor": {"atol": 0.1}, "activation": {"sample_rate": 0.5}},
        "policy": {"action": "fallback_ops"}}]}
    (line,) = problems(doc, base)
    assert "checks.tensor: tensor checks do not apply to a generation model" in line
    assert "checks.activation: tier 2 of a generation model captures the GGUF its upstream " \
        "serves: set checks.activation.primary_gguf" in line
    assert "policy.action: 'fallback_ops'" in line


def test_max_batch_on_a_generation_model_is_refused_not_ignored(base):
    """A generation model scores one completion at a time: a max_batch set on it would be
    ignored in silence."""
    lines = problems(generation_doc(mirror={"sample_rate": 0.1, "max_batch": 8}), base)
    assert any("mirror.max_batch: a generation model scores one completion at a time" in line
               for line in lines), lines
    parse_config(generation_doc(mirror={"sample_rate": 0.1}), base, "guard.yaml")


def test_checks_generation_on_a_tensor_model_is_refused(base):
    doc = {"version": 1, "models": [{"name": "m", "task": "classification",
                                      "primary": {"backend": "onnxruntime", "path": "m.onnx"},
                                      "checks": {"generation": {"max_mean_kld": 0.2}}}]}
    (line,) = problems(doc, base)
    assert line == ("models[0]: checks.generation: is set but the model's task is "
                    "'classification'")


def test_generation_thresholds_are_checked(base):
    doc = {"version": 1, "models": [{"name": "m", "primary": {"backend": "onnxruntime",
                                                               "path": "m.onnx"},
                                      "checks": {"generation": {"in_control_ratio": 1.0,
                                                                "bet": 1.0}}}]}
    lines = problems(doc, base)
    assert any(line.startswith("models[0].checks.generation.bet: ") for line in lines)
    doc["models"][0]["checks"]["generation"] = {"in_control_ratio": 1.0}
    (line,) = problems(doc, base)
    assert line.startswith("models[0].checks.generation: in_control_ratio must be in (0, 1)")


def test_a_generation_model_validates_with_its_defaults(base):
    config = parse_config(generation_doc(), base, "guard.yaml")
    model = config.models[0]
    assert model.policy.min_samples == 5  # the task's default
    assert model.policy.arl0_for(model.mirror.sample_rate) == 1e5  # the shared ARL0
    assert 0 < model.checks.generation.in_control_ratio < 1


def test_the_task_default_survives_the_trip_to_the_verifier(base):
    from guard.ipc.config import config_from_wire, config_to_wire

    config = parse_config(generation_doc(), base, "guard.yaml")
    again = config_from_wire(config_to_wire(config))
    assert again.models[0].policy.min_samples == 5


def test_a_generation_model_needs_the_http_edge(base):
    doc = generation_doc()
    del doc["server"]
    (line,) = problems(doc, base)
    assert "server.http_port: unset" in line  # the openai backend's own check


def test_a_tensor_reference_is_refused_for_generation(base):
    lines = problems(generation_doc(reference={"backend": "onnxruntime", "path": "m.onnx"}),
                     base)
    assert any("reference.backend: a generation model's reference is scored by a "
               "teacher-forcing scorer (backend llama_cpp or openai or transformers)" in line
               for line in lines)


def test_an_llm_backend_needs_task_generation(base):
    doc = generation_doc()
    doc["models"][0]["task"] = "generic"
    lines = problems(doc, base)
    assert any("primary.backend: 'openai' serves or scores an LLM: set task: generation" in line
               for line in lines)


def test_an_openai_reference_validates_and_builds_a_remote_scorer_importing_nothing_heavy(base):
    import sys

    from guard.backends import create_backend
    from guard.backends.openai_scorer import OpenAIScorer

    reference = {"backend": "openai", "target": "http://10.0.0.7:8000/v1", "model": "smol-bf16",
                 "options": {"scoring": "prompt_logprobs", "top_logprobs": 10,
                             "api_key_env": "REFERENCE_KEY"}}
    config = parse_config(generation_doc(reference=reference), base, "guard.yaml")
    before = {name for name in ("torch", "transformers", "llama_cpp") if name in sys.modules}
    scorer = create_backend(config.models[0].reference, "reference")
    assert isinstance(scorer, OpenAIScorer) and scorer.base == "http://10.0.0.7:8000"
    assert scorer.options.top_logprobs == 10
    assert {name for name in ("torch", "transformers", "llama_cpp") if name in sys.modules} \
        == before


@pytest.mark.parametrize("role, options, message", [
    ("reference", {"sample_logprobs": 5}, "reference.options.sample_logprobs: is for an openai "
     "primary or fallback"),
    ("reference", {"engine": "vllm"}, "reference.options.engine: is for an openai primary"),
    ("reference", {"sample_token_ids": True}, "reference.options.sample_token_ids: is for an "
     "openai primary or fallback"),
    ("primary", {"scoring": "echo"}, "primary.options.scoring: is for an openai reference"),
    ("fallback", {"top_logprobs": 5}, "fallback.options.top_logprobs: is for an openai "
     "reference"),
    ("reference", {"logprobs_mode": "processed_logprobs"}, "reference.options.logprobs_mode: "
     "is for an openai primary or fallback"),
    ("primary", {"logprobs_mode": "processed"}, "logprobs_mode"),
    ("reference", {"scoring": "logits"}, "scoring"),
    ("reference", {"top_logprobs": 0}, "top_logprobs"),
    ("reference", {"generation_config": "vllm"}, "reference.options.generation_config: is for "
     "an openai primary or fallback"),
    ("primary", {"engine": "llama.cpp", "generation_config": "vllm"},
     "generation_config: engine llama.cpp does not apply a model's generation_config.json"),
    ("primary", {"engine": "vllm", "generation_config": "/absent/folder"},
     "generation_config: cannot read /absent/folder"),
])
def test_openai_options_of_the_other_role_are_refused(base, role, options, message):
    block = {"backend": "openai", "target": "http://127.0.0.1:8000", "model": "smol-ref",
             "options": options}
    if role != "reference":
        block = dict(OPENAI if role == "primary" else FALLBACK, options=options)
    lines = problems(generation_doc(**{role: block}), base)
    assert any(message in line for line in lines), lines


def test_a_target_holding_credentials_is_refused_without_echoing_them(base):
    block = dict(OPENAI, target="http://user:s3cret-key@127.0.0.1:8000")
    lines = problems(generation_doc(primary=block), base)
    assert any("credentials in the URL" in line and "api_key_env" in line for line in lines)
    assert not any("s3cret" in line for line in lines), lines


def _complete_problems(data, base_dir: Path) -> list[str]:
    """The checks' registries too (tier 2's capturable pairs): what validate and the verifier
    load with."""
    from guard.plan import complete

    with pytest.raises(ConfigError) as info:
        complete.parse_config(data, base_dir, "guard.yaml")
    return info.value.problems


def test_tier2_of_a_generation_model_captures_the_gguf_its_upstream_serves(base):
    from guard.plan import complete

    (base / "served.gguf").touch()
    doc = generation_doc(checks={"activation": {"on_failure": True,
                                                "primary_gguf": "served.gguf"}})
    model = complete.parse_config(doc, base, "guard.yaml").models[0]
    captured = model.activation_primary()
    assert captured.backend == "llama_cpp" and captured.path == str(base / "served.gguf")
    assert model.primary.backend == "openai"  # what serves is unchanged


def test_tier2_of_a_generation_model_says_what_it_needs(base):
    (line,) = problems(generation_doc(checks={"activation": {"primary_gguf": "gone.gguf",
                                                             "on_failure": True}}), base)
    assert "checks.activation.primary_gguf: file not found" in line
    (base / "served.gguf").touch()
    doc = generation_doc(reference={"backend": "llama_cpp", "path": "smol.gguf"},
                         checks={"activation": {"on_failure": True,
                                                "primary_gguf": "served.gguf"}})
    (line,) = _complete_problems(doc, base)
    assert "primary backend 'llama_cpp' beside reference backend 'llama_cpp'" in line
    assert "isolated on a transformers reference's modules" in line
    doc = {"version": 1, "models": [{
        "name": "m", "primary": {"backend": "onnxruntime", "path": "m.onnx"},
        "checks": {"activation": {"primary_gguf": "served.gguf"}}}]}
    (line,) = problems(doc, base)
    assert "checks.activation.primary_gguf: names what a generation model's upstream serves" \
        in line


@pytest.mark.parametrize("options, note", [
    ({"engine": "vllm"}, "engine vllm's temperature is not declared"),
    ({}, "engine unknown's temperature is not declared"),
    ({"engine": "vllm", "generation_config": "vllm"}, None),
    ({"engine": "vllm", "sample_logprobs": 5}, None),  # no transform enters raw logprobs
    # ... but it enters processed ones
    ({"engine": "vllm", "sample_logprobs": 5, "logprobs_mode": "processed_logprobs"},
     "engine vllm's temperature is not declared"),
    ({"engine": "llama.cpp"}, None),
])
def test_validate_notes_a_server_whose_sampling_defaults_are_not_declared(base, capsys,
                                                                          options, note):
    """A valid config (exit 0) whose sampled calls would go uncompared: `guard config
    validate` says so before the verifier's start-up event does."""
    import yaml

    from guard.cli import main

    path = base / "guard.yaml"
    path.write_text(yaml.safe_dump(generation_doc(primary=dict(OPENAI, options=options))))
    assert main(["config", "validate", str(path)]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if ": note: " in line]
    if note is None:
        assert notes == [], out
    else:
        (line,) = notes
        assert line.startswith(f"{path}: note: models[0] (smol): {note}: ") and \
            "options.generation_config" in line, line


def test_validate_notes_processed_logprobs_against_a_remote_reference(base, capsys):
    import yaml

    from guard.cli import main

    remote = {"backend": "openai", "target": "http://127.0.0.1:8000", "model": "smol-ref"}
    primary = dict(OPENAI, options={"engine": "vllm", "generation_config": "vllm",
                                    "logprobs_mode": "processed_logprobs"})
    path = base / "guard.yaml"
    path.write_text(yaml.safe_dump(generation_doc(primary=primary, reference=remote)))
    assert main(["config", "validate", str(path)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if ": note: " in line]
    assert "logprobs_mode processed_logprobs with an openai reference" in line and \
        'reason="no_distribution"' in line, line
