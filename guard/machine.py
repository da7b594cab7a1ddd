"""The machine a figure was measured on, as benchmarks and the matrix report write it down."""

from __future__ import annotations

from pathlib import Path


def cpu_model(default: str = "unknown") -> str:
    """The CPU's model name from /proc/cpuinfo (Linux); ``default`` where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return default
