"""instrument(): routing counts by hand, timing of all four phases, gradients untouched, and the
global imbalance over a 2-rank gloo group."""

import gc
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ranks
from metrics_fakes import free_port, init_gloo, make_fake
from moe_comm.metrics import instrument, InstrumentedBackend, keys
from moe_comm.metrics.instrumented import (
    instrumented_backends,
    rows_leaving_rank,
    rows_per_expert,
    summarize,
)

# 3 tokens, top-2, 4 experts on 2 ranks (experts 0,1 on rank 0; 2,3 on rank 1).
TOPK_IDX_RANK0 = torch.tensor([[0, 2], [2, 3], [1, 0]])
TOPK_IDX_RANK1 = torch.tensor([[3, 2], [3, 2], [3, 2]])


def _leaving(topk_idx_TK, ep_rank, once_per_rank, ep_size=2, num_experts=4):
    rows_E = rows_per_expert(topk_idx_TK, num_experts)
    return rows_leaving_rank(
        topk_idx_TK, rows_E, ep_rank, num_experts // ep_size, ep_size, once_per_rank
    ).item()


def test_routing_counts_by_hand():
    assert rows_per_expert(TOPK_IDX_RANK0, 4).tolist() == [2, 1, 2, 1]
    # all-to-all: one row per (token, expert on rank 1): (0,e2) (1,e2) (1,e3)
    assert _leaving(TOPK_IDX_RANK0, 0, once_per_rank=False) == 3
    # dedup: one row per (token, rank 1): tokens 0 and 1
    assert _leaving(TOPK_IDX_RANK0, 0, once_per_rank=True) == 2
    # seen from rank 1: tokens 0 and 2 send to rank 0 (experts 0, 1, 0)
    assert _leaving(TOPK_IDX_RANK0, 1, once_per_rank=False) == 3
    assert _leaving(TOPK_IDX_RANK0, 1, once_per_rank=True) == 2
    # 4 ranks of one expert each, rank 3: all 6 rows but e3's leave; tokens 0,1,2 all leave
    assert _leaving(TOPK_IDX_RANK0, 3, once_per_rank=False, ep_size=4) == 5
    assert _leaving(TOPK_IDX_RANK0, 3, once_per_rank=True, ep_size=4) == 5
    # masked slots (-1, as DeepEP marks them) are neither counted nor sent
    masked = torch.tensor([[0, -1], [-1, 3]])
    assert rows_per_expert(masked, 4).tolist() == [1, 0, 0, 1]
    assert _leaving(masked, 0, once_per_rank=True) == 1
    assert _leaving(masked, 0, once_per_rank=False) == 1


def _step(backend, x_TD, topk_idx_TK, topk_w_TK):
    result = backend.dispatch(x_TD, topk_idx_TK, topk_w_TK)
    y_RD = result.recv_x_RD * 2.0  # the "experts"
    out_TD = backend.combine(y_RD, result.handle)
    out_TD.square().sum().backward()
    return out_TD


def test_instrumented_is_transparent_and_times_every_phase(world_of_one):
    torch.manual_seed(0)
    x_TD = torch.randn(3, 8)
    topk_w_TK = torch.rand(3, 2)
    bare = make_fake()
    x_bare = x_TD.clone().requires_grad_()
    w_bare = topk_w_TK.clone().requires_grad_()
    out_bare = _step(bare, x_bare, TOPK_IDX_RANK0, w_bare)

    wrapped = instrument(make_fake())
    assert isinstance(wrapped, InstrumentedBackend)
    assert (wrapped.name, wrapped.ep_size, wrapped.num_local_experts) == ("nccl", 1, 4)
    x_inst = x_TD.clone().requires_grad_()
    w_inst = topk_w_TK.clone().requires_grad_()
    out_inst = _step(wrapped, x_inst, TOPK_IDX_RANK0, w_inst)

    assert torch.equal(out_bare, out_inst)
    assert torch.equal(x_bare.grad, x_inst.grad)
    assert torch.equal(w_bare.grad, w_inst.grad)
    phases = [phase for phase, _, _ in wrapped.stats.intervals]
    assert sorted(phases) == ["combine_bwd", "combine_fwd", "dispatch_bwd", "dispatch_fwd"]
    times = wrapped.stats.take_times_ms()
    assert all(ms > 0 for ms in times.values()) and len(times) == 4
    assert wrapped.stats.intervals == []


def test_summarize_per_step_bytes_and_times(world_of_one):
    wrapped = instrument(make_fake())
    x_TD = torch.randn(3, 8, requires_grad=True)
    w_TK = torch.rand(3, 2, requires_grad=True)
    for _ in range(2):  # two steps between log lines
        _step(wrapped, x_TD, TOPK_IDX_RANK0, w_TK)
    metrics = summarize([wrapped], steps=2)
    # world of one: every expert is local, nothing leaves the rank
    assert metrics[keys.SENT_GB] == 0.0
    assert metrics[keys.DISPATCH_MS] == pytest.approx(
        metrics[keys.DISPATCH_FWD_MS] + metrics[keys.DISPATCH_BWD_MS]
    )
    assert metrics[keys.COMM_MS] > 0
    # experts [2,1,2,1] routed rows: max/mean = 2/1.5
    assert metrics[keys.IMBALANCE_EXPERT] == pytest.approx(2 / 1.5)
    assert metrics[keys.IMBALANCE_RANK] == pytest.approx(1.0)
    # counters were reset
    assert wrapped.stats.bytes == {} and wrapped.stats.rows_per_expert_E is None


def test_no_grad_and_disabled_pass_through(world_of_one, monkeypatch):
    wrapped = instrument(make_fake())
    with torch.no_grad():
        result = wrapped.dispatch(torch.randn(3, 8), TOPK_IDX_RANK0, torch.rand(3, 2))
        wrapped.combine(result.recv_x_RD, result.handle)
    assert wrapped.stats.intervals == [] and wrapped.stats.rows_per_expert_E is None
    assert summarize([wrapped], steps=1) == {}  # nothing measured: no numbers, not zeros
    monkeypatch.setenv("MOE_COMM_INSTRUMENT", "0")
    bare = make_fake()
    assert instrument(bare) is bare


def _two_rank_worker(rank, port, backend_names, results):
    init_gloo(rank, 2, port)
    try:
        for backend_name in backend_names:  # one pair of processes for every case: each start sets up gloo anew
            wrapped = instrument(make_fake(backend_name))
            topk_idx_TK = TOPK_IDX_RANK0 if rank == 0 else TOPK_IDX_RANK1
            x_TD = torch.randn(3, 8, requires_grad=True)
            w_TK = torch.rand(3, 2, requires_grad=True)
            _step(wrapped, x_TD, topk_idx_TK, w_TK)
            assert instrumented_backends() == [wrapped]
            results[(backend_name, rank)] = summarize(instrumented_backends(), steps=1)
            del wrapped
            gc.collect()  # the next case's registry holds only its own layer
    finally:
        dist.destroy_process_group()


CASES = [("nccl", 3), ("nvshmem", 2)]


@pytest.fixture(scope="module")
def two_ranks():
    results = mp.Manager().dict()
    ranks.spawn(_two_rank_worker, args=(free_port(), [name for name, _ in CASES], results), nprocs=2)
    return dict(results)


@pytest.mark.parametrize("backend_name, rows_sent_rank0", CASES)
def test_two_ranks_global_imbalance_and_bytes(two_ranks, backend_name, rows_sent_rank0):
    results = {rank: two_ranks[(backend_name, rank)] for rank in (0, 1)}
    rank0 = results[0]
    # global rows per expert: rank 0 [2,1,2,1] + rank 1 [0,0,3,3] = [2,1,5,4]: max/mean = 5/3
    assert rank0[keys.IMBALANCE_EXPERT] == pytest.approx(5 / 3)
    # rows per rank: rank 0 hosts experts 0,1 -> 3, rank 1 -> 9: max/mean = 9/6
    assert rank0[keys.IMBALANCE_RANK] == pytest.approx(1.5)
    assert results[1][keys.IMBALANCE_RANK] == pytest.approx(1.5)
    # bytes: rows x hidden 8 x fp32 4 bytes, for dispatch and combine, forward and backward
    row_bytes = 8 * 4
    assert rank0[keys.DISPATCH_GB] == pytest.approx(2 * rows_sent_rank0 * row_bytes / 1e9)
    assert rank0[keys.SENT_GB] == pytest.approx(4 * rows_sent_rank0 * row_bytes / 1e9)
    assert not math.isnan(rank0[keys.COMM_MS])
