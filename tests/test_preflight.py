"""The preflight verb's report on CPU (the probes themselves run on GPUs: tests/test_nvshmem_gpu.py)."""

import subprocess
import sys

from moe_comm.preflight import Environment, pairs_from_times, report


def test_pairs_and_report_name_the_slow_and_failed_pairs():
    # 4 ranks, 2 per node: rank 3's step to rank 1 is 10x slower; rank 2 gave up on a peer.
    ns = [[0, 1_000_000, 2_000_000, 2_000_000],
          [1_000_000, 0, 2_000_000, 2_000_000],
          [2_000_000, 2_000_000, 0, 1_000_000],
          [2_000_000, 20_000_000, 1_000_000, 0]]
    pairs = pairs_from_times(ns, bytes_=8 << 20, iters=10, ranks_per_node=2)
    assert len(pairs) == 12
    by = {(p.src, p.dst): p for p in pairs}
    assert by[(0, 1)].same_node and not by[(0, 2)].same_node
    assert abs(by[(0, 1)].gbps - (8 << 20) * 10 / 1e-3 / 1e9) < 1e-6
    env = Environment("ibrc", "1", "mlx5_0:1", ["mlx5_0", "mlx5_1"], True, 2, 2)
    text, ok = report(env, pairs, {2: "gave up after 5 s waiting for EP rank 1's probe"}, min_gbps=0.0)
    assert not ok
    assert "NVSHMEM_REMOTE_TRANSPORT=ibrc  IBGDA=on" in text and "mlx5_0, mlx5_1" in text
    assert text.splitlines()[6].startswith("slowest     3->1 ")
    assert "FAILED      rank 2: gave up" in text and "NOT ready" in text
    text, ok = report(env, pairs, {}, min_gbps=10.0)
    assert not ok and "1 pairs below --min-gbps 10" in text and "3->1" in text.split("below")[1]
    text, ok = report(env, pairs, {}, min_gbps=0.0)
    assert ok and "every pair answered" in text


def test_a_step_that_gave_up_reports_no_bandwidth():
    # The kernel writes -1 for a step whose wait gave up: no rate is made up for it.
    pairs = pairs_from_times([[0, -1], [1_000_000, 0]], bytes_=1 << 20, iters=5, ranks_per_node=1)
    by = {(p.src, p.dst): p.gbps for p in pairs}
    assert by[(0, 1)] == 0.0 and by[(1, 0)] > 0


def test_preflight_outside_torchrun_says_how_to_launch():
    proc = subprocess.run([sys.executable, "-m", "moe_comm", "preflight"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "torchrun --nproc_per_node" in proc.stderr
