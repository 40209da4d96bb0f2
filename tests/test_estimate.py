"""`moe_comm.predict.estimate` against TorchTitan's own accounting, and `check` on the flagship recipe."""

import copy
from pathlib import Path

import pytest
import torch
from torchtitan.models.deepseek_v3 import deepseekv3_args, DeepSeekV3Model
from torchtitan.models.utils import get_moe_model_nparams_and_flops

from moe_comm.predict import estimate
from moe_comm.__main__ import main
from moe_comm.layout import flavors, Layout

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
    lay = Layout(2, 1, 2, 1, 2, 1, 1, 1, 2, 1)
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


def test_one_gpu_memory_hand_counted():
    """World 1: no fully_shard (no working set, no gradient reduce) and autocast instead - bf16
    copies of every weight but the embedding held to their backward (the routed experts' only
    without AC), the residual stream's tensors in fp32 - checked term by term."""
    flavors.register()
    a = deepseekv3_args["671B_layers_1gpu"]
    one = Layout(1, 1, 1, 1, 1, 1, 1, 1, 1, 1)
    assert not estimate.fsdp_applied(one) and estimate.autocast(one)
    assert estimate.fsdp_applied(Layout(2, 1, 2, 1, 1, 1, 2, 1, 2, 1))  # EP borrows: fully_shard
    assert not estimate.autocast(Layout(2, 1, 2, 1, 1, 1, 2, 1, 1, 1))  # TP without FSDP: fp32
    p = estimate.count_params(a)
    routed = 2 * 3 * a.moe_args.num_experts * a.dim * a.moe_inter_dim  # 2 MoE layers
    none = estimate.memory_per_gpu(a, one, 2, SEQ, "none")
    assert none.fsdp_working_set == 0 and none.grad_reduce == 0
    assert none.params_and_optimizer == 12 * p.total and none.gradients == 4 * p.total
    assert none.weight_copies == 2 * (p.total - p.embedding)
    extra = [2 * 2 * a.dim + 2 * a.dim * 2, 2 * 2 * a.dim + 2 * a.dim * 3, 2 * 2 * a.dim + 2 * a.dim * 3]  # dense, MoE, MoE
    bf16 = [estimate._act_bytes_per_token(a, i >= a.n_dense_layers) for i in range(3)]
    assert none.activations == pytest.approx(2 * SEQ * (sum(bf16) + sum(extra)))
    assert none.forward_end == pytest.approx(none.params_and_optimizer + none.weight_copies + none.activations
                                             + none.logits)
    full = estimate.memory_per_gpu(a, one, 2, SEQ, "full")
    assert full.weight_copies == 2 * (p.total - p.embedding - routed)  # the experts' casts recomputed
    assert full.peak_at == "end of backward" and full.total == 16 * p.total  # fp32 params, grads, moments
    # no fully_shard: the allocator's cache fitted on the one-GPU runs, not the 2xH200 ones
    assert none.reserved - none.total == pytest.approx(
        estimate.ALLOCATOR_CACHE_BYTES_PER_OUTPUT_PARAM_UNSHARDED * a.vocab_size * a.dim)
    # measured on one H200 (results/h200x1): 99.8 GiB in use at 2 x 4096 without AC, 86.0 with full AC
    assert none.total / estimate.GiB == pytest.approx(99.8, rel=0.05)
    assert full.total / estimate.GiB == pytest.approx(86.0, rel=0.03)


def _saved_bytes_per_logit(loss_fn, tokens: int = 256, vocab: int = 4096) -> dict[str, int]:
    """The distinct tensors of the logits' size TorchTitan's loss saves for its backward: their
    dtype -> bytes per logit."""
    x = torch.randn(1, tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    saved = {}

    def pack(t):
        if t.numel() == tokens * vocab:
            saved[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(x, labels)
    loss.backward()
    return {str(t.dtype): t.element_size() for t in saved.values()}


def test_the_compiled_loss_keeps_the_bf16_logits_alone():
    """logits_bytes: TorchTitan's eager cross-entropy saves the fp32 log-probabilities (4 B a
    logit, beside the bf16 logits the forward holds); compiled, it saves the bf16 logits and
    recomputes the softmax in its backward. Traced with inductor's partitioner (min-cut
    rematerialisation, which aot_eager_decomp_partition runs without generating kernels)."""
    from torchtitan.components.loss import cross_entropy_loss

    assert _saved_bytes_per_logit(cross_entropy_loss) == {"torch.float32": 4}
    compiled = torch.compile(cross_entropy_loss, backend="aot_eager_decomp_partition")
    assert _saved_bytes_per_logit(compiled) == {"torch.bfloat16": 2}
    assert (estimate.logits_bytes(False), estimate.logits_bytes(True)) == (2 + 4, 2)
    flavors.register()
    a, one = deepseekv3_args["671B_layers_1gpu"], Layout(1, 1, 1, 1, 1, 1, 1, 1, 1, 1)
    eager = estimate.memory_per_gpu(a, one, 2, SEQ, "none")
    loss_compiled = estimate.memory_per_gpu(a, one, 2, SEQ, "none", loss_compiled=True)
    assert eager.logits - loss_compiled.logits == 4 * 2 * SEQ * a.vocab_size  # 3.9 GiB at 2 x 4096
    assert eager.total - loss_compiled.total == pytest.approx(4 * 2 * SEQ * a.vocab_size)


def test_memory_estimate_is_close_to_measured_16b():
    # results/h200x2: 16B, FSDP 2, EP 2, 1 x 4096, full AC: 119.5 GiB in use, 127.5 reserved
    lay = Layout(2, 1, 2, 1, 2, 1, 1, 1, 2, 1)
    mem = estimate.memory_per_gpu(deepseekv3_args["16B"], lay, 1, SEQ, "full")
    assert mem.peak_at == "end of backward"
    assert mem.total / estimate.GiB == pytest.approx(119.5, rel=0.03)
    assert mem.reserved / estimate.GiB == pytest.approx(127.5, rel=0.03)


def test_memory_estimate_is_close_to_measured_671b_layers():
    # results/h200x2: 4 x 4096 without AC: 102.9 GiB in use (137.4 reserved, capped by the device)
    flavors.register()
    lay = Layout(2, 1, 2, 1, 2, 1, 1, 1, 2, 1)
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
    # every figure with its range; the recompute replays the comm (issue 37 item 1) and keeps its tensors
    assert "low-high" in out and "low-high: every unmeasured input at its pessimistic" in out
    assert "4 transfers each (the AC recompute replays what dispatch and combine returned" in out
    assert "6 transfers" not in out and "what the recompute keeps of dispatch and combine" in out
    # the flagship turns the per-call CUDA graphs off (their pools do not fit at its layout) ...
    assert "the MoE calls' CUDA graph pools" not in out
    # ... which, on, the memory line counts
    assert main(["check", "recipes/deepseek_v3_671b_b200.toml", "--skip-files", "--moe_comm.cuda_graphs", "true"]) == 0
    assert "the MoE calls' CUDA graph pools" in capsys.readouterr().out


def test_check_cli_on_the_one_gpu_recipe(capsys, monkeypatch):
    """EP 1 on one H200: the scale model prices the backends' local work (deepep refused there),
    and the memory line names autocast's weight copies instead of an FSDP working set."""
    monkeypatch.chdir(REPO)
    assert main(["check", "recipes/deepseek_v3_671b_h200x1.toml", "--skip-files"]) == 0
    out = capsys.readouterr().out
    assert "autocast's bf16 weight copies" in out and "no fully_shard" in out and "FSDP working set" not in out
    # the refusal is DeepEPBackend.check_run's own
    assert "expert_parallel_degree 1" in out and "(refused: [parallelism] expert_parallel_degree = 1: DeepEP has no one-rank" in out
    assert "<- this recipe" in out.split("\n  nvshmem ")[1].splitlines()[0]


def test_check_cli_reports_errors(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["check", "recipes/debug_cpu.toml", "--parallelism.expert_parallel_degree", "3"]) == 2
    assert "expert_parallel_degree = 3" in capsys.readouterr().err


def test_check_cli_on_flagship_with_nvshmem_prints_its_buffers(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["check", "recipes/deepseek_v3_671b_b200.toml", "--skip-files", "--moe_comm.backend", "nvshmem"]) == 0
    out = capsys.readouterr().out
    # EP 32 = 4 nodes of 8; 1 x 4096 tokens per microbatch; buffers at 1.25x the expected load
    assert "nvshmem     4 node(s) x 8 per EP group, 4096 tokens per call" in out
    assert "recv_capacity_factor 1.25" in out and "symmetric heap" in out
    assert "<- this recipe" in out.split("\n  nvshmem ")[1].splitlines()[0]


def test_check_counts_the_fp8_experts_row_alignment(capsys, monkeypatch):
    """The expert rows `check` prints are the backend's: with expert_dtype = "fp8" each expert's
    segment is padded to fp8_experts.ROW_ALIGN (128), not the bf16 grouped GEMM's 8, and the
    capacity is a whole number of ROW_ALIGN (as NvshmemBackend sizes it: fp8_experts.expert_rows)."""
    import re

    from moe_comm import fp8_experts
    from moe_comm.kernels import capacity

    monkeypatch.chdir(REPO)

    def expert_rows(*overrides):
        assert main(["check", "recipes/deepseek_v3_671b_h200x1.toml", "--skip-files", *overrides]) == 0
        return int(re.search(r"([\d,]+) expert rows", capsys.readouterr().out).group(1).replace(",", ""))

    bf16, fp8 = expert_rows(), expert_rows("--moe_comm.expert_dtype", "fp8", "--moe_comm.dispatch_dtype", "fp8")
    tokens, experts, top_k = 2 * 4096, 32, 8
    assert bf16 == capacity.expert_rows(tokens, experts, top_k, 1, 1.25, 8)
    padded = capacity.expert_rows(tokens, experts, top_k, 1, 1.25, fp8_experts.ROW_ALIGN)
    assert padded == bf16 + experts * (fp8_experts.ROW_ALIGN - 8)
    assert fp8 == -(-padded // fp8_experts.ROW_ALIGN) * fp8_experts.ROW_ALIGN == 69_632


def _flagship_layout(pp: int = 8) -> Layout:
    return Layout(256, 32, 8, 1, 256 // pp, 1, 1, pp, 32, 1)


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
    with pytest.raises(ValueError, match="1F1B needs at least 8 microbatches per step"):
        act("1F1B", 4)
