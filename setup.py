"""Only what pyproject.toml cannot say in a stable way: the optional C extension.

Tier 1's one-pass verdict kernel (guard/verify/_verdict.c) is ``optional``: where no C compiler
is installed the build warns and goes on, and guard/verify/tensor.py takes the numpy path
(about 4x slower at 1 MB; benchmarks/results/check_cost.md). Everything else about the package
is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("guard.verify._verdict", ["guard/verify/_verdict.c"],
                             optional=True)])
