"""GPU correctness cases for the deepep backend (TorchTitan 0.2.2's DeepEP path over DeepEP
v1.2.1), under the same oracles as the nvshmem kernels (tests/gpu/oracles.py).

DeepEP lays out an expert's rows in its own order and does not pad segments, so the layout
oracle compares each expert's rows as a set, with exact (unpadded) counts. With more ranks than
GPUs the ranks share GPUs under CUDA MPS over a gloo group (DeepEP exchanges its IPC handles
through the group), as in tests/gpu/nvshmem_cases.py.

Usage: torchrun --nproc_per_node N tests/gpu/deepep_cases.py REPORT.json
"""

import faulthandler
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from case_runner import CaseLog, start_group  # noqa: E402
import overlap_cases  # noqa: E402
from oracles import apply_experts, expert_params, gather_cpu, reference_forward, reference_layout, routing  # noqa: E402

from moe_comm.backends.base import MoELayerSpec  # noqa: E402
from moe_comm.backends.deepep import DeepEPBackend  # noqa: E402
from moe_comm.config import MoEComm  # noqa: E402

NUM_SMS = int(os.environ.get("MOE_COMM_TEST_NUM_SMS", "20"))


def same_rows(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal as multisets of rows: sorted by a random projection, then compared bit for bit."""
    if got.shape != want.shape:
        return False
    if got.numel() == 0:
        return True
    key = torch.randn(got.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    order_g = (got.double() @ key).argsort()
    order_w = (want.double() @ key).argsort()
    return torch.equal(got[order_g], want[order_w])


class Cases:
    def __init__(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = dist.group.WORLD
        self.cpu_collectives = dist.get_backend(self.group) == "gloo"

    def backend(self, num_experts, top_k, hidden):
        layer = MoELayerSpec(num_experts=num_experts, top_k=top_k, hidden=hidden)
        return DeepEPBackend(layer, self.group, MoEComm(backend="deepep", num_sms=NUM_SMS))

    def layout_and_combine(self, num_tokens, hidden, num_experts, top_k, mode, seed):
        g = torch.Generator().manual_seed(seed * 100 + self.rank)
        x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16).to(self.device)
        idx, w = routing(num_tokens, num_experts, top_k, mode, g, self.device, self.rank, self.world, self.world)
        backend = self.backend(num_experts, top_k, hidden)
        L = num_experts // self.world
        res = backend.dispatch(x, idx, w)
        recv = res.recv_x_RD.clone()
        counts = res.tokens_per_expert_L.cpu()
        out_w = backend.combine(recv, res.handle)
        r1 = backend.dispatch(x, idx, torch.ones_like(w))
        out1 = backend.combine(r1.recv_x_RD, r1.handle)
        torch.cuda.synchronize()
        xs, idxs = gather_cpu(x), gather_cpu(idx)
        hist = torch.bincount(idx.flatten().cpu(), minlength=num_experts)
        hist = hist.to(self.device if not self.cpu_collectives else "cpu")
        dist.all_reduce(hist)
        hist = hist.cpu()

        _, ref_counts = reference_layout(xs, idxs, self.rank, L, 1)
        assert torch.equal(counts.to(torch.int32), ref_counts), f"tokens_per_expert {counts.tolist()} != {ref_counts.tolist()}"
        assert torch.equal(hist[self.rank * L:(self.rank + 1) * L].to(torch.int32), ref_counts), "counts vs histogram"
        start = 0
        recv_cpu = recv.cpu()
        for e, n in enumerate(ref_counts.tolist()):
            want = torch.cat([xx[(ii == self.rank * L + e).any(dim=1)] for xx, ii in zip(xs, idxs)])
            assert same_rows(recv_cpu[start:start + n], want), f"expert {e}: received rows differ"
            start += n
        expected = x.float() * w.sum(dim=1, keepdim=True)
        err = (out_w.float() - expected).abs().max().item()
        assert err <= 2e-2 * max(1.0, expected.abs().max().item()), f"combine error {err}"
        fan = (out1.float() / top_k - x.float()).abs().max().item()
        assert fan <= 1e-2 * max(1.0, x.float().abs().max().item()), f"combine/fan-out differs from x by {fan}"

    def forward_backward(self, num_tokens, hidden, num_experts, top_k, seed):
        g = torch.Generator().manual_seed(seed * 7 + self.rank)
        dtype = torch.bfloat16
        x = torch.randn(num_tokens, hidden, generator=g).to(dtype).to(self.device).requires_grad_(True)
        idx, w0 = routing(num_tokens, num_experts, top_k, "random", g, self.device)
        w = w0.clone().requires_grad_(True)
        grad_out = torch.randn(num_tokens, hidden, generator=g).to(dtype).to(self.device)
        a, b = expert_params(num_experts, hidden, dtype, self.device, seed)
        backend = self.backend(num_experts, top_k, hidden)
        res = backend.dispatch(x, idx, w)
        y = apply_experts(res.recv_x_RD, res.tokens_per_expert_L, self.rank * (num_experts // self.world), a, b)
        out = backend.combine(y, res.handle)
        (out.float() * grad_out.float()).sum().backward()
        torch.cuda.synchronize()
        xr = x.detach().float().cpu().requires_grad_(True)
        wr = w.detach().cpu().clone().requires_grad_(True)
        ref = reference_forward(xr, idx.cpu(), wr, a.cpu(), b.cpu())
        (ref * grad_out.float().cpu()).sum().backward()
        for what, got, want, tol in (("forward", out.detach().cpu(), ref.detach(), 3e-2),
                                     ("grad x", x.grad.cpu(), xr.grad, 3e-2),
                                     ("grad w", w.grad.cpu(), wr.grad, 5e-2)):
            err = (got.float() - want.float()).abs().max().item()
            assert err <= tol * max(1.0, want.float().abs().max().item()), f"{what} differs from the reference by {err}"

    def overlap_calls_in_flight(self, hidden, num_experts, top_k, iters):
        """The chunked overlap's calls by hand on the comm stream (tests/gpu/overlap_cases.py);
        at least 2 tokens a rank, so no chunk is empty."""
        def route(T, E, K, mode, g):
            return routing(T, E, K, mode, g, self.device)

        overlap_cases.calls_in_flight(self.rank, self.world, self.device, route, self.backend(num_experts, top_k, hidden),
                                      hidden, num_experts, top_k, iters, min_tokens=2)

    def overlap_microbatch_calls(self, hidden, num_experts, top_k, iters):
        """One microbatch's forward calls beside another's backward in two threads meeting at the
        sync points (tests/gpu/overlap_cases.py)."""
        def route(T, E, K, mode, g):
            return routing(T, E, K, mode, g, self.device)

        overlap_cases.microbatch_calls_in_flight(self.rank, self.world, self.device, route,
                                                 self.backend(num_experts, top_k, hidden), hidden, num_experts,
                                                 top_k, iters)


def main():
    faulthandler.enable()
    report = sys.argv[1]
    gpus = start_group()
    c = Cases()
    W = c.world
    log = CaseLog()
    log.run("layout_random_h7168_top8", c.layout_and_combine, 512, 7168, 32 * W, 8, "random", 1)
    log.run("layout_one_expert_h2048_top8", c.layout_and_combine, 300, 2048, 16 * W, 8, "one_expert", 2)
    log.run("layout_zipf_h2048_top6", c.layout_and_combine, 400, 2048, 16 * W, 6, "zipf", 3)
    log.run("layout_top1_h2048", c.layout_and_combine, 256, 2048, 8 * W, 1, "random", 4)
    log.run("grad_h2048_top6", c.forward_backward, 256, 2048, 16 * W, 6, 5)
    log.run("grad_h7168_top8", c.forward_backward, 256, 7168, 32 * W, 8, 6)
    log.run("overlap_calls_in_flight", c.overlap_calls_in_flight, 2048, 16 * W, 8, 20)
    log.run("overlap_microbatch_calls_in_flight", c.overlap_microbatch_calls, 2048, 16 * W, 8, 10)
    merged = log.merged()
    if c.rank == 0:
        with open(report, "w") as f:
            json.dump({"world": W, "gpus": gpus, "results": merged}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
