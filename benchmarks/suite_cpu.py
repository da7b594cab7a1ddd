"""Where the test suite's CPU goes, by process: the pytest workers themselves (the tests and the
in-process guards they start), the verifier processes, ``guard`` commands, conversions in child
processes, and what no Python process accounts for (vLLM's venv, Envoy, Prometheus, Triton).

Why: issue 27 asks for the suite in under 6 minutes of tests on 2 cores. Durations (``pytest
--durations``) say which tests are long in wall time, but on 2 busy cores a test's wall time is
mostly its neighbour's CPU; what bounds the suite is its total CPU (at best wall = CPU / cores).
This splits that total by the process that spent it, so that a lever (a verifier started from a
pre-imported zygote, a fixture that imports no torch) can be priced before it is built.

How: the suite runs once (``python -m pytest`` with this repository's settings, extra arguments
passed on), with a ``sitecustomize`` on PYTHONPATH that appends one JSON line per Python process
at its exit (``atexit``, and ``os._exit``, which guard's verifier and serving processes end
with): its argv, its own CPU (user + system, from ``os.times``), its wall time, whether it had
imported torch / TensorFlow / ONNX Runtime. Processes that clear PYTHONPATH (vLLM's server) or are
not Python (Envoy, Prometheus, Triton), and any killed by a signal, write nothing: their CPU is
the total less the records (the total is this process's children's, from ``getrusage``, which
counts every descendant that was waited for). To name that rest, a thread reads /proc every
``--poll`` seconds (default 0.5) and keeps each new process's last CPU reading; the processes no
record names are summed by program (the ``-m`` module of a Python one): a process's last
``--poll`` seconds before its exit are missed, so these figures are lower bounds, close for the
long-lived servers they are for. A grandchild left to init when its parent died
is counted nowhere: vLLM's model worker, as vLLM starts by default, was (126 s of vLLM's CPU in
tests/e2e/test_vllm.py by /proc, 112 s for the whole file by getrusage); the lean start the
tests use now keeps it in a process that is waited for (benchmarks/vllm_test_server.py).

    .venv/bin/python benchmarks/suite_cpu.py [--out DIR] [-- PYTEST ARGS]

Writes suite_cpu.json/.md under --out (default benchmarks/results). Takes the suite's time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402

VERIFIER = "guard.verifier_process.process"  # what every verifier imports before its models
TORCH_VERIFIER = f"torch, {VERIFIER}"  # and one whose models are torch's
FILES_SHOWN = 25  # test files in the report's table (all are in the JSON)
TESTS_SHOWN = 30  # tests in the report's table (all are in the JSON)
UNRECORDED_SHOWN = 15  # programs in the table of what no record names

# One JSON line per process at its exit; GUARD_SUITE_CPU_LOG names the file. Nothing here may
# raise into the process it is loaded in.
SITECUSTOMIZE = '''
import atexit, json, os, sys, time
_start = time.time()
_logged = []


def _guard_suite_cpu_record():
    if _logged:
        return
    _logged.append(1)
    try:
        times = os.times()
        modules = sys.modules
        record = {"pid": os.getpid(), "argv": sys.argv[:4], "exe": sys.executable,
                  "cpu_s": round(times.user + times.system, 3),
                  "wall_s": round(time.time() - _start, 2),
                  "torch": "torch" in modules, "tensorflow": "tensorflow" in modules,
                  "onnxruntime": "onnxruntime" in modules,
                  "test": os.environ.get("PYTEST_CURRENT_TEST", "")}
        with open(os.environ["GUARD_SUITE_CPU_LOG"], "a") as log:
            log.write(json.dumps(record) + "\\n")
    except Exception:
        pass


atexit.register(_guard_suite_cpu_record)
_exit = os._exit


def _exit_recorded(code):
    _guard_suite_cpu_record()
    _exit(code)


os._exit = _exit_recorded
'''

# A pytest plugin (-p) that charges each test file with what its tests cost the worker that ran
# them: the worker's own CPU (the test, the in-process guards it started) and its waited-for
# children's (servers, verifiers, conversions: everything started and stopped under that file,
# module fixtures included, since their teardown runs inside the file's last test).
PLUGIN = '''
import json, os, time

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, started = os.times(), time.monotonic()
    yield
    after = os.times()
    record = {"file": item.nodeid.split("::")[0], "test": item.nodeid,
              "own_cpu_s": (after.user + after.system) - (before.user + before.system),
              "children_cpu_s": (after.children_user + after.children_system)
              - (before.children_user + before.children_system),
              "wall_s": time.monotonic() - started, "end": time.time(),
              "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
    with open(os.environ["GUARD_SUITE_CPU_TESTS"], "a") as log:
        log.write(json.dumps(record) + "\\n")
'''


class ProcPoller:
    """The last CPU reading (user + system, /proc/PID/stat) of every process started after it,
    by (pid, start time): a killed server's CPU, or one that records nothing, is read here."""

    def __init__(self, interval: float):
        self.interval = interval
        self.seen: dict[tuple[int, int], dict] = {}
        self._since = _boot_ticks_now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="proc-poller", daemon=True)

    def __enter__(self) -> "ProcPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
                # comm is in parentheses and may hold spaces: the fields follow the last ")"
                fields = stat[stat.rindex(")") + 2:].split()
                started = int(fields[19])
                if started < self._since:
                    continue
                key = (int(entry.name), started)
                seen = self.seen.get(key)
                if seen is None:
                    argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
                    comm = stat[stat.index("(") + 1:stat.rindex(")")]
                    seen = self.seen[key] = {"pid": key[0], "name": program_name(
                        [a.decode(errors="replace") for a in argv if a], comm)}
                seen["cpu_s"] = (int(fields[11]) + int(fields[12])) / bench.CLK_TCK
            except (OSError, ValueError, IndexError):
                continue  # gone between the listing and the read, or a kernel thread

    def unrecorded(self, records: list[dict]) -> list[dict]:
        """CPU by program of the processes seen here that no record names, costliest first."""
        recorded = {r["pid"] for r in records}
        rows: dict[str, dict] = collections.defaultdict(lambda: {"processes": 0, "cpu_s": 0.0})
        for process in self.seen.values():
            if process["pid"] in recorded or process["pid"] == os.getpid():
                continue
            row = rows[process["name"]]
            row["processes"] += 1
            row["cpu_s"] += process["cpu_s"]
        return sorted(({"program": name, "processes": row["processes"],
                        "cpu_s": round(row["cpu_s"], 1)} for name, row in rows.items()),
                      key=lambda row: -row["cpu_s"])


def _boot_ticks_now() -> int:
    """Now, in the clock ticks since boot that /proc/PID/stat's start time counts."""
    return int(float(Path("/proc/uptime").read_text().split()[0]) * bench.CLK_TCK)


def program_name(argv: list[str], comm: str = "") -> str:
    """A process's program as the report names it: the executable's name, a Python process's
    ``-m`` module (vLLM's ``vllm.entrypoints.openai.api_server``) or script, or for ``python
    -c`` the name the process gave itself (``comm``: vLLM's engine core, started so by
    multiprocessing, calls itself ``VLLM::EngineCore``)."""
    if not argv:
        return comm or "?"
    name = Path(argv[0]).name
    if name.startswith("python"):
        if "-m" in argv[1:-1]:
            return argv[argv.index("-m") + 1]
        if "-c" in argv[1:]:
            return f"python -c ({comm})" if comm and not comm.startswith("python") \
                else "python -c"
        scripts = [a for a in argv[1:] if not a.startswith("-")]
        return Path(scripts[0]).name if scripts else name
    return name


def median(values: list[float]) -> float | None:
    """The middle value (the upper one of an even count), None for none."""
    return sorted(values)[len(values) // 2] if values else None


def read_jsonl(path: Path) -> list[dict]:
    """The records a log holds (none where nothing wrote one)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def kind(record: dict) -> str:
    """The row a process is counted in."""
    argv = record["argv"] or [""]
    program = Path(argv[0]).name
    if "verifier_process" in " ".join(argv):
        return "verifier processes"
    if (argv[0] == "-c" and not record["test"]) or "pytest" in argv[0]:
        return "pytest workers (tests, in-process guards)"
    if program == "__main__.py" and "guard" in argv[0] and len(argv) > 1:
        return f"`guard {argv[1]}`"
    if program == "worker.py":
        return "extra serving processes"
    if argv[0] == "-c":
        return "`python -c` children of tests"
    return program or "?"


def summarize(records: list[dict], total_cpu_s: float) -> list[dict]:
    rows: dict[str, dict] = collections.defaultdict(
        lambda: {"processes": 0, "cpu_s": 0.0, "with_torch": 0, "cpu": []})
    for record in records:
        row = rows[kind(record)]
        row["processes"] += 1
        row["cpu_s"] += record["cpu_s"]
        row["with_torch"] += record["torch"]
        row["cpu"].append(record["cpu_s"])
    accounted = sum(r["cpu_s"] for r in rows.values())
    table = []
    for name, row in sorted(rows.items(), key=lambda item: -item[1]["cpu_s"]):
        cpu = row.pop("cpu")
        table.append({"kind": name, **row, "cpu_s": round(row["cpu_s"], 1),
                      "median_cpu_s": median(cpu),
                      "share": round(row["cpu_s"] / total_cpu_s, 3)})
    rest = total_cpu_s - accounted
    table.append({"kind": "not recorded (vLLM, Envoy, Prometheus, Triton, killed processes)",
                  "processes": None, "cpu_s": round(rest, 1), "with_torch": None,
                  "median_cpu_s": None, "share": round(rest / total_cpu_s, 3)})
    return table


def verifier_detail(records: list[dict]) -> dict:
    verifiers = [r for r in records if kind(r) == "verifier processes"]
    torch = [r["cpu_s"] for r in verifiers if r["torch"]]
    other = [r["cpu_s"] for r in verifiers if not r["torch"]]
    return {"with_torch": len(torch), "median_cpu_s_with_torch": median(torch),
            "without_torch": len(other), "median_cpu_s_without_torch": median(other)}


def import_cpu_s(modules: str) -> float:
    """CPU seconds of a fresh interpreter that imports ``modules`` (comma-separated) and exits,
    less an empty one's; the least of three."""
    def run(code: str) -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", code], check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)

    return round(min(run(f"import {modules}") for _ in range(3))
                 - min(run("pass") for _ in range(3)), 2)


def zygote_bound_s(records: list[dict], imports: dict[str, float]) -> float:
    """What verifiers started from a process that had imported their modules already would have
    saved: each verifier's imports (torch's too where it had torch), at most its own CPU."""
    saved = 0.0
    for record in records:
        if kind(record) == "verifier processes":
            cost = imports[TORCH_VERIFIER if record["torch"] else VERIFIER]
            saved += min(cost, record["cpu_s"])
    return saved


def by_file(tests: list[dict]) -> list[dict]:
    """Each test file's CPU (its worker's own and its waited-for children's) and wall time,
    costliest first."""
    files: dict[str, dict] = collections.defaultdict(
        lambda: {"tests": 0, "own_cpu_s": 0.0, "children_cpu_s": 0.0, "wall_s": 0.0})
    for test in tests:
        row = files[test["file"]]
        row["tests"] += 1
        for key in ("own_cpu_s", "children_cpu_s", "wall_s"):
            row[key] += test[key]
    rows = [{"file": name, "tests": row["tests"], "own_cpu_s": round(row["own_cpu_s"], 1),
             "children_cpu_s": round(row["children_cpu_s"], 1),
             "cpu_s": round(row["own_cpu_s"] + row["children_cpu_s"], 1),
             "wall_s": round(row["wall_s"], 1)} for name, row in files.items()]
    return sorted(rows, key=lambda row: -row["cpu_s"])


def by_test(tests: list[dict]) -> list[dict]:
    """Each test's CPU (its setup's too: a module fixture is charged to the file's first test),
    costliest first."""
    rows = [{"test": test["test"], "own_cpu_s": round(test["own_cpu_s"], 2),
             "children_cpu_s": round(test["children_cpu_s"], 2),
             "cpu_s": round(test["own_cpu_s"] + test["children_cpu_s"], 2),
             "wall_s": round(test["wall_s"], 2)} for test in tests]
    return sorted(rows, key=lambda row: -row["cpu_s"])


def worker_spans(tests: list[dict]) -> list[dict]:
    """Per xdist worker: when its first test began and its last ended (seconds from the first
    test's start anywhere), its tests' wall time, and the file it ran last: a worker that ends
    long before the others is the tail a longest-first order should shorten."""
    workers: dict[str, dict] = {}
    for test in tests:
        if "end" not in test:
            continue
        begin = test["end"] - test["wall_s"]
        w = workers.setdefault(test["worker"], {"begin": begin, "end": test["end"], "busy_s": 0.0,
                                                "last_file": test["file"]})
        w["begin"], w["busy_s"] = min(w["begin"], begin), w["busy_s"] + test["wall_s"]
        if test["end"] >= w["end"]:
            w["end"], w["last_file"] = test["end"], test["file"]
    if not workers:
        return []
    zero = min(w["begin"] for w in workers.values())
    return [{"worker": name or "main", "first_s": round(w["begin"] - zero, 1),
             "last_s": round(w["end"] - zero, 1), "busy_s": round(w["busy_s"], 1),
             "last_file": w["last_file"]} for name, w in sorted(workers.items())]


def blank(value) -> str:
    """A table cell: the value, or nothing where there is none."""
    return "" if value is None else str(value)


def markdown(report: dict) -> str:
    lines = [
        "# Where the test suite's CPU goes",
        "",
        f"`python -m pytest {' '.join(report['pytest_args'])}`: exit {report['pytest_exit']}, "
        f"{report['wall_s']:.0f} s wall, {report['total_cpu_s']:.0f} s CPU (user + system of every "
        f"descendant): {report['total_cpu_s'] / report['wall_s']:.2f} cores busy on average of "
        f"{report['machine']['cpus_usable']}. At best the suite takes CPU / cores: "
        f"{report['total_cpu_s'] / report['machine']['cpus_usable'] / 60:.1f} min here; 6 min on "
        f"2 cores needs at most 720 s of CPU.",
        "",
        bench.md_table(["processes", "count", "CPU s", "share", "median CPU s", "with torch"],
                       [[row["kind"], blank(row["processes"]), row["cpu_s"], f"{row['share']:.0%}",
                         blank(row["median_cpu_s"]), blank(row["with_torch"])]
                        for row in report["by_kind"]]),
    ]
    v = report["verifiers"]
    lines += [
        "",
        f"Verifier processes: {v['with_torch']} imported torch (median "
        f"{v['median_cpu_s_with_torch']} s CPU each), {v['without_torch']} did not (median "
        f"{v['median_cpu_s_without_torch']} s). A fresh interpreter's imports cost "
        f"{report['import_cpu_s'][TORCH_VERIFIER]} s of CPU here for a verifier of torch models, "
        f"{report['import_cpu_s'][VERIFIER]} s for one without: what a verifier started "
        f"from a pre-imported zygote would save per start, at most "
        f"{report['zygote_bound_s']:.0f} s of the suite's CPU "
        f"({report['zygote_bound_s'] / report['total_cpu_s']:.0%}).",
    ]
    files = report["by_file"]
    if files:
        top = files[:FILES_SHOWN]
        top_cpu, files_cpu = sum(f["cpu_s"] for f in top), sum(f["cpu_s"] for f in files)
        lines += [
            "",
            f"The {len(top)} costliest of {len(files)} test files ({top_cpu:.0f} of "
            f"{files_cpu:.0f} s charged to files; a file's children are "
            "the processes its tests and module fixtures started and waited for):",
            "",
            bench.md_table(["file", "tests", "CPU s", "in the worker", "in children", "wall s"],
                           [[f["file"], f["tests"], f["cpu_s"], f["own_cpu_s"],
                             f["children_cpu_s"], f["wall_s"]] for f in top]),
        ]
    costliest = (report.get("by_test") or [])[:TESTS_SHOWN]
    if costliest:
        lines += ["", f"The {len(costliest)} costliest tests (a test's setup included: a module "
                  "fixture is charged to the first test that asks for it):", "",
                  bench.md_table(["test", "CPU s", "in the worker", "in children", "wall s"],
                                 [[t["test"], t["cpu_s"], t["own_cpu_s"], t["children_cpu_s"],
                                   t["wall_s"]] for t in costliest])]
    spans = report.get("workers") or []
    if spans:
        lines += ["", "Workers (seconds from the first test's start; busy: its tests' wall time):",
                  "", bench.md_table(["worker", "first test", "last test ended", "busy s",
                                      "last file"],
                                     [[w["worker"], w["first_s"], w["last_s"], w["busy_s"],
                                       w["last_file"]] for w in spans])]
    rest = report.get("unrecorded") or []
    if rest:
        lines += ["", f"What no record names, by program (read from /proc every "
                  f"{report['poll_s']} s: lower bounds; {UNRECORDED_SHOWN} shown):", "",
                  bench.md_table(["program", "processes", "CPU s"],
                                 [[r["program"], r["processes"], r["cpu_s"]]
                                  for r in rest[:UNRECORDED_SHOWN]])]
    lines += ["", bench.machine_line(report["machine"], ("torch",))]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--poll", type=float, default=0.5,
                        help="seconds between the /proc readings of unrecorded processes")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as folder:
        (Path(folder) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        (Path(folder) / "guard_suite_cpu_plugin.py").write_text(PLUGIN)
        log_path, tests_path = Path(folder) / "processes.jsonl", Path(folder) / "tests.jsonl"
        env = dict(os.environ, GUARD_SUITE_CPU_LOG=str(log_path),
                   GUARD_SUITE_CPU_TESTS=str(tests_path),
                   PYTHONPATH=os.pathsep.join(filter(None, (folder,
                                                            os.environ.get("PYTHONPATH")))))
        bench.log(f"running the suite: pytest {' '.join(args.pytest_args)}")
        started = time.monotonic()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        with ProcPoller(args.poll) as poller:
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p",
                                   "guard_suite_cpu_plugin", *args.pytest_args],
                                  cwd=bench.REPO, env=env, check=False)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = time.monotonic() - started
        records, tests = read_jsonl(log_path), read_jsonl(tests_path)
    total = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    imports = {m: import_cpu_s(m) for m in (VERIFIER, TORCH_VERIFIER)}
    verifiers = verifier_detail(records)
    zygote = zygote_bound_s(records, imports)
    report = {"pytest_args": args.pytest_args, "pytest_exit": done.returncode,
              "wall_s": round(wall, 1), "total_cpu_s": round(total, 1),
              "by_kind": summarize(records, total), "verifiers": verifiers,
              "import_cpu_s": imports, "zygote_bound_s": round(zygote, 1),
              "by_file": by_file(tests), "by_test": by_test(tests),
              "workers": worker_spans(tests),
              "poll_s": args.poll, "unrecorded": poller.unrecorded(records),
              "machine": bench.machine_info(), "processes": records}
    md = markdown(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "suite_cpu.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "suite_cpu.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
