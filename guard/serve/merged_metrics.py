"""One /metrics for every process of a guard: this process's registry plus the expositions of the
verifier and of the extra serving processes, asked for at each scrape.

Same-named series are summed (the request path counts the samples the ring refused under
``guard_mirror_total{outcome="dropped"}``, the verifier those its queues refused). Why a forward
and not prometheus_client's multiprocess mode: that mode is switched on by an environment
variable read at import and keeps one set of files per process, which does not fit several
servers in one process (tests, embedding) nor a child that restarts (its gauges would have to
be reaped by hand); a forward keeps one registry per process and a dead verifier's gauges
simply vanish with it.
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client.registry import Collector

from guard.observe.exposition import merge
from guard.observe.metrics import GuardMetrics


class MergedMetrics(Collector):
    """This process's registry plus the expositions of the verifier and of the other serving
    processes (``others()``: their texts), same-named series summed."""

    def __init__(self, metrics: GuardMetrics, others: Callable[[], Iterable[str]]):
        self.metrics = metrics
        self.others = others

    def collect(self):
        yield from merge(self.metrics.registry.collect(), self.others())
