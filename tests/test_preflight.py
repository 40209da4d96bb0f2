"""The preflight verb's report on CPU (the probes themselves run on GPUs: tests/test_nvshmem_gpu.py)."""

import subprocess
import sys

from moe_comm.preflight import Environment, failures, pairs_from_times, report


def test_pairs_and_report_name_the_slow_pairs():
    # received_ns[dst][src], 4 ranks, 2 per node: rank 1's receive from rank 3 is 10x slower.
    ns = [[0, 1_000_000, 2_000_000, 2_000_000],
          [1_000_000, 0, 2_000_000, 20_000_000],
          [2_000_000, 2_000_000, 0, 1_000_000],
          [2_000_000, 2_000_000, 1_000_000, 0]]
    pairs = pairs_from_times(ns, bytes_=8 << 20, iters=10, ranks_per_node=2)
    assert len(pairs) == 12
    by = {(p.src, p.dst): p for p in pairs}
    assert by[(0, 1)].same_node and not by[(0, 2)].same_node
    assert abs(by[(1, 0)].gbps - (8 << 20) * 10 / 1e-3 / 1e9) < 1e-6
    env = Environment("ibrc", "1", "mlx5_0:1", ["mlx5_0", "mlx5_1"], True, 2, 2)
    text, ok = report(env, pairs, timeout_s=5.0, min_gbps=0.0)
    assert ok and "every pair answered" in text
    assert "NVSHMEM_REMOTE_TRANSPORT=ibrc  IBGDA=on" in text and "mlx5_0, mlx5_1" in text
    assert text.splitlines()[6].startswith("slowest     3->1 ")
    text, ok = report(env, pairs, timeout_s=5.0, min_gbps=10.0)
    assert not ok and "1 pairs below --min-gbps 10" in text and "3->1" in text.split("below")[1]


def test_a_rank_that_never_answers_is_named_and_the_other_pairs_keep_their_rates():
    # Rank 1 sent no probe: every rank's receive from it is -1. The other pairs are independent
    # of it (one warp each, every probe sent before any wait) and keep their rates.
    ns = [[0, -1, 1_000_000, 1_000_000],
          [1_000_000, 0, 1_000_000, 1_000_000],
          [1_000_000, -1, 0, 1_000_000],
          [1_000_000, -1, 1_000_000, 0]]
    pairs = pairs_from_times(ns, bytes_=1 << 20, iters=5, ranks_per_node=2)
    dead = [p for p in pairs if p.status == "no probe"]
    assert sorted((p.src, p.dst) for p in dead) == [(1, 0), (1, 2), (1, 3)] and all(p.gbps == 0 for p in dead)
    alive = [p for p in pairs if p.src != 1]
    assert len(alive) == 9 and all(p.status == "ok" and abs(p.gbps - (1 << 20) * 5 / 1e-3 / 1e9) < 1e-6 for p in alive)
    text, ok = report(Environment("none", "0", "", [], False, 1, 2), pairs, timeout_s=5.0, min_gbps=0.0)
    assert not ok and "NOT ready" in text
    assert "NVLink (same node)     3 pairs: min 5.2" in text and "network (other nodes)  6 pairs: min 5.2" in text
    assert "FAILED      rank 1 never answered: no probe from it reached any of its 3 peer(s) within 5 s" in text
    assert failures(pairs, 5.0) == ["rank 1 never answered: no probe from it reached any of its 3 peer(s) within 5 s"]


def test_a_lost_link_and_a_rank_without_report():
    # Rank 3's probe never reached rank 0 (one link), and rank 2 sent no report at all.
    ns = [[0, 1_000_000, 1_000_000, -1], [1_000_000, 0, 1_000_000, 1_000_000], None,
          [1_000_000, 1_000_000, 1_000_000, 0]]
    pairs = pairs_from_times(ns, bytes_=1 << 20, iters=5, ranks_per_node=4)
    by = {(p.src, p.dst): p.status for p in pairs}
    assert by[(3, 0)] == "no probe" and by[(0, 2)] == by[(1, 2)] == by[(3, 2)] == "not measured"
    assert failures(pairs, 5.0) == ["rank 3's probe never reached rank(s) [0] within 5 s",
                                    "rank 2 sent no report (dead or hung): the pairs into it are not measured"]


def test_preflight_outside_torchrun_says_how_to_launch():
    proc = subprocess.run([sys.executable, "-m", "moe_comm", "preflight"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "torchrun --nproc_per_node" in proc.stderr
