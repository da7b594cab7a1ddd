"""Only what pyproject.toml cannot say in a stable way: the optional C extensions.

Both are ``optional``: where no C compiler is installed the build warns and goes on.

- Tier 1's one-pass verdict kernel (guard/verify/_verdict.c): without it guard/verify/tensor.py
  takes the numpy path (about 4x slower at 1 MB; benchmarks/results/check_cost.md).
- The sample ring's acquire/release counters (guard/ipc/_atomics.c): without it the ring keeps
  plain stores on x86-64, where they are correct, and refuses to start on other CPUs
  (guard/ipc/ring.py says why).

Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("guard.verify._verdict", ["guard/verify/_verdict.c"], optional=True),
    Extension("guard.ipc._atomics", ["guard/ipc/_atomics.c"], optional=True),
])
