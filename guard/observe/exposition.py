"""One exposition out of several registries: this process's, plus the texts of the verifier and
of the other serving processes, same-named series summed (guard/serve/merged_metrics.py
``MergedMetrics``; why a forward and not prometheus_client's multiprocess mode: there).

The text format has no counter ``_created`` series of its own: a counter's, histogram's or
summary's ``_created`` is written as a gauge family ``NAME_created`` beside ``NAME``, and read
back so. Merged as a family of its own, it came out twice (once in the family it belongs to,
once as that gauge), with two ``# TYPE`` lines, which ``promtool check metrics`` rejects. So a
``NAME_created`` gauge read back goes into ``NAME``'s family, and a ``_created`` value merges as
the latest start (a sum restarts when any process does), never as a sum.
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

_CREATED = "_created"
_HAS_CREATED = ("counter", "histogram", "summary")


def _owner(families: dict[str, Metric], other: Metric) -> Metric | None:
    """The counter/histogram/summary family a ``NAME_created`` gauge read back belongs to."""
    if other.type != "gauge" or not other.name.endswith(_CREATED):
        return None
    owner = families.get(other.name[:-len(_CREATED)])
    return owner if owner is not None and owner.type in _HAS_CREATED else None


def _merge_samples(into: Metric, samples: Iterable[Sample]) -> None:
    values = {(s.name, tuple(sorted(s.labels.items()))): s for s in into.samples}
    for s in samples:
        key = (s.name, tuple(sorted(s.labels.items())))
        old = values.get(key)
        if old is None:
            values[key] = s
            continue
        # A sum starts over when any of its processes does: the latest start is the sum's.
        value = max(old.value, s.value) if s.name.endswith(_CREATED) else old.value + s.value
        values[key] = Sample(s.name, s.labels, value, old.timestamp, old.exemplar)
    into.samples = list(values.values())


def merge(local: Iterable[Metric], texts: Iterable[str]) -> list[Metric]:
    """``local`` families (a registry's ``collect()``) with the families of ``texts`` (text
    expositions), same-named series summed, each family once."""
    families = {f.name: f for f in local}
    pending_created: list[Metric] = []
    for other in (f for text in texts for f in text_string_to_metric_families(text)):
        owner = _owner(families, other)
        if owner is not None:
            _merge_samples(owner, other.samples)
            continue
        if other.type == "gauge" and other.name.endswith(_CREATED):
            pending_created.append(other)  # its owner may come later in the text
            continue
        mine = families.get(other.name)
        if mine is None:
            families[other.name] = other
        else:
            _merge_samples(mine, other.samples)
    for created in pending_created:
        owner = _owner(families, created)
        if owner is not None:
            _merge_samples(owner, created.samples)
        elif created.name in families:
            _merge_samples(families[created.name], created.samples)
        else:
            families[created.name] = created
    return list(families.values())


def counter_by_label(families: Iterable[Metric], family: str, label: str) -> dict[str, dict]:
    """A counter's values in a merged exposition, per model and ``label`` value:
    ``{model: {value: int}}`` (what the admin status shows as /metrics counts it, whichever
    process or Envoy counted)."""
    out: dict[str, dict[str, int]] = {}
    for metric in families:
        if metric.name != family:
            continue
        for sample in metric.samples:
            model = sample.labels.get("model")
            if sample.name.endswith("_total") and model is not None and label in sample.labels:
                per = out.setdefault(model, {})
                per[sample.labels[label]] = per.get(sample.labels[label], 0) + int(sample.value)
    return out
