"""benchmarks.plots draws the documentation's figures from the benchmarks' JSON (a smoke test: the
figures are PNG files; what they show is the benchmarks' business)."""

from __future__ import annotations

import json

import pytest

from benchmarks import plots

PNG = b"\x89PNG\r\n\x1a\n"
pytestmark = pytest.mark.unit


def test_the_accuracy_figure_is_drawn_from_resnet_paritys_report(tmp_path):
    report = {"table": "compression", "seeds": [0, 1], "training_args": ["--epochs", "3"],
              "final": {"fp16": [0.9, 0.91]}, "wall_s": {"fp16": [30, 31]},
              "curves": {"2 workers, -s 2, uncompressed": [[0.5, 0.8, 0.9], [0.6, 0.8, 0.91]],
                         "fp16": [[0.5, 0.8, 0.9], [0.6, 0.8, 0.91]], "torch DDP (gloo)": [[0.4, 0.7, 0.9], [0.5, 0.7]]}}
    (tmp_path / "parity.json").write_text(json.dumps(report))
    png = tmp_path / "accuracy.png"
    assert plots.main(["accuracy", str(tmp_path / "parity.json"), str(png)]) == 0
    assert png.read_bytes()[:8] == PNG


def test_a_wrong_call_says_how_to_call_it(capsys):
    assert plots.main(["pie"]) == 2
    assert "usage: python -m benchmarks.plots {accuracy,capped,ps_vs_ring}" in capsys.readouterr().err
