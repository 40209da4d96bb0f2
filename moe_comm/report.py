"""`python -m moe_comm report RUN_DIR...`: compare runs' per-step JSONL offline.

Reads each run's metrics.jsonl (written by moe_comm.metrics), summarises the steady state (the
median over steps after a warm-up, which includes start-up and compilation), and writes a
markdown table comparing backends plus PNG plots into --out (default: a `report` folder in
the runs' own folder, the one folder that holds them all). Every PNG names its recipes,
hardware, dates and backend options in a footer, and a backend keeps its colour across the
plots (moe_comm.plots). Used for results/ and by experiments/mfu_sweep.py; no W&B or network
needed.
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_comm import plots
from moe_comm.backends import backend_class, baseline, names
from moe_comm.config import MoEComm
from moe_comm.metrics import history, keys
from moe_comm.metrics.keys import JSONL_NAME

DEFAULT_WARMUP_STEPS = history.WARMUP_STEPS  # the footer's too: both say their window
# What the step line shows as n/a on CPU (no peak to divide by, no device memory): n/a here too
NOT_ON_CPU = (keys.TFLOPS, keys.MFU, keys.MEM_RESERVED)
# What a plot says when nobody said which kernels its runs were built from (the runs do not record it).
KERNELS_NOT_STATED = "not stated (--kernels COMMIT: the commit whose csrc/ the runs were built from)"


def kernels_text(kernels: str | None) -> str:
    """Which kernels a figure measured, for its footer and its report."""
    return f"csrc/ of commit {kernels}" if kernels else KERNELS_NOT_STATED


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
        """Its backend's label for it (the class's `run_label`); a name no backend has (an older
        run's) with the SM budget it recorded. A run over an emulated link says so (the tables and
        plot legends take their backend column from here)."""
        backend = self.static.get(keys.BACKEND, "?")
        options = self.static.get(keys.BACKEND_OPTIONS) or {}
        if backend in names():
            label = backend_class(backend).run_label(options)
        else:
            label = backend if options.get("num_sms") is None else f"{backend}-sm{options['num_sms']}"
        return f"{label} (EMULATED link)" if self.static.get(keys.EMULATED_LINK) else label

    @property
    def shape(self) -> str:
        return f"b{self.static.get(keys.LOCAL_BATCH, '?')}xs{self.static.get(keys.SEQ_LEN, '?')}"

    @property
    def hardware(self) -> str:
        """'2 x NVIDIA H200': the run's world size and device."""
        world = self.static.get(keys.WORLD_SIZE)
        device = self.static.get(keys.DEVICE, "unknown device")
        return f"{world} x {device}" if world else device

    @property
    def date(self) -> str:
        """The day (UTC) of the run's first logged step."""
        when = self.records[0].get("time")
        return time.strftime("%Y-%m-%d", time.gmtime(when)) if when else "not recorded"

    @property
    def options(self) -> str:
        """The [moe_comm] options that differ from their defaults: 'num_sms=64, ...'."""
        defaults = dataclasses.asdict(MoEComm())
        options = self.static.get(keys.BACKEND_OPTIONS) or {}
        changed = [f"{k}={v}" for k, v in options.items() if k in defaults and v != defaults[k]]
        return ", ".join(changed) or "defaults"


def find_jsonl(path: Path) -> list[Path]:
    """A JSONL file itself, RUN_DIR/metrics.jsonl, or every metrics.jsonl below RUN_DIR."""
    if path.is_file():
        return [path]
    if (path / JSONL_NAME).is_file():
        return [path / JSONL_NAME]
    return sorted(path.rglob(JSONL_NAME))


def load_run(jsonl: Path) -> Run:
    # one row per step, the newest start's (moe_comm.metrics.history: a run's start moves the
    # rows it supersedes aside; a file from before that rule is read by the same rule)
    records = history.newest_rows(jsonl.read_text().splitlines())
    if not records:
        raise ValueError(f"{jsonl} has no steps (did the run reach its first log step?)")
    static_keys = (keys.RECIPE, keys.BACKEND, keys.BACKEND_OPTIONS, keys.DEVICE, keys.PEAK_DTYPE,
                   keys.EP_SIZE, keys.WORLD_SIZE, keys.LOCAL_BATCH, keys.SEQ_LEN, keys.SENDS_PER,
                   keys.EMULATED_LINK)
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


def summarize_run(run: Run, warmup_steps: int = DEFAULT_WARMUP_STEPS, relative_to: Path | None = None) -> dict[str, Any]:
    """Steady-state numbers: steps after `warmup_steps` (all steps if there are no more).
    The run's folder is given relative to `relative_to` (the report's folder) when set."""
    window = set(history.steady_steps([r["step"] for r in run.records], warmup_steps))
    steady = [r for r in run.records if r["step"] in window]
    folder = run.path.parent
    summary: dict[str, Any] = {
        "run": os.path.relpath(folder, relative_to) if relative_to else str(folder),
        "recipe": run.static.get(keys.RECIPE, "?"),
        "backend": run.static.get(keys.BACKEND, "?"),
        "backend_name": run.backend_name,
        "backend_options": run.static.get(keys.BACKEND_OPTIONS, {}),
        "shape": run.shape,
        "device": run.static.get(keys.DEVICE, "?"),
        "peak_dtype": run.static.get(keys.PEAK_DTYPE, "bf16"),
        "steps_summarized": [r["step"] for r in steady],
    }
    cpu = run.static.get(keys.DEVICE) == "CPU"
    for name, key, how in _SUMMARY_FIELDS:
        summary[name] = None if cpu and key in NOT_ON_CPU else _reduce([r.get(key) for r in steady], how)
    summary["window"] = history.window_text(summary["steps_summarized"], warmup_steps)
    return summary


def add_speedups(summaries: list[dict[str, Any]]) -> None:
    """tokens/s relative to the baseline backend's run (moe_comm.backends.baseline, TorchTitan's
    own path) of the same recipe and shape ("vs_<baseline>")."""
    name = baseline().name
    base_tps = {
        (s["recipe"], s["shape"]): s["tps"] for s in summaries if s["backend"] == name and s["tps"]
    }
    for s in summaries:
        base = base_tps.get((s["recipe"], s["shape"]))
        s[f"vs_{name}"] = s["tps"] / base if base and s["tps"] else None


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _steps(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else (str(steps[0]) if steps else "none")


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    name = baseline().name
    header = (f"| recipe | backend | batch×seq | tok/s/GPU | vs {name} | TFLOPS | MFU % | "
              "comm not hidden % | dispatch ms | combine ms | step ms | sent GB/step | "
              "rank imbalance | mem GiB | loss | steps |")
    lines = [header, "|" + " --- |" * (header.count("|") - 1)]
    for s in summaries:
        mfu = _fmt(s["mfu"], ".2f") + ("" if s["peak_dtype"] == "bf16" else f" ({s['peak_dtype']} peak)")
        lines.append(
            f"| {s['recipe']} | {s['backend_name']} | {s['shape']} | {_fmt(s['tps'], ',.0f')} | "
            f"{_fmt(s.get(f'vs_{name}'), '.3f')} | {_fmt(s['tflops'], '.1f')} | {mfu} | "
            f"{_fmt(s['comm_exposed_pct'], '.1f')} | {_fmt(s['dispatch_ms'], '.2f')} | "
            f"{_fmt(s['combine_ms'], '.2f')} | {_fmt(s['step_ms'], '.1f')} | "
            f"{_fmt(s['sent_gb'], '.3f')} | {_fmt(s['imbalance_rank'], '.3f')} | "
            f"{_fmt(s['mem_reserved_gib'], '.1f')} | {_fmt(s['loss'], '.4f')} | {_steps(s['steps_summarized'])} |"
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


def run_styles(runs: list[Run]) -> list[dict[str, Any]]:
    """Matplotlib line styles: the backend's colour; runs of one backend differ in dash and marker."""
    seen: dict[str, int] = {}
    styles = []
    for run in runs:
        backend = run.static.get(keys.BACKEND, "?")
        i = seen.get(backend, 0)
        seen[backend] = i + 1
        styles.append(dict(color=plots.backend_color(backend), linestyle=plots.LINE_STYLES[i % len(plots.LINE_STYLES)],
                           marker=plots.MARKERS[i % len(plots.MARKERS)]))
    return styles


def provenance(runs: list[Run], labels: list[str], kernels: str | None = None) -> list[str]:
    """The footer of every plot of a report: what was run, on what, when, with which options and
    which kernels (the commit of csrc/ the runs were built from, as the caller states it)."""

    def distinct(values) -> str:
        return ", ".join(dict.fromkeys(values))

    dates = sorted({r.date for r in runs})
    options = {r.options for r in runs}
    if len(options) == 1:
        backend_options = f"{options.pop()} (every run)"
    else:
        backend_options = ";  ".join(f"{label}: {r.options}" for label, r in zip(labels, runs))
    return [
        f"recipe: {distinct(r.static.get(keys.RECIPE, '?') for r in runs)}",
        f"hardware: {distinct(r.hardware for r in runs)};  "
        f"date: {dates[0] if len(dates) == 1 else dates[0] + ' to ' + dates[-1]}",
        f"[moe_comm] options: {backend_options}",
        f"kernels: {kernels_text(kernels)}",
    ]


def write_plots(runs: list[Run], summaries: list[dict[str, Any]], out: Path, kernels: str | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels = run_labels(runs)
    styles = run_styles(runs)
    footer = provenance(runs, labels, kernels)
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
        for run, label, style, summary in zip(runs, labels, styles, summaries):
            points = [(r["step"], r[key]) for r in run.records if r.get(key) is not None]
            if key == keys.MFU:  # MFU is only comparable against the same peak: say which
                label += f" (of the {summary['peak_dtype']} peak)"
            if points:
                ax.plot(*zip(*points), markersize=3, label=label, **style)
                plotted = True
        if not plotted:
            plt.close(fig)
            continue
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        plots.save(fig, out / filename, footer)
        plt.close(fig)
        written.append(out / filename)

    # where a steady-state step goes: dispatch, combine, everything else; a bar per run in its
    # backend's colour (dispatch solid, combine lighter, the rest grey), the legend beside it
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(runs) + 1.2))
    dispatch = [s["dispatch_ms"] or 0.0 for s in summaries]
    combine = [s["combine_ms"] or 0.0 for s in summaries]
    rest = [max((s["step_ms"] or 0.0) - d - c, 0.0) for s, d, c in zip(summaries, dispatch, combine)]
    colors = [style["color"] for style in styles]
    y = list(range(len(runs)))[::-1]  # the first run on top
    ax.barh(y, dispatch, color=colors)
    ax.barh(y, combine, left=dispatch, color=colors, alpha=0.45)
    ax.barh(y, rest, left=[d + c for d, c in zip(dispatch, combine)], color="0.85")
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel(f"ms per step (median over the steps after the first {DEFAULT_WARMUP_STEPS}: warm-up)")
    ax.legend(
        handles=[Patch(color="0.2", label="dispatch (fwd+bwd)"), Patch(color="0.2", alpha=0.45, label="combine (fwd+bwd)"),
                 Patch(color="0.85", label="rest of step")],
        fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False,
    )
    ax.set_title("Step time breakdown", fontsize=10)
    ax.margins(y=0.5 / max(len(runs), 1))
    plots.save(fig, out / "step_breakdown.png", footer)
    plt.close(fig)
    written.append(out / "step_breakdown.png")
    return written


def default_out(run_paths: list[Path]) -> Path:
    """`report` beside the runs: RUN_DIR/report for one run folder, else in the folder that
    holds all of them. Never the current directory (an untracked ./report in a checkout)."""
    folders = [p.resolve() if p.is_dir() else p.resolve().parent for p in run_paths]
    common = Path(os.path.commonpath(folders))
    if common == Path.cwd().resolve() or common == Path(common.anchor):
        raise ValueError(
            f"the runs {', '.join(map(str, run_paths))} share no folder below {common}: "
            "say where the report goes with --out DIR"
        )
    return common / "report"


def build_report(
    run_paths: list[Path], out: Path, warmup_steps: int = DEFAULT_WARMUP_STEPS, title: str = "MoE comm backends",
    kernels: str | None = None,
) -> tuple[Path, list[dict[str, Any]]]:
    jsonl_files = [j for p in run_paths for j in find_jsonl(p)]
    if not jsonl_files:
        raise FileNotFoundError(f"no {JSONL_NAME} under {', '.join(map(str, run_paths))}")
    runs = [load_run(j) for j in jsonl_files]
    first = baseline().name  # the baseline's run first in its recipe and shape
    runs.sort(key=lambda r: (str(r.static.get(keys.RECIPE)), r.shape, r.backend_name != first, r.backend_name))
    summaries = [summarize_run(r, warmup_steps, relative_to=out) for r in runs]
    add_speedups(summaries)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(runs, summaries, out, kernels)
    md = [
        f"# {title}",
        "",
        f"Kernels: {kernels_text(kernels)}.",
        "",
        f"Medians over the steps after the first {warmup_steps} (warm-up: start-up, compilation; a run "
        "with none after it: its last step alone), column 'steps'; memory is the max. n/a: not measured, or "
        "no meaning on the run's device (TFLOPS, MFU and memory on CPU, as on the step line). "
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
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for report.md and PNGs (default: report/ in the runs' own folder)")
    parser.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP_STEPS,
                        help="steps left out of the medians (start-up, compilation)")
    parser.add_argument("--title", default="MoE comm backends")
    parser.add_argument("--kernels", default=None,
                        help="the commit whose csrc/ the runs were built from; every plot and report.md names it")


def main(args: argparse.Namespace) -> int:
    try:
        out = args.out or default_out(args.runs)
        report_md, summaries = build_report(args.runs, out, args.warmup_steps, args.title, args.kernels)
    except (FileNotFoundError, ValueError) as e:
        print(f"report: {e}")
        return 1
    print(markdown_table(summaries))
    print(f"wrote {report_md} and plots in {out}")
    return 0
