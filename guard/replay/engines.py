"""Engines run planned batches and yield their outcomes; the aggregator does not care which ran.

- ``LocalEngine``: one process, one ``ModelRunner`` per model, batches in order, inference of
  the next batches (on a thread per side: reference, primary) overlapped with reading and
  checking (on this one).
- ``RayEngine``: one worker actor per CPU slot, each with its own backend set (built from the
  config text the driver ships, so the workers need the artifacts at the same paths: a shared
  volume or the same image), batches handed to idle actors with a bounded number in flight so a
  large capture streams instead of filling the object store. Outcomes come back out of order;
  the aggregator sorts them by item index, so the report equals the local engine's.

Ray is an optional extra (``pip install '.[ray]'``), imported only here and only when used.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator

import yaml

from guard.backends.base import TensorSpec
from guard.config import GuardConfig
from guard.plan.complete import parse_config
from guard.errors import GuardError, install_hint
from guard.malloc import tune_for_inference
from guard.replay.execute import Runners
from guard.replay.items import Batch, RecordOutcome

LOCAL_RAY_CPUS = 2  # a local cluster (no --ray-address) gets this many CPUs: one actor each


class LocalEngine:
    name = "local"
    AHEAD = 2  # batches handed to the sides' threads beyond the one being checked

    def __init__(self, config: GuardConfig):
        self.runners = Runners({m.name: m for m in config.models})
        self.workers = 1

    def input_specs(self, model: str) -> tuple[TensorSpec, ...]:
        return self.runners.get(model).npz_inputs()

    def describe(self, model: str) -> dict[str, str]:
        return self.runners.get(model).describe()

    def run(self, batches: Iterable[Batch]) -> Iterator[list[RecordOutcome]]:
        """This thread reads the records of the next batches, hands each batch to the
        reference's and the primary's threads (``ModelRunner.submit``: each side runs its
        queue back to back) and checks the inferred ones. ``AHEAD`` batches are queued beyond
        the one being checked, so that the reference never waits for this thread to read the
        next batch, nor for the primary to finish the last one."""
        pending: deque = deque()  # (runner, Submitted), in batch order
        try:
            for batch in batches:
                runner = self.runners.get(batch.model)
                pending.append((runner, runner.submit(batch)))
                if len(pending) > self.AHEAD:
                    runner, submitted = pending.popleft()
                    yield runner.check(runner.collect(submitted))
            while pending:
                runner, submitted = pending.popleft()
                yield runner.check(runner.collect(submitted))
        finally:  # stopped early (an error, or the caller closed us): let queued work finish
            for runner, submitted in pending:
                runner.collect(submitted)

    def close(self) -> None:
        self.runners.close()


class ReplayWorker:
    """A Ray actor: its own backends for the models of one config, loaded on first use."""

    def __init__(self, config_text: str, base_dir: str):
        tune_for_inference()  # a Ray worker process: see guard/malloc.py
        config = parse_config(yaml.safe_load(config_text), Path(base_dir), "replay config")
        self.runners = Runners({m.name: m for m in config.models})

    def describe(self, model: str) -> dict[str, str]:
        return self.runners.get(model).describe()

    def input_specs(self, model: str) -> tuple[TensorSpec, ...]:
        return self.runners.get(model).npz_inputs()

    def run(self, batch: Batch) -> list[RecordOutcome]:
        return self.runners.run(batch)

    def close(self) -> None:
        self.runners.close()


def _import_ray():
    try:
        import ray
    except ImportError:
        raise GuardError(f"--engine ray needs Ray: {install_hint('ray')}") from None
    return ray


class RayEngine:
    name = "ray"

    def __init__(self, config_text: str, base_dir: Path, address: str | None,
                 workers: int | None = None):
        self.ray = _import_ray()
        self.address = address
        self._started_here = False
        ray = self.ray
        if not ray.is_initialized():
            kwargs = {"log_to_driver": False}
            if address:
                kwargs["address"] = address  # an existing cluster: its settings are its own
            else:
                # A local cluster: the workers import guard and any `module:factory` model the
                # way this process does.
                path = os.pathsep.join(p for p in sys.path if p and Path(p).exists())
                # address "local": always a fresh cluster of our own, never one that `ray
                # start` left registered on this machine.
                kwargs.update(address="local", num_cpus=LOCAL_RAY_CPUS, include_dashboard=False,
                              configure_logging=False,
                              runtime_env={"env_vars": {"PYTHONPATH": path}})
            try:
                ray.init(**kwargs)
            except Exception as exc:  # connection refused, bad address...
                raise GuardError(f"cannot start or reach a Ray cluster"
                                 f"{' at ' + address if address else ''}: {exc}") from None
            self._started_here = True
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.workers = max(1, workers or cpus)
        actor = ray.remote(num_cpus=1)(ReplayWorker)
        self.actors = [actor.remote(config_text, str(base_dir)) for _ in range(self.workers)]

    def _ask(self, method: str, model: str):
        try:
            return self.ray.get(getattr(self.actors[0], method).remote(model))
        except Exception as exc:
            raise GuardError(f"a Ray worker cannot load model '{model}': "
                             f"{_root_cause(exc)}") from None

    def input_specs(self, model: str) -> tuple[TensorSpec, ...]:
        return self._ask("input_specs", model)

    def describe(self, model: str) -> dict[str, str]:
        return self._ask("describe", model)

    def run(self, batches: Iterable[Batch]) -> Iterator[list[RecordOutcome]]:
        ray = self.ray
        idle = list(self.actors) * 2  # two batches per actor: the next one waits there
        pending: dict = {}  # object ref -> actor
        batches = iter(batches)
        exhausted = False
        while pending or not exhausted:
            while idle and not exhausted:
                batch = next(batches, None)
                if batch is None:
                    exhausted = True
                    break
                actor = idle.pop()
                pending[actor.run.remote(batch)] = actor
            if not pending:
                break
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                idle.append(pending.pop(ref))
                try:
                    yield ray.get(ref)
                except Exception as exc:
                    raise GuardError(f"a Ray worker failed: {_root_cause(exc)}") from None

    def close(self) -> None:
        ray = self.ray
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=30)
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass
        for actor in self.actors:
            ray.kill(actor)
        if self._started_here:
            ray.shutdown()


def _root_cause(exc: Exception) -> str:
    cause = getattr(exc, "cause", None) or exc
    return f"{type(cause).__name__}: {cause}"
