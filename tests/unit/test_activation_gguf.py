"""Tier 2 for GGUF engines (issue 30): llama.cpp's graph, captured node by node through its eval
callback, aligned with the transformers reference's modules and isolated on the reference's side
(the callback only observes). The real SmolLM2-135M GGUF (guard.zoo.llm), real llama.cpp
(llama-cpp-python), real transformers: a file with one tensor requantized to a much lower type
is named at that layer; the clean file names none. The perturbed tensors and the other clean
rungs are in the corpus (guard.zoo.faults.gguf_cases, benchmarks/localisation.py).

The reference loads once per module (SmolLM2 dequantized to fp32; tens of seconds on a loaded
CPU); each check isolates every one of the ~360 aligned layers."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llm extra) is not installed")
pytest.importorskip("transformers", reason="transformers (the llm extra) is not installed")
pytest.importorskip("gguf", reason="gguf (the llm extra) is not installed")

from guard.config import ActivationCheckConfig, TensorCheckConfig  # noqa: E402
from guard.verify.activation import ActivationChecker  # noqa: E402
from guard.verify.activation.decide import BASIS_PEERS  # noqa: E402
from guard.zoo import faults, llm  # noqa: E402

# A short text keeps each capture and isolation small.
TEXT = "The capital of France is Paris, and the"


@pytest.fixture(scope="module")
def shipped():
    try:
        return llm.smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def ids(shipped):
    return faults.gguf_ids(shipped, TEXT)


# The reference's own noise (its thread counts, ~1e-7) is nothing beside a quantized layer's
# peers: not measured here, to keep the file's runtime down.
NO_NOISE = {"noise_floor": {"enabled": False}}


def _check(shipped, primary, ids, true_layer=None):
    case = faults.FaultCase("case", "weight", "smollm2", shipped, primary,
                            {"input_ids": ids}, true_layer, tensor=NO_NOISE, gguf=True)
    return faults.check(case)


def test_the_clean_file_aligns_every_layer_and_names_none(shipped, ids):
    report = _check(shipped, shipped, ids)
    assert not report.error and not report.unaligned
    assert report.pair == "transformers/llama_cpp"
    names = [layer.name for layer in report.layers]
    # 30 blocks of 12 (9 modules, the attention's, the MLP's and the block's own code), the
    # embedding, the final norm and the head.
    assert len(names) == 30 * 12 + 3 and names[0] == "model.embed_tokens"
    assert names[-1] == "lm_head"
    block = {layer.name: layer for layer in report.layers if layer.name.startswith(
        "model.layers.0.")}
    # q and k compared in transformers' row order (llama.cpp's converter permuted them): what
    # reaches them is the same embedding, so they differ only by llama.cpp's own rounding.
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"):
        assert block[name].propagated.rel_error < 0.05
        assert block[name].isolated.rel_error == pytest.approx(
            block[name].propagated.rel_error, rel=1e-3)
    # Every quantized projection differs measurably by design, judged against its peers.
    assert all(layer.peer_group for layer in report.layers if layer.op == "Linear")
    assert report.first_divergence is None and report.passed, report.summary()


def test_one_tensor_requantized_lower_is_named_at_its_layer(shipped, ids):
    primary = llm.one_tensor_requantized("blk.3.ffn_down.weight", "Q2_K")
    from gguf import GGUFReader

    ours = {t.name: t for t in GGUFReader(str(primary)).tensors}
    changed = [t.name for t in GGUFReader(str(shipped)).tensors
               if t.tensor_type != ours[t.name].tensor_type
               or not np.array_equal(np.asarray(t.data), np.asarray(ours[t.name].data))]
    assert changed == ["blk.3.ffn_down.weight"]
    assert ours["blk.3.ffn_down.weight"].tensor_type.name == "Q2_K"

    report = _check(shipped, primary, ids, "model.layers.3.mlp.down_proj")
    first = report.first_divergence
    assert first is not None and first.name == "model.layers.3.mlp.down_proj"
    assert report.basis == BASIS_PEERS and not report.passed
    # It stands out from its peers; the blocks after it, fed its error, are not blamed.
    assert first.isolated.rel_error > 4 * first.peer_level
    assert first.peer_group == "model.layers.*.mlp.down_proj"
    assert [s.name for s in report.suspects][0] == first.name
    assert not any(s.divergent for s in report.layers if s is not first)


def test_a_whole_model_requantized_names_no_layer(shipped, ids):
    """Q2_K everywhere: every layer adds more error, alike; the drift is the model's, which the
    generation tier reports. With the completion failing it, tier 2 says why no layer."""
    from guard.verify.generation import GenerationCheck

    q2k = llm.quant_ladder(("Q2_K",))["Q2_K"]
    checker = faults.checker_for(faults.FaultCase(
        "q2k", "spread", "smollm2", shipped, q2k, {"input_ids": ids}, None, tensor=NO_NOISE,
        gguf=True))
    try:
        failing = GenerationCheck(passed=False, mode="logprobs", reason="mean KLD 0.45")
        report = checker.check({"input_ids": ids}, tier1=failing)
    finally:
        checker.close()
    assert report.budget.tier1_failed is True
    assert report.first_divergence is None
    assert "stands out from its peers'" in report.undetermined


def test_a_llama_cpp_side_beside_anything_but_transformers_is_refused(shipped):
    from guard.backends.activations import CaptureUnsupported
    from guard.backends.activations.llama_cpp import LlamaCppSide

    side = LlamaCppSide(shipped, label="primary")
    other = LlamaCppSide(shipped, label="reference")
    try:
        with pytest.raises(CaptureUnsupported, match="transformers reference"):
            ActivationChecker(ActivationCheckConfig(on_failure=True), other, side,
                              tensor=TensorCheckConfig())
        with pytest.raises(ValueError, match="one sequence"):
            side.capture({"input_ids": np.zeros((2, 4), dtype=np.int64)})
    finally:
        side.close()
        other.close()
