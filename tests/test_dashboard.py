"""`python -m moe_comm dashboard` offline: the workspace spec it would create compares backends."""

import json

from moe_comm.__main__ import main as cli_main
from moe_comm.metrics import keys


def _panels(section):
    return {p["title"]: p for p in section["panels"]}


def test_offline_spec(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    out = tmp_path / "spec.json"
    assert cli_main(["dashboard", "--project", "P", "--recipe", "debug_cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "not saved to W&B (no W&B credentials: no WANDB_API_KEY, no `wandb login`)" in printed and str(out) in printed

    spec = json.loads(out.read_text())
    workspace = spec["workspace"]
    assert workspace["project"] == "P"
    sections = {s["name"]: s for s in workspace["sections"]}
    assert list(sections) == ["Backend comparison", "Over steps", "MoE communication"]
    bars = _panels(sections["Backend comparison"])
    assert [p["metrics"] for p in bars.values()] == [
        [keys.MFU], [keys.TPS], [keys.COMM_EXPOSED_PCT], [keys.MEM_RESERVED]
    ]
    lines = _panels(sections["MoE communication"])
    assert lines["dispatch / combine (ms per step, fwd+bwd)"]["y"] == [keys.DISPATCH_MS, keys.COMBINE_MS]
    runset = workspace["runset_settings"]
    assert runset["groupby"] == [{"name": "Group"}, {"name": "moe_comm.backend"}]
    assert "debug_cpu" in runset["filters"]
    # the wire form W&B's API would receive names the same panels
    view_text = json.dumps(spec["view"])
    assert spec["view"]["project"] == "P" and keys.COMM_EXPOSED_PCT in view_text


def test_offline_flag_never_calls_wandb(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # present, but --offline wins: no network
    out = tmp_path / "spec.json"
    assert cli_main(["dashboard", "--project", "P", "--entity", "team", "--offline", "--out", str(out)]) == 0
    assert "not saved to W&B (--offline)" in capsys.readouterr().out
    assert json.loads(out.read_text())["workspace"]["entity"] == "team"
