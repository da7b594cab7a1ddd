"""Pin determinism for the reference side (its answers are the truth others are judged by).

torch's switches are process-wide: when a torch *primary* shares the process with a torch
reference, the primary runs with them too (deterministic algorithms, TF32 off, the reference's
thread count). Pinning is done once, the first time a torch reference loads.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_pinned = False


def pin_torch_reference(threads: int) -> None:
    global _pinned
    import torch

    with _lock:
        if _pinned:
            return
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        if threads > 0:
            torch.set_num_threads(threads)
        _pinned = True
