"""Where a training step's GPU time goes, from a TorchTitan (torch.profiler) trace of one rank.

    python experiments/profile_summary.py TRACE.json [OUT.json]

Kernel time is summed by category over the profiled step's span: MoE dispatch/combine
(this project's kernels, or the NCCL send/recv kernels of the all-to-all path), FSDP
collectives (all-gather / reduce-scatter), GEMMs, and everything else; "idle" is the share of
the span in which no kernel ran at all (host syncs, launch gaps). Every profile summary under
results/ was computed this way, so the numbers compare.

`launchers_ms` says who launched the time: each kernel is traced back, through the launch call
that shares its correlation id, to the CPU events open around that call on its thread, the
innermost annotation or autograd node (`fwd:layers.1.moe`, `autograd::engine::evaluate_function:
XBackward0`) and the innermost op. That is how run 60's FP8 step showed autograd zero-filling a
gradient for each of dispatch's non-differentiable outputs (`_DispatchFp8RowsBackward >
aten::fill_`), which no kernel name would have told.
"""

import json
import sys
from pathlib import Path

CATEGORIES = [
    ("moe_comm_kernels", ("moe_comm::", "dispatch_kernel", "combine_kernel", "combine_backward_kernel")),
    ("all_to_all", ("SendRecv", "AllToAll", "all_to_all")),
    ("fsdp_collectives", ("AllGather", "ReduceScatter", "AllReduce")),
    ("gemm", ("gemm", "Gemm", "GEMM", "cutlass", "sm90_xmma", "nvjet", "grouped", "Grouped")),
]


TOP = 40  # kernels listed by name


def category(name: str) -> str:
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other_kernels"


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def top_kernels_ms(by_name: dict[str, float]) -> dict[str, float]:
    """The TOP largest kernel times (us in, ms out) by the first 160 characters of their names,
    kernels whose names share those summed: CUTLASS instantiations differ only past them, and
    keyed by the cut name one overwrote another, so a list could show part of a family's time
    (run 32's bf16 grouped GEMMs: 15.4 ms listed, against about 50 ms that its GEMM total implies)."""
    cut: dict[str, float] = {}
    for name, t in by_name.items():
        cut[name[:160]] = cut.get(name[:160], 0.0) + t
    return {name: t / 1e3 for name, t in sorted(cut.items(), key=lambda kv: -kv[1])[:TOP]}


AUTOGRAD_NODE = "autograd::engine::evaluate_function: "


def launchers_ms(events: list[dict], span_start: float, span_end: float) -> dict[str, float]:
    """The TOP largest kernel times in the span (ms) by "context > op | kernel": the innermost
    annotation or autograd node open around the kernel's launch, the innermost other CPU op, and the
    kernel's name (80 characters). Kernels whose launch is not in the trace count under "?"."""
    where: dict[int, str] = {}  # correlation -> "context > op"
    by_thread: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"):
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        open_: list[dict] = []  # the CPU events enclosing the current time, outermost first
        for e in thread:
            while open_ and open_[-1]["ts"] + open_[-1]["dur"] < e["ts"]:
                open_.pop()
            if e["cat"] in ("cuda_runtime", "cuda_driver"):
                correlation = e.get("args", {}).get("correlation")
                if correlation is not None:  # a launch: the kernel it queued has the same id
                    context = next((o["name"] for o in reversed(open_) if o["cat"] == "user_annotation"
                                    or o["name"].startswith(AUTOGRAD_NODE)), "-")
                    op = next((o["name"] for o in reversed(open_) if o["cat"] == "cpu_op"
                               and not o["name"].startswith(AUTOGRAD_NODE)), "-")
                    where[correlation] = f"{context} > {op}"
                continue
            open_.append(e)
    times: dict[str, float] = {}
    for k in events:
        if k.get("ph") != "X" or k.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        a, b = max(k["ts"], span_start), min(k["ts"] + k["dur"], span_end)
        if b <= a:
            continue
        key = f"{where.get(k.get('args', {}).get('correlation'), '?')} | {k['name'][:80]}"
        times[key] = times.get(key, 0.0) + (b - a)
    return {key: t / 1e3 for key, t in sorted(times.items(), key=lambda kv: -kv[1])[:TOP]}


def summarize(trace_path: Path) -> dict:
    events = json.loads(trace_path.read_text()).get("traceEvents", [])
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    if steps:
        span_start = min(s["ts"] for s in steps)
        span_end = max(s["ts"] + s["dur"] for s in steps)
    else:
        span_start = min(k["ts"] for k in kernels)
        span_end = max(k["ts"] + k["dur"] for k in kernels)
    span = span_end - span_start
    by_cat: dict[str, float] = {}
    by_name: dict[str, float] = {}
    intervals = []
    for k in kernels:
        a, b = max(k["ts"], span_start), min(k["ts"] + k["dur"], span_end)
        if b <= a:
            continue
        cat = category(k["name"])
        by_cat[cat] = by_cat.get(cat, 0.0) + (b - a)
        by_name[k["name"]] = by_name.get(k["name"], 0.0) + (b - a)
        intervals.append((a, b))
    busy = union_length(intervals)
    return {
        "trace": str(trace_path),
        "span_ms": span / 1e3,
        "kernel_time_share": {c: t / span for c, t in sorted(by_cat.items())},
        "gpu_busy_share": busy / span,
        "gpu_idle_share": 1 - busy / span,
        # the kernels that take the most time, by name (first 160 characters), for a breakdown
        # finer than the categories (the MoE layer's permute, grouped GEMM, attention...)
        "top_kernels_ms": top_kernels_ms(by_name),
        "launchers_ms": launchers_ms(events, span_start, span_end),
    }


def main() -> int:
    summary = summarize(Path(sys.argv[1]))
    text = json.dumps(summary, indent=1)
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
