"""The machinery the benchmarks here share: the machine and the guard measured, servers as child
processes, free ports and the log line, latency figures, CPU accounting from /proc (a server's CPU
per request, and the CPU other processes used meanwhile: a shared machine's noise), the flags and
work folder of a closed-loop run, and the reports' tables and files.

Nothing here knows a model or a protocol: the seeded classifier served over the Open Inference
Protocol, and the closed-loop load on it, are oip_load.py's. A script imports this module with
its own folder on ``sys.path`` (``sys.path.insert(0, str(Path(__file__).resolve().parent))``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from guard.machine import cpu_model

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
HOST = "127.0.0.1"
NOISY_NEIGHBOUR_CORES = 0.15  # other processes' CPU during a cell above which we warn
# llama.cpp's own server as `make test` builds it (the Makefile's LLAMA_SERVER)
LLAMA_SERVER = REPO / ".venv" / "bin" / "llama-server"


# -- small helpers ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def percentile_ms(latencies_ns: np.ndarray, q: float) -> float:
    return float(np.percentile(latencies_ns, q)) / 1e6 if latencies_ns.size else float("nan")


def summarize(latencies_ns: np.ndarray, elapsed_s: float, errors: int) -> dict:
    return {
        "requests": int(latencies_ns.size),
        "errors": int(errors),
        "elapsed_s": round(elapsed_s, 3),
        "throughput_rps": latencies_ns.size / elapsed_s if elapsed_s > 0 else float("nan"),
        "mean_ms": float(latencies_ns.mean()) / 1e6 if latencies_ns.size else float("nan"),
        "p50_ms": percentile_ms(latencies_ns, 50),
        "p90_ms": percentile_ms(latencies_ns, 90),
        "p99_ms": percentile_ms(latencies_ns, 99),
        "p999_ms": percentile_ms(latencies_ns, 99.9),
        "max_ms": float(latencies_ns.max()) / 1e6 if latencies_ns.size else float("nan"),
    }


# -- the machine and the guard measured ------------------------------------------------------------
def machine_info() -> dict:
    cpu = cpu_model()
    versions = {"python": platform.python_version()}
    for name in ("onnxruntime", "torch", "grpcio", "numpy", "tritonclient", "protobuf",
                 "llama-cpp-python"):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:
            versions[name] = "n/a"
    try:
        from guard import __version__ as guard_version
    except Exception:
        guard_version = "n/a"
    versions["guard"] = guard_version
    return {
        "guard_source": guard_source(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "versions": versions,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def guard_source() -> dict:
    """Which guard was measured: the commit, and guard/ files changed since (if any)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.rstrip("\n")

    try:
        return {"commit": git("rev-parse", "--short", "HEAD"),
                "uncommitted_guard_files": git("status", "--porcelain", "--", "guard").splitlines()}
    except (OSError, subprocess.SubprocessError):
        return {}


def machine_line(machine: dict, packages: tuple[str, ...]) -> str:
    """The report's 'Machine:' line, naming the versions of ``packages`` (then grpcio, guard)."""
    m, v = machine, machine["versions"]
    source = m.get("guard_source", {})
    names = "".join(f", {name} {v.get(name, '?')}" for name in (*packages, "grpcio"))
    return (
        f"Machine: {m['cpu_model']}, {m['cpu_count']} cores ({m['cpus_usable']} usable); "
        f"Python {v['python']}{names}, guard {v['guard']} (commit {source.get('commit', '?')}"
        f"{', with uncommitted changes in guard/' if source.get('uncommitted_guard_files') else ''}"
        f"); {m['platform']}; {m['date']}")


# -- servers as child processes --------------------------------------------------------------------
class Child:
    def __init__(self, cell: str, argv: list[str], logfile: Path, env: dict, cwd: Path = REPO):
        self.cell = cell
        self.logfile = logfile
        self._log = logfile.open("w")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env, cwd=str(cwd), start_new_session=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.logfile.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()
        return self.process.returncode


def clean_up(children: list, workdir: Path, keep_workdir: bool) -> None:
    """Kill what still runs of ``children`` and remove the work folder (unless kept)."""
    for child in children:
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait(timeout=10)
    if keep_workdir:
        log(f"work folder kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


# -- CPU accounting --------------------------------------------------------------------------------
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (guard serve's verifier process)."""
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


def proc_ticks(pid) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, all threads


def group_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) of the live process ``pid`` and of every live
    process in the process group it leads: a server started in a session of its own with the
    engine processes it started (vLLM), or one process (llama-server)."""
    ticks = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[2]) == pid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(server_pid: int) -> dict | None:
    """Machine-wide busy/total/steal ticks, and the CPU ticks of the server (the serving
    process), of its children (guard's verifier process; none for the baseline) and of this
    process."""

    try:
        values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        idle = values[3] + values[4]
        verifier = 0
        for pid in child_pids(server_pid):
            try:
                verifier += proc_ticks(pid)
            except OSError:
                pass
        return {"busy": sum(values) - idle - values[7], "total": sum(values),
                "steal": values[7], "server": proc_ticks(server_pid), "verifier": verifier,
                "self": proc_ticks("self"), "wall": time.monotonic()}
    except (OSError, ValueError, IndexError):
        return None


def cpu_usage(before: dict | None, after: dict | None, requests: int,
              servers: tuple[str, ...] = ("server", "verifier")) -> dict:
    """Cores used on average over the cell: by each server, the load generator, and anything
    else on the machine (other processes: a noisy neighbour makes the figures unreliable).
    ``servers`` names the snapshot keys holding server ticks: ``cpu_snapshot``'s one "server"
    here; upstream_hop.py snapshots one key per process group (MLServer, guard)."""
    if not before or not after:
        return {}
    seconds = lambda key: (after[key] - before[key]) / CLK_TCK  # noqa: E731
    used = {name: seconds(name) for name in servers}
    client = seconds("self")
    return cpu_summary({"wall_s": after["wall"] - before["wall"],
                        **{f"{name}_s": s for name, s in used.items()}, "client_s": client,
                        "other_s": max(0.0, seconds("busy") - sum(used.values()) - client),
                        "steal_s": seconds("steal"), "requests": requests})


NOT_SERVERS = ("wall", "client", "other", "steal")  # the ``*_s`` keys of cpu_usage that are not


def cpu_summary(raw: dict) -> dict:
    """``raw`` (CPU seconds per ``<name>_s``, "requests") plus cores per name and CPU ms per
    request for each server (every ``<name>_s`` but wall, client, other, steal)."""
    wall = raw["wall_s"] or float("nan")
    servers = [k[:-2] for k in raw if k.endswith("_s") and k[:-2] not in NOT_SERVERS]
    out = dict(raw)
    for name in (*servers, "client", "other", "steal"):
        out[f"{name}_cores"] = raw[f"{name}_s"] / wall
    for name in servers:
        out[f"{name}_cpu_ms_per_request"] = (raw[f"{name}_s"] * 1e3 / raw["requests"]
                                             if raw["requests"] else float("nan"))
    return out


def merge_cpu(parts: list[dict]) -> dict:
    """The CPU figures of several rounds of one cell: seconds and requests summed."""
    parts = [p["cpu"] for p in parts if p.get("cpu")]
    if not parts:
        return {}
    keys = [k for k in parts[0] if k.endswith("_s")] + ["requests"]
    return cpu_summary({k: sum(p.get(k, 0.0) for p in parts) for k in keys})


def other_load(pids: list[int], seconds: float = 1.0) -> float:
    """Cores used over ``seconds`` by processes other than this one and ``pids``."""
    before = [cpu_snapshot(pid) for pid in pids] or [cpu_snapshot(os.getpid())]
    time.sleep(seconds)
    after = [cpu_snapshot(pid) for pid in pids] or [cpu_snapshot(os.getpid())]
    if None in before or None in after:
        return 0.0
    ours = sum(a["server"] - b["server"] for a, b in zip(after, before)) + (
        after[0]["self"] - before[0]["self"])
    wall = after[0]["wall"] - before[0]["wall"]
    return max(0.0, (after[0]["busy"] - before[0]["busy"] - ours) / CLK_TCK / wall)


def wait_quiet(pids: list[int], max_wait: float) -> None:
    """On a shared machine, wait (at most ``max_wait`` s) until other processes are quiet."""
    if max_wait <= 0:
        return
    deadline = time.monotonic() + max_wait
    load = other_load(pids)
    if load <= NOISY_NEIGHBOUR_CORES:
        return
    log(f"  other processes use {load:.2f} cores; waiting up to {max_wait:.0f}s for quiet ...")
    while time.monotonic() < deadline:
        load = other_load(pids, 2.0)
        if load <= NOISY_NEIGHBOUR_CORES:
            log(f"  quiet now ({load:.2f} cores)")
            return
    log(f"  still {load:.2f} cores of other load: measuring anyway (flagged in the report)")


# -- the run ---------------------------------------------------------------------------------------
def add_run_arguments(parser: argparse.ArgumentParser, name: str, rounds_what: str) -> None:
    """The flags every closed-loop benchmark here shares."""
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds measured per cell (default 10; 2 with --quick)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds of warm-up load before each cell (default 2; 0.5 --quick)")
    parser.add_argument("--concurrency", default="1,8",
                        help="comma-separated concurrent clients (default 1,8)")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"{rounds_what}; latencies are pooled over rounds "
                        "(default 2; 1 with --quick)")
    parser.add_argument("--out", default=str(HERE / "results"),
                        help=f"folder for {name}.json/.md (default benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--wait-quiet", type=float, default=20.0, metavar="S",
                        help="before each cell, wait up to S seconds while other processes use "
                        f"more than {NOISY_NEIGHBOUR_CORES} cores (shared machines); 0 = off "
                        "(default 20)")
    parser.add_argument("--retries", type=int, default=1,
                        help="measure a cell again when other processes used the CPU during it; "
                        "the least disturbed attempt is kept (default 1)")
    parser.add_argument("--keep-workdir", action="store_true",
                        help="keep the temp folder (models, configs, server logs)")


def run_plan(args: argparse.Namespace, prefix: str):
    """The run's settings from ``add_run_arguments``' flags (defaults filled in, ``args.rounds``
    too) and a fresh work folder that is also guard's cache (``GUARD_CACHE_DIR``, here and in
    the children's ``env``). Returns (concurrencies, duration, warmup, out_dir, workdir, env)."""
    concurrencies = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    if not concurrencies or min(concurrencies) < 1:
        raise SystemExit("--concurrency: a comma-separated list of integers >= 1")
    duration = args.duration if args.duration is not None else (2.0 if args.quick else 10.0)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 2.0)
    out_dir = Path(args.out).resolve()
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    env = dict(os.environ, GUARD_CACHE_DIR=str(workdir), PYTHONUNBUFFERED="1")
    os.environ["GUARD_CACHE_DIR"] = str(workdir)
    log(f"work folder {workdir}; {duration:g}s per cell after {warmup:g}s warm-up; "
        f"concurrency {concurrencies}; {args.rounds} round(s)")
    return concurrencies, duration, warmup, out_dir, workdir, env


def parse_and_run(parser: argparse.ArgumentParser, argv: list[str], run_fn) -> int:
    """Parse (``--rounds`` >= 1), make SIGTERM run ``run_fn``'s cleanup, run."""
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be >= 1")

    def terminated(signum, frame):  # SIGTERM too runs run()'s finally: no server left behind
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    return run_fn(args)


def write_results(out_dir: Path, name: str, report: dict, md: str, text: str) -> None:
    """``<name>.json`` and ``<name>.md`` under ``out_dir``; the text tables to stdout."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(md)
    print()
    print(text)
    log(f"wrote {out_dir / f'{name}.json'} and {out_dir / f'{name}.md'}")


# -- reports ---------------------------------------------------------------------------------------
def other_cores(report: dict, cell: str, c: str) -> float:
    """Cores other processes used during ``cell`` at concurrency ``c`` (0 when unknown)."""
    return report["cells"][cell]["by_concurrency"][c].get("cpu", {}).get("other_cores", 0.0)


def mark_disturbed(report: dict, target: dict, c: str, cells) -> None:
    """Mark ``target`` 'disturbed' when other processes used the CPU during a cell it compares:
    then its PASS or MISS says more about the neighbours than about guard."""
    target["disturbed"] = any(other_cores(report, x, c) > NOISY_NEIGHBOUR_CORES for x in cells)


def ok_word(target: dict) -> str:
    word = "PASS" if target["ok"] else "MISS"
    return f"{word} (disturbed)" if target.get("disturbed") else word


def plain_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def md_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


def run_line(settings: dict) -> str:
    s = settings
    return (f"Run: {s['duration_s']:g} s per cell after {s['warmup_s']:g} s warm-up, "
            f"{s['rounds']} round(s), concurrency {s['concurrency']}"
            + (" (--quick: smoke check, not figures to quote)" if s["quick"] else ""))


def noisy_warning(report: dict, steadier: str) -> list[str]:
    """The WARNING line (or none) when other processes used the CPU during some cell."""
    other = max((f.get("cpu", {}).get("other_cores", 0.0) for cell in report["cells"].values()
                 for f in cell["by_concurrency"].values()), default=0.0)
    if other <= NOISY_NEIGHBOUR_CORES:
        return []
    return [f"WARNING: other processes used up to {other:.2f} cores during a cell (see "
            "'other load'): the machine was shared; latency figures and targets marked "
            f"'disturbed' are unreliable ({steadier} is the steadier figure)"]


def render_text(context: list[str], tables: list[tuple[str, list[str], list[list[str]]]]) -> str:
    """Context lines, then each (title, head, rows) table; the first table goes untitled."""
    parts = ["\n".join(context), "", plain_table(*tables[0][1:])]
    for title, head, rows in tables[1:]:
        parts += ["", title, plain_table(head, rows)]
    return "\n".join(parts)


def render_markdown(title: str, script: str, context: list[str], cells: dict[str, str],
                    tables: list[tuple[str, list[str], list[list[str]]]]) -> str:
    """The .md report: title, context bullets, the cells, then a section per (heading, head,
    rows) table."""
    cell_lines = "\n".join(f"- ({k}) {v}" for k, v in cells.items())
    context_lines = "\n".join(f"- {line.strip()}" for line in context)
    sections = "\n\n".join(f"## {heading}\n\n{md_table(head, rows)}"
                           for heading, head, rows in tables)
    return (
        f"# {title}\n\n"
        f"Generated by `benchmarks/{script}`; closed-loop load over loopback, latency "
        "measured at the client.\n\n"
        f"{context_lines}\n\nCells:\n\n{cell_lines}\n\n"
        f"{sections}\n"
    )


def write_one_table(out_dir: Path, name: str, report: dict, title: str, context: list[str],
                    head: list[str], rows: list[list[str]], notes: list[str]) -> None:
    """A report of one table: ``<name>.md`` (title, context paragraphs, the table, notes) and
    ``<name>.json`` under ``out_dir``, the plain table to stdout."""
    md = "\n\n".join([f"# {title}", *context, md_table(head, rows), *notes]) + "\n"
    write_results(out_dir, name, report, md, "\n".join(context) + "\n\n" + plain_table(head, rows))

