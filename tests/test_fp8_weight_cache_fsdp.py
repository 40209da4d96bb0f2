"""The FP8 experts' WeightCache under FSDP2 (gloo, 2 ranks, CPU: moe_comm.kernels.fp8 runs the
pure-torch maths here). FSDP2 writes each step's all-gathered weights into the unsharded
parameters with their version counters preserved, so a cache keyed on versions alone would serve
the last step's e4m3 weights after the optimizer changed them; the cache also keys on the
optimizer steps taken. Three steps of two microbatches each, with FSDP resharding after the
forward and backward (no PP: each microbatch gathers anew, and the cache may miss) and as torch's
pipeline schedules run a stage (no reshard until the step's last backward): every output and
gradient equals the uncached model's bit for bit, and under PP's settings the weights are
quantised once per step."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import ranks
from metrics_fakes import free_port, init_gloo

L, D, I = 4, 64, 32
PADDED = [16, 0, 48, 32]


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(L, I, D, generator=g) * 0.1)
        self.w2 = nn.Parameter(torch.randn(L, D, I, generator=g) * 0.1)
        self.w3 = nn.Parameter(torch.randn(L, I, D, generator=g) * 0.1)
        self.cache = None

    def forward(self, carrier, rows, counts):
        from moe_comm import fp8_experts

        return fp8_experts.grouped_experts(self.w1, self.w2, self.w3, carrier, rows, counts, cache=self.cache)


def _worker(rank, port, results):
    init_gloo(rank, 2, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from moe_comm import fp8_experts
    from moe_comm.fp8_experts import Fp8Rows
    from moe_comm.kernels import fp8_reference as ref

    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(sum(PADDED), D, generator=g).to(torch.bfloat16)
    rows = Fp8Rows(*ref.quantise_rows(x, ref.MIN_AMAX_ROWS))
    counts = torch.tensor(PADDED, dtype=torch.int32)
    for reshard in (True, False):
        outs, made, versions = {}, None, []
        for cached in (False, True):
            model = Experts()
            model.cache = fp8_experts.WeightCache() if cached else None
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            got = []
            for step in range(3):
                for mb in range(2):
                    if not reshard:  # as torch's pipeline schedules run a stage's microbatches
                        model.set_requires_gradient_sync(mb == 1)
                        model.set_reshard_after_backward(mb == 1)
                    carrier = torch.zeros((), dtype=torch.bfloat16, requires_grad=True).expand(x.shape)
                    y = model(carrier, rows, counts)
                    if cached:
                        versions.append(model.w1._version)  # the unsharded parameter, as the experts saw it
                    (y.float() * (1 + mb)).sum().backward()
                    got.append(y.detach().clone())
                got += [p.grad.full_tensor().clone() for p in model.parameters()]
                opt.step()
                opt.zero_grad()
            outs[cached] = got
            made = model.cache.made if cached else made
        results[(rank, reshard)] = {
            "equal": all(torch.equal(a, b) for a, b in zip(outs[True], outs[False])),
            "made": dict(made), "versions": versions}
    dist.destroy_process_group()


def test_the_weight_cache_follows_fsdp2s_weights_bit_for_bit():
    results = mp.Manager().dict()
    ranks.spawn(_worker, args=(free_port(), results), nprocs=2)
    for rank in (0, 1):
        for reshard in (True, False):
            r = results[(rank, reshard)]
            assert r["equal"], (rank, reshard)
            assert 3 <= r["made"]["forward"] <= 6, r  # at least once per step; resharding may move the storage
        kept = results[(rank, False)]
        assert kept["made"] == {"forward": 3, "transposed": 6}, kept  # once per step, as PP runs
        # why the optimizer steps are in the key: FSDP2 preserved the version over the new weights
        assert len(set(kept["versions"])) == 1, kept["versions"]


def _ep_worker(rank, port, results):
    """Expert weights sharded over 2 ranks as DTensors (what EP makes of them), the experts on
    their local tensors as TokenLevelExperts runs them, AdamW between steps."""
    init_gloo(rank, 2, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard

    from moe_comm import fp8_experts
    from moe_comm.fp8_experts import Fp8Rows
    from moe_comm.kernels import fp8_reference as ref

    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(20 + rank)
    local = PADDED[2 * rank:2 * rank + 2]
    x = torch.randn(sum(local), D, generator=g).to(torch.bfloat16)
    rows = Fp8Rows(*ref.quantise_rows(x, ref.MIN_AMAX_ROWS))
    counts = torch.tensor(local, dtype=torch.int32)
    outs, versions = {}, []
    for cached in (False, True):
        full = Experts()
        params = [nn.Parameter(distribute_tensor(getattr(full, n).detach(), mesh, [Shard(0)])) for n in ("w1", "w2", "w3")]
        opt = torch.optim.AdamW(params, lr=0.05)
        cache = fp8_experts.WeightCache() if cached else None
        got = []
        for step in range(3):
            w = [p.to_local() for p in params]
            versions.append(w[0]._version)
            carrier = torch.zeros((), dtype=torch.bfloat16, requires_grad=True).expand(x.shape)
            y = fp8_experts.grouped_experts(*w, carrier, rows, counts, cache=cache)
            y.float().sum().backward()
            got += [y.detach().clone()] + [p.grad.to_local().clone() for p in params]
            opt.step()
            opt.zero_grad()
        outs[cached] = (got, dict(cache.made) if cache else None)
    # a cache that would make copies ahead of these weights: they are shards, never whole between steps
    ahead = fp8_experts.WeightCache(lambda: tuple(params))
    try:
        ahead.make_ahead()
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    del ahead
    results[rank] = {"equal": all(torch.equal(a, b) for a, b in zip(outs[True][0], outs[False][0])),
                     "made": outs[True][1], "versions": versions, "refused": refused}
    dist.destroy_process_group()


def test_the_weight_cache_follows_ep_sharded_weights_the_optimizer_changes():
    """AdamW updates a DTensor's local tensor below autograd: the version of what to_local()
    returns stays as it was while the values change, so only the optimizer-step key refreshes
    the cache; with it, every step's output and gradients equal the uncached model's. A cache
    asked to make copies ahead of such shards refuses (they are whole only while gathered)."""
    results = mp.Manager().dict()
    ranks.spawn(_ep_worker, args=(free_port(), results), nprocs=2)
    for rank in (0, 1):
        r = results[rank]
        assert r["equal"] and r["made"] == {"forward": 3, "transposed": 6}, r
        assert len(set(r["versions"])) == 1, r["versions"]  # the values changed, the version did not
        assert "sharded (DTensor)" in r["refused"], r  # copies made ahead only of whole weights
