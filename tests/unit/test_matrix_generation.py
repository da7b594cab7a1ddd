"""guard matrix's generative columns on the real SmolLM2-135M-Instruct GGUF: the config's
checks, and one small sweep (2 prompts x 16 tokens) of llama.cpp in-process at F16 and Q2_K
and llama-cpp-python's server on the shipped Q4_1, against the fp32 reference (llama.cpp on
the GGUF dequantized to F32: the weights of the transformers reference, loaded in a second;
tests/unit/test_generation_tier.py runs the transformers one).

Every assertion is a property that holds on any x86-64 CPU: the ladder's gaps (F16 ~0, Q2_K
~0.4 nats per token) are orders of magnitude wider than kernel differences between CPUs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from guard.errors import BackendError, ConfigError
from guard.matrix.config import load_matrix_config
from guard.matrix.generation import perplexity_statistics, summarize_perplexity

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "matrix"


def _write(tmp_path: Path, model: dict, backends: list[dict], **top) -> Path:
    path = tmp_path / "llm.yaml"
    path.write_text(yaml.safe_dump({
        "version": 1, "name": "llm-test", "output_dir": str(tmp_path / "out"), "threads": 1,
        "models": [{"name": "smol", "task": "generation", **model}], "backends": backends,
        "tolerances": {"atol": [0.0], "rtol": [0.0]}, "tiers": ["generation"], **top}))
    return path


def test_the_shipped_llm_config_validates():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llm extra) is not installed")
    config, _ = load_matrix_config(CONFIGS / "llm.yaml")
    assert config.models[0].task == "generation" and config.tiers == ["generation"]
    kinds = {b.backend for b in config.backends}
    assert kinds == {"llama_cpp", "openai", "transformers", "onnxruntime_genai"}
    gpu, _ = load_matrix_config(CONFIGS / "llm-gpu.yaml")
    assert {b.device for b in gpu.backends} == {"cpu", "cuda"}
    assert all(b.cause for b in gpu.backends)


def test_a_columns_device_reaches_its_scorer(tmp_path):
    """A generative column on cuda loads there (here: the backend's refusal before any weight
    loads), not on the CPU while its record says cuda."""
    from guard.matrix.columns import open_column
    from guard.matrix.config import MatrixBackend, MatrixModel

    pytest.importorskip("transformers", reason="transformers (the llm extra) is not installed")
    if torch_cuda_available():
        pytest.skip("this machine has CUDA: tests/gpu/test_gpu_llm.py runs the column there")
    model = MatrixModel.model_validate({"name": "smol", "zoo": "smollm2", "task": "generation"})
    column = MatrixBackend(name="c", backend="transformers", device="cuda")
    with pytest.raises(BackendError, match="device cuda: this torch build or machine has no CUDA"):
        open_column(model, column, 1)


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("model, backends, message", [
    ({"zoo": "nosuch"}, [{"name": "a", "backend": "llama_cpp"}],
     r"models\[0\]\.zoo: unknown LLM 'nosuch' \(available: smollm2\)"),
    ({"gguf": "missing.gguf"}, [{"name": "a", "backend": "llama_cpp"}],
     r"models\[0\]\.gguf: file not found"),
    ({"zoo": "smollm2", "reference": {"backend": "torch"}},
     [{"name": "a", "backend": "llama_cpp"}],
     r"models\[0\]\.reference\.backend: a generation model's reference is a teacher-forcing "
     r"scorer"),
    ({"zoo": "smollm2"}, [{"name": "a", "backend": "openai"}],
     r"backend openai needs 'serve: llama_cpp'"),
    ({"zoo": "smollm2"}, [{"name": "a", "backend": "transformers", "precision": "int8"}],
     r"backends\[0\]\.precision: transformers runs fp32, fp16 or bf16"),
    ({"zoo": "smollm2"}, [{"name": "a", "backend": "llama_cpp", "device": "cuda"}],
     r"backends\[0\]\.device: a llama_cpp column runs on the CPU"),
    ({"zoo": "smollm2"}, [{"name": "a", "backend": "transformers", "quant": "Q8_0"}],
     r"backends\[0\]\.quant: transformers runs the GGUF dequantized"),
    ({"zoo": "smollm2"}, [{"name": "a", "backend": "llama_cpp", "process": "own"}],
     r"backends\[0\]\.process: generative columns run in the sweep's process"),
    ({"zoo": "smollm2"}, [{"name": "a", "backend": "llama_cpp", "artifact": "onnx"}],
     r"backends\[0\]\.artifact: a generative column's artifact is derived"),
])
def test_bad_generation_configs_are_refused_with_the_key(tmp_path, model, backends, message):
    with pytest.raises(ConfigError, match=message):
        load_matrix_config(_write(tmp_path, model, backends))


def test_a_gguf_needs_task_generation(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({
        "version": 1, "models": [{"name": "m", "gguf": "x.gguf"}],
        "backends": [{"name": "a", "backend": "llama_cpp"}],
        "tolerances": {"atol": [0.0], "rtol": [0.0]}}))
    with pytest.raises(ConfigError, match="'gguf' is an LLM's: set task: generation"):
        load_matrix_config(path)


def test_perplexity_statistics_are_llama_perplexitys():
    """KL(reference || primary), Δp of the text's token, same top, PPL ratio: checked on two
    hand-made distributions."""
    reference = np.log(np.array([[0.7, 0.2, 0.1], [0.5, 0.25, 0.25]]))
    primary = np.log(np.array([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]]))
    tokens = np.array([0, 1])
    figures = summarize_perplexity([perplexity_statistics(reference, primary, tokens)])
    kld = [0.7 * np.log(0.7 / 0.6) + 0.2 * np.log(0.2 / 0.3),
           0.5 * np.log(0.5 / 0.2) + 0.25 * np.log(0.25 / 0.5) + 0.25 * np.log(0.25 / 0.3)]
    assert figures["mean_kld"] == pytest.approx(np.mean(kld))
    assert figures["delta_p_rms"] == pytest.approx(np.sqrt(((0.6 - 0.7) ** 2
                                                            + (0.5 - 0.25) ** 2) / 2))
    assert figures["same_top1"] == 0.5
    assert figures["ppl_ratio"] == pytest.approx(np.exp((-np.log(0.6) - np.log(0.5)) / 2
                                                        - (-np.log(0.7) - np.log(0.25)) / 2))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llm extra) is not installed")
    pytest.importorskip("transformers", reason="transformers (the llm extra) is not installed")
    from guard.cli import main
    from guard.zoo.llm import smollm2_gguf

    try:
        smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    tmp_path = tmp_path_factory.mktemp("matrix-llm")
    path = _write(tmp_path, {"zoo": "smollm2", "inputs": {"samples": 2, "max_tokens": 16},
                             "reference": {"backend": "llama_cpp", "quant": "F32",
                                           "options": {"context_length": 256}}},
                  [{"name": "llama_f16", "backend": "llama_cpp", "quant": "F16"},
                   {"name": "llama_q2_k", "backend": "llama_cpp", "quant": "Q2_K"},
                   {"name": "server_q4_1", "backend": "openai", "serve": "llama_cpp"}])
    code = main(["matrix", str(path), "--quiet"])
    out = tmp_path / "out"
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    return code, {r["backend"]: r for r in records}, (out / "summary.md").read_text()


def test_the_ladder_passes_near_the_top_and_fails_at_two_bits(sweep):
    code, records, _ = sweep
    assert code == 1  # some column fails
    f16, q2k, server = records["llama_f16"], records["llama_q2_k"], records["server_q4_1"]
    assert (f16["status"], server["status"]) == ("pass", "pass")
    assert (q2k["status"], q2k["failure_type"]) == ("fail", "generation")
    assert "max_mean_kld" in q2k["reason"]
    limit = 0.05  # checks.generation.max_mean_kld's default
    assert f16["stats"]["mean_kld"] < 0.01 * limit < limit < q2k["stats"]["mean_kld"]
    assert server["stats"]["mean_kld"] < limit
    for record in records.values():
        assert record["tier"] == "generation" and record["samples"] == 2
        assert record["reference"] == "llama.cpp on SmolLM2-135M-Instruct.Q4_1.gguf at F32"


def test_guards_figure_is_close_to_the_full_vocabulary_one(sweep):
    """From the top-20 a server returns, guard's KLD lands near the full-vocabulary KLD over
    the same tokens (32 tokens here: looser than the 10% the tier's own test holds over 96),
    and the lumped bound stays below it."""
    stats = sweep[1]["llama_q2_k"]["stats"]
    assert abs(stats["guard_over_full"] - 1) <= 0.25, stats
    assert stats["mean_kld_lower_bound"] <= stats["full_kld"] * (1 + 1e-3)
    assert "full_kld" not in sweep[1]["server_q4_1"]["stats"]  # a server gives top-k only


def test_llama_perplexity_statistics_order_the_ladder(sweep):
    f16 = sweep[1]["llama_f16"]["stats"]["perplexity"]
    q2k = sweep[1]["llama_q2_k"]["stats"]["perplexity"]
    assert f16["tokens"] == q2k["tokens"] > 0  # the same tokens: the reference's completions
    assert f16["mean_kld"] < q2k["mean_kld"] and f16["kld_p99"] < q2k["kld_p99"]
    assert f16["delta_p_rms"] < q2k["delta_p_rms"]
    assert f16["same_top1"] >= max(0.9, q2k["same_top1"]) and q2k["ppl_ratio"] > 1.0
    assert sweep[1]["server_q4_1"]["stats"]["perplexity"] == {}


def test_the_summary_names_the_reference_beside_the_figures(sweep):
    text = sweep[2]
    assert "## Generative columns of smol" in text
    assert "against the reference **llama.cpp on SmolLM2-135M-Instruct.Q4_1.gguf at F32**" \
        in text
    assert "| llama_q2_k | llama_cpp Q2_K | fail |" in text
    assert "| server_q4_1 | openai (llama_cpp server) GGUF as is | pass | 2/2 |" in text
