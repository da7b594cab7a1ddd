"""Config and helpers of the second hardening round: control listeners off loopback, the tap
opt-in, the sampling key, and paths under a Kubernetes ConfigMap volume."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from guard.cli import main as guard_main
from guard.plan.complete import load_config, parse_config
from guard.errors import ConfigError, GuardError
from guard.runtime import sampling
from guard.serve.reload import model_fingerprint

LINE = re.compile(r"^\S.*?: \S.*$")


@pytest.fixture
def base(tmp_path: Path) -> Path:
    (tmp_path / "m.onnx").write_bytes(b"not really onnx")
    for name in ("ca.pem", "tls.crt", "tls.key"):
        (tmp_path / name).write_text("pem")
    return tmp_path


def doc(server=None, **model) -> dict:
    return {"version": 1, "server": server or {},
            "models": [{"name": "m", "primary": {"backend": "onnxruntime", "path": "m.onnx"},
                        **model}]}


def problems(data, base_dir: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, base_dir, "guard.yaml")
    for line in info.value.problems:
        assert LINE.match(line), line
    return info.value.problems


MTLS = {"cert_file": "tls.crt", "key_file": "tls.key", "client_ca_file": "ca.pem",
        "allowed_identities": ["spiffe://cluster/ns/ml/sa/operator"]}


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.7", "::", "guard.example"])
def test_admin_off_loopback_needs_client_authentication(base, host):
    [line] = problems(doc({"admin_host": host}), base)
    assert line.startswith("server.admin_host: ") and "not loopback" in line
    no_list = {k: v for k, v in MTLS.items() if k != "allowed_identities"}
    [line] = problems(doc({"admin_host": host, "admin_tls": no_list}), base)
    assert line.startswith("server.admin_host: ")
    config = parse_config(doc({"admin_host": host, "admin_tls": MTLS}), base)
    assert config.server.admin_tls.client_ca_file == str(base / "ca.pem")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_admin_on_loopback_needs_nothing(base, host):
    assert parse_config(doc({"admin_host": host}), base).server.admin_host == host


def test_tap_listener_and_opt_in(base):
    [line] = problems(doc(tap=True), base)
    assert line == ("models[0].tap: needs server.tap (the Tap listener that the model's own "
                    "server reports to)")
    [line] = problems(doc({"tap": {"host": "0.0.0.0"}}, tap=True), base)
    assert line.startswith("server.tap.host: ") and "not loopback" in line
    config = parse_config(doc({"tap": {"host": "0.0.0.0", "port": 9004, "tls": MTLS}},
                              tap=True), base)
    assert config.models[0].tap and config.server.tap.tls.allowed_identities == MTLS[
        "allowed_identities"]
    assert not parse_config(doc(), base).models[0].tap  # off by default
    [line] = problems(doc({"tap": {"tls": {"cert_file": "tls.crt", "key_file": "tls.key",
                                           "allowed_identities": ["x"]}}}), base)
    assert line.startswith("server.tap.tls: ") and "client_ca_file" in line
    [line] = problems(doc({"tap": {"tls": {**MTLS, "client_ca_file": "gone.pem"}}}), base)
    assert line.startswith("server.tap.tls.client_ca_file: file not found")


def test_validate_command_refuses_an_open_admin_port(base, capsys):
    path = base / "guard.yaml"
    path.write_text(yaml.safe_dump(doc({"admin_host": "0.0.0.0"})))
    assert guard_main(["config", "validate", str(path)]) == 2
    assert "server.admin_host: '0.0.0.0' is not loopback" in capsys.readouterr().err


def test_sampling_key_file(base):
    (base / "short").write_bytes(b"tiny\n")
    [line] = problems(doc({"sampling_key_file": "short"}), base)
    assert line.startswith("server.sampling_key_file: holds 4 bytes")
    [line] = problems(doc({"sampling_key_file": "missing"}), base)
    assert line.startswith("server.sampling_key_file: cannot read")


# -- the keyed sampling hash ----------------------------------------------------------------------
@pytest.fixture
def clean_key(monkeypatch):
    monkeypatch.delenv(sampling.ENV, raising=False)
    monkeypatch.delenv(sampling._RESOLVED_ENV, raising=False)
    monkeypatch.setattr(sampling, "_key", None)


def _picked(ids, rate=0.25):
    return {i for i in ids if sampling.sampled(i, rate)}


IDS = [f"req-{i}" for i in range(4000)]


def test_keyed_sampling_is_shared_by_key_and_secret_without_it(tmp_path, clean_key,
                                                               monkeypatch):
    secret = tmp_path / "key"
    secret.write_bytes(os.urandom(32))
    assert sampling.configure(str(secret)) == "file"
    first = _picked(IDS)
    assert 800 < len(first) < 1200  # about a quarter
    # Another process with the same key file (another replica) picks the same requests.
    code = ("import sys; from guard.runtime import sampling; sampling.configure(sys.argv[1]); "
            "print(sum(sampling.sampled(f'req-{i}', 0.25) << i for i in range(4000)))")
    replica = subprocess.run([sys.executable, "-c", code, str(secret)], capture_output=True,
                             text=True, check=True, env={k: v for k, v in os.environ.items()
                                                         if not k.startswith("GUARD_SAMP")})
    assert int(replica.stdout) == sum(1 << int(i[4:]) for i in first)
    # A capture rate at or below the mirror rate picks a subset of the mirrored requests.
    assert _picked(IDS, 0.1) <= first
    # The verifier (a child that was not configured) takes the serving process's key.
    child = subprocess.run([sys.executable, "-c", code.replace(
        "sampling.configure(sys.argv[1]); ", "")], capture_output=True, text=True, check=True)
    assert int(child.stdout) == sum(1 << int(i[4:]) for i in first)
    # Another key picks other requests: a client cannot compute the choice without it.
    monkeypatch.setenv(sampling.ENV, "another deployment's secret")
    assert sampling.configure(None) == "env"
    assert _picked(IDS) != first
    monkeypatch.delenv(sampling.ENV)
    assert sampling.configure(None) == "random"
    assert _picked(IDS) not in (first, set())


def test_unkeyed_ids_cannot_steer_sampling(clean_key):
    """The old hash was public: ids chosen to fall under the rate were always mirrored. Under a
    random key the same ids are a plain sample."""
    import hashlib

    public = [i for i in IDS if int.from_bytes(hashlib.blake2b(
        i.encode(), digest_size=8).digest(), "big") / 2**64 < 0.05]
    sampling.configure(None)
    assert len(public) > 100
    assert len(_picked(public, 0.05)) < len(public) / 2


def test_short_environment_key_is_refused(clean_key, monkeypatch):
    monkeypatch.setenv(sampling.ENV, "short")
    with pytest.raises(GuardError, match="^GUARD_SAMPLING_KEY: sampling key: 5 bytes"):
        sampling.configure(None)


# -- a Kubernetes ConfigMap volume ----------------------------------------------------------------
def _configmap(volume: Path, version: str, artifact: bytes, atol: float) -> None:
    """Write a new version the way the kubelet does: a timestamped folder, then the '..data'
    symlink swapped onto it; the visible names are symlinks through '..data'."""
    folder = volume / f"..{version}"
    folder.mkdir()
    (folder / "m.onnx").write_bytes(artifact)
    model = {"name": "m", "primary": {"backend": "onnxruntime", "path": "m.onnx"},
             "checks": {"tensor": {"atol": atol}}}
    (folder / "guard.yaml").write_text(yaml.safe_dump({"version": 1, "models": [model]}))
    (volume / "..data_tmp").symlink_to(folder.name)
    os.replace(volume / "..data_tmp", volume / "..data")
    for name in ("m.onnx", "guard.yaml"):
        if not (volume / name).is_symlink():
            (volume / name).symlink_to(f"..data/{name}")


def test_configmap_update_reloads_only_what_changed(tmp_path):
    volume = tmp_path / "config"
    volume.mkdir()
    _configmap(volume, "2024_01_01_00_00_00.1", b"weights v1", 1e-4)
    first = load_config(volume / "guard.yaml")
    assert first.models[0].primary.path == str(volume / "m.onnx")  # not through '..2024...'
    loaded = model_fingerprint(first.models[0])  # as the reloader keeps it from the load
    _configmap(volume, "2024_01_01_00_05_00.2", b"weights v1", 1e-4)  # same content
    assert model_fingerprint(load_config(volume / "guard.yaml").models[0]) == loaded
    _configmap(volume, "2024_01_01_00_10_00.3", b"weights v2", 1e-4)  # new artifact
    assert model_fingerprint(load_config(volume / "guard.yaml").models[0]) != loaded
    _configmap(volume, "2024_01_01_00_15_00.4", b"weights v1", 1e-3)  # new setting
    assert model_fingerprint(load_config(volume / "guard.yaml").models[0]) != loaded
