"""The comm benchmark's plot, redrawn from the committed merged JSON (no GPU): it says what it
shows (shapes, hardware, date, backend options) and draws every backend readably, the slow
ones on a log axis next to a zoom on the fast ones."""

import json
import shutil
from pathlib import Path

from PIL import Image

from in_process import run_script

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "results" / "model_inputs" / "comm_bench_h200x2.json"


def test_plot_from_the_committed_json(tmp_path):
    merged = tmp_path / "comm_bench.json"
    shutil.copy(COMMITTED, merged)
    proc = run_script(REPO / "experiments" / "bench_comm.py", "plot", str(merged), "--date", "2026-11-30",
                      "--kernels", "73fe4c2", "--png", str(tmp_path / "plot.png"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    png = Image.open(tmp_path / "plot.png")
    footer = png.text["Description"]
    assert "kernels: csrc/ of commit 73fe4c2" in footer
    assert "hardware: 2 x NVIDIA H200, torch 2.11.0+cu130;  date: 2026-11-30" in footer
    assert "dsv3_random = 4096 tokens/rank, hidden 7168, top-8, 256 experts, random routing" in footer
    assert "nvshmem num_sms 20/24/32/64" in footer and "nccl: library-managed" in footer
    assert png.size[0] > 1500  # three shapes side by side, two rows (log overview, zoom)


def test_report_records_the_date_for_later_plots(tmp_path):
    raw = REPO / "results" / "h200x2" / "raw"
    out = tmp_path / "merged.json"
    proc = run_script(REPO / "experiments" / "bench_comm.py", "report",
                      *(str(raw / f) for f in ("bench_p2p.json", "bench_main.json", "bench_symm.json")), "--json", str(out),
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads(out.read_text())
    assert len(merged["date"]) == 10  # YYYY-MM-DD: the raw files carry none, so today's
    assert Image.open(out.with_suffix(".png")).text["Description"].count(merged["date"]) == 1
