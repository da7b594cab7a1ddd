"""Replay of a generative model, in its parts (the whole path with a real server and model is
tests/e2e/test_llm_replay.py): capture records read back (a damaged or newer one skipped and
counted, a probe's completion preferred, a fallback's answer left out), JSONL prompt sets, the
tier's details surviving a record, the run's figures (llama-perplexity's table, KLD by position,
the flagged completions) and how the report shows them. The reference's scores here are
synthetic distributions (numpy), the same the tier's own math tests use."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from guard.backends.scoring import ReferenceScores, top_of
from guard.capture.records import GENERATION_INPUT, PROBED_OUTPUT, generation_tensor
from guard.capture.writer import CaptureTag, CaptureWriter, PendingRecord
from guard.config import CaptureConfig, ModelConfig
from guard.errors import GuardError
from guard.observe.metrics import GuardMetrics
from guard.protocol.generation import (
    FORMAT_VERSION,
    GenerationSample,
    SamplingParams,
    TokenLogprob,
    to_dict,
)
from guard.replay.aggregate import ModelAggregate
from guard.replay.items import CHECKED, PRIMARY_ERROR, RecordOutcome
from guard.replay.prompts import DEFAULT_MAX_TOKENS, PromptStats, parse_line, read_prompts
from guard.replay.report import html, markdown
from guard.replay.source import Filters, Source
from guard.verify.generation import (
    MAX_FLAGGED,
    GenerationCheck,
    GenerationFigures,
    check_generation,
)
from guard.verify.pipeline import TierReport

MODEL = ModelConfig.model_validate({
    "name": "smol", "task": "generation",
    "primary": {"backend": "openai", "target": "http://127.0.0.1:1", "model": "smol-q2"},
    "reference": {"backend": "llama_cpp", "path": "smol.gguf"}})


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def scored_call(rng, length: int, off: float, texts=None) -> tuple[GenerationSample, object]:
    """A greedy completion with the primary's logprobs (its distribution is the reference's
    with noise of scale ``off``), and the check of it against the reference."""
    reference = _log_softmax(rng.normal(0, 2.0, (length, 40)))
    primary = _log_softmax(np.log(np.exp(reference)) + rng.normal(0, off, reference.shape))
    tokens = primary.argmax(axis=1)
    texts = texts or [f"t{t}" for t in tokens]
    sample = GenerationSample(
        model="smol", endpoint="completions", prompt="Once upon a time",
        completion_text="".join(texts), sampling=SamplingParams(temperature=0.0),
        tokens=tuple(TokenLogprob(text, float(primary[i, t]), tuple(
            (texts[i] if j == t else f"t{j}", float(primary[i, j]))
            for j in np.argsort(-primary[i])[:5])) for i, (t, text) in enumerate(zip(tokens,
                                                                                   texts))))
    top_ids, top_lp = top_of(reference.astype(np.float32))
    names = {int(t): text for t, text in zip(tokens, texts)}
    scores = ReferenceScores(
        token_ids=tuple(int(t) for t in tokens), token_texts=tuple(texts),
        top_ids=top_ids, top_logprobs=top_lp,
        top_texts=tuple(tuple(names.get(int(i), f"t{i}") for i in row[:5]) for row in top_ids),
        chosen_logprob=reference[np.arange(length), tokens].astype(np.float32),
        logprobs=reference.astype(np.float32), prompt_token_ids=(0,),
        primary_top_logprobs=tuple(np.array([reference[i, j] for j in np.argsort(
            -primary[i])[:5]], dtype=np.float64) for i in range(length)))
    return sample, check_generation(sample, scores)


# -- the tier's details in a record ---------------------------------------------------------
def test_a_checks_details_rebuild_the_check_through_json():
    rng = np.random.default_rng(1)
    _, check = scored_call(rng, 12, 1.5)
    assert check.mode == "logprobs" and not check.passed and check.first_divergence
    back = GenerationCheck.from_dict(json.loads(json.dumps(check.details())))
    for name in ("passed", "mode", "tokens", "statistic", "top1_compared", "reason"):
        assert getattr(back, name) == getattr(check, name), name
    assert math.isclose(back.mean_kld, check.mean_kld) and math.isnan(back.z)
    assert back.first_divergence.as_dict() == check.first_divergence.as_dict()
    assert back.per_token_text == check.per_token_text
    for name in ("per_token_surprise", "per_token_primary_logprob", "per_token_kld",
                 "per_token_delta_p"):
        np.testing.assert_allclose(getattr(back, name), getattr(check, name), rtol=1e-5,
                                   atol=1e-9, err_msg=name)
    with pytest.raises(ValueError, match="mode"):
        GenerationCheck.from_dict({"passed": True})


# -- the run's figures ------------------------------------------------------------------------
def test_figures_weigh_every_token_and_keep_the_flagged_completions():
    rng = np.random.default_rng(2)
    figures = GenerationFigures()
    checks = []
    for k in range(MAX_FLAGGED + 4):
        sample, check = scored_call(rng, 4 + k % 5, 1.5 if k % 2 else 0.01)
        checks.append((sample, check))
        details = check.details() | {"prompt": sample.prompt}
        figures.add(TierReport(check.passed, check.summary(), [], json.loads(json.dumps(
            details))), {"index": 100 + k, "request_id": f"r{k}", "source": "cap.gcap"})
    out = figures.as_dict()
    every = [c for _, c in checks]
    kld = np.concatenate([c.per_token_kld for c in every])
    assert out["checks"] == len(every) and out["passed"] == sum(c.passed for c in every)
    assert math.isclose(out["mean_kld"], kld.mean(), rel_tol=1e-5)
    assert out["kld_max"] >= out["kld_p999"] >= out["kld_p99"] >= out["kld_median"]
    nll_primary = np.concatenate([[-t.logprob for t in s.tokens] for s, _ in checks])
    nll_reference = np.concatenate([c.per_token_surprise for c in every])
    assert math.isclose(out["ppl_ratio"], math.exp(nll_primary.mean() - nll_reference.mean()),
                        rel_tol=1e-4)
    failing = [k for k, c in enumerate(every) if not c.passed]
    assert out["flagged_total"] == len(failing)
    assert [f["record"] for f in out["flagged"]] == [100 + k for k in failing][:MAX_FLAGGED]
    assert out["flagged"][0]["per_token"]["text"] == list(every[failing[0]].per_token_text)
    assert out["first_divergence"]["record"] == 100 + next(
        k for k, c in enumerate(every) if c.first_divergence is not None)
    positions = out["by_position"]
    assert len(positions["kld_mean"]) == max(c.tokens for c in every)
    assert positions["completions"][0] == len(every)
    assert math.isclose(positions["kld_mean"][0],
                        np.mean([c.per_token_kld[0] for c in every]), rel_tol=1e-5)


def _aggregate(rng, texts=None) -> dict:
    aggregate = ModelAggregate(MODEL, {"reference": "llama_cpp smol.gguf", "primary": "openai",
                                       "tiers": ["generation"]})
    for k, off in enumerate((1.5, 0.01, 2.0)):
        sample, check = scored_call(rng, 8, off, texts if k == 0 else None)
        details = check.details() | {"prompt": sample.prompt}
        aggregate.add(RecordOutcome(k, "smol", CHECKED, request_id=f"r{k}", tiers={
            "generation": TierReport(check.passed, check.summary(), [], details)},
            live_passed=check.passed))
    return aggregate.result()


def test_a_run_with_nothing_compared_says_why(tmp_path):
    """Every completion not comparable (here: logprobs after the transform, undeclared): the
    verdict's reason and the report's summary name the causes, by the metric's label."""
    aggregate = ModelAggregate(MODEL, {"reference": "llama_cpp smol.gguf", "primary": "openai",
                                       "tiers": ["generation"]})
    for k in range(3):
        check = GenerationCheck(passed=True, mode="not_comparable", tokens=8,
                                cause="logprobs_mode", reason="masked tokens")
        aggregate.add(RecordOutcome(k, "smol", CHECKED, request_id=f"r{k}", tiers={
            "generation": TierReport(True, check.summary(), [], check.details())},
            live_passed=True))
    model = aggregate.result()
    assert model["verdict"] == "pass"
    assert model["verdict_reason"] == ("no sample could be checked: generation: 3 not "
                                       "comparable (logprobs_mode 3)")
    assert model["tiers"]["generation"]["not_comparable_reasons"] == {"logprobs_mode": 3}
    assert "3 / 0 (logprobs_mode 3)" in markdown(_report(model))


def test_a_generative_primary_error_is_not_filed_under_the_tensor_tier():
    """An upstream that failed a replayed call: counted in ``status``, named in
    ``error_examples``; the tensor tier, which never runs for a generative model, shows none."""
    aggregate = ModelAggregate(MODEL, {"reference": "llama_cpp smol.gguf", "primary": "openai",
                                       "tiers": ["generation"]})
    aggregate.add(RecordOutcome(0, "smol", PRIMARY_ERROR, request_id="r0",
                                error="upstream answered 503"))
    model = aggregate.result()
    assert model["status"]["primary_error"] == 1
    assert [e["error"] for e in model["error_examples"]] == ["upstream answered 503"]
    assert model["tiers"]["tensor"]["primary_errors"] == 0
    assert model["tiers"]["tensor"]["checks"] == 0


def _report(model: dict) -> dict:
    return {"guard_version": "t", "verdict": model["verdict"], "exit_code": 1, "problems": [],
            "config": {"path": "guard.yaml", "hash": "h"}, "engine": {"name": "local"},
            "timing": {"seconds": 1.0, "records": 3, "records_per_second": 3.0},
            "inputs": {"files": [], "records_read": 3, "replayed": 3, "skipped_bytes": 0,
                       "skipped_regions": 0, "unreadable_records": 0, "filtered": {},
                       "stopped_at_max_records": False},
            "unknown_models": {}, "models": {"smol": model}}


def test_the_report_shows_the_summary_the_plot_and_each_flagged_completion_shaded():
    texts = ["<b>", " &", " Paris", "\n", " is", "", " a", " city"]
    model = _aggregate(np.random.default_rng(3), texts)
    g = model["tiers"]["generation"]
    assert model["verdict"] == "drift" and g["checks"] == 3 and g["flagged_total"] == 2
    assert model["thresholds"]["generation"]["max_mean_kld"] == 0.05
    page, text = html(_report(model)), markdown(_report(model))
    for shown in ("Mean PPL(Q)/PPL(base)", "99.9% KLD", "RMS Δp", "Same top p"):
        assert shown in page and shown in text
    assert "| model | samples | verdict | generation |" in text  # no tensor columns
    assert "KLD by position" in page and "<polyline" in page
    assert page.count("class='tok first'") == sum(
        f["first_divergence"] is not None for f in g["flagged"])
    # Token texts are escaped, a newline is marked, an empty token is visible.
    assert "&lt;b&gt;</span>" in page and " &amp;</span>" in page and "<b>" not in page
    assert "\u21b5\n</span>" in page and "\u2205</span>" in page
    assert "background:rgba(217, 83, 79," in page
    assert "completion: <b> & Paris\n is a city" in text


# -- capture records read back ----------------------------------------------------------------
def _call(prompt: str, route: str = "primary") -> GenerationSample:
    return GenerationSample(model="smol", endpoint="completions", prompt=prompt,
                            completion_text=" Paris", tokens=(TokenLogprob(" Paris", -0.2),),
                            sampling=SamplingParams(temperature=0.0, max_tokens=8), route=route)


def test_capture_records_come_back_as_calls_and_bad_ones_are_skipped_and_counted(tmp_path):
    writer = CaptureWriter("smol", CaptureConfig(dir=str(tmp_path)), GuardMetrics("test"), {})
    writer.start()

    def write(n: int, route: str, inputs: dict, outputs: dict | None = None) -> None:
        writer.submit(PendingRecord(CaptureTag(f"r{n}", 10**18 + n, 0.01, True), route, 0,
                                    inputs, outputs or {}))

    newer = to_dict(_call("from the future")) | {"format_version": FORMAT_VERSION + 1}
    write(0, "primary", {GENERATION_INPUT: generation_tensor(_call("one"))})
    write(1, "primary", {GENERATION_INPUT: np.array([b"{not json"], dtype=object)})
    write(2, "primary", {GENERATION_INPUT: np.array([json.dumps(newer).encode()],
                                                    dtype=object)})
    write(5, "primary", {GENERATION_INPUT: np.array([b"[" * 100_000 + b"]" * 100_000],
                                                    dtype=object)})
    write(3, "fallback", {GENERATION_INPUT: generation_tensor(_call("two", "fallback"))})
    probe = replace(_call("three"), completion_text=" Lyon", tokens=(TokenLogprob(" Lyon"),))
    write(4, "fallback", {GENERATION_INPUT: generation_tensor(_call("three", "fallback"))},
          {PROBED_OUTPUT: generation_tensor(probe)})
    writer.close()

    source = Source([str(tmp_path)], {"smol"}, Filters(), lambda m: (), None,
                    frozenset({"smol"}))
    items = list(source.items())
    assert [(i.request_id, i.generation.completion_text) for i in items] == [
        ("r0", " Paris"), ("r4", " Lyon")]  # the probe's completion was the one compared
    assert all(i.inputs == {} and not i.generate for i in items)
    stats = source.stats
    assert stats.records_read == 6 and stats.replayed == 2
    assert stats.unreadable_records == 3
    assert stats.filtered == {"no_primary_completion": 1}
    problems = " ".join(stats.files[0]["problems"])
    assert "not JSON" in problems and f"format_version: {FORMAT_VERSION + 1} is newer" in problems
    assert "nested too deep" in problems


def test_a_record_keeps_what_its_server_reported_and_the_replay_scores_with_it(tmp_path):
    """The verifier puts a llama-server's report (GET /props, the keys guard reads) into each
    capture record; read back, the call carries it, and the tier scores it with those defaults
    (a llama-server started with --temp 0.6 --top-k 20 --min-p 0, recorded), not with the
    llama.cpp preset the block's engine names: the replay scores it as the live verifier did."""
    from pathlib import Path

    from guard.verify.generation import (
        GenerationThresholds,
        GenerationTier,
        declared_defaults,
        llama_server_sampling,
    )
    from guard.verify.tiers import Compared

    recorded = json.loads((Path(__file__).parent.parent / "recorded" /
                           "llama_server_props.json").read_text())
    params = recorded["props_with_flags"]["default_generation_settings"]["params"]
    settings = llama_server_sampling(params)
    assert len(json.dumps(settings)) < len(json.dumps(params)) / 2  # (what a record carries)
    options = {"engine": "llama.cpp"}
    reported = declared_defaults(options, reported=params)
    assert declared_defaults(options, reported=settings) == reported
    assert (reported.temperature, reported.top_k, reported.min_p) == (0.6, 20, 0.0)

    # A sampled completion (no logprobs: the reference alone judges it, under the transform).
    rng = np.random.default_rng(4)
    reference = _log_softmax(rng.normal(0, 2.0, (24, 40)))
    tokens = [int(rng.choice(40, p=np.exp(row))) for row in reference]
    texts = [f"t{t}" for t in tokens]
    call = GenerationSample(model="smol", endpoint="completions", prompt="Once",
                            completion_text="".join(texts), sampling=SamplingParams(),
                            tokens=tuple(TokenLogprob(text) for text in texts))
    top_ids, top_lp = top_of(reference.astype(np.float32))
    scores = ReferenceScores(
        token_ids=tuple(tokens), token_texts=tuple(texts), top_ids=top_ids, top_logprobs=top_lp,
        top_texts=tuple(tuple(f"t{i}" for i in row[:5]) for row in top_ids),
        chosen_logprob=reference[np.arange(24), tokens].astype(np.float32),
        logprobs=reference.astype(np.float32), prompt_token_ids=(0,))

    writer = CaptureWriter("smol", CaptureConfig(dir=str(tmp_path)), GuardMetrics("test"), {})
    writer.start()
    writer.submit(PendingRecord(CaptureTag("r0", 10**18, 0.01, True), "primary", 0,
                                {GENERATION_INPUT: generation_tensor(
                                    replace(call, server_settings=settings))}, {}))
    writer.close()
    (item,) = Source([str(tmp_path)], {"smol"}, Filters(), lambda m: (), None,
                     frozenset({"smol"})).items()
    assert item.generation.server_settings == settings
    assert to_dict(item.generation)["format_version"] == 5 == FORMAT_VERSION
    assert "server_settings" not in to_dict(call)  # (nothing reported: an older version)

    tier = GenerationTier(declared_defaults(options), GenerationThresholds(), options)
    as_replayed = tier.check(Compared(scores, item.generation))
    as_live = check_generation(call, scores, reported)
    as_preset = check_generation(call, scores, declared_defaults(options))
    assert as_replayed.mode == as_live.mode == "sampled"
    assert as_replayed.statistic == as_live.statistic != as_preset.statistic
    assert tier.check(Compared(scores, call)).statistic == as_preset.statistic


# -- JSONL prompt sets ------------------------------------------------------------------------
def test_prompt_lines_become_greedy_calls_and_bad_lines_are_counted(tmp_path):
    call = parse_line('{"prompt": "The capital of France is"}', "smol", "p.jsonl:1")
    assert call.endpoint == "completions" and call.request_id == "p.jsonl:1"
    assert call.sampling.temperature == 0.0 and call.sampling.max_tokens == DEFAULT_MAX_TOKENS
    chat = parse_line(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "id": 7,
                                  "temperature": 0.7, "max_tokens": 5, "stop": ["\n"]}),
                      "smol", "x")
    assert chat.endpoint == "chat" and chat.messages[0]["content"] == "Hi"
    assert (chat.request_id, chat.sampling.temperature, chat.sampling.max_tokens,
            chat.sampling.stop) == ("7", 0.7, 5, ("\n",))
    # A text to score (llama-perplexity's way): echoed, nothing generated unless it says.
    text = parse_line('{"prompt": "Water boils at 100 degrees.", "echo": true}', "smol", "x")
    assert text.echo and text.sampling.max_tokens == 0 and not call.echo
    for line, why in (("[1]", "JSON object"), ("{", "not JSON"),
                      ('{"prompt": "a", "messages": []}', "either"), ("{}", "either"),
                      ('{"prompt": 3}', "string"), ('{"messages": [{"role": "user"}]}',
                                                    r"messages\[0\]"),
                      ('{"prompt": "a", "max_token": 3}', "unknown key 'max_token'"),
                      ('{"prompt": "a", "max_tokens": "many"}', "max_tokens"),
                      ('{"prompt": "a", "echo": "yes"}', "'echo' must be"),
                      ('{"messages": [{"role": "user", "content": "b"}], "echo": true}',
                       "only with 'prompt'"),
                      # Guard writes the request from the line: RFC 8259's JSON only.
                      ('{"prompt": "a", "temperature": NaN}', "NaN is not a JSON number"),
                      # Deeper than the interpreter's stack: one bad line, not a crash.
                      ('{"prompt": "a", "stop": ' + "[" * 100_000 + "]" * 100_000 + "}",
                       "nested too deep")):
        with pytest.raises(ValueError, match=why):
            parse_line(line, "smol", "x")
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": 1}\n{"messages": [{"role": "user", '
                    '"content": "b"}]}\n')
    stats = PromptStats()
    calls = list(read_prompts(path, "smol", stats))
    assert [c.request_id for c in calls] == ["p.jsonl:1", "p.jsonl:4"]
    assert (stats.lines, stats.records, stats.unreadable) == (3, 2, 1)
    assert stats.problems == ["line 3: 'prompt' must be a string"]


def test_a_prompt_set_goes_to_a_generative_model_only(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n')
    with pytest.raises(GuardError, match="pass --models NAME"):
        Source([str(path)], {"smol", "cnn"}, Filters(), lambda m: (), None, frozenset({"smol"}))
    with pytest.raises(GuardError, match="model 'cnn' is not one"):
        Source([str(path)], {"smol", "cnn"}, Filters(), lambda m: (), "cnn", frozenset({"smol"}))
    source = Source([str(path)], {"smol"}, Filters(), lambda m: (), "smol", frozenset({"smol"}))
    (item,) = source.items()
    assert item.generate and item.generation.prompt == "a" and item.model == "smol"
