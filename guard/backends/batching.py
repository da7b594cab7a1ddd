"""Several requests as one forward pass: stacked along the first axis, the answers split back.

Offline replay (guard/replay/execute.py) and the verifier's mirror
(guard/verifier_process/mirror.py) both run many same-shaped requests through one backend, and
a backend's fixed cost per call (the session's dispatch, the interpreter lock, a thread's
wake-up) is often most of a small model's forward. Where the backend says its first axis is the
batch, the requests are stacked and run once:

- ``dynamic_batch``: every input the backend declares has a dynamic first dimension (-1). A
  backend that declares no inputs (a torch module without a signature) is not stacked: nothing
  says its first axis is a batch.
- ``signature``: requests with equal signatures (input names, dtypes, every dimension but the
  first) stack.
- ``stack`` / ``split_rows``: the stacked inputs; the answers cut back into each request's rows,
  or None when an output is not one row per input row (a detector's boxes after NMS, a
  scalar): such a batch runs one request at a time instead.

A stacked call answers every row as a call of its own would, up to the order in which the
backend sums (a batch can pick another kernel): the callers compare figures within that noise.
"""

from __future__ import annotations

import numpy as np

from guard.backends.base import BackendInfo


def dynamic_batch(info: BackendInfo) -> bool:
    """Does every input this backend declares take a batch on its first axis?"""
    specs = info.inputs
    return bool(specs) and all(s.shape and s.shape[0] == -1 for s in specs)


def signature(inputs: dict[str, np.ndarray]) -> tuple:
    """Requests with equal signatures can be stacked along the first axis."""
    return tuple((name, a.dtype.str, a.shape[1:] if a.ndim else None)
                 for name, a in sorted(inputs.items()))


def rows(inputs: dict[str, np.ndarray]) -> int:
    """The rows of one request: its (first) input's first dimension; 1 for a scalar input."""
    first = next(iter(inputs.values()), None)
    return int(first.shape[0]) if first is not None and first.ndim else 1


def stack(requests: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Same-signature requests as one, in order."""
    return {name: np.concatenate([r[name] for r in requests], axis=0) for name in requests[0]}


def split_rows(outputs: dict[str, np.ndarray], counts: list[int]) -> list[dict] | None:
    """``outputs`` of a stacked call cut into each request's rows (``counts``, in order), as
    views; None when an output does not have one row per input row."""
    total = sum(counts)
    if any(np.ndim(a) == 0 or np.shape(a)[0] != total for a in outputs.values()):
        return None
    bounds = np.cumsum([0, *counts]).tolist()
    return [{name: a[bounds[k]:bounds[k + 1]] for name, a in outputs.items()}
            for k in range(len(counts))]
