"""Pin determinism for the reference side (its answers are the truth others are judged by).

torch's switches are process-wide: when a torch *primary* shares the process with a torch
reference, the primary runs with them too (deterministic algorithms, TF32 off, the reference's
thread count). Pinning is done once, the first time a torch reference loads.

Why not ``torch.use_deterministic_algorithms``: besides the flag it sets the compiler's
(``torch._inductor.config.deterministic``), and importing that module imports torch._dynamo,
2-8 s per process, which every verifier with an eager or TorchScript reference paid for a
compiler it never runs. So the flag is set directly, the compiler's only where the compiler is
loaded already, and a ``torch_compile`` backend calls ``pin_compiler`` before it compiles.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

_lock = threading.Lock()
_pinned = False
_INDUCTOR_CONFIG = "torch._inductor.config"


def pin_torch_reference(threads: int) -> None:
    global _pinned
    import torch

    with _lock:
        if _pinned:
            return
        torch._C._set_deterministic_algorithms(True, warn_only=True)
        if _INDUCTOR_CONFIG in sys.modules:
            inductor_config: Any = sys.modules[_INDUCTOR_CONFIG]  # (a config module of flags)
            inductor_config.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        if threads > 0:
            torch.set_num_threads(threads)
        _pinned = True


def pin_compiler() -> None:
    """Before a ``torch.compile`` compiles: where a reference pinned determinism in this
    process, the compiler follows it (what ``torch.use_deterministic_algorithms`` would have
    set at the pin)."""
    with _lock:
        if _pinned:
            import torch._inductor.config as inductor_config

            inductor_config.deterministic = True
