"""What the nvshmem backend decides before any GPU work: buffer sizing, the kernels' bounds and
error words read from csrc's headers, and building it where it cannot run (its rules
themselves: tests/test_backend_checks.py)."""

import pytest

from moe_comm.backends import build_backend
from moe_comm.backends.base import MoELayerSpec
from moe_comm.config import MoEComm
from moe_comm.kernels import capacity
from moe_comm.kernels.errors import KernelErrors, PHASES
from moe_comm.kernels.limits import LIMITS
from moe_comm.errors import RecipeError


def test_expert_rows_worst_case_and_factor():
    # Exact worst case: every source rank sends all its tokens here, one row per local expert hit.
    assert capacity.expert_rows(16384, 64, 8, ranks=2, factor=0.0, align=8) == 2 * 16384 * 8 + 32 * 7
    # A factor is a multiple of the balanced load (tokens * top_k), plus alignment room.
    assert capacity.expert_rows(16384, 64, 8, ranks=2, factor=1.25, align=8) == 163840 + 32 * 7
    # Never above the worst case, and the worst case uses min(top_k, local experts).
    assert capacity.expert_rows(100, 8, 6, ranks=4, factor=10.0, align=16) == 100 * 4 * 2 + 2 * 15


def test_slot_buffers_worst_case_by_hand():
    # EP 32 = 4 nodes x 8, 4096 tokens, DeepSeek-V3's 256 experts, top-8, bf16 rows of 7168.
    s = capacity.buffer_sizes(4096, 256, 8, 7168 * 2, ranks=32, ranks_per_node=8, factor=0.0)
    assert (s.nodes, s.fwd_slots, s.net_slots, s.send_slots) == (4, 4 * 4096, 3 * 4096, 3 * 4096)
    assert s.shape == [32, 8, 16384, 12288]
    # One node: no network buffers, a forwarder is its own source.
    one = capacity.buffer_sizes(4096, 256, 8, 7168 * 2, ranks=8, ranks_per_node=8, factor=0.0)
    assert (one.fwd_slots, one.net_slots, one.send_slots) == (4096, 0, 0)


def test_slot_buffers_with_a_factor_follow_the_hit_probability():
    # 16 experts, top-2, 4 ranks of 2 per node: 4 experts per rank, 8 per node.
    # P(rank hit) = 1 - C(12,2)/C(16,2) = 1 - 66/120 = 0.45; P(node hit) = 1 - C(8,2)/C(16,2) = 1 - 28/120.
    s = capacity.buffer_sizes(1000, 16, 2, 64, ranks=4, ranks_per_node=2, factor=1.5)
    assert s.fwd_slots == round(1.5 * 2 * 1000 * 0.45)  # 1350 <= worst 2000
    assert s.net_slots == min(1000, -(-int(1.5 * 1000 * 92) // 120))  # capped at the worst case
    assert capacity.hit_probability(16, 2, 4) == 1 - 66 / 120


def test_limits_come_from_the_header():
    header = (capacity.__file__.rsplit("moe_comm", 1)[0]) + "csrc/common/limits.h"
    text = open(header).read()
    assert f"kMaxTopK = {LIMITS.max_top_k};" in text and f"kMaxRanks = {LIMITS.max_ranks};" in text
    assert LIMITS.max_ranks == 256 and LIMITS.max_ranks_per_node == 8 and LIMITS.max_nodes == 32


def test_error_words_name_the_timeout():
    e = KernelErrors.from_words([0, 0, 0, 0, 0, 1, 3, 5])  # dispatch, forwarder finishing, peer 5
    assert e.any and e.timeout_kernel == "dispatch" and e.timeout_peer == 5
    assert e.timeout_phase == PHASES[3] and "NVLink" in e.timeout_phase
    assert not KernelErrors.from_words([0] * 8).any
    overflow = KernelErrors.from_words([0, 0, 0, 2, 70, 0, 0, 0])
    assert overflow.slots_buffer.startswith("rows one rank receives over the network") and overflow.slots_needed == 70


def test_building_on_a_cpu_machine_asks_the_same_check(group):
    """The backend's constructor runs check_run with what the process sees: no CUDA here."""
    layer = MoELayerSpec(num_experts=8, top_k=2, hidden=256)
    with pytest.raises(RecipeError, match='needs CUDA GPUs and this run is on cpu; on CPU use backend = "nccl"'):
        build_backend(MoEComm(backend="nvshmem"), layer, group)


def test_unknown_backend_names_the_field(group):
    layer = MoELayerSpec(num_experts=8, top_k=2, hidden=256)
    with pytest.raises(ValueError, match=r"\[moe_comm\] backend"):
        build_backend(MoEComm(backend="mpi"), layer, group)


def test_rows_move_in_the_compute_dtype_under_autocast():
    """One GPU (or DDP) trains under autocast with an fp32 residual stream: the nvshmem backend
    moves the rows in the autocast dtype the experts compute in (half the bytes, and what FP8
    dispatch quantises from), with the gradient back in fp32; FSDP's bf16 rows pass unchanged."""
    import torch

    from moe_comm.backends.base import rows_in_compute_dtype

    x = torch.randn(4, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows = rows_in_compute_dtype(x)
    assert rows.dtype == torch.bfloat16
    rows.float().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, torch.ones_like(x))
    assert rows_in_compute_dtype(x).dtype == torch.float32  # no autocast: as they are
    bf16 = x.detach().bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert rows_in_compute_dtype(bf16) is bf16


def test_one_host_runs_nvshmem_without_its_proxy_thread():
    """On one host NVSHMEM's proxy thread would only spin a CPU core (the kernels bound their
    own waits); across hosts it drives the network and must stay (moe_comm.kernels.runtime)."""
    from moe_comm.kernels.runtime import ONE_HOST_ENV

    assert ONE_HOST_ENV == {"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "1"}
