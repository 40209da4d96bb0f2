"""What the nvshmem backend decides before any GPU work: capacity sizing, and building it where
it cannot run (its rules themselves: tests/test_backend_checks.py)."""

import pytest
import torch.distributed as dist

from moe_comm.backends import build_backend
from moe_comm.backends.base import MoELayerSpec
from moe_comm.backends.nvshmem import receive_capacity
from moe_comm.config import MoEComm
from moe_comm.errors import RecipeError


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    if not dist.is_initialized():  # a file store: no port to collide with other test sessions
        store = tmp_path_factory.mktemp("store") / "pg"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
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


def test_building_on_a_cpu_machine_asks_the_same_check(group):
    """The backend's constructor runs check_run with what the process sees: no CUDA here."""
    layer = MoELayerSpec(num_experts=8, top_k=2, hidden=256)
    with pytest.raises(RecipeError, match='needs CUDA GPUs and this run is on cpu; on CPU use backend = "nccl"'):
        build_backend(MoEComm(backend="nvshmem"), layer, group)


def test_unknown_backend_names_the_field(group):
    layer = MoELayerSpec(num_experts=8, top_k=2, hidden=256)
    with pytest.raises(ValueError, match=r"\[moe_comm\] backend"):
        build_backend(MoEComm(backend="mpi"), layer, group)
