"""experiments/host_syncs.py on CPU: the census counts what would synchronise on a GPU and puts it
in the right phase (backward included); the nccl backend at EP 2 on gloo synchronises once per
forward dispatch (the split sizes' blocking copy) and nowhere else, and at EP 1 not at all. The
GPU instruments (CUDA sync calls, the blocking probe) run on the device (`run` with no --cases)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from metrics_fakes import free_port
from outcomes import kept, result, run_script

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("host_syncs", REPO / "experiments" / "host_syncs.py")
hs = importlib.util.module_from_spec(spec)
sys.modules["host_syncs"] = hs
spec.loader.exec_module(hs)


def _count(fn):
    census = hs.Census(on_gpu=False)
    census.phase = "p"
    with census:
        fn()
    return census.found["p"]


def test_census_rules_on_cpu_stand_for_the_gpu():
    x = torch.arange(12)
    assert sum(_count(lambda: x.to(torch.device("cpu")).tolist()).values()) == 1  # the copy; its host copy reads free
    found = _count(lambda: x.tolist())
    assert list(found) and next(iter(found)).startswith("scalar read (.tolist) at tests/test_host_syncs.py")
    assert sum(_count(lambda: x.to("cpu", non_blocking=True).tolist()).values()) == 0  # async, then a host read
    assert sum(_count(lambda: x[x > 3]).values()) == 1  # boolean-mask index
    assert sum(_count(lambda: torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3]))).values()) == 1
    assert sum(_count(lambda: torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3]), output_size=6)).values()) == 0
    assert sum(_count(lambda: x.nonzero()).values()) == 1
    assert sum(_count(lambda: (x * 2).sum(dim=0)).values()) == 0
    assert sum(_count(lambda: x[torch.tensor([0, 2])]).values()) == 0  # integer index: no sync


class _SyncInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad.abs().max().item()  # a planted sync in combine's backward
        return grad


class _Planted:
    """A backend with one sync in combine's forward and one in its backward, none in dispatch."""

    def dispatch(self, x_TD, idx_TK, w_TK):
        from moe_comm.backends.base import DispatchResult

        return DispatchResult(x_TD * 1.0, None, w_TK)

    def combine(self, y_RD, handle):
        if bool((y_RD != 0).any()):  # planted: a scalar read
            pass
        return _SyncInBackward.apply(y_RD) * handle.sum(dim=1, keepdim=True).to(y_RD.dtype)


def test_census_puts_each_sync_in_its_phase():
    census = hs.Census(on_gpu=False)
    phases = hs.Phases(census, torch.device("cpu"))
    x, w, idx = torch.randn(8, 4), torch.rand(8, 2), torch.zeros(8, 2, dtype=torch.int64)
    with census:
        hs.one_call(_Planted(), phases, x, idx, w, torch.randn(8, 4))
    counts = {p: sum(census.found[p].values()) for p in hs.PHASES}
    assert counts == {"dispatch.fwd": 0, "combine.fwd": 1, "combine.bwd": 1, "dispatch.bwd": 0}
    assert any("(combine)" in site for site in census.found["combine.fwd"])
    assert set(phases.host_ms) == set(hs.PHASES)  # every phase opened and closed


def in_background(shared_run, folder: Path, nice: int):
    """The nccl case at EP 2, run as its command line runs it (torchrun and two workers) at
    niceness `nice` while other modules' tests run (tests/conftest.py): its JSON."""
    return kept(_nccl_ep2, folder / "host_syncs.json", nice)


def _nccl_ep2(out: Path, nice: int) -> dict:
    argv = ["run", "--cases", "nccl_ep2_cpu", "--tokens", "64", "--hidden", "128", "--experts", "16", "--top-k", "4",
            "--iters", "1", "--warmup", "1", "--port", str(free_port()), "--out", str(out)]
    run_script("experiments/host_syncs.py", *argv, nice=nice)
    return json.loads(out.read_text())


def test_nccl_on_cpu_syncs_once_per_forward_dispatch_at_ep2(background):
    doc = result(background)
    assert doc["schema"] == hs.SCHEMA and doc["shape"]["tokens"] == 64
    ep2 = doc["cases"]["nccl_ep2_cpu"]
    assert ep2["status"] == "ok", ep2.get("log_tail")
    assert len(ep2["per_rank"]) == 2
    s = ep2["summary"]
    assert s["dispatch.fwd"]["syncs_per_call"] == 1
    (site,) = s["dispatch.fwd"]["census_sites"]
    assert site.startswith("device-to-host copy at moe_comm/backends/nccl.py:") and "(dispatch)" in site
    assert all(s[p]["syncs_per_call"] == 0 for p in ("combine.fwd", "combine.bwd", "dispatch.bwd"))
    assert "| nccl_ep2_cpu | dispatch.fwd | 1 |" in hs.report(doc)


def test_nccl_on_cpu_at_ep1_does_not_sync(tmp_path, monkeypatch):
    """One rank, in this process (the worker as torchrun would start it)."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    shape = dict(hs.SHAPE, tokens=64, hidden=128, experts=16, top_k=4)
    hs.worker("nccl_ep1_cpu", tmp_path, shape, iters=1, warmup=1)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["world"] == 1
    assert {p: rank0["phases"][p]["census"]["per_call"] for p in hs.PHASES} == dict.fromkeys(hs.PHASES, 0)


def _seen(sync_counts, waits_per_call, host_us, ops):
    from collections import Counter

    return {"calls": len(sync_counts), "sync_counts": sync_counts, "by_api": Counter(cudaStreamSynchronize=sum(sync_counts)),
            "waits_us": [w for call in waits_per_call for w in call], "wait_per_call_us": [sum(c) for c in waits_per_call],
            "host_us": host_us, "op_self_us": ops}


def test_gpu_phase_counts_cuda_syncs_and_a_wait_outside_the_cuda_api():
    """The GPU rules on made-up profiles: CUDA sync calls are counted with their waits; a probe
    sleep no sync call took is one wait more, named by the op that grew, costed by its own time."""
    normal = _seen([2, 2], [[30.0, 10.0], [50.0, 10.0]], [400.0, 420.0], {"deepep::dispatch": [90.0, 110.0],
                                                                            "aten::mul": [5.0, 5.0]})
    # the sleep landed in a CUDA sync call: nothing outside the API
    taken = _seen([2, 2], [[19000.0, 10.0], [19500.0, 10.0]], [19400.0, 19600.0], normal["op_self_us"])
    e = hs._gpu_phase(normal, taken, {"blocks_host": True})
    assert e["syncs_per_call"] == 2 and e["cuda_sync_calls"]["wait_us"]["median"] == 20.0
    assert e["cuda_sync_calls"]["wait_us_per_call"] == 50.0 and e["cuda_sync_calls"]["by_api"] == {"cudaStreamSynchronize": 2}
    # the sleep landed in DeepEP's own op (its CPU poll)
    polled = _seen([2, 2], [[30.0, 10.0], [50.0, 10.0]], [19400.0, 19600.0], {"deepep::dispatch": [19100.0, 19200.0],
                                                                               "aten::mul": [5.0, 5.0]})
    e = hs._gpu_phase(normal, polled, probe := {"blocks_host": True})
    assert e["syncs_per_call"] == 3 and probe["wait_outside_cuda_api"]["op"] == "deepep::dispatch"
    assert probe["wait_outside_cuda_api"]["self_cpu_us"]["median"] == 100.0
    # no wait at all (nvshmem): the CUDA count stands
    assert hs._gpu_phase(_seen([0, 0], [[], []], [50.0, 60.0], {}), None, {"blocks_host": False})["syncs_per_call"] == 0
