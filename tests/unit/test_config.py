"""guard/config/: loading, validation, error lines, path resolution, JSON Schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from guard.backends import BACKEND_NAMES
from guard.config import BackendConfig, GuardConfig, format_validation_error
from guard.errors import ConfigError, GuardError
from guard.plan.complete import load_config, parse_config
from guard.plan.schema import config_json_schema

IMPLEMENTED_BACKENDS = frozenset(BACKEND_NAMES)

LINE = re.compile(r"^\S.*?: \S.*$")  # "dotted.path: message"


# -- helpers ------------------------------------------------------------------------------------
@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A config folder with fake artifacts (they only need to exist for path resolution)."""
    (tmp_path / "m.onnx").touch()
    (tmp_path / "ref.pt").touch()
    return tmp_path


ORT = {"backend": "onnxruntime", "path": "m.onnx"}
TORCH = {"backend": "torch", "path": "ref.pt"}


def doc(**model_overrides) -> dict:
    model = {"name": "m", "primary": dict(ORT)}
    model.update(model_overrides)
    return {"version": 1, "models": [model]}


def problems(data, base_dir: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, base_dir, "guard.yaml")
    lines = info.value.problems
    assert lines, "a ConfigError must name at least one problem"
    for line in lines:
        assert LINE.match(line), f"not a 'path: message' line: {line!r}"
        assert "\n" not in line
    return lines


def write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


# -- valid configs and defaults -----------------------------------------------------------------
def test_minimal_config_gets_contract_defaults(base):
    config = parse_config(doc(), base)
    assert isinstance(config, GuardConfig)
    assert config.version == 1
    s = config.server
    assert (s.host, s.grpc_port, s.metrics_port, s.admin_port) == ("0.0.0.0", 8001, 9090, 8003)
    assert s.admin_host == "127.0.0.1"
    m = config.models[0]
    assert m.name == "m" and m.task == "generic"
    assert m.primary.backend == "onnxruntime"
    assert m.primary.precision == "fp32" and m.primary.device == "cpu"
    assert m.primary.options == {}
    assert m.reference is None and m.fallback is None
    assert m.policy.action == "alert"
    assert m.policy.recover_ratio <= m.policy.trip_ratio
    assert m.policy.min_samples <= m.policy.window
    assert 0.0 <= m.mirror.sample_rate <= 1.0
    assert config.model("m") is m


def test_full_contract_example_is_valid(base):
    text = """
version: 1
server:
  host: 0.0.0.0
  grpc_port: 8001
  metrics_port: 9090
  admin_port: 8003
models:
  - name: resnet
    task: classification
    primary:   {backend: onnxruntime, path: m.onnx, precision: int8}
    reference: {backend: torch, path: ref.pt}
    fallback:  {backend: onnxruntime, path: m.onnx}
    mirror:    {sample_rate: 0.05, queue_size: 64, timeout_s: 5.0}
    checks:
      tensor:     {atol: 1.0e-4, rtol: 1.0e-3}
      activation: {}
      task:       {}
    policy:
      action: fallback_model
"""
    config = load_config(write(base / "guard.yaml", text))
    m = config.model("resnet")
    assert m.task == "classification"
    assert m.primary.precision == "int8"
    assert m.reference.backend == "torch"
    assert m.fallback is not None
    assert m.mirror.sample_rate == pytest.approx(0.05)
    assert m.mirror.queue_size == 64
    assert m.checks.tensor.atol == pytest.approx(1e-4)
    assert m.checks.tensor.rtol == pytest.approx(1e-3)
    assert m.policy.action == "fallback_model"


def test_load_config_sets_source_hash_and_base_dir(base):
    path = write(base / "guard.yaml", doc())
    config = load_config(path)
    assert re.fullmatch(r"[0-9a-f]{16}", config.context.source_hash)
    assert config.context.base_dir == base.resolve()
    assert config.context.source_path == path
    # Every backend block carries the same context (its factory imports from base_dir).
    assert config.models[0].primary.context is config.context
    # The hash follows the file's text.
    write(path, yaml.safe_dump(doc()) + "# a comment\n")
    assert load_config(path).context.source_hash != config.context.source_hash


def test_per_output_tolerances_parse(base):
    config = parse_config(
        doc(checks={"tensor": {"atol": 0.1, "outputs": {"logits": {"rtol": 0.5}}}}), base
    )
    t = config.models[0].checks.tensor
    assert t.atol == pytest.approx(0.1)
    assert t.outputs["logits"].rtol == pytest.approx(0.5)
    assert t.outputs["logits"].atol is None


# -- path resolution ------------------------------------------------------------------------------
def test_relative_path_resolves_against_config_folder_not_cwd(tmp_path, monkeypatch):
    conf_dir = tmp_path / "conf"
    (conf_dir / "models").mkdir(parents=True)
    artifact = conf_dir / "models" / "net.onnx"
    artifact.touch()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path = write(conf_dir / "guard.yaml",
                 doc(primary={"backend": "onnxruntime", "path": "models/net.onnx"}))
    config = load_config(path)
    assert Path(config.models[0].primary.path) == artifact.resolve()
    assert Path(config.models[0].primary.path).is_absolute()


def test_relative_path_with_parent_folder(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "net.onnx").touch()
    path = write(tmp_path / "conf" / "guard.yaml",
                 doc(primary={"backend": "onnxruntime", "path": "../shared/net.onnx"}))
    config = load_config(path)
    assert config.models[0].primary.path == str((shared / "net.onnx").resolve())


def test_relative_config_path_given_to_load_config(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "m.onnx").touch()
    write(tmp_path / "conf" / "guard.yaml", doc())
    monkeypatch.chdir(tmp_path)
    config = load_config("conf/guard.yaml")
    assert config.models[0].primary.path == str((tmp_path / "conf" / "m.onnx").resolve())


def test_every_role_is_resolved(base):
    config = parse_config(doc(reference=dict(TORCH), fallback=dict(ORT)), base)
    m = config.models[0]
    assert m.primary.path == str((base / "m.onnx").resolve())
    assert m.reference.path == str((base / "ref.pt").resolve())
    assert m.fallback.path == str((base / "m.onnx").resolve())
    for spec in (m.primary, m.reference, m.fallback):
        assert spec.context.base_dir == base


def test_missing_artifact_names_resolved_path(base):
    lines = problems(doc(primary={"backend": "onnxruntime", "path": "sub/nope.onnx"}), base)
    expected = (base / "sub" / "nope.onnx").resolve()
    assert lines == [f"models[0].primary.path: file not found: {expected}"]


def test_missing_artifacts_in_several_roles_are_all_reported(base):
    data = doc(reference={"backend": "torch", "path": "a.pt"},
               fallback={"backend": "onnxruntime", "path": "b.onnx"})
    data["models"].append({"name": "n", "primary": {"backend": "onnxruntime", "path": "c.onnx"}})
    lines = problems(data, base)
    assert len(lines) == 3
    assert lines[0].startswith("models[0].reference.path: file not found: ")
    assert lines[0].endswith(str((base / "a.pt").resolve()))
    assert lines[1].startswith("models[0].fallback.path: file not found: ")
    assert lines[2].startswith("models[1].primary.path: file not found: ")


def test_absolute_missing_path(base):
    missing = base / "abs" / "gone.onnx"
    lines = problems(doc(primary={"backend": "onnxruntime", "path": str(missing)}), base)
    assert lines == [f"models[0].primary.path: file not found: {missing.resolve()}"]


def test_factory_path_accepted_without_a_file(base):
    config = parse_config(
        doc(reference={"backend": "torch", "path": "fixture_models:affine",
                       "options": {"kwargs": {"repeat": 2}}}),
        base,
    )
    ref = config.models[0].reference
    assert ref.path == "fixture_models:affine"  # left as is, imported at load time
    assert ref.is_factory
    assert ref.options == {"kwargs": {"repeat": 2}}
    assert not config.models[0].primary.is_factory


def test_factory_path_dotted_module(base):
    config = parse_config(
        doc(primary={"backend": "torch_compile", "path": "pkg.sub.models:build_net"}), base
    )
    assert config.models[0].primary.path == "pkg.sub.models:build_net"


def test_factory_form_is_not_accepted_for_onnxruntime(base):
    lines = problems(doc(primary={"backend": "onnxruntime", "path": "foo:bar"}), base)
    assert any(line.startswith("models[0].primary.path:") for line in lines)


# -- unknown keys ---------------------------------------------------------------------------------
def test_unknown_top_level_key(base):
    data = doc()
    data["bogus"] = 1
    assert problems(data, base) == ["bogus: unknown key"]


def test_unknown_server_key(base):
    data = doc()
    data["server"] = {"grpc_prot": 9000}
    assert problems(data, base) == ["server.grpc_prot: unknown key"]


def test_unknown_model_key(base):
    assert problems(doc(fallbak=dict(ORT)), base) == ["models[0].fallbak: unknown key"]


def test_unknown_key_in_second_model(base):
    data = doc()
    data["models"].append({"name": "two", "primary": dict(ORT), "mirrror": {}})
    assert problems(data, base) == ["models[1].mirrror: unknown key"]


@pytest.mark.parametrize(
    ("block", "key", "path"),
    [
        ("primary", "bogus", "models[0].primary.bogus"),
        ("mirror", "rate", "models[0].mirror.rate"),
        ("policy", "trip", "models[0].policy.trip"),
    ],
)
def test_unknown_key_in_nested_blocks(base, block, key, path):
    data = doc()
    model = data["models"][0]
    model.setdefault(block, {})
    model[block] = {**model[block], key: 1}
    assert problems(data, base) == [f"{path}: unknown key"]


def test_unknown_key_in_checks(base):
    lines = problems(doc(checks={"tensor": {"atoll": 1.0}, "activation": {"x": 1}}), base)
    assert sorted(lines) == [
        "models[0].checks.activation.x: unknown key",
        "models[0].checks.tensor.atoll: unknown key",
    ]


def test_unknown_key_in_per_output_tolerance(base):
    lines = problems(doc(checks={"tensor": {"outputs": {"y": {"atol": 1, "foo": 1}}}}), base)
    assert lines == ["models[0].checks.tensor.outputs.y.foo: unknown key"]


def test_unknown_onnxruntime_option(base):
    lines = problems(doc(primary={**ORT, "options": {"bogus": 1, "intra_op_thread": 2}}), base)
    assert sorted(lines) == [
        "models[0].primary.options.bogus: unknown key",
        "models[0].primary.options.intra_op_thread: unknown key",
    ]


def test_unknown_torch_option_on_factory_reference(base):
    lines = problems(
        doc(reference={"backend": "torch", "path": "fixture_models:affine",
                       "options": {"bogus": True}}),
        base,
    )
    assert lines == ["models[0].reference.options.bogus: unknown key"]


def test_unknown_torch_compile_option_and_bad_value(base):
    lines = problems(
        doc(fallback={"backend": "torch_compile", "path": "pkg.models:build",
                      "options": {"mode": "fast", "nope": 1}}),
        base,
    )
    assert "models[0].fallback.options.nope: unknown key" in lines
    assert any(line.startswith("models[0].fallback.options.mode: ") for line in lines)
    assert len(lines) == 2


def test_known_backend_options_accepted(base):
    config = parse_config(
        doc(primary={**ORT, "options": {"intra_op_threads": 2,
                                        "providers": ["CPUExecutionProvider"],
                                        "graph_optimization_level": "basic"}},
            reference={**TORCH, "options": {"threads": 1, "output_names": ["y"]}}),
        base,
    )
    assert config.models[0].primary.options["intra_op_threads"] == 2


def test_option_value_error_names_option(base):
    lines = problems(doc(primary={**ORT, "options": {"intra_op_threads": -1}}), base)
    assert len(lines) == 1 and lines[0].startswith("models[0].primary.options.intra_op_threads: ")


def test_options_must_be_a_mapping(base):
    lines = problems(doc(primary={**ORT, "options": [1]}), base)
    assert len(lines) == 1 and lines[0].startswith("models[0].primary.options: ")


# -- missing required keys ------------------------------------------------------------------------
def test_missing_version(base):
    data = doc()
    del data["version"]
    assert problems(data, base) == ["version: required key is missing"]


def test_missing_models(base):
    assert problems({"version": 1}, base) == ["models: required key is missing"]


def test_missing_primary(base):
    assert problems({"version": 1, "models": [{"name": "a"}]}, base) == [
        "models[0].primary: required key is missing"
    ]


def test_missing_name_and_backend(base):
    lines = problems({"version": 1, "models": [{"primary": {"path": "m.onnx"}}]}, base)
    assert sorted(lines) == [
        "models[0].name: required key is missing",
        "models[0].primary.backend: required key is missing",
    ]


def test_backend_without_path(base):
    lines = problems(doc(primary={"backend": "onnxruntime"}), base)
    assert len(lines) == 1
    assert lines[0].startswith("models[0].primary: ")
    assert "path" in lines[0]


def test_empty_models_list(base):
    lines = problems({"version": 1, "models": []}, base)
    assert len(lines) == 1 and lines[0].startswith("models: ")


# -- value errors ---------------------------------------------------------------------------------
def test_sample_rate_out_of_range(base):
    assert problems(doc(mirror={"sample_rate": 1.5}), base) == [
        "models[0].mirror.sample_rate: must be in [0, 1]"
    ]
    assert problems(doc(mirror={"sample_rate": -0.1}), base) == [
        "models[0].mirror.sample_rate: must be in [0, 1]"
    ]


@pytest.mark.parametrize("rate", [0, 0.0, 1, 1.0, 0.5])
def test_sample_rate_bounds_inclusive(base, rate):
    config = parse_config(doc(mirror={"sample_rate": rate}), base)
    assert config.models[0].mirror.sample_rate == rate


def test_several_problems_one_line_each(base):
    lines = problems(
        doc(mirror={"sample_rate": 2, "queue_size": 0, "timeout_s": 0}), base
    )
    assert sorted(lines) == [
        "models[0].mirror.queue_size: must be >= 1",
        "models[0].mirror.sample_rate: must be in [0, 1]",
        "models[0].mirror.timeout_s: must be > 0",
    ]


def test_port_out_of_range(base):
    data = doc()
    data["server"] = {"grpc_port": 70000}
    lines = problems(data, base)
    assert len(lines) == 1 and lines[0].startswith("server.grpc_port: ")


def test_negative_tolerance(base):
    lines = problems(doc(checks={"tensor": {"atol": -1}}), base)
    assert lines == ["models[0].checks.tensor.atol: must be >= 0"]


def test_bad_task_and_action_values(base):
    lines = problems(doc(task="nope", policy={"action": "panic"}), base)
    assert len(lines) == 2
    assert any(line.startswith("models[0].task: ") for line in lines)
    assert any(line.startswith("models[0].policy.action: ") for line in lines)


def test_unknown_backend_name(base):
    lines = problems(doc(primary={"backend": "tflite", "path": "m.onnx"}), base)
    assert len(lines) == 1
    assert lines[0].startswith("models[0].primary.backend: ")


def test_bad_model_name(base):
    lines = problems(doc(name="has space"), base)
    assert len(lines) == 1 and lines[0].startswith("models[0].name: ")


@pytest.mark.parametrize("name", ["..", ".", ".hidden", "-x", "_x", "a/b", "a\\b", "x" * 129])
def test_model_name_cannot_escape_or_hide_its_capture_folder(base, name):
    lines = problems(doc(name=name), base)
    assert len(lines) == 1 and lines[0].startswith("models[0].name: ")
    assert "capture folder" in lines[0]


@pytest.mark.parametrize("name", ["resnet", "resnet-50.v2", "A_1", "0x", "a..b"])
def test_model_names_that_stay_plain_folder_names(base, name):
    assert parse_config(doc(name=name), base).models[0].name == name


# -- sha256: only on artifact files; required where the loader can unpickle -------------------
UPSTREAM = {"backend": "upstream", "target": "localhost:8001", "model": "m"}


def test_sha256_on_an_upstream_is_an_error_naming_the_key(base):
    lines = problems(doc(primary={**UPSTREAM, "sha256": "a" * 64}), base)
    assert lines == ["models[0].primary.sha256: backend 'upstream' has no artifact to pin "
                     "(the remote server loads its own model): remove sha256"]


def test_sha256_on_a_factory_is_an_error_naming_the_key(base):
    lines = problems(doc(reference={"backend": "torch", "path": "fixture_models:affine",
                                    "sha256": "a" * 64}), base)
    assert len(lines) == 1
    assert lines[0].startswith("models[0].reference.sha256: 'fixture_models:affine' is a "
                               "Python factory")


def test_pt2_without_sha256_is_refused_saying_why(base):
    (base / "prog.pt2").touch()
    lines = problems(doc(reference={"backend": "torch", "path": "prog.pt2"}), base)
    assert len(lines) == 1 and lines[0].startswith("models[0].reference.sha256: required")
    assert "unpickle" in lines[0] and "sha256sum" in lines[0]
    pinned = parse_config(doc(reference={"backend": "torch", "path": "prog.pt2",
                                         "sha256": "b" * 64}), base)
    assert pinned.models[0].reference.sha256 == "b" * 64


def test_sha256_on_files_stays_optional(base):
    config = parse_config(doc(primary={**ORT, "sha256": "c" * 64}, reference=dict(TORCH)), base)
    assert config.models[0].primary.sha256 == "c" * 64 and config.models[0].reference.sha256 is None


def test_bad_device(base):
    lines = problems(doc(primary={**ORT, "device": "tpu"}), base)
    assert len(lines) == 1 and lines[0].startswith("models[0].primary.device: ")
    assert "tpu" in lines[0]


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_good_devices(base, device):
    config = parse_config(doc(primary={**ORT, "device": device}), base)
    assert config.models[0].primary.device == device


# Contract backend names; those whose code has not landed must be rejected with a clear message.
UNIMPLEMENTED_CANDIDATES = {
    "openvino": {"backend": "openvino", "path": "m.onnx"},
    "tensorrt": {"backend": "tensorrt", "path": "m.onnx"},
}
UPSTREAM = {"backend": "upstream", "target": "triton:8001", "model": "resnet"}


@pytest.mark.parametrize(
    "backend", sorted(set(UNIMPLEMENTED_CANDIDATES) - IMPLEMENTED_BACKENDS) or ["none-left"])
def test_contract_backends_not_implemented_are_rejected(base, backend):
    if backend == "none-left":
        assert IMPLEMENTED_BACKENDS >= set(UNIMPLEMENTED_CANDIDATES)
        return
    lines = problems(doc(fallback=UNIMPLEMENTED_CANDIDATES[backend]), base)
    assert len(lines) == 1
    assert lines[0].startswith("models[0].fallback: ")
    assert f"backend '{backend}' is not available" in lines[0]
    for name in sorted(IMPLEMENTED_BACKENDS):
        assert name in lines[0]  # the message says what is available


def test_every_implemented_backend_is_a_contract_name():
    assert IMPLEMENTED_BACKENDS <= {"torch", "torch_compile", "onnxruntime", "openvino",
                                    "tensorrt", "tensorflow", "keras", "litert", "upstream",
                                    "openai", "transformers", "llama_cpp"}  # "Generative models"
    assert {"torch", "torch_compile", "onnxruntime"} <= IMPLEMENTED_BACKENDS


def test_upstream_takes_target_and_model_not_path(base):
    config = parse_config(doc(fallback=UPSTREAM), base)
    fallback = config.models[0].fallback
    assert (fallback.target, fallback.model, fallback.path) == ("triton:8001", "resnet", None)
    lines = problems(doc(fallback={"backend": "upstream", "model": "resnet"}), base)
    assert len(lines) == 1 and lines[0].startswith("models[0].fallback: ")
    assert "target" in lines[0]
    lines = problems(doc(fallback={**UPSTREAM, "path": "m.onnx"}),
                     base)
    assert len(lines) == 1 and "path" in lines[0]
    lines = problems(doc(fallback={**UPSTREAM, "device": "cuda"}), base)
    assert len(lines) == 1 and "takes no device" in lines[0]


def test_target_and_model_only_for_upstream(base):
    lines = problems(doc(primary={**ORT, "target": "h:1"}), base)
    assert len(lines) == 1 and "upstream" in lines[0]


@pytest.mark.parametrize(
    ("backend", "path", "precision"),
    [("torch", "ref.pt", "int8"), ("torch_compile", "ref.pt", "int8"),
     ("onnxruntime", "m.onnx", "bf16")],
)
def test_precision_not_derivable(base, backend, path, precision):
    lines = problems(doc(primary={"backend": backend, "path": path, "precision": precision}), base)
    assert len(lines) == 1
    assert lines[0].startswith("models[0].primary: ")
    assert f"precision '{precision}' cannot be derived by backend '{backend}'" in lines[0]


@pytest.mark.parametrize(
    ("backend", "path", "precision"),
    [("torch", "ref.pt", "fp16"), ("torch", "ref.pt", "bf16"),
     ("onnxruntime", "m.onnx", "fp16"), ("onnxruntime", "m.onnx", "int8")],
)
def test_precision_derivable(base, backend, path, precision):
    config = parse_config(doc(primary={"backend": backend, "path": path, "precision": precision}),
                          base)
    assert config.models[0].primary.precision == precision
    assert precision in config.models[0].primary.describe()


def test_unknown_precision(base):
    lines = problems(doc(primary={**ORT, "precision": "fp8"}), base)
    assert len(lines) == 1 and lines[0].startswith("models[0].primary.precision: ")


# -- policy rules ----------------------------------------------------------------------------------
def test_fallback_model_needs_fallback(base):
    lines = problems(doc(policy={"action": "fallback_model"}), base)
    assert len(lines) == 1
    assert lines[0].startswith("models[0]")
    assert "fallback_model" in lines[0] and "'fallback'" in lines[0]


def test_fallback_model_with_fallback_is_valid(base):
    config = parse_config(doc(policy={"action": "fallback_model"}, fallback=dict(ORT)), base)
    assert config.models[0].policy.action == "fallback_model"


def test_recover_ratio_above_trip_ratio(base):
    lines = problems(doc(policy={"trip_ratio": 0.2, "recover_ratio": 0.3}), base)
    assert lines == ["models[0].policy: recover_ratio must not exceed trip_ratio (hysteresis)"]


def test_recover_ratio_equal_trip_ratio_is_allowed(base):
    config = parse_config(doc(policy={"trip_ratio": 0.2, "recover_ratio": 0.2}), base)
    assert config.models[0].policy.recover_ratio == config.models[0].policy.trip_ratio


def test_min_samples_above_window(base):
    lines = problems(doc(policy={"window": 10, "min_samples": 11}), base)
    assert lines == ["models[0].policy: min_samples must not exceed window"]


def test_trip_ratio_out_of_range(base):
    lines = problems(doc(policy={"trip_ratio": 1.5}), base)
    assert lines == ["models[0].policy.trip_ratio: must be in [0, 1]"]


def test_fallback_ops_needs_a_derived_int8_primary_a_reference_and_a_fallback(base):
    ops = {"action": "fallback_ops"}
    lines = problems(doc(fallback=dict(ORT), policy=ops), base)
    assert len(lines) == 1 and lines[0].startswith("models[0]: policy.action 'fallback_ops' "
                                                   "needs a 'reference'")
    lines = problems(doc(fallback=dict(ORT), reference=dict(ORT), policy=ops), base)
    assert len(lines) == 1 and "onnxruntime precision int8" in lines[0]
    config = parse_config(doc(primary={**ORT, "precision": "int8"}, reference=dict(ORT),
                              fallback=dict(ORT), policy=ops), base)
    assert config.models[0].policy.action == "fallback_ops"
    assert config.models[0].policy.repair.buffer == 32
    config = parse_config(doc(primary={**ORT, "precision": "fp16"}, reference=dict(ORT),
                              fallback=dict(ORT), policy=ops), base)
    assert config.models[0].primary.precision == "fp16"


def test_fallback_ops_rejects_a_primary_it_cannot_rebuild(base):
    ops = {"action": "fallback_ops"}
    # A torch fp16 primary is not an ONNX graph the fp16 converter can rebuild.
    lines = problems(doc(primary={**TORCH, "precision": "fp16"}, reference=dict(ORT),
                         fallback=dict(ORT), policy=ops), base)
    assert len(lines) == 1 and "precision int8 or fp16" in lines[0], lines
    assert "this primary is torch fp16" in lines[0]


def test_fallback_ops_on_torch_compile_needs_a_torch_reference_and_no_fullgraph(base):
    ops = {"action": "fallback_ops"}
    factory = "fixture_models:affine"
    compiled = {"backend": "torch_compile", "path": factory}
    torch_ref = {"backend": "torch", "path": factory}
    for precision in ("fp32", "fp16", "bf16"):
        config = parse_config(doc(primary={**compiled, "precision": precision},
                                  reference=torch_ref, fallback=torch_ref, policy=ops), base)
        assert config.models[0].primary.precision == precision
    lines = problems(doc(primary=compiled, reference=dict(ORT), fallback=torch_ref,
                         policy=ops), base)
    assert len(lines) == 1 and "reference.backend must be torch" in lines[0], lines
    lines = problems(doc(primary={**compiled, "options": {"fullgraph": True}},
                         reference=torch_ref, fallback=torch_ref, policy=ops), base)
    assert len(lines) == 1 and "primary.options.fullgraph must be false" in lines[0], lines
    lines = problems(doc(primary={**compiled, "options": {
        "fullgraph": True, "eager_fp32_modules": ["attn"]}}), base)
    assert lines == ["models[0].primary.options.eager_fp32_modules: needs fullgraph: false "
                     "(each module kept eager is a graph break)"]


def test_fallback_ops_on_tensorrt_needs_a_reduced_precision(base):
    ops = {"action": "fallback_ops"}
    trt = {"backend": "tensorrt", "path": "m.onnx"}
    config = parse_config(doc(primary={**trt, "precision": "fp16"}, reference=dict(ORT),
                              fallback=dict(ORT), policy=ops), base)
    assert config.models[0].primary.backend == "tensorrt"
    lines = problems(doc(primary=trt, reference=dict(ORT), fallback=dict(ORT), policy=ops), base)
    assert len(lines) == 1 and "tensorrt precision int8 or fp16" in lines[0]
    assert "this primary is tensorrt fp32" in lines[0]


def test_duplicate_model_names(base):
    data = doc()
    data["models"].append({"name": "m", "primary": dict(ORT)})
    lines = problems(data, base)
    assert len(lines) == 1
    assert "'m'" in lines[0] and "twice" in lines[0]


@pytest.mark.parametrize("version", [2, 0, "1", "one"])
def test_version_must_be_1(base, version):
    data = doc()
    data["version"] = version
    lines = problems(data, base)
    assert len(lines) == 1 and lines[0].startswith("version: ")


# -- document shape and YAML ----------------------------------------------------------------------
@pytest.mark.parametrize("data", [None, [1, 2], "text", 5])
def test_not_a_mapping(base, data):
    lines = problems(data, base)
    assert len(lines) == 1
    assert lines[0].startswith("(top level): ")
    assert "mapping" in lines[0]


def test_models_not_a_list(base):
    lines = problems({"version": 1, "models": "abc"}, base)
    assert len(lines) == 1 and lines[0].startswith("models: ")


def test_bad_yaml_reports_line_and_column(tmp_path):
    path = write(tmp_path / "guard.yaml",
                 "version: 1\nmodels:\n  - name: a\n    primary: {backend: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.problems) == 1
    line = info.value.problems[0]
    assert line.startswith("(yaml): ")
    assert re.search(r"line \d+, column \d+", line)
    assert info.value.source == str(path)


def test_bad_yaml_points_at_the_offending_line(tmp_path):
    # A tab-indented block: the scanner fails on line 3.
    path = write(tmp_path / "guard.yaml", "version: 1\nmodels:\n\t- name: a\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert re.search(r"\bline 3, column \d+", info.value.problems[0])


def test_empty_file_is_not_a_mapping(tmp_path):
    path = write(tmp_path / "guard.yaml", "")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems[0].startswith("(top level): ")


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.yaml")
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("(file): cannot read")
    assert str(tmp_path / "absent.yaml") in str(info.value)


def test_config_error_is_a_guard_error_with_source(base):
    path = write(base / "guard.yaml", doc(bogus=1))
    with pytest.raises(GuardError) as info:
        load_config(path)
    assert isinstance(info.value, ConfigError)
    assert info.value.source == str(path)
    assert str(info.value) == f"{path}: models[0].bogus: unknown key"


def test_load_config_yaml_unknown_key_at_right_path(base):
    text = """
version: 1
models:
  - name: a
    primary:
      backend: onnxruntime
      path: m.onnx
      options: {bogus: 1}
  - name: b
    primary: {backend: torch, path: "fixture_models:affine", options: {kwarg: {}}}
"""
    with pytest.raises(ConfigError) as info:
        load_config(write(base / "guard.yaml", text))
    assert info.value.problems == [
        "models[0].primary.options.bogus: unknown key",
        "models[1].primary.options.kwarg: unknown key",
    ]


# -- format_validation_error ----------------------------------------------------------------------
def test_format_validation_error_lines():
    with pytest.raises(ValidationError) as info:
        GuardConfig.model_validate(
            {"version": 1, "extra": 0,
             "models": [{"name": "a", "primary": {"backend": "torch", "path": "x.pt"},
                         "mirror": {"sample_rate": 3}}]}
        )
    lines = format_validation_error(info.value)
    assert sorted(lines) == ["extra: unknown key",
                             "models[0].mirror.sample_rate: must be in [0, 1]"]


def test_format_validation_error_strips_value_error_prefix():
    with pytest.raises(ValidationError) as info:
        BackendConfig.model_validate({"backend": "onnxruntime", "path": "x", "device": "tpu"})
    (line,) = format_validation_error(info.value)
    assert line.startswith("device: device 'tpu'")
    assert "Value error" not in line


def test_format_validation_error_union_field_keeps_field_path():
    with pytest.raises(ValidationError) as info:
        GuardConfig.model_validate(
            {"version": 1,
             "models": [{"name": "a", "primary": {"backend": "torch", "path": "x.pt"},
                         "checks": {"tensor": {"outputs": {"y": {"atol": -2}}}}}]}
        )
    assert format_validation_error(info.value) == [
        "models[0].checks.tensor.outputs.y.atol: must be >= 0"
    ]


# -- JSON Schema ----------------------------------------------------------------------------------
def test_config_json_schema():
    schema = config_json_schema()
    assert isinstance(schema, dict)
    text = json.dumps(schema)  # serialisable
    assert json.loads(text) == schema
    props = schema["properties"]
    assert {"version", "server", "models"} <= set(props)
    assert "models" in schema.get("required", [])
    assert "version" in schema.get("required", [])
    assert schema.get("additionalProperties") is False
    defs = schema["$defs"]
    assert "grpc_port" in defs["ServerConfig"]["properties"]
    backend = defs["BackendConfig"]["properties"]
    assert {"backend", "path", "precision", "device", "options"} <= set(backend)
    assert "onnxruntime" in json.dumps(backend["backend"])
    assert "sample_rate" in defs["MirrorConfig"]["properties"]


def test_torch_compile_refuses_torchscript(base):
    lines = problems(doc(fallback={"backend": "torch_compile", "path": "ref.pt"}), base)
    assert len(lines) == 1 and "cannot compile a TorchScript" in lines[0]


def test_two_listeners_on_one_port_are_refused(base):
    """serve would fail at start blaming another process for guard's own listener."""
    data = doc()
    data["server"] = {"grpc_port": 18001, "metrics_port": 18001, "admin_port": 0,
                      "http_port": 0}
    assert problems(data, base) == [
        "server.metrics_port: 18001 is server.grpc_port too; each listener needs a port of "
        "its own"]
    data["server"]["metrics_port"] = 0  # 0 picks a free port: never a clash
    assert parse_config(data, base, "guard.yaml").server.metrics_port == 0
