"""Tier 2 offline: `guard replay` on an input set runs the same activation tier the sidecar
does and writes the first divergent layer into report.json (the CONTRACT field)."""

from __future__ import annotations

import json

import numpy as np
import yaml

from guard.cli import main
from guard.zoo.classifier import sample_inputs
from report_page import parse, target


def reading(onnx_path: str, initializer: str) -> str:
    """The name of the graph's node that reads ``initializer``."""
    import onnx

    (name,) = [n.name for n in onnx.load(onnx_path).graph.node if initializer in n.input]
    return name


def test_replay_report_names_the_first_divergent_layer(tmp_path, zoo_classifier):
    onnx = str(zoo_classifier["onnx"])
    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "models": [{
        "name": "cnn", "task": "classification",
        "primary": {"backend": "onnxruntime", "path": onnx, "precision": "int8"},
        "reference": {"backend": "onnxruntime", "path": onnx},
        "checks": {"tensor": {"atol": 0.0, "rtol": 0.05},
                   "activation": {"sample_rate": 1.0}},
    }]}))
    np.savez(tmp_path / "set.npz", image=sample_inputs(12, seed=3))
    out = tmp_path / "report"
    code = main(["replay", "--config", str(config), str(tmp_path / "set.npz"),
                 "--report-dir", str(out), "--batch-size", "1", "--quiet"])
    report = json.loads((out / "report.json").read_text())
    cnn = report["models"]["cnn"]
    assert code == 1 and cnn["verdict"] == "drift"
    activation = cnn["tiers"]["activation"]
    assert activation["checks"] == 12 and activation["passed"] == 0
    # fc1 holds the seeded weight outlier: the first layer over its allowance on any CPU (the
    # convolutions' own int8 error, ~0.5%, is far under rtol 0.05). Its node is the one that
    # reads fc1's weight, whatever name the exporter gave it.
    fc1 = reading(onnx, "fc1.weight")
    assert activation["first_divergence"]["layer"] == fc1
    assert activation["first_divergence"]["error"] > 0.05
    assert "activation" in cnn["tiers_run"]
    # The page: details as tables, the divergent layer and the failing records linked to
    # the plots that show them (html.parser, as a browser sees the structure).
    page = parse((out / "report.html").read_text())
    assert page.pre == 0
    layer = [href for href, text in page.links if text == fc1]
    assert len(layer) == 1 and f"per-layer error of the first divergence (first: {fc1})" in (
        target(page, layer[0])[1])
    failing = page.table("record", "request id", "source", "why", "plots")
    assert [int(c.text) for c in failing.column("record")] == [
        e["index"] for e in cnn["failing_examples"]]
    for cell in failing.column("plots"):
        shown = [target(page, href) for href in cell.links]
        assert "logits: max abs error per sample (12 samples)" in shown[0][1]
        assert shown[1] == target(page, layer[0])


def test_replay_torch_reference_vs_onnx_export_names_the_nested_leaf(tmp_path):
    """The way a new user deploys: the eager module as reference (``module:factory``), its
    ONNX export (TorchScript exporter, opset 17) as the primary, made from a copy with one
    projection perturbed by 2%. The report names that projection, inside its block's Sequential,
    not the container around it."""
    from guard.zoo import layouts

    inputs = layouts.encoder_inputs(6, seed=2)
    broken = layouts.perturbed(layouts.encoder(0), "blocks.1.attn.q", 0.02, seed=1)
    primary = layouts.export(broken, tmp_path / "encoder.onnx", inputs)
    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "models": [{
        "name": "encoder",
        "primary": {"backend": "onnxruntime", "path": str(primary)},
        "reference": {"backend": "torch", "path": "guard.zoo.layouts:encoder"},
        "checks": {"activation": {"on_failure": True}},
    }]}))
    np.savez(tmp_path / "set.npz", **inputs)
    out = tmp_path / "report"
    code = main(["replay", "--config", str(config), str(tmp_path / "set.npz"),
                 "--report-dir", str(out), "--batch-size", "2", "--quiet"])
    report = json.loads((out / "report.json").read_text())
    encoder = report["models"]["encoder"]
    assert code == 1 and encoder["verdict"] == "drift"
    activation = encoder["tiers"]["activation"]
    assert activation["checks"] == 3 and activation["passed"] == 0
    assert activation["first_divergence"]["layer"] == "blocks.1.attn.q"
    assert set(activation["first_divergence_layers"]) == {"blocks.1.attn.q"}
