"""`[moe_comm] log_expert_counts`: the metrics processor, as TorchTitan's trainer wires it (its
optimizers with the aux-loss-free bias hook, then the model parts), writes each step's routed
tokens per expert per MoE layer before TorchTitan's bias update zeroes them - and that update
still happens. On CPU, one process, a tiny DeepSeek-V3 through TorchTitan's own MoE forward."""

import dataclasses
import json
import types

import pytest
import torch

import moe_comm.titan  # noqa: F401  the CPU adaptations
from moe_comm.metrics import build_metrics_processor, expert_counts

from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs
from torchtitan.models.moe import MoEArgs

TOKENS = (2, 16)  # local batch x seq


def _model(load_balance_coeff):
    args = DeepSeekV3ModelArgs(
        vocab_size=64, dim=32, inter_dim=64, moe_inter_dim=16, n_layers=3, n_dense_layers=1, n_heads=2,
        moe_args=MoEArgs(num_experts=8, num_shared_experts=1, top_k=2, score_func="sigmoid", route_norm=True,
                         score_before_experts=False, load_balance_coeff=load_balance_coeff, use_grouped_mm=False),
        q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        max_seq_len=TOKENS[1], attn_type="sdpa", attn_mask_type="causal")
    args.moe_impl = "standard"
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _processor(tmp_path, *extra):
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    job_config = ConfigManager().parse_args([
        "--job.custom_config_module", "moe_comm.config", "--job.dump_folder", str(tmp_path / "dump"),
        "--metrics.no-enable_wandb", "--training.local_batch_size", str(TOKENS[0]),
        "--training.seq_len", str(TOKENS[1]), "--model.flavor", "tiny", *extra])
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    processor = build_metrics_processor(job_config, dims)
    processor.num_flops_per_token = 1_000_000  # TorchTitan's trainer sets it
    return job_config, processor


def _train(tmp_path, steps, log_freq, load_balance_coeff=1e-3, log=True):
    """TorchTitan's order: build the processor, the model, the optimizers with its MoE load
    balancing hook, hand both to the processor; then per step forward/backward, step, log."""
    from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing

    job_config, processor = _processor(tmp_path, "--metrics.log_freq", str(log_freq),
                                       *(["--moe_comm.log_expert_counts"] if log else []))
    model = _model(load_balance_coeff)
    no_mesh = types.SimpleNamespace(get_optional_mesh=lambda name: None)
    optimizers = build_optimizers_with_moe_load_balancing([model], job_config.optimizer, no_mesh)
    processor.optimizers = optimizers
    processor.model_parts = [model]
    moes = [b.moe for b in model.layers.values() if b.moe_enabled]
    expected, biases = [], []
    tokens = torch.randint(0, 64, TOKENS, generator=torch.Generator().manual_seed(1))
    for step in range(1, steps + 1):
        before = [m.tokens_per_expert.clone() for m in moes]
        model(tokens).float().pow(2).mean().backward()
        expected.append([(m.tokens_per_expert - b).long().tolist() for m, b in zip(moes, before)])
        bias = [m.expert_bias.clone() for m in moes] if load_balance_coeff else None
        optimizers.step()
        optimizers.zero_grad()
        if load_balance_coeff:  # TorchTitan's update ran: counts zeroed, bias moved
            assert all(m.tokens_per_expert.sum() == 0 for m in moes)
            biases.append(all(not torch.equal(b, m.expert_bias) for b, m in zip(bias, moes)))
        processor.ntokens_since_last_log += TOKENS[0] * TOKENS[1]
        processor.data_loading_times.append(0.0)
        if step % log_freq == 0:
            processor.log(step, 1.0, 1.0, 0.5)
    processor.close()
    return processor, expected, biases


def _read(path):
    lines = [json.loads(line) for line in open(path)]
    return lines[0], lines[1:]


@pytest.mark.parametrize("log_freq", [1, 2])
def test_counts_are_read_before_torchtitans_bias_update(tmp_path, log_freq):
    processor, expected, biases = _train(tmp_path, 4, log_freq)
    run, steps = _read(tmp_path / "dump" / expert_counts.FOLDER / "rank0.jsonl")
    assert run["kind"] == "run" and run["layers"] == ["1", "2"] and run["num_experts"] == 8 and run["top_k"] == 2
    assert run["load_balance_coeff"] == 1e-3 and run["tokens_per_step"] == TOKENS[0] * TOKENS[1]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [s["counts"] for s in steps] == expected
    for s in steps:  # every token picks top_k experts in every MoE layer
        assert all(sum(layer) == TOKENS[0] * TOKENS[1] * 2 for layer in s["counts"])
    assert all(biases)  # the aux-loss-free bias was still updated every step
    assert processor.expert_counts._handle is None  # closed: the global hook is gone


def test_without_load_balancing_each_step_counts_its_own_tokens(tmp_path):
    _, expected, _ = _train(tmp_path, 3, 1, load_balance_coeff=None)
    run, steps = _read(tmp_path / "dump" / expert_counts.FOLDER / "rank0.jsonl")
    assert run["load_balance_coeff"] is None
    assert [s["counts"] for s in steps] == expected  # not TorchTitan's ever-growing totals


def test_off_by_default(tmp_path):
    processor, _, _ = _train(tmp_path, 2, 1, log=False)
    assert processor.expert_counts is None
    assert not (tmp_path / "dump" / expert_counts.FOLDER).exists()
