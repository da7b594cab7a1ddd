"""Observability: Prometheus metrics and structured events."""
