"""`python -m moe_comm report` on small synthetic runs written by the real JSONL logger."""

import json
import time

import pytest
from PIL import Image

from moe_comm.__main__ import main as cli_main
from moe_comm.metrics import keys
from moe_comm.metrics.processor import JsonlLogger


def _write_run(folder, backend, num_sms, tps, dispatch_ms, combine_ms, step_ms, recipe="debug_cpu"):
    static = {
        keys.RECIPE: recipe,
        keys.BACKEND: backend,
        keys.BACKEND_OPTIONS: {"num_sms": num_sms, "max_tokens_per_rank": 0},
        keys.DEVICE: "NVIDIA H200",
        keys.WORLD_SIZE: 2,
        keys.PEAK_DTYPE: "bf16",
        keys.LOCAL_BATCH: 2,
        keys.SEQ_LEN: 256,
    }
    jsonl = JsonlLogger(str(folder / "metrics.jsonl"), static)
    for step in range(1, 6):
        warm = step == 1  # a slow first step the medians must leave out
        jsonl.log(
            {
                keys.TPS: tps / 10 if warm else tps,
                keys.TFLOPS: tps * 0.5,
                keys.MFU: float("nan") if warm else tps / 100,
                keys.LOSS: 10.0 - step,
                keys.MEM_RESERVED: 40.0 + step,
                keys.DISPATCH_MS: dispatch_ms,
                keys.COMBINE_MS: combine_ms,
                keys.COMM_MS: dispatch_ms + combine_ms,
                keys.STEP_MS: step_ms * 10 if warm else step_ms,
                keys.COMM_EXPOSED_PCT: 100 * (dispatch_ms + combine_ms) / step_ms,
                keys.SENT_GB: 0.25,
                keys.IMBALANCE_RANK: 1.1,
            },
            step,
        )
    jsonl.close()


def test_report_two_runs(tmp_path):
    _write_run(tmp_path / "nccl_run", "nccl", 20, 1000.0, 3.0, 4.0, 100.0)
    _write_run(tmp_path / "nvshmem_run", "nvshmem", 24, 1200.0, 1.0, 1.5, 80.0)
    out = tmp_path / "report"
    # folders given in any order; nccl sorts first as the baseline
    rc = cli_main(["report", str(tmp_path / "nvshmem_run"), str(tmp_path / "nccl_run"), "--out", str(out)])
    assert rc == 0
    for name in ("report.md", "summary.json", "tps.png", "mfu.png", "comm_exposed.png",
                 "memory.png", "loss.png", "step_breakdown.png"):
        path = out / name
        assert path.is_file() and path.stat().st_size > 0, name
    assert (out / "tps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Kernels: not stated" in (out / "report.md").read_text()  # no --kernels: it says so

    rows = [line for line in (out / "report.md").read_text().splitlines() if line.startswith("| debug_cpu")]
    assert rows == [
        "| debug_cpu | nccl | b2xs256 | 1,000 | 1.000 | 500.0 | 10.00 | 7.0 | 3.00 | 4.00 | "
        "100.0 | 0.250 | 1.100 | 45.0 | 5.0000 | 3-5 |",
        "| debug_cpu | nvshmem-sm24 | b2xs256 | 1,200 | 1.200 | 600.0 | 12.00 | 3.1 | 1.00 | 1.50 | "
        "80.0 | 0.250 | 1.100 | 45.0 | 5.0000 | 3-5 |",
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert [s["steps_summarized"] for s in summary] == [[3, 4, 5], [3, 4, 5]]
    assert summary[1]["vs_nccl"] == 1.2


def test_report_without_runs_fails_clearly(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path), "--out", str(tmp_path / "r")]) == 1
    assert "no metrics.jsonl under" in capsys.readouterr().out


PNGS = ("tps.png", "mfu.png", "comm_exposed.png", "memory.png", "loss.png", "step_breakdown.png")


def test_every_png_says_what_it_shows(tmp_path):
    _write_run(tmp_path / "runs" / "a", "nccl", 20, 1000.0, 3.0, 4.0, 100.0)
    _write_run(tmp_path / "runs" / "b", "nvshmem", 24, 1200.0, 1.0, 1.5, 80.0)
    out = tmp_path / "r"
    assert cli_main(["report", str(tmp_path / "runs"), "--out", str(out), "--kernels", "abc1234"]) == 0
    today = time.strftime("%Y-%m-%d", time.gmtime())
    assert "Kernels: csrc/ of commit abc1234." in (out / "report.md").read_text()
    for name in PNGS:
        footer = Image.open(out / name).text["Description"]
        assert "recipe: debug_cpu" in footer, name
        assert "kernels: csrc/ of commit abc1234" in footer, name  # the commit whose csrc/ the runs were built from
        assert f"hardware: 2 x NVIDIA H200;  date: {today}" in footer, name
        # options that differ from [moe_comm]'s defaults, per run
        assert "[moe_comm] options: nccl: defaults;  nvshmem-sm24: num_sms=24" in footer, name


def test_one_colour_per_backend(tmp_path):
    from moe_comm import plots, report

    _write_run(tmp_path / "a", "nccl", 20, 1000.0, 3.0, 4.0, 100.0, recipe="r1")
    _write_run(tmp_path / "b", "nvshmem", 24, 1200.0, 1.0, 1.5, 80.0, recipe="r1")
    _write_run(tmp_path / "c", "nccl", 20, 900.0, 3.0, 4.0, 100.0, recipe="r2")
    runs = [report.load_run(tmp_path / x / "metrics.jsonl") for x in "abc"]
    styles = report.run_styles(runs)
    assert styles[0]["color"] == styles[2]["color"] == plots.backend_color("nccl")
    assert styles[1]["color"] == plots.backend_color("nvshmem") != styles[0]["color"]
    assert styles[0]["linestyle"] != styles[2]["linestyle"]  # same backend, another recipe
    labels = report.run_labels(runs)
    assert len(set(labels)) == 3


def test_report_goes_beside_the_runs(tmp_path, monkeypatch):
    _write_run(tmp_path / "runs" / "a", "nccl", 20, 1000.0, 3.0, 4.0, 100.0)
    _write_run(tmp_path / "runs" / "b", "nvshmem", 24, 1200.0, 1.0, 1.5, 80.0)
    monkeypatch.chdir(tmp_path)
    assert cli_main(["report", "runs/a", "runs/b"]) == 0
    assert (tmp_path / "runs" / "report" / "report.md").is_file()
    assert not (tmp_path / "report").exists()
    assert cli_main(["report", "runs/a"]) == 0
    assert (tmp_path / "runs" / "a" / "report" / "step_breakdown.png").is_file()
    summary = json.loads((tmp_path / "runs" / "report" / "summary.json").read_text())
    assert [s["run"] for s in summary] == ["../a", "../b"]  # relative: the folder can move


def test_report_without_a_shared_folder_asks_for_out(tmp_path, monkeypatch, capsys):
    _write_run(tmp_path / "a", "nccl", 20, 1000.0, 3.0, 4.0, 100.0)
    _write_run(tmp_path / "b", "nccl", 20, 1000.0, 3.0, 4.0, 100.0)
    monkeypatch.chdir(tmp_path)
    assert cli_main(["report", "a", "b"]) == 1
    assert "--out" in capsys.readouterr().out and not (tmp_path / "report").exists()


def test_report_refuses_a_jsonl_that_mixes_two_runs(tmp_path, capsys):
    """A deepep run appended to an nccl run's file must not be reported as nccl."""
    _write_run(tmp_path / "run", "nccl", 20, 1000.0, 3.0, 4.0, 100.0)
    first = (tmp_path / "run" / "metrics.jsonl").read_text()
    _write_run(tmp_path / "other", "deepep", 20, 900.0, 3.0, 4.0, 100.0)
    later = [json.loads(line) for line in (tmp_path / "other" / "metrics.jsonl").read_text().splitlines()]
    (tmp_path / "run" / "metrics.jsonl").write_text(
        first + "".join(json.dumps({**r, "step": r["step"] + 5}) + "\n" for r in later))
    assert cli_main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "r")]) == 1
    out = capsys.readouterr().out
    assert "mixes two runs" in out and "'nccl'" in out and "'deepep' at step 6" in out
