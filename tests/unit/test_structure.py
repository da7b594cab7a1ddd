"""Outputs that are not flat tensors (lists, dicts, nesting, strings, None) are compared leaf
by leaf; a difference in structure is a failure with the reason, never a crash or a pass."""

from __future__ import annotations

import numpy as np

from guard.config import ChecksConfig
from guard.verify.pipeline import Comparator
from guard.verify.structure import flatten_outputs


def check(ref, out):
    return Comparator(ChecksConfig.model_validate({"tensor": {"atol": 1e-6, "rtol": 0.0}})).check(
        ref, out)


def test_nested_python_structures_flatten_to_named_leaves():
    value = {"boxes": [np.zeros((1, 4)), np.ones((2, 4))], "meta": {"label": "cat", "n": 3},
             "none": None, "scores": [0.5, 0.25]}
    flat = flatten_outputs(value)
    assert sorted(flat) == ["boxes.0", "boxes.1", "meta.label", "meta.n", "none", "scores"]
    assert flat["scores"].shape == (2,)


def test_equal_structures_pass_and_a_changed_leaf_fails_by_name():
    ref = {"a": [np.arange(3.0), {"b": "x", "c": 1.0}]}
    assert check(ref, {"a": [np.arange(3.0), {"b": "x", "c": 1.0}]}).passed
    changed = check(ref, {"a": [np.arange(3.0), {"b": "y", "c": 1.0}]})
    assert not changed.passed and "a.1.b: non-numeric values differ" in changed.summary()
    number = check(ref, {"a": [np.arange(3.0), {"b": "x", "c": 1.5}]})
    assert not number.passed and "a.1.c: max abs error 0.5" in number.summary()


def test_different_count_names_shapes_or_nesting_fail_with_reasons():
    ref = {"y": np.zeros((2, 3)), "z": np.zeros(2)}
    missing = check(ref, {"y": np.zeros((2, 3))})
    assert "z: primary lacks this output" in missing.summary()
    renamed = check(ref, {"y": np.zeros((2, 3)), "w": np.zeros(2)})
    assert {"w: reference lacks this output", "z: primary lacks this output"} <= set(
        renamed.summary().removeprefix("tensor: fail: ").split("; "))
    shape = check(ref, {"y": np.zeros((3, 2)), "z": np.zeros(2)})
    assert "y: shape (3, 2) != reference (2, 3)" in shape.summary()
    nested = check({"p": [np.zeros(2), np.zeros(2)]}, {"p": np.zeros((2, 2))})
    assert not nested.passed
    assert "p: reference lacks this output" in nested.summary()
    assert "p.0: primary lacks this output" in nested.summary()
    assert not check({}, {}).passed  # nothing to compare is not a pass
