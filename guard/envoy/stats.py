"""guard's request metrics in Envoy mode, from Envoy's stats: read at scrape time from the admin
API (``/stats?format=prometheus``, only guard's clusters) and given guard's names and labels,
so that dashboards and alerts built on the Python data plane keep working:

- ``guard_requests_total{model, route}``: the cluster's ModelInfer calls with gRPC status OK (the
  Python data plane counts answered requests the same way); a generation model's cluster
  (HTTP): its answers with a 2xx status;
- ``guard_request_errors_total{model, code}``: the cluster's ModelInfer calls by any other gRPC
  status, named as gRPC names them (an Envoy local reply, e.g. an upstream that refuses
  connections, carries a gRPC status too: UNAVAILABLE; a call the client cancelled ends with
  none and is not counted, as in the Python data plane); a
  generation model's: its answers by any other HTTP status, named as the Python HTTP edge names
  them (its gRPC name, google.rpc.Code's mapping);
- ``guard_generation_not_comparable_total{model, reason="endpoint"}``: a generation model's
  calls to the endpoints guard forwards unchecked (embeddings, /tokenize ...), from the
  stats of the route that forwards them (its requests sent upstream; the Python edge counts
  them as it admits them, a call refused for want of an upstream included);
- ``guard_request_duration_seconds{model, route}``: the cluster's ``upstream_rq_time``, whose
  buckets the bootstrap sets to guard's (milliseconds there, seconds here). It is the time
  Envoy waited for the upstream, every status included; the Python data plane's histogram
  counts answered requests only, from request received to answer ready.

The gRPC calls are counted by the access log of guard's bootstrap (``guard_calls.grpc`` tagged
``cluster``, ``code`` and ``route``, the answering endpoint's: a fallback's cluster answers from
the primary standing in while the fallback is down, guard/envoy/bootstrap.py) or, in
istio-proxy, by the grpc_stats filter (``cluster.<c>.grpc.ModelInfer.<code>``); both are read.
The duration histogram is the cluster's: a call the primary answered standing in is timed
under ``route="fallback"``.

Envoy merges its histograms from the worker threads at each stats flush (the bootstrap sets
``stats_flush_interval`` to 1 s), so the duration histogram lags the counters by up to that.
Each Envoy counts from 0 (one started again after a death, a hot restart's new one):
``StatsReader`` sums them, the gone ones with what they had counted when last read.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from urllib.parse import quote

import grpc
from prometheus_client.parser import text_string_to_metric_families

from guard.envoy.process import admin_get
from guard.observe.metrics import UNKNOWN_MODEL
from guard.protocol.openai import status_code_name

_STATUS = {code.value[0]: code.name for code in grpc.StatusCode}
_GRPC_CODE = re.compile(r"^envoy_cluster_grpc_ModelInfer_(\d+)(_total)?$")  # the parser adds _total
_CALLS = re.compile(r"^envoy_guard_calls_grpc(_total)?$")  # the access log's, tags as labels
UNCHECKED_STAT = "guard_other_"  # the stat prefix of the routes of calls guard never checks
# The HTTP listener's calls, counted at their end (guard/envoy/openai_listener.py
# ``_call_counter``: tags ``cluster``, ``code``, ``flags``).
HTTP_SCOPE = "guard_http"
_HTTP_CALLS = re.compile(rf"^envoy_{HTTP_SCOPE}_calls(_total)?$")
# Envoy's response flags (the short names) that say a 2xx call's answer did not end as its
# upstream meant it to, in the order they decide, with the code the Python edge counts such a
# call under: a timeout (the route's, its idle one, the stream's duration) DEADLINE_EXCEEDED;
# the upstream's connection or stream ended (upstream connection termination, remote reset,
# protocol error) UNAVAILABLE. A client that left (``DC``) decides nothing: the openai package
# closes its connection as soon as it has read ``[DONE]``, which can be before Envoy has the
# upstream's end of the body, and that call was answered whole (the Python edge's rule too).
# Which of those a client that left mid-stream was, Envoy's flags cannot say: it counts as
# answered here, where the Python edge counts it CANCELLED.
_CUT_SHORT = (("UT", "DEADLINE_EXCEEDED"), ("SI", "DEADLINE_EXCEEDED"),
              ("DT", "DEADLINE_EXCEEDED"), ("UMSDR", "DEADLINE_EXCEEDED"),
              ("UC", "UNAVAILABLE"), ("UR", "UNAVAILABLE"), ("UPE", "UNAVAILABLE"))


def http_outcome(status: int, flags: str) -> str | None:
    """How the Python edge counts an HTTP call that ended with ``status`` and Envoy's response
    ``flags`` (``-`` for none, else comma-separated short names): None for answered, else its
    code. A 2xx call cut short after its headers is the flags' code, not answered."""
    if not 200 <= status < 300:
        return status_code_name(status)
    raised = set(flags.split(","))
    if "DC" in raised:
        return None
    return next((code for flag, code in _CUT_SHORT if flag in raised), None)


_FILTER = (r"^(cluster\.guard_[^.]*_(primary|fallback)(_sampled)?\.|guard_calls\.|"
           rf"{HTTP_SCOPE}\.|vhost\.[^.]*\.route\.{UNCHECKED_STAT})")
# A generation model's calls to the endpoints guard forwards unchecked: its route's requests
# sent upstream (vhost.<listener>.route.<prefix>.upstream_rq_total, the route tagged).
_ROUTE_REQUESTS = "envoy_vhost_route_upstream_rq_total"


def _labels(pairs: dict[str, str]) -> str:
    def quote(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{quote(v)}"' for k, v in pairs.items()) + "}"


Figures = dict[tuple, float]  # ("requests", model, route), ("errors", model, code),
# ("bucket", model, route, le_seconds), ("sum", model, route), ("count", model, route)


def _answered_by(where: tuple[str, str] | None,
                 tags: Mapping[str, str]) -> tuple[str, str] | None:
    """(model, route) of a counted call: its cluster's, but the route of the endpoint that
    answered where the counter says one (tag ``route``: a fallback's cluster answers from the
    primary standing in while the fallback is down, bootstrap.serving_cluster)."""
    route = tags.get("route", "")
    if where is not None and route in ("primary", "fallback"):
        return where[0], route
    return where


def collect(text: str, clusters: dict[str, tuple[str, str]],
            unchecked: Mapping[str, str] | None = None) -> Figures:
    """Envoy's exposition of guard's clusters as guard's figures; ``clusters``: cluster name ->
    (model, route), from the bootstrap's layout; ``unchecked``: the stat prefix of each
    generation model's route for the calls guard forwards unchecked -> the model. A route's two
    clusters (the sampled twin and the other) add up. gRPC calls are counted by the call
    counter's status (``guard_calls``), HTTP calls by ``http_outcome`` (``guard_http``); both
    at the call's end."""
    unchecked = unchecked or {}
    figures: Figures = {}

    def add(key: tuple, value: float) -> None:
        figures[key] = figures.get(key, 0.0) + value

    def add_call(model: str, route: str, status: int, value: float) -> None:
        add(("requests", model, route) if status == 0 else
            ("errors", model, _STATUS.get(status, str(status))), value)

    def add_http_call(tags: Mapping[str, str], value: float) -> None:
        if not tags.get("code", "").isdigit():
            return
        cluster, status, flags = tags.get("cluster", ""), int(tags["code"]), tags.get("flags", "-")
        where = _answered_by(clusters.get(cluster), tags)
        if where is not None:
            outcome = http_outcome(status, flags)
            add(("requests", *where) if outcome is None else ("errors", where[0], outcome),
                value)
        elif cluster in ("", "-") and status >= 400 and "NR" not in flags.split(","):
            # Envoy's own refusal (a path no route takes, NR, is not a call of a model's)
            add(("errors", UNKNOWN_MODEL, status_code_name(status)), value)

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if _CALLS.match(name):
                where = _answered_by(clusters.get(sample.labels.get("cluster", "")),
                                     sample.labels)
                number = sample.labels.get("code", "")
                if where is not None and number.isdigit():  # "": cancelled by its client
                    add_call(*where, int(number), sample.value)
                continue
            if _HTTP_CALLS.match(name):
                add_http_call(sample.labels, sample.value)
                continue
            if name == _ROUTE_REQUESTS:  # (the by-code counter parses to this name too)
                model = unchecked.get(sample.labels.get("envoy_route", ""))
                if model is not None and "envoy_response_code" not in sample.labels:
                    add(("endpoint", model), sample.value)
                continue
            cluster = sample.labels.get("envoy_cluster_name", "")
            where = clusters.get(cluster)
            if where is None:
                continue
            model, route = where
            code = _GRPC_CODE.match(name)
            if code is not None:
                add_call(model, route, int(code.group(1)), sample.value)
            elif name == "envoy_cluster_upstream_rq_time_bucket":
                bound = float(sample.labels["le"])
                add(("bucket", model, route, bound / 1000.0 if bound != float("inf") else bound),
                    sample.value)
            elif name == "envoy_cluster_upstream_rq_time_sum":
                add(("sum", model, route), sample.value / 1000.0)
            elif name == "envoy_cluster_upstream_rq_time_count":
                add(("count", model, route), sample.value)
    return figures


def render(figures: Figures) -> str:
    """guard's figures in the text format."""
    lines = ["# TYPE guard_requests_total counter"]
    lines += [f"guard_requests_total{_labels({'model': k[1], 'route': k[2]})} {v}"
              for k, v in sorted(figures.items()) if k[0] == "requests"]
    lines.append("# TYPE guard_request_errors_total counter")
    lines += [f"guard_request_errors_total{_labels({'model': k[1], 'code': k[2]})} {v}"
              for k, v in sorted(figures.items()) if k[0] == "errors"]
    unchecked = [f"guard_generation_not_comparable_total"
                 f"{_labels({'model': k[1], 'reason': 'endpoint'})} {v}"
                 for k, v in sorted(figures.items()) if k[0] == "endpoint"]
    if unchecked:  # (generation models only)
        lines += ["# TYPE guard_generation_not_comparable_total counter", *unchecked]
    lines.append("# TYPE guard_request_duration_seconds histogram")
    routes = sorted({k[1:3] for k in figures if k[0] == "bucket"})
    for model, route in routes:
        labels = {"model": model, "route": route}
        bounds = sorted((k[3], v) for k, v in figures.items()
                        if k[0] == "bucket" and k[1:3] == (model, route))
        for bound, value in bounds:
            le = "+Inf" if bound == float("inf") else repr(round(bound, 9))
            lines.append(f"guard_request_duration_seconds_bucket{_labels({**labels, 'le': le})}"
                         f" {value}")
        for part in ("count", "sum"):
            lines.append(f"guard_request_duration_seconds_{part}{_labels(labels)} "
                         f"{figures.get((part, model, route), 0.0)}")
    return "\n".join(lines) + "\n"


def translate(text: str, clusters: dict[str, tuple[str, str]],
              unchecked: Mapping[str, str] | None = None) -> str:
    """Envoy's exposition of guard's clusters as guard's metrics (the text format)."""
    return render(collect(text, clusters, unchecked))


class StatsReader:
    """guard's request metrics from the Envoys of the moment, read at each scrape, summed over
    every Envoy process guard has run: each counts only the calls it forwarded itself. An
    Envoy that is gone (it died and was started again, or a hot restart retired it) is carried
    over with what it had counted when last read (``note``), so guard's counters never go
    backwards. A hot restart's new Envoy starts with ``--skip-hot-restart-parent-stats``:
    Envoy's own copy of the old one's counters into the new one lasts only the restart (the
    new one drops those it did not count itself once the old one exits), and a hot restart
    reset ``guard_requests_total`` to 0. The plane reads the old one just before a hot
    restart (the new one shuts its admin API down at once): the calls it forwards in the
    second the new one takes to start, and while it drains, are not counted."""

    def __init__(self):
        self._carried: Figures = {}
        self._texts: dict[int, str] = {}  # a live Envoy's pid -> its stats when last read
        self._lock = threading.Lock()

    def note(self, pid: int, admin_port: int) -> bool:
        """Read Envoy ``pid``'s stats now; False where it does not answer."""
        try:
            text = admin_get(admin_port,
                             f"/stats?format=prometheus&usedonly&filter={quote(_FILTER)}")
        except OSError:
            return False
        with self._lock:
            self._texts[pid] = text
        return True

    def exposition(self, envoys: Mapping[int, int], clusters: dict[str, tuple[str, str]],
                   unchecked: Mapping[str, str] | None = None) -> str:
        """``envoys``: the live Envoys, pid -> admin port (the current one and those a hot
        restart retired that still drain); "" while none answers. ``clusters``,
        ``unchecked``: ``collect``'s."""
        answered = [pid for pid, port in envoys.items() if port and self.note(pid, port)]
        with self._lock:
            for pid in [pid for pid in self._texts if pid not in envoys]:  # gone: carried
                _add_into(self._carried, collect(self._texts.pop(pid), clusters, unchecked))
            if not answered:
                return ""
            total = dict(self._carried)
            for text in self._texts.values():
                _add_into(total, collect(text, clusters, unchecked))
        return render(total)


def _add_into(total: Figures, figures: Figures) -> None:
    for key, value in figures.items():
        total[key] = total.get(key, 0.0) + value
