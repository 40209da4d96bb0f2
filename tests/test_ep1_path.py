"""The backend serves the MoE layers at EP 1 too (one rank holds every expert).

- The nccl backend at EP 1 is TorchTitan's own local path op for op: forward and every gradient
  equal TorchTitan's `MoE` (its `indices_padding_wrapper` around the grouped GEMM) bit for bit.
- Our parallelize attaches the recipe's backend at EP 1 without sharding the experts, and the
  experts run the backend's rows as they are (no second padding permute).
- The deepep backend is refused at EP 1 before launch (tests/test_backend_checks.py); the nvshmem
  kernels at EP 1 are GPU cases (tests/gpu/nvshmem_cases.py, world 1).
"""

import copy

import pytest
import torch

import moe_comm.titan  # noqa: F401  the CPU adaptations (histc on ids, the CPU permute)
from moe_comm.backends import build_backend
from moe_comm.backends.base import MoELayerSpec
from moe_comm.config import MoEComm


def _moe_pair(dtype):
    """TorchTitan's MoE and ours, same weights (debugmodel's MoE shape, 8 experts, top-3)."""
    from torchtitan.models.moe import MoE
    from torchtitan.models.moe.moe import MoEArgs

    from moe_comm.titan.model import TokenLevelMoE

    args = MoEArgs(num_experts=8, num_shared_experts=1, top_k=3, score_func="softmax", route_norm=False)
    torch.manual_seed(0)
    titan = MoE(args, dim=64, hidden_dim=32)
    for p in titan.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = TokenLevelMoE(args, dim=64, hidden_dim=32)
    ours.load_state_dict(titan.state_dict())
    return titan.to(dtype), ours.to(dtype), args


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nccl_at_ep1_is_titans_local_path_to_the_bit(group, dtype):
    titan, ours, args = _moe_pair(dtype)
    ours.comm_backend = build_backend(MoEComm(backend="nccl"), MoELayerSpec(args.num_experts, args.top_k, 64, args.score_before_experts), group)
    ours.experts.rows_from_backend = True
    x = torch.randn(2, 37, 64, dtype=dtype)  # 74 tokens: segments that need padding
    x_titan, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_titan, out_ours = titan(x_titan), ours(x_ours)
    assert torch.equal(out_titan, out_ours)
    g = torch.randn_like(out_titan)
    out_titan.backward(g)
    out_ours.backward(g)
    assert torch.equal(x_titan.grad, x_ours.grad)
    ours_params = dict(ours.named_parameters())
    for name, p in titan.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, ours_params[name].grad), name


def test_experts_do_not_pad_backend_rows_again(group, monkeypatch):
    """Rows a backend laid out go straight to the grouped GEMM: TorchTitan's padding wrapper (a
    gather and a scatter of every row) is not called, and each expert's rows get that expert's
    weights (checked against a per-expert bf16 matmul)."""
    from torchtitan.models.moe import moe as titan_moe

    _, ours, _ = _moe_pair(torch.float32)
    ours.experts.rows_from_backend = True

    def no_second_padding(fn):
        raise AssertionError("TorchTitan's indices_padding_wrapper ran on rows a backend already padded")

    monkeypatch.setattr(titan_moe, "indices_padding_wrapper", no_second_padding)
    counts = torch.tensor([8, 0, 16, 8, 0, 0, 8, 8], dtype=torch.int32)  # multiples of the alignment
    x = torch.randn(int(counts.sum()), 64)
    y = ours.experts(x, counts)
    w1, w2, w3 = (w.detach().bfloat16() for w in (ours.experts.w1, ours.experts.w2, ours.experts.w3))
    start = 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + n].bfloat16()
        ref = ((torch.nn.functional.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T).float()
        torch.testing.assert_close(y[start:start + n], ref, rtol=2e-2, atol=2e-2)
        start += n


def test_parallelize_attaches_the_backend_at_ep1(group, tmp_path):
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.train_spec import get_train_spec

    from moe_comm.metrics.instrumented import InstrumentedBackend
    from moe_comm.titan.parallelize import parallelize_deepseekv3_moe_comm

    config = ConfigManager().parse_args([
        "--job.config_file", "recipes/debug_cpu.toml", "--parallelism.expert_parallel_degree", "1",
        "--parallelism.data_parallel_shard_degree", "1", "--job.dump_folder", str(tmp_path),
    ])
    spec = get_train_spec(config.model.name)
    model_args = copy.deepcopy(spec.model_args[config.model.flavor])
    model_args.update_from_config(config)
    model = spec.model_cls(model_args)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    parallelize_deepseekv3_moe_comm(model, dims, config)
    moes = [b.moe for b in model.layers.values() if b.moe_enabled]
    assert moes
    for moe in moes:
        assert isinstance(moe.comm_backend, InstrumentedBackend)
        assert moe.comm_backend.backend.name == "nccl" and moe.comm_backend.backend.ep_size == 1
        assert moe.experts.rows_from_backend
        assert not hasattr(moe.experts.w1, "device_mesh")  # not sharded at EP 1
    x = torch.randint(0, model_args.vocab_size, (1, 16))
    assert model(x).shape == (1, 16, model_args.vocab_size)
