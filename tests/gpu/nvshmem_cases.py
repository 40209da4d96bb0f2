"""GPU correctness cases for the nvshmem backend, run under torchrun (1 or more GPUs).

One process group and one NVSHMEM start-up serve every case (start-up costs seconds), so the
cases run in one launch; each writes PASS/FAIL with its error to a JSON report that
tests/test_nvshmem_gpu.py turns into one pytest test per case.

Oracles (DeepEP's, plus references):
  - received rows equal a pure-torch expert-major layout built from every rank's tokens,
    bit for bit (rows are copies), padding rows zero;
  - per-expert counts equal an all-reduce of the routing histogram;
  - combine with unit weights divided by the fan-out equals the input;
  - outputs and gradients (x and routing weights) against a pure-torch reference and against
    the "nccl" backend.

Usage: torchrun --nproc_per_node N tests/gpu/nvshmem_cases.py REPORT.json
"""

import faulthandler
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from moe_comm.backends.base import MoELayerSpec
from moe_comm.backends.nvshmem import NvshmemBackend, receive_capacity
from moe_comm.config import MoEComm
from moe_comm.kernels.runtime import NvshmemRuntime

MAX_TOKENS = 1024
MAX_HIDDEN = 7168
ALIGN = 8  # TorchTitan's bf16 default


def routing(num_tokens, num_experts, top_k, mode, generator, device):
    """topk_idx [T, K] int64 and weights [T, K] float32, distinct experts per token."""
    if mode == "random":
        scores = torch.rand(num_tokens, num_experts, generator=generator, device=device)
        idx = scores.topk(top_k, dim=1).indices
    elif mode == "one_expert":  # every token's first pick is expert 0
        scores = torch.rand(num_tokens, num_experts, generator=generator, device=device)
        scores[:, 0] = 2.0
        idx = scores.topk(top_k, dim=1).indices
    else:
        raise ValueError(mode)
    w = torch.rand(num_tokens, top_k, generator=generator, device=device) + 0.1
    return idx.contiguous(), w.contiguous()


def gather_cpu(t):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t.detach().cpu())
    return out


def expert_params(num_experts, hidden, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = (torch.rand(num_experts, hidden, generator=g) + 0.5).to(device=device, dtype=dtype)
    b = (torch.rand(num_experts, hidden, generator=g) - 0.5).to(device=device, dtype=dtype)
    return a, b


def apply_experts(recv, tokens_per_expert, first_expert, a, b):
    """y = recv * a_e + b_e on each expert's segment (padding and tail rows stay zero)."""
    y = torch.zeros_like(recv)
    start = 0
    for e, n in enumerate(tokens_per_expert.tolist()):
        if n:
            y[start:start + n] = recv[start:start + n] * a[first_expert + e] + b[first_expert + e]
        start += n
    return y


def reference_layout(xs, idxs, rank, local_experts, align):
    rows, counts = [], []
    hidden, dtype = xs[0].shape[1], xs[0].dtype
    for e in range(rank * local_experts, (rank + 1) * local_experts):
        seg = [x[(idx == e).any(dim=1)] for x, idx in zip(xs, idxs)]
        seg = torch.cat(seg) if seg else torch.zeros(0, hidden, dtype=dtype)
        n = seg.shape[0]
        padded = (n + align - 1) // align * align
        rows.append(torch.cat([seg, torch.zeros(padded - n, hidden, dtype=dtype)]))
        counts.append(padded)
    return torch.cat(rows), torch.tensor(counts, dtype=torch.int32)


def reference_forward(x, idx, w, a, b):
    """out_t = sum_k w_tk * (x_t * a_e + b_e), all in fp32."""
    x32, a32, b32 = x.float(), a.float(), b.float()
    y = x32[:, None, :] * a32[idx] + b32[idx]  # [T, K, D]
    return (w[:, :, None] * y).sum(dim=1)


class Cases:
    def __init__(self):
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = dist.group.WORLD
        self.results = {}
        # Size the buffers once for the largest case (fp32 rows of the widest hidden).
        NvshmemRuntime.start(self.group, MAX_TOKENS, MAX_HIDDEN * 4)

    def backend(self, num_experts, top_k, hidden, factor=0.0, num_sms=20):
        layer = MoELayerSpec(num_experts=num_experts, top_k=top_k, hidden=hidden)
        config = MoEComm(backend="nvshmem", num_sms=num_sms, max_tokens_per_rank=MAX_TOKENS, recv_capacity_factor=factor)
        return NvshmemBackend(layer, self.group, config)

    def run(self, name, fn, *args):
        try:
            fn(*args)
            dist.barrier()
            self.results[name] = "PASS"
        except Exception:  # noqa: BLE001 - every failure goes to the report
            self.results[name] = "FAIL\n" + traceback.format_exc()
            print(f"[rank {self.rank}] {name} FAILED\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        if self.rank == 0:
            print(f"{name}: {self.results[name].splitlines()[0]}", flush=True)

    # ---- cases -------------------------------------------------------------------------
    def layout_and_combine(self, num_tokens, hidden, num_experts, top_k, dtype, mode, seed, zero_rank=None):
        g = torch.Generator(device=self.device).manual_seed(seed * 100 + self.rank)
        T = 0 if zero_rank == self.rank else num_tokens
        x = torch.randn(T, hidden, generator=g, device=self.device).to(dtype)
        idx, w = routing(T, num_experts, top_k, mode, g, self.device)
        backend = self.backend(num_experts, top_k, hidden)
        L = num_experts // self.world

        # Every collective first (both ranks must reach each one), then the assertions.
        result = backend.dispatch(x, idx, w)
        y_unit = result.recv_x_RD.clone()
        out_unit = backend.combine(y_unit, result.handle)
        torch.cuda.synchronize()
        backend.check_errors(synchronize=True)
        # Fan-out oracle: unit weights, then divide by K.
        r1 = backend.dispatch(x, idx, torch.ones_like(w))
        out1 = backend.combine(r1.recv_x_RD, r1.handle)
        xs, idxs = gather_cpu(x), gather_cpu(idx)
        # DeepEP's oracle: per-expert counts against an all-reduce of the routing histogram.
        hist = torch.bincount(idx.flatten(), minlength=num_experts).to(torch.int64)
        dist.all_reduce(hist)

        ref_rows, ref_counts = reference_layout(xs, idxs, self.rank, L, ALIGN)
        counts = result.tokens_per_expert_L.cpu()
        assert torch.equal(counts, ref_counts), f"tokens_per_expert {counts.tolist()} != {ref_counts.tolist()}"
        true_counts = hist[self.rank * L:(self.rank + 1) * L].cpu()
        padded = (true_counts + ALIGN - 1) // ALIGN * ALIGN
        assert torch.equal(padded.to(torch.int32), counts), "counts disagree with the all-reduced histogram"
        n = int(counts.sum())
        assert n <= result.recv_x_RD.shape[0]
        assert torch.equal(result.recv_x_RD[:n].cpu(), ref_rows), "received rows differ from the reference layout"

        # combine(dispatch(x)) with the routing weights == x * sum_k w_k (identity experts).
        expected = (x.float() * w.sum(dim=1, keepdim=True)).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        err = (out_unit.float() - expected.float()).abs().max().item() if T else 0.0
        assert err <= tol * max(1.0, expected.float().abs().max().item() if T else 1.0), f"combine error {err}"
        if T:
            fan = (out1.float() / top_k - x.float()).abs().max().item()
            limit = (1e-6 if dtype == torch.float32 else 1e-2) * max(1.0, x.float().abs().max().item())
            assert fan <= limit, f"combine/fan-out differs from x by {fan}"

    def forward_backward(self, num_tokens, hidden, num_experts, top_k, dtype, seed, compare_nccl):
        g = torch.Generator(device=self.device).manual_seed(seed * 7 + self.rank)
        x = torch.randn(num_tokens, hidden, generator=g, device=self.device).to(dtype).requires_grad_(True)
        idx, w0 = routing(num_tokens, num_experts, top_k, "random", g, self.device)
        w = w0.clone().requires_grad_(True)
        grad_out = torch.randn(num_tokens, hidden, generator=g, device=self.device).to(dtype)
        a, b = expert_params(num_experts, hidden, dtype, self.device, seed)
        L = num_experts // self.world

        def run(backend):
            xx = x.detach().clone().requires_grad_(True)
            ww = w.detach().clone().requires_grad_(True)
            res = backend.dispatch(xx, idx, ww)
            y = apply_experts(res.recv_x_RD, res.tokens_per_expert_L, self.rank * L, a, b)
            out = backend.combine(y, res.handle)
            (out.float() * grad_out.float()).sum().backward()
            return out.detach(), xx.grad, ww.grad

        # Both backends run (collectives on every rank) before the first assertion.
        out, gx, gw = run(self.backend(num_experts, top_k, hidden))
        if compare_nccl:
            from moe_comm.backends.nccl import NcclBackend

            layer = MoELayerSpec(num_experts=num_experts, top_k=top_k, hidden=hidden)
            o2, gx2, gw2 = run(NcclBackend(layer, self.group, MoEComm(backend="nccl")))
        # Pure-torch reference on this rank's tokens (experts are elementwise, so no gather).
        xr = x.detach().float().clone().requires_grad_(True)
        wr = w.detach().clone().requires_grad_(True)
        ref = reference_forward(xr, idx, wr, a, b)
        (ref * grad_out.float()).sum().backward()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        scale = lambda t: max(1.0, t.abs().max().item())  # noqa: E731
        assert (out.float() - ref.detach()).abs().max().item() <= tol * scale(ref), "forward differs from reference"
        assert (gx.float() - xr.grad).abs().max().item() <= tol * scale(xr.grad), "grad x differs from reference"
        # grad w is a dot product over hidden: bf16 inputs put its error near 1e-2 relative.
        gw_tol = 1e-4 if dtype == torch.float32 else 5e-2
        assert (gw - wr.grad).abs().max().item() <= gw_tol * scale(wr.grad), "grad w differs from reference"
        if compare_nccl:
            assert (out.float() - o2.float()).abs().max().item() <= tol * scale(o2.float()), "forward differs from nccl"
            assert (gx.float() - gx2.float()).abs().max().item() <= tol * scale(gx2.float()), "grad x differs from nccl"
            assert (gw - gw2).abs().max().item() <= gw_tol * scale(gw2), "grad w differs from nccl"

    def many_calls(self, hidden, num_experts, top_k, calls):
        """Changing routing every call, dispatches back to back (the barrier path) included."""
        backend = self.backend(num_experts, top_k, hidden)
        errors = []  # asserted after the loop, so every rank makes every call
        for i in range(calls):
            g = torch.Generator(device=self.device).manual_seed(1000 + i * 31 + self.rank)
            T = 1 + (i * 97) % MAX_TOKENS
            x = torch.randn(T, hidden, generator=g, device=self.device, dtype=torch.bfloat16)
            idx, w = routing(T, num_experts, top_k, "random", g, self.device)
            res = backend.dispatch(x, idx, w)
            if i % 5 == 4:  # two dispatches in a row, then combine the second
                res = backend.dispatch(x, idx, w)
            out = backend.combine(res.recv_x_RD, res.handle)
            expected = x.float() * w.sum(dim=1, keepdim=True)
            err = (out.float() - expected).abs().max().item()
            if err > 2e-2 * max(1.0, expected.abs().max().item()):
                errors.append(f"call {i}: error {err}")
        backend.check_errors(synchronize=True)
        assert not errors, errors

    def capacity_overflow(self):
        """All tokens to one rank's experts with a small capacity: the error names the field."""
        hidden, num_experts, top_k = 256, 8 * self.world, 2
        backend = self.backend(num_experts, top_k, hidden, factor=0.1)
        T = 512
        x = torch.randn(T, hidden, device=self.device, dtype=torch.bfloat16)
        idx = torch.stack([torch.zeros(T, dtype=torch.int64), torch.ones(T, dtype=torch.int64)], dim=1).to(self.device)
        w = torch.ones(T, top_k, device=self.device)
        res = backend.dispatch(x, idx, w)
        backend.combine(res.recv_x_RD, res.handle)
        # Until the host raises, the counts are clamped so the grouped GEMM stays inside recv_x.
        rows_counted = int(res.tokens_per_expert_L.sum())
        raised = None
        try:
            backend.check_errors(synchronize=True)
        except RuntimeError as e:
            raised = str(e)
        NvshmemRuntime.errors(clear=True)
        dist.barrier()
        assert rows_counted <= res.recv_x_RD.shape[0], f"counts {rows_counted} exceed capacity {res.recv_x_RD.shape[0]}"
        if self.rank == 0:
            assert raised is not None and "recv_capacity_factor" in raised, f"no capacity error: {raised}"

    def cuda_graph(self, hidden, num_experts, top_k):
        """Dispatch + combine captured once and replayed on new inputs: no host sync inside."""
        backend = self.backend(num_experts, top_k, hidden)
        T = 256
        x = torch.zeros(T, hidden, device=self.device, dtype=torch.bfloat16)
        idx = torch.zeros(T, top_k, device=self.device, dtype=torch.int64)
        w = torch.zeros(T, top_k, device=self.device)

        def fill(seed):
            g = torch.Generator(device=self.device).manual_seed(seed + self.rank)
            x.copy_(torch.randn(T, hidden, generator=g, device=self.device))
            i2, w2 = routing(T, num_experts, top_k, "random", g, self.device)
            idx.copy_(i2)
            w.copy_(w2)

        fill(1)
        res = backend.dispatch(x, idx, w)  # warm up (starts NVSHMEM state)
        backend.combine(res.recv_x_RD, res.handle)
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            res = backend.dispatch(x, idx, w)
            out = backend.combine(res.recv_x_RD, res.handle)
        errors = []  # asserted after the loop, so every rank replays every time
        for seed in (2, 3, 4):
            fill(seed)
            torch.cuda.synchronize()
            dist.barrier()
            graph.replay()
            torch.cuda.synchronize()
            expected = x.float() * w.sum(dim=1, keepdim=True)
            err = (out.float() - expected).abs().max().item()
            if err > 2e-2 * max(1.0, expected.abs().max().item()):
                errors.append(f"replay {seed}: error {err}")
        assert not errors, errors

    def bad_input(self):
        backend = self.backend(8 * self.world, 2, 256)
        x = torch.randn(MAX_TOKENS + 1, 256, device=self.device, dtype=torch.bfloat16)
        idx = torch.zeros(MAX_TOKENS + 1, 2, device=self.device, dtype=torch.int64)
        try:
            backend.dispatch(x, idx, torch.ones(MAX_TOKENS + 1, 2, device=self.device))
        except ValueError as e:
            assert "max_tokens_per_rank" in str(e)
        else:
            raise AssertionError("too many tokens were accepted")
        try:
            self.backend(7 * self.world + 1, 2, 256)
        except ValueError as e:
            assert "expert_parallel_degree" in str(e) or self.world == 1
        else:
            assert self.world == 1, "num_experts not divisible by EP was accepted"


def main():
    faulthandler.enable()
    report = sys.argv[1]
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    c = Cases()
    bf16, fp32 = torch.bfloat16, torch.float32
    c.run("layout_random_h7168_top8_bf16", c.layout_and_combine, 512, 7168, 32 * c.world, 8, bf16, "random", 1)
    c.run("layout_random_h2048_top8_fp32", c.layout_and_combine, 512, 2048, 32 * c.world, 8, fp32, "random", 2)
    c.run("layout_top1_h2048_bf16", c.layout_and_combine, 512, 2048, 8 * c.world, 1, bf16, "random", 3)
    c.run("layout_one_expert_top1", c.layout_and_combine, 512, 2048, 8 * c.world, 1, bf16, "one_expert", 4)
    c.run("layout_one_expert_top8", c.layout_and_combine, 300, 2048, 16 * c.world, 8, fp32, "one_expert", 5)
    c.run("layout_256_experts_uneven", c.layout_and_combine, 1000, 2048, 256, 8, bf16, "random", 6)
    c.run("layout_zero_tokens_on_last_rank", c.layout_and_combine, 256, 2048, 8 * c.world, 4, bf16, "random", 7,
          c.world - 1)
    compare = c.world > 1
    c.run("grad_h2048_top6_fp32", c.forward_backward, 384, 2048, 16 * c.world, 6, fp32, 8, compare)
    c.run("grad_h7168_top8_bf16", c.forward_backward, 256, 7168, 32 * c.world, 8, bf16, 9, compare)
    c.run("many_calls_changing_routing", c.many_calls, 2048, 32 * c.world, 8, 25)
    c.run("capacity_overflow_raises", c.capacity_overflow)
    c.run("cuda_graph_replay", c.cuda_graph, 2048, 16 * c.world, 8)
    c.run("bad_input_errors", c.bad_input)
    per_rank = [None] * c.world
    dist.all_gather_object(per_rank, c.results)
    merged = {}
    for name in c.results:
        failures = [f"rank {r}: {res[name]}" for r, res in enumerate(per_rank) if res[name] != "PASS"]
        merged[name] = "PASS" if not failures else "FAIL\n" + "\n".join(failures)
    if c.rank == 0:
        with open(report, "w") as f:
            json.dump({"world": c.world, "results": merged}, f, indent=1)
    dist.barrier()
    NvshmemRuntime._current.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
