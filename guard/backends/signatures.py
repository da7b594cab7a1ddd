"""Whether a primary and its reference can be compared at all, known once both are loaded.

guard compares what the two sides take and give; it never transposes or renames for them. A
layout difference (an NHWC Keras or TFLite model against an NCHW torch or ONNX one) or a naming
difference (a ``.keras``'s output layer name against its SavedModel's ``output_0``) would fail
every sample of tier 1 for a reason that is the config's, not drift: it is a load error instead,
naming both sides' shapes or names.
"""

from __future__ import annotations

from guard.errors import BackendError
from guard.protocol.tensors import TensorSpec


def _shape(spec: TensorSpec) -> str:
    return "[" + ", ".join("?" if d < 0 else str(d) for d in spec.shape) + "]"


def _compatible(a: TensorSpec, b: TensorSpec) -> bool:
    if not a.shape or not b.shape:  # a side that cannot tell (TorchScript without metadata)
        return True
    if len(a.shape) != len(b.shape):
        return False
    return all(x < 0 or y < 0 or x == y for x, y in zip(a.shape, b.shape))


def check_pair(model: str, reference, primary) -> None:
    """``reference`` and ``primary`` are ``BackendInfo``s; raises ``BackendError`` located at
    ``models[model]`` when the primary's inputs or outputs cannot be compared with the
    reference's. A side whose signature is unknown (no names) is not checked."""
    where = f"models[{model}]"
    for kind in ("inputs", "outputs"):
        ref = {s.name: s for s in getattr(reference, kind)}
        pri = {s.name: s for s in getattr(primary, kind)}
        if not ref or not pri:
            continue
        if set(ref) != set(pri):
            raise BackendError(
                f"{where}: the primary's {kind} {sorted(pri)} are not the reference's "
                f"{sorted(ref)}: guard compares tensors by name; name them alike in both "
                "models (or by the backend's naming option, where it has one)")
        for name, spec in pri.items():
            if not _compatible(spec, ref[name]):
                raise BackendError(
                    f"{where}: {kind[:-1]} '{name}' has shape {_shape(spec)} in the primary "
                    f"({primary.backend}) and {_shape(ref[name])} in the reference "
                    f"({reference.backend}): a layout difference (NHWC vs NCHW?) is the "
                    "models' own business; export both sides with one layout")


def check_fallback(model: str, primary, fallback) -> None:
    """``primary`` and ``fallback`` are ``BackendInfo``s; raises ``BackendError`` located at
    ``models[model].fallback`` where the fallback does not take the primary's inputs or give
    its outputs, by name: clients keep the names the model's metadata says (the primary's),
    and a fallback that answers under other names would break them at the moment guard
    switches (an output asked for by name would come back missing). A side whose signature is
    unknown (no names) is not checked."""
    for kind in ("inputs", "outputs"):
        ours = {s.name for s in getattr(primary, kind)}
        theirs = {s.name for s in getattr(fallback, kind)}
        if ours and theirs and ours != theirs:
            raise BackendError(
                f"models[{model}].fallback: {kind} {sorted(theirs)} differ from the primary's "
                f"{sorted(ours)}: clients keep the primary's names when guard switches; "
                "export the fallback with the same names")
