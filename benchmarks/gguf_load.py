"""What a transformers reference costs to load from a GGUF: transformers' own parse, the same
parse within ``gguf_cache.parsed_once`` (the file parsed once, not three times), and guard's
backend on a first start (parse, then write the dequantized folder) and on a later one (the
folder).

Why: a verifier whose reference is a GGUF (``backend: transformers``, ``path: x.gguf``) pays the
parse on its first start after an install or an upgrade of transformers, and every test worker
and replay that finds no cache pays it too. transformers parses the file three times per load.

Each load runs in a fresh interpreter that imports torch and transformers first (not counted);
CPU is the interpreter's own (user + system) over the load alone, wall likewise. Modes
alternate within a round so that the machine's drift falls on all of them alike. Every mode
must load the same weights (a digest of the state dict) and tokenize alike, or the script
fails.

    .venv/bin/python benchmarks/gguf_load.py [--rounds 3] [--out DIR]

Writes gguf_load.{json,md} under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402

# One load in a fresh interpreter; argv[1] is the mode, argv[2] a cache folder of its own.
CHILD = r'''
import hashlib, json, os, sys, time
mode, cache = sys.argv[1], sys.argv[2]
os.environ["GUARD_CACHE_DIR"] = cache
import torch, transformers  # imported before the clock starts
from transformers import AutoModelForCausalLM, AutoTokenizer
from guard.backends import create_backend, gguf_cache
from guard.config.backend import BackendConfig
from guard.zoo import llm
gguf = llm.smollm2_gguf()


def plain():
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 local_files_only=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                              local_files_only=True)
    return model, tokenizer


def parsed_once():
    with gguf_cache.parsed_once():
        return plain()


def backend():
    scorer = create_backend(BackendConfig(backend="transformers", path=str(gguf)), "reference", 1)
    scorer.load()
    return scorer.model, scorer._loaded_tokenizer()


if mode == "later start":  # the folder a first start wrote
    backend()
started, cpu = time.monotonic(), os.times()
model, tokenizer = {"transformers": plain, "parsed_once": parsed_once, "first start": backend,
                    "later start": backend}[mode]()
wall, after = time.monotonic() - started, os.times()
digest = hashlib.sha256()
for name, tensor in sorted(model.state_dict().items()):
    digest.update(name.encode())
    digest.update(tensor.detach().float().numpy().tobytes())
print(json.dumps({"cpu_s": after.user + after.system - cpu.user - cpu.system, "wall_s": wall,
                  "weights": digest.hexdigest(),
                  "ids": tokenizer("The capital of France is")["input_ids"]}))
'''
MODES = {  # mode: what the report calls it
    "transformers": "transformers' own GGUF load (model + tokenizer)",
    "parsed_once": "the same within gguf_cache.parsed_once",
    "first start": "guard's transformers backend, first start (parse + write the folder)",
    "later start": "guard's transformers backend, later start (the folder)",
}


def load_once(mode: str, work: Path) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(cache)], cwd=bench.REPO,
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"{mode}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="gguf-load-") as work:
        for round_ in range(args.rounds):
            for mode in MODES:
                bench.log(f"round {round_ + 1}/{args.rounds}: {mode} ...")
                runs[mode].append(load_once(mode, Path(work)))
    answers = {(run["weights"], tuple(run["ids"])) for rows in runs.values() for run in rows}
    if len(answers) != 1:
        raise SystemExit(f"the modes loaded different models: {answers}")
    base = statistics.median(run["cpu_s"] for run in runs["transformers"])
    rows, summary = [], {}
    for mode, title in MODES.items():
        cpu = statistics.median(run["cpu_s"] for run in runs[mode])
        wall = statistics.median(run["wall_s"] for run in runs[mode])
        summary[mode] = {"cpu_s_median": round(cpu, 2), "wall_s_median": round(wall, 2),
                         "x_transformers": round(cpu / base, 3)}
        rows.append([title, f"{cpu:.2f}", f"{wall:.2f}", f"{cpu / base:.2f}x",
                     " ".join(f"{run['cpu_s']:.2f}" for run in runs[mode])])
    machine = bench.machine_info()
    report = {"machine": machine, "rounds": args.rounds, "summary": summary, "runs": runs}
    head = ["load of SmolLM2-135M's Q4_1 GGUF", "CPU s (median)", "wall s (median)",
            "x transformers' CPU", "CPU s, each round"]
    md = "\n".join([
        "# Loading a transformers reference from a GGUF", "",
        f"`.venv/bin/python benchmarks/gguf_load.py --rounds {args.rounds}`: each load in a "
        "fresh interpreter with torch and transformers imported first (not counted), the modes "
        "alternating within a round; every mode loaded the same weights (state-dict digest) "
        "and tokenized alike.", "",
        bench.md_table(head, rows), "",
        bench.machine_line(machine, ("torch",)), ""])
    bench.write_results(args.out, "gguf_load", report, md, bench.plain_table(head, rows))


if __name__ == "__main__":
    main()
