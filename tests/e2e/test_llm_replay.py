"""Generative capture and replay, end to end (issue 30): a real llama.cpp server (llama-server) on
the real SmolLM2 Q2_K GGUF behind guard's OpenAI-compatible edge, called with the `openai` client;
the verifier scores every call (sample_rate 1) and capture records it; `guard replay` scores the
capture again, offline, and must reach the verdicts the sidecar reached live. Two models share
the upstream: one scored by llama.cpp's F16 of the same weights (Q2_K drifts from it), one by
the Q2_K file itself (it agrees), so the capture holds passes and failures.

Also here: a JSONL prompt set, replayed by having the primary generate (over HTTP) and the
reference score; the errors a user meets (a bad line, a primary that does not answer); the
Ray engine on the same capture; the HTML report in a real browser (headless Chromium).

Completions are short (16 tokens, 4 prompts): the point is the path, not the statistics."""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import pytest

from llm_support import free_port, start_llama_cpp_upstream, stop_llama_server
from support import metric, scrape, wait_for, write_config

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(900)

from guard.capture.inspect import summarise  # noqa: E402
from guard.capture.reader import FileStats, expand_paths, read_records  # noqa: E402
from guard.capture.records import generation_calls  # noqa: E402
from guard.cli import main  # noqa: E402
from guard.plan.serving import load_config  # noqa: E402
from guard.replay.generation_report import plain_text, shaded_html  # noqa: E402
from guard.serve.app import BackgroundServer  # noqa: E402
from guard.zoo.llm import PROMPTS, quant_ladder  # noqa: E402

CALLS = PROMPTS[:4]
MAX_TOKENS = 16
SECRET = "sk-client-secret-never-stored"
MODELS = ("drifting", "agreeing")  # scored by F16 / by the primary's own Q2_K file
CONTRACT_FIRST_DIVERGENCE = {"record", "position", "text_before", "primary_token",
                             "reference_top"}


@pytest.fixture(scope="module")
def ladder():
    return quant_ladder(("F16", "Q2_K"))


@pytest.fixture(scope="module")
def upstream(ladder, tmp_path_factory):
    server = start_llama_cpp_upstream(tmp_path_factory.mktemp("llama"), ladder["Q2_K"], "smol-q2")
    try:
        yield server
    finally:
        stop_llama_server(server)


def generation_model(name: str, url: str, reference, **extra) -> dict:
    return {"name": name, "task": "generation",
            "primary": {"backend": "openai", "target": url, "model": "smol-q2",
                        "options": {"sample_logprobs": 5, "engine": "llama.cpp"}},
            "reference": {"backend": "llama_cpp", "path": str(reference)},
            "mirror": {"sample_rate": 1.0, "timeout_s": 120},
            "policy": {"action": "alert"}, **extra}


@pytest.fixture(scope="module")
def online(upstream, ladder, tmp_path_factory):
    """The sidecar's run: every call mirrored, scored, captured; its metrics at the end."""
    folder = tmp_path_factory.mktemp("online")
    capture = {"dir": "capture", "sample_rate": 1.0}
    models = [generation_model("drifting", upstream.url, ladder["F16"], capture=capture),
              generation_model("agreeing", upstream.url, ladder["Q2_K"], capture=capture)]
    config = load_config(write_config(folder, models, http_port=0))
    with BackgroundServer(config) as server:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                               api_key=SECRET, max_retries=0, timeout=120)
        for prompt in CALLS:
            for name in MODELS:
                answer = client.completions.create(model=name, prompt=prompt,
                                                   max_tokens=MAX_TOKENS, temperature=0)
                assert answer.choices[0].logprobs is None  # guard's own, stripped

        def written(values):
            return all(metric(values, "guard_capture_records_total", model=name,
                              outcome="written") == len(CALLS) for name in MODELS)

        live = wait_for(lambda: (v := scrape(server.metrics_port)) and written(v) and v,
                        timeout=300, interval=0.2)
    return folder, live


def live_verdicts(capture_dir) -> dict[str, list[dict]]:
    """Per model, each record's call and live verdict details, in capture order."""
    out: dict[str, list[dict]] = {}
    for path in expand_paths([capture_dir]):
        for record in read_records(path, FileStats()):
            call, probed = generation_calls(record)
            (verdict,) = record.verdicts
            out.setdefault(record.model, []).append(
                {"call": call, "probed": probed, "passed": verdict.passed,
                 "details": json.loads(verdict.details_json), "mirrored": record.mirrored})
    return out


@pytest.fixture(scope="module")
def replayed(online, tmp_path_factory):
    folder, _ = online
    out = tmp_path_factory.mktemp("replay")
    code = main(["replay", "--config", str(folder / "guard.yaml"), str(folder / "capture"),
                 "--report-dir", str(out), "--quiet"])
    return code, json.loads((out / "report.json").read_text()), out


def test_capture_holds_the_call_and_its_verdict_and_no_credential(online):
    folder, live = online
    records = live_verdicts(folder / "capture")
    for name in MODELS:
        assert len(records[name]) == len(CALLS)
        for r in records[name]:
            call = r["call"]
            assert r["probed"] is None and r["mirrored"]
            assert call.prompt in CALLS and call.endpoint == "completions"
            assert call.sampling.temperature == 0 and call.sampling.max_tokens == MAX_TOKENS
            assert call.sampling.logprobs is None  # the client did not ask: guard did
            assert call.tokens and call.has_logprobs and all(t.top for t in call.tokens)
            assert "".join(t.text for t in call.tokens) == call.completion_text
            assert r["details"]["mode"] == "logprobs"
    summary = summarise([str(folder / "capture")])
    for name in MODELS:
        failed = metric(live, "guard_checks_total", model=name, tier="generation",
                        result="fail")
        assert summary["models"][name]["live_failed"] == failed
    # The client's key went to guard in its Authorization header: no record may hold it.
    for path in (folder / "capture").rglob("*.gcap"):
        data = path.read_bytes()
        assert SECRET.encode() not in data and b"Bearer" not in data


def test_replay_of_the_capture_reaches_the_live_verdicts(online, replayed):
    folder, live = online
    code, report, _ = replayed
    records = live_verdicts(folder / "capture")
    verdicts = {}
    for name in MODELS:
        m = report["models"][name]
        g = m["tiers"]["generation"]
        live_pass = metric(live, "guard_checks_total", model=name, tier="generation",
                           result="pass")
        live_fail = metric(live, "guard_checks_total", model=name, tier="generation",
                           result="fail")
        assert (g["checks"], g["passed"]) == (live_pass + live_fail, live_pass)
        agreement = m["live_agreement"]
        assert agreement["compared"] == len(CALLS)
        assert agreement["both_pass"] + agreement["both_fail"] == len(CALLS), agreement
        # The KLD itself, not only the verdicts: replay's mean over every token equals the
        # live records' token-weighted mean (the same reference file, the same tokens).
        details = [r["details"] for r in records[name]]
        live_mean = sum(d["mean_kld"] * d["tokens"] for d in details) / \
            sum(d["tokens"] for d in details)
        assert math.isclose(g["mean_kld"], live_mean, rel_tol=1e-3, abs_tol=1e-5)
        verdicts[name] = m["verdict"]
    assert verdicts == {"drifting": "drift", "agreeing": "pass"} and code == 1
    drifting = report["models"]["drifting"]["tiers"]["generation"]
    assert drifting["mean_kld"] > 0.05 > report["models"]["agreeing"]["tiers"]["generation"][
        "mean_kld"]
    first = drifting["first_divergence"]
    assert set(first) >= CONTRACT_FIRST_DIVERGENCE and len(first["reference_top"]) == 5
    assert first["primary_token"] != first["reference_top"][0][0]
    assert 0 <= first["record"] < 2 * len(CALLS)
    for key in ("kld_p99", "kld_p999", "top1_agreement", "delta_p_rms", "ppl_ratio"):
        assert drifting[key] is not None, key
    assert drifting["flagged"] and drifting["flagged_total"] == drifting["checks"] - \
        drifting["passed"]
    assert len(drifting["by_position"]["kld_mean"]) == MAX_TOKENS


def test_report_pages_show_the_completions_and_the_summary(replayed):
    _, report, out = replayed
    page = (out / "report.html").read_text()
    text = (out / "report.md").read_text()
    for shown in ("Same top p", "99.9% KLD", "Mean PPL(Q)/PPL(base)", "Flagged completions"):
        assert shown in page and shown in text, shown
    assert "class='tok first'" in page and "KLD by position" in page
    for flagged in report["models"]["drifting"]["tiers"]["generation"]["flagged"]:
        assert shaded_html(flagged) in page and plain_text(flagged) in text
    assert "first divergent token at position" in text


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium): the HTML "
                    "report is not checked in a browser here")
    return found


def screenshot(page, png, profile, width: int = 1100, height: int = 2600) -> None:
    """Headless Chromium's screenshot of a page (a fresh profile, nothing fetched)."""
    subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                    "--disable-background-networking", "--no-first-run",
                    f"--user-data-dir={profile}", "--hide-scrollbars",
                    f"--window-size={width},{height}", f"--screenshot={png}",
                    page.resolve().as_uri()], check=True, capture_output=True, timeout=120)


def test_the_html_report_renders_in_a_browser(replayed, tmp_path):
    """The page as a reader sees it: the shaded tokens and the plot are drawn (pixels of the
    shading's red and of the plot's blue), not only present in the markup."""
    Image = pytest.importorskip("PIL.Image")
    _, _, out = replayed
    png = tmp_path / "report.png"
    screenshot(out / "report.html", png, tmp_path / "profile")
    image = Image.open(png).convert("RGB")
    assert image.size == (1100, 2600)
    pixels = list(image.get_flattened_data()) if hasattr(image, "get_flattened_data") \
        else list(image.getdata())
    shaded = sum(1 for r, g, b in pixels if r > 200 and 90 < g < 215 and abs(g - b) < 20
                 and r - g > 25)
    line_blue = sum(1 for r, g, b in pixels if abs(r - 0x4a) < 25 and abs(g - 0x7e) < 25
                    and abs(b - 0xbb) < 25)
    assert shaded > 200 and line_blue > 50, (shaded, line_blue)


def test_a_prompt_set_is_generated_by_the_primary_and_scored(upstream, ladder, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": CALLS[0]}, {"prompt": CALLS[1], "max_tokens": 12, "id": "second"},
             {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12}]
    prompts.write_text("\n".join(json.dumps(line) for line in lines)
                       + "\n{\"prompt\": \"x\", \"max_token\": 3}\n\n")
    config = write_config(tmp_path, [generation_model("drifting", upstream.url, ladder["F16"])],
                          http_port=0)
    out = tmp_path / "report"
    code = main(["replay", str(config), str(prompts), "--report-dir", str(out), "--quiet"])
    report = json.loads((out / "report.json").read_text())
    g = report["models"]["drifting"]["tiers"]["generation"]
    assert g["checks"] == 3 and g["modes"] == {"logprobs": 3}
    assert g["mean_kld"] > 0.05 and code == 1  # Q2_K against F16, as the capture showed
    inputs = report["inputs"]
    assert inputs["replayed"] == 3 and inputs["unreadable_records"] == 1
    (entry,) = inputs["files"]
    assert entry["kind"] == "prompts" and "line 4: unknown key 'max_token'" in \
        entry["problems"][0]
    # The problem line and report.md say which line too, not only report.json.
    assert any("prompts.jsonl: line 4: unknown key 'max_token'" in p
               for p in report["problems"]), report["problems"]
    assert "line 4: unknown key 'max_token'" in (out / "report.md").read_text()
    assert {f["request_id"] for f in g["flagged"]} <= {"prompts.jsonl:1", "second",
                                                       "prompts.jsonl:3"}


def test_a_primary_that_does_not_answer_stops_a_prompt_set_with_one_line(ladder, tmp_path,
                                                                        capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": CALLS[0]}) + "\n")
    model = generation_model("drifting", f"http://127.0.0.1:{free_port()}", ladder["F16"])
    model["primary"]["options"]["ready_timeout_s"] = 0.5
    config = write_config(tmp_path, [model], http_port=0)
    code = main(["replay", str(config), str(prompts), "--report-dir", str(tmp_path / "r"),
                 "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "models[drifting].primary" in err[0] and "does not answer" in err[0]


def test_the_ray_engine_replays_the_capture_to_the_same_report(online, replayed, tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'guard[ray]'")
    from guard.replay.report import RUN_DEPENDENT
    from test_replay_ray import assert_same_report

    folder, _ = online
    _, local, _ = replayed
    out = tmp_path / "ray"
    code = main(["replay", "--config", str(folder / "guard.yaml"), str(folder / "capture"),
                 "--report-dir", str(out), "--engine", "ray", "--workers", "1", "--quiet"])
    remote = json.loads((out / "report.json").read_text())
    assert code == 1
    assert_same_report({k: v for k, v in remote.items() if k not in RUN_DEPENDENT},
                       {k: v for k, v in local.items() if k not in RUN_DEPENDENT})
