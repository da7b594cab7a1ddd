"""The serving processes' event loop (guard/serve/event_loop.py): uvloop where installed, asyncio's
own where asked, and a clear error for a value it does not know."""

from __future__ import annotations

import asyncio

import pytest

from guard.errors import GuardError
from guard.serve import event_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_where_installed(monkeypatch):
    pytest.importorskip("uvloop", reason="uvloop is in the llm extra: pip install -e '.[llm]'")
    monkeypatch.delenv(event_loop.ENV, raising=False)
    assert event_loop.run(_loop_module()).startswith("uvloop")
    monkeypatch.setenv(event_loop.ENV, "uvloop")
    assert event_loop.run(_loop_module()).startswith("uvloop")


def test_asyncio_when_asked(monkeypatch):
    monkeypatch.setenv(event_loop.ENV, "asyncio")
    assert event_loop.run(_loop_module()).startswith("asyncio")


def test_an_unknown_choice_is_named(monkeypatch):
    monkeypatch.setenv(event_loop.ENV, "trio")
    coroutine = _loop_module()
    with pytest.raises(GuardError, match="GUARD_EVENT_LOOP='trio'"):
        event_loop.run(coroutine)
    coroutine.close()
