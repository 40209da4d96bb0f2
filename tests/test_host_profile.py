"""experiments/host_profile.py's reduction of a profiler trace, on a trace made by hand: each GPU
idle gap goes to its cause (the host launched the next kernel late, and what it was doing; the
host had waited in a synchronisation; the kernel waited on the device), launches and
synchronising calls are counted per step, and the MoE calls' host time is summed. The worker
itself runs under torchrun on the device (its plumbing: a CPU run of debug_cpu)."""

import pytest

from experiments import host_profile


def x(name, ts, dur, cat, tid=1, corr=None):
    event = {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid}
    if corr is not None:
        event["args"] = {"correlation": corr}
    return event


def kernel(name, ts, dur, corr):
    return x(name, ts, dur, "kernel", tid=7, corr=corr)


def launch(ts, corr, tid=1, name="cudaLaunchKernel"):
    return x(name, ts, 2, "cuda_runtime", tid=tid, corr=corr)


TRACE = {"traceEvents": [
    x("host_profile.step#1", 0, 1000, "user_annotation"),
    x("host_profile.step#2", 1000, 500, "user_annotation"),
    # the profiler's copies of the marks on the GPU's timeline, from each step's first kernel:
    # not where a step starts (step 1's leading gap 0-120 is its own)
    x("host_profile.step#1", 120, 900, "gpu_user_annotation", tid=7),
    x("host_profile.step#2", 1110, 200, "gpu_user_annotation", tid=7),
    x("fwd:layers.1.moe.router", 100, 200, "user_annotation"),
    x("moe:dispatch", 310, 40, "user_annotation"),
    x("moe_comm::dispatch", 315, 30, "cpu_op"),
    x("phase:log", 300, 400, "user_annotation"),
    x("aten::item", 300, 103, "cpu_op"),
    # step 1: K1 runs 120-200; K2 launched late by the router at 250 (gap 200-260: 52 us host,
    # 8 us device latency)
    launch(112, 1), kernel("gemm_k1", 120, 80, 1),
    launch(250, 2), kernel("router_k2", 260, 140, 2),
    # the host waits in a sync from 300 until the GPU is done at 400, then relaunches at 650
    x("cudaStreamSynchronize", 300, 102, "cuda_runtime"),
    launch(650, 3, name="cudaGraphLaunch"), kernel("replayed_k3", 660, 40, 3),
    # K4 launched at 705 but waits on another stream until 800
    launch(705, 4), kernel("other_k4", 800, 100, 4),
    x("cudaMalloc", 720, 5, "cuda_runtime"),
    # step 2: one kernel launched on the autograd thread inside a backward node
    x("autograd::engine::evaluate_function: MmBackward0", 1050, 100, "cpu_op", tid=2),
    launch(1100, 5, tid=2), kernel("nvjet_gemm", 1110, 200, 5),
]}


def test_idle_gaps_go_to_their_causes():
    result = host_profile.analyse(TRACE, [1, 2])
    s1, s2 = result["steps"][1], result["steps"][2]
    assert s1["span_ms"] == pytest.approx(1.0)
    busy = 80 + 140 + 40 + 100  # K1, K2, K3, K4
    assert s1["gpu_busy_ms"] == pytest.approx(busy / 1e3)
    by_cause = s1["idle_ms_by_cause"]
    # leading gap 0-120: K1 launched at 112 (host late 114 us to its end), 6 us device latency
    # gap 200-260: K2's launch ends at 252 -> 52 host, 8 device
    # gap 400-660: the sync started before the GPU went idle and ended at 402 -> host after sync (652 - 400)
    # gap 700-800: K4's launch ends at 707 -> 7 host (launched late), 93 device
    # trailing 900-1000
    assert by_cause["host launched late"] == pytest.approx((114 + 52 + 7) / 1e3)
    assert by_cause["host had synchronised"] == pytest.approx(252 / 1e3)
    assert by_cause["waited on the device"] == pytest.approx((6 + 8 + 8 + 93) / 1e3)
    assert by_cause["after the last kernel"] == pytest.approx(100 / 1e3)
    labels = s1["idle_ms_by_host_activity"]
    assert labels["host launched late: fwd:layers.1.moe.router"] == pytest.approx((114 + 52) / 1e3)  # K1 and K2
    assert labels["host launched late: no op open (Python between ops)"] == pytest.approx(7 / 1e3)
    assert labels["host had synchronised: cudaStreamSynchronize in phase:log"] == pytest.approx(252 / 1e3)
    assert s1["gpu_idle_ms"] == pytest.approx(sum(by_cause.values()))
    assert s1["launches"] == 4 and s1["graph_launches"] == 1
    assert s1["syncs"] == 1 and s1["allocator_calls"] == {"cudaMalloc": 1}
    assert s1["moe_host_us"]["moe:dispatch"] == {"calls": 1, "mean_us": 40.0, "total_us": 40.0}
    assert s1["moe_host_us"]["moe_comm::dispatch"]["mean_us"] == 30.0
    # the autograd thread's launch: its backward node names what the host was doing
    assert s2["idle_ms_by_host_activity"][
        "host launched late: autograd::engine::evaluate_function: MmBackward0"] == pytest.approx(102 / 1e3)
    assert result["mean"]["span_ms"] == pytest.approx(0.75)


def test_runs_name_their_environment_and_overrides():
    spec = host_profile.parse_run("nvshmem-prefetch=nvshmem,--training.dataloader.num_workers=1,"
                                  "--moe_comm.cuda_graphs=false,NVSHMEM_DISABLE_LOCAL_ONLY_PROXY=0")
    assert (spec.label, spec.backend) == ("nvshmem-prefetch", "nvshmem")
    assert spec.env == {"NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "0"}
    assert spec.overrides == ["--training.dataloader.num_workers", "1", "--moe_comm.cuda_graphs", "false"]
    assert host_profile.parse_run("nccl").backend == "nccl"
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        host_profile.parse_run("x=nvshmem,oops")
    assert host_profile.parse_run("c=nccl,--compile.enable").overrides == ["--compile.enable"]


def test_runs_reach_the_trainer_spelled_as_torchtitan_parses_them():
    """TorchTitan's parser takes a true/false field as a flag only (`--moe_comm.cuda_graphs false`
    stops the run); the recipe loader reads each run's overrides, then the ones for every run,
    before any run starts, and a bad one names the run and the field."""
    recipe = "recipes/deepseek_v3_671b_h200x1.toml"
    spec = host_profile.checked(recipe, host_profile.parse_run(
        "n=nvshmem,--moe_comm.cuda_graphs=false,--compile.enable,--training.dataloader.num_workers=1"),
        ["--metrics.log_freq", "5"])
    assert spec.overrides == ["--moe_comm.backend", "nvshmem", "--moe_comm.no-cuda_graphs", "--compile.enable",
                              "--training.dataloader.num_workers", "1", "--metrics.log_freq", "5"]
    with pytest.raises(SystemExit, match=r"--runs bad: override --moe_comm\.cuda_graph: .*cuda_graphs"):
        host_profile.checked(recipe, host_profile.parse_run("bad=nvshmem,--moe_comm.cuda_graph=false"), [])


def test_the_threads_are_read_over_quiet_steps():
    args = host_profile.parse_args(["--out", "/tmp/x", "--steps", "16", "--first-step", "4",
                                    "--sync-steps", "9", "10", "--profile-steps", "12", "13"])
    assert host_profile.quiet_steps(args) == (4, 8)
    with pytest.raises(SystemExit):
        host_profile.parse_args(["--out", "/tmp/x", "--steps", "13", "--profile-steps", "12", "13"])
