"""Configuration hot reload: watch the config file, validate first, swap changed models only.

Triggers: the file changing (polled every ``server.reload_interval_s``, from the end of the
first load on; the path is resolved through symlinks each time, so the ``..data`` symlink swap
of a Kubernetes ConfigMap volume is seen; a ``subPath`` mount never updates, which is
Kubernetes' behaviour, not ours) and SIGHUP. Relative paths in the config resolve against the
folder the config file is named in, not the ``..data`` target, and artifacts compare by
content: a ConfigMap update reloads only the models whose config or artifact changed.

A new config is validated before anything changes. An invalid one is rejected with an event and
``guard_config_reloads_total{result="rejected"}``, and the old config stays in force. A valid one
is applied per model, the same way in every serving process (the first one included: one path,
guard/serve/processes.py ``ServingPool``): models whose config (or artifact file) changed are
built and loaded beside the old ones (``Prepare``), in every serving process and in the verifier
process, then swapped in with one dict assignment (``Commit``); requests already inside the old
model finish on it, and it is closed once they are done (however long that takes;
``model_retire_waiting`` after 30 s, ``model_retired`` when it then closes:
guard/serve/registry.py ``retire``). A model that fails to load anywhere keeps its old version
everywhere. Models that did not change are not touched,
so their traffic never notices. A model reloaded for its ``mirror`` or ``capture`` keys alone
keeps its detectors' evidence (``evidence_fingerprint``); any other change starts them afresh,
as a restarted verifier does. ``server`` settings (ports, workers) take effect on restart.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, NamedTuple

from guard.config import GuardConfig, ModelConfig
from guard.plan.serving import load_config
from guard.errors import ConfigError
from guard.ipc.routes import RouteTable
from guard.observe.events import emit
from guard.serve.registry import RETIRE_REPORT_S

if TYPE_CHECKING:
    from prometheus_client import Counter

    from guard.serve.processes import ServingPool
    from guard.serve.verifier_link import VerifierLink

log = logging.getLogger("guard.reload")


def file_state(path: Path) -> tuple:
    """What identifies the file's content without reading it (symlinks followed)."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
        return (real, st.st_mtime_ns, st.st_size, st.st_ino)
    except OSError:
        return ("missing",)


class ReloadOutcome(NamedTuple):
    """What a reload did, as the admin API's Reload answers it: ``result`` as
    guard_config_reloads_total counts it (``applied``; ``failed``: some models kept their old
    version, ``failed`` names them with why; ``rejected``: the file is not a valid config,
    ``problems`` says why, and the config in force stays)."""

    result: str
    problems: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()  # (model, why)
    config_hash: str = ""

    @property
    def applied(self) -> bool:
        return self.result == "applied"


_digests: dict[tuple, str] = {}  # file_state -> sha256 of the content


def content_digest(path: Path) -> str:
    """sha256 of a file's content, computed again only when its state (path through symlinks,
    mtime, size, inode) changed. Content, not state, is compared: a ConfigMap update rewrites
    every file of the volume under a new folder, and an unchanged artifact must not reload."""
    state = file_state(path)
    digest = _digests.get(state)
    if digest is None:
        sha = hashlib.sha256()
        try:
            with open(path, "rb") as file:
                for block in iter(lambda: file.read(1 << 20), b""):
                    sha.update(block)
        except OSError:
            return "unreadable"
        digest = _digests[state] = sha.hexdigest()
    return digest


def model_fingerprint(model: ModelConfig, leave_out: tuple[str, ...] = ()) -> str:
    """A model's config plus the content of its artifact files: equal means nothing to reload.
    Paths are compared as written in the config, resolved against the config file's folder
    without following symlinks (guard/config/base.py ``_absolute``). ``leave_out``: top-level
    keys not compared."""
    state = model.model_dump(mode="json", exclude=set(leave_out))
    for role in ("primary", "reference", "fallback"):
        spec = getattr(model, role)
        if spec is not None and spec.path and os.path.isfile(spec.path):
            state[f"{role}_artifact"] = content_digest(Path(spec.path))
    return json.dumps(state, sort_keys=True, default=str)


# What a model's detectors accumulate does not depend on these keys: how many calls are
# mirrored and how (rate, queue, threads, batching), and what capture keeps.
_NOT_EVIDENCE = ("mirror", "capture")


def evidence_fingerprint(model: ModelConfig) -> str:
    """What a model's detectors judge by: its fingerprint without ``mirror`` and ``capture``,
    and its ARL0 in samples (``policy.false_alarms_per_day`` converts with the sample rate).
    Equal across a reload, the verifier carries the detectors' evidence over
    (guard/policy/route.py ``RoutePolicy.carry_on``): an SRE who raises ``mirror.sample_rate``
    in an incident keeps what the detectors have seen so far."""
    arl0 = model.policy.arl0_for(model.mirror.sample_rate)
    return f"{model_fingerprint(model, _NOT_EVIDENCE)} arl0={arl0!r}"


class _Prints(NamedTuple):
    whole: str  # model_fingerprint: unequal, the model reloads
    evidence: str  # evidence_fingerprint: equal, its detectors' evidence carries over


def _prints(model: ModelConfig) -> _Prints:
    return _Prints(model_fingerprint(model), evidence_fingerprint(model))


class ConfigReloader:
    retire_report_s = RETIRE_REPORT_S  # sent with Commit: every serving process retires so

    def __init__(self, path: Path, *, config: Callable[[], GuardConfig],
                 applied: Callable[[GuardConfig], Awaitable | None],
                 table: RouteTable, serving: "ServingPool", verifier: "VerifierLink",
                 reloads: "Counter"):
        """``config()``: the config in force; ``applied(config)``: called with the config a
        reload put in force (what a restarted child is told); what it returns, if anything, is
        awaited (Envoy mode: a hot restart). ``table``: the route slots; ``serving``: every
        serving process (``prepare``, ``commit``, their models by name); ``verifier``: the
        verifier's half; ``reloads``: ``guard_config_reloads_total``."""
        self.path = path
        self.config = config
        self.applied = applied
        self.table = table
        self.serving = serving
        self.verifier = verifier
        self.reloads = reloads
        self._state = file_state(path)
        self._lock = asyncio.Lock()
        # What each model was loaded from (config and artifact content; and what its detectors
        # judge by), taken when it was loaded: computing the old side at reload time would
        # read the new artifact twice.
        self._prints = {m.name: _prints(m) for m in config().models}

    async def watch(self, interval: float) -> None:
        """Poll the file; started by the server once the first load has finished (a change
        made during it is seen here: the state is the one from before the load)."""
        while True:
            await asyncio.sleep(interval)
            state = file_state(self.path)
            if state != self._state:
                self._state = state
                await self.reload("file changed")

    async def reload(self, trigger: str) -> ReloadOutcome:
        """Validate and apply the config file (``trigger``: why, for the events)."""
        async with self._lock:
            # What this reload reads is seen: the watcher does not reload it again (a SIGHUP
            # after an edit was one reload, counted twice, before).
            self._state = file_state(self.path)
            loop = asyncio.get_running_loop()
            try:
                new = await loop.run_in_executor(None, load_config, self.path)
            except ConfigError as exc:
                self.reloads.labels("rejected").inc()
                emit("config_rejected", trigger=trigger, path=str(self.path),
                     problems=exc.problems, note="the previous config stays in force")
                return ReloadOutcome("rejected", problems=tuple(exc.problems))
            return await self._apply(new, trigger)

    async def _apply(self, new: GuardConfig, trigger: str) -> ReloadOutcome:
        """Changed and added models load in every serving process (the backends that answer)
        and in the verifier (reference, checks, capture); only those that loaded everywhere
        are swapped in."""
        old = self.config()
        if new.server != old.server:
            emit("config_server_changed", note="server settings take effect on restart")
        old_prints = self._prints
        new_prints = {m.name: _prints(m) for m in new.models}
        loop = asyncio.get_running_loop()
        names = {m.name for m in new.models}
        models = self.serving.local.models
        slots = self.table.assign(m.name for m in new.models)
        wanted = sorted(name for name in names if name not in old_prints
                        or old_prints[name].whole != new_prints[name].whole)
        removed = [name for name in list(models) if name not in names]
        failed = await loop.run_in_executor(None, self.serving.prepare, new, slots, wanted)
        built = [name for name in wanted if name not in failed]
        # Evidence carries over where only the mirroring or capture changed (and both sides
        # loaded from the same artifacts: the whole fingerprint's artifact digests are in it).
        carried = [name for name in built if name in old_prints
                   and old_prints[name].evidence == new_prints[name].evidence]
        refused = await loop.run_in_executor(
            None, self.verifier.reload, new, slots, built, removed, carried)
        failed.update(refused)
        built = [name for name in built if name not in refused]
        changed = [name for name in built if name in models]
        added = [name for name in built if name not in models]
        await loop.run_in_executor(None, self.serving.commit, built, removed,
                                   self.retire_report_s)
        for name in removed:
            self.table.release(name)
        for name, error in failed.items():
            emit("model_reload_failed", model=name, error=error,
                 note="the previous version of this model stays in force")
        kept_models = [m for m in old.models if m.name in failed]
        # The server block in force stays (its ports, grace, limits: read at start, said to
        # take effect on restart by config_server_changed); the new one is the file's.
        applied = new.model_copy(update={"server": old.server, "models": [
            *(m for m in new.models if m.name not in failed), *kept_models]})
        applied.context = new.context
        self._prints = {name: (old_prints[name] if name in failed else new_prints[name])
                        for name in new_prints if name in old_prints or name not in failed}
        done = self.applied(applied)
        if done is not None:  # Envoy mode: a changed bootstrap hot-restarts Envoy
            await done
        result = "failed" if failed else "applied"
        self.reloads.labels(result).inc()
        emit("config_reloaded", trigger=trigger, changed=changed, added=added, removed=removed,
             failed=sorted(failed), evidence_carried=[n for n in carried if n in changed],
             config_hash=new.context.source_hash)
        return ReloadOutcome(result, changed=tuple(changed), added=tuple(added),
                             removed=tuple(removed), failed=tuple(sorted(failed.items())),
                             config_hash=new.context.source_hash or "")
