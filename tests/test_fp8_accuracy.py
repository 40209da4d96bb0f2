"""experiments/fp8_accuracy.py draws every row and sample from its seeded generator, so its
recorded figures (results/fp8_dispatch_accuracy.json) come back the same when run again: its
Student-t rows and its p99 subsample were once drawn unseeded, and a change of the quantiser
could not be told from a new draw."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script(monkeypatch):
    spec = importlib.util.spec_from_file_location("fp8_accuracy", ROOT / "experiments/fp8_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # rows enough that the p99 takes its subsample (over 16M kept elements is the script's cut)
    monkeypatch.setattr(module, "TOKENS", 2304)
    return module


def test_two_runs_give_the_same_figures(tmp_path, monkeypatch, capsys):
    script = _script(monkeypatch)
    runs = []
    for name in ("a.json", "b.json"):
        script.main(tmp_path / name)
        doc = json.loads((tmp_path / name).read_text())
        runs.append({k: doc[k] for k in ("distributions", "bf16_of_fp32_reference")})
    assert runs[0] == runs[1]
    assert set(runs[0]["distributions"]) == {"normal", "normal_with_outlier_channels", "rmsnormed"}
