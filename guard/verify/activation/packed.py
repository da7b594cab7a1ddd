"""Units a runtime's optimiser packed into one op, and the names that list their members.

ONNX Runtime's transformer optimiser (``onnxruntime.transformers.optimizer``) fuses an
attention's three projections and its own code (scores, softmax, the heads' reshape) into one
``Attention`` node whose weight is the projections' weights concatenated along the output axis
(``[hidden, 3 * hidden]``, q then k then v) and whose bias is theirs concatenated. No module
scope survives on that node; what tells which modules it packs is its weight: column block by
column block, the weights of the modules (or of the reference graph's nodes) it replaced.

A fault changes a few percent of one member's weights, so blocks are matched within a relative
L2 distance (``PACK_TOLERANCE``): a weight perturbed by 10% is 0.1 away from its original, two
unrelated weights of the same shape about 1.4 apart (independent draws), so the match is never
ambiguous in between.

A unit's name lists its members: ``blocks.1.attn.{q,k,v}`` (torch paths, common prefix kept
once), ``layer1.0.conv1+layer1.0.bn1`` (a chain); :func:`members` reads either back.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

PACK_TOLERANCE = 0.5  # relative L2 distance within which a block is a member's weight


def pack_order(packed: np.ndarray, candidates: Sequence[tuple[str, np.ndarray]],
               tolerance: float = PACK_TOLERANCE) -> list[str] | None:
    """The labels of the candidates whose arrays, concatenated along the last axis in that
    order, make up ``packed`` (each block within ``tolerance``), or None when they do not tile
    it or fewer than two do. A label may come with several arrays (a weight and its transpose:
    the layouts ``[in, out]`` and ``[out, in]``); each label is used once."""
    packed = np.asarray(packed, dtype=np.float64)
    if packed.ndim == 0:
        return None
    width = packed.shape[-1]
    offset, order = 0, []
    while offset < width:
        best = None
        for label, array in candidates:
            if label in order or array.ndim != packed.ndim or array.shape[:-1] != packed.shape[:-1]:
                continue
            w = array.shape[-1]
            if offset + w > width:
                continue
            ref = np.asarray(array, dtype=np.float64)
            scale = float(np.linalg.norm(ref))
            if scale == 0.0:
                continue  # a zero bias matches any zero block: no evidence of membership
            distance = float(np.linalg.norm(packed[..., offset:offset + w] - ref)) / scale
            if distance < tolerance and (best is None or distance < best[0]):
                best = (distance, label, w)
        if best is None:
            return None
        order.append(best[1])
        offset += best[2]
    return order if len(order) >= 2 else None


def brace(names: Sequence[str], sep: str = ".") -> str:
    """One name for a packed unit's members: their common leading and trailing ``sep``-atoms
    once, the rest in braces (``blocks.1.attn.{q,k,v}``); joined with ``+`` where they share
    no atom or no brace form reads back unambiguously."""
    names = list(dict.fromkeys(names))
    if len(names) == 1:
        return names[0]
    parts = [n.split(sep) for n in names]
    shortest = min(len(p) for p in parts)
    lead = 0
    while lead < shortest - 1 and all(p[lead] == parts[0][lead] for p in parts):
        lead += 1
    trail = 0
    while (trail < shortest - lead - 1
           and all(p[len(p) - 1 - trail] == parts[0][len(parts[0]) - 1 - trail] for p in parts)):
        trail += 1
    middles = [sep.join(p[lead:len(p) - trail]) for p in parts]
    if (not lead and not trail or len(set(middles)) != len(middles)
            or any(not m or any(c in m for c in ",{}+") for m in middles)):
        return "+".join(names)
    head = parts[0][:lead]
    tail = parts[0][len(parts[0]) - trail:] if trail else []
    return sep.join(head + ["{" + ",".join(middles) + "}"] + tail)


_BRACED = re.compile(r"(.*)\{([^{}]*)\}(.*)")


def members(name: str) -> list[str]:
    """The members a unit's name lists: ``a+b`` and ``p.{q,k,v}`` (one brace group per part)
    expanded; a plain name is its own one member."""
    out: list[str] = []
    depth, start = 0, 0
    parts = []
    for i, c in enumerate(name):
        depth += c == "{"
        depth -= c == "}"
        if c == "+" and depth == 0:
            parts.append(name[start:i])
            start = i + 1
    parts.append(name[start:])
    for part in parts:
        match = _BRACED.fullmatch(part)
        if match:
            out += [f"{match.group(1)}{m}{match.group(3)}" for m in match.group(2).split(",")]
        else:
            out.append(part)
    return out
