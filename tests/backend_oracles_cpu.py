"""The backend oracles of tests/gpu/nvshmem_cases.py, run on CPU (gloo) against the "nccl"
backend, so every backend answers to the same checks (the nvshmem ones run on the GPU).

`run_rank(rank, world, port, report)` is one gloo rank of them (tests/ranks.py starts them); rank 0
writes every case's verdict to `report`.
"""

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
from oracles import (  # noqa: E402
    apply_experts,
    expert_params,
    gather_cpu,
    reference_forward,
    reference_layout,
    routing,
)

from metrics_fakes import init_gloo  # noqa: E402
from moe_comm.backends.base import MoELayerSpec  # noqa: E402
from moe_comm.backends.nccl import NcclBackend  # noqa: E402
from moe_comm.config import MoEComm  # noqa: E402
from moe_comm.titan import cpu  # noqa: E402

ALIGN = 8  # TorchTitan's bf16 default TOKEN_GROUP_ALIGN_SIZE_M


def backend(num_experts, top_k, hidden):
    layer = MoELayerSpec(num_experts=num_experts, top_k=top_k, hidden=hidden)
    return NcclBackend(layer, dist.group.WORLD, MoEComm(backend="nccl"))


def layout_and_fan_out(num_tokens, hidden, num_experts, top_k, dtype, mode, seed):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    idx, w = routing(num_tokens, num_experts, top_k, mode, g, "cpu")
    b = backend(num_experts, top_k, hidden)
    L = num_experts // world
    # Every collective first, then the checks: a check failing on one rank only must not leave
    # the other waiting in a collective.
    res = b.dispatch(x, idx, w)
    ref_rows, ref_counts = reference_layout(gather_cpu(x), gather_cpu(idx), rank, L, ALIGN)
    hist = torch.bincount(idx.flatten(), minlength=num_experts)
    dist.all_reduce(hist)
    r1 = b.dispatch(x, idx, torch.ones_like(w))
    out1 = b.combine(r1.recv_x_RD, r1.handle)

    counts = res.tokens_per_expert_L.to(torch.int32)
    assert torch.equal(counts, ref_counts), f"tokens_per_expert {counts.tolist()} != {ref_counts.tolist()}"
    padded = (hist[rank * L:(rank + 1) * L] + ALIGN - 1) // ALIGN * ALIGN
    assert torch.equal(padded.to(torch.int32), counts), "counts disagree with the all-reduced histogram"
    n = int(counts.sum())
    assert torch.equal(res.recv_x_RD[:n], ref_rows), "received rows differ from the reference layout"
    fan = (out1.float() / top_k - x.float()).abs().max().item()
    assert fan <= 1e-6 * max(1.0, x.float().abs().max().item()), f"combine/fan-out differs from x by {fan}"


def forward_backward(num_tokens, hidden, num_experts, top_k, seed):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed * 7 + rank)
    x = torch.randn(num_tokens, hidden, generator=g).requires_grad_(True)
    idx, w0 = routing(num_tokens, num_experts, top_k, "random", g, "cpu")
    w = w0.clone().requires_grad_(True)
    grad_out = torch.randn(num_tokens, hidden, generator=g)
    a, b_ = expert_params(num_experts, hidden, torch.float32, "cpu", seed)
    be = backend(num_experts, top_k, hidden)
    res = be.dispatch(x, idx, w)
    y = apply_experts(res.recv_x_RD, res.tokens_per_expert_L, rank * (num_experts // world), a, b_)
    out = be.combine(y, res.handle)
    (out * grad_out).sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    wr = w.detach().clone().requires_grad_(True)
    ref = reference_forward(xr, idx, wr, a, b_)
    (ref * grad_out).sum().backward()
    for name, got, want in (("forward", out.detach(), ref.detach()), ("grad x", x.grad, xr.grad), ("grad w", w.grad, wr.grad)):
        err = (got - want).abs().max().item()
        assert err <= 1e-4 * max(1.0, want.abs().max().item()), f"{name} differs from the reference by {err}"


def run_rank(rank: int, world: int, port: int, report: str) -> None:
    cpu.apply()
    init_gloo(rank, world, port)
    cases = {
        "layout_random_top8_fp32": (layout_and_fan_out, (256, 64, 16, 8, torch.float32, "random", 1)),
        "layout_one_expert_top2_bf16": (layout_and_fan_out, (128, 64, 8, 2, torch.bfloat16, "one_expert", 2)),
        "layout_top1_fp32": (layout_and_fan_out, (200, 32, 8, 1, torch.float32, "random", 3)),
        "forward_backward_top6": (forward_backward, (96, 64, 16, 6, 4)),
    }
    results = {}
    for name, (fn, args) in cases.items():
        try:
            fn(*args)
            results[name] = "PASS"
        except Exception:  # noqa: BLE001 - every failure goes to the report
            results[name] = "FAIL\n" + traceback.format_exc()
        dist.barrier()
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, results)
    if dist.get_rank() == 0:
        merged = {name: ("PASS" if all(r[name] == "PASS" for r in per_rank)
                         else "\n".join(f"rank {i}: {r[name]}" for i, r in enumerate(per_rank) if r[name] != "PASS"))
                  for name in cases}
        with open(report, "w") as f:
            json.dump(merged, f, indent=1)
    dist.destroy_process_group()
