"""Where a training step's host time and GPU idle go, run by run (issue 35 item 2).

    python experiments/host_profile.py --recipe recipes/deepseek_v3_671b_h200x1.toml --out OUT \\
        --runs nvshmem nccl nvshmem-nographs=nvshmem,--moe_comm.cuda_graphs=false \\
        --steps 16 --sync-steps 9 10 --profile-steps 12 13 [-- TorchTitan overrides for every run]

A run is LABEL=BACKEND[,NAME=VALUE...] (or just BACKEND): NAME=VALUE pairs are environment
variables of that run, or overrides of the recipe when NAME starts with "--"
(`nvshmem-prefetch=nvshmem,--training.dataloader.num_workers=1`); a true/false field also
takes its flag alone (`nvshmem-compiled=nvshmem,--compile.enable`). Every run's overrides are
read as `python -m moe_comm train` reads them (moe_comm.recipe) before the first run starts, so a
bad one stops the command naming it, and the trainer gets them spelled as TorchTitan parses them
(`--moe_comm.cuda_graphs=false` reaches it as `--moe_comm.no-cuda_graphs`). Each run is one
`torchrun --standalone --nproc_per_node 1` of this file as TorchTitan's trainer (as
`-m torchtitan.train` would run it, `[metrics] log_freq` 1, no W&B), which records:

  every step, without a profiler:
    - the trainer's host phases: loading the batch, issuing forward + backward, gradient
      clipping, issuing the optimizer, waiting for the GPU at the step's end (TorchTitan's
      `.item()`; near zero means the host, not the GPU, set the step's pace), metrics logging;
    - the host time inside each MoE dispatch and combine call (forward; perf_counter around
      the layer's backend, instrumentation included);
    - the CPU time of every thread of the process (/proc), so a thread that spins shows;
  at --sync-steps: `torch.cuda.set_sync_debug_mode("warn")`, every synchronising call counted
    by its call site (the first frame outside torch);
  at --profile-steps (and one step after, for the last one's end): a torch.profiler trace with
    CPU and CUDA activities, each module's forward, the trainer's phases and the MoE calls
    annotated. It is reduced here to, per step: the GPU's busy and idle share; each idle gap's
    cause (the next kernel was launched late by the host, and what the host was doing then; the
    host had waited in a synchronisation; or the kernel had been issued and waited on the
    device); kernel launches, synchronising calls and allocator calls per step; host time per
    MoE op.

OUT/host_profile.json holds every run (OUT/runs/LABEL/ its trace, log and raw records);
OUT/host_profile.md compares them. The profiler itself costs host time per op, which widens
host-bound gaps in the profiled steps; the unprofiled phases and MoE times do not have that bias.
"""

import argparse
import gzip
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from bisect import bisect_right
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.device_env import DEVICE_ENV  # noqa: E402
from experiments.profile_summary import category, union_length  # noqa: E402

WORKER_ENV = "MOE_COMM_HOST_PROFILE"  # the worker's settings (JSON), set by the driver
STEP_MARK = "host_profile.step#"
# CUDA runtime/driver calls that launch device work, wait for it, or go to the allocator
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
ALLOCATOR_CALLS = ("cudaMalloc", "cudaFree", "cudaMallocHost", "cudaFreeHost", "cudaHostAlloc")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
TOP_LABELS = 25


# ---- the trace ---------------------------------------------------------------------------------

@dataclass
class _Ev:
    name: str
    ts: float
    end: float
    tid: Any
    cat: str
    corr: int | None = None


def _events(trace: dict) -> list[_Ev]:
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args = e.get("args") or {}
        corr = args.get("correlation", args.get("correlation id"))
        out.append(_Ev(str(e.get("name", "")), float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("tid"),
                       str(e.get("cat", "")), corr))
    return out


def _matches(name: str, calls: tuple[str, ...]) -> bool:
    return any(name == c or name.startswith(c + "_") or name.startswith(c + "Ex") for c in calls)


class _HostStacks:
    """Per host thread: its annotations (nested ranges) and its outermost CPU ops, to say what
    the thread was doing at a given time."""

    def __init__(self, events: list[_Ev]):
        self.notes: dict[Any, list[_Ev]] = defaultdict(list)
        ops: dict[Any, list[_Ev]] = defaultdict(list)
        for e in events:
            if e.cat == "user_annotation" and not e.name.startswith(STEP_MARK):
                self.notes[e.tid].append(e)
            elif e.cat == "cpu_op":
                ops[e.tid].append(e)
        self.tops: dict[Any, list[_Ev]] = {}
        for tid, evs in ops.items():
            evs.sort(key=lambda e: (e.ts, -e.end))
            tops, end = [], float("-inf")
            for e in evs:
                if e.ts >= end:  # not inside the previous outermost op
                    tops.append(e)
                    end = e.end
            self.tops[tid] = tops
        for evs in self.notes.values():
            evs.sort(key=lambda e: (e.ts, -e.end))
        self.note_starts = {tid: [e.ts for e in evs] for tid, evs in self.notes.items()}
        self.top_starts = {tid: [e.ts for e in evs] for tid, evs in self.tops.items()}

    def label(self, tid: Any, ts: float) -> str:
        """What the host thread was doing at `ts`: its innermost annotation (a module's forward,
        a trainer phase, an MoE call), else its outermost op (on the autograd thread: the
        backward node), else nothing (Python between ops)."""
        notes = self.notes.get(tid, [])
        for j in range(bisect_right(self.note_starts.get(tid, []), ts) - 1, -1, -1):
            if notes[j].end >= ts:  # ranges nest, so the latest-starting open one is the innermost
                return notes[j].name
        k = bisect_right(self.top_starts.get(tid, []), ts) - 1
        if k >= 0 and self.tops[tid][k].end >= ts:
            return self.tops[tid][k].name
        return "no op open (Python between ops)"


def analyse(trace: dict, steps: list[int]) -> dict[str, Any]:
    """Per step of `steps` (annotated STEP_MARK + n), and their mean: the reduction the module
    doc describes. A step's span runs from its mark to the next step's mark (so the trainer's
    work between steps counts), or to its own mark's end for the last step of the trace. The
    marks are the host's (cat user_annotation): the profiler also copies each onto the GPU's
    timeline (gpu_user_annotation), starting where the step's first kernel ran, and spans taken
    from those copies left out the GPU's idle from the step's start to its first kernel (run 41:
    2.1% idle reported where 17.6 ms of each 364 ms step had no kernel)."""
    events = _events(trace)
    marks = sorted((e for e in events if e.name.startswith(STEP_MARK) and e.cat == "user_annotation"),
                   key=lambda e: e.ts)
    spans = {}
    for i, m in enumerate(marks):
        n = int(m.name[len(STEP_MARK):])
        spans[n] = (m.ts, marks[i + 1].ts if i + 1 < len(marks) else m.end)
    gpu = sorted((e for e in events if e.cat in GPU_CATS), key=lambda e: e.ts)
    runtime = [e for e in events if e.cat in ("cuda_runtime", "cuda_driver")]
    launch_of = {e.corr: e for e in runtime if e.corr is not None and _matches(e.name, LAUNCH_CALLS)}
    syncs = [e for e in runtime if _matches(e.name, SYNC_CALLS)]
    stacks = _HostStacks(events)
    per_step = {}
    for n in steps:
        if n not in spans:
            continue
        a, b = spans[n]
        acts = [e for e in gpu if e.end > a and e.ts < b]
        busy = union_length([(max(e.ts, a), min(e.end, b)) for e in acts])
        idle_by_kind: Counter = Counter()
        idle_by_label: Counter = Counter()
        cursor = a
        for e in acts:  # merged walk: a gap is where the next activity starts after all before ended
            if e.ts > cursor:
                for kind, label, us in _gap_cause(cursor, e, launch_of, syncs, stacks):
                    idle_by_kind[kind] += us
                    idle_by_label[f"{kind}: {label}"] += us
            cursor = max(cursor, e.end)
        if b > cursor:
            idle_by_kind["after the last kernel"] += b - cursor
            idle_by_label["after the last kernel: " + stacks.label(marks[0].tid, b)] += b - cursor
        in_span = [e for e in runtime if a <= e.ts < b]
        sync_sites = Counter(f"{e.name} in {stacks.label(e.tid, e.ts)}" for e in in_span if _matches(e.name, SYNC_CALLS))
        kernels = Counter()
        for e in acts:
            kernels[category(e.name)] += min(e.end, b) - max(e.ts, a)
        per_step[n] = {
            "span_ms": (b - a) / 1e3,
            "gpu_busy_ms": busy / 1e3,
            "gpu_idle_ms": (b - a - busy) / 1e3,
            "gpu_idle_share": (b - a - busy) / (b - a) if b > a else 0.0,
            "idle_ms_by_cause": {k: v / 1e3 for k, v in idle_by_kind.most_common()},
            "idle_ms_by_host_activity": {k: v / 1e3 for k, v in idle_by_label.most_common(TOP_LABELS)},
            "launches": sum(1 for e in in_span if _matches(e.name, LAUNCH_CALLS)),
            "graph_launches": sum(1 for e in in_span if e.name.startswith("cudaGraphLaunch")),
            "syncs": sum(sync_sites.values()),
            "syncs_by_site": dict(sync_sites.most_common()),
            "allocator_calls": dict(Counter(e.name for e in in_span if _matches(e.name, ALLOCATOR_CALLS))),
            "kernel_ms_by_category": {k: v / 1e3 for k, v in kernels.most_common()},
            "moe_host_us": _moe_host_us([e for e in events if a <= e.ts < b]),
        }
    return {"steps": per_step, "mean": _mean_of(list(per_step.values()))}


def _gap_cause(gap_start: float, nxt: _Ev, launch_of: dict, syncs: list[_Ev],
               stacks: _HostStacks) -> list[tuple[str, str, float]]:
    """Why the GPU idled from `gap_start` until `nxt` began, as (cause, label, microseconds):
    until the host had launched `nxt`, the host's (late, or back from a synchronisation); from
    then on, the device's (a wait on another stream, or launch latency)."""
    gap = nxt.ts - gap_start
    launch = launch_of.get(nxt.corr)
    if launch is None:
        return [("unattributed", nxt.name[:80], gap)]
    host = max(0.0, min(launch.end, nxt.ts) - gap_start)
    out = []
    if host > 0:
        waited = [s for s in syncs if s.ts <= gap_start and gap_start <= s.end <= launch.ts]
        if waited:
            s = max(waited, key=lambda s: s.end)
            out.append(("host had synchronised", f"{s.name} in {stacks.label(s.tid, s.ts)}", host))
        else:
            out.append(("host launched late", stacks.label(launch.tid, launch.ts), host))
    if gap - host > 0:
        out.append(("waited on the device", nxt.name[:80], gap - host))
    return out


def _moe_host_us(events: list[_Ev]) -> dict[str, dict[str, float]]:
    """Host time of the MoE calls: the annotated forward calls (moe:...) and our ops (moe_comm::...)."""
    times: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if (e.cat == "user_annotation" and e.name.startswith("moe:")) or (e.cat == "cpu_op" and e.name.startswith("moe_comm::")):
            times[e.name].append(e.end - e.ts)
    return {k: {"calls": len(v), "mean_us": statistics.fmean(v), "total_us": sum(v)} for k, v in sorted(times.items())}


def _mean_of(records: list[dict]) -> dict[str, Any]:
    """Numbers averaged over steps, dicts of numbers key by key."""
    if not records:
        return {}
    out: dict[str, Any] = {}
    for k, v in records[0].items():
        if isinstance(v, (int, float)):
            out[k] = statistics.fmean(r[k] for r in records)
        elif isinstance(v, dict) and all(isinstance(x, (int, float)) for x in v.values()):
            keys = {kk for r in records for kk in r[k]}
            merged = {kk: statistics.fmean(r[k].get(kk, 0) for r in records) for kk in keys}
            out[k] = dict(sorted(merged.items(), key=lambda kv: -kv[1]))
        else:
            out[k] = v
    return out


# ---- the worker (a TorchTitan trainer under torchrun) ---------------------------------------

def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of every thread of this process, by "tid name"."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[f"{task.name} {name}"] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return out


def _call_site() -> str:
    import traceback

    frames = traceback.extract_stack()[:-2]
    outside = [f for f in frames if "/torch/" not in f.filename and "warnings" not in f.filename
               and not f.filename.endswith("host_profile.py")]
    f = outside[-1] if outside else frames[-1]
    return f"{Path(f.filename).name}:{f.lineno} ({f.name})"


def worker() -> None:
    import contextlib
    import warnings

    import torch
    from torchtitan.train import main, Trainer

    settings = json.loads(os.environ[WORKER_ENV])
    out = Path(settings["out"])
    profile_steps = set(settings["profile_steps"])
    sync_steps = set(settings["sync_steps"])
    record: dict[str, Any] = {"steps": {}, "sync_sites": Counter(), "sync_steps": sorted(sync_steps)}
    state: dict[str, Any] = {"profiler": None, "annotate": False, "step": None}

    def mark(name: str):
        return torch.profiler.record_function(name) if state["annotate"] else contextlib.nullcontext()

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            with mark(f"phase:{name}"):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    state["times"][name] = state["times"].get(name, 0.0) + time.perf_counter() - t0
                    state["times"][f"{name}_end"] = time.perf_counter()
        return wrapper

    class _Batches:
        def __init__(self, it):
            self.it = it

        def __iter__(self):
            return self

        def __next__(self):
            return timed("data", lambda: next(self.it))()

    def moe_timer(backend, op: str):
        fn = getattr(backend, op)

        def wrapper(*args, **kwargs):
            with mark(f"moe:{op}"):
                t0 = time.perf_counter()
                result = fn(*args, **kwargs)
                state["moe"][op].append(time.perf_counter() - t0)
            return result
        return wrapper

    def module_marks(model) -> list:
        """Forward hooks that annotate the model's blocks and the MoE layer's parts (removed
        when the profile ends)."""
        handles = []
        for name, module in model.named_modules():
            depth = name.count(".")
            if not name or not (depth <= 2 or (depth == 3 and ".moe." in name)):
                continue

            def pre(mod, args, _label=f"fwd:{name}"):
                rf = torch.profiler.record_function(_label)
                rf.__enter__()
                mod.__dict__.setdefault("_host_profile_marks", []).append(rf)

            def post(mod, args, output):
                marks = mod.__dict__.get("_host_profile_marks")
                if marks:
                    marks.pop().__exit__(None, None, None)

            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        return handles

    class HostProfileTrainer(Trainer):
        def __init__(self, job_config):
            super().__init__(job_config)
            self.optimizers.step = timed("optimizer", self.optimizers.step)
            self.metrics_processor.log = timed("log", self.metrics_processor.log)
            self.backends = []
            for part in self.model_parts:
                for m in part.modules():
                    backend = getattr(m, "comm_backend", None)
                    if backend is not None:
                        backend.dispatch = moe_timer(backend, "dispatch")
                        backend.combine = moe_timer(backend, "combine")
                        self.backends.append(backend)

        def forward_backward_step(self, *args, **kwargs):
            return timed("forward_backward", super().forward_backward_step)(*args, **kwargs)

        def train_step(self, data_iterator):
            n = self.step
            if n == min(profile_steps, default=-1):
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                state["profiler"] = torch.profiler.profile(activities=activities)
                state["profiler"].__enter__()
                state["annotate"] = True
                state["hooks"] = [h for part in self.model_parts for h in module_marks(part)]
            if n == settings["thread_steps"][0]:
                state["threads"] = (time.perf_counter(), _thread_cpu_s())
            state["times"], state["moe"] = {}, defaultdict(list)
            syncing = n in sync_steps
            with contextlib.ExitStack() as stack:
                if syncing:
                    stack.enter_context(warnings.catch_warnings())
                    warnings.simplefilter("always")
                    shown = warnings.showwarning

                    def count(message, category, filename, lineno, file=None, line=None):
                        if "synchroniz" in str(message):
                            record["sync_sites"][_call_site()] += 1
                        else:
                            shown(message, category, filename, lineno, file, line)

                    warnings.showwarning = count
                    stack.callback(lambda: setattr(warnings, "showwarning", shown))
                    if torch.cuda.is_available():  # (a CPU run checks the plumbing only)
                        torch.cuda.set_sync_debug_mode("warn")
                        stack.callback(torch.cuda.set_sync_debug_mode, 0)
                stack.enter_context(mark(f"{STEP_MARK}{n}"))
                t0 = time.perf_counter()
                super().train_step(_Batches(data_iterator))
                t1 = time.perf_counter()
            times = state["times"]
            record["steps"][n] = {
                "step_ms": (t1 - t0) * 1e3,
                "data_ms": times.get("data", 0.0) * 1e3,
                "forward_backward_issue_ms": times.get("forward_backward", 0.0) * 1e3,
                "clip_ms": (times.get("optimizer_end", t1) - times.get("forward_backward_end", t0)
                            - times.get("optimizer", 0.0)) * 1e3,
                "optimizer_issue_ms": times.get("optimizer", 0.0) * 1e3,
                "end_of_step_wait_ms": (times.get("log_end", t1) - times.get("optimizer_end", t1)
                                        - times.get("log", 0.0)) * 1e3,
                "log_ms": times.get("log", 0.0) * 1e3,
                "moe_host_us": {op: [t * 1e6 for t in v] for op, v in state["moe"].items()},
                "synced_debug": syncing,
                "profiled": state["annotate"],
            }
            if n == settings["thread_steps"][1] and "threads" in state:
                start, before = state.pop("threads")
                wall = time.perf_counter() - start
                after = _thread_cpu_s()
                record["thread_cpu_share"] = dict(sorted(
                    ((k, (after[k] - before.get(k, 0.0)) / wall) for k in after if after[k] - before.get(k, 0.0) > 0.02 * wall),
                    key=lambda kv: -kv[1]))
            if state["profiler"] is not None and n == max(profile_steps) + 1:
                state["annotate"] = False
                for h in state.pop("hooks"):
                    h.remove()
                state["profiler"].__exit__(None, None, None)
                state["profiler"].export_chrome_trace(str(out / "trace.json.gz"))
                state["profiler"] = None

        def close(self) -> None:
            record["graphs"] = {}
            for i, b in enumerate(self.backends):
                graphs = getattr(b, "graphs", None)
                if graphs is not None:
                    record["graphs"][f"layer {i}"] = {**dict(graphs.counts), "stopped": graphs.stopped}
            if torch.cuda.is_available():
                record["max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
                record["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            record["cpus"] = len(os.sched_getaffinity(0))
            record["sync_sites"] = dict(record["sync_sites"].most_common())
            (out / "worker.json").write_text(json.dumps(record, indent=1))
            super().close()

    main(HostProfileTrainer)


# ---- the driver --------------------------------------------------------------------------------

@dataclass
class RunSpec:
    label: str
    backend: str
    env: dict[str, str] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)


def parse_run(text: str) -> RunSpec:
    """LABEL=BACKEND[,NAME=VALUE...] or BACKEND (module doc)."""
    label, sep, rest = text.partition("=")
    if not sep:
        return RunSpec(text, text)
    backend, *pairs = rest.split(",")
    spec = RunSpec(label, backend)
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if name.startswith("--"):
            spec.overrides += [name, value] if eq else [name]  # a true/false field's flag alone
        elif eq and name:
            spec.env[name] = value
        else:
            raise SystemExit(f"--runs {text!r}: write LABEL=BACKEND,NAME=VALUE,... ({pair!r} has no NAME=VALUE)")
    return spec


def checked(recipe_path: str, spec: RunSpec, common: list[str]) -> RunSpec:
    """The run with its overrides (its own, then those for every run) read by the recipe loader
    `python -m moe_comm train` uses, and spelled as TorchTitan parses them; a bad one exits naming
    the run and the field, before any run starts."""
    from moe_comm import recipe

    words = ["--moe_comm.backend", spec.backend, *spec.overrides, *common]
    try:
        r = recipe.load(recipe_path, words, check_paths=False, allow_blockers=True)
    except recipe.RecipeError as e:
        raise SystemExit(f"--runs {spec.label}: {e}") from None
    return RunSpec(spec.label, spec.backend, spec.env, r.overrides)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise_worker(w: dict, first_step: int) -> dict[str, Any]:
    """Medians over the unprofiled, unsynced steps from `first_step` on."""
    plain = [r for n, r in w["steps"].items() if int(n) >= first_step and not r["profiled"] and not r["synced_debug"]]
    phases = ("step_ms", "data_ms", "forward_backward_issue_ms", "clip_ms", "optimizer_issue_ms",
              "end_of_step_wait_ms", "log_ms")
    out: dict[str, Any] = {p: _median([r[p] for r in plain]) for p in phases}
    moe = defaultdict(list)
    for r in plain:
        for op, us in r["moe_host_us"].items():
            moe[op] += us
    out["moe_host_us_per_call"] = {op: _median(us) for op, us in sorted(moe.items())}
    out["steps_summarised"] = len(plain)
    syncs = len(w.get("sync_steps", [])) or 1
    out["syncs_per_step_by_site"] = {k: v / syncs for k, v in w.get("sync_sites", {}).items()}
    out["syncs_per_step"] = sum(out["syncs_per_step_by_site"].values())
    for k in ("thread_cpu_share", "graphs", "max_reserved_gib", "max_allocated_gib", "cpus"):
        out[k] = w.get(k)
    return out


def quiet_steps(args: argparse.Namespace) -> tuple[int, int]:
    """The first stretch of steps from --first-step on that are neither sync-debugged nor
    profiled: the threads' CPU time is read over it."""
    busy = set(args.sync_steps)
    if args.profile_steps:
        busy |= set(range(min(args.profile_steps), max(args.profile_steps) + 2))
    first = args.first_step
    while first in busy:
        first += 1
    last = first
    while last + 1 <= args.steps and last + 1 not in busy:
        last += 1
    return first, last


def run_one(args: argparse.Namespace, spec: RunSpec) -> dict[str, Any]:
    folder = args.out / "runs" / spec.label
    folder.mkdir(parents=True, exist_ok=True)
    settings = {"out": str(folder), "profile_steps": args.profile_steps, "sync_steps": args.sync_steps,
                "thread_steps": quiet_steps(args)}
    env = {**os.environ, **DEVICE_ENV, **spec.env, WORKER_ENV: json.dumps(settings), "HF_DATASETS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           str(Path(__file__).resolve()), "--job.config_file", args.recipe,
           "--training.steps", str(args.steps), "--metrics.log_freq", "1", "--metrics.no-enable-wandb",
           "--job.dump_folder", str(folder), *spec.overrides]
    print(f"[host_profile] {spec.label}: {shlex.join(cmd)}", flush=True)
    start = time.monotonic()
    with open(folder / "train.log", "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
                                start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = None
    result: dict[str, Any] = {"label": spec.label, "backend": spec.backend, "env": spec.env,
                              "overrides": spec.overrides, "command": shlex.join(cmd),
                              "wall_s": time.monotonic() - start, "returncode": rc}
    worker_json, trace = folder / "worker.json", folder / "trace.json.gz"
    if rc != 0 or not worker_json.is_file():
        tail = (folder / "train.log").read_text(errors="replace").splitlines()[-30:]
        result["error"] = "timeout" if rc is None else f"exit {rc}"
        result["log_tail"] = tail
        return result
    result["unprofiled"] = summarise_worker(json.loads(worker_json.read_text()), args.first_step)
    if trace.is_file():
        with gzip.open(trace, "rt") as f:
            result["profiled"] = analyse(json.load(f), args.profile_steps)["mean"]
    return result


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    lines = [f"# Host time and GPU idle, `{args.recipe}`", "",
             f"{args.steps} steps; phases: medians of steps >= {args.first_step} neither profiled nor "
             f"sync-debugged; syncs at steps {args.sync_steps}; profile: mean of steps {args.profile_steps} "
             "(torch.profiler, CPU + CUDA; it widens host-bound gaps).", "",
             "| run | step ms | data ms | issue fwd+bwd ms | end-of-step wait ms | MoE dispatch / combine host us | "
             "GPU idle % (profiled) | idle ms: launched late / after sync / device | syncs/step | launches/step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error']} | | | | | | | | |")
            continue
        u, p = r["unprofiled"], r.get("profiled", {})
        moe = u["moe_host_us_per_call"]
        idle = p.get("idle_ms_by_cause", {})
        lines.append(
            f"| {r['label']} | {_fmt(u['step_ms'])} | {_fmt(u['data_ms'])} | {_fmt(u['forward_backward_issue_ms'])} | "
            f"{_fmt(u['end_of_step_wait_ms'])} | {_fmt(moe.get('dispatch'), '.0f')} / {_fmt(moe.get('combine'), '.0f')} | "
            f"{_fmt(100 * p['gpu_idle_share'] if p else None)} | {_fmt(idle.get('host launched late'))} / "
            f"{_fmt(idle.get('host had synchronised'))} / {_fmt(idle.get('waited on the device'))} | "
            f"{_fmt(u['syncs_per_step'])} | {_fmt(p.get('launches'), '.0f')} |")
    for r in results:
        if "error" in r:
            continue
        p = r.get("profiled", {})
        lines += ["", f"## {r['label']}", "", f"    {r['command']}", ""]
        lines.append("Idle by what the host was doing (ms per step): " + "; ".join(
            f"{k} {v:.2f}" for k, v in list(p.get("idle_ms_by_host_activity", {}).items())[:12]))
        lines.append("")
        lines.append("Syncs per step by site: " + ("; ".join(
            f"{k} x{v:g}" for k, v in r["unprofiled"]["syncs_per_step_by_site"].items()) or "none"))
        lines.append("")
        lines.append("Threads using more than 2% of a core: " + "; ".join(
            f"{k} {100 * v:.0f}%" for k, v in (r["unprofiled"]["thread_cpu_share"] or {}).items()))
        if r["unprofiled"].get("graphs"):
            lines += ["", f"CUDA graphs: {r['unprofiled']['graphs']}"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ours, overrides = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="recipes/deepseek_v3_671b_h200x1.toml")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs", nargs="+", default=["nvshmem", "nccl"], help="LABEL=BACKEND[,NAME=VALUE...] (module doc)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--first-step", type=int, default=4, help="first step the unprofiled medians take")
    p.add_argument("--sync-steps", type=int, nargs="*", default=[9, 10])
    p.add_argument("--profile-steps", type=int, nargs="*", default=[12, 13])
    p.add_argument("--timeout", type=float, default=240, help="seconds per run")
    args = p.parse_args(ours)
    args.overrides = overrides
    if args.profile_steps and max(args.profile_steps) + 1 > args.steps:
        p.error(f"--profile-steps {args.profile_steps}: the trace ends one step after the last, so --steps must be "
                f"at least {max(args.profile_steps) + 1}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    specs = [checked(args.recipe, parse_run(text), args.overrides) for text in args.runs]
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for spec in specs:
        results.append(run_one(args, spec))
        (args.out / "host_profile.json").write_text(json.dumps(
            {"recipe": args.recipe, "argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M"), "runs": results},
            indent=1))
    (args.out / "host_profile.md").write_text(markdown(results, args))
    print((args.out / "host_profile.md").read_text())
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    if WORKER_ENV in os.environ:
        worker()
    else:
        sys.exit(main())
