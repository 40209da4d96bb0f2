"""The nvshmem backend on real GPUs (run on the device: `pytest -m gpu`).

tests/gpu/nvshmem_cases.py runs every case in one torchrun launch per GPU count (NVSHMEM
start-up is the slow part); each case then becomes one test here.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.device_env import DEVICE_ENV  # noqa: E402  NVLink multicast off on the lent machines

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

CASES = [
    "layout_random_h7168_top8_bf16",
    "layout_random_h2048_top8_fp32",
    "layout_top1_h2048_bf16",
    "layout_one_expert_top1",
    "layout_one_expert_top8",
    "layout_256_experts_uneven",
    "layout_zero_tokens_on_last_rank",
    "grad_h2048_top6_fp32",
    "grad_h7168_top8_bf16",
    "many_calls_changing_routing",
    "capacity_overflow_raises",
    "cuda_graph_replay",
    "bad_input_errors",
]
_reports: dict[int, dict] = {}


def run_cases(num_gpus: int, tmp_dir: Path) -> dict:
    if num_gpus not in _reports:
        if torch.cuda.device_count() < num_gpus:
            pytest.fail(f"this test needs {num_gpus} GPUs; the machine has {torch.cuda.device_count()}")
        report = tmp_dir / f"nvshmem_cases_{num_gpus}.json"
        env = dict(os.environ, **DEVICE_ENV)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_gpus}",
               str(ROOT / "tests" / "gpu" / "nvshmem_cases.py"), str(report)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if not report.exists():
            pytest.fail(f"the case runner wrote no report (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        _reports[num_gpus] = json.loads(report.read_text())
    return _reports[num_gpus]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_gpus", [1, 2])
def test_nvshmem_case(num_gpus, case, tmp_path_factory):
    report = run_cases(num_gpus, tmp_path_factory.getbasetemp())
    assert report["world"] == num_gpus
    result = report["results"].get(case, "MISSING: the runner did not reach this case")
    assert result == "PASS", result
