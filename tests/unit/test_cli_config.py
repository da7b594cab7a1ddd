"""The ``guard`` command line, in-process: config validate/schema, usage errors, serve on a bad
config. Exit codes and stderr lines are the contract (CONTRACT.md, "Command line")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from guard import __version__
from guard.cli import main

LINE = re.compile(r"^\S.*?: \S.*$")
ROOT = Path(__file__).resolve().parents[2]


def write_config(folder: Path, name: str = "guard.yaml", **model_overrides) -> Path:
    (folder / "m.onnx").touch()
    model = {"name": "resnet", "primary": {"backend": "onnxruntime", "path": "m.onnx"}}
    model.update(model_overrides)
    path = folder / name
    path.write_text(yaml.safe_dump({"version": 1, "models": [model]}))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def usage_exit(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    out, err = capsys.readouterr()
    return info.value.code, out, err


# -- config validate -----------------------------------------------------------------------------
def test_validate_valid_config_exits_0(tmp_path, capsys):
    path = write_config(tmp_path)
    code, out, err = run(capsys, "config", "validate", str(path))
    assert code == 0
    assert "valid" in out and "resnet" in out
    assert "Traceback" not in err


def test_validate_invalid_config_one_line_per_problem(tmp_path, capsys):
    path = write_config(
        tmp_path,
        bogus=1,
        mirror={"sample_rate": 2},
        policy={"recover_ratio": 0.5, "trip_ratio": 0.1},
    )
    code, out, err = run(capsys, "config", "validate", str(path))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 3, lines
    for line in lines:
        assert LINE.match(line), line
    assert all(line.startswith(f"{path}: ") for line in lines), lines  # the file first
    lines = [line.removeprefix(f"{path}: ") for line in lines]
    assert "models[0].bogus: unknown key" in lines
    assert "models[0].mirror.sample_rate: must be in [0, 1]" in lines
    assert any(line.startswith("models[0].policy: recover_ratio") for line in lines)
    assert "Traceback" not in err
    assert "valid (" not in out


def test_validate_missing_artifact(tmp_path, capsys):
    path = write_config(tmp_path, primary={"backend": "onnxruntime", "path": "nope.onnx"})
    code, _, err = run(capsys, "config", "validate", str(path))
    assert code == 2
    assert err.strip().splitlines() == [
        f"{path}: models[0].primary.path: file not found: {(tmp_path / 'nope.onnx').resolve()}"
    ]


def test_validate_unknown_backend_option(tmp_path, capsys):
    path = write_config(tmp_path, primary={"backend": "onnxruntime", "path": "m.onnx",
                                           "options": {"bogus": 1}})
    code, _, err = run(capsys, "config", "validate", str(path))
    assert code == 2
    assert err.strip().splitlines() == [f"{path}: models[0].primary.options.bogus: unknown key"]


def test_validate_bad_yaml_names_the_file(tmp_path, capsys):
    path = tmp_path / "guard.yaml"
    path.write_text("version: 1\nmodels: [\n")
    code, _, err = run(capsys, "config", "validate", str(path))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"{path}: (yaml): "), lines
    assert re.search(r"line \d+, column \d+", lines[0])


@pytest.mark.parametrize("command", [["config", "validate"], ["serve"], ["deploy", "rules"],
                                     ["matrix"], ["replay"]])
def test_a_yaml_syntax_error_names_the_file_in_every_command(tmp_path, capsys, command):
    path = tmp_path / "broken.yaml"
    path.write_text("version: 1\nmodels:\n  - name: a\n    primary: {backend: torch\n")
    extra = [str(tmp_path / "none.npz")] if command == ["replay"] else []
    code, _, err = run(capsys, *command, str(path), *extra)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert str(path) in line and "(yaml): line 5, column 1" in line, line


def test_validate_missing_file(tmp_path, capsys):
    code, _, err = run(capsys, "config", "validate", str(tmp_path / "absent.yaml"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "cannot read" in lines[0]
    assert "Traceback" not in err


def test_validate_needs_a_file_argument(capsys):
    code, _, err = run(capsys, "config", "validate")
    assert code == 2
    assert err == "guard: guard config validate: a config file is needed: --config FILE (or FILE)\n"


# -- config schema ---------------------------------------------------------------------------------
def test_schema_prints_json(capsys):
    code, out, err = run(capsys, "config", "schema")
    assert code == 0
    schema = json.loads(out)
    assert {"version", "server", "models"} <= set(schema["properties"])
    assert "BackendConfig" in schema["$defs"]


def test_schema_into_a_pipe_closed_early_ends_quietly():
    """`guard config schema | head -1`: head leaves after one line; guard must not print a
    BrokenPipeError traceback. Through a real shell pipe (whether head leaves before or after
    guard wrote depends on the scheduler: both must be quiet), then with the pipe's read end
    closed before guard writes (deterministic: the write always meets a closed pipe)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "guard", "config", "schema"]
    result = subprocess.run(
        f"set -o pipefail; {' '.join(command)} | head -1", shell=True, executable="/bin/bash",
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout == "{\n"
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
    assert result.returncode in (0, 141)
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()  # the reader is gone before guard writes a byte
    _, err = process.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert process.returncode == 141  # 128 + SIGPIPE: what a shell reports for `cmd | head`


# -- serve with a bad config ------------------------------------------------------------------------
def test_serve_missing_config_one_line_no_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "serve", "--config", "missing.yaml")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("guard: ")
    assert "missing.yaml" in lines[0]
    assert "Traceback" not in err and "Traceback" not in out


def test_serve_invalid_config_exits_2_naming_the_problem(tmp_path, capsys):
    path = write_config(tmp_path, mirror={"queue_size": 0})
    code, _, err = run(capsys, "serve", "--config", str(path))
    assert code == 2
    lines = err.strip().splitlines()
    assert lines == [f"guard: {path}: models[0].mirror.queue_size: must be >= 1"]


def test_serve_needs_config(capsys):
    code, _, err = run(capsys, "serve")
    assert code == 2
    assert err == "guard: guard serve: a config file is needed: --config FILE (or FILE)\n"


# -- usage ------------------------------------------------------------------------------------------
def test_unknown_command_exits_2(capsys):
    code, _, err = usage_exit(capsys, "frobnicate")
    assert code == 2
    assert "frobnicate" in err


def test_no_command_exits_2(capsys):
    code, _, err = usage_exit(capsys)
    assert code == 2
    assert "usage" in err


def test_unknown_config_action_exits_2(capsys):
    code, _, _ = usage_exit(capsys, "config", "lint")
    assert code == 2


def test_config_without_action_exits_2(capsys):
    code, _, _ = usage_exit(capsys, "config")
    assert code == 2


@pytest.mark.parametrize("argv", [["--help"], ["config", "--help"], ["config", "validate", "-h"],
                                  ["serve", "--help"]])
def test_help_exits_0(capsys, argv):
    code, out, _ = usage_exit(capsys, *argv)
    assert code == 0
    assert "usage" in out


def test_version(capsys):
    code, out, _ = usage_exit(capsys, "--version")
    assert code == 0
    assert __version__ in out
