"""Constrained decoding against the generation tier: what JSON mode does to a healthy pair.

A request can constrain which tokens the server may choose: JSON mode (`response_format`),
a grammar, a schema, a logit bias. The server then samples from the model's distribution
masked by the constraint, and the sampled check (z: the reference's surprise at each token
against the transform the server applied) reads every forced token ('{', quotes) as a token the
model itself gives a few percent or less. This benchmark measures it on a pair known to agree:
the primary is llama-cpp-python's chat completion on SmolLM2's shipped Q4_1 GGUF (in-process:
the same code its server runs, JSON mode through its grammar), the reference guard's `llama_cpp`
scorer on the same file. Each call is built into a sample exactly as the HTTP edge builds it
(the request body through guard/protocol/openai/, the answer through `gather`), then checked:

- as guard checked it before it read constraints (the sample's `constraints` emptied): z;
- as guard checks it now: not comparable (`constrained`) without logprobs;
- with the primary's top-5 logprobs in the answer (the client asked, or the primary block's
  `options.sample_logprobs`): the per-token comparison, which needs no transform.

Free calls (the same prompts and seeds, no `response_format`) are the control.

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_constrained.py [--calls 12]
       [--tokens 24] [--out DIR]
Writes benchmarks/results/llm_constrained.{json,md} (machine noted).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
QUESTIONS = ("What is the capital of France?", "Name three colours.", "Who wrote Hamlet?",
             "What is 2+2?", "Describe a cat.", "List two planets.")
# llama.cpp's sampler, every value in the request (the preset below gives only its order).
SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
            "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def run(calls: int, tokens: int) -> dict:
    from llama_cpp import Llama

    from guard.backends import create_backend
    from guard.config.backend import BackendConfig
    from guard.protocol import openai as api
    from guard.verify.generation import SERVER_DEFAULTS, GenerationThresholds, check_generation
    from guard.zoo import llm as smol

    path = smol.smollm2_gguf()
    primary = Llama(str(path), n_ctx=512, logits_all=True, verbose=False, seed=0,
                    n_threads=1, n_threads_batch=1)
    reference = create_backend(BackendConfig(backend="llama_cpp", path=str(path),
                                             options={"context_length": 512}), "reference", 1)
    reference.load()
    limit = GenerationThresholds().max_abs_z
    engine = SERVER_DEFAULTS["llama-cpp-python"]  # its sampler's order; the values: the request's
    found: dict = {}
    try:
        for way, extra in (("free", {}), ("json_object",
                                          {"response_format": {"type": "json_object"}})):
            rows = []
            for seed in range(calls):
                body = {"model": "smol", "seed": seed, "max_tokens": tokens, **SAMPLING,
                        "messages": [{"role": "user",
                                      "content": QUESTIONS[seed % len(QUESTIONS)]}], **extra}
                call = api.parse_request("chat", json.dumps(body).encode())
                asked = {k: v for k, v in body.items() if k not in ("model", "messages")}
                answer = primary.create_chat_completion(messages=body["messages"],
                                                        logprobs=True, top_logprobs=5, **asked)
                # As its server sends it: JSON (the in-process answer holds numpy floats).
                answer = json.loads(json.dumps(answer, default=float))
                completion = api.Completion()
                api.gather(completion, "chat", answer, streamed=False)
                told = api.build_sample(call, completion)  # with the primary's logprobs
                plain = replace(told, tokens=())  # as a server that was not asked for them
                scores = reference.score(plain)
                now = check_generation(plain, scores, engine)
                before = check_generation(
                    replace(plain, sampling=replace(plain.sampling, constraints=())), scores,
                    engine)
                with_logprobs = check_generation(told, reference.score(told), engine)
                rows.append({"seed": seed, "text": told.completion_text,
                             "constraints": list(plain.sampling.constraints),
                             "before_mode": before.mode, "before_z": before.statistic,
                             "now_mode": now.mode, "now_cause": now.cause,
                             "logprobs_mode": with_logprobs.mode,
                             "logprobs_passed": with_logprobs.passed,
                             "logprobs_mean_kld": with_logprobs.mean_kld})
                bench.log(f"{way}: {seed + 1}/{calls}")
            zs = np.array([r["before_z"] for r in rows], dtype=float)
            found[way] = {
                "calls": rows,
                "before": {"failed": int(np.sum(np.abs(zs) > limit)),
                           "z_min": float(np.min(zs)), "z_median": float(np.median(zs)),
                           "z_max": float(np.max(zs))},
                "now": {"not_comparable": sum(r["now_mode"] == "not_comparable" for r in rows),
                        "failed": sum(r["now_mode"] == "sampled" and r["before_z"] is not None
                                      and abs(r["before_z"]) > limit for r in rows)},
                "logprobs": {"passed": sum(r["logprobs_mode"] == "logprobs"
                                           and bool(r["logprobs_passed"]) for r in rows),
                             "mean_kld_max": float(np.nanmax([r["logprobs_mean_kld"]
                                                              for r in rows]))},
            }
    finally:
        primary.close()
        reference.close()
    return found


def main() -> None:
    from guard.verify.generation import GenerationThresholds

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    found = run(args.calls, args.tokens)
    report = {"settings": vars(args) | {"out": str(args.out)}, "machine": bench.machine_info(),
              "ways": found}
    limit = GenerationThresholds().max_abs_z
    head = ["calls", "before: sampled z (min / median / max)", f"before: failed (|z| > {limit:g})",
            "now, no logprobs", "now, top-5 logprobs: passed", "max mean KLD (nats/token)"]
    rows = []
    for way, result in found.items():
        before, now, told = result["before"], result["now"], result["logprobs"]
        rows.append([f"{way} ({args.calls})",
                     f"{before['z_min']:.2f} / {before['z_median']:.2f} / {before['z_max']:.2f}",
                     f"{before['failed']} of {args.calls}",
                     (f"not comparable (constrained): {now['not_comparable']}"
                      if now["not_comparable"] else f"sampled, failed {now['failed']}"),
                     f"{told['passed']} of {args.calls}", f"{told['mean_kld_max']:.4f}"])
    context = [
        f"SmolLM2-135M-Instruct's shipped Q4_1 GGUF on both sides: llama-cpp-python's chat "
        f"completion as the primary (one thread), guard's `llama_cpp` reference. {args.calls} "
        f"calls per way, {args.tokens} tokens at most, llama.cpp's sampler at temperature 0.8, "
        "top_k 40, top_p 0.95, min_p 0.05 (all in the request).",
        bench.machine_line(report["machine"], ("numpy",)),
    ]
    bench.write_one_table(
        args.out, "llm_constrained", report,
        "Constrained decoding against the generation tier (JSON mode on a healthy pair)",
        context, head, rows,
        ["Before: the sampled check on every call, as guard ran it before it read constraints. "
         "Now: a call without logprobs whose decoding was constrained is counted "
         "(`guard_generation_not_comparable_total{reason=\"constrained\"}`), never scored; the "
         "same calls with the primary's top-5 logprobs are compared token by token (the "
         "model's own distribution, before the grammar) and pass.",
         f"Reproduce: `PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_constrained.py "
         f"--calls {args.calls} --tokens {args.tokens}`"])


if __name__ == "__main__":
    main()
