"""A llama-server started with a model card's sampling flags, its calls leaving sampling to
the server: z of its healthy completions scored with the llama.cpp preset's built-in
defaults (what guard assumed before it asked) and with what the server reported at GET /props
(what the verifier now reads at load).

The primary is llama.cpp's own server (``llama-server``, built from the llama.cpp that
llama-cpp-python vendors; not part of guard's install: pass its path) on SmolLM2's F16 GGUF,
started with ``--temp 0.6 --top-k 20 --min-p 0``; each call is a plain ``/v1/completions``
with a prompt, ``max_tokens`` and a seed (and ``return_tokens``, llama-server's token ids),
read by guard's edge parser; the reference is the ``llama_cpp`` scorer on the same file.

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_llama_server_props.py [LLAMA_SERVER]
       [--completions 12] [--tokens 64]
Writes benchmarks/results/llm_llama_server_props.{json,md} (machine noted).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FLAGS = ("--temp", "0.6", "--top-k", "20", "--min-p", "0")


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        return json.loads(answer.read())


def start_llama_server(binary: str, gguf: Path, flags: tuple[str, ...] = ()):
    """llama-server on ``gguf`` (one thread, a 512-token context) with ``flags``, once it
    answers /props: (the process, its base URL, its /props params)."""
    from guard.backends.openai import llama_server_settings

    port = bench.free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp()) / "llama-server.log"
    with log.open("w") as out:
        server = subprocess.Popen([binary, "-m", str(gguf), "--host", "127.0.0.1", "--port",
                                   str(port), "-c", "512", "-t", "1", *flags],
                                  stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while (params := llama_server_settings(base, None, 2.0)[0]) is None:
        if server.poll() is not None or time.monotonic() > deadline:
            server.terminate()
            raise SystemExit(log.read_text()[-3000:])
        time.sleep(0.3)
    return server, base, params


def completion_sample(base: str, body: dict):
    """``body`` asked of the server at /v1/completions, as guard's edge reads call and
    answer: a GenerationSample."""
    from guard.protocol import openai as api

    answer = _post(base + "/v1/completions", body)
    call = api.parse_request("completions", json.dumps(body).encode())
    completion = api.Completion()
    api.gather(completion, "completions", answer, streamed=False)
    return api.build_sample(call, completion, route="primary")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("llama_server", nargs="?", default=str(bench.LLAMA_SERVER),
                        help="llama.cpp's llama-server binary (default: the one `make test` "
                        "builds, %(default)s)")
    parser.add_argument("--completions", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from guard.backends import create_backend
    from guard.config.backend import BackendConfig
    from guard.verify.generation import (
        SERVER_DEFAULTS,
        GenerationThresholds,
        check_generation,
        declared_defaults,
    )
    from guard.zoo import llm as smol

    f16 = smol.quant_ladder(("F16",))["F16"]
    server, base, params = start_llama_server(args.llama_server, f16, FLAGS)
    reference = create_backend(BackendConfig(backend="llama_cpp", path=str(f16),
                                             options={"context_length": 512}), "reference", 1)
    reference.load()
    found: dict[str, list[float]] = {"preset (built-in defaults)": [], "GET /props": []}
    try:
        ways = {"preset (built-in defaults)": SERVER_DEFAULTS["llama.cpp"],
                "GET /props": declared_defaults({"engine": "llama.cpp"}, reported=params)}
        for seed in range(args.completions):
            sample = completion_sample(base, {
                "model": "smol", "prompt": smol.PROMPTS[seed % len(smol.PROMPTS)],
                "max_tokens": args.tokens, "seed": 300 + seed, "return_tokens": True})
            scores = reference.score(sample)
            for name, defaults in ways.items():
                found[name].append(float(check_generation(sample, scores, defaults).statistic))
            bench.log(f"completion {seed + 1}/{args.completions}")
    finally:
        server.terminate()
        server.wait(30)
        reference.close()
    limit = GenerationThresholds().max_abs_z
    rows = []
    for name, values in found.items():
        z = np.array(values)
        rows.append([name, f"{z.mean():+.2f}", f"{z.min():+.2f} to {z.max():+.2f}",
                     f"{z.sum() / math.sqrt(z.size):+.2f}", str(int(np.sum(np.abs(z) > limit)))])
    head = ["scored with", "mean z", "range", "pooled z (sum / sqrt n)",
            f"beyond ±max_abs_z ({limit:g})"]
    report = {"completions": args.completions, "tokens": args.tokens, "flags": list(FLAGS),
              "z": found, "machine": bench.machine_info()}
    md = "\n".join([
        "# llama-server started with sampling flags: the preset against what it reports", "",
        f"`benchmarks/llm_llama_server_props.py`: llama-server on SmolLM2 F16 started with "
        f"`{' '.join(FLAGS)}`, {args.completions} calls of {args.tokens} tokens that leave "
        "sampling to the server, scored by the llama_cpp reference on the same file. Under "
        "agreement z is about N(0, 1).", "", bench.md_table(head, rows), "",
        bench.machine_line(report["machine"], ("llama-cpp-python",)), ""])
    bench.write_results(args.out, "llm_llama_server_props", report, md,
                        bench.plain_table(head, rows))


if __name__ == "__main__":
    main()
