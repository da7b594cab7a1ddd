"""One serving process's models by name, and the only code that changes them: ``load`` (the
first load), ``prepare`` + ``commit`` (a reload: build beside, then swap), ``use_primary`` (a
repair's variant, or the primary as configured back) and ``close``.

Every serving process, the first one included, holds one ``ModelRegistry`` inside its
``ServingWorker`` (guard/serve/worker.py) and changes it only through these hooks, reached the
same way in every process (the control messages ``Init``, ``Prepare``, ``Commit``,
``UsePrimary``, ``Stop``: guard/ipc/messages.py). ``models`` is one dict for the process's
life: the data plane, admin and tap read it, and a swap is one item assignment, so the next
request sees the new model and a request already inside the old one finishes on it.

A replaced or removed model is closed by ``retire`` once the requests inside it are done,
never under one (a backend closed mid-inference can crash the process).
"""

from __future__ import annotations

import asyncio
from guard.config import GuardConfig, ModelConfig
from guard.ipc.messages import UsePrimary
from guard.ipc.ring import SampleRing
from guard.ipc.routes import RouteTable
from guard.observe.events import emit
from guard.observe.metrics import GuardMetrics
from guard.serve.model import ServedModel

RETIRE_REPORT_S = 30.0  # a replaced model still busy after this is reported (and awaited)


async def retire(model: ServedModel, report_s: float = RETIRE_REPORT_S) -> None:
    """Close a replaced model once the requests inside it have finished: never under a request.
    Requests end by their own deadline or the backend's (an upstream's timeout); one still
    inside after ``report_s`` seconds is reported once (``model_retire_waiting``), and waited
    for (``model_retired`` when the model then closes)."""
    model.end_watches()  # WatchRoute streams of the old version end now
    waited, reported = 0.0, False
    while model.requests_in_flight:
        await asyncio.sleep(0.05)
        waited += 0.05
        if waited >= report_s and not reported:
            reported = True
            emit("model_retire_waiting", model=model.name,
                 requests_in_flight=model.requests_in_flight, waited_s=round(waited, 1),
                 note="the replaced version is closed when its last request finishes")
    await asyncio.get_running_loop().run_in_executor(None, model.close)
    if reported:
        emit("model_retired", model=model.name, waited_s=round(waited, 1))


class ModelRegistry:
    def __init__(self, metrics: GuardMetrics, table: RouteTable, ring: SampleRing,
                 where: str = "serving process 0"):
        """``table``, ``ring``: what the models share with the verifier; ``where``: this
        process, for error messages. ``load`` and ``prepare`` block for seconds (run them off
        the event loop); ``connect`` and ``commit`` run on it."""
        self.metrics = metrics
        self.table = table
        self.ring = ring
        self.where = where
        self.models: dict[str, ServedModel] = {}
        self.prepared: dict[str, ServedModel] = {}  # a reload's models, until its commit
        # Models being built right now: a stop while one loads (an upstream not ready yet)
        # closes it too, which ends its load instead of leaving a thread waiting minutes.
        self._building: set[ServedModel] = set()
        self.inline_below_ms = 0.0

    # -- the hooks -------------------------------------------------------------------------------
    def load(self, config: GuardConfig, slots: dict[str, int],
             primaries: dict[str, UsePrimary] | None = None) -> None:
        """The first load: every model of ``config`` on its route slot, each on the primary
        ``primaries`` names (a repair that outlived a restart) or as configured. On a failure
        what was loaded is closed and the error raised."""
        self.inline_below_ms = config.server.inline_below_ms
        primaries = primaries or {}
        try:
            for model_config in config.models:
                name = model_config.name
                self.models[name] = self._build(model_config, slots[name], primaries.get(name))
        except BaseException:
            self.close()
            raise

    def prepare(self, config: GuardConfig, slots: dict[str, int],
                changed: list[str]) -> dict[str, str]:
        """A reload's first step: build the ``changed`` models beside the old ones (they serve
        on until ``commit``); {model: error} for those that did not load."""
        failed: dict[str, str] = {}
        for name in changed:
            try:
                self.prepared[name] = self._build(config.model(name), slots[name])
            except Exception as exc:
                failed[name] = f"{self.where}: {exc}"
        return failed

    async def connect(self, prepared: bool = False) -> None:
        """Open the upstream channels of the loaded models (``prepared``: of a reload's new
        ones), so that the first request does not pay for the connection."""
        for model in list((self.prepared if prepared else self.models).values()):
            await model.connect()

    async def commit(self, names: list[str], removed: list[str],
                     report_s: float = RETIRE_REPORT_S) -> None:
        """A reload's second step (on the event loop): swap in the prepared ``names`` (they
        loaded everywhere), drop the rest of what was prepared and the ``removed`` models;
        each replaced one is retired (``retire``)."""
        prepared, self.prepared = self.prepared, {}
        retired: list[ServedModel | None] = []
        for name, model in prepared.items():
            if name in names:
                retired.append(self.models.get(name))  # (None: not served before)
                self.models[name] = model  # the swap
            else:
                retired.append(model)
        retired.extend(self.models.pop(name, None) for name in removed)
        for old in retired:
            if old is not None:
                asyncio.create_task(retire(old, report_s))

    def use_primary(self, message: UsePrimary) -> str:
        """A repair's variant (or the primary as configured back); "" when done, otherwise
        why not."""
        model = self.models.get(message.model)
        if model is None:
            return f"{self.where}: unknown model '{message.model}'"
        try:
            model.use_primary(message.kept, message.primary)
        except Exception as exc:
            return f"{self.where}: {exc}"
        return ""

    def close(self) -> None:
        """Close every model, the prepared ones too (the process stops)."""
        for model in [*self.models.values(), *self.prepared.values(), *list(self._building)]:
            model.close()

    # -- building ---------------------------------------------------------------------------------
    def _build(self, model_config: ModelConfig, slot: int,
               primary: UsePrimary | None = None) -> ServedModel:
        model = ServedModel(model_config, self.metrics, self.table, slot, self.ring)
        self._building.add(model)
        try:
            model.load(self.inline_below_ms)
            if primary is not None and primary.kept:
                model.use_primary(primary.kept, primary.primary)
        except BaseException:
            model.close()
            raise
        finally:
            self._building.discard(model)
        return model
