"""What scoring a sampled completion costs beside generating it, as the model grows.

Issue 29's target is scoring <= 0.25x the primary's CPU to generate a 128-token completion. On
SmolLM2-135M the reference's own teacher-forced pass is most of the cost (llm_ladder.md), and
the docs once said the ratio "should fall" for larger models, whose decode does more work per
token than a batched pass: this measures it. Models of three shapes, all with SmolLM2's
tokenizer and random weights (the cost of a forward pass does not depend on what the weights
learned): SmolLM2-135M's own shape, SmolLM2-360M's, and TinyLlama-1.1B's (hidden 2048, 22
layers). Each is written as an F16 GGUF, the primary is its Q4_1 requantization in llama.cpp
(as the ladder's is), and the references are those of the ladder: the llama_cpp F16 one as
stored and held as F32 (``options.upcast``), and transformers fp32 on the same F16 file, with
its linear layers run by oneDNN (its default, ``options.onednn_linear``) and by torch's own
kernels.

Per completion: the primary generates 128 tokens (temperature 0.8, as llama-cpp-python's
server samples; the token ids ride along, as a server that returns them gives them, so that a
random model's text needs no re-tokenization), then each reference scores it (the
teacher-forced pass) and the tier checks it in sampled mode (no logprobs: the z-score, the
costliest check). CPU seconds of this process from /proc (user + system), one thread, mean
of ``--repeat``; each reference's prompt cache off (every score costs its whole sequence).

Usage: .venv/bin/python benchmarks/llm_scoring_scale.py [--repeat 3] [--shapes 135M,360M,1.1B]
Writes benchmarks/results/llm_scoring_scale.json and .md. The models (about 10 GB with the
references' F32 copies for the 1.1B shape) go to --cache (default a temporary folder kept
between runs: /tmp/guard-scoring-scale).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {  # name: (hidden, layers, ffn, heads, kv heads), each head 64 wide
    "135M": (576, 30, 1536, 9, 3),     # SmolLM2-135M
    "360M": (960, 32, 2560, 15, 5),    # SmolLM2-360M
    "1.1B": (2048, 22, 5632, 32, 4),   # TinyLlama-1.1B
}
RESULTS = Path(__file__).resolve().parent / "results"


def random_llama(template: Path, out: Path, shape: tuple[int, ...], seed: int = 0) -> Path:
    """An F16 llama GGUF of ``shape`` with random weights (N(0, 0.02), norms 1) and
    ``template``'s tokenizer, chat template and rope settings; kept where it already is."""
    if out.is_file():
        return out
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    hidden, layers, ffn, heads, kv_heads = shape
    kv = hidden // heads * kv_heads
    reader = GGUFReader(template)
    overrides = {"llama.embedding_length": hidden, "llama.block_count": layers,
                 "llama.feed_forward_length": ffn, "llama.attention.head_count": heads,
                 "llama.attention.head_count_kv": kv_heads, "general.file_type": 1,  # F16
                 "general.name": f"random llama {hidden}x{layers}", "general.size_label": ""}
    partial = out.with_suffix(".partial")
    writer = GGUFWriter(partial, arch="llama")
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, overrides.get(field.name, field.contents()), kind,
                             sub_type=sub)
    rng = np.random.default_rng(seed)
    vocab = int(reader.fields["llama.vocab_size"].contents())

    def weight(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    for b in range(layers):
        for name, dims in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)),
                           ("attn_v", (kv, hidden)), ("attn_output", (hidden, hidden)),
                           ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                           ("ffn_down", (hidden, ffn))):
            writer.add_tensor(f"blk.{b}.{name}.weight", weight(*dims))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{b}.{name}.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, out)
    return out


def measure(shape_name: str, cache: Path, tokens: int, repeat: int, threads: int) -> dict:
    from guard.backends.gguf_quantize import quantize
    from guard.backends.llama_cpp import open_llama
    from guard.protocol.generation import SamplingParams
    from guard.verify.generation import SERVER_DEFAULTS, check_generation
    from guard.zoo import llm as smol
    from llm_ladder import cost_references, cpu_seconds

    f16 = random_llama(smol.smollm2_gguf(), cache / f"random-{shape_name}.F16.gguf",
                       SHAPES[shape_name])
    q4 = quantize(f16, cache / f"random-{shape_name}.Q4_1.gguf", "Q4_1", threads)
    primary = open_llama(q4, context_length=512, threads=threads, logits_all=False)
    references = cost_references(f16, f16, threads)
    sampling = SamplingParams(temperature=0.8)
    totals = dict.fromkeys(["generate", *references], 0.0)
    produced = used = seed = 0
    while used < repeat:
        # A random model samples a lone byte of a multi-byte character now and then: its text
        # is then not what the references detokenize (a tokenization mismatch, nothing
        # scored). Such a completion is left out and another drawn.
        seed += 1
        if seed > 5 * repeat:
            raise RuntimeError(f"{shape_name}: {seed - 1} completions, {used} scored")
        prompt = smol.PROMPTS[seed % len(smol.PROMPTS)]
        costs = {}
        start = cpu_seconds()
        sample = smol.complete(primary, prompt, tokens, sampling, seed=seed, token_ids=True)
        costs["generate"] = cpu_seconds() - start
        modes = set()
        for name, reference in references.items():
            start = cpu_seconds()
            check = check_generation(sample, reference.score(sample),
                                     SERVER_DEFAULTS["llama.cpp"])
            costs[name] = cpu_seconds() - start
            modes.add(check.mode)
        print(f"{shape_name} seed {seed}: {sorted(modes)} {json.dumps(costs)}",
              file=sys.stderr, flush=True)
        if modes == {"sampled"}:
            used += 1
            produced += len(sample.tokens)
            for name, value in costs.items():
                totals[name] += value
    vocab = int(primary.n_vocab())
    primary.close()
    for reference in references.values():
        reference.close()
    hidden, layers, ffn, heads, kv_heads = SHAPES[shape_name]
    per = {name: value / repeat for name, value in totals.items()}
    return {"shape": shape_name, "hidden": hidden, "layers": layers, "ffn": ffn,
            "heads": heads, "kv_heads": kv_heads, "completions_drawn": seed,
            "parameters": _parameters(SHAPES[shape_name], vocab),
            "tokens_generated_mean": produced / repeat,
            "generate_cpu_s": per["generate"],
            **{f"{name}_cpu_s": per[name] for name in references},
            **{f"{name}_ratio": per[name] / per["generate"] for name in references}}


def _parameters(shape: tuple[int, ...], vocab: int) -> int:
    hidden, layers, ffn, heads, kv_heads = shape
    kv = hidden // heads * kv_heads
    return vocab * hidden + layers * (2 * hidden * hidden + 2 * kv * hidden + 3 * ffn * hidden)


def markdown(record: dict) -> str:
    m = record["machine"]
    lines = [
        "# Scoring cost beside generating, as the model grows", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; load average "
        f"{m['loadavg']} at the end. `benchmarks/llm_scoring_scale.py --repeat "
        f"{record['repeat']}` ({record['seconds']} s). Random-weight llama models with "
        "SmolLM2's tokenizer (a pass costs what the shape says, whatever the weights learned); "
        f"the primary is each one's Q4_1 in llama.cpp generating {record['tokens']} tokens "
        "(temperature 0.8); each reference scores the completion (its teacher-forced pass, "
        "prompt cache off) and the tier checks it in sampled mode. CPU seconds of the process "
        "from /proc, one thread, mean per completion; x: over generating. Target (issue 29): "
        "<= 0.25x.", "",
        "| shape | parameters | generate, CPU s | llama_cpp F16, CPU s (x) | llama_cpp F16 "
        "upcast to F32, CPU s (x) | transformers fp32, CPU s (x) | transformers fp32, "
        "torch's linear kernels, CPU s (x) |",
        "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in record["rows"]:
        cells = [f"{r[f'{n}_cpu_s']:.2f} ({r[f'{n}_ratio']:.2f}x)" if f"{n}_cpu_s" in r
                 else "n/a" for n in ("llama_cpp_f16", "llama_cpp_f16_upcast",
                                      "transformers_fp32", "transformers_fp32_torch_kernels")]
        lines.append(f"| {r['shape']} ({r['hidden']} x {r['layers']} layers) | "
                     f"{r['parameters'] / 1e6:.0f}M | {r['generate_cpu_s']:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--cache", type=Path, default=Path("/tmp/guard-scoring-scale"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    os.environ["GUARD_CACHE_DIR"] = str(args.cache)  # the references' F32 copies
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llm_ladder import machine

    started = time.time()
    rows = [measure(name, args.cache, args.tokens, args.repeat, args.threads)
            for name in args.shapes.split(",")]
    record = {"machine": machine(), "repeat": args.repeat, "tokens": args.tokens,
              "threads": args.threads, "rows": rows,
              "seconds": round(time.time() - started, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm_scoring_scale.json").write_text(json.dumps(record, indent=2) + "\n")
    text = markdown(record)
    (args.out / "llm_scoring_scale.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
