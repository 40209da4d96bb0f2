"""experiments/one_gpu_table.py reads a call's runs as the committed table of that call says.

Run 63's four runs (results/h200x1/raw/run63/runs/*/metrics.jsonl) against the table.json the
device wrote from them: the medians, peaks and MoE phases come out the same here, and the final
loss is the last logged step's.
"""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN63 = ROOT / "results/h200x1/raw/run63"


@pytest.fixture(scope="module")
def one_gpu_table():
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import one_gpu_table
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    return one_gpu_table


def test_run63_rows_are_the_committed_table(one_gpu_table):
    committed = {r["run"]: r for r in json.loads((RUN63 / "table.json").read_text())["rows"]}
    assert sorted(committed) == ["nccl_bf16", "nccl_bf16_again", "nvshmem_fp8", "nvshmem_fp8_again"]
    for name, want in committed.items():
        got = one_gpu_table.run_row(RUN63 / "runs" / name)
        for key, value in want.items():
            assert got[key] == (pytest.approx(value) if isinstance(value, float) else value), (name, key)
    fp8 = one_gpu_table.run_row(RUN63 / "runs/nvshmem_fp8")
    last = json.loads((RUN63 / "runs/nvshmem_fp8/metrics.jsonl").read_text().splitlines()[-1])
    assert fp8["final_loss"] == last["loss_metrics/global_avg_loss"]
    assert round(fp8["final_loss"], 4) == 1.3746 and fp8["steps"] == 100


def test_the_fp8_runs_over_the_nccl_runs_of_the_same_variant(one_gpu_table):
    """Run 63: nvshmem_fp8 over nccl_bf16, nvshmem_fp8_again over nccl_bf16_again (1.197, 1.198)."""
    rows = [one_gpu_table.run_row(RUN63 / "runs" / n)
            for n in ("nccl_bf16", "nccl_bf16_again", "nvshmem_fp8", "nvshmem_fp8_again")]
    got = {(q["variant"], q["base"], q["run"]): round(q["ratio"], 3) for q in one_gpu_table.pairs(rows)}
    assert got == {("-", "nccl_bf16", "nvshmem_fp8"): 1.197, ("_again", "nccl_bf16_again", "nvshmem_fp8_again"): 1.198}
