"""The matrix's ONNX Runtime GenAI engine (guard/backends/onnxruntime_genai.py) against
transformers on the same weights: a seeded two-layer llama with SmolLM2's tokenizer, built by
ONNX Runtime GenAI's real model builder at fp32 (about 10 s), so that the two engines must agree
to float rounding."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai (the ort-genai extra) is not "
                    "installed")
pytest.importorskip("transformers", reason="transformers (the llm extra) is not installed")

from guard.config import BackendConfig  # noqa: E402
from guard.matrix.columns import ScorerColumn  # noqa: E402
from guard.verify.generation import check_generation  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from guard.zoo.llm import smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("ort-genai")
    hf, built = root / "hf", root / "built"
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                              local_files_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    done = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i",
                           str(hf), "-o", str(built), "-p", "fp32", "-e", "cpu", "-c",
                           str(root / "cache")], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return hf, built


@pytest.fixture(scope="module")
def scorers(folders):
    from guard.backends import create_backend
    from guard.backends.onnxruntime_genai import OrtGenAIScorer

    hf, built = folders
    ort = OrtGenAIScorer(BackendConfig(backend="onnxruntime_genai", path=str(built)), "primary", 1)
    ort.load()
    torch_side = create_backend(BackendConfig(backend="transformers", path=str(hf)),
                                "reference", 1)
    torch_side.load()
    yield ort, torch_side
    ort.close()
    torch_side.close()


def test_teacher_forcing_agrees_with_transformers(scorers):
    ort, torch_side = scorers
    ids = torch_side.encode_prompt("The capital of France is") + [1000, 2000, 3000, 4000]
    a, b = ort.forward(ids, 5), torch_side.forward(ids, 5)
    assert a.shape == b.shape == (len(ids) - 5, 49152)
    assert np.max(np.abs(a - b)) < 1e-3
    assert ort.encode_prompt("x y") == torch_side.encode_prompt("x y")


def test_greedy_is_the_argmax_of_its_own_distributions(scorers):
    ort, _ = scorers
    prompt = ort.encode_prompt("Once upon a time")
    ids = ort.greedy(prompt, 8)
    assert len(ids) == 8
    assert list(ort.forward(prompt + ids, len(prompt)).argmax(-1)) == ids


def test_a_column_of_it_passes_the_tier_against_the_same_weights(scorers):
    """The matrix's column: a greedy completion with the top-20 a server would return, scored
    by transformers on the same weights: a KLD of float rounding. (Not the same top-1 at every
    position: a random model's distributions are near-uniform, so rounding may flip them.)"""
    ort, torch_side = scorers
    sample = ScorerColumn(ort).complete("The capital of France is", 8, 20)
    assert len(sample.tokens) == 8 and all(len(t.top) == 20 for t in sample.tokens)
    check = check_generation(sample, torch_side.score(sample))
    assert check.mode == "logprobs" and check.passed
    assert check.mean_kld < 1e-4
