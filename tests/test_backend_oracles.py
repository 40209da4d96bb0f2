"""The "nccl" backend against the same oracles as the nvshmem kernels (tests/gpu/nvshmem_cases.py):
expert-major layout equal to a pure-torch reference, counts equal to an all-reduced histogram,
combine / fan-out = input, forward and gradients (x and routing weights) against a reference.
Two gloo processes on CPU; one launch serves every case."""

import json

import pytest

import backend_oracles_cpu
import ranks
from metrics_fakes import free_port

CASES = ["layout_random_top8_fp32", "layout_one_expert_top2_bf16", "layout_top1_fp32", "forward_backward_top6"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("oracles") / "report.json"
    ranks.spawn(backend_oracles_cpu.run_rank, args=(2, free_port(), str(out)), nprocs=2)
    assert out.exists(), "rank 0 wrote no report"
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_nccl_backend_oracle(report, case):
    assert report.get(case) == "PASS", report.get(case, "the runner did not reach this case")
