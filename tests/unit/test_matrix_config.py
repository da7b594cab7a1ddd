"""The shipped matrix configs validate, and a backend's stated cause reaches the summary."""

from __future__ import annotations

from pathlib import Path

from guard.matrix.config import load_matrix_config
from guard.matrix.report import markdown, summarise

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "matrix"


def test_shipped_matrix_configs_validate():
    for name in ("cpu.yaml", "gpu.yaml"):
        config, _ = load_matrix_config(CONFIGS / name)
        assert config.backends and config.models
    gpu, _ = load_matrix_config(CONFIGS / "gpu.yaml")
    assert {b.device for b in gpu.backends} == {"cpu", "cuda"}
    assert all(b.cause for b in gpu.backends)  # every failure class has its cause named


def test_causes_are_printed_beside_failures():
    record = {"model": "resnet", "backend": "cuda_eager_tf32", "tier": "tensor", "atol": 1e-6,
              "rtol": 1e-5, "status": "fail", "failure_type": "numeric",
              "cause": "TF32 on: matmul/conv inputs rounded to 10 mantissa bits",
              "environment": {}}
    text = markdown(summarise([record]), "gpu")
    assert "| backend | numeric | cause |" in text
    assert "| cuda_eager_tf32 | 1 | TF32 on: matmul/conv inputs rounded to 10 mantissa bits |" in text
