"""What llama.cpp's build flags change in the scoring cost: the Makefile's two builds side by side.

The Makefile builds llama-cpp-python with named flags (LLAMA_CPP_ISA): ``host``, its default,
x86-64-v3 plus the AVX-512 and AVX-VNNI extensions this CPU lists, or ``x86-64-v3`` alone (a
venv that runs on any x86-64 server CPU). Both the Q4_1 primary (generating) and the llama_cpp
references (teacher-forcing) run on that build, so both sides of issue 29's ratio move with it.
This runs ``llm_ladder.py --cost-only`` under each build in turn, ``--rounds`` times
alternating (one machine, one after the other): the venv's own build (``host``, as `make test`
installed it) and the x86-64-v3 build, installed once with ``pip --target`` into
``$GUARD_CACHE_DIR``/``~/.cache/guard`` (about 5 minutes on 2 cores) and put first on
PYTHONPATH.

Usage: .venv/bin/python benchmarks/llm_scoring_isa.py [--rounds 2] [--repeat 5]
Writes benchmarks/results/llm_scoring_cost_isa.json and .md (the machine, each build's
extensions and the load average noted).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

from llm_ladder import COST_REFERENCES  # noqa: E402

from guard.backends.derive import cache_root  # noqa: E402


def make_flags(isa: str) -> str:
    return subprocess.run(["make", "-s", "--no-print-directory", "llama-cpp-flags",
                           f"LLAMA_CPP_ISA={isa}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def makefile_version() -> str:
    for line in (ROOT / "Makefile").read_text().splitlines():
        if line.startswith("LLAMA_CPP_VERSION := "):
            return line.split(":= ")[1].strip()
    raise SystemExit("no LLAMA_CPP_VERSION in the Makefile")


def portable_build() -> Path:
    """A site folder holding llama-cpp-python built with the Makefile's x86-64-v3 flags."""
    version, flags = makefile_version(), make_flags("x86-64-v3")
    key = hashlib.sha256(f"{version} {flags}".encode()).hexdigest()[:12]
    site = cache_root() / f"llama-cpp-python-{key}"
    if not (site / "llama_cpp").is_dir():
        print(f"building llama-cpp-python {version} for x86-64-v3 into {site} (about 5 min)",
              file=sys.stderr, flush=True)
        site.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=site.parent, prefix=site.name + "."))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir",
                        "--no-deps", "--target", str(partial), f"llama-cpp-python=={version}"],
                       env={**os.environ, "CMAKE_ARGS": flags}, check=True)
        partial.rename(site)
    return site


def cost_run(extra_path: Path | None, repeat: int) -> dict:
    """llm_ladder.py --cost-only in a fresh interpreter, ``extra_path`` first on its path."""
    with tempfile.TemporaryDirectory() as out:
        shutil.copy(RESULTS / "llm_ladder.json", out)  # --cost-only keeps that file's ladder
        path = [str(extra_path)] if extra_path else []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path + [str(ROOT)])}
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "llm_ladder.py"),
                        "--cost-only", "--repeat", str(repeat), "--out", out], env=env,
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads((Path(out) / "llm_ladder.json").read_text())["cost"]


def markdown(record: dict) -> list[str]:
    runs, m = record["runs"], record["runs"][0]["cost"]["machine"]
    lines = ["# The scoring cost under the Makefile's two llama.cpp builds", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}. "
             f"`llm_ladder.py --cost-only --repeat {record['repeat']}` under each build in "
             f"turn, {record['rounds']} rounds alternating; CPU seconds of one process from "
             "/proc, one thread, a 128-token sampled completion of the shipped Q4_1 primary "
             "generated and scored, each row's load average at its end. Target (issue 29): "
             "scoring <= 0.25x generating.", ""]
    for run in runs:
        lines.append(f"- {run['build']}: llama.cpp built for "
                     f"{run['cost']['machine'].get('llama_cpp_build', '?')} "
                     f"(load average {run['cost']['machine']['loadavg']})")
    keys = [key for _, key in COST_REFERENCES if key in runs[0]["cost"]]  # as measured then
    header = "| build | generate, CPU s | " + " | ".join(
        f"{key}: pass s, x generating (sampled / logprobs)" for key in keys)
    lines += ["", header + " |", "|" + " --- |" * (2 + len(keys))]
    for run in runs:
        cost = run["cost"]
        cells = [run["build"], f"{cost['generate_cpu_s']:.3f}"]
        for key in keys:
            sampled, logprobs = cost[key]["sampled"], cost[key]["logprobs"]
            cells.append(f"{sampled['score_cpu_s']:.3f}, {sampled['ratio']:.3f} / "
                         f"{logprobs['ratio']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Reproduce: `.venv/bin/python benchmarks/llm_scoring_isa.py`; `make "
              "llama-cpp-flags [LLAMA_CPP_ISA=x86-64-v3]` prints each build's flags."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    builds = {"host (the venv's)": None, "x86-64-v3": portable_build()}
    runs = []
    for round_ in range(args.rounds):
        for name, site in builds.items():
            print(f"round {round_ + 1}: {name}", file=sys.stderr, flush=True)
            runs.append({"round": round_ + 1, "build": name,
                         "flags": make_flags("host" if site is None else "x86-64-v3"),
                         "cost": cost_run(site, args.repeat)})
    record = {"rounds": args.rounds, "repeat": args.repeat, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm_scoring_cost_isa.json").write_text(json.dumps(record, indent=2) + "\n")
    text = "\n".join(markdown(record)) + "\n"
    (args.out / "llm_scoring_cost_isa.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
