"""deploy/grafana/guard-dashboard.json: every query is PromQL that refers only to metrics (and
labels) the guard exports.

The exported names come from guard's own registry (guard.observe.metrics.GuardMetrics) with
every labelled child created, so that counters show their ``_total``, histograms their
``_bucket``/``_count``/``_sum`` series. Queries are parsed with promql-parser after Grafana's
macros and variables are replaced by values of the same kind. The real-Prometheus e2e test
(tests/e2e/test_prometheus_alerts.py) runs the same queries against a Prometheus server.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser
import pytest
from prometheus_client.metrics import MetricWrapperBase

from guard.observe.metrics import GuardMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/guard-dashboard.json"
# Labels every scraped series gets from Prometheus, whatever the exporter says.
TARGET_LABELS = {"job", "instance", "__name__"}
GRAFANA_MACROS = {"$__rate_interval": "1m", "$__interval": "30s", "$__range": "1h"}


def exported_series() -> dict[str, set[str]]:
    """Series name -> label names, as a guard's /metrics shows them."""
    metrics = GuardMetrics("test")
    for wrapper in vars(metrics).values():
        if isinstance(wrapper, MetricWrapperBase) and wrapper._labelnames:
            wrapper.labels(*["x"] * len(wrapper._labelnames))
    series: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target, template variable and annotation."""
    found = []

    def panels(items):
        for item in items:
            yield item
            yield from panels(item.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) \
            else variable["query"]
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert match, f"variable {variable['name']}: expected label_values(selector, label)"
        found.append((f"variable {variable['name']}", match.group(1)))
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            found.append((f"annotation {annotation['name']!r}", annotation["expr"]))
    return found


def substitute(expr: str) -> str:
    for macro, value in GRAFANA_MACROS.items():
        expr = expr.replace(macro, value)
    # Dashboard variables are only used as regex matchers (=~"$var"): any regex stands in.
    assert not re.search(r'[^~]"\$\w+"', expr), "a variable outside a regex matcher"
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def selectors(node) -> list:
    """Every VectorSelector in a parsed expression."""
    if isinstance(node, promql_parser.VectorSelector):
        return [node]
    found = []
    for attribute in ("expr", "lhs", "rhs", "vector_selector", "param"):
        child = getattr(node, attribute, None)
        if child is not None and not isinstance(child, (str, int, float)):
            found += selectors(child)
    for arg in getattr(node, "args", None) or []:
        found += selectors(arg)
    return found


def matcher_names(selector) -> set[str]:
    return {m.name for m in selector.matchers.matchers}


def grouping_problems(node, exported: dict[str, set[str]]) -> list[str]:
    """`sum by (x)` over series that have no label x groups everything into one: a typo."""
    problems = []
    if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None \
            and node.modifier.type == promql_parser.AggModifierType.By:
        available = set(TARGET_LABELS)
        for selector in selectors(node.expr):
            available |= exported.get(selector.name, set())
        problems += [f"by ({label})" for label in node.modifier.labels if label not in available]
    for attribute in ("expr", "lhs", "rhs", "vector_selector"):
        child = getattr(node, attribute, None)
        if child is not None:
            problems += grouping_problems(child, exported)
    for arg in getattr(node, "args", None) or []:
        problems += grouping_problems(arg, exported)
    return problems


def test_dashboard_is_grafana_json_with_panels():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    titles = [p["title"] for p in dashboard["panels"] if p["type"] != "row"]
    assert len(titles) == len(set(titles)), "panel titles are unique"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_every_query_uses_only_exported_metrics_and_labels():
    exported = exported_series()
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    assert len(queries) > 20
    used = set()
    for where, expr in queries:
        parsed = promql_parser.parse(substitute(expr))
        found = selectors(parsed)
        for selector in found:
            name = selector.name
            assert name in exported, f"{where}: {name} is not a guard metric"
            unknown = matcher_names(selector) - exported[name] - TARGET_LABELS
            assert not unknown, f"{where}: {name} has no label(s) {sorted(unknown)}"
            used.add(name)
        if "vector(" not in expr:
            assert found, f"{where}: no metric in {expr}"
        assert not grouping_problems(parsed, exported), f"{where}: {expr}"
    # The panels the dashboard promises (traffic, latency, drift, checks, mirror, queue,
    # reference, fallback and transitions).
    assert {
        "guard_requests_total", "guard_request_duration_seconds_bucket", "guard_drift_ratio",
        "guard_checks_total", "guard_mirror_total", "guard_mirror_queue_depth",
        "guard_reference_duration_seconds_bucket", "guard_fallback_active",
        "guard_fallback_transitions_total", "guard_tensor_max_abs_error_bucket",
    } <= used


def test_latency_panels_are_histogram_quantiles_over_buckets():
    queries = dict(dashboard_queries(json.loads(DASHBOARD.read_text())))
    quantiles = [q for q in queries.values() if q.startswith("histogram_quantile(")]
    assert quantiles
    for query in quantiles:
        assert "_bucket{" in query and "by (le" in query, query


@pytest.mark.parametrize("bad,problem", [
    ('rate(guard_request_total{model=~".*"}[1m])', "not a guard metric"),
    ('guard_mirror_total{outcomes="dropped"}', "has no label"),
    ('sum by (model, tiers) (rate(guard_checks_total[1m]))', "groups by a missing label"),
])
def test_the_check_catches_a_wrong_name_or_label(bad, problem):
    exported = exported_series()
    parsed = promql_parser.parse(bad)
    (selector,) = selectors(parsed)
    if problem == "not a guard metric":
        assert selector.name not in exported
    elif problem == "has no label":
        assert matcher_names(selector) - exported[selector.name] - TARGET_LABELS
    else:
        assert grouping_problems(parsed, exported) == ["by (tiers)"]
