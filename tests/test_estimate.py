"""`moe_comm.estimate` against TorchTitan's own accounting, and `check` on the flagship recipe."""

import copy
from pathlib import Path

import pytest
import torch
from torchtitan.models.deepseek_v3 import deepseekv3_args, DeepSeekV3Model
from torchtitan.models.utils import get_moe_model_nparams_and_flops

from moe_comm import estimate
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


def test_memory_estimate_is_close_to_measured_16b():
    # NOTES §1: 16B, FSDP 2, EP 2, 1 x 4096, full AC measured 127 GB per H200
    lay = estimate.Layout(2, 1, 2, 1, 2, 1, 1, 1, 2, 1)
    mem = estimate.memory_per_gpu(deepseekv3_args["16B"], lay, 1, SEQ, "full")
    assert 110e9 < mem.total < 145e9


def test_comm_volume_counts():
    lay = estimate.Layout(2, 1, 2, 1, 2, 1, 1, 1, 2, 1)
    args = deepseekv3_args["debugmodel"]
    vol = estimate.comm_volume(args, lay, 2, 256)
    assert vol.rows_per_layer == 2 * 256 * args.moe_args.top_k
    assert vol.remote_fraction == 0.5
    assert 0 < vol.dedup_rows_per_layer < vol.rows_per_layer * vol.remote_fraction
    moe_layers = args.n_layers - args.n_dense_layers
    assert vol.bytes_per_step == 4 * vol.rows_per_layer * 0.5 * args.dim * 2 * moe_layers


def test_check_cli_on_flagship(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["check", "recipes/deepseek_v3_671b_b200.toml", "--skip-files"]) == 0
    out = capsys.readouterr().out
    assert "671.03B params, 37.55B active, 281.2 GFLOP/token" in out
    assert "world 256 = 32 node(s) x 8" in out and "pp 8, ep 32" in out
    assert "memory/GPU" in out and "fits" in out and "MoE comm" in out


def test_check_cli_reports_errors(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["check", "recipes/debug_cpu.toml", "--parallelism.expert_parallel_degree", "3"]) == 2
    assert "expert_parallel_degree = 3" in capsys.readouterr().err
