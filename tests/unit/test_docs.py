"""The docs: the site builds strictly (a broken link fails), the README fits a page and its links
resolve, and the generated reference pages cover every metric and config section in the code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "reference"


def _env() -> dict:
    """This checkout's guard first, whatever guard the interpreter has installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    """``mkdocs build --strict`` of this checkout into a temporary folder (its hook writes the
    generated reference pages into docs/reference/ first)."""
    pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra: pip install -e '.[dev]'")
    site = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"mkdocs build --strict exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return site


def test_site_builds_strictly_with_every_page(built_site):
    for page in ("index.html", "quickstart/index.html", "reference/config/index.html",
                 "reference/metrics/index.html", "architecture/index.html"):
        assert (built_site / page).is_file(), page


def _rows(page: str) -> dict[str, str]:
    """Table rows of a generated page by their first cell (a code span)."""
    rows = {}
    for line in page.splitlines():
        m = re.match(r"\| `([^`]+)` \|", line)
        if m:
            rows.setdefault(m.group(1), line)
    return rows


def _sections(page: str) -> dict[str, str]:
    """A generated page's sections by their explicit anchor ({#name})."""
    parts = re.split(r"^## .*\{#([\w-]+)\}$", page, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_registered_metric_is_in_the_metrics_page(built_site):
    from guard.observe.metrics import GuardMetrics

    metrics = GuardMetrics("test")
    rows = _rows((REFERENCE / "metrics.md").read_text())
    families = list(metrics.registry.collect())
    assert len(families) >= 26
    for family in families:
        exposed = f"{family.name}_total" if family.type == "counter" else family.name
        assert exposed in rows, f"{exposed} is registered but not in the metrics page"
        row = rows[exposed]
        assert f"| {family.type} |" in row
        assert " ".join(family.documentation.split()) in row.replace("\\|", "|")
    for value in vars(metrics).values():
        labels = getattr(value, "_labelnames", None)
        if labels:
            name = value.describe()[0].name
            row = rows[f"{name}_total" if value._type == "counter" else name]
            for label in labels:
                assert f"`{label}`" in row, f"{name}: label {label} missing"


def test_every_config_section_is_in_the_config_page(built_site):
    schema = json.loads(subprocess.run(
        [sys.executable, "-m", "guard", "config", "schema"], cwd=REPO, env=_env(),
        capture_output=True, text=True, check=True).stdout)
    sections = _sections((REFERENCE / "config.md").read_text())
    for key in schema["properties"]:
        assert key in _rows(sections["top-level"]), f"top-level key {key} is not in the page"
    for name, definition in schema["$defs"].items():
        assert name.lower() in sections, f"section {name} is not in the config page"
        rows = _rows(sections[name.lower()])
        for key, prop in definition.get("properties", {}).items():
            assert key in rows, f"{name}.{key} is not in the config page"
            if "default" in prop:
                assert f"`{json.dumps(prop['default'])}`" in rows[key], f"{name}.{key} default"


def test_readme_fits_a_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines (at most 200)"


def test_readme_links_resolve():
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link.split("#")[0] for link in links
                if not re.match(r"[a-z]+:", link) and not link.startswith("#")]
    assert relative, "the README links to no docs page"
    for link in relative:
        assert not link.startswith("docs/reference/"), (
            f"README.md links to {link}: generated at build time, not in a fresh clone")
        assert (REPO / link).exists(), f"README.md links to {link}, which does not exist"
    assert any(link.startswith("docs/") for link in relative)


def _relative_targets(html: str) -> list[str]:
    """The href and src targets of a built page that point inside the site."""
    targets = re.findall(r'(?:href|src)="([^"]+)"', html)
    return [t.split("#")[0] for t in targets
            if not re.match(r"[a-z]+:", t) and not t.startswith(("#", "//")) and t.split("#")[0]]


def test_every_link_on_the_site_resolves_benchmark_results_included(built_site):
    """A docs page's link to a repository file (a benchmark's results) is a link on the site
    too, to a copy the build puts under repo/ (docs/repo_links.py), and nothing links nowhere."""
    broken = []
    for page in built_site.rglob("*.html"):
        if page.name == "404.html":
            continue
        for target in _relative_targets(page.read_text()):
            path = (page.parent / target).resolve()
            if path.is_dir():
                path = path / "index.html"
            if not path.exists():
                broken.append(f"{page.relative_to(built_site)} -> {target}")
    assert not broken, broken[:20]
    benchmarks = (built_site / "benchmarks/index.html").read_text()
    results = [t for t in _relative_targets(benchmarks) if "repo/benchmarks/results/" in t]
    assert len(results) >= 5, results
    summary = built_site / "repo/benchmarks/results/matrix-cpu/summary/index.html"
    assert summary.is_file()  # a results page, rendered, with its heat map beside it
    assert 'src="../heatmap.png"' in summary.read_text()
    assert (built_site / "repo/benchmarks/results/matrix-cpu/heatmap.png").is_file()


# The packages whose every module the architecture page's code map must name.
MAPPED_IN_FULL = ("serve", "verifier_process", "ipc", "runtime", "policy", "plan", "verify",
                  "protocol")


def test_the_architecture_page_names_what_exists():
    """Every repository path docs/architecture.md names exists; in its code map each module a
    folder's bullet names is in that folder, and the packages of MAPPED_IN_FULL are named in
    full (a module added or removed there changes the map)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    paths = re.findall(r"`((?:guard|tests|proto|benchmarks)/[\w./-]*)`", text)
    assert len(paths) > 50
    missing = [p for p in paths if "NAME" not in p and not (REPO / p.rstrip("/")).exists()]
    assert not missing, missing
    code_map = text[text.index("## Code map"):text.index("## Layers")]
    bullets = {m.group(1): m.group(2) for m in re.finditer(
        r"^- `guard/(\w+)/`(.*?)(?=^- |\Z)", code_map, flags=re.M | re.S)}
    assert set(MAPPED_IN_FULL) <= set(bullets), sorted(bullets)
    for package, bullet in bullets.items():
        folder = REPO / "guard" / package
        named = set(re.findall(r"`([\w]+\.(?:py|c))`", bullet))
        named |= {f"{d}/" for d in re.findall(r"`(\w+)/`", bullet)}
        for name in named:  # a module of the package or of one of its subpackages
            assert (folder / name).exists() or list(folder.rglob(name.rstrip("/"))), \
                f"the code map names guard/{package}/.../{name}, which does not exist"
        if package in MAPPED_IN_FULL:
            modules = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
            modules |= {f"{p.name}/" for p in folder.iterdir()
                        if p.is_dir() and (p / "__init__.py").exists()}
            assert not modules - named, f"guard/{package}/: not in the code map: " \
                f"{sorted(modules - named)}"
