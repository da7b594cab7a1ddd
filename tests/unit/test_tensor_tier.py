"""Tier 1 (guard/verify/tensor.py) and the Comparator's per-output tolerances."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from guard.config import ChecksConfig
from guard.verify import tensor
from guard.verify.pipeline import Comparator
from guard.verify.tensor import (
    OutputCheck,
    TensorCheck,
    Tolerance,
    compare_output,
    compare_outputs,
)

ZERO = Tolerance(atol=0.0, rtol=0.0)


@pytest.fixture(autouse=True)
def every_pass_gets_statistics(monkeypatch):
    """The tests below check the statistics of passes: sample every one (the sampling itself
    is tested at the end of this file)."""
    monkeypatch.setattr(tensor, "PASS_STATS_EVERY", 1)


def f64(*values) -> np.ndarray:
    return np.array(values, dtype=np.float64)


# -- verdicts --------------------------------------------------------------------------------------
def test_identical_passes_with_zero_tolerance():
    ref = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    check = compare_output("y", ref, ref.copy(), ZERO)
    assert check.passed and check.reason == ""
    assert check.name == "y"
    assert check.max_abs == 0.0 and check.mean_abs == 0.0 and check.p99_abs == 0.0
    assert check.max_rel == 0.0 and check.min_rtol == 0.0
    assert check.cosine_distance == pytest.approx(0.0, abs=1e-12)
    assert check.nonfinite_mismatch == 0


def test_error_exactly_at_atol_boundary_passes():
    check = compare_output("y", f64(0.0, 2.0), f64(0.5, 2.0), Tolerance(atol=0.5, rtol=0.0))
    assert check.max_abs == 0.5
    assert check.allowed == 0.5
    assert check.passed


def test_error_just_over_atol_fails():
    over = np.nextafter(0.5, 1.0)
    check = compare_output("y", f64(0.0, 2.0), f64(over, 2.0), Tolerance(atol=0.5, rtol=0.0))
    assert not check.passed
    assert "max abs error" in check.reason and "allowed" in check.reason


def test_boundary_with_atol_plus_rtol_times_max_ref():
    # allowed = 0.25 + 0.0625 * max|ref| (= 4) = 0.5, all exact in binary.
    tol = Tolerance(atol=0.25, rtol=0.0625)
    ref = f64(1.0, -4.0, 2.0)
    at = compare_output("y", ref, f64(1.0, -4.5, 2.0), tol)
    assert at.ref_max_abs == 4.0  # max of |ref|, sign ignored
    assert at.allowed == 0.5
    assert at.max_abs == 0.5
    assert at.passed
    over = compare_output("y", ref, f64(1.0, np.nextafter(-4.5, -5.0), 2.0), tol)
    assert not over.passed


def test_rtol_scales_with_max_abs_of_reference():
    tol = Tolerance(atol=0.0, rtol=0.01)
    # An error of 0.5 anywhere is fine when max|ref| is 100 (allowed 1.0) ...
    big = compare_output("y", f64(100.0, 0.0), f64(100.0, 0.5), tol)
    assert big.passed and big.allowed == pytest.approx(1.0)
    # ... and not when max|ref| is 10 (allowed 0.1).
    small = compare_output("y", f64(10.0, 0.0), f64(10.0, 0.5), tol)
    assert not small.passed and small.allowed == pytest.approx(0.1)


def test_rtol_uses_reference_not_candidate():
    tol = Tolerance(atol=0.0, rtol=0.5)
    # ref max is 1 -> allowed 0.5; the candidate's large value must not widen the tolerance.
    check = compare_output("y", f64(1.0), f64(3.0), tol)
    assert check.ref_max_abs == 1.0
    assert not check.passed


def test_shape_mismatch_fails_without_crash():
    check = compare_output("y", np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32), ZERO)
    assert not check.passed
    assert "shape" in check.reason and "(3, 2)" in check.reason and "(2, 3)" in check.reason
    assert check.max_abs == math.inf


def test_shape_mismatch_same_size_broadcastable():
    check = compare_output("y", np.zeros((1, 3)), np.zeros((3,)), Tolerance(1.0, 1.0))
    assert not check.passed and "shape" in check.reason


def test_dtype_mismatch_fails_even_when_values_equal():
    ref = np.array([1.0, 2.0], np.float32)
    check = compare_output("y", ref, ref.astype(np.float16), Tolerance(1.0, 1.0))
    assert not check.passed
    assert "dtype" in check.reason and "float16" in check.reason and "float32" in check.reason
    assert check.max_abs == 0.0  # still measured


# -- NaN / Inf -------------------------------------------------------------------------------------
def test_nan_on_candidate_only_fails():
    check = compare_output("y", f64(1.0, 2.0), f64(1.0, np.nan), Tolerance(1.0, 1.0))
    assert not check.passed
    assert check.nonfinite_mismatch == 1
    assert "NaN/Inf" in check.reason


def test_nan_on_reference_only_fails():
    check = compare_output("y", f64(np.nan, 2.0), f64(1.0, 2.0), Tolerance(1.0, 1.0))
    assert not check.passed and check.nonfinite_mismatch == 1


def test_nan_at_same_position_passes_and_is_excluded_from_stats():
    ref = f64(np.nan, 1.0, 3.0)
    out = f64(np.nan, 1.5, 3.0)
    check = compare_output("y", ref, out, Tolerance(atol=0.5, rtol=0.0))
    assert check.passed
    assert check.nonfinite_mismatch == 0
    assert check.max_abs == 0.5  # finite, not NaN
    assert check.mean_abs == pytest.approx(0.25)  # over the two finite positions only
    assert check.ref_max_abs == 3.0
    for value in (check.max_abs, check.mean_abs, check.p99_abs, check.max_rel,
                  check.cosine_distance, check.min_rtol):
        assert math.isfinite(value)


def test_nan_positions_differ():
    check = compare_output("y", f64(np.nan, 1.0), f64(1.0, np.nan), Tolerance(10.0, 10.0))
    assert not check.passed and check.nonfinite_mismatch == 2


def test_plus_inf_vs_minus_inf_fails():
    check = compare_output("y", f64(np.inf, 1.0), f64(-np.inf, 1.0), Tolerance(1.0, 1.0))
    assert not check.passed and check.nonfinite_mismatch == 1


def test_inf_vs_finite_fails():
    check = compare_output("y", f64(np.inf), f64(1e308), Tolerance(math.inf, 0.0))
    assert not check.passed and check.nonfinite_mismatch == 1


def test_inf_vs_nan_fails():
    check = compare_output("y", f64(np.inf), f64(np.nan), Tolerance(1.0, 1.0))
    assert not check.passed and check.nonfinite_mismatch == 1


@pytest.mark.parametrize("inf", [np.inf, -np.inf])
def test_inf_same_sign_passes(inf):
    check = compare_output("y", f64(inf, 2.0), f64(inf, 2.0), ZERO)
    assert check.passed
    assert check.max_abs == 0.0 and check.ref_max_abs == 2.0  # inf excluded from stats


def test_all_nonfinite_matching():
    check = compare_output("y", f64(np.nan, np.inf), f64(np.nan, np.inf), ZERO)
    assert check.passed and check.max_abs == 0.0 and check.ref_max_abs == 0.0


# -- empty, integer, bool --------------------------------------------------------------------------
def test_empty_tensors_pass():
    check = compare_output("y", np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32), ZERO)
    assert check.passed
    assert check.max_abs == 0.0 and check.mean_abs == 0.0 and check.min_rtol == 0.0


def test_empty_vs_nonempty_fails():
    check = compare_output("y", np.zeros((0, 3)), np.zeros((1, 3)), ZERO)
    assert not check.passed and "shape" in check.reason


def test_integer_outputs_equal_pass():
    ref = np.array([[1, 2, 3]], np.int64)
    assert compare_output("idx", ref, ref.copy(), ZERO).passed


def test_integer_outputs_differ_fail():
    check = compare_output("idx", np.array([1, 2, 3], np.int32), np.array([1, 2, 4], np.int32),
                           Tolerance(atol=0.5, rtol=0.0))
    assert not check.passed
    assert check.max_abs == 1.0


def test_int8_difference_does_not_wrap_around():
    check = compare_output("q", np.array([-128], np.int8), np.array([127], np.int8), ZERO)
    assert check.max_abs == 255.0
    assert not check.passed


def test_uint8_difference_does_not_wrap_around():
    check = compare_output("q", np.array([0], np.uint8), np.array([255], np.uint8),
                           Tolerance(atol=254.0, rtol=0.0))
    assert check.max_abs == 255.0
    assert not check.passed


def test_integer_within_tolerance_passes():
    check = compare_output("q", np.array([10, 20], np.int32), np.array([11, 20], np.int32),
                           Tolerance(atol=1.0, rtol=0.0))
    assert check.passed and check.max_abs == 1.0


def test_bool_outputs():
    ref = np.array([True, False, True])
    assert compare_output("mask", ref, ref.copy(), ZERO).passed
    flipped = compare_output("mask", ref, np.array([True, True, True]), Tolerance(1e-4, 1e-3))
    assert not flipped.passed
    assert flipped.max_abs == 1.0


def test_bool_vs_int_is_dtype_mismatch():
    check = compare_output("mask", np.array([True, False]), np.array([1, 0], np.uint8),
                           Tolerance(1.0, 1.0))
    assert not check.passed and "dtype" in check.reason


def test_non_numeric_outputs_are_compared_for_equality():
    # Strings get no tolerance: equal passes, any difference fails with a reason.
    same = compare_output("s", np.array(["a", "b"]), np.array(["a", "b"]), ZERO)
    assert same.passed and same.max_abs == 0.0
    check = compare_output("s", np.array(["a", "b"]), np.array(["a", "c"]), Tolerance(1.0, 1.0))
    assert not check.passed
    assert "non-numeric values differ" in check.reason
    assert check.max_abs == math.inf


# -- statistics on a hand-computed example --------------------------------------------------------
def test_statistics_hand_computed():
    ref = f64(1.0, -2.0, 3.0, 4.0)
    out = f64(1.5, -2.0, 2.0, 4.0)
    # |out - ref| = [0.5, 0, 1, 0]
    check = compare_output("y", ref, out, Tolerance(atol=0.1, rtol=0.2))
    assert check.max_abs == pytest.approx(1.0)
    assert check.mean_abs == pytest.approx(0.375)
    # numpy linear percentile over sorted [0, 0, 0.5, 1]: index 0.99 * 3 = 2.97
    assert check.p99_abs == pytest.approx(0.5 + 0.97 * 0.5)
    # relative errors [0.5/1, 0/2, 1/3, 0/4]
    assert check.max_rel == pytest.approx(0.5)
    dot = 1.5 * 1 + (-2) * (-2) + 2 * 3 + 4 * 4  # 27.5
    norms = math.sqrt(1.5**2 + 4 + 4 + 16) * math.sqrt(1 + 4 + 9 + 16)
    assert check.cosine_distance == pytest.approx(1.0 - dot / norms)
    assert check.ref_max_abs == pytest.approx(4.0)
    assert check.allowed == pytest.approx(0.1 + 0.2 * 4.0)
    assert check.min_rtol == pytest.approx(1.0 / 4.0)
    assert not check.passed  # 1.0 > 0.9
    # min_rtol really is the smallest rtol that passes with atol=0
    assert compare_output("y", ref, out, Tolerance(0.0, check.min_rtol)).passed
    assert not compare_output("y", ref, out, Tolerance(0.0, check.min_rtol * 0.999)).passed


def test_float16_statistics_past_256_match_float32s():
    """Squares of float16 values past 256 overflow float16 (65504): the cosine distance read
    0.0 (inf, then NaN, then max(0, nan)) for two nearly opposite vectors."""
    ref, out = [-280.0, 300.0, 10.0, 5.0], [300.0, -280.0, 10.0, 5.0]
    half = compare_output("y", np.array(ref, np.float16), np.array(out, np.float16), ZERO)
    single = compare_output("y", np.array(ref, np.float32), np.array(out, np.float32), ZERO)
    assert half.cosine_distance == pytest.approx(single.cosine_distance, rel=1e-6)
    assert half.cosine_distance > 1.9


def test_statistics_as_dict():
    check = compare_output("y", f64(1.0, 2.0), f64(1.0, 2.5), ZERO)
    d = check.as_dict()
    assert d["name"] == "y" and d["passed"] is False
    assert d["max_abs"] == pytest.approx(0.5)
    assert set(d) >= {"mean_abs", "p99_abs", "max_rel", "cosine_distance", "min_rtol", "reason"}


def test_cosine_distance_opposite_and_zero_vectors():
    opposite = compare_output("y", f64(1.0, 2.0), f64(-1.0, -2.0), Tolerance(10.0, 0.0))
    assert opposite.cosine_distance == pytest.approx(2.0)
    zeros = compare_output("y", f64(0.0, 0.0), f64(0.0, 0.0), ZERO)
    assert zeros.cosine_distance == 0.0 and zeros.passed


def test_max_rel_ignores_reference_zeros_and_min_rtol_infinite():
    check = compare_output("y", f64(0.0, 0.0), f64(0.0, 1e-3), Tolerance(atol=1e-2, rtol=0.0))
    assert check.passed  # atol covers it
    assert check.max_rel == 0.0  # no reference value to be relative to
    assert check.min_rtol == math.inf  # no rtol passes with atol = 0 when max|ref| = 0


def test_p99_with_many_values():
    ref = np.zeros(1000)
    out = np.zeros(1000)
    out[-1] = 100.0  # one outlier
    check = compare_output("y", ref, out, Tolerance(1000.0, 0.0))
    assert check.max_abs == 100.0
    assert check.p99_abs < 1.0  # the single outlier sits above the 99th percentile
    assert check.mean_abs == pytest.approx(0.1)


# -- compare_outputs -------------------------------------------------------------------------------
def test_compare_outputs_all_pass():
    ref = {"a": f64(1.0), "b": f64(2.0)}
    result = compare_outputs(ref, {"a": f64(1.0), "b": f64(2.0)}, ZERO)
    assert isinstance(result, TensorCheck)
    assert result.passed
    assert [o.name for o in result.outputs] == ["a", "b"]
    assert result.failures == []
    assert result.summary().startswith("pass")


def test_compare_outputs_one_failing_fails_all():
    result = compare_outputs({"a": f64(1.0), "b": f64(2.0)}, {"a": f64(1.0), "b": f64(3.0)}, ZERO)
    assert not result.passed
    assert [o.name for o in result.failures] == ["b"]
    assert result.max_abs_error == 1.0
    assert result.summary().startswith("fail: b: ")


def test_output_missing_in_candidate():
    result = compare_outputs({"a": f64(1.0), "b": f64(2.0)}, {"a": f64(1.0)}, ZERO)
    assert not result.passed
    (failure,) = result.failures
    assert failure.name == "b"
    assert "primary lacks" in failure.reason
    assert result.max_abs_error == 0.0  # inf of the missing output is not a number to report


def test_output_missing_in_reference():
    result = compare_outputs({"a": f64(1.0)}, {"a": f64(1.0), "extra": f64(2.0)}, ZERO)
    assert not result.passed
    (failure,) = result.failures
    assert failure.name == "extra"
    assert "reference lacks" in failure.reason
    assert "extra: reference lacks" in result.summary()


def test_no_outputs_is_not_a_pass():
    assert not compare_outputs({}, {}, ZERO).passed


def test_per_output_tolerance_in_compare_outputs():
    ref = {"a": f64(1.0), "b": f64(1.0)}
    out = {"a": f64(1.5), "b": f64(1.5)}
    result = compare_outputs(ref, out, ZERO, {"b": Tolerance(atol=1.0, rtol=0.0)})
    by_name = {o.name: o for o in result.outputs}
    assert not by_name["a"].passed
    assert by_name["b"].passed
    assert by_name["b"].allowed == 1.0


def test_max_abs_error_over_outputs():
    check = TensorCheck(True, [OutputCheck("a", True, max_abs=0.1),
                               OutputCheck("b", True, max_abs=0.3),
                               OutputCheck("c", False, max_abs=math.inf)])
    assert check.max_abs_error == pytest.approx(0.3)


# -- Comparator with a ChecksConfig ----------------------------------------------------------------
def test_verifier_uses_default_tolerances():
    comparator = Comparator(ChecksConfig.model_validate({"tensor": {"atol": 0.1, "rtol": 0.0}}))
    assert comparator.check({"y": f64(1.0)}, {"y": f64(1.1 - 1e-9)}).passed
    assert not comparator.check({"y": f64(1.0)}, {"y": f64(1.2)}).passed


def test_verifier_per_output_override_falls_back_to_defaults_for_the_rest():
    checks = ChecksConfig.model_validate(
        {"tensor": {"atol": 0.01, "rtol": 0.0,
                    "outputs": {"logits": {"atol": 1.0}, "probs": {"rtol": 0.5}}}}
    )
    comparator = Comparator(checks)
    assert comparator.default == Tolerance(0.01, 0.0)
    assert comparator.per_output["logits"] == Tolerance(1.0, 0.0)  # rtol inherited
    assert comparator.per_output["probs"] == Tolerance(0.01, 0.5)  # atol inherited

    ref = {"logits": f64(10.0), "probs": f64(1.0), "other": f64(1.0)}
    out = {"logits": f64(10.9), "probs": f64(1.4), "other": f64(1.4)}
    result = comparator.check(ref, out)
    by_name = {o.name: o for o in result.outputs}
    assert by_name["logits"].passed  # 0.9 <= 1.0
    assert by_name["probs"].passed  # 0.4 <= 0.01 + 0.5 * 1
    assert not by_name["other"].passed  # 0.4 > 0.01
    assert not result.passed
    assert by_name["other"].allowed == pytest.approx(0.01)


def test_verifier_override_can_be_stricter():
    checks = ChecksConfig.model_validate(
        {"tensor": {"atol": 1.0, "rtol": 0.0, "outputs": {"y": {"atol": 0.0}}}}
    )
    result = Comparator(checks).check({"y": f64(1.0), "z": f64(1.0)},
                                    {"y": f64(1.5), "z": f64(1.5)})
    assert [o.name for o in result.failures] == ["y"]


def test_verifier_default_checks_config():
    comparator = Comparator(ChecksConfig())
    ref = {"y": np.ones((2, 3), np.float32)}
    assert comparator.check(ref, {"y": ref["y"] + np.float32(1e-5)}).passed
    assert not comparator.check(ref, {"y": ref["y"] + np.float32(1e-2)}).passed


# -- one-pass verdict, statistics for failures and a sample of passes ------------------------------
@pytest.mark.parametrize("size", [7, 4096, tensor._CHUNK + 3, 3 * tensor._CHUNK])
@pytest.mark.parametrize("scale", [1e-7, 1e-3, 1e-1])
def test_fast_verdict_agrees_with_full_statistics(size, scale):
    rng = np.random.default_rng(size)
    ref = rng.standard_normal(size).astype(np.float32)
    out = (ref + scale * rng.standard_normal(size)).astype(np.float32)
    tol = Tolerance(1e-4, 1e-3)
    fast = compare_output("y", ref, out, tol, stats=False)
    full = compare_output("y", ref, out, tol, stats=True)
    assert fast.passed == full.passed
    assert fast.max_abs == full.max_abs and fast.ref_max_abs == full.ref_max_abs
    assert fast.allowed == full.allowed and fast.min_rtol == full.min_rtol
    assert full.stats and not math.isnan(full.p99_abs)
    if not fast.passed:  # a failure always carries its statistics
        assert fast.stats and fast.p99_abs == full.p99_abs


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_in_a_late_chunk_takes_the_full_path(bad):
    ref = np.zeros(3 * tensor._CHUNK, dtype=np.float32)
    out = ref.copy()
    out[-5] = bad
    check = compare_output("y", ref, out, Tolerance(1.0, 1.0), stats=False)
    assert not check.passed and check.nonfinite_mismatch == 1 and check.stats
    both = ref.copy()
    both[-5] = bad
    same = compare_output("y", both, both.copy(), ZERO, stats=False)
    assert same.passed  # NaN/Inf at the same place on both sides


def test_passes_get_statistics_first_and_then_one_in_n(monkeypatch):
    monkeypatch.setattr(tensor, "PASS_STATS_EVERY", 4)
    monkeypatch.setattr(tensor, "_passes_seen", 0)
    ref = np.linspace(-1, 1, 100, dtype=np.float32)
    checks = [compare_output("y", ref, ref + np.float32(1e-6), Tolerance(1e-4, 0.0))
              for _ in range(8)]
    assert [c.stats for c in checks] == [True, False, False, False] * 2
    skipped = checks[1]
    assert skipped.passed and math.isnan(skipped.p99_abs) and math.isnan(skipped.cosine_distance)
    assert skipped.max_abs == checks[0].max_abs and skipped.allowed == checks[0].allowed
    failing = compare_output("y", ref, ref + np.float32(1.0), Tolerance(1e-4, 0.0))
    assert not failing.passed and failing.stats and failing.mean_abs > 0


# -- the one-pass kernel (guard/verify/_verdict.c) against numpy, exactly -------------------------
if os.environ.get("GUARD_REQUIRE_KERNEL"):  # .ci/run: a build without it is a failure there
    from guard.verify import _verdict as kernel
else:
    kernel = pytest.importorskip("guard.verify._verdict",
                                 reason="the C kernel is not built here (no C compiler?)")


def _numpy_pair(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.abs(a - b).max()), float(np.abs(b).max())


def _same(x: tuple[float, float], y: tuple[float, float]) -> bool:
    """Equal, NaN included (a NaN must come back as NaN, not as some number)."""
    return all((math.isnan(p) and math.isnan(q)) or p == q for p, q in zip(x, y))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [1, 2, 7, 8, 9, 31, 33, 1000, tensor._CHUNK + 5])
def test_kernel_equals_numpy_bit_for_bit(dtype, size):
    rng = np.random.default_rng(size)
    for scale in (1e-30, 1e-6, 1.0, 1e30):
        b = (scale * rng.standard_normal(size)).astype(dtype)
        a = (b + scale * 1e-3 * rng.standard_normal(size)).astype(dtype)
        assert kernel.max_abs_pair(a, b) == _numpy_pair(a, b)
    # the extremes: subnormals, signed zeros, the largest finite values (a - b overflows to Inf)
    tiny, big = np.finfo(dtype).smallest_subnormal, np.finfo(dtype).max
    specials = np.array([0.0, -0.0, tiny, -tiny, big, -big, 1.0], dtype=dtype)
    a = np.resize(specials, size)
    b = np.resize(specials[::-1], size)
    assert _same(kernel.max_abs_pair(a, b), _numpy_pair(a, b))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("where", [0, 5, -1])
@pytest.mark.parametrize("bad", [np.nan, -np.nan, np.inf, -np.inf])
def test_kernel_propagates_nan_and_inf(dtype, where, bad):
    size = 37
    for side in ("a", "b", "both"):
        a, b = np.ones(size, dtype), np.ones(size, dtype)
        if side in ("a", "both"):
            a[where] = bad
        if side in ("b", "both"):
            b[where] = bad
        got, want = kernel.max_abs_pair(a, b), _numpy_pair(a, b)
        assert _same(got, want), (side, got, want)
        assert not (math.isfinite(got[0]) and math.isfinite(got[1]))  # sends to the full path


def test_kernel_refuses_what_it_cannot_read():
    f32 = np.ones(4, np.float32)
    with pytest.raises(TypeError):
        kernel.max_abs_pair(f32.astype(np.float16), f32.astype(np.float16))
    with pytest.raises(TypeError):
        kernel.max_abs_pair(f32, f32.astype(np.float64))
    with pytest.raises(ValueError):
        kernel.max_abs_pair(f32, np.ones(5, np.float32))
    with pytest.raises(ValueError):
        kernel.max_abs_pair(f32[:0], f32[:0])
    with pytest.raises((ValueError, BufferError)):
        kernel.max_abs_pair(np.ones(8, np.float32)[::2], f32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_verdict_paths_agree(dtype, monkeypatch):
    """The kernel and the numpy chunks give one verdict and the same figures; float16, which
    the kernel does not take, goes to numpy; a strided output never reaches the kernel."""
    rng = np.random.default_rng(1)
    ref = rng.standard_normal(3 * tensor._CHUNK + 11).astype(dtype)
    out = (ref + rng.standard_normal(ref.size).astype(dtype) * dtype(1e-3)).astype(dtype)
    tol = Tolerance(1e-4, 1e-3)
    with_kernel = compare_output("y", ref, out, tol, stats=False)
    strided = compare_output("y", ref[::2], out[::2], tol, stats=False)
    monkeypatch.setattr(tensor, "_kernel", None)
    without = compare_output("y", ref, out, tol, stats=False)
    assert (with_kernel.passed, with_kernel.max_abs, with_kernel.ref_max_abs) == (
        without.passed, without.max_abs, without.ref_max_abs)
    assert strided.max_abs == compare_output("y", ref[::2], out[::2], tol, stats=False).max_abs
