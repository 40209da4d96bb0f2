"""What the nvshmem backend decides before any GPU work: capacity sizing and bad input."""

import pytest
import torch.distributed as dist

from moe_comm.backends import build_backend
from moe_comm.backends.base import MoELayerSpec
from moe_comm.backends.nvshmem import receive_capacity
from moe_comm.config import MoEComm


@pytest.fixture(scope="module")
def group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29513", rank=0, world_size=1)
    yield dist.group.WORLD


def test_receive_capacity_worst_case_and_factor():
    layer = MoELayerSpec(num_experts=64, top_k=8, hidden=7168)
    # Exact worst case: every source rank sends all its tokens here, one row per local expert hit.
    assert receive_capacity(16384, layer, ep_size=2, factor=0.0, align=8) == 2 * 16384 * 8 + 32 * 7
    # A factor is a multiple of the balanced load (tokens * top_k), plus alignment room.
    assert receive_capacity(16384, layer, ep_size=2, factor=1.25, align=8) == 163840 + 32 * 7
    # Never above the worst case, and the worst case uses min(top_k, local experts).
    small = MoELayerSpec(num_experts=8, top_k=6, hidden=256)
    assert receive_capacity(100, small, ep_size=4, factor=10.0, align=16) == 100 * 4 * 2 + 2 * 15


def test_score_before_experts_is_refused_with_the_fix(group):
    layer = MoELayerSpec(num_experts=8, top_k=2, hidden=256, score_before_experts=True)
    with pytest.raises(ValueError, match='backend = "nccl"'):
        build_backend(MoEComm(backend="nvshmem"), layer, group)


def test_top_k_above_kernel_bound_is_refused(group):
    layer = MoELayerSpec(num_experts=64, top_k=9, hidden=256)
    with pytest.raises(ValueError, match="top_k=9"):
        build_backend(MoEComm(backend="nvshmem"), layer, group)


def test_num_sms_must_be_positive(group):
    layer = MoELayerSpec(num_experts=8, top_k=2, hidden=256)
    with pytest.raises(ValueError, match="num_sms"):
        build_backend(MoEComm(backend="nvshmem", num_sms=0), layer, group)


def test_cpu_only_machine_gets_a_clear_error(group):
    layer = MoELayerSpec(num_experts=8, top_k=2, hidden=256)
    with pytest.raises(RuntimeError, match="needs CUDA GPUs"):
        build_backend(MoEComm(backend="nvshmem"), layer, group)


def test_unknown_backend_names_the_field(group):
    layer = MoELayerSpec(num_experts=8, top_k=2, hidden=256)
    with pytest.raises(ValueError, match=r"\[moe_comm\] backend"):
        build_backend(MoEComm(backend="mpi"), layer, group)
