# The C extension guard/verify/_verdict.c (built by setup.py where a compiler is present).
import numpy as np

def max_abs_pair(a: np.ndarray, b: np.ndarray, /) -> tuple[float, float]: ...
