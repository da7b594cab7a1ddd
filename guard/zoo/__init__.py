"""Seeded models built offline (no downloads) for the demo, tests and benchmarks."""
