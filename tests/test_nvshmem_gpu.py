"""The nvshmem backend on GPUs (run on the device: `pytest -m gpu`).

tests/gpu/nvshmem_cases.py runs every case in one torchrun launch per layout (NVSHMEM start-up
is the slow part); each case then becomes one test here. Layouts: 1, 2, 4 and 8 ranks on one
node, and virtual nodes (nodes x ranks per node) 2x1, 2x2, 4x1, 2x4 and 4x2, whose network hop
runs through NVSHMEM put/signal between ranks of this machine. With fewer GPUs than ranks, the
ranks share the GPUs as NVSHMEM PEs under CUDA MPS (started and stopped here) over a gloo group:
that checks correctness, not speed. Launches run one at a time by default: side by side under
MPS (MOE_COMM_GPU_TEST_CONCURRENCY=N, packed while their ranks' SMs and memory fit the GPU) they
finish in half the time, but once (results/h200x1/README.md, run 5) an illegal memory access
raised during several jobs' NVSHMEM start-ups reached every MPS client at once.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.device_env import DEVICE_ENV, Mps  # noqa: E402  NVLink multicast off on the lent machines

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
    "graphed_calls_match_eager",
    "bad_input_errors",
    "overlap_calls_in_flight",
    "overlap_layer_matches_plain",
    "overlap_microbatch_calls_in_flight",
    "overlap_microbatch_layer_matches_plain",
    "layout_fp8_rows_fp8_wire",
    "layout_fp8_rows_bf16_wire",
    "layout_fp8_rows_every_node",
    "grad_fp8_experts_fp8_wire",
    "grad_fp8_experts_bf16_wire",
    "grad_fp8_combine_backward",
    "grad_fp8_combine_backward_tiny_gradient",
]
# What a one-GPU training step runs (EP 1: every expert on the rank), at world 1 only.
WORLD1_CASES = ["moe_layer_ep1_against_nccl", "emulated_link_holds", "moe_layer_fp8_experts_ep1"]
ERROR_CASES = ["slot_overflow_raises", "hang_raises_on_every_rank"]
# (ranks, virtual node size; 0 = the real node)
LAYOUTS = [(1, 0), (2, 0), (4, 0), (8, 0), (2, 1), (4, 2), (4, 1), (8, 4), (8, 2)]
ERROR_LAYOUTS = [(2, 0), (4, 2)]
NUM_SMS = 8
# GPU memory one rank of a case launch may hold at its peak: the 8-PE launches' processes held
# 7.3-10.3 GiB each when two of them side by side ran the GPU out of memory (run 51, before each
# case gave back what it held: tests/gpu/case_runner.py). Launches are packed only while their
# ranks fit the GPUs' memory at this much each, as well as their SMs.
RANK_MEMORY_BYTES = 12 << 30
LAUNCH_TIMEOUT_S = 600
ERROR_TIMEOUT_S = 5  # wait_timeout_s of the error layouts and the dead-pair preflight
# After a wait gives up, every process of the job must have ended within this much more.
EXIT_BOUND_S = ERROR_TIMEOUT_S + 10
DEAD_PAIR_LAYOUTS = [(2, 0), (4, 2)]  # preflight with rank 1 silent: 2 ranks, 2 virtual nodes x 2
CONCURRENCY = int(os.environ.get("MOE_COMM_GPU_TEST_CONCURRENCY", "1"))
# A subset of the launches by id ("1,2x2,2_errors,2x2_dead_pair"; default every one): a device
# call with a few minutes checks what a change touched; what it leaves out is reported as a
# skip that says it did not run, never as a pass.
ONLY = set(filter(None, os.environ.get("MOE_COMM_GPU_LAYOUTS", "").split(",")))


def _sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _layout_id(ranks: int, virtual: int, errors: bool) -> str:
    kind = f"{ranks // virtual}x{virtual}" if virtual else f"{ranks}"
    return f"{kind}{'_errors' if errors else ''}"


def _dead_pair_id(ranks: int, virtual: int) -> str:
    return f"{_layout_id(ranks, virtual, False)}_dead_pair"


def _launch(ranks: int, virtual: int, errors: bool, out: Path, port: int) -> subprocess.Popen:
    report = out / f"nvshmem_cases_{_layout_id(ranks, virtual, errors)}.json"
    env = dict(os.environ, **DEVICE_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["MOE_COMM_TEST_NUM_SMS"] = str(NUM_SMS)
    env["MOE_COMM_TEST_WAIT_TIMEOUT"] = str(ERROR_TIMEOUT_S) if errors else "60"
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


def wait_all(procs: list[subprocess.Popen], timeout_s: float, poll_s: float = 0.05) -> list[float]:
    """When each process ended (time.time()), waiting for all of them together; those still
    running after timeout_s are killed then. Each launch's own end time, not when a wait in
    turn reached it: run 55 timed an error job that had ended in 3 s at 28 s, the end of the
    longer launch side by side with it, waited for first."""
    deadline = time.time() + timeout_s
    ends = [None] * len(procs)
    while None in ends:
        now = time.time()
        for i, proc in enumerate(procs):
            if ends[i] is None and proc.poll() is not None:
                ends[i] = now
        if None in ends and now >= deadline:
            for i, proc in enumerate(procs):
                if ends[i] is None:
                    proc.kill()
                    proc.wait()
                    ends[i] = time.time()
        elif None in ends:
            time.sleep(poll_s)
    return ends


def _preflight(ranks: int, virtual: int, out: Path, port: int, name: str, *extra: str) -> dict:
    """The preflight verb under torchrun; its JSON report, exit status and end time."""
    env = dict(os.environ, **DEVICE_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={ranks}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "-m", "moe_comm", "preflight",
           "--bytes", str(1 << 20), "--iters", "5", "--json", str(out / f"{name}.json"), *extra]
    if virtual:
        cmd += ["--virtual-node", str(virtual)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        log, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log, code = f"{e.stdout or ''}{e.stderr or ''}\nTIMED OUT after 300 s", None
    ended = time.time()
    (out / f"{name}.log").write_text(log if isinstance(log, str) else log.decode())
    path = out / f"{name}.json"
    if not path.exists():
        return {"missing": str(log)[-8000:], "exit": code}
    return json.loads(path.read_text()) | {"exit": code, "ended_at": ended}


@pytest.fixture(scope="session")
def reports(tmp_path_factory):
    """Every layout's report, launched in batches whose SMs and memory fit the GPUs."""
    out = Path(os.environ.get("MOE_COMM_GPU_REPORTS", tmp_path_factory.mktemp("nvshmem_cases")))
    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    budget = _sm_count() * gpus
    memory = torch.cuda.get_device_properties(0).total_memory * gpus
    jobs = [(r, v, False) for r, v in LAYOUTS] + [(r, v, True) for r, v in ERROR_LAYOUTS]
    jobs = [j for j in jobs if not ONLY or _layout_id(*j) in ONLY]
    mps = Mps()
    # every launch counts, the preflights' 4 ranks too (run 13 started none for a subset of dead-pair
    # preflights only, and the ranks time-sliced the GPU: rates 10x lower, the case still right)
    if any(r > gpus for r in [4] + [r for r, _, _ in jobs] + [r for r, _ in DEAD_PAIR_LAYOUTS]):
        mps.start()
    results, port = {}, 29600
    try:
        # First the preflight verb (what a user runs first) on 2 virtual nodes x 2: every pair
        # probed through put/signal; then with one rank that never answers.
        results["preflight"] = _preflight(4, 2, out, port, "preflight_2x2")
        port += 1
        for ranks, virtual in [lay for lay in DEAD_PAIR_LAYOUTS if not ONLY or _dead_pair_id(*lay) in ONLY]:
            results[("dead_pair", ranks, virtual)] = _preflight(
                ranks, virtual, out, port, f"preflight_{_dead_pair_id(ranks, virtual)}",
                "--silent-rank", "1", "--wait-timeout-s", str(ERROR_TIMEOUT_S))
            port += 1
        while jobs:
            batch, used, held = [], 0, 0
            for job in list(jobs):
                cost, hold = job[0] * NUM_SMS, job[0] * RANK_MEMORY_BYTES
                if (used + cost <= budget and held + hold <= memory and len(batch) < CONCURRENCY) or not batch:
                    batch.append(job)
                    used += cost
                    held += hold
                    jobs.remove(job)
            procs = []
            for ranks, virtual, errors in batch:
                procs.append(((ranks, virtual, errors), _launch(ranks, virtual, errors, out, port)))
                port += 1
            ends = wait_all([proc for _, proc in procs], LAUNCH_TIMEOUT_S)
            for (key, proc), ended in zip(procs, ends):
                report = out / f"nvshmem_cases_{_layout_id(*key)}.json"
                log = (out / f"nvshmem_cases_{_layout_id(*key)}.log").read_text()
                results[key] = (json.loads(report.read_text()) | {"exit": proc.returncode, "ended_at": ended}
                                if report.exists() else {"missing": log[-8000:]})
    finally:
        mps.stop()
    _record_exit_bounds(results, out)
    return results


def _record_exit_bounds(results: dict, out: Path) -> None:
    """How long after its last wait gave up each error job's last process ended (the job's
    launcher returns once every process has), for results/h200x1."""
    rows = []
    for key, r in results.items():
        if "missing" in r:
            continue
        if isinstance(key, tuple) and key[0] == "dead_pair":
            rows.append({"job": f"preflight_{_dead_pair_id(key[1], key[2])}", "exit": r["exit"],
                         "error_to_last_exit_s": r["ended_at"] - max(r["done_at"].values())})
        elif isinstance(key, tuple) and key[2] and r.get("error_at") and None not in r["error_at"]:
            rows.append({"job": f"nvshmem_cases_{_layout_id(*key)}", "exit": r["exit"],
                         "error_to_last_exit_s": r["ended_at"] - max(r["error_at"])})
    (out / "exit_bounds.json").write_text(json.dumps({"wait_timeout_s": ERROR_TIMEOUT_S, "bound_s": EXIT_BOUND_S,
                                                      "jobs": rows}, indent=1))


def _result(reports, key, case):
    if key not in reports:
        pytest.skip(f"{_layout_id(*key)} not in MOE_COMM_GPU_LAYOUTS={','.join(sorted(ONLY))}: not run")
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


@pytest.mark.parametrize("case", WORLD1_CASES)
def test_nvshmem_world1_case(reports, case):
    result = _result(reports, (1, 0, False), case)
    assert result == "PASS", result


@pytest.mark.parametrize("case", ERROR_CASES)
@pytest.mark.parametrize("layout", ERROR_LAYOUTS, ids=[_layout_id(r, v, True) for r, v in ERROR_LAYOUTS])
def test_nvshmem_error_case(reports, layout, case):
    result = _result(reports, (*layout, True), case)
    assert result == "PASS", result


@pytest.mark.parametrize("layout", ERROR_LAYOUTS, ids=[_layout_id(r, v, True) for r, v in ERROR_LAYOUTS])
def test_every_process_ends_after_a_wait_gives_up(reports, layout):
    """The hang case's job: every rank raised, then left by the interpreter's normal exit (exit
    status 0 from every process, so the launcher's is 0) within the bound of the last error."""
    if (*layout, True) not in reports:
        pytest.skip(f"{_layout_id(*layout, True)} not in MOE_COMM_GPU_LAYOUTS: not run")
    report = reports[(*layout, True)]
    if "missing" in report:
        pytest.fail(f"the case runner wrote no report:\n{report['missing']}")
    assert report["exit"] == 0, f"the job's processes did not all exit normally (launcher status {report['exit']})"
    assert None not in report["error_at"], f"a rank never raised: {report['error_at']}"
    late = report["ended_at"] - max(report["error_at"])
    assert late <= EXIT_BOUND_S, f"the last process ended {late:.1f} s after the last error (bound {EXIT_BOUND_S} s)"


@pytest.mark.parametrize("layout", DEAD_PAIR_LAYOUTS, ids=[_layout_id(r, v, False) for r, v in DEAD_PAIR_LAYOUTS])
def test_preflight_names_a_rank_that_never_answers(reports, layout):
    if ("dead_pair", *layout) not in reports:
        pytest.skip(f"{_dead_pair_id(*layout)} not in MOE_COMM_GPU_LAYOUTS: not run")
    report = reports[("dead_pair", *layout)]
    if "missing" in report:
        pytest.fail(f"preflight wrote no report (exit {report['exit']}):\n{report['missing']}")
    ranks = layout[0]
    assert report["exit"] == 1 and not report["ok"]
    assert len(report["failed"]) == 1 and report["failed"][0].startswith("rank 1 never answered"), report["failed"]
    pairs = report["pairs"]
    assert len(pairs) == ranks * (ranks - 1)
    assert all(p["status"] == "no probe" for p in pairs if p["src"] == 1)
    # every other pair arrived and kept its rate: pairs are independent of the silent rank
    assert all(p["status"] == "ok" and p["gbps"] > 0 for p in pairs if p["src"] != 1), pairs
    assert len(report["done_at"]) == ranks  # every rank reported, the silent one too
    late = report["ended_at"] - max(report["done_at"].values())
    assert late <= EXIT_BOUND_S, f"the last process ended {late:.1f} s after the probes (bound {EXIT_BOUND_S} s)"


def test_preflight_probes_every_pair(reports):
    report = reports["preflight"]
    if "missing" in report:
        pytest.fail(f"preflight wrote no report:\n{report['missing']}")
    assert report["exit"] == 0 and not report["failed"] and report["ok"]
    pairs = report["pairs"]
    assert len(pairs) == 12 and all(p["gbps"] > 0 and p["status"] == "ok" for p in pairs)
    assert sum(p["same_node"] for p in pairs) == 4  # 2 virtual nodes x 2: one NVLink peer each
    assert report["environment"]["ranks_per_node"] == 2
