"""The event loop a serving process runs on: uvloop where it is installed, else asyncio's own.

Every serving process (the first, in ``guard serve``, and each extra one, guard/serve/worker.py)
runs its gRPC server (grpc.aio), the OpenAI-compatible HTTP edge (aiohttp) and its control
tasks on one event loop. The HTTP edge reads and writes every streamed event of every call in
Python, and a quarter of its CPU per event was the loop itself (py-spy, docs/http-edge.md):
uvloop (libuv under asyncio's API) is the loop aiohttp recommends, and MLServer runs grpc.aio
and its HTTP server on it in one process as guard does. It comes with the ``llm`` extra, beside
aiohttp; without it, or with ``GUARD_EVENT_LOOP=asyncio`` in the environment (inherited by the
extra serving processes), the process runs on asyncio's default loop, as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Coroutine, TypeVar, cast

from guard.errors import GuardError, install_hint

log = logging.getLogger("guard.serve")
T = TypeVar("T")
ENV = "GUARD_EVENT_LOOP"  # "auto" (default): uvloop where importable; "asyncio": never


def uvloop_module() -> Any | None:
    """The uvloop module where this process should run on it, else None."""
    choice = os.environ.get(ENV, "auto").strip().lower()
    if choice == "asyncio":
        return None
    if choice not in ("auto", "uvloop"):
        raise GuardError(f"{ENV}={choice!r}: expected auto, uvloop or asyncio")
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise GuardError(f"{ENV}=uvloop but uvloop is not installed: "
                             f"{install_hint('llm-remote', 'uvloop')}") from None
        return None
    return uvloop


def run(main: Coroutine[Any, Any, T], wait_for_threads: bool = True) -> T:
    """``asyncio.run(main)`` on the loop :func:`uvloop_module` picks.

    ``wait_for_threads=False``: a serving process's main, which exits at once after it
    (guard/runtime/children.py ``exit_at_once``). ``asyncio.run`` ends by joining the loop's
    executor threads, and one may still be blocked in work the stop no longer needs (a
    reload's model load waiting out an upstream's ``ready_timeout_s``): the process then
    outlived its shutdown grace by as long. Here what is left on the loop is cancelled and the
    executor is shut down without a wait."""
    uvloop = uvloop_module()
    if uvloop is not None:
        log.debug("serving on uvloop")
    if wait_for_threads:
        return asyncio.run(main) if uvloop is None else cast(T, uvloop.run(main))
    loop = asyncio.new_event_loop() if uvloop is None else uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()  # (its default executor: shut down without waiting)
