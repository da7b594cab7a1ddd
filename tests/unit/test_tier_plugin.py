"""A tier is one module plus one registration line: a toy tier declared here (``TIER``) and
registered (``register_tier``) runs in the Comparator, has its series in the metrics
exposition and its section, figures and column in the replay report."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import numpy as np
import pytest
from prometheus_client import generate_latest

from guard.config import ChecksConfig, ModelConfig
from guard.observe.metrics import GuardMetrics
from guard.replay.aggregate import ModelAggregate
from guard.replay.items import CHECKED, RecordOutcome
from guard.replay.report import markdown
from guard.verify.pipeline import Comparator, tier_reports
from guard.verify.tiers import TIER_MODULES, TierKind, detector_tiers, register_tier


# -- the toy tier: the whole of it ----------------------------------------------------------------
@dataclass
class Gap:
    """Per sample: the largest gap between the sides' sums, a continuous statistic."""

    passed: bool
    statistic: float

    def summary(self) -> str:
        return f"sum gap {self.statistic:.3g}"

    def as_dict(self) -> dict:
        return {"passed": self.passed, "statistic": self.statistic}


class SumGap:
    name = "toy"

    def check(self, sample):
        gap = max(abs(float(np.sum(sample.reference[k]) - np.sum(sample.primary[k])))
                  for k in sample.reference)
        return Gap(gap <= 0.5, gap)


class GapFigures:
    def __init__(self):
        self.values: list[float] = []

    def add(self, report, where) -> None:
        self.values.append(report.details["statistic"])

    def as_dict(self) -> dict:
        return {"mean_gap": float(np.mean(self.values)), "max_gap": max(self.values)}


TIER = TierKind("toy", build=lambda setup: SumGap(), detector=False, figures=GapFigures)


@pytest.fixture
def toy():
    register_tier("toy", __name__)  # the one registration line
    yield
    TIER_MODULES.pop("toy")


MODEL = ModelConfig.model_validate({"name": "m", "primary": {"backend": "onnxruntime",
                                                             "path": "m.onnx"}})


def test_a_registered_tier_runs_is_exposed_and_reported(toy):
    comparator = Comparator(ChecksConfig(), "generic")
    assert comparator.tiers == ("tensor", "toy")
    reference = {"y": np.zeros(4, np.float32)}
    results = [comparator.check(reference, {"y": np.full(4, v, np.float32)})
               for v in (0.0, 0.1, 1.0)]
    assert [r.tiers["toy"].passed for r in results] == [True, True, False]
    assert results[2].tiers["toy"].statistic == pytest.approx(4.0)

    metrics = GuardMetrics("t", serving=False)
    metrics.declare_model("m", comparator.tiers, detector_tiers(comparator.tiers))
    exposition = generate_latest(metrics.registry).decode()
    assert 'guard_checks_total{model="m",result="fail",tier="toy"} 0.0' in exposition
    assert 'tier="toy"' not in "\n".join(  # evidence only: no detector series
        line for line in exposition.splitlines() if line.startswith("guard_drift_ratio"))

    aggregate = ModelAggregate(MODEL, {"tiers": list(comparator.tiers)})
    for i, result in enumerate(results):
        aggregate.add(RecordOutcome(i, "m", CHECKED, tiers=tier_reports(result)))
    tiers = aggregate.result()["tiers"]
    assert list(tiers)[:2] == ["tensor", "task"] and "toy" in tiers
    assert tiers["toy"]["checks"] == 3 and tiers["toy"]["passed"] == 2
    assert tiers["toy"]["max_gap"] == pytest.approx(4.0)
    assert tiers["toy"]["mean_gap"] == pytest.approx((0.0 + 0.4 + 4.0) / 3, rel=1e-6)
    assert tiers["toy"]["failing_share"] == pytest.approx(1 / 3)
    report = {"guard_version": "t", "verdict": "pass", "exit_code": 0, "problems": [],
              "config": {"path": "/c.yaml", "hash": "h"}, "filters": {},
              "inputs": {"files": [], "records_read": 0, "replayed": 0, "skipped_bytes": 0,
                         "skipped_regions": 0, "unreadable_records": 0, "filtered": {},
                         "stopped_at_max_records": False},
              "unknown_models": {}, "models": {"m": aggregate.result()}, "generated_at": "now",
              "engine": {"name": "local", "workers": 1},
              "timing": {"seconds": 1.0, "records": 3, "records_per_second": 1.0}}
    page = markdown(json.loads(json.dumps(report)))
    header = next(line for line in page.splitlines() if line.startswith("| model"))
    assert "toy" in header and "2/3 pass" in page


def test_without_its_registration_the_tier_is_nowhere():
    assert "toy" not in Comparator(ChecksConfig(), "generic").tiers
    assert "toy" not in ModelAggregate(MODEL).result()["tiers"]


# -- a tier of another kind of sample: what the generation tier needs -----------------------------
@dataclass
class Divergence:
    passed: bool
    statistic: float  # mean KLD per token, nats: the detector's continuous input

    def summary(self) -> str:
        return f"mean KLD {self.statistic:.3g} nats/token"

    def as_dict(self) -> dict:
        return {"passed": self.passed, "kld": self.statistic}


class TokenKld:
    name = "toygen"

    def check(self, sample):
        """``reference``/``primary``: per-token distributions over a shared vocabulary (what a
        teacher-forced reference and the primary's top logprobs give)."""
        p, q = np.asarray(sample.reference), np.asarray(sample.primary)
        kld = float(np.mean(np.sum(p * np.log(p / q), axis=-1)))
        return Divergence(kld <= 0.01, kld)


GENERATION = TierKind("toygen", build=lambda setup: TokenKld(), takes="generation")


@pytest.fixture
def toygen(monkeypatch):
    import types

    module = types.ModuleType("toygen_tier")
    module.TIER = GENERATION
    monkeypatch.setitem(sys.modules, "toygen_tier", module)
    register_tier("toygen", "toygen_tier")
    yield
    TIER_MODULES.pop("toygen")


def test_a_generation_tier_judges_sampled_calls_without_tier_1(toygen):
    tensors = Comparator(ChecksConfig(), "classification")
    assert "toygen" not in tensors.tiers  # it takes another kind of sample
    calls = Comparator(ChecksConfig(), "generation")
    assert calls.tiers == ("generation", "toygen")  # after the registered generation tier
    reference = [[0.7, 0.2, 0.1], [0.5, 0.25, 0.25]]
    same = calls.check(reference, reference)
    drifted = calls.check(reference, [[0.2, 0.7, 0.1], [0.5, 0.25, 0.25]])
    assert same.passed and same.tiers["toygen"].statistic == pytest.approx(0.0)
    assert not drifted.passed and drifted.tiers["toygen"].statistic > 0.1
    # The generation tier cannot read these toy distributions: its error is a note, never the
    # sample's verdict.
    assert set(drifted.tiers) == {"toygen"}
    assert any(note.startswith("tier generation could not run") for note in drifted.notes)
    assert tier_reports(drifted)["toygen"].details["kld"] == drifted.tiers["toygen"].statistic
