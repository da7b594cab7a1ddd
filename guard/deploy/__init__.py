"""Deployment helpers: artefacts generated from a guard config (Prometheus alerting rules in
rules.py, a canary gate for Argo Rollouts and Flagger in rollout.py).

The constants live here, free of heavy imports, so that ``guard --help`` stays instant.
"""

RULE_FORMATS = ("prometheus", "prometheusrule")
# Where `runbook_url` points unless --runbook-base says otherwise: the runbook in this repository.
# Pass the URL your runbook is served at (a git host's rendered page) to get clickable links.
DEFAULT_RUNBOOK_BASE = "docs/runbook.md"

import re

# Kubernetes label syntax (apimachinery's validation): a key is a name of at most 63 characters,
# optionally under a DNS-subdomain prefix ("app.kubernetes.io/name"); a value is empty or a name.
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^({_LABEL_NAME})?$")


def parse_labels(items: list[str], flag: str) -> dict[str, str]:
    """``KEY=VALUE`` arguments (``flag`` names them in errors) as Kubernetes labels; ValueError
    naming the first that is not one (a bad label would only be refused by the API server)."""
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not _LABEL_KEY.match(key):
            raise ValueError(f"{flag}: '{item}' is not LABEL=VALUE (a Kubernetes label, e.g. "
                             "release=kube-prometheus-stack)")
        if not _LABEL_VALUE.match(value):
            raise ValueError(f"{flag}: '{item}': the value must be at most 63 characters of "
                             "letters, digits, '-', '_' and '.', starting and ending with a "
                             "letter or digit")
        labels[key] = value
    return labels
