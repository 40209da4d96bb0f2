"""MoE dispatch/combine benchmark: every backend present, DeepSeek-V3 and decode shapes.

Three steps, all on the GPU machine but the last:
  python experiments/bench_comm.py p2p OUT.json
      one process, two GPUs: the copy-engine P2P ceiling (one way, and both ways at once).
  torchrun --nproc_per_node 2 experiments/bench_comm.py run OUT.json --backends nvshmem nccl
      per backend and shape: median time of dispatch and of combine (CUDA events, steady state,
      no host sync between iterations), rows and bytes that actually cross NVLink (from the
      routing: once per destination rank for nvshmem, once per expert for all-to-all paths),
      link GB/s, and SMs used. For nvshmem also each kernel's GPU time (torch.profiler): the
      transport kernels (dispatch, combine: the SM budget, NVLink) apart from the local
      expert-major layout kernels (expand, reduce: whole GPU, no NVLink), so the transport
      compares like for like with DeepEP. torch's symmetric-memory all-to-all (backend "torch_symm") must
      run in its own launch: it starts NVSHMEM through torch, which cannot share a process with
      this project's NVSHMEM start-up.
  python experiments/bench_comm.py report OUT_DIR/*.json --json MERGED.json --kernels COMMIT
      merges the runs, adds ratios against the nvshmem backend, records the kernels' commit (that
      of the csrc/ the runs were built from), and draws the plot beside it. The model's input is
      results/model_inputs/comm_bench_h200x2.json (its MANIFEST.json entry says how it was made).
  python experiments/bench_comm.py plot results/model_inputs/comm_bench_h200x2.json --png results/h200x2/comm_bench.png
      redraws that plot from the merged JSON alone.
"""

import argparse
import faulthandler
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

SHAPES = {
    # name: tokens per rank, hidden, top_k, experts, routing
    "dsv3_random": (4096, 7168, 8, 256, "random"),
    "dsv3_balanced": (4096, 7168, 8, 256, "balanced"),
    "decode_random": (128, 7168, 8, 256, "random"),
    # one MoE layer of recipes/deepseek_v3_671b_h200x1.toml at world 1: 2 x 4096 tokens, 32 experts
    "one_gpu_recipe": (8192, 7168, 8, 32, "random"),
}
WARMUP, ITERS = 10, 50
P2P_BYTES = 1 << 30


def make_routing(T, E, K, mode, rank, device):
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    if mode == "random":
        idx = torch.rand(T, E, generator=g, device=device).topk(K, dim=1).indices
    else:  # every expert gets the same number of rows; K consecutive ids are distinct
        idx = (torch.arange(T * K, device=device).view(T, K) + rank * T * K) % E
    w = torch.rand(T, K, generator=g, device=device)
    return idx.to(torch.int64).contiguous(), (w / w.sum(dim=1, keepdim=True)).contiguous()


def link_rows(idx, E, world, rank):
    """Rows leaving this rank: per destination rank (dedup) and per expert (all-to-all)."""
    dest = idx // (E // world)
    remote = dest != rank
    per_expert = int(remote.sum())
    dedup = sum(int((dest == d).any(dim=1).sum()) for d in range(world) if d != rank)
    return dedup, per_expert


def p2p(out: Path) -> None:
    """Copy-engine ceiling between the two GPUs, timed with CUDA events on the copying streams."""
    assert torch.cuda.device_count() >= 2, "the P2P ceiling needs two GPUs in one process"
    n = P2P_BYTES // 4
    a0, b0 = torch.empty(n, device="cuda:0"), torch.empty(n, device="cuda:0")
    a1, b1 = torch.empty(n, device="cuda:1"), torch.empty(n, device="cuda:1")
    s0, s1 = torch.cuda.Stream("cuda:0"), torch.cuda.Stream("cuda:1")

    def timed(both: bool) -> float:
        rates = []
        for _ in range(10):
            torch.cuda.synchronize("cuda:0")
            torch.cuda.synchronize("cuda:1")
            e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            with torch.cuda.stream(s0):
                e[0].record(s0)
                a1.copy_(a0, non_blocking=True)
                e[1].record(s0)
            if both:
                with torch.cuda.stream(s1):
                    e[2].record(s1)
                    b0.copy_(b1, non_blocking=True)
                    e[3].record(s1)
            s0.synchronize()
            s1.synchronize()
            ms = e[0].elapsed_time(e[1])
            if both:
                ms = max(ms, e[2].elapsed_time(e[3]))
            rates.append(P2P_BYTES / (ms * 1e-3) / 1e9)
        return statistics.median(rates[2:])

    result = {"p2p_one_way_gbps": timed(False), "p2p_both_ways_per_direction_gbps": timed(True),
              "bytes": P2P_BYTES, "device": torch.cuda.get_device_name(0), "method": "copy_ between two GPUs, CUDA events"}
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def build(name, E, K, D, group, num_sms, max_tokens, options):
    from moe_comm.backends import build_backend
    from moe_comm.backends.base import MoELayerSpec
    from moe_comm.config import MoEComm

    layer = MoELayerSpec(num_experts=E, top_k=K, hidden=D)
    config = MoEComm(backend=name, num_sms=num_sms, max_tokens_per_rank=max_tokens, recv_capacity_factor=0.0,
                     **(options if name == "nvshmem" else {}))
    return build_backend(config, layer, group)


class TorchSymmAllToAll:
    """torch's symmetric-memory all_to_all_vdev (1D; the 2D variant refuses 128 local experts
    at torch 2.11). Dispatch: group rows by destination rank (one per token-expert pair) and
    exchange; combine: exchange back with the received splits, then the weighted sum. No host
    sync: splits stay on the GPU."""

    name = "torch_symm"

    def __init__(self, E, K, D, group, max_tokens):
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
        self.E, self.K, self.group = E, K, group
        self.world = dist.get_world_size(group)
        device = torch.device("cuda", torch.cuda.current_device())
        rows = max_tokens * K * self.world
        self.send = symm_mem.empty(rows, D, dtype=torch.bfloat16, device=device)
        self.recv = symm_mem.empty(rows, D, dtype=torch.bfloat16, device=device)
        self.in_splits = symm_mem.empty(self.world, dtype=torch.int64, device=device)
        self.out_splits = symm_mem.empty(2, self.world, dtype=torch.int64, device=device)  # splits, offsets
        self.back_in_splits = symm_mem.empty(self.world, dtype=torch.int64, device=device)
        self.back_out_splits = symm_mem.empty(2, self.world, dtype=torch.int64, device=device)
        for t in (self.send, self.recv, self.in_splits, self.out_splits, self.back_in_splits, self.back_out_splits):
            symm_mem.rendezvous(t, group.group_name)

    def dispatch(self, x, idx, w):
        T = x.shape[0]
        dest = (idx // (self.E // self.world)).flatten()
        order = torch.argsort(dest, stable=True)
        n = T * self.K
        self.send[:n].copy_(x[order // self.K])
        self.in_splits.copy_(torch.bincount(dest, minlength=self.world))
        torch.ops.symm_mem.all_to_all_vdev(self.send, self.recv, self.in_splits, self.out_splits, self.group.group_name)
        return self.recv, (order, w, T)

    def combine(self, y, handle):
        order, w, T = handle
        self.back_in_splits.copy_(self.out_splits[0])
        torch.ops.symm_mem.all_to_all_vdev(y, self.send, self.back_in_splits, self.back_out_splits,
                                           self.group.group_name)
        back = torch.empty_like(self.send[: T * self.K])
        back[order] = self.send[: T * self.K]
        return (back.view(T, self.K, -1).float() * w[:, :, None]).sum(dim=1).to(y.dtype)


def timed_iterations(once, marks: int) -> list[tuple]:
    """WARMUP untimed calls of once(None), then ITERS back-to-back calls of once(events), each
    with its own `marks` CUDA events to record (no host sync in between): the events."""
    events = [tuple(torch.cuda.Event(enable_timing=True) for _ in range(marks)) for _ in range(ITERS)]
    for _ in range(WARMUP):
        once(None)
    torch.cuda.synchronize()
    dist.barrier()
    for ev in events:
        once(ev)
    torch.cuda.synchronize()
    return events


def time_backend(backend, x, idx, w, is_symm):
    """Median dispatch and combine times (us) over ITERS back-to-back iterations."""

    def once(ev):
        if ev:
            ev[0].record()
        if is_symm:
            recv, handle = backend.dispatch(x, idx, w)
            y = recv
        else:
            res = backend.dispatch(x, idx, w)
            y, handle = res.recv_x_RD, res.handle
        if ev:
            ev[1].record()
        out = backend.combine(y, handle)
        if ev:
            ev[2].record()
        return out

    events = timed_iterations(once, 3)
    d = statistics.median(e[0].elapsed_time(e[1]) * 1e3 for e in events)
    c = statistics.median(e[1].elapsed_time(e[2]) * 1e3 for e in events)
    return d, c


# The nvshmem backend's local kernels (plan, staging and the expert-major layout: whole GPU, no
# link), told apart from its communication (dispatch_kernel and combine_kernel: the recipe's SM
# budget, the links), so that the transport compares like for like with DeepEP, whose
# dispatch/combine move token-major rows and leave the permute to the caller.
LOCAL_KERNELS = {
    "dispatch": ("plan_count_kernel", "scan_kernel", "plan_assign_kernel", "pack_kernel", "receive_count_kernel",
                 "expand_kernel"),
    "combine": ("reduce_kernel", "finalize_kernel"),
}


def transport_split(row: dict) -> dict:
    """Transport time of each nvshmem op: the op's event time less its local kernels' profiled
    time. The local kernels wait on nobody, so their profiled time is exact; the communication
    kernels' own profiled time is reported too, but under the profiler a rank's kernel also
    counts the wait for its peer's late launch."""
    k = row["kernel_us"]
    local = {op: sum(k.get(name, 0.0) for name in names) for op, names in LOCAL_KERNELS.items()}
    t_d, t_c = row["dispatch_us"] - local["dispatch"], row["combine_us"] - local["combine"]
    link_bytes = row["link_bytes_per_rank"]
    return {"transport_dispatch_us": t_d, "transport_combine_us": t_c, "transport_round_trip_us": t_d + t_c,
            "layout_us": local["dispatch"] + local["combine"],
            "transport_dispatch_link_gbps": link_bytes / (t_d * 1e-6) / 1e9,
            "transport_combine_link_gbps": link_bytes / (t_c * 1e-6) / 1e9}


def time_fwd_bwd(backend, x, idx, w):
    """Median time (us) of what a training step's MoE layer asks of a backend: dispatch and
    combine forward, then both backwards (experts as the identity, a fixed output gradient;
    gradients to x and to the routing weights, as the router needs)."""
    xg, wg = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    grad_out = torch.randn_like(x)

    def once(ev):
        if ev:
            ev[0].record()
        res = backend.dispatch(xg, idx, wg)
        out = backend.combine(res.recv_x_RD * 1.0, res.handle)
        out.backward(grad_out)
        if ev:
            ev[1].record()
        xg.grad, wg.grad = None, None

    events = timed_iterations(once, 2)
    return statistics.median(e[0].elapsed_time(e[1]) * 1e3 for e in events)


def round_trip(backend, x, idx, w):
    """One dispatch + combine of a backend with this project's interface."""
    res = backend.dispatch(x, idx, w)
    return backend.combine(res.recv_x_RD, res.handle)


def time_kernels(backend, x, idx, w, iters=20):
    """Mean GPU time per iteration (us) of each nvshmem kernel, from a torch.profiler trace of
    `iters` back-to-back dispatch + combine iterations."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        round_trip(backend, x, idx, w)
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            round_trip(backend, x, idx, w)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for evt in prof.key_averages():
        match = re.search(r"moe_comm::(\w+_kernel)", evt.key)
        if match:
            t = getattr(evt, "device_time_total", 0.0) or getattr(evt, "cuda_time_total", 0.0)
            totals[match[1]] = totals.get(match[1], 0.0) + t
    return {kernel: total / iters for kernel, total in sorted(totals.items())}


def time_graph_round_trip(backend, x, idx, w, replays=50):
    """Dispatch + combine captured once in a CUDA graph: the round trip without Python or
    launch overhead (only for backends with no host sync on the path)."""
    round_trip(backend, x, idx, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        round_trip(backend, x, idx, w)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def run(out: Path, backends: list[str], num_sms_list: list[int], shapes: list[str], options: dict) -> None:
    """Each backend x SM budget x shape. With more ranks than GPUs the ranks share GPUs (gloo
    group, CUDA MPS): the figures then measure per-op work, not links."""
    local_rank = int(os.environ["LOCAL_RANK"])
    gpus = torch.cuda.device_count()
    torch.cuda.set_device(local_rank % gpus)
    shared = int(os.environ["WORLD_SIZE"]) > gpus
    if shared:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    device = torch.device("cuda", local_rank % gpus)
    max_tokens = max(SHAPES[s][0] for s in shapes)
    rows = []
    configs = [(name, num_sms) for name in backends for num_sms in (num_sms_list if name == "nvshmem" else [0])]
    for name, num_sms in configs:
        for shape in shapes:
            T, D, K, E, mode = SHAPES[shape]
            x = torch.randn(T, D, device=device, dtype=torch.bfloat16)
            idx, w = make_routing(T, E, K, mode, rank, device)
            dedup, per_expert = link_rows(idx, E, world, rank)
            entry = {"backend": name, "shape": shape, "tokens": T, "hidden": D, "top_k": K, "experts": E,
                     "routing": mode, "world": world}
            try:
                if name == "torch_symm":
                    backend = TorchSymmAllToAll(E, K, D, group, max_tokens)
                else:
                    backend = build(name, E, K, D, group, max(num_sms, 1), max_tokens, options)
                d_us, c_us = time_backend(backend, x, idx, w, name == "torch_symm")
                fwd_bwd_us = 0.0 if name == "torch_symm" else time_fwd_bwd(backend, x, idx, w)
                graph_us = time_graph_round_trip(backend, x, idx, w) if name == "nvshmem" else 0.0
                kernels = time_kernels(backend, x, idx, w) if name == "nvshmem" else {}
            except Exception as e:  # noqa: BLE001 - a backend that cannot run is recorded
                entry["error"] = f"{type(e).__name__}: {e}"[:2000]
                rows.append(entry)
                print(f"[rank {rank}] {name} {shape}: {entry['error']}", file=sys.stderr, flush=True)
                continue
            link = dedup if name in ("nvshmem", "deepep") else per_expert
            link_bytes = link * D * 2
            stats = torch.tensor([d_us, c_us, float(link_bytes), graph_us, fwd_bwd_us, *kernels.values()])
            gathered = [None] * world
            dist.all_gather_object(gathered, stats)
            kernel_max = {k: max(float(g[5 + i]) for g in gathered) for i, k in enumerate(kernels)}
            # The slowest rank bounds the op; bytes are this rank's outgoing ones (symmetric routing).
            d_max = max(float(g[0]) for g in gathered)
            c_max = max(float(g[1]) for g in gathered)
            graph_max = max(float(g[3]) for g in gathered)
            fwd_bwd_max = max(float(g[4]) for g in gathered)
            entry.update({
                "num_sms": num_sms if name == "nvshmem" else None,
                "options": options if name == "nvshmem" else None,
                "network_sms": backend.network_sms if name == "nvshmem" else None,
                "ranks_share_gpus": shared,
                "sms_note": None if name == "nvshmem" else "library-managed (NCCL channels / torch kernels)",
                "dispatch_us": d_max, "combine_us": c_max, "round_trip_us": d_max + c_max,
                "round_trip_graph_us": graph_max or None,
                "fwd_bwd_us": fwd_bwd_max or None,
                "link_rows_per_rank": link, "link_bytes_per_rank": link_bytes,
                "dispatch_link_gbps": link_bytes / (d_max * 1e-6) / 1e9,
                "combine_link_gbps": link_bytes / (c_max * 1e-6) / 1e9,
            })
            if kernel_max:
                entry["kernel_us"] = kernel_max  # slowest rank per kernel
                entry.update(transport_split(entry))
            rows.append(entry)
            if rank == 0:
                print(f"{name:>10} sms={num_sms:>3} {shape:>14}: dispatch {d_max:8.1f} us  combine {c_max:8.1f} us"
                      f"  link {entry['dispatch_link_gbps']:6.1f}/{entry['combine_link_gbps']:6.1f} GB/s"
                      f"  graph round trip {graph_max:8.1f} us  forward+backward {fwd_bwd_max:8.1f} us", flush=True)
                if kernel_max:
                    print(f"{'':>10} kernels (us): " + "  ".join(f"{k} {v:.1f}" for k, v in kernel_max.items())
                          + f"  transport {entry['transport_dispatch_us']:.1f} + {entry['transport_combine_us']:.1f} us"
                          f"  link {entry['transport_dispatch_link_gbps']:.1f}/"
                          f"{entry['transport_combine_link_gbps']:.1f} GB/s", flush=True)
            del backend
            torch.cuda.synchronize()
            dist.barrier()
    if rank == 0:
        out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                   "date": time.strftime("%Y-%m-%d", time.gmtime()), "rows": rows}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def report(inputs: list[Path], json_out: Path, kernels: str | None = None) -> None:
    merged = {"p2p": None, "rows": [], "inputs": [str(p) for p in inputs]}
    if kernels:
        merged["kernels"] = kernels
    for path in inputs:
        data = json.loads(path.read_text())
        if "p2p_one_way_gbps" in data:
            merged["p2p"] = data
        else:
            merged["device"] = data["device"]
            merged["torch"] = data["torch"]
            merged["rows"].extend(data["rows"])
    ceiling = merged["p2p"]["p2p_both_ways_per_direction_gbps"] if merged["p2p"] else None
    ok = [r for r in merged["rows"] if "error" not in r]
    best_nvshmem = {}
    for r in ok:
        if r.get("kernel_us"):
            r.update(transport_split(r))
        if ceiling:
            r["dispatch_link_fraction"] = r["dispatch_link_gbps"] / ceiling
            r["combine_link_fraction"] = r["combine_link_gbps"] / ceiling
            if r.get("kernel_us"):
                r["transport_dispatch_link_fraction"] = r["transport_dispatch_link_gbps"] / ceiling
                r["transport_combine_link_fraction"] = r["transport_combine_link_gbps"] / ceiling
        if r["backend"] == "nvshmem" and r["num_sms"] <= 20:
            cur = best_nvshmem.get(r["shape"])
            if cur is None or r["round_trip_us"] < cur["round_trip_us"]:
                best_nvshmem[r["shape"]] = r
    for r in ok:
        ref = best_nvshmem.get(r["shape"])
        if ref and r["backend"] != "nvshmem":
            r["nvshmem_speedup"] = r["round_trip_us"] / ref["round_trip_us"]
    if "date" not in merged:  # the day the numbers were measured; `report` runs right after `run`
        dates = sorted({json.loads(p.read_text()).get("date") for p in inputs} - {None})
        merged["date"] = dates[0] if dates else time.strftime("%Y-%m-%d", time.gmtime())
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(merged, indent=1))
    plot(merged, json_out.with_suffix(".png"))


def _bench_footer(merged: dict, ok: list[dict], date: str, kernels: str) -> list[str]:
    """What the plot shows: the benchmark's shapes (it has no recipe), hardware, date, options, kernels."""
    world = ok[0]["world"] if ok else "?"
    shapes = "; ".join(
        f"{name} = {t} tokens/rank, hidden {d}, top-{k}, {e} experts, {routing} routing"
        for name, (t, d, k, e, routing) in SHAPES.items()
    )
    sms = sorted({r["num_sms"] for r in ok if r["backend"] == "nvshmem"})
    opts = sorted({json.dumps(r["options"], sort_keys=True) for r in ok if r["backend"] == "nvshmem" and r.get("options")})
    options = [f"nvshmem num_sms {'/'.join(map(str, sms))}" + (f", {'; '.join(opts)}" if opts else "")] if sms else []
    options += [f"{b}: {note}" for b, note in dict.fromkeys((r["backend"], r["sms_note"]) for r in ok if r.get("sms_note"))]
    return [
        f"experiments/bench_comm.py (no recipe): bf16, {shapes}",
        f"hardware: {world} x {merged.get('device', '?')}, torch {merged.get('torch', '?')};  date: {date}",
        "backend options: " + ";  ".join(options),
        f"kernels: {kernels}",
    ]


def plot(merged: dict, png: Path, date: str | None = None, kernels: str | None = None) -> None:
    """Per shape: the round trip of every backend on a log axis (the slow and the fast ones
    readable together), and below it the fast ones zoomed in, split into dispatch transport,
    the local expert-major layout (nvshmem's expand and reduce) and combine transport."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from moe_comm import plots
    from moe_comm.report import kernels_text

    ok = [r for r in merged["rows"] if "error" not in r]
    date = date or merged.get("date") or "not recorded"
    kernels = kernels_text(kernels or merged.get("kernels"))
    shapes = [s for s in SHAPES if any(r["shape"] == s for r in ok)]
    configs = sorted({(r["backend"], r["num_sms"]) for r in ok}, key=lambda k: (k[0] != "nccl", k[0], k[1] or 0))
    fig, axes = plt.subplots(2, len(shapes), figsize=(5 * len(shapes), 7.5), squeeze=False,
                             gridspec_kw={"height_ratios": [1, 1.3]})
    for col, shape in enumerate(shapes):
        rows = [(b, sms, next(r for r in ok if r["shape"] == shape and r["backend"] == b and r["num_sms"] == sms))
                for b, sms in configs if any(r["shape"] == shape and r["backend"] == b and r["num_sms"] == sms for r in ok)]
        names = [b + (f"\n{sms} SMs" if sms else "") for b, sms, _ in rows]
        colors = [plots.backend_color(b) for b, _, _ in rows]
        totals = [r["round_trip_us"] for _, _, r in rows]
        x = list(range(len(rows)))
        title = f"{shape}: {SHAPES[shape][0]} tokens/rank"

        top = axes[0][col]
        top.bar(x, totals, color=colors)
        top.set_yscale("log")
        for xi, total in zip(x, totals):
            top.text(xi, total * 1.08, f"{total:,.0f}", ha="center", va="bottom", fontsize=7)
        top.set_ylim(min(totals) / 2, max(totals) * 3)
        top.set_xticks(x, names, fontsize=7)
        top.set_title(f"{title}\nround trip, all backends (log scale)", fontsize=9)
        top.set_ylabel("microseconds (median)")

        # the zoom: every backend within 3x of the fastest; slower bars are cut, their total written
        fastest = min(totals)
        limit = 1.25 * max(t for t in totals if t <= 3 * fastest)
        bottom_ax = axes[1][col]
        for xi, (backend, _, r), color in zip(x, rows, colors):
            if r.get("kernel_us"):
                parts = (r["transport_dispatch_us"], r.get("layout_us", r["kernel_us"].get("expand_kernel", 0.0)
                                                                 + r["kernel_us"].get("reduce_kernel", 0.0)),
                         r["transport_combine_us"])
            else:
                parts = (r["dispatch_us"], 0.0, r["combine_us"])
            styles = (dict(color=color), dict(color="0.85", hatch="//", edgecolor="0.5"), dict(color=color, alpha=0.45))
            base = 0.0
            for height, style in zip(parts, styles):
                bottom_ax.bar(xi, height, bottom=base, **style)
                base += height
            if base > limit:
                bottom_ax.text(xi, limit * 0.97, f"{base:,.0f} \u2191", ha="center", va="top", fontsize=7,
                               bbox=dict(facecolor="white", edgecolor="none", pad=1))
            else:
                bottom_ax.text(xi, base + limit * 0.01, f"{base:,.0f}", ha="center", va="bottom", fontsize=7)
        bottom_ax.set_ylim(0, limit)
        bottom_ax.set_xticks(x, names, fontsize=7)
        bottom_ax.set_title(f"zoom: backends within 3x of the fastest ({limit:,.0f} \u00b5s cap)", fontsize=9)
        bottom_ax.set_ylabel("microseconds (median)")

    backends = dict.fromkeys(b for b, _ in configs)
    handles = [Patch(color=plots.backend_color(b), label=b) for b in backends]
    handles += [Patch(color="0.3", label="dispatch (transport)"),
                Patch(facecolor="0.85", hatch="//", edgecolor="0.5", label="layout: expand + reduce (nvshmem)"),
                Patch(color="0.3", alpha=0.45, label="combine (transport)")]
    footer = _bench_footer(merged, ok, date, kernels)
    plots.add_footer(fig, footer, top_in=0.75)  # then the title and legend go in the top band
    height = fig.get_figheight()
    fig.suptitle(f"MoE dispatch + combine, {ok[0]['world'] if ok else '?'} x {merged.get('device', '')}",
                 y=1 - 0.08 / height, va="top")
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.4 / height))
    fig.savefig(png, dpi=120, metadata={"Description": "\n".join(footer)})
    print(f"wrote {png}")


def main() -> int:
    faulthandler.enable()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("p2p")
    p.add_argument("out", type=Path)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--backends", nargs="+", default=["nvshmem", "nccl"])
    r.add_argument("--num-sms", nargs="+", type=int, default=[20])
    r.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    r.add_argument("--network-sms", type=int, default=0, help="nvshmem: SMs of num_sms for the network hop")
    r.add_argument("--virtual-node", type=int, default=0, help="nvshmem: ranks per virtual node (0: the real node)")
    r.add_argument("--dispatch-dtype", choices=("bf16", "fp8"), default="bf16")
    rep = sub.add_parser("report")
    rep.add_argument("inputs", nargs="+", type=Path)
    rep.add_argument("--json", type=Path, required=True)
    rep.add_argument("--kernels", default=None, help="the commit whose csrc/ the runs were built from")
    pl = sub.add_parser("plot", help="redraw the PNG from a merged JSON (no GPU needed)")
    pl.add_argument("json", type=Path)
    pl.add_argument("--png", type=Path, default=None, help="where the PNG goes (default: beside the JSON)")
    pl.add_argument("--date", default=None, help="the measurement date, for a JSON made before `report` recorded it")
    pl.add_argument("--kernels", default=None,
                    help="the commit whose csrc/ the runs were built from, for a JSON made before `report` recorded it")
    args = parser.parse_args()
    if args.cmd == "p2p":
        p2p(args.out)
    elif args.cmd == "run":
        options = {"network_sms": args.network_sms, "virtual_node_size": args.virtual_node,
                   "dispatch_dtype": args.dispatch_dtype}
        run(args.out, args.backends, args.num_sms, args.shapes, options)
    elif args.cmd == "plot":
        plot(json.loads(args.json.read_text()), args.png or args.json.with_suffix(".png"), args.date, args.kernels)
    else:
        report(args.inputs, args.json, args.kernels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
