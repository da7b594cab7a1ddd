"""Python's cyclic garbage collector, kept off the objects that live as long as the process.

Why: once torch and the backends are loaded, a process holds ~430 000 objects the collector
tracks (the zoo CNN's replay, measured). They never become garbage, but each full (oldest
generation) collection walks all of them while holding the interpreter lock: 300-370 ms in one
stop on the AMD EPYC, ~400 ms of a 3.5 s replay of 10 000 records in all. Every thread that
needs the lock then waits, and inference needs it: a TorchScript forward takes the lock back
at least twice per call (on return, and inside when it drops a tensor that Python made), so
the reference, which bounds replay, slept 45-60 us per row of its 220 (benchmarks/
replay_throughput.py). ``gc.freeze()`` moves every object alive now into a permanent
generation that collections skip; with it the same replay's collections took 80-95 ms in all,
none above 50 ms, and the reference stopped waiting (replay 70% -> 88% of the reference's own
throughput).

Where: replay (guard/replay/execute.py ``Runners``), where results accumulate: thousands of
outcomes outliving the young generations are what set off one full collection after another.
The serving processes (serve, the verifier) keep no such pile: their full collections are
rare, and a model that a config reload retires must stay collectable, so they leave the
collector as it is.

This is the step CPython's documentation gives for long-lived state (``gc.freeze``: "the
permanent generation"); the collector still runs, on what is made after the freeze.

The cost: a frozen object that later becomes part of an unreachable cycle is not collected until
``thaw()``; objects freed by reference counting (nearly all) are freed as usual. So freeze once
what was just loaded, after collecting what loading left behind, and thaw when the loaded set
is let go (replay's runners closing; a config reload retiring models).

``GUARD_GC_FREEZE=off`` leaves the collector as Python sets it up.
"""

from __future__ import annotations

import gc
import logging
import os
import time

log = logging.getLogger("guard.collector")


def enabled() -> bool:
    return os.environ.get("GUARD_GC_FREEZE", "").lower() not in ("off", "0", "false", "no")


def freeze_loaded() -> str:
    """Collect what loading left behind, then freeze everything alive. Returns what was done
    (for a start-up event). A full collection first: it costs one pause now, on a process that
    is not serving yet, instead of one on every later full collection."""
    if not enabled():
        return "off (GUARD_GC_FREEZE)"
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    took = time.perf_counter() - started
    log.debug("gc: froze %d objects in %.0f ms", frozen, took * 1e3)
    return f"froze {frozen} objects"


def thaw() -> None:
    """Give frozen objects back to the collector (the oldest generation): after the set that
    was frozen has been let go, so that any cycles among it are collected again."""
    if gc.get_freeze_count():
        gc.unfreeze()
