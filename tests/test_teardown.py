"""The agreement before NVSHMEM's collective teardown (moe_comm.kernels.runtime) and the bounded
board it rests on (moe_comm.kernels.peers), with ranks as threads over one in-process store. The
GPU side (every process of a job that timed out ends within the bound) is a GPU case:
tests/test_nvshmem_gpu.py::test_every_process_ends_after_a_wait_gives_up."""

import threading
import time
from types import SimpleNamespace

import torch.distributed as dist

from moe_comm.kernels.peers import PeerBoard
from moe_comm.kernels.runtime import NvshmemRuntime


def _ranks(world: int, aborted=(), absent=(), timeout_s=1.0):
    """Run agree_teardown on every rank but the absent ones; rank -> ((together, why), seconds)."""
    store = dist.HashStore()
    out = {}

    def rank_main(rank):
        rt = NvshmemRuntime.__new__(NvshmemRuntime)
        rt.rank, rt.world = rank, world
        rt.request = SimpleNamespace(wait_timeout_s=timeout_s)
        rt.board = PeerBoard(store, "moe_comm/nvshmem/test", world, rank)
        rt.errors = lambda: SimpleNamespace(timeout_kernel="dispatch" if rank in aborted else "")
        start = time.monotonic()
        out[rank] = (rt.agree_teardown(), time.monotonic() - start)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world) if r not in absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_every_rank_clean_tears_down_together():
    out = _ranks(4)
    assert all(res == (True, "") for res, _ in out.values())


def test_a_rank_that_gave_up_makes_every_rank_skip_and_is_named():
    out = _ranks(4, aborted={2})
    assert all(not together for (together, _), _ in out.values())
    assert out[2][0][1] == "a wait of this rank gave up"
    for r in (0, 1, 3):
        assert "EP rank(s) [2] gave up" in out[r][0][1]
        assert out[r][1] < 1.0  # no need to wait out the bound: rank 2 said so


def test_a_rank_that_never_comes_is_named_within_the_bound():
    out = _ranks(3, absent={1}, timeout_s=0.5)
    assert set(out) == {0, 2}
    for r in (0, 2):
        together, why = out[r][0]
        assert not together and "EP rank(s) [1] did not reach the end within wait_timeout_s = 0.5 s" in why
        assert 0.5 <= out[r][1] < 3.0


def test_board_gathers_what_was_posted_and_answers_an_unreachable_store_with_nothing():
    store = dist.HashStore()
    a, b = PeerBoard(store, "p", 2, 0), PeerBoard(store, "p", 2, 1)
    a.post("x", "one")
    assert a.gather("x", 0.1) == {0: "one"}
    b.post("x", "two")
    assert a.gather("x", 0.1) == {0: "one", 1: "two"}

    class Gone:
        def add(self, *args):
            raise dist.DistStoreError("connection reset")

    assert PeerBoard(Gone(), "p", 2, 0).gather("x", 0.1) == {}


def test_board_reads_one_ranks_post_without_waiting_for_the_others():
    store = dist.HashStore()
    board = PeerBoard(store, "p", 4, 1)
    PeerBoard(store, "p", 4, 0).post("verdict", "ok")
    start = time.monotonic()
    assert board.read("verdict", 0, 5.0) == "ok" and time.monotonic() - start < 1.0
    assert board.read("verdict", 2, 0.2) is None
