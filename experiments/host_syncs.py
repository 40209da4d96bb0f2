"""Host synchronisations per dispatch and combine of each backend, forward and backward, and what
each costs (issue 34 item 3).

    python experiments/host_syncs.py run --out results/h200x1/host_syncs.json      # one H200, every case
    python experiments/host_syncs.py run --cases nccl_ep2_cpu nccl_ep1_cpu --tokens 64 --hidden 256 \\
        --out /tmp/host_syncs.json                                                   # CPU: counts only

A host synchronisation is a point where the CPU stops until the GPU has finished work queued
before it: while it waits nothing new is launched, and after it the GPU idles for the launches
that follow. Three instruments, each attributing what it sees to the phase it happens in
(dispatch / combine, forward / backward; the backward phases are bracketed by identity autograd
nodes on each op's output and input, as moe_comm.metrics.instrumented times them):
  * census (every case, CPU included): the Python-level torch calls that synchronise on a GPU,
    seen by a TorchFunctionMode, with their call sites: a blocking device-to-host (or pageable
    host-to-device) copy, a scalar read of a device tensor (.item, .tolist, bool()), an op whose
    output size depends on device data (nonzero, boolean-mask indexing, masked_select, unique,
    repeat_interleave without output_size). On a CPU run a tensor counts as "device" unless a
    device-to-host copy made it, so the CPU run counts what the same code does on a GPU;
  * CUDA sync calls (GPU): cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize /
    synchronous cudaMemcpy from the torch profiler's CUDA runtime events inside each phase, with
    their durations (the wait, as the host sees it);
  * blocking probe (GPU): a GPU sleep (SLEEP_MS) queued just before one phase; a phase whose host
    time grows by it waits for the GPU somewhere. Where no CUDA sync call absorbed the sleep, the
    wait is outside the CUDA API (DeepEP's dispatch polls pinned host memory for the receive
    counts in C++): it is counted once more, named by the op whose own CPU time absorbed it, with
    that op's self CPU time in the unprobed calls as its cost (an upper bound: it includes the
    op's launches).
A phase's syncs per call = its CUDA sync calls + the waits outside the CUDA API (GPU), the
census (CPU).

Cases (CASES): nccl at EP 1 on the GPU; nvshmem at EP 1; deepep and nvshmem at 2 PEs on one GPU
under CUDA MPS with a gloo group (several ranks share the GPU, as tests/test_deepep_gpu.py runs
them: timings on one GPU say nothing about links, the counts and the host-side waits do); nccl at
EP 1 and EP 2 on CPU (gloo; census only). Shape (--tokens, --hidden, --experts, --top-k): by
default DeepSeek-V3's layer, 4096 tokens per rank, hidden 7168, 256 experts, top-8, routing drawn
by moe_comm.predict.routing_plan ("node_limited", seed 0), bf16 rows; the expert between dispatch
and combine is a scale (no GEMM: only the two ops are measured).
"""

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

SCHEMA = "host_syncs/1"
PHASES = ("dispatch.fwd", "combine.fwd", "combine.bwd", "dispatch.bwd")  # in the order they run
RANGE = "host_syncs/"
SLEEP_MS = 20.0
NUM_SMS = 20  # per PE: 2 PEs x 20 SMs fit one H200's 132 (the cooperative launches of all PEs must be resident at once)
CUDA_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                   "cudaMemcpy2D", "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize",
                   "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2")


@dataclass(frozen=True)
class CaseSpec:
    backend: str
    ranks: int
    device: str  # "cuda" or "cpu"
    where: str


CASES = {
    "nccl_ep1": CaseSpec("nccl", 1, "cuda", "EP 1 on one GPU (TorchTitan's local path: sort, gather, padding permute)"),
    "nvshmem_ep1": CaseSpec("nvshmem", 1, "cuda", "EP 1 on one GPU (our layout kernels, no link)"),
    "deepep_2pe": CaseSpec("deepep", 2, "cuda", "2 PEs on one GPU under CUDA MPS, gloo group (TorchTitan's DeepEP "
                           "path over DeepEP v1.2.1)"),
    "nvshmem_2pe": CaseSpec("nvshmem", 2, "cuda", "2 PEs on one GPU under CUDA MPS, gloo group"),
    "nccl_ep2_cpu": CaseSpec("nccl", 2, "cpu", "EP 2 on CPU, gloo (census only)"),
    "nccl_ep1_cpu": CaseSpec("nccl", 1, "cpu", "EP 1 on CPU (census only)"),
}
SHAPE = {"tokens": 4096, "hidden": 7168, "experts": 256, "top_k": 8, "routing": "node_limited"}


# ---- census ----------------------------------------------------------------------------------

class Census(TorchFunctionMode):
    """Counts Python-level torch calls that synchronise with the GPU, per phase and call site."""

    SCALAR_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"}
    DATA_SIZED = {"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere"}

    def __init__(self, on_gpu: bool):
        super().__init__()
        self.on_gpu = on_gpu
        self.phase: str | None = None
        self.found: dict[str, Counter] = defaultdict(Counter)
        self._host: dict[int, object] = {}  # id -> weakref of tensors a device-to-host copy made

    def _device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if self.on_gpu:
            return t.is_cuda
        ref = self._host.get(id(t))
        return not (ref is not None and ref() is t)

    @staticmethod
    def _target(args, kwargs):
        for a in (*args[1:], kwargs.get("device")):
            if isinstance(a, (torch.device, str)):
                try:
                    return torch.device(a)
                except RuntimeError:
                    continue
            if isinstance(a, torch.Tensor):
                return a.device
        return None

    def _kind(self, name: str, args, kwargs) -> tuple[str | None, bool]:
        """(what synchronises, or None; whether the result lives on the host)."""
        src = args[0] if args else None
        if name in ("to", "cpu"):
            target = torch.device("cpu") if name == "cpu" else self._target(args, kwargs)
            if target is None or not isinstance(src, torch.Tensor):
                return None, False
            blocking = not kwargs.get("non_blocking", any(a is True for a in args[1:]))
            if target.type == "cpu" and self._device(src):
                return ("device-to-host copy" if blocking else None), True
            if target.type == "cuda" and not src.is_cuda and blocking:
                return "blocking host-to-device copy", False
            return None, False
        if name in self.SCALAR_READS and self._device(src):
            return f"scalar read (.{name.strip('_')})", False
        if name in self.DATA_SIZED and self._device(src):
            return f"data-sized output ({name})", False
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and self._device(src):
            index = args[1] if len(args) > 1 else None
            parts = index if isinstance(index, (tuple, list)) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                return "data-sized output (boolean-mask index)", False
        if name == "repeat_interleave" and self._device(src) and "output_size" not in kwargs:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor):
                return "data-sized output (repeat_interleave without output_size)", False
        if name == "where" and len(args) == 1 and not kwargs and self._device(src):
            return "data-sized output (where)", False
        return None, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        kind, host = self._kind(name, args, kwargs)
        if kind and not self.on_gpu and _inside(CPU_ONLY):
            kind = None
        out = func(*args, **kwargs)
        if host and isinstance(out, torch.Tensor):
            import weakref

            self._host[id(out)] = weakref.ref(out)
        if kind and self.phase:
            self.found[self.phase][f"{kind} at {_call_site()}"] += 1
        return out


# Code that runs only on CPU, standing in for a GPU kernel: on a GPU the kernel runs instead,
# without its host reads. TorchTitan's EP permute indices: a Triton kernel on the GPU,
# fill_indices_cpu (a loop of .item() reads) with use_cpu=True, which moe_comm.titan.cpu sets.
CPU_ONLY = (("torchtitan/models/moe/kernels.py", "fill_indices_cpu"),)


def _inside(functions) -> bool:
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename.replace(os.sep, "/")
        if any(path.endswith(file) and f.f_code.co_name == fn for file, fn in functions):
            return True
        f = f.f_back
    return False


def _call_site() -> str:
    """The first frame outside torch and this file: file:line (function)."""
    f = sys._getframe(2)
    here = os.path.abspath(__file__)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path != here and f"{os.sep}torch{os.sep}" not in path:
            rel = os.path.relpath(path, REPO) if path.startswith(str(REPO)) else path.split("site-packages" + os.sep)[-1]
            return f"{rel}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "?"


# ---- phases ----------------------------------------------------------------------------------

class Phases:
    """Opens and closes each phase: the census's phase, a profiler range, the host clock and,
    in the probe, a GPU sleep queued just before the phase. Backward phases are opened and
    closed from autograd nodes (the thread autograd runs them on)."""

    def __init__(self, census: Census | None, device: torch.device):
        self.census = census
        self.device = device
        self.profile = False
        self.probe: str | None = None  # the phase to queue a sleep before
        self.sleep_cycles = 0
        self.host_ms: dict[str, list[float]] = defaultdict(list)
        self._open: dict[str, tuple] = {}

    def begin(self, phase: str) -> None:
        pushed = False
        if self.census is not None:
            self.census.phase = phase
            if not _mode_active(self.census):  # an autograd thread without the mode: push it here
                self.census.__enter__()
                pushed = True
        rf = None
        if self.profile:
            rf = torch.autograd.profiler.record_function(RANGE + phase)
            rf.__enter__()
        if self.probe == phase:
            torch.cuda._sleep(self.sleep_cycles)
        self._open[phase] = (time.perf_counter(), rf, pushed)

    def end(self, phase: str) -> None:
        t0, rf, pushed = self._open.pop(phase)
        if self.probe in (None, phase):  # under the probe, only the phase the sleep was queued before
            self.host_ms[phase].append(1e3 * (time.perf_counter() - t0))
        if rf is not None:
            rf.__exit__(None, None, None)
        if self.census is not None:
            self.census.phase = None
            if pushed and _mode_active(self.census):
                self.census.__exit__(None, None, None)


def _mode_active(mode) -> bool:
    return any(torch._C._get_function_stack_at(i) is mode for i in range(torch._C._len_torch_function_stack()))


class _Mark(torch.autograd.Function):
    """Identity; its backward calls `callback(phase)` when the gradient passes."""

    @staticmethod
    def forward(ctx, x, callback, phase):
        ctx.callback, ctx.phase = callback, phase
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback(ctx.phase)
        return grad, None, None


def one_call(backend, phases: Phases, x_TD, idx_TK, w_TK, grad_TD) -> None:
    """Dispatch, a scale standing in for the experts, combine; then the backward of both."""
    x = x_TD.detach().requires_grad_(True)
    w = w_TK.detach().requires_grad_(True)
    phases.begin("dispatch.fwd")
    res = backend.dispatch(_Mark.apply(x, phases.end, "dispatch.bwd"), idx_TK, w)
    phases.end("dispatch.fwd")
    y = _Mark.apply(res.recv_x_RD, phases.begin, "dispatch.bwd") * 1.5
    phases.begin("combine.fwd")
    out = backend.combine(_Mark.apply(y, phases.end, "combine.bwd"), res.handle)
    phases.end("combine.fwd")
    # torch.autograd.backward's engine call without its torch-function hook: a mode is off while
    # it handles a call, and the census must see the Python code the backward runs
    torch.autograd.graph._engine_run_backward(
        (_Mark.apply(out, phases.begin, "combine.bwd"),), (grad_TD.to(out.dtype),), False, False, (), True, True)


# ---- the profiler's view -----------------------------------------------------------------------

def _profiled(events) -> dict:
    """Per phase: CUDA sync calls per call, their waits, the phase's host time, and per CPU op
    its self CPU time, from the events inside each phase's range (phases never overlap in time:
    forward on the main thread, backward on autograd's while the main thread waits)."""
    ranges = sorted((e for e in events if e.name.startswith(RANGE)), key=lambda e: e.time_range.start)
    syncs = [e for e in events if e.name in CUDA_SYNC_CALLS]
    ops = [e for e in events if not e.name.startswith(RANGE) and e.name not in CUDA_SYNC_CALLS
           and not e.name.startswith(("cuda", "cu")) and e.device_type == torch.autograd.DeviceType.CPU]
    out: dict = {}
    for r in ranges:
        phase = r.name[len(RANGE):]
        inside = lambda e: r.time_range.start <= e.time_range.start < r.time_range.end  # noqa: E731
        mine = [e for e in syncs if inside(e)]
        d = out.setdefault(phase, {"calls": 0, "sync_counts": [], "by_api": Counter(), "waits_us": [],
                                   "wait_per_call_us": [], "host_us": [], "op_self_us": defaultdict(list)})
        waits = [e.time_range.end - e.time_range.start for e in mine]
        d["calls"] += 1
        d["sync_counts"].append(len(mine))
        d["by_api"].update(e.name for e in mine)
        d["waits_us"] += waits
        d["wait_per_call_us"].append(sum(waits))
        d["host_us"].append(r.time_range.end - r.time_range.start)
        for e in ops:
            if inside(e) and e.time_range.end <= r.time_range.end:
                d["op_self_us"][e.name].append(e.self_cpu_time_total)
    return out


def _stats(xs: list[float]) -> dict | None:
    if not xs:
        return None
    return {"median": statistics.median(xs), "mean": statistics.fmean(xs), "max": max(xs), "n": len(xs)}


# ---- one rank ----------------------------------------------------------------------------------

def _start_group(spec: CaseSpec) -> torch.device:
    if spec.device == "cpu":
        from moe_comm.titan import cpu

        cpu.apply()  # TorchTitan's EP permute on CPU
        dist.init_process_group("gloo")
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count()
    torch.cuda.set_device(local_rank % gpus)
    if int(os.environ["WORLD_SIZE"]) <= gpus:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:  # ranks share a GPU: NCCL refuses that ("Duplicate GPU detected")
        dist.init_process_group("gloo")
    return torch.device("cuda", local_rank % gpus)


def _sleep_cycles(ms: float) -> int:
    """GPU clock cycles torch.cuda._sleep spins for `ms` milliseconds, measured here."""
    cycles = 10_000_000
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles // 10)
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    torch.cuda.synchronize()
    return int(cycles * ms / a.elapsed_time(b))


def worker(case: str, out: Path, shape: dict, iters: int, warmup: int) -> None:
    from moe_comm.backends import build_backend
    from moe_comm.backends.base import MoELayerSpec
    from moe_comm.config import MoEComm
    from moe_comm.predict.routing_plan import draw_topk

    spec = CASES[case]
    device = _start_group(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    T, D, E, K = shape["tokens"], shape["hidden"], shape["experts"], shape["top_k"]
    layer = MoELayerSpec(num_experts=E, top_k=K, hidden=D)
    config = MoEComm(backend=spec.backend, num_sms=NUM_SMS, max_tokens_per_rank=T)
    backend = build_backend(config, layer, dist.group.WORLD)
    g = torch.Generator().manual_seed(100 + rank)
    idx = draw_topk(shape["routing"], world, T, E, K, seed=0)[rank].to(device)
    w = torch.rand(T, K, generator=g).to(device)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16).to(device)
    grad = torch.randn(T, D, generator=g).to(device)
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    plain = Phases(None, device)
    for _ in range(warmup):
        one_call(backend, plain, x, idx, w, grad)
    sync()
    census = Census(on_gpu)
    counted = Phases(census, device)
    census_calls = 2
    with census:
        for _ in range(census_calls):
            one_call(backend, counted, x, idx, w, grad)
    sync()
    result = {"rank": rank, "world": world, "device": str(device), "phases": {},
              "device_name": torch.cuda.get_device_name(device) if on_gpu else "CPU"}
    for phase in PHASES:
        sites = {site: n / census_calls for site, n in sorted(census.found[phase].items())}
        result["phases"][phase] = {"census": {"per_call": sum(sites.values()), "sites": sites}}
    if on_gpu:
        result["phases"] = _gpu_passes(backend, device, x, idx, w, grad, iters, result["phases"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def _gpu_passes(backend, device, x, idx, w, grad, iters: int, phases: dict) -> dict:
    """The GPU instruments: host time per phase, the blocking probe (perf_counter, no profiler),
    then the profiler's CUDA sync calls with and without the probe. A profiler that cannot run
    (CUPTI under MPS, say) is recorded, and the counts fall back to the census plus what the
    probe shows."""
    def calls(ph: Phases, n: int, each_sync: bool = False):
        dist.barrier()
        for _ in range(n):
            one_call(backend, ph, x, idx, w, grad)
            if each_sync:
                torch.cuda.synchronize()
        torch.cuda.synchronize()

    plain = Phases(None, device)
    calls(plain, iters)
    probe = Phases(None, device)
    probe.sleep_cycles = _sleep_cycles(SLEEP_MS)
    for phase in PHASES:
        probe.probe = phase
        calls(probe, 2, each_sync=True)
    normal, probed, failure = {}, {}, None
    try:
        from torch.profiler import profile, ProfilerActivity

        for ph, name in ((Phases(None, device), None), *((Phases(None, device), p) for p in PHASES)):
            ph.profile, ph.probe, ph.sleep_cycles = True, name, probe.sleep_cycles
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                calls(ph, iters if name is None else 2, each_sync=name is not None)
            seen = _profiled(prof.events())
            if name is None:
                normal = seen
            else:
                probed[name] = seen.get(name)
    except Exception as e:  # noqa: BLE001 - recorded; the census and the probe still stand
        failure = f"{type(e).__name__}: {e}"[:300]
    for phase in PHASES:
        host = {k: statistics.median(ph.host_ms[phase]) for k, ph in (("plain", plain), ("probe", probe))}
        added = host["probe"] - host["plain"]
        phases[phase].update(host_ms=host, probe={"sleep_ms": SLEEP_MS, "host_ms_added": added,
                                                  "blocks_host": added >= 0.5 * SLEEP_MS})
        if failure or normal.get(phase) is None:
            census = phases[phase]["census"]["per_call"]
            extra = 1 if phases[phase]["probe"]["blocks_host"] and census == 0 else 0
            phases[phase].update(profiler=failure or "phase not seen by the profiler", syncs_per_call=census + extra,
                                 counted_by="census" + (" + 1 for the probe's wait outside Python" if extra else ""))
        else:
            phases[phase].update(_gpu_phase(normal[phase], probed.get(phase), phases[phase]["probe"]))
    return phases


def _gpu_phase(normal: dict, probed: dict | None, probe: dict) -> dict:
    calls = normal["calls"]
    entry = {
        "cuda_sync_calls": {"per_call": statistics.median(normal["sync_counts"]),
                            "by_api": {k: v / calls for k, v in normal["by_api"].items()},
                            "wait_us": _stats(normal["waits_us"]),
                            "wait_us_per_call": statistics.median(normal["wait_per_call_us"])},
        "host_us": _stats(normal["host_us"]),
    }
    outside = None
    if probe["blocks_host"] and probed is not None:
        api_max = max(probed["waits_us"], default=0.0) / 1e3
        probe["absorbed_by_cuda_sync_call"] = api_max >= 0.5 * SLEEP_MS
        if not probe["absorbed_by_cuda_sync_call"]:
            grown = {op: statistics.median(t) - statistics.median(normal["op_self_us"].get(op, [0.0]))
                     for op, t in probed["op_self_us"].items()}
            op = max(grown, key=grown.get) if grown else "?"
            outside = {"op": op, "grew_ms": grown.get(op, 0.0) / 1e3,
                       "self_cpu_us": _stats(normal["op_self_us"].get(op, []))}
            probe["wait_outside_cuda_api"] = outside
    entry["syncs_per_call"] = entry["cuda_sync_calls"]["per_call"] + (1 if outside else 0)
    entry["counted_by"] = "CUDA sync calls" + (" + the probe's wait outside the CUDA API" if outside else "")
    return entry


# ---- all cases ---------------------------------------------------------------------------------

def _summary(ranks: list[dict], census_only: bool) -> dict:
    out = {}
    for phase in PHASES:
        per = [r["phases"][phase] for r in ranks]
        s = {"census_per_call": max(p["census"]["per_call"] for p in per),
             "census_sites": sorted({site for p in per for site in p["census"]["sites"]})}
        if census_only:
            s["syncs_per_call"] = s["census_per_call"]
        else:
            waits = [p for p in per if p.get("cuda_sync_calls")]
            s["syncs_per_call"] = max(p.get("syncs_per_call", 0) for p in per)
            s["counted_by"] = sorted({p.get("counted_by", "") for p in per})
            s["host_ms"] = max(p["host_ms"]["plain"] for p in per)
            s["profiler"] = next((p["profiler"] for p in per if p.get("profiler")), "ok")
            all_waits = [w for p in waits for w in ([p["cuda_sync_calls"]["wait_us"]["median"]]
                                                   if p["cuda_sync_calls"]["wait_us"] else [])]
            s["cuda_sync_wait_us"] = {"median_over_ranks": statistics.median(all_waits) if all_waits else None,
                                      "mean_over_ranks": statistics.fmean(
                                          [p["cuda_sync_calls"]["wait_us"]["mean"] for p in waits
                                           if p["cuda_sync_calls"]["wait_us"]]) if all_waits else None}
            s["wait_us_per_call"] = max((p["cuda_sync_calls"]["wait_us_per_call"] for p in waits), default=None)
            outside = [p["probe"]["wait_outside_cuda_api"] for p in per if p.get("probe", {}).get("wait_outside_cuda_api")]
            if outside:
                costs = [o["self_cpu_us"]["median"] for o in outside if o["self_cpu_us"]]
                s["wait_outside_cuda_api"] = {"op": outside[0]["op"],
                                              "self_cpu_us_median": statistics.median(costs) if costs else None}
            s["blocks_host"] = any(p.get("probe", {}).get("blocks_host") for p in per)
        out[phase] = s
    return out


def run(args) -> int:
    cases = args.cases or list(CASES)
    shape = dict(SHAPE, tokens=args.tokens, hidden=args.hidden, experts=args.experts, top_k=args.top_k)
    doc = {"schema": SCHEMA, "command": args.command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "torch": torch.__version__, "device": "CPU",  # a GPU case's rank 0 names its GPU (no context here)
           "shape": shape, "num_sms": NUM_SMS, "sleep_ms": SLEEP_MS, "cases": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in cases:
        spec = CASES[name]
        if spec.device == "cuda" and not torch.cuda.is_available():
            doc["cases"][name] = {**asdict(spec), "status": "not run", "reason": "needs a CUDA GPU"}
            continue
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
            if spec.device == "cpu":
                env["CUDA_VISIBLE_DEVICES"] = ""
            else:
                from experiments.device_env import DEVICE_ENV  # NVLink multicast off on the lent machines

                env.update(DEVICE_ENV)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={spec.ranks}",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{args.port}", str(Path(__file__).resolve()),
                   "worker", "--case", name, "--out", tmp, "--iters", str(args.iters), "--warmup", str(args.warmup),
                   "--shape", json.dumps(shape)]
            shared = spec.device == "cuda" and spec.ranks > torch.cuda.device_count()
            started = time.monotonic()
            print(f"[host_syncs] {name}: {spec.where}", flush=True)
            from experiments.device_env import Mps

            with (Mps() if shared else _Nothing()):
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
            ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
            entry = {**asdict(spec), "seconds": round(time.monotonic() - started, 1)}
            if proc.returncode != 0 or len(ranks) != spec.ranks:
                entry.update(status="failed", reason=f"exit {proc.returncode}",
                             log_tail=(proc.stdout + proc.stderr)[-4000:])
            else:
                entry.update(status="ok", summary=_summary(ranks, spec.device == "cpu"), per_rank=ranks)
                if spec.device == "cuda":
                    doc["device"] = ranks[0]["device_name"]
            doc["cases"][name] = entry
            print(f"[host_syncs] {name}: {entry['status']} in {entry['seconds']} s", flush=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
    print(report(doc))
    return 0 if all(c["status"] in ("ok", "not run") for c in doc["cases"].values()) else 1


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def report(doc: dict) -> str:
    s = doc["shape"]
    lines = [f"Host synchronisations per call, {doc['device']}, torch {doc['torch']}, {doc['date'][:10]}; shape: "
             f"{s['tokens']} tokens per rank, hidden {s['hidden']}, {s['experts']} experts, top-{s['top_k']}, "
             f"{s['routing']} routing. Command: `{doc['command']}`. The probe: does a {doc['sleep_ms']:g} ms GPU "
             "sleep queued before the phase hold up its host call (and where, when no CUDA sync call took it).", "",
             "| case | phase | syncs / call | CUDA sync wait µs (median / mean) | wait µs per call | probe | host ms "
             "| census (call sites) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    fmt = lambda v: "-" if v is None else f"{v:,.0f}"  # noqa: E731
    for name, c in doc["cases"].items():
        if c["status"] != "ok":
            lines.append(f"| {name} | {c['status']}: {c.get('reason', '')} | | | | | | |")
            continue
        for phase, p in c["summary"].items():
            w = p.get("cuda_sync_wait_us") or {}
            outside = p.get("wait_outside_cuda_api")
            probe = ("-" if "blocks_host" not in p else
                     f"waits, outside the CUDA API: {outside['op']} ({fmt(outside['self_cpu_us_median'])} µs self CPU)"
                     if outside else "waits" if p["blocks_host"] else "no wait")
            if p.get("profiler", "ok") != "ok":
                probe += f"; profiler: {p['profiler']}"
            lines.append(
                f"| {name} | {phase} | {p['syncs_per_call']:g} | {fmt(w.get('median_over_ranks'))} / "
                f"{fmt(w.get('mean_over_ranks'))} | {fmt(p.get('wait_us_per_call'))} | {probe} | "
                + (f"{p['host_ms']:.2f}" if "host_ms" in p else "-")
                + f" | {p['census_per_call']:g}" + (f": {'; '.join(p['census_sites'])}" if p["census_sites"] else "")
                + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run", help="every case (each under torchrun), merged into one JSON")
    r.add_argument("--out", required=True)
    r.add_argument("--cases", nargs="+", choices=list(CASES))
    r.add_argument("--tokens", type=int, default=SHAPE["tokens"])
    r.add_argument("--hidden", type=int, default=SHAPE["hidden"])
    r.add_argument("--experts", type=int, default=SHAPE["experts"])
    r.add_argument("--top-k", type=int, default=SHAPE["top_k"])
    r.add_argument("--iters", type=int, default=10)
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--port", type=int, default=29710)
    r.add_argument("--timeout-s", type=float, default=300.0)
    w = sub.add_parser("worker", help="one rank of one case (under torchrun)")
    w.add_argument("--case", required=True, choices=list(CASES))
    w.add_argument("--out", required=True)
    w.add_argument("--iters", type=int, default=10)
    w.add_argument("--warmup", type=int, default=3)
    w.add_argument("--shape", required=True)
    rep = sub.add_parser("report", help="the markdown table of a host_syncs JSON")
    rep.add_argument("json")
    args = p.parse_args(argv)
    if args.verb == "worker":
        worker(args.case, Path(args.out), json.loads(args.shape), args.iters, args.warmup)
        return 0
    if args.verb == "report":
        print(report(json.loads(Path(args.json).read_text())))
        return 0
    args.command = shlex.join(["python", "experiments/host_syncs.py", *argv])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
