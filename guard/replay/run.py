"""``guard replay``: captured traffic (or .npz input sets, or a generative model's JSONL prompt
sets) through the same checks, offline.

Pipeline: ``Source`` (read, filter) -> ``plan_batches`` (group) -> engine (reference + primary as
configured now, ``Comparator.check`` per record) -> ``ModelAggregate`` (in record order) ->
``write_report``. Exit codes: 0 every model passes, 1 a model drifts, 2 usage or input error
(also, with ``--strict``: damaged bytes skipped, records of models the config lacks, records
that do not fit the model). The report is written in every case where replay ran.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from guard import __version__
from guard.plan.complete import load_config
from guard.errors import GuardError
from guard.replay.aggregate import ModelAggregate
from guard.replay.items import INPUT_ERROR, RecordOutcome
from guard.replay.plan import DEFAULT_BATCH_ROWS, plan_batches
from guard.replay.progress import Progress
from guard.replay.report import write_report
from guard.replay.source import Filters, Source

EXIT_PASS, EXIT_DRIFT, EXIT_USAGE = 0, 1, 2
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


@dataclass
class ReplayOptions:
    config: str
    captures: list[str]
    report_dir: str = "replay-report"
    engine: str = "local"  # local | ray
    ray_address: str | None = None
    workers: int | None = None  # Ray actors (default: the cluster's CPUs)
    max_records: int | None = None
    models: list[str] = field(default_factory=list)
    since: str | None = None
    until: str | None = None
    strict: bool = False
    batch_rows: int = DEFAULT_BATCH_ROWS
    progress: bool = True


def parse_time(text: str, flag: str, now: datetime | None = None) -> int:
    """ISO 8601 (a zone-less time is UTC) or a duration back from now (``90s``, ``30m``, ``2h``,
    ``7d``) -> Unix nanoseconds."""
    now = now or datetime.now(timezone.utc)
    match = _DURATION.match(text.strip())
    if match:
        moment = now - timedelta(**{_UNITS[match.group(2)]: float(match.group(1))})
    else:
        try:
            moment = datetime.fromisoformat(text.strip())
        except ValueError:
            raise GuardError(f"{flag}: cannot read '{text}': give an ISO 8601 time "
                             "(2025-06-01T12:00:00Z) or a duration back from now (30m, 2h, 7d)"
                             ) from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1e9)


def _engine(options: ReplayOptions, config, config_text: str):
    if options.engine == "ray":
        from guard.replay.engines import RayEngine

        return RayEngine(config_text, config.context.base_dir, options.ray_address,
                         options.workers)
    from guard.replay.engines import LocalEngine

    return LocalEngine(config)


def replay(options: ReplayOptions) -> tuple[int, dict]:
    """Run a replay; returns (exit code, report). Raises ``GuardError`` on usage errors that stop
    it before anything ran (bad config, unknown --models, unreadable or mismatched .npz)."""
    config = load_config(options.config)
    config_text = Path(options.config).read_text()
    names = [m.name for m in config.models]
    for name in options.models:
        if name not in names:
            raise GuardError(f"--models: '{name}' is not a model of the config "
                             f"(it has: {', '.join(names)})")
    if options.max_records is not None and options.max_records < 1:
        raise GuardError("--max-records: must be >= 1")
    if options.batch_rows < 1:
        raise GuardError("--batch-size: must be >= 1")
    filters = Filters(
        models=frozenset(options.models) if options.models else None,
        since_nanos=parse_time(options.since, "--since") if options.since else None,
        until_nanos=parse_time(options.until, "--until") if options.until else None,
        max_records=options.max_records,
    )
    npz_model: str | None
    if options.models and len(options.models) == 1:
        npz_model = options.models[0]
    else:
        npz_model = names[0] if len(names) == 1 else None

    started = time.monotonic()
    engine = _engine(options, config, config_text)
    try:
        generative = frozenset(m.name for m in config.models if m.task == "generation")
        source = Source(options.captures, set(names), filters, engine.input_specs, npz_model,
                        generative)
        progress = Progress(max_records=options.max_records, enabled=options.progress)
        outcomes: list[RecordOutcome] = []
        for batch_outcomes in engine.run(plan_batches(source.items(), options.batch_rows)):
            outcomes += batch_outcomes
            progress.update(len(batch_outcomes), max(o.progress for o in batch_outcomes))
        progress.finish()
        models_seen = sorted({o.model for o in outcomes}, key=names.index)
        backends = {name: engine.describe(name) for name in models_seen}
        workers = engine.workers
    finally:
        engine.close()
    seconds = time.monotonic() - started

    aggregates = {name: ModelAggregate(config.model(name), backends[name])
                  for name in models_seen}
    for outcome in sorted(outcomes, key=lambda o: o.index):
        aggregates[outcome.model].add(outcome)
    stats = source.stats

    problems: list[str] = []
    strict_problems: list[str] = []
    if not outcomes:
        problems.append("no record was replayed (empty input, or everything filtered out)")
    if stats.skipped_bytes or stats.unreadable_records:
        # Which ones, where a file says (a prompt set's line numbers, a record's error).
        which = "; ".join(f"{Path(f['path']).name}: {problem}" for f in stats.files
                          if not f.get("vanished") for problem in f.get("problems", ()))
        strict_problems.append(
            f"{stats.skipped_bytes} damaged byte(s) skipped in {stats.skipped_regions} "
            f"region(s), {stats.unreadable_records} unreadable record(s)"
            + (f" ({which})" if which else ""))
    if stats.vanished_files:
        strict_problems.append(
            f"{len(stats.vanished_files)} capture file(s) deleted before they were read (a live "
            "guard's retention; replay a copy of the folder to read it whole): "
            + ", ".join(Path(path).name for path in stats.vanished_files))
    if stats.unknown_models:
        strict_problems.append("records of models the config lacks: " + ", ".join(
            f"{k} ({v})" for k, v in sorted(stats.unknown_models.items())))
    input_errors = sum(1 for o in outcomes if o.status == INPUT_ERROR)
    if input_errors:
        strict_problems.append(f"{input_errors} record(s) do not fit their model's inputs "
                               "as configured now")
    models = {name: agg.result() for name, agg in aggregates.items()}
    drift = any(m["verdict"] == "drift" for m in models.values())
    if problems or (options.strict and strict_problems):
        code = EXIT_USAGE
    else:
        code = EXIT_DRIFT if drift else EXIT_PASS
    verdict = {EXIT_PASS: "pass", EXIT_DRIFT: "drift", EXIT_USAGE: "error"}[code]
    suffix = " (fatal: --strict)" if options.strict else " (not fatal without --strict)"
    report = {
        "guard_version": __version__,
        "verdict": verdict,
        "exit_code": code,
        "problems": problems + [p + suffix for p in strict_problems],
        "config": {"path": str(Path(options.config).resolve()), "hash": config.context.source_hash},
        "filters": {"models": sorted(options.models) or None, "since": options.since,
                    "until": options.until, "max_records": options.max_records,
                    "strict": options.strict, "batch_rows": options.batch_rows},
        "inputs": stats.as_dict(),
        "unknown_models": dict(sorted(stats.unknown_models.items())),
        "models": models,
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "engine": {"name": engine.name, "workers": workers},
        "timing": {"seconds": seconds, "records": len(outcomes),
                   "records_per_second": len(outcomes) / seconds if seconds > 0 else 0.0},
    }
    return code, report


def _figures_line(m: dict) -> str:
    """A model's headline figures: tier 1's, or a generative model's (mean KLD, same top-1)."""
    g = m["tiers"].get("generation")
    if g is not None and "mean_kld" in g:
        kld = "-" if g["mean_kld"] is None else f"{g['mean_kld']:.3g}"
        top1 = "-" if g["top1_agreement"] is None else f"{g['top1_agreement']:.1%}"
        pooled = "" if g.get("z_pooled") is None else \
            f", pooled z {g['z_pooled']:.3g} over {g['z_completions']} sampled"
        return (f"generation {g['passed']}/{g['checks']} pass, mean KLD {kld} nats, "
                f"same top-1 {top1}{pooled}")
    t = m["tiers"]["tensor"]
    return f"tensor {t['passed']}/{t['checks']} pass, max abs error {t['max_abs_error']:.3g}"


def replay_command(options: ReplayOptions, out=None) -> int:
    out = out or sys.stdout
    code, report = replay(options)
    paths = write_report(report, options.report_dir)
    for name, m in report["models"].items():
        print(f"{name}: {m['verdict']} ({m['samples']} samples; {_figures_line(m)}): "
              f"{m['verdict_reason']}", file=out)
    for problem in report["problems"]:
        print(f"problem: {problem}", file=out)
    print(f"report: {paths['json']} {paths['md']} {paths['html']}", file=out)
    print(f"verdict: {report['verdict']} (exit {code})", file=out)
    return code
