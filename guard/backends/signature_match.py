"""Matching a reference's outputs to its primary's, once both sides are loaded.

Exporters name outputs their own way: TorchScript's are ``output0``, ``output1``... (guard's
torch backend, without a ``guard.json``), the ONNX export of the same network names them as its
author chose (``scores``), a ``.keras`` names them after its layers and its SavedModel
``output_0``. A name is not drift. So, per model, at load:

- the same names on both sides: compared by name (shapes must agree: ``signatures.check_pair``);
- names that differ, with the same number of outputs whose kinds (float, int, bool, bytes) and
  shapes agree position by position, and no name shared at two positions: the reference's
  outputs are renamed to the primary's by position (``OutputMatch.renamed``, logged and shown
  in ``guard admin status``);
- anything else: a load error, one line naming both sides' outputs.

A side that cannot tell its outputs at load (a TorchScript file without ``guard.json``) is
observed: it runs once on inputs generated from either side's signature
(guard/protocol/synthetic.py) and its answer's names, dtypes and shapes stand for its
signature. This runs where both sides meet, the verifier's checked pair (guard/verify/pair.py);
the serving process never needs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from guard.backends.base import Backend, BackendInfo
from guard.errors import BackendError
from guard.protocol.synthetic import CannotGenerate, generate_inputs
from guard.protocol.tensors import OIP_TO_NUMPY, TensorSpec, oip_datatype

_PROBE_ROWS = 1  # one row is enough to learn names, dtypes and the per-row shape


@dataclass(frozen=True)
class OutputMatch:
    """How the reference's outputs line up with the primary's: ``renamed`` maps a reference
    output's name to the primary's where they differ (empty: every name matches)."""

    renamed: dict[str, str] = field(default_factory=dict)
    observed: tuple[str, ...] = ()  # the roles whose outputs were learnt by running them

    def apply(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A reference answer under the primary's names."""
        if not self.renamed:
            return outputs
        return {self.renamed.get(name, name): value for name, value in outputs.items()}

    def rename_info(self, info: BackendInfo) -> BackendInfo:
        """The reference's ``BackendInfo`` with its outputs under the primary's names."""
        if not self.renamed:
            return info
        outputs = tuple(TensorSpec(self.renamed.get(s.name, s.name), s.datatype, s.shape)
                        for s in info.outputs)
        return BackendInfo(info.backend, info.artifact, info.precision, info.device,
                           info.inputs, outputs, dict(info.details))

    def describe(self) -> str:
        return ", ".join(f"{ref} -> {pri}" for ref, pri in self.renamed.items())


def _kind(datatype: str) -> str:
    """float, int, bool or bytes ("" unknown): an fp16 primary of an fp32 reference compares."""
    if datatype == "BYTES":
        return "bytes"
    dtype = OIP_TO_NUMPY.get(datatype)
    if dtype is None:
        return "float" if datatype == "BF16" else ""
    return {"f": "float", "b": "bool"}.get(dtype.kind, "int")


def _shapes_agree(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    if not a or not b:  # unknown on one side
        return True
    return len(a) == len(b) and all(x < 0 or y < 0 or x == y for x, y in zip(a, b))


def _agree(a: TensorSpec, b: TensorSpec) -> bool:
    kinds = _kind(a.datatype), _kind(b.datatype)
    return ("" in kinds or kinds[0] == kinds[1]) and _shapes_agree(a.shape, b.shape)


def _names(specs) -> str:
    return "[" + ", ".join(s.name for s in specs) + "]"


def match_outputs(model: str, reference: BackendInfo, primary: BackendInfo,
                  observed: tuple[str, ...] = ()) -> OutputMatch:
    """The ``OutputMatch`` of two sides' outputs, or ``BackendError`` (one line, both sides'
    names) when they cannot be matched. Sides without output names are not matched here."""
    ref, pri = reference.outputs, primary.outputs
    if not ref or not pri or {s.name for s in ref} == {s.name for s in pri}:
        return OutputMatch(observed=observed)
    ref_names, pri_names = [s.name for s in ref], [s.name for s in pri]
    why = ""
    if len(ref) != len(pri):
        why = f"{len(ref)} outputs against {len(pri)}"
    elif any(r.name != p.name and (r.name in pri_names or p.name in ref_names)
             for r, p in zip(ref, pri)):
        why = "a name both sides use sits at different positions"
    else:
        for r, p in zip(ref, pri):
            if not _agree(r, p):
                why = (f"'{r.name}' ({r.datatype or '?'} {list(r.shape)}) and '{p.name}' "
                       f"({p.datatype or '?'} {list(p.shape)}) differ in dtype or shape")
                break
    if why:
        raise BackendError(
            f"models[{model}]: the reference's outputs {_names(ref)} ({reference.backend}) "
            f"cannot be matched to the primary's {_names(pri)} ({primary.backend}): {why}; "
            "name them alike (options.output_names) or export both sides alike")
    renamed = {r: p for r, p in zip(ref_names, pri_names) if r != p}
    return OutputMatch(renamed=renamed, observed=observed)


def knows_outputs(info: BackendInfo) -> bool:
    """True when a side's outputs are named at load (TorchScript without guard.json: not)."""
    return bool(info.outputs)


def observe(backend: Backend, input_specs: tuple[TensorSpec, ...]) -> BackendInfo | None:
    """``backend``'s signature with its outputs as one run on generated inputs shows them
    (names, OIP dtypes, shapes with the batch axis unknown); None when no inputs can be
    generated from ``input_specs``."""
    try:
        inputs = generate_inputs(input_specs, _PROBE_ROWS)
    except CannotGenerate:
        return None
    answer = backend.infer(inputs)
    info = backend.describe()
    return BackendInfo(info.backend, info.artifact, info.precision, info.device, info.inputs,
                       answer_specs(answer), dict(info.details))


def answer_specs(answer: dict[str, np.ndarray]) -> tuple[TensorSpec, ...]:
    """The outputs an answer shows: names, OIP dtypes, shapes with the batch axis unknown."""
    outputs = []
    for name, value in answer.items():
        value = np.asarray(value)
        try:
            datatype = oip_datatype(value.dtype)
        except TypeError:
            datatype = ""
        shape = (-1, *value.shape[1:]) if value.ndim else ()
        outputs.append(TensorSpec(name, datatype, shape))
    return tuple(outputs)


def generatable(specs: tuple[TensorSpec, ...]) -> bool:
    """Whether inputs can be generated from ``specs`` (datatypes and per-row shapes known)."""
    try:
        generate_inputs(specs, 1)
    except CannotGenerate:
        return False
    return bool(specs)


def pair_outputs(model: str, reference: Backend, primary: Backend) -> OutputMatch:
    """Match a loaded pair's outputs (see the module docstring); observes a side that cannot
    tell its outputs, on inputs generated from whichever side's signature can generate them."""
    infos = {"reference": reference.describe(), "primary": primary.describe()}
    blind = [role for role, info in infos.items() if not knows_outputs(info)]
    if not blind:
        return match_outputs(model, infos["reference"], infos["primary"])
    specs = next((info.inputs for info in (infos["primary"], infos["reference"])
                  if generatable(info.inputs)), ())
    observed = []
    backends = {"reference": reference, "primary": primary}
    for role in blind:
        try:
            seen = observe(backends[role], specs) if specs else None
        except Exception:  # a side that cannot run generated inputs (value-sensitive ones):
            seen = None  # unmatched here; a naming difference then fails samples as errors
        if seen is not None:
            infos[role] = seen
            observed.append(role)
    return match_outputs(model, infos["reference"], infos["primary"], tuple(observed))
