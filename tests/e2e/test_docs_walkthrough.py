"""The walkthroughs in docs/own-model.md and docs/matrix-own-model.md, run as written: their
export script, config and matrix file are taken from the pages, so a page that drifts from what
guard does fails here (the figures on the pages are one run's; these tests hold the properties)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from guard.cli import main

ROOT = Path(__file__).resolve().parents[2]


def block(page: str, first_line: str) -> str:
    """The fenced code block of ``docs/page`` whose first line is ``first_line``."""
    text = (ROOT / "docs" / page).read_text()
    for body in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        if body.startswith(first_line):
            return body
    raise AssertionError(f"docs/{page} has no code block starting with {first_line!r}")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("walkthrough")
    (folder / "export.py").write_text(block("own-model.md", "# export.py"))
    assert block("own-model.md", "# export.py").splitlines()[1:] == \
        block("matrix-own-model.md", "# export.py").splitlines()[1:]  # one export, two pages
    result = subprocess.run([sys.executable, "export.py"], cwd=folder, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return folder


def test_the_walkthrough_config_loads_as_the_page_says(exported, capsys):
    config = exported / "guard.yaml"
    config.write_text(block("own-model.md", "# guard.yaml"))
    assert main(["config", "validate", "--load", str(config)]) == 0
    out = capsys.readouterr().out
    assert "models[net]: loads (" in out
    assert "outputs matched by position (reference -> primary): output0 -> scores" in out
    # Without the reference's input_names: the error the page quotes.
    config.write_text(config.read_text().replace(", options: {input_names: [x]}", ""))
    assert main(["config", "validate", "--load", str(config)]) == 2
    assert "the primary's inputs ['x'] are not the reference's ['input']" in \
        capsys.readouterr().err


def test_the_matrix_page_runs_as_written(exported, capsys):
    matrix = exported / "matrix.yaml"
    matrix.write_text(block("matrix-own-model.md", "# matrix.yaml"))
    out = exported / "results" / "first-run"
    main(["matrix", str(matrix), "--output-dir", str(out), "--backends", "ort_fp32,ort_int8"])
    printed = capsys.readouterr().out
    assert "inputs generated from ort_fp32's signature" in printed
    assert "ort_fp32: 4/4 checks pass" in printed  # fp32 agrees at every tolerance of the grid
    assert "(outputs matched by position: output0 -> scores)" in printed
    assert (out / "records.jsonl").is_file() and (out / "summary.md").is_file()
