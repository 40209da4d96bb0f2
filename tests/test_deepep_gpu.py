"""The deepep backend on GPUs, under the nvshmem kernels' oracles (run on the device after
`python -m moe_comm build-deepep`: `pytest -m gpu`). 2 and 4 ranks; with fewer GPUs than ranks
they share the GPUs under CUDA MPS (started and stopped by tests/test_nvshmem_gpu.py's helper)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

CASES = ["layout_random_h7168_top8", "layout_one_expert_h2048_top8", "layout_zipf_h2048_top6", "layout_top1_h2048",
         "grad_h2048_top6", "grad_h7168_top8", "overlap_calls_in_flight", "overlap_microbatch_calls_in_flight"]
RANKS = [2, 4]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        pytest.fail("DeepEP is not installed here: run `python -m moe_comm build-deepep` first")
    from experiments.device_env import DEVICE_ENV, Mps

    out = Path(os.environ.get("MOE_COMM_GPU_REPORTS", tmp_path_factory.mktemp("deepep_cases")))
    out.mkdir(parents=True, exist_ok=True)
    mps = Mps()
    if max(RANKS) > torch.cuda.device_count():
        mps.start()
    env = dict(os.environ, **DEVICE_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs = {}
    try:
        for i, ranks in enumerate(RANKS):  # side by side: 6 ranks x 20 SMs fit one H200's 132
            log = open(out / f"deepep_cases_{ranks}.log", "w")
            procs[ranks] = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={ranks}",
                 "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{29650 + i}",
                 str(ROOT / "tests" / "gpu" / "deepep_cases.py"), str(out / f"deepep_cases_{ranks}.json")],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        for proc in procs.values():
            try:
                proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
    finally:
        mps.stop()
    results = {}
    for ranks in RANKS:
        path = out / f"deepep_cases_{ranks}.json"
        results[ranks] = (json.loads(path.read_text()) if path.exists()
                          else {"missing": (out / f"deepep_cases_{ranks}.log").read_text()[-8000:]})
    return results


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("ranks", RANKS)
def test_deepep_case(reports, ranks, case):
    report = reports[ranks]
    if "missing" in report:
        pytest.fail(f"the DeepEP case runner wrote no report for {ranks} ranks:\n{report['missing']}")
    assert report["world"] == ranks
    result = report["results"].get(case, "MISSING: the runner did not reach this case")
    assert result == "PASS", result
