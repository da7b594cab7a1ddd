"""glibc malloc settings for processes that run inference (serve, the verifier, replay, matrix).

Why: a forward pass allocates its intermediate tensors and frees them again, every call. glibc
returns free memory at the top of its heap to the kernel once it exceeds ``M_TRIM_THRESHOLD``,
which it sizes dynamically from the largest freed block (at most 64 MiB, often far less): a
forward whose intermediates add up to more is trimmed at the end of each call and page-faults its
memory back at the start of the next. Measured on the project's AMD EPYC: the zoo CNN's
TorchScript reference at batch 64 took 47 minor page faults per row and ran at 380-430 us per row
instead of 205-220 (2x), depending only on where earlier allocations (an ONNX Runtime session's,
say) had left the top of the heap; with the thresholds below, 0 faults and the fast figure. It
takes a large working set per call: the zoo's models at batch 1 and 8 (what the sidecar's
verifier runs for them) faulted neither way; a larger model, or replay's batches, do.

What: ``M_MMAP_THRESHOLD`` 32 MiB (glibc's own ceiling for its dynamic threshold: larger blocks,
model weights, are still mapped on their own and returned when freed) and ``M_TRIM_THRESHOLD``
64 MiB (twice that, the trim threshold glibc's dynamic rule pairs with it). Setting either fixes
both (it turns the dynamic rule off), so both are set. The cost: up to 64 MiB of freed heap per
malloc arena stays mapped instead of going back to the kernel.

Left alone when ``GUARD_MALLOC_TUNING=off``, when the user set glibc's own ``MALLOC_*_``
variables (theirs win), and off glibc (musl, macOS): a no-op there.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger("guard.malloc")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 64 << 20
_USER_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
                   "MALLOC_MMAP_MAX_")
_done: str | None = None


def tune_for_inference() -> str:
    """Apply the settings once per process; returns what was done (for the start-up event)."""
    global _done
    if _done is None:
        _done = _tune()
        log.debug("malloc: %s", _done)
    return _done


def switched_off(variable: str) -> bool:
    """Is a process setting's off switch (``GUARD_MALLOC_TUNING``, guard/collector.py's
    ``GUARD_GC_FREEZE``) set: off, 0, false or no, in any case."""
    return os.environ.get(variable, "").lower() in ("off", "0", "false", "no")


def _tune() -> str:
    if switched_off("GUARD_MALLOC_TUNING"):
        return "off (GUARD_MALLOC_TUNING)"
    if any(name in os.environ for name in _USER_VARIABLES):
        return "left to the MALLOC_*_ environment variables"
    if platform.libc_ver()[0] != "glibc":
        return "not glibc: left alone"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "mallopt unavailable: left alone"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(M_TRIM_THRESHOLD,
                                                                      TRIM_THRESHOLD_BYTES)
    if not ok:
        return "mallopt refused: left alone"
    return f"glibc mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB, trim threshold " \
           f"{TRIM_THRESHOLD_BYTES >> 20} MiB"
