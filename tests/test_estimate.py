"""`moe_comm.predict.estimate` against TorchTitan's own accounting, and `check` on the flagship recipe."""

import copy
from pathlib import Path

import pytest
import torch
from torchtitan.models.deepseek_v3 import deepseekv3_args, DeepSeekV3Model
from torchtitan.models.utils import get_moe_model_nparams_and_flops

from moe_comm.predict import estimate
from moe_comm.__main__ import main
from moe_comm.titan import flavors

REPO = Path(__file__).resolve().parents[1]
SEQ = 4096


def _titan_count(flavor: str) -> tuple[int, int]:
    """TorchTitan's params and flops/token for a flavor, on a meta-device model."""
    args = copy.deepcopy(deepseekv3_args[flavor])
    args.max_seq_len = SEQ
    args.moe_impl = "standard"  # set by update_from_config in a real run
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    head_dims = args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim
    return get_moe_model_nparams_and_flops(args, model, head_dims, SEQ)


@pytest.mark.parametrize("flavor", ["debugmodel", "16B", "671B", "671B_layers"])
def test_params_and_flops_match_torchtitan(flavor):
    flavors.register()
    args = deepseekv3_args[flavor]
    nparams, flops = _titan_count(flavor)
    ours = estimate.count_params(args)
    assert ours.total == nparams
    assert ours.flops_per_token(args, SEQ) == pytest.approx(flops, rel=0.01)


def test_671b_headline_numbers():
    args = deepseekv3_args["671B"]
    p = estimate.count_params(args)
    assert p.total == pytest.approx(671e9, rel=0.01)
    assert p.active == pytest.approx(37e9, rel=0.03)
    # NOTES §1: TorchTitan reports 281 GFLOP/token for 671B at seq 4096
    assert p.flops_per_token(args, SEQ) == pytest.approx(281e9, rel=0.01)


def test_memory_peaks_hand_counted():
    """Forward end = 12 B/param + working set + activations + logits; backward end = 16 B/param
    + working set + the largest unit's unsharded gradients (bf16 + fp32); the peak is the larger."""
    args = deepseekv3_args["debugmodel"]
    lay = estimate.Layout(2, 1, 2, 1, 2, 1, 1, 1, 2, 1)
    p = estimate.count_params(args)
    mem = estimate.memory_per_gpu(args, lay, 2, 256, "none")
    assert mem.params_and_optimizer == 12 * p.total / 2 and mem.gradients == 4 * p.total / 2
    assert mem.grad_reduce == pytest.approx(mem.fsdp_working_set / 4 * 6)  # 6 B vs 2 x 2 B per unit param
    assert mem.forward_end == pytest.approx(mem.params_and_optimizer + mem.fsdp_working_set + mem.activations + mem.logits)
    assert mem.total == max(mem.forward_end, mem.backward_end)
    assert mem.reserved == pytest.approx(mem.total + estimate.ALLOCATOR_CACHE_BYTES_PER_OUTPUT_PARAM
                                         * args.vocab_size * args.dim)
    # more tokens move the peak to the end of the forward pass
    big = estimate.memory_per_gpu(args, lay, 64, 2048, "none")
    assert big.peak_at == "end of forward" and big.total == big.forward_end


def test_memory_estimate_is_close_to_measured_16b():
    # results/h200x2: 16B, FSDP 2, EP 2, 1 x 4096, full AC: 119.5 GiB in use, 127.5 reserved
    lay = estimate.Layout(2, 1, 2, 1, 2, 1, 1, 1, 2, 1)
    mem = estimate.memory_per_gpu(deepseekv3_args["16B"], lay, 1, SEQ, "full")
    assert mem.peak_at == "end of backward"
    assert mem.total / estimate.GiB == pytest.approx(119.5, rel=0.03)
    assert mem.reserved / estimate.GiB == pytest.approx(127.5, rel=0.03)


def test_memory_estimate_is_close_to_measured_671b_layers():
    # results/h200x2: 4 x 4096 without AC: 102.9 GiB in use (137.4 reserved, capped by the device)
    flavors.register()
    lay = estimate.Layout(2, 1, 2, 1, 2, 1, 1, 1, 2, 1)
    mem = estimate.memory_per_gpu(deepseekv3_args["671B_layers"], lay, 4, SEQ, "none")
    assert mem.peak_at == "end of forward"
    assert mem.total / estimate.GiB == pytest.approx(102.9, rel=0.03)
    assert mem.reserved / estimate.GiB == pytest.approx(137.4, rel=0.03)


def test_check_cli_on_flagship(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["check", "recipes/deepseek_v3_671b_b200.toml", "--skip-files"]) == 0
    out = capsys.readouterr().out
    assert "671.03B params, 37.55B active, 281.2 GFLOP/token" in out
    assert "world 256 = 32 node(s) x 8" in out and "pp 8, ep 32" in out
    assert "memory/GPU" in out and "fits" in out and "MoE comm" in out
    # per backend: the hierarchy, rows and bytes per phase per step, comm time, MFU, the winner
    assert "EP 32 over 4 node(s) x 8 rank(s)" in out and "routing node_limited" in out
    for backend in ("nccl", "deepep", "nvshmem", "nvshmem-fp8"):
        assert f"\n  {backend} " in out
    assert "network rows" in out and "NVLink GB" in out and "MFU" in out
    assert "<- this recipe" in out and "expected fastest on this cluster:" in out


def test_check_cli_reports_errors(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["check", "recipes/debug_cpu.toml", "--parallelism.expert_parallel_degree", "3"]) == 2
    assert "expert_parallel_degree = 3" in capsys.readouterr().err


def test_check_cli_on_flagship_with_nvshmem_prints_its_buffers(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["check", "recipes/deepseek_v3_671b_b200.toml", "--skip-files", "--moe_comm.backend", "nvshmem"]) == 0
    out = capsys.readouterr().out
    # EP 32 = 4 nodes of 8; 1 x 4096 tokens per microbatch; buffers at 2x the expected load
    assert "nvshmem     4 node(s) x 8 per EP group, 4096 tokens per call" in out
    assert "12,288 net slots, 12,288 send slots" in out and "symmetric heap" in out
    assert "<- this recipe" in out.split("\n  nvshmem ")[1].splitlines()[0]


def _flagship_layout(pp: int = 8) -> estimate.Layout:
    return estimate.Layout(256, 32, 8, 1, 256 // pp, 1, 1, pp, 32, 1)


def test_pipelined_memory_hand_counted():
    """671B, PP 8 x FSDP 32, EP 32, 1F1B, 8 microbatches of 1 x 4096, full AC. TorchTitan's
    split of 61 layers + embedding + output over 8 stages gives rank 0 the embedding, the 3
    dense layers and 4 MoE layers, the most parameters of any rank; each block is unsharded in
    bf16 with an fp32 gradient for the step (no reshard after forward with PP, gradients
    accumulated over the microbatches); 1F1B's rank 0 holds min(8, pp) microbatches of layer
    inputs, plus one layer recomputed."""
    a = deepseekv3_args["671B"]
    mem = estimate.memory_per_gpu(a, _flagship_layout(), 8, SEQ, "full", 1, "1F1B")
    m = a.moe_args
    routed = 3 * m.num_experts * a.dim * a.moe_inter_dim
    moe_unit = estimate._moe_block_params(a) - routed + routed / 32
    held = 3 * estimate._dense_block_params(a) + 4 * moe_unit + a.vocab_size * a.dim
    assert mem.pipelined and mem.stages_per_rank == 1 and mem.microbatches_in_flight == 8
    assert mem.fsdp_working_set == pytest.approx(2 * held) and mem.grad_reduce == pytest.approx(4 * held)
    layer = estimate._act_bytes_per_token(a, True)
    assert mem.activations == pytest.approx(8 * SEQ * 7 * 2 * a.dim + SEQ * layer)
    assert mem.logits == 0  # the output and its logits are on rank 7
    assert mem.forward_end == pytest.approx(mem.params_and_optimizer + mem.fsdp_working_set + mem.grad_reduce
                                            + mem.activations)
    assert mem.total == max(mem.forward_end, mem.backward_end)


def test_memory_moves_with_the_schedule_and_microbatches():
    a = deepseekv3_args["671B"]
    lay = _flagship_layout()

    def act(schedule, local_batch, ac="full", layers_per_stage=None):
        return estimate.memory_per_gpu(a, lay, local_batch, SEQ, ac, 1, schedule, layers_per_stage)

    # 1F1B holds pp microbatches however many run; Interleaved1F1B (v = 2) holds (v - 1) x the
    # microbatches of a round + 2 (pp - 1) + 1 chunks of half a rank: 23 / 2 at 16 microbatches,
    # 30 / 2 at 15 (one round of 15)
    assert act("1F1B", 8).activations == act("1F1B", 32).activations
    assert act("Interleaved1F1B", 16).microbatches_in_flight == 11.5
    assert act("Interleaved1F1B", 15).microbatches_in_flight == 15
    assert act("Interleaved1F1B", 16, "none").activations > act("1F1B", 16, "none").activations
    # the zero-bubble V holds 2 pp chunks of half a rank: pp microbatches, as 1F1B
    assert act("ZBVZeroBubble", 16).microbatches_in_flight == 8
    # no AC keeps every activation of every microbatch in flight
    assert act("1F1B", 8, "none").activations > 20 * act("1F1B", 8, "full").activations
    assert act("Interleaved1F1B", 32, layers_per_stage=2).stages_per_rank == 4
    with pytest.raises(ValueError, match="1F1B needs at least pp = 8"):
        act("1F1B", 4)
