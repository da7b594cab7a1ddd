"""guard: a runtime guard for deep-learning inference."""

__version__ = "0.1.0"
