"""Which torch modules an exported ONNX node came from: both exporters' scope conventions.

- The dynamo exporter (``torch.onnx.export(..., dynamo=True)``) writes the call stack on every
  node as metadata, ``pkg.torch.onnx.name_scopes``: ``['', 'layer1', 'layer1.0',
  'layer1.0.bn1', '_native_batch_norm_legit_no_training_1']``: the root, then each module
  called on the way down by its full path, then the op's own name.
- The TorchScript exporter names nodes by the same stack, one segment per module called:
  ``/layer1/layer1.0/conv1/Conv``. A segment is the module's *unqualified* name (torch.onnx's
  ``_unqualified_variable_name``: from the last non-numeric atom of the full path on), so
  ``layer1.0.conv1`` is ``conv1`` and ``layer2.0.downsample.0`` is ``downsample.0``, while
  ``layer1.0`` stays ``layer1.0`` and repeats the segment of its parent ``layer1``. A container
  that is never called (a ``ModuleList``) leaves no segment: ``/blocks.0/attn/q/MatMul``. A
  module called a second time gets a ``_1`` suffix (``relu_1``).

Joining segments with dots (``layer1.layer1.0.conv1``) is wrong for everything inside a
``Sequential``; :func:`torchscript_paths` rebuilds the full paths, checked against the torch
module's own paths where they are known.
"""

from __future__ import annotations

import ast
from collections.abc import Collection

SCOPES_KEY = "pkg.torch.onnx.name_scopes"


def unqualified(path: str) -> str:
    """The TorchScript exporter's segment for a module path (from the last non-numeric atom)."""
    atoms = path.split(".")
    for i in range(len(atoms) - 1, -1, -1):
        if not atoms[i].isnumeric():
            return ".".join(atoms[i:])
    return path


def _candidates(parent: str, segment: str) -> list[str]:
    """Full paths a segment may stand for under ``parent``: overlaps first (the segment repeats
    the tail of the parent's path, as ``layer1.0`` does under ``layer1``), then the plain join."""
    seg = segment.split(".")
    prev = parent.split(".") if parent else []
    out = []
    for j in range(min(len(prev), len(seg) - 1), 0, -1):
        if prev[len(prev) - j:] == seg[:j]:
            out.append(".".join(prev[: len(prev) - j] + seg))
    out.append(f"{parent}.{segment}" if parent else segment)
    return out


def torchscript_paths(segments: list[str], known: Collection[str] | None = None) -> list[str]:
    """Full module paths of a TorchScript node name's scope segments, outermost first.

    With ``known`` (the torch module's paths), the candidate that exists wins; a segment that
    matches no candidate falls back to the one known path with that unqualified name under the
    parent (a module called from outside its own parent), else to the structural guess."""
    paths: list[str] = []
    parent = ""
    for segment in segments:
        options = _candidates(parent, segment)
        chosen = None
        if known is not None:
            chosen = next((c for c in options if c in known), None)
            if chosen is None:
                same = [k for k in known if unqualified(k) == segment
                        and (not parent or k.startswith(parent + "."))]
                chosen = same[0] if len(same) == 1 else None
        if chosen is None:
            chosen = options[0]
        paths.append(chosen)
        parent = chosen
    return paths


def node_scopes(node, known: Collection[str] | None = None) -> list[str] | None:
    """The module paths on the call stack a node was exported from, outermost first (``[]``:
    the root module itself), or None when the node records no scope."""
    for prop in node.metadata_props:
        if prop.key == SCOPES_KEY:
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return None
            if not isinstance(scopes, list) or len(scopes) < 2:
                return None
            return [str(s) for s in scopes[1:-1] if s != ""]
    if node.name.startswith("/"):  # TorchScript exporter: /layer1/layer1.0/conv1/Conv
        segments = [part for part in node.name.split("/")[1:-1] if part]
        return torchscript_paths(segments, known)
    return None


def node_module(node, known: Collection[str] | None = None) -> str | None:
    """The innermost torch module path a node was exported from ('' = the root), or None."""
    scopes = node_scopes(node, known)
    if scopes is None:
        return None
    return scopes[-1] if scopes else ""
