"""A llama-server's captured calls replayed offline: scored with what the server reported at
GET /props when they were compared live (kept in each capture record now), against the llama.cpp
preset a replay used before (records carried nothing of the server's).

``guard serve`` (this checkout, a subprocess) stands in front of llama-server on SmolLM2's F16
GGUF started with ``--temp 0.6 --top-k 20 --min-p 0`` (``engine: llama.cpp``, the llama_cpp
reference on the same file, every call sampled and captured); 12 plain completions leave
sampling to the server. Then the capture is read back as ``guard replay`` reads it (its Source)
and each call scored by the replay's own check (the model's Comparator): once as recorded (the
server's report in the record), once with the report taken out (a record as guard wrote it
before). Under agreement z is about N(0, 1); the live verifier's z (in each record's verdict)
is the yardstick. ``guard replay`` itself is run on the capture too (its pass count).

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_llama_server_replay.py [LLAMA_SERVER]
       [--completions 12] [--tokens 48]
Writes benchmarks/results/llm_llama_server_replay.{json,md} (machine noted).
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
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from llm_llama_server_props import FLAGS, _post, start_llama_server  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent


def _checks(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('guard_checks_total{model="smol"'))


def serve_and_capture(base: str, gguf: Path, work: Path, completions: int, tokens: int,
                      prompts) -> tuple[Path, Path]:
    """``guard serve`` in front of the server at ``base``, every call sampled and captured:
    (its config, the capture folder) once ``completions`` calls were compared."""
    http_port, metrics_port = bench.free_port(), bench.free_port()
    capture = work / "capture"
    model = {"name": "smol", "task": "generation",
             "primary": {"backend": "openai", "target": base, "model": "smol",
                         "options": {"engine": "llama.cpp"}},
             "reference": {"backend": "llama_cpp", "path": str(gguf),
                           "options": {"context_length": 512}},
             "mirror": {"sample_rate": 1.0, "timeout_s": 300}, "policy": {"action": "alert"},
             "capture": {"dir": str(capture), "mode": "all"}}
    config = work / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "server": {
        "host": "127.0.0.1", "grpc_port": 0, "admin_port": 0, "metrics_port": metrics_port,
        "http_port": http_port, "reload_interval_s": 0}, "models": [model]}))
    log = work / "guard.log"
    guard = subprocess.Popen([sys.executable, "-m", "guard", "serve", "--config", str(config)],
                             stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=work)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health/ready",
                                            timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if guard.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(log.read_text()[-3000:])
            time.sleep(0.3)
        for seed in range(completions):
            _post(f"http://127.0.0.1:{http_port}/v1/completions", {
                "model": "smol", "prompt": prompts[seed % len(prompts)],
                "max_tokens": tokens, "seed": 500 + seed})
        deadline = time.monotonic() + 600
        while _checks(metrics_port) < completions:
            if time.monotonic() > deadline:
                raise SystemExit("the verifier did not compare every call: "
                                 + log.read_text()[-2000:])
            time.sleep(0.5)
    finally:
        guard.terminate()  # (capture is flushed at shutdown)
        guard.wait(60)
    return config, capture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("llama_server", nargs="?", default=str(bench.LLAMA_SERVER),
                        help="llama.cpp's llama-server binary (default: the one `make test` "
                        "builds, %(default)s)")
    parser.add_argument("--completions", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from guard.backends import create_backend
    from guard.capture.reader import FileStats, expand_paths, read_records
    from guard.plan.serving import load_config
    from guard.replay.source import Filters, Source
    from guard.verify.generation import GenerationCheck, GenerationThresholds
    from guard.verify.pipeline import Comparator
    from guard.zoo import llm as smol

    f16 = smol.quant_ladder(("F16",))["F16"]
    work = Path(tempfile.mkdtemp(prefix="guard-llama-replay-"))
    server, base, _ = start_llama_server(args.llama_server, f16, FLAGS)
    try:
        config_path, capture = serve_and_capture(base, f16, work, args.completions,
                                                 args.tokens, smol.PROMPTS)
    finally:
        server.terminate()
        server.wait(30)
    bench.log("captured; replaying")
    report_dir = work / "report"
    replayed = subprocess.run([sys.executable, "-m", "guard", "replay", "--config",
                               str(config_path), "--report-dir", str(report_dir), "--quiet",
                               str(capture)], capture_output=True, text=True, cwd=ROOT)
    generation = json.loads((report_dir / "report.json").read_text())["models"]["smol"][
        "tiers"]["generation"] if (report_dir / "report.json").exists() else {}

    config = load_config(config_path).models[0]
    items = list(Source([str(capture)], {"smol"}, Filters(), lambda m: (), None,
                        frozenset({"smol"})).items())
    reference = create_backend(config.reference, "reference", 1)
    reference.load()
    comparator = Comparator.for_model(config)
    found: dict[str, list[float]] = {"live (the verifier, GET /props at load)": [],
                                     "replay, the record's report (now)": [],
                                     "replay, no report (records before)": []}
    try:
        stats = FileStats()
        for record in (r for path in expand_paths([capture]) for r in read_records(path, stats)):
            verdict = json.loads(record.verdicts[0].details_json)
            found["live (the verifier, GET /props at load)"].append(
                float(GenerationCheck.from_dict(verdict).statistic))
        for item in items:
            call = item.generation
            scores = reference.score(call)
            now = comparator.check(scores, call).tiers["generation"]
            before = comparator.check(scores, replace(call, server_settings=None)) \
                .tiers["generation"]
            found["replay, the record's report (now)"].append(float(now.statistic))
            found["replay, no report (records before)"].append(float(before.statistic))
    finally:
        reference.close()
    limit = GenerationThresholds().max_abs_z
    rows = []
    for name, values in found.items():
        if not values:
            rows.append([name, "-", "-", "-", "-"])
            continue
        z = np.array(values)
        rows.append([name, f"{z.mean():+.2f}", f"{z.min():+.2f} to {z.max():+.2f}",
                     f"{z.sum() / math.sqrt(z.size):+.2f}", str(int(np.sum(np.abs(z) > limit)))])
    head = ["scored", "mean z", "range", "pooled z (sum / sqrt n)",
            f"beyond ±max_abs_z ({limit:g})"]
    settings = items[0].generation.server_settings if items else None
    cli = (f"`guard replay` of the capture: exit {replayed.returncode}, "
           f"{generation.get('passed')} of {generation.get('checks')} passed"
           if generation else f"`guard replay` failed: {replayed.stderr[-500:]}")
    report = {"completions": args.completions, "tokens": args.tokens, "flags": list(FLAGS),
              "records": len(items), "server_settings": settings, "z": found,
              "guard_replay": {"exit": replayed.returncode, "checks": generation.get("checks"),
                               "passed": generation.get("passed")},
              "machine": bench.machine_info()}
    md = "\n".join([
        "# A llama-server's captured calls replayed: the server's report kept in the record",
        "", f"`benchmarks/llm_llama_server_replay.py`: llama-server on SmolLM2 F16 started with "
        f"`{' '.join(FLAGS)}`, `guard serve` in front (engine llama.cpp, every call sampled "
        f"and captured), {args.completions} calls of {args.tokens} tokens that leave sampling "
        f"to the server; {len(items)} records read back as `guard replay` reads them and "
        "scored by the replay's check with the llama_cpp reference on the same file. Under "
        "agreement z is about N(0, 1).", "", bench.md_table(head, rows), "",
        f"{cli}. What a record keeps of the server's report: `{json.dumps(settings)}`.", "",
        bench.machine_line(report["machine"], ("llama-cpp-python",)), ""])
    bench.write_results(args.out, "llm_llama_server_replay", report, md,
                        bench.plain_table(head, rows))


if __name__ == "__main__":
    main()
