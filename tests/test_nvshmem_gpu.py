"""The nvshmem backend on GPUs (run on the device: `pytest -m gpu`).

tests/gpu/nvshmem_cases.py runs every case in one torchrun launch per layout (NVSHMEM start-up
is the slow part); each case then becomes one test here. Layouts: 1, 2, 4 and 8 ranks on one
node, and virtual nodes (nodes x ranks per node) 2x1, 2x2, 4x1, 2x4 and 4x2, whose network hop
runs through NVSHMEM put/signal between ranks of this machine. With fewer GPUs than ranks, the
ranks share the GPUs as NVSHMEM PEs under CUDA MPS (started and stopped here) over a gloo group:
that checks correctness, not speed. Launches run one at a time by default: side by side under
MPS (MOE_COMM_GPU_TEST_CONCURRENCY=N, packed while ranks x num_sms fit the GPU) they finish in
half the time, but once (results/h200x1/README.md, run 5) an illegal memory access raised during
several jobs' NVSHMEM start-ups reached every MPS client at once.
"""

import json
import os
import shutil
import subprocess
import sys
import time
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
    "layout_one_expert_top8",
    "layout_zipf_top6",
    "layout_own_node_only",
    "layout_one_other_node",
    "layout_every_node",
    "layout_zero_tokens_on_last_rank",
    "layout_fp8_h7168_top8",
    "layout_fp8_every_node",
    "grad_h2048_top6_fp32",
    "grad_h7168_top8_bf16",
    "grad_every_node_top8_fp32",
    "grad_padding_rows_zero",
    "many_calls_changing_routing",
    "capacity_overflow_raises",
    "cuda_graph_dispatch_dispatch_combine",
    "bad_input_errors",
    "overlap_calls_in_flight",
    "overlap_layer_matches_plain",
]
ERROR_CASES = ["slot_overflow_raises", "hang_raises_on_every_rank"]
# (ranks, virtual node size; 0 = the real node)
LAYOUTS = [(1, 0), (2, 0), (4, 0), (8, 0), (2, 1), (4, 2), (4, 1), (8, 4), (8, 2)]
ERROR_LAYOUTS = [(2, 0), (4, 2)]
NUM_SMS = 8
LAUNCH_TIMEOUT_S = 600
CONCURRENCY = int(os.environ.get("MOE_COMM_GPU_TEST_CONCURRENCY", "1"))


def _sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _layout_id(ranks: int, virtual: int, errors: bool) -> str:
    kind = f"{ranks // virtual}x{virtual}" if virtual else f"{ranks}"
    return f"{kind}{'_errors' if errors else ''}"


class Mps:
    """The CUDA MPS daemon, when ranks must share GPUs (root on the device)."""

    def __init__(self):
        self.started = False

    def start(self):
        control = shutil.which("nvidia-cuda-mps-control")
        if control is None:
            pytest.fail("several ranks must share a GPU but nvidia-cuda-mps-control is not on the PATH")
        subprocess.run([control, "-d"], check=True)
        self.started = True
        time.sleep(1)

    def stop(self):
        if self.started:
            subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, check=False)
            self.started = False


def _launch(ranks: int, virtual: int, errors: bool, out: Path, port: int) -> subprocess.Popen:
    report = out / f"nvshmem_cases_{_layout_id(ranks, virtual, errors)}.json"
    env = dict(os.environ, **DEVICE_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["MOE_COMM_TEST_NUM_SMS"] = str(NUM_SMS)
    env["MOE_COMM_TEST_WAIT_TIMEOUT"] = "5" if errors else "60"
    env.setdefault("MOE_COMM_INIT_TIMEOUT", "120")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={ranks}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", str(ROOT / "tests" / "gpu" / "nvshmem_cases.py"),
           str(report)]
    if virtual:
        cmd += ["--virtual-node", str(virtual)]
    if errors:
        cmd.append("--errors")
    log = open(out / f"nvshmem_cases_{_layout_id(ranks, virtual, errors)}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="session")
def reports(tmp_path_factory):
    """Every layout's report, launched in batches whose SM budgets fit the GPUs."""
    out = Path(os.environ.get("MOE_COMM_GPU_REPORTS", tmp_path_factory.mktemp("nvshmem_cases")))
    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    budget = _sm_count() * gpus
    jobs = [(r, v, False) for r, v in LAYOUTS] + [(r, v, True) for r, v in ERROR_LAYOUTS]
    mps = Mps()
    if any(r > gpus for r, _, _ in jobs):
        mps.start()
    results, port = {}, 29600
    try:
        # First the preflight verb (what a user runs first) on 2 virtual nodes x 2: every pair
        # probed through put/signal.
        env = dict(os.environ, **DEVICE_ENV)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=4", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", "-m", "moe_comm", "preflight", "--virtual-node", "2",
             "--bytes", str(1 << 20), "--iters", "5", "--json", str(out / "preflight_2x2.json")],
            env=env, capture_output=True, text=True, timeout=300)
        (out / "preflight_2x2.log").write_text(proc.stdout + proc.stderr)
        path = out / "preflight_2x2.json"
        results["preflight"] = (json.loads(path.read_text()) | {"exit": proc.returncode} if path.exists()
                                else {"missing": (proc.stdout + proc.stderr)[-8000:]})
        port += 1
        while jobs:
            batch, used = [], 0
            for job in list(jobs):
                cost = job[0] * NUM_SMS
                if (used + cost <= budget and len(batch) < CONCURRENCY) or not batch:
                    batch.append(job)
                    used += cost
                    jobs.remove(job)
            procs = []
            for ranks, virtual, errors in batch:
                procs.append(((ranks, virtual, errors), _launch(ranks, virtual, errors, out, port)))
                port += 1
            for key, proc in procs:
                try:
                    proc.wait(timeout=LAUNCH_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                report = out / f"nvshmem_cases_{_layout_id(*key)}.json"
                log = (out / f"nvshmem_cases_{_layout_id(*key)}.log").read_text()
                results[key] = json.loads(report.read_text()) if report.exists() else {"missing": log[-8000:]}
    finally:
        mps.stop()
    return results


def _result(reports, key, case):
    report = reports[key]
    if "missing" in report:
        pytest.fail(f"the case runner wrote no report for {_layout_id(*key)}:\n{report['missing']}")
    ranks, virtual, _ = key
    assert report["world"] == ranks and report["ranks_per_node"] == (virtual or ranks)
    return report["results"].get(case, "MISSING: the runner did not reach this case")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[_layout_id(r, v, False) for r, v in LAYOUTS])
def test_nvshmem_case(reports, layout, case):
    result = _result(reports, (*layout, False), case)
    assert result == "PASS", result


@pytest.mark.parametrize("case", ERROR_CASES)
@pytest.mark.parametrize("layout", ERROR_LAYOUTS, ids=[_layout_id(r, v, True) for r, v in ERROR_LAYOUTS])
def test_nvshmem_error_case(reports, layout, case):
    result = _result(reports, (*layout, True), case)
    assert result == "PASS", result


def test_preflight_probes_every_pair(reports):
    report = reports["preflight"]
    if "missing" in report:
        pytest.fail(f"preflight wrote no report:\n{report['missing']}")
    assert report["exit"] == 0 and not report["failed"]
    pairs = report["pairs"]
    assert len(pairs) == 12 and all(p["gbps"] > 0 for p in pairs)
    assert sum(p["same_node"] for p in pairs) == 4  # 2 virtual nodes x 2: one NVLink peer each
    assert report["environment"]["ranks_per_node"] == 2
