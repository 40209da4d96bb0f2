"""tests/ranks.py: a rank that never ends fails the call within its timeout, naming the rank,
and a failing rank's error reaches the caller (as torch.multiprocessing.spawn's does)."""

import os
import time

import pytest
from torch.multiprocessing import ProcessRaisedException

import ranks


def _rank_1_hangs(rank: int) -> None:
    if rank == 1:
        time.sleep(120)


def _rank_0_reports_its_env(rank: int) -> None:
    if rank == 0:
        raise ValueError(f"rank 0 sees {os.environ.get('MOE_COMM_TEST_RANKS')!r}")


def test_a_hung_rank_is_named_and_killed():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] of 2 still running after 2 s; killed"):
        ranks.spawn(_rank_1_hangs, nprocs=2, timeout_s=2)
    assert time.monotonic() - start < 30


def test_ranks_get_the_callers_environment_and_report_failure(monkeypatch):
    monkeypatch.setenv("MOE_COMM_TEST_RANKS", "from the caller")
    with pytest.raises(ProcessRaisedException, match="rank 0 sees 'from the caller'"):
        ranks.spawn(_rank_0_reports_its_env, nprocs=2)
