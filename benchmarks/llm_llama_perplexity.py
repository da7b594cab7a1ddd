"""guard's KLD figures beside llama.cpp's own ``llama-perplexity --kl-divergence``, on the same
tokens.

llama-perplexity is built from the llama.cpp that llama-cpp-python's sdist vendors (the
version guard's llama_cpp backend runs):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
    tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \\
        -DBUILD_SHARED_LIBS=OFF
    cmake --build build --target llama-perplexity -j2

The base is SmolLM2-135M-Instruct's shipped Q4_1 GGUF dequantized to F32 by llama.cpp's
quantizer (the weights of guard's fp32 reference, run by llama.cpp); each rung is a
requantization of the same file (guard/zoo/llm.py). The text is CPython's own LICENSE.txt
(English prose and license text that every Python install carries), cut by llama-perplexity
into chunks of ``--ctx`` tokens; in each chunk it scores the second half from the first.

On exactly those positions this script hands guard what a server returns for a given text
(the rung's top-20 logprobs per token, its distribution teacher-forced by llama.cpp
in-process) and scores it with guard's ``llama_cpp`` reference on the same F32 file:

- llama-perplexity's mean KLD is KL(base || rung); guard's estimate of that direction from
  the top-20 is ``mean_kld_reverse``; guard's own figure (``mean_kld``) is KL(rung || base);
- numpy over both full distributions gives both directions exactly, the tie-breaker;
- same top p, RMS Δp of the text's token and the perplexity ratio beside llama-perplexity's.

llama-perplexity stores the base's log-probabilities as 16-bit integers and skips base tokens
below log p = -16, so its figures are its own approximations of the same quantities.

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_llama_perplexity.py \\
           --llama-perplexity PATH/TO/build/bin/llama-perplexity
Writes benchmarks/results/llm_llama_perplexity.json and .md (machine and load noted).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import subprocess
import sysconfig
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from guard.matrix.columns import sample_from_distributions
from guard.matrix.generation import kld_rows
from guard.protocol.generation import SamplingParams
from guard.verify.generation import GenerationThresholds, check_generation
from guard.zoo.llm import SHIPPED, quant_ladder, requantized, smollm2_gguf

RESULTS = Path(__file__).resolve().parent / "results"
RUNGS = ("Q8_0", SHIPPED, "Q4_K_M", "Q3_K_M", "Q2_K")
TOP_LOGPROBS = 20
# llama-perplexity's final statistics, as it prints them.
PATTERNS = {
    "mean_kld": r"Mean\s+KLD:\s+([-\d.]+)",
    "kld_p99": r"99\.0%\s+KLD:\s+([-\d.]+)",
    "delta_p_rms": r"RMS Δp\s*:\s+([-\d.]+)",
    "same_top": r"Same top p:\s+([-\d.]+)",
    "ppl_ratio": r"Mean PPL\(Q\)/PPL\(base\)\s*:\s+([-\d.]+)",
}


def run(binary: Path, *args: str) -> str:
    done = subprocess.run([str(binary), *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama-perplexity {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def parse(output: str) -> dict:
    figures = {}
    for key, pattern in PATTERNS.items():
        found = re.search(pattern, output)
        if found is None:
            raise RuntimeError(f"llama-perplexity printed no {key}:\n{output[-3000:]}")
        figures[key] = float(found.group(1))
    figures["delta_p_rms"] /= 100  # printed in percent
    figures["same_top"] /= 100
    return figures


def chunks_of(base_file: Path) -> tuple[int, list[list[int]]]:
    """llama-perplexity's tokens from its --kl-divergence-base file: (n_ctx, chunks)."""
    with base_file.open("rb") as handle:
        if handle.read(8) != b"_logits_":
            raise RuntimeError(f"{base_file} is not a llama-perplexity logits file")
        n_ctx, = struct.unpack("<I", handle.read(4))
        _, n_chunk = struct.unpack("<ii", handle.read(8))
        tokens = np.frombuffer(handle.read(4 * n_ctx * n_chunk), dtype=np.int32)
    return n_ctx, [tokens[i * n_ctx:(i + 1) * n_ctx].tolist() for i in range(n_chunk)]


def guard_figures(rung_path: Path, reference, n_ctx: int, chunks: list[list[int]],
                  threads: int) -> dict:
    """guard's figures and numpy's on llama-perplexity's positions of every chunk."""
    from guard.backends import create_backend
    from guard.config.backend import BackendConfig

    primary = create_backend(BackendConfig(backend="llama_cpp", path=str(rung_path),
                                           options={"context_length": n_ctx}), "primary",
                             threads)
    primary.load()
    first = n_ctx // 2
    checks, full, full_reverse, same_top, delta_p, delta_nll = [], [], [], [], [], []
    for tokens in chunks:
        if reference.adds_bos:  # llama-perplexity puts BOS first where the model adds one
            tokens = [reference.bos_id] + tokens[1:]
        prompt, completion = tokens[:first + 1], tokens[first + 1:]
        lp_primary = primary.forward(tokens, len(prompt))
        sample = sample_from_distributions(None, completion, lp_primary, primary.vocab,
                                           TOP_LOGPROBS, primary.decode)
        sample = replace(sample, prompt_token_ids=tuple(prompt),
                         sampling=SamplingParams(temperature=0.0))
        scores = reference.score(sample)
        assert scores.scored and not scores.approximate
        checks.append(check_generation(sample, scores, limits=GenerationThresholds()))
        full.append(kld_rows(lp_primary, scores.logprobs))
        full_reverse.append(kld_rows(scores.logprobs, lp_primary))
        same_top.append(lp_primary.argmax(-1) == scores.logprobs.argmax(-1))
        ids = np.arange(len(completion)), np.asarray(completion)
        delta_p.append(np.exp(lp_primary[ids]) - np.exp(scores.logprobs[ids]))
        delta_nll.append(scores.logprobs[ids].astype(np.float64) - lp_primary[ids])
    primary.close()

    def joined(name):
        return np.concatenate([getattr(c, name) for c in checks])

    guard_reverse = joined("per_token_kld_reverse")
    top1 = sum(c.top1_agreement * c.top1_compared for c in checks) / sum(
        c.top1_compared for c in checks)
    return {
        "tokens": int(sum(c.tokens for c in checks)),
        "guard_mean_kld_reverse": float(guard_reverse.mean()),
        "guard_kld_reverse_p99": float(np.percentile(guard_reverse, 99)),
        "guard_mean_kld": float(joined("per_token_kld").mean()),
        "guard_mean_kld_lower_bound": float(joined("per_token_kld_lower_bound").mean()),
        "guard_same_top": float(top1),
        "guard_delta_p_rms": float(np.sqrt(np.mean(joined("per_token_delta_p") ** 2))),
        "numpy_mean_kld_reverse": float(np.concatenate(full_reverse).mean()),
        "numpy_kld_reverse_p99": float(np.percentile(np.concatenate(full_reverse), 99)),
        "numpy_mean_kld": float(np.concatenate(full).mean()),
        "numpy_same_top": float(np.concatenate(same_top).mean()),
        "numpy_delta_p_rms": float(np.sqrt(np.mean(np.concatenate(delta_p) ** 2))),
        "numpy_ppl_ratio": float(np.exp(np.concatenate(delta_nll).mean())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-perplexity", type=Path, required=True)
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rungs", default=",".join(RUNGS))
    parser.add_argument("--text", type=Path,
                        default=Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from guard.backends import create_backend
    from guard.config.backend import BackendConfig

    started, load_start = time.time(), [round(v, 2) for v in os.getloadavg()]
    rungs = tuple(args.rungs.split(","))
    ladder = quant_ladder(rungs)
    base = requantized(smollm2_gguf(), "F32")
    common = ["-c", str(args.ctx), "-b", str(args.ctx), "-t", str(args.threads),
              "--chunks", str(args.chunks)]
    reference = create_backend(BackendConfig(backend="llama_cpp", path=str(base),
                                             options={"context_length": args.ctx}),
                               "reference", args.threads)
    reference.load()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        base_file = Path(work) / "base.kld"
        run(args.llama_perplexity, "-m", str(base), "-f", str(args.text),
            "--kl-divergence-base", str(base_file), *common)
        n_ctx, chunks = chunks_of(base_file)
        for rung in rungs:
            output = run(args.llama_perplexity, "-m", str(ladder[rung]), "--kl-divergence-base",
                         str(base_file), "--kl-divergence", *common)
            row = {"rung": rung, "llama_perplexity": parse(output),
                   **guard_figures(ladder[rung], reference, n_ctx, chunks, args.threads)}
            row["guard_over_llama_perplexity"] = (row["guard_mean_kld_reverse"]
                                                  / row["llama_perplexity"]["mean_kld"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    reference.close()
    record = {
        "machine": _machine(load_start), "base": f"{base.name} (the shipped Q4_1, dequantized "
        "to F32 by llama.cpp's quantizer)", "text": str(args.text), "ctx": args.ctx,
        "chunks": args.chunks, "top_logprobs": TOP_LOGPROBS, "rows": rows,
        "seconds": round(time.time() - started, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm_llama_perplexity.json").write_text(json.dumps(record, indent=2) + "\n")
    text = "\n".join(_markdown(record)) + "\n"
    (args.out / "llm_llama_perplexity.md").write_text(text)
    print(text)


def _machine(load_start) -> dict:
    import platform

    from guard.machine import cpu_model

    return {"cpu": cpu_model(platform.processor()), "cores": os.cpu_count(),
            "platform": platform.platform(), "loadavg_start": load_start,
            "loadavg": [round(v, 2) for v in os.getloadavg()]}


def _markdown(record: dict) -> list[str]:
    m = record["machine"]
    lines = [
        "# guard's KLD beside llama-perplexity's, on the same tokens", "",
        f"Machine: {m['cpu']}, {m['cores']} cores (load average {m['loadavg_start']} -> "
        f"{m['loadavg']}; accuracy figures do not depend on it). Base: {record['base']}, run "
        f"by llama.cpp in both tools. Text: {record['text']}, {record['chunks']} chunks of "
        f"{record['ctx']} tokens, the second half of each scored (llama-perplexity's "
        f"positions). guard sees the rung's top-{record['top_logprobs']} logprobs per token, "
        "as a server returns them; numpy sees both full distributions.", "",
        "KL(base ‖ rung), llama-perplexity's direction, nats per token:", "",
        "| rung | tokens | llama-perplexity | guard's estimate (top-20) | guard / llama-perplexity "
        "| numpy (full) | p99: llama-perplexity / guard / numpy | same top p: llama-perplexity "
        "/ guard / numpy | RMS Δp: llama-perplexity / guard / numpy | PPL ratio: "
        "llama-perplexity / numpy |", "| --- |" + " --- |" * 9]
    for r in record["rows"]:
        lp = r["llama_perplexity"]
        lines.append(
            f"| {r['rung']} | {r['tokens']} | {lp['mean_kld']:.5f} | "
            f"{r['guard_mean_kld_reverse']:.5f} | {r['guard_over_llama_perplexity']:.3f} | "
            f"{r['numpy_mean_kld_reverse']:.5f} | {lp['kld_p99']:.4f} / "
            f"{r['guard_kld_reverse_p99']:.4f} / {r['numpy_kld_reverse_p99']:.4f} | "
            f"{lp['same_top']:.1%} / {r['guard_same_top']:.1%} / {r['numpy_same_top']:.1%} | "
            f"{lp['delta_p_rms']:.2%} / {r['guard_delta_p_rms']:.2%} / "
            f"{r['numpy_delta_p_rms']:.2%} | {lp['ppl_ratio']:.4f} / "
            f"{r['numpy_ppl_ratio']:.4f} |")
    lines += [
        "", "guard's own direction, KL(rung ‖ base), on the same tokens: guard's figure (the "
        "tier's mean_kld), its lumped bound, numpy:", "",
        "| rung | guard | lumped bound | numpy | guard / numpy |",
        "| --- | --- | --- | --- | --- |"]
    for r in record["rows"]:
        lines.append(f"| {r['rung']} | {r['guard_mean_kld']:.5f} | "
                     f"{r['guard_mean_kld_lower_bound']:.5f} | {r['numpy_mean_kld']:.5f} | "
                     f"{r['guard_mean_kld'] / r['numpy_mean_kld']:.3f} |")
    lines += ["", "Reproduce: see the docstring of benchmarks/llm_llama_perplexity.py "
              f"({record['seconds']} s here)."]
    return lines


if __name__ == "__main__":
    main()
