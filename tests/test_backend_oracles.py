"""The "nccl" backend against the same oracles as the nvshmem kernels (tests/gpu/nvshmem_cases.py):
expert-major layout equal to a pure-torch reference, counts equal to an all-reduced histogram,
combine / fan-out = input, forward and gradients (x and routing weights) against a reference.
Two gloo processes on CPU; one launch serves every case."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = ["layout_random_top8_fp32", "layout_one_expert_top2_bf16", "layout_top1_fp32", "forward_backward_top6"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("oracles") / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "tests" / "backend_oracles_cpu.py"), str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.exists(), f"no report (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_nccl_backend_oracle(report, case):
    assert report.get(case) == "PASS", report.get(case, "the runner did not reach this case")
