"""Grouping replay items into batches: same model, same input signature (names, dtypes, shape
past the first axis), up to ``batch_rows`` rows. Items of other signatures wait in their own
group, so interleaved traffic of several models or shapes still batches.

The grouping depends only on the items and ``batch_rows``, never on timing or the engine, so
every engine runs exactly the same batches (and so computes exactly the same numbers).
"""

from __future__ import annotations

from typing import Iterable, Iterator

from guard.replay.items import Batch, ReplayItem

DEFAULT_BATCH_ROWS = 64


def plan_batches(items: Iterable[ReplayItem], batch_rows: int = DEFAULT_BATCH_ROWS
                 ) -> Iterator[Batch]:
    open_groups: dict[tuple, tuple[list[ReplayItem], int]] = {}
    for item in items:
        key = (item.model, item.signature())
        group, rows = open_groups.get(key, ([], 0))
        if group and rows + item.rows > batch_rows:
            yield Batch(item.model, group)
            group, rows = [], 0
        group.append(item)
        rows += item.rows
        if rows >= batch_rows:
            yield Batch(item.model, group)
            open_groups.pop(key, None)
        else:
            open_groups[key] = (group, rows)
    for (model, _), (group, _) in open_groups.items():
        yield Batch(model, group)
