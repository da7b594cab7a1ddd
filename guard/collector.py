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
none above 50 ms, and replay went from 75% to 87-91% of the reference's own throughput (with
guard/backends/torch.py's fewer lock round trips beside it; 70% before both).

Where: replay (guard/replay/execute.py ``Runners``), where results accumulate: thousands of
outcomes outliving the young generations are what set off one full collection after another.
The serving processes (serve, the verifier) keep no such pile: their full collections are
rare, and a model that a config reload retires must stay collectable, so they leave the
collector as it is.

This is the step CPython's documentation gives for long-lived state (``gc.freeze``: "the
permanent generation"); the collector still runs, on what is made after the freeze.

The cost: a frozen object that later becomes part of an unreachable cycle is not collected until
``thaw()``; objects freed by reference counting (nearly all) are freed as usual. So freeze what
was just loaded, after collecting what loading left behind, and thaw when the loaded set is let
go (replay's runners closing).

``GUARD_GC_FREEZE=off`` leaves the collector as Python sets it up.
"""

from __future__ import annotations

import gc
import logging

from guard.malloc import switched_off

log = logging.getLogger("guard.collector")


def enabled() -> bool:
    return not switched_off("GUARD_GC_FREEZE")


def freeze_loaded() -> str:
    """Collect what loading left behind, then freeze everything alive; returns what was done.
    The full collection first costs one pause now, before the loaded model's batches run,
    instead of one on every later full collection."""
    if not enabled():
        return "off (GUARD_GC_FREEZE)"
    gc.collect()
    gc.freeze()
    done = f"froze {gc.get_freeze_count()} objects"
    log.debug("gc: %s", done)
    return done


def thaw() -> None:
    """Give frozen objects back to the collector (the oldest generation): after the set that
    was frozen has been let go, so that any cycles among it are collected again."""
    if gc.get_freeze_count():
        gc.unfreeze()
