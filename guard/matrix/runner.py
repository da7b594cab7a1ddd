"""Run a matrix: every model on the reference and on every backend, then every check.

One *check* is (model, backend, tolerance, tier) over the model's input set: it passes when
every sample passes that tier. Each check becomes one JSONL record with the configuration, the
statistics (worst over samples for errors, mean for task metrics), latencies, the failure type
(``exception``: the backend could not load or run; ``shape``: outputs differ in count, names,
shapes, dtypes or nesting; ``numeric``: tolerance exceeded or NaN/Inf disagreement; ``task``:
tier 3 failed) and the environment fingerprint. A backend that does not apply to a model (no
ONNX artifact for an onnxruntime backend) is recorded as ``skip`` and left out of pass rates.

Each backend is loaded once per model and run on every sample; checks at every tolerance reuse
those outputs (the tolerance changes the verdict, not the answers).

The reference's options that describe the model rather than its engine (a TorchScript's input
and output names, a factory's arguments: ``DESCRIBES_MODEL`` in guard/backends/options.py) reach
every column whose backend takes them, unless the column sets its own: a user's TorchScript
named by the reference's ``output_names`` is named alike in the torch columns. Inputs are
generated from the reference's signature, or, where it cannot tell datatypes and shapes (a
TorchScript without ``guard.json``), from the first column's whose artifact can (its ONNX).
Outputs are matched as the verifier matches a served pair (guard/backends/signature_match.py):
by name, else by position where count, kinds and shapes agree (TorchScript's ``output0`` against
the ONNX export's ``scores``: a name is not drift; the record says ``outputs_matched``); what
cannot be matched is compared by name and fails as ``shape``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from guard import __version__

from guard.machine import cpu_model

from guard.backends.base import Role
from guard.config import BackendConfig, ChecksConfig, ConfigContext
from guard.matrix.config import MatrixBackend, MatrixConfig, MatrixModel, ReferenceBackend
from guard.verify.pipeline import CheckResult, Comparator

log = logging.getLogger("guard.matrix")

SHAPE_WORDS = ("shape", "lacks this output", "dtype", "adapter failed", "non-numeric")


@dataclass
class PreparedModel:
    config: MatrixModel
    task: str
    adapters: list
    torchscript: str | None = None
    onnx: str | None = None
    factory: str | None = None
    factory_kwargs: dict = field(default_factory=dict)
    eager_factory: str | None = None  # zoo models: the eager module, for torch_compile
    keras: str | None = None  # the zoo's Keras ports: the .keras and its SavedModel
    saved_model: str | None = None
    samples: list[dict[str, np.ndarray]] = field(default_factory=list)


def zoo_dir() -> Path:
    """Exported zoo models live in the guard cache, not beside the results."""
    from guard.backends.derive import cache_root

    folder = cache_root() / "zoo"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def environment() -> dict:
    import importlib.metadata as md

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    cpu = cpu_model(platform.processor() or "")
    # guard's own version from the code that ran (a checkout on PYTHONPATH has no metadata).
    env = {"guard": __version__, "python": platform.python_version(),
           "numpy": np.__version__, "torch": version("torch"),
           "onnxruntime": version("onnxruntime"), "platform": platform.platform(),
           "cpu": cpu, "cores": os.cpu_count(),
           # Other work on the machine slows latencies, never the accuracy figures.
           "loadavg": [round(v, 2) for v in os.getloadavg()]}
    try:
        import torch

        env["torch_threads"] = torch.get_num_threads()
        env["torch_deterministic"] = torch.are_deterministic_algorithms_enabled()
    except ImportError:
        pass
    return env


def gpu_environment() -> dict:
    """The GPU a CUDA column ran on; empty until one has (CUDA is never initialised to ask)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    return {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}


def prepare(model: MatrixModel, workdir: Path) -> PreparedModel:
    adapters = model.adapters
    if model.zoo is not None:
        from guard.zoo import zoo_entry

        entry = zoo_entry(model.zoo)
        paths = entry.export(workdir, 0)
        prepared = PreparedModel(model, model.task or entry.task,
                                 adapters if adapters is not None else _adapter_configs(
                                     entry.adapters),
                                 torchscript=str(paths.get("torchscript") or "") or None,
                                 onnx=str(paths.get("onnx") or "") or None,
                                 # A real model without TorchScript runs eager on every torch
                                 # backend (minilm: transformers' module).
                                 factory=None if paths.get("torchscript") else entry.factory,
                                 factory_kwargs=dict(entry.factory_kwargs),
                                 eager_factory=entry.factory,
                                 keras=str(paths.get("keras") or "") or None,
                                 saved_model=str(paths.get("saved_model") or "") or None)
        n = model.inputs.samples * model.inputs.batch
        arrays = entry.sample_inputs(n, model.inputs.seed)
    else:
        prepared = PreparedModel(model, model.task or "generic", adapters or [],
                                 torchscript=model.torchscript, onnx=model.onnx,
                                 factory=model.factory,
                                 factory_kwargs=dict(model.factory_kwargs))
        arrays = None
    if model.inputs.file is not None:
        with np.load(model.inputs.file) as data:
            arrays = {k: data[k] for k in data.files}
    prepared.samples = _split(arrays, model.inputs.batch, model.inputs.samples) if arrays else []
    return prepared


def _adapter_configs(entries) -> list:
    from guard.config import AdapterConfig, _adapter_entry

    return [AdapterConfig.model_validate(_adapter_entry(e)) for e in entries]


def _split(arrays: dict[str, np.ndarray], batch: int, samples: int) -> list[dict]:
    rows = min(a.shape[0] for a in arrays.values())
    count = min(samples, max(1, rows // batch))
    return [{k: v[i * batch:(i + 1) * batch] for k, v in arrays.items()} for i in range(count)]


# A TensorFlow-family format -> the PreparedModel field holding it, in the order preferred.
_TF_ARTIFACTS = {"tf_saved_model": "saved_model", "keras": "keras"}


def backend_spec(model: PreparedModel, kind: str, precision: str, options: dict,
                 base: Path, device: str = "cpu", artifact: str | None = None
                 ) -> BackendConfig | str:
    """The backend block for this model, or why the backend does not apply to it.
    ``artifact``: the format to give it instead of the one its kind's formats pick."""
    from guard.backends import backend_kind

    options = dict(options)
    formats = backend_kind(kind).formats if artifact is None else frozenset({artifact})
    tf_formats = [f for f in _TF_ARTIFACTS if f in formats]
    if tf_formats and "onnx" not in formats:
        path = next((getattr(model, _TF_ARTIFACTS[f]) for f in tf_formats
                     if getattr(model, _TF_ARTIFACTS[f])), None)
        if path is None:
            return f"no {' or '.join(tf_formats)} artifact for this model"
    elif "onnx" in formats:
        if not model.onnx:
            return "no ONNX artifact for this model"
        path = model.onnx
    elif "factory" in formats and (model.factory or (
            "torchscript" not in formats and model.eager_factory)):
        # torch.compile cannot compile TorchScript: it gets the eager module when there is one.
        path = model.factory or model.eager_factory
        options.setdefault("kwargs", model.factory_kwargs)
    elif model.torchscript and _torch_format(model.torchscript) in formats:
        path = model.torchscript
    elif model.torchscript:  # torch.compile cannot compile TorchScript
        return (f"{kind} takes a torch.export program (.pt2) or a factory, and this model has "
                "a TorchScript file only")
    else:
        return "no TorchScript artifact or factory for this model"
    from guard.errors import ConfigError
    from guard.plan.serving import backend_block

    # Checked against the backend's declaration, which may normalise it (TensorRT's device).
    try:
        return backend_block({"backend": kind, "path": path, "precision": precision,
                              "device": device, "options": options},
                             ConfigContext(base_dir=base), f"the matrix's {kind} block")
    except ConfigError as exc:  # this column cannot take this model (a .pt2 below fp32...)
        return "; ".join(exc.problems)


def _torch_format(path: str) -> str:
    """The format of a MatrixModel's ``torchscript`` file: TorchScript, or a torch.export
    program (.pt2)."""
    return "torch_export" if path.endswith(".pt2") else "torchscript"


def column_options(reference: ReferenceBackend, column: MatrixBackend) -> dict:
    """``column``'s options with the reference's model-describing ones it takes and does not
    set itself (see the module docstring)."""
    from guard.backends.options import model_options

    shared = model_options(reference.backend) & model_options(column.backend)
    inherited = {key: value for key, value in reference.options.items()
                 if key in shared and key not in column.options}
    return {**inherited, **column.options}


def input_signature(reference, config: MatrixConfig, prepared: PreparedModel, base: Path,
                    say: Callable[[str], None]):
    """The input specs to generate a model's inputs from: the loaded ``reference``'s, else
    those of the first column that can tell them and names the same inputs."""
    from guard.backends import create_backend
    from guard.backends.signature_match import generatable
    from guard.protocol.synthetic import CannotGenerate

    own = reference.describe().inputs
    if generatable(own):
        return own
    names = {spec.name for spec in own}
    seen = []  # (column, its input names) that could have given inputs under other names
    for column in config.backends:
        spec = backend_spec(prepared, column.backend, "fp32", {}, base, column.device,
                            column.artifact)
        if isinstance(spec, str):
            continue
        backend = create_backend(spec, "primary", 1)
        try:
            backend.load()
            specs = backend.describe().inputs
        except Exception:  # a column that cannot load says so when it runs
            continue
        finally:
            backend.close()
        if generatable(specs) and (not names or {s.name for s in specs} == names):
            say(f"model {prepared.config.name}: inputs generated from {column.name}'s "
                f"signature (the reference declares no datatypes or shapes)")
            return specs
        if generatable(specs):
            seen.append((column.name, [s.name for s in specs]))
    if seen:
        first, theirs = seen[0]
        listed = f"[{', '.join(theirs)}]"
        raise CannotGenerate(
            f"the reference declares no datatypes or shapes for its inputs "
            f"[{', '.join(sorted(names))}], and {first}'s signature, which could give them, "
            f"names them {listed}: name the reference's inputs alike "
            f"(reference.options.input_names: {listed}, which the torch columns get too) or "
            "give inputs.file (.npz)")
    return own


@dataclass
class BackendRun:
    outputs: list[dict] = field(default_factory=list)
    error: str = ""
    load_s: float = 0.0
    latency_ms: float = 0.0
    # describe().details after load: what the backend found worth saying (a trace's baked
    # cuDNN flags, ONNX Runtime's int8 kernels, OpenVINO's precision as run), in the records.
    details: dict[str, str] = field(default_factory=dict)


def output_match(model: str, reference: BackendRun, column: BackendRun):
    """The reference's outputs lined up with a column's from their first answers (see the
    module docstring); an empty match where they cannot be lined up."""
    from guard.backends.base import BackendInfo
    from guard.backends.signature_match import OutputMatch, answer_specs, match_outputs
    from guard.errors import BackendError

    if not reference.outputs or not column.outputs:
        return OutputMatch()
    sides = [BackendInfo(role, "", "", "", (), answer_specs(run.outputs[0]))
             for role, run in (("reference", reference), ("column", column))]
    try:
        return match_outputs(model, sides[0], sides[1])
    except BackendError:
        return OutputMatch()


def run_backend(spec: BackendConfig, role: Role, threads: int, samples,
                generate=None) -> BackendRun:
    from guard.backends import create_backend

    run = BackendRun()
    started = time.perf_counter()
    try:
        backend = create_backend(spec, role, threads)
        backend.load()
    except Exception as exc:
        run.error = f"load failed: {type(exc).__name__}: {exc}"
        return run
    run.load_s = time.perf_counter() - started
    try:
        run.details = dict(backend.describe().details)
        if not samples and generate is not None:
            samples[:] = generate(backend)
        if samples:
            backend.infer(samples[0])  # warm-up (torch.compile compiles here)
        times = []
        for sample in samples:
            t0 = time.perf_counter()
            run.outputs.append(backend.infer(sample))
            times.append(time.perf_counter() - t0)
        run.latency_ms = 1000 * statistics.median(times) if times else 0.0
    except Exception as exc:
        run.error = f"inference failed: {type(exc).__name__}: {exc}"
        log.debug("%s", traceback.format_exc())
    finally:
        backend.close()
    return run


def _tensor_failure(result: CheckResult) -> str:
    reasons = " ".join(o.reason for o in result.tensor.failures)
    return "shape" if any(w in reasons for w in SHAPE_WORDS) else "numeric"


def _tier_stats(tier: str, results: list[CheckResult]) -> dict:
    if tier == "tensor":
        outs = [o for r in results for o in r.tensor.outputs]
        finite = [o for o in outs if np.isfinite(o.max_abs)]
        worst = lambda key: max((getattr(o, key) for o in finite), default=0.0)  # noqa: E731
        return {
            "outputs": len({o.name for o in outs}),
            "max_abs": worst("max_abs"),
            "mean_abs": float(np.mean([o.mean_abs for o in finite])) if finite else 0.0,
            "p99_abs": worst("p99_abs"),
            "max_rel": worst("max_rel"),
            "cosine_distance": worst("cosine_distance"),
            "min_rtol_to_pass": worst("min_rtol"),
            "nonfinite_mismatch": sum(o.nonfinite_mismatch for o in outs),
        }
    metrics: dict[str, list[float]] = {}
    for r in results:
        for key, value in (r.task.metrics if r.task is not None else {}).items():
            if isinstance(value, (int, float)):
                metrics.setdefault(key, []).append(float(value))
    return {k: float(np.mean(v)) for k, v in metrics.items()}


def _first_reason(tier: str, results: list[CheckResult]) -> str:
    for r in results:
        t = r.tiers.get(tier)
        if t is not None and not t.passed:
            return t.summary()[:400]
    return ""


def run_matrix(config: MatrixConfig, base: Path, output_dir: Path,
               say: Callable[[str], None] = print) -> list[dict]:
    from guard.protocol.synthetic import generate_inputs

    output_dir.mkdir(parents=True, exist_ok=True)
    env: dict = {}
    records: list[dict] = []
    records_path = output_dir / "records.jsonl"
    handle = records_path.open("w")
    grid = [(a, r) for a in config.tolerances.atol for r in config.tolerances.rtol]

    def emit(record: dict) -> None:
        if not env:  # taken after the reference loaded: its determinism flags are then set
            env.update(environment())
        if "gpu" not in env:  # records share env: the summary's machine line names the GPU
            env.update(gpu_environment())
        record["environment"] = env
        records.append(record)
        handle.write(json.dumps(record, default=float) + "\n")
        handle.flush()

    try:
        for model in config.models:
            if model.task == "generation":
                from guard.matrix.generation import run_generation_model

                if "generation" in config.tiers:
                    run_generation_model(config, model, emit, say)
                else:
                    say(f"model {model.name}: task generation, but tiers name no generation")
                continue
            say(f"model {model.name}: preparing")
            prepared = prepare(model, zoo_dir())
            ref_config = model.reference or config.reference
            ref_spec = backend_spec(prepared, ref_config.backend, "fp32", ref_config.options, base)
            if isinstance(ref_spec, str):
                say(f"model {model.name}: no reference ({ref_spec}); skipped")
                continue

            # Bound now: the reference and every column of this model run before the loop moves on,
            # but the closure must not read whichever model the loop holds later.
            def generate(backend, prepared=prepared, model=model):
                specs = input_signature(backend, config, prepared, base, say)
                return _split(generate_inputs(specs, model.inputs.samples * model.inputs.batch,
                                              model.inputs.seed),
                              model.inputs.batch, model.inputs.samples)

            reference = run_backend(ref_spec, "reference", 1, prepared.samples, generate)
            if reference.error:
                say(f"model {model.name}: reference failed ({reference.error}); skipped")
                continue
            say(f"model {model.name}: reference {ref_config.backend} fp32, "
                f"{len(prepared.samples)} samples, {reference.latency_ms:.2f} ms/sample")
            for backend in config.backends:
                _check_backend(config, base, prepared, backend, reference, grid, emit, say,
                               ref_spec)
    finally:
        handle.close()
    return records


def _check_backend(config, base, prepared: PreparedModel, backend: MatrixBackend,
                   reference: BackendRun, grid, emit, say, ref_spec=None) -> None:
    from guard.matrix.generation import applies

    model = prepared.config
    # The options the column ran with (its own and those it takes from the reference), as recorded.
    options = column_options(model.reference or config.reference, backend)
    spec: BackendConfig | str
    if applies(backend):
        spec = "a generative column (task generation models only)"
    else:
        spec = backend_spec(prepared, backend.backend, backend.precision, options, base,
                            backend.device, backend.artifact)
    common = {"matrix": config.name, "model": model.name, "task": prepared.task,
              "reference": f"{(model.reference or config.reference).backend} fp32",
              "backend": backend.name,
              "backend_kind": backend.backend, "precision": backend.precision,
              "device": backend.device, "cause": backend.cause,
              "options": options, "adapters": [a.name for a in prepared.adapters],
              "samples": len(prepared.samples)}
    tiers = [t for t in config.tiers if t != "task" or prepared.task != "generic"]
    if isinstance(spec, str):
        for atol, rtol in grid:
            for tier in tiers:
                emit({**common, "atol": atol, "rtol": rtol, "tier": tier, "status": "skip",
                      "failure_type": None, "reason": spec})
        say(f"  {backend.name}: skipped ({spec})")
        return
    if backend.process == "own":
        from guard.matrix.apart import run_apart

        run = run_apart(spec, "primary", config.threads, prepared.samples)
    else:
        run = run_backend(spec, "primary", config.threads, prepared.samples)
    latency = {"reference_ms": reference.latency_ms, "backend_ms": run.latency_ms,
               "backend_load_s": round(run.load_s, 3)}
    if run.details:
        common["backend_details"] = run.details
    if run.error:
        for atol, rtol in grid:
            for tier in tiers:
                emit({**common, "atol": atol, "rtol": rtol, "tier": tier, "status": "fail",
                      "failure_type": "exception", "reason": run.error})
        say(f"  {backend.name}: exception: {run.error}")
        return
    match = output_match(model.name, reference, run)
    if match.renamed:
        common["outputs_matched"] = match.renamed
        reference = BackendRun([match.apply(outputs) for outputs in reference.outputs],
                               reference.error, reference.load_s, reference.latency_ms)
    passed_cells: list[bool] = []
    localiser = None
    if "activation" in tiers:
        from guard.matrix.localise import Localiser, capture_reference

        localiser = Localiser(capture_reference(prepared, ref_spec), spec,
                              backend.process == "own")
    try:
        _check_cells(model, prepared, grid, tiers, reference, run, common, latency, emit,
                     passed_cells, localiser)
    finally:
        if localiser is not None:
            localiser.close()
    matched = f" (outputs matched by position: {match.describe()})" if match.renamed else ""
    say(f"  {backend.name}: {sum(passed_cells)}/{len(passed_cells)} checks pass, "
        f"{run.latency_ms:.2f} ms/sample{matched}")


def _check_cells(model, prepared: PreparedModel, grid, tiers, reference: BackendRun,
                 run: BackendRun, common: dict, latency: dict, emit, passed_cells: list,
                 localiser) -> None:
    for atol, rtol in grid:
        checks = ChecksConfig.model_validate({
            "tensor": {"atol": atol, "rtol": rtol, "noise_floor": {"enabled": False}},
            "task": model.checks.task.model_dump(exclude_unset=True)})
        comparator = Comparator(checks, prepared.task, prepared.adapters)
        comparator.pass_stats = True  # the sweep's tables report every output's statistics
        results = [comparator.check(ref, out) for ref, out in zip(reference.outputs, run.outputs)]
        if localiser is not None:  # tier 2 on the cell's first tier-1 failure
            record = localiser.record(atol, rtol, results, prepared.samples)
            emit({**common, "atol": atol, "rtol": rtol, "tier": "activation", **record,
                  "latency": latency})
            if record["status"] != "skip":
                passed_cells.append(record["status"] == "pass")
        for tier in [t for t in tiers if t != "activation"]:
            tier_results = [r.tiers[tier] for r in results]
            ok = all(t.passed for t in tier_results)
            failure = None
            if not ok:
                if tier == "tensor":
                    failure = next(_tensor_failure(r) for r in results if not r.tensor.passed)
                else:
                    failure = next(("shape" if t.failure == "shape" else "task")
                                   for t in tier_results if not t.passed)
            emit({**common, "atol": atol, "rtol": rtol, "tier": tier,
                  "status": "pass" if ok else "fail", "failure_type": failure,
                  "reason": "" if ok else _first_reason(tier, results),
                  "samples_passed": sum(t.passed for t in tier_results),
                  "stats": _tier_stats(tier, results), "latency": latency})
            passed_cells.append(ok)
