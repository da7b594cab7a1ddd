"""Deployment helpers: artefacts generated from a guard config (Prometheus alerting rules in
rules.py, a canary gate for Argo Rollouts and Flagger in rollout.py).

The constants live here, free of heavy imports, so that ``guard --help`` stays instant.
"""

RULE_FORMATS = ("prometheus", "prometheusrule")
# Where `runbook_url` points unless --runbook-base says otherwise: the runbook in this repository.
# Pass the URL your runbook is served at (a git host's rendered page) to get clickable links.
DEFAULT_RUNBOOK_BASE = "docs/runbook.md"
