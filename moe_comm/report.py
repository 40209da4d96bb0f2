"""`python -m moe_comm report RUN_DIR...`: compare runs' per-step JSONL offline.

Reads each run's metrics.jsonl (written by moe_comm.metrics), summarises the steady state (the
median over steps after a warm-up, which includes start-up and compilation), and writes a
markdown table comparing backends plus PNG plots into --out. Used for results/ and by
experiments/mfu_sweep.py; no W&B or network needed.
"""

import argparse
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_comm.metrics import keys
from moe_comm.metrics.keys import JSONL_NAME

DEFAULT_WARMUP_STEPS = 2

# (summary field, JSONL key, how a step's values are reduced)
_SUMMARY_FIELDS = (
    ("tps", keys.TPS, "median"),
    ("tflops", keys.TFLOPS, "median"),
    ("mfu", keys.MFU, "median"),
    ("comm_exposed_pct", keys.COMM_EXPOSED_PCT, "median"),
    ("dispatch_ms", keys.DISPATCH_MS, "median"),
    ("combine_ms", keys.COMBINE_MS, "median"),
    ("comm_ms", keys.COMM_MS, "median"),
    ("step_ms", keys.STEP_MS, "median"),
    ("sent_gb", keys.SENT_GB, "median"),
    ("comm_gbps", keys.COMM_BW, "median"),
    ("imbalance_rank", keys.IMBALANCE_RANK, "median"),
    ("imbalance_expert", keys.IMBALANCE_EXPERT, "median"),
    ("mem_reserved_gib", keys.MEM_RESERVED, "max"),
    ("loss", keys.LOSS, "last"),
)


@dataclass
class Run:
    """One run's JSONL: its static fields (from the first line) and the per-step records."""

    path: Path
    records: list[dict[str, Any]]
    static: dict[str, Any] = field(default_factory=dict)

    @property
    def backend_name(self) -> str:
        backend = self.static.get(keys.BACKEND, "?")
        sms = (self.static.get(keys.BACKEND_OPTIONS) or {}).get("num_sms")
        return backend if backend == "nccl" or sms is None else f"{backend}-sm{sms}"

    @property
    def shape(self) -> str:
        return f"b{self.static.get(keys.LOCAL_BATCH, '?')}xs{self.static.get(keys.SEQ_LEN, '?')}"


def find_jsonl(path: Path) -> list[Path]:
    """A JSONL file itself, RUN_DIR/metrics.jsonl, or every metrics.jsonl below RUN_DIR."""
    if path.is_file():
        return [path]
    if (path / JSONL_NAME).is_file():
        return [path / JSONL_NAME]
    return sorted(path.rglob(JSONL_NAME))


def load_run(jsonl: Path) -> Run:
    by_step = {}  # a resumed run appends the steps after its checkpoint again: keep the last
    for line in jsonl.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = record
    records = [by_step[step] for step in sorted(by_step)]
    if not records:
        raise ValueError(f"{jsonl} has no steps (did the run reach its first log step?)")
    static_keys = (keys.RECIPE, keys.BACKEND, keys.BACKEND_OPTIONS, keys.DEVICE, keys.PEAK_DTYPE,
                   keys.EP_SIZE, keys.WORLD_SIZE, keys.LOCAL_BATCH, keys.SEQ_LEN, keys.SENDS_PER)
    static = {k: records[0][k] for k in static_keys if k in records[0]}
    for record in records[1:]:  # a folder reused by another run (older runs had no guard)
        changed = [k for k in static if k in record and record[k] != static[k]]
        if changed:
            k = changed[0]
            raise ValueError(
                f"{jsonl} mixes two runs: {k} is {static[k]!r} up to step {records[0]['step']} and "
                f"{record[k]!r} at step {record['step']}; split it, or rerun each into its own folder"
            )
    return Run(path=jsonl, records=records, static=static)


def _reduce(values: list[float], how: str) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return None
    if how == "max":
        return max(values)
    if how == "last":
        return values[-1]
    return statistics.median(values)


def summarize_run(run: Run, warmup_steps: int = DEFAULT_WARMUP_STEPS) -> dict[str, Any]:
    """Steady-state numbers: steps after `warmup_steps` (all steps if there are no more)."""
    steady = [r for r in run.records if r["step"] > warmup_steps] or run.records[-1:]
    summary: dict[str, Any] = {
        "run": str(run.path.parent),
        "recipe": run.static.get(keys.RECIPE, "?"),
        "backend": run.static.get(keys.BACKEND, "?"),
        "backend_name": run.backend_name,
        "backend_options": run.static.get(keys.BACKEND_OPTIONS, {}),
        "shape": run.shape,
        "device": run.static.get(keys.DEVICE, "?"),
        "peak_dtype": run.static.get(keys.PEAK_DTYPE, "bf16"),
        "steps_summarized": [r["step"] for r in steady],
    }
    for name, key, how in _SUMMARY_FIELDS:
        summary[name] = _reduce([r.get(key) for r in steady], how)
    return summary


def add_speedups(summaries: list[dict[str, Any]]) -> None:
    """tokens/s relative to the nccl run of the same recipe and shape ("vs_nccl")."""
    baseline = {
        (s["recipe"], s["shape"]): s["tps"] for s in summaries if s["backend"] == "nccl" and s["tps"]
    }
    for s in summaries:
        base = baseline.get((s["recipe"], s["shape"]))
        s["vs_nccl"] = s["tps"] / base if base and s["tps"] else None


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    header = ("| recipe | backend | batch×seq | tok/s/GPU | vs nccl | TFLOPS | MFU % | "
              "comm not hidden % | dispatch ms | combine ms | step ms | sent GB/step | "
              "rank imbalance | mem GiB | loss |")
    lines = [header, "|" + " --- |" * (header.count("|") - 1)]
    for s in summaries:
        mfu = _fmt(s["mfu"], ".2f") + ("" if s["peak_dtype"] == "bf16" else f" ({s['peak_dtype']} peak)")
        lines.append(
            f"| {s['recipe']} | {s['backend_name']} | {s['shape']} | {_fmt(s['tps'], ',.0f')} | "
            f"{_fmt(s.get('vs_nccl'), '.3f')} | {_fmt(s['tflops'], '.1f')} | {mfu} | "
            f"{_fmt(s['comm_exposed_pct'], '.1f')} | {_fmt(s['dispatch_ms'], '.2f')} | "
            f"{_fmt(s['combine_ms'], '.2f')} | {_fmt(s['step_ms'], '.1f')} | "
            f"{_fmt(s['sent_gb'], '.3f')} | {_fmt(s['imbalance_rank'], '.3f')} | "
            f"{_fmt(s['mem_reserved_gib'], '.1f')} | {_fmt(s['loss'], '.4f')} |"
        )
    return "\n".join(lines) + "\n"


def run_labels(runs: list[Run]) -> list[str]:
    """Short legend labels: only the parts (recipe, backend, shape) that differ between runs."""
    parts = [(r.static.get(keys.RECIPE, "?"), r.backend_name, r.shape) for r in runs]
    varying = [i for i in range(3) if len({p[i] for p in parts}) > 1] or [1]
    labels = [" ".join(p[i] for i in varying) for p in parts]
    # two runs with the same label (a repeat): tell them apart by folder
    return [
        label if labels.count(label) == 1 else f"{label} ({run.path.parent.name})"
        for label, run in zip(labels, runs)
    ]


def write_plots(runs: list[Run], summaries: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = run_labels(runs)
    written = []
    for key, title, filename in (
        (keys.TPS, "tokens/s per GPU", "tps.png"),
        (keys.MFU, "MFU (%)", "mfu.png"),
        (keys.COMM_EXPOSED_PCT, "MoE comm not hidden (% of step)", "comm_exposed.png"),
        (keys.MEM_RESERVED, "max reserved memory (GiB)", "memory.png"),
        (keys.LOSS, "loss", "loss.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        plotted = False
        for run, label in zip(runs, labels):
            points = [(r["step"], r[key]) for r in run.records if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=label)
                plotted = True
        if not plotted:
            plt.close(fig)
            continue
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=120)
        plt.close(fig)
        written.append(out / filename)

    # where a steady-state step goes: dispatch, combine, everything else
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(runs) + 2.0))
    dispatch = [s["dispatch_ms"] or 0.0 for s in summaries]
    combine = [s["combine_ms"] or 0.0 for s in summaries]
    rest = [max((s["step_ms"] or 0.0) - d - c, 0.0) for s, d, c in zip(summaries, dispatch, combine)]
    ax.barh(labels, dispatch, label="dispatch (fwd+bwd)")
    ax.barh(labels, combine, left=dispatch, label="combine (fwd+bwd)")
    ax.barh(labels, rest, left=[d + c for d, c in zip(dispatch, combine)], label="rest of step")
    ax.set_xlabel("ms per step (median after warm-up)")
    ax.set_title("Step time breakdown")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=3)
    fig.tight_layout()
    fig.savefig(out / "step_breakdown.png", dpi=120)
    plt.close(fig)
    written.append(out / "step_breakdown.png")
    return written


def build_report(
    run_paths: list[Path], out: Path, warmup_steps: int = DEFAULT_WARMUP_STEPS, title: str = "MoE comm backends"
) -> tuple[Path, list[dict[str, Any]]]:
    jsonl_files = [j for p in run_paths for j in find_jsonl(p)]
    if not jsonl_files:
        raise FileNotFoundError(f"no {JSONL_NAME} under {', '.join(map(str, run_paths))}")
    runs = [load_run(j) for j in jsonl_files]
    runs.sort(key=lambda r: (str(r.static.get(keys.RECIPE)), r.shape, r.backend_name != "nccl", r.backend_name))
    summaries = [summarize_run(r, warmup_steps) for r in runs]
    add_speedups(summaries)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(runs, summaries, out)
    md = [
        f"# {title}",
        "",
        f"Medians over steps after the first {warmup_steps} (warm-up); memory is the max. "
        "'comm not hidden' = compute-stream time inside dispatch + combine (forward and backward, "
        "all MoE layers) over step time. 'sent' = bytes leaving each rank per step.",
        "",
        markdown_table(summaries),
    ]
    md += [f"![{p.stem}]({p.name})" for p in plots]
    report_md = out / "report.md"
    report_md.write_text("\n".join(md) + "\n")
    (out / "summary.json").write_text(json.dumps(summaries, indent=2) + "\n")
    return report_md, summaries


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, help="run dump folders or metrics.jsonl files")
    parser.add_argument("--out", type=Path, default=Path("report"), help="folder for report.md and PNGs")
    parser.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP_STEPS,
                        help="steps left out of the medians (start-up, compilation)")
    parser.add_argument("--title", default="MoE comm backends")


def main(args: argparse.Namespace) -> int:
    try:
        report_md, summaries = build_report(args.runs, args.out, args.warmup_steps, args.title)
    except (FileNotFoundError, ValueError) as e:
        print(f"report: {e}")
        return 1
    print(markdown_table(summaries))
    print(f"wrote {report_md} and plots in {args.out}")
    return 0
