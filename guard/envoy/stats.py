"""guard's request metrics in Envoy mode, from Envoy's stats: read at scrape time from the admin
API (``/stats?format=prometheus``, only guard's clusters) and given guard's names and labels,
so that dashboards and alerts built on the Python data plane keep working:

- ``guard_requests_total{model, route}``: the cluster's gRPC calls with status OK (the Python
  data plane counts answered requests the same way);
- ``guard_request_errors_total{model, code}``: the cluster's calls by any other gRPC status,
  named as gRPC names them (an Envoy local reply, e.g. an upstream that refuses connections,
  carries a gRPC status too: UNAVAILABLE);
- ``guard_request_duration_seconds{model, route}``: the cluster's ``upstream_rq_time``, whose
  buckets the bootstrap sets to guard's (milliseconds there, seconds here). It is the time
  Envoy waited for the upstream, every status included; the Python data plane's histogram
  counts answered requests only, from request received to answer ready.

Envoy merges its histograms from the worker threads at each stats flush (the bootstrap sets
``stats_flush_interval`` to 1 s), so the duration histogram lags the counters by up to that.
"""

from __future__ import annotations

import re
from urllib.parse import quote

import grpc
from prometheus_client.parser import text_string_to_metric_families

from guard.envoy.process import admin_get

_STATUS = {code.value[0]: code.name for code in grpc.StatusCode}
_GRPC_CODE = re.compile(r"^envoy_cluster_grpc_ModelInfer_(\d+)(_total)?$")  # the parser adds _total
_FILTER = r"^cluster\.guard_[^.]*_(primary|fallback)(_sampled)?\."


def _labels(pairs: dict[str, str]) -> str:
    def quote(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{quote(v)}"' for k, v in pairs.items()) + "}"


def translate(text: str, clusters: dict[str, tuple[str, str]]) -> str:
    """Envoy's exposition of guard's clusters as guard's metrics (the text format);
    ``clusters``: cluster name -> (model, route), from the bootstrap's layout."""
    requests: dict[tuple[str, str], float] = {}
    errors: dict[tuple[str, str], float] = {}
    buckets: dict[tuple[str, str], dict[float, float]] = {}
    sums: dict[tuple[str, str], float] = {}
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            where = clusters.get(sample.labels.get("envoy_cluster_name", ""))
            if where is None:
                continue
            model, route = where
            name = sample.name
            code = _GRPC_CODE.match(name)
            if code is not None:
                status = int(code.group(1))
                if status == 0:
                    requests[where] = requests.get(where, 0.0) + sample.value
                else:
                    key = (model, _STATUS.get(status, str(status)))
                    errors[key] = errors.get(key, 0.0) + sample.value
            # A route's two clusters (sampled twin and the other) add up.
            elif name == "envoy_cluster_upstream_rq_time_bucket":
                bound = float(sample.labels["le"])
                bound = bound / 1000.0 if bound != float("inf") else bound
                bounds = buckets.setdefault(where, {})
                bounds[bound] = bounds.get(bound, 0.0) + sample.value
            elif name == "envoy_cluster_upstream_rq_time_sum":
                sums[where] = sums.get(where, 0.0) + sample.value / 1000.0
            elif name == "envoy_cluster_upstream_rq_time_count":
                counts[where] = counts.get(where, 0.0) + sample.value
    lines = ["# TYPE guard_requests_total counter"]
    lines += [f"guard_requests_total{_labels({'model': m, 'route': r})} {v}"
              for (m, r), v in sorted(requests.items())]
    lines.append("# TYPE guard_request_errors_total counter")
    lines += [f"guard_request_errors_total{_labels({'model': m, 'code': c})} {v}"
              for (m, c), v in sorted(errors.items())]
    lines.append("# TYPE guard_request_duration_seconds histogram")
    for (model, route), bounds in sorted(buckets.items()):
        labels = {"model": model, "route": route}
        for bound, value in sorted(bounds.items()):
            le = "+Inf" if bound == float("inf") else repr(round(bound, 9))
            lines.append(f"guard_request_duration_seconds_bucket{_labels({**labels, 'le': le})}"
                         f" {value}")
        lines.append(f"guard_request_duration_seconds_count{_labels(labels)} "
                     f"{counts.get((model, route), 0.0)}")
        lines.append(f"guard_request_duration_seconds_sum{_labels(labels)} "
                     f"{sums.get((model, route), 0.0)}")
    return "\n".join(lines) + "\n"


def exposition(admin_port: int, clusters: dict[str, tuple[str, str]]) -> str:
    """guard's request metrics from the Envoy whose admin API is on ``admin_port``; "" when
    it does not answer (restarting: the series come back with the next Envoy, from 0, as a
    counter reset that Prometheus' rate() handles)."""
    if not admin_port:
        return ""
    try:
        text = admin_get(admin_port, f"/stats?format=prometheus&usedonly&filter={quote(_FILTER)}")
    except OSError:
        return ""
    return translate(text, clusters)
