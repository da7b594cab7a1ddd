"""server.log_format: json: one JSON object per stderr line, every log of every guard process
(issue 28, item 7: the docs promised "one JSON line per event" but each line began with a
timestamp and a logger name)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import yaml

from support import model_block, write_config, x_input
from test_cli import free_port, start_serve

NOISY = {"backend": "torch", "path": "fixture_models:noisy_affine"}


def serve_briefly(tmp_path, log_format: str, requests: int = 5) -> str:
    """guard serve on a model whose primary and reference log when built; its stderr."""
    port = free_port()
    config = write_config(tmp_path, [model_block(primary=NOISY, reference=NOISY)],
                          log_format=log_format)
    data = yaml.safe_load(config.read_text())
    data["server"]["grpc_port"] = port
    config.write_text(yaml.safe_dump(data))
    process, client = start_serve(config, port, stdout=subprocess.DEVNULL, timeout=120)
    try:
        for _ in range(requests):
            client.infer("m", [x_input(np.ones((1, 4)))])
    finally:
        client.close()
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    return stderr


def test_json_log_format_is_one_object_per_line_from_both_processes(tmp_path):
    stderr = serve_briefly(tmp_path, "json")
    records = []
    for line in stderr.splitlines():
        record = json.loads(line)  # every line, or this raises
        assert isinstance(record, dict) and {"ts", "level", "logger", "process"} <= set(record)
        records.append(record)
    built = {r["process"] for r in records if r["logger"] == "fixture.noisy"}
    assert built == {"guard", "verifier"}, records  # the primary here, the reference there
    events = [r["event"] for r in records if r["logger"] == "guard.events"]
    assert {"server_started", "model_verifier_loaded", "server_stopped"} <= set(events)
    started = next(r for r in records if r.get("event") == "server_started")
    assert "message" not in started and started["level"] == "INFO"


def test_text_log_format_keeps_the_prefix(tmp_path):
    stderr = serve_briefly(tmp_path, "text", requests=1)
    lines = [line for line in stderr.splitlines() if "fixture.noisy" in line]
    # the primary here; the reference and its own copy of the primary in the verifier
    assert sum("[verifier]: " in line for line in lines) == 2 and len(lines) == 3, stderr
    assert all(line.endswith("built an affine model") for line in lines)
    event = next(line for line in stderr.splitlines() if '"event": "server_started"' in line)
    assert " INFO guard.events {" in event


def test_log_format_is_text_or_json(tmp_path):
    from guard.plan.serving import load_config
    from guard.errors import ConfigError

    config = write_config(tmp_path, [model_block()], log_format="yaml")
    try:
        load_config(config)
    except ConfigError as exc:
        assert any(p.startswith("server.log_format: ") for p in exc.problems), exc.problems
    else:
        raise AssertionError("log_format: yaml was accepted")


def test_a_transformers_reference_draws_no_progress_bar_into_the_json_log():
    """transformers draws a "Loading weights" bar on stderr (the GGUF parser a tqdm one): in a
    json log every line must still be one object, so guard's processes turn the bars off."""
    import os
    import sys

    import pytest

    pytest.importorskip("transformers")
    from guard.observe.logformat import PROGRESS_OFF

    code = ("from guard.observe.logformat import configure; configure('json', 'verifier'); "
            "from guard.backends import create_backend; from guard.config import BackendConfig; "
            "from guard.zoo.llm import smollm2_gguf; "
            "create_backend(BackendConfig(backend='transformers', path=str(smollm2_gguf())), "
            "'reference').load()")
    env = {k: v for k, v in os.environ.items() if k not in PROGRESS_OFF}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "Loading weights" not in done.stderr
    for line in done.stderr.splitlines():
        assert isinstance(json.loads(line), dict), line
