"""MFU sweep: backends x local batch x sequence length of one recipe, or a list of (recipe, backend)
runs, each through `python -m moe_comm train`; results to OUT/NAME.json plus plots.

Sweep (the 2xH200 benchmark recipe):
    python experiments/mfu_sweep.py --recipe recipes/deepseek_v3_671b_layers_h200x2.toml \\
        --backends nccl nvshmem deepep --batch 1 2 4 --seq 2048 4096 --steps 20 \\
        --out results/h200x2 --name mfu_sweep
Baselines (a short list of recipe:backend runs at their recipes' own batch and sequence):
    python experiments/mfu_sweep.py --runs recipes/deepseek_v3_671b_layers_h200x2.toml:nccl \\
        recipes/deepseek_v3_16b_h200x2.toml:nccl --steps 30 --out results/h200x2 --name baselines
Cost of the instrumentation (each configuration twice, MOE_COMM_INSTRUMENT=1 and =0):
    ... --instrument-cost

Each run is experiments/runner.py's: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NVSHMEM_DISABLE_NVLS=1 (experiments/device_env.py: the rule of the lent H200 machines this sweep
runs on), its own dump folder (OUT/runs/NAME/<run>/, with train.log and metrics.jsonl) and W&B
name "<backend>-b<B>-s<S>". A run that fails (OOM, timeout, crash) is recorded with its error and
the tail of its log, and the sweep goes on. OUT/NAME.json is rewritten after every run, so an
interrupted sweep keeps what it measured; `--resume` does only the runs it lacks, and
`--budget-s 540` stops starting runs before a 10-minute command limit (then --resume). Paths
in the JSON are relative to OUT, so OUT can be copied off the GPU machine and `--report-only`
rebuilds the table and plots there (e.g. where matplotlib is installed). Extra TorchTitan
overrides for every run follow `--`; in --runs mode, --batch/--seq (first value) apply to all.
"""

import argparse
import importlib.util
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moe_comm import report  # noqa: E402
from experiments.runner import (  # noqa: E402  the runs themselves, shared with the other experiments that train
    instrument_cost, load_previous, RunResult, run_all, RunSpec, split_overrides, train_command,
)


def plan(args: argparse.Namespace) -> list[RunSpec]:
    if args.runs:
        specs = []
        for item in args.runs:
            recipe, sep, backend = item.rpartition(":")
            if not sep or not recipe or not backend:
                raise SystemExit(f"--runs takes RECIPE.toml:BACKEND, got {item!r}")
            specs.append(RunSpec(recipe, backend, args.batch[0] if args.batch else None,
                                 args.seq[0] if args.seq else None))
    else:
        if not args.recipe:
            raise SystemExit("give --recipe (a sweep) or --runs RECIPE:BACKEND ... (a list)")
        specs = [
            RunSpec(args.recipe, backend, batch, seq)
            for batch in (args.batch or [None])
            for seq in (args.seq or [None])
            for backend in args.backends
        ]
    if args.instrument_cost:
        specs = [s for spec in specs for s in (spec, RunSpec(**{**asdict(spec), "instrumented": False}))]
    return specs


def plot_sweep(results: list[RunResult], out: Path, runs: list[report.Run],
               kernels: str | None) -> Path | None:
    """MFU and tokens/s against tokens per rank per step (batch x seq), one line per backend
    and sequence length, in the backend's colour; the footer names what `runs` are and the
    kernels they were built from."""
    ok = [r for r in results if r.status == "ok" and r.spec.instrumented]
    if not ok:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moe_comm import plots

    fig, (ax_mfu, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    # One line per backend and sequence length: points of a line differ only in local batch.
    lines = sorted({(r.spec.backend, r.summary.get("seq_len") or 0) for r in ok})
    for backend, seq in lines:
        points = sorted(
            (r.summary["tokens_per_rank"], r.summary["mfu"], r.summary["tps"])
            for r in ok if r.spec.backend == backend and (r.summary.get("seq_len") or 0) == seq
        )
        xs = [p[0] for p in points]
        label = f"{backend}, seq {seq}" if seq else backend
        i = [s for b, s in lines if b == backend].index(seq)
        style = dict(color=plots.backend_color(backend), linestyle=plots.LINE_STYLES[i % len(plots.LINE_STYLES)],
                     marker=plots.MARKERS[i % len(plots.MARKERS)])
        ax_mfu.plot(xs, [p[1] if p[1] is not None else float("nan") for p in points], label=label, **style)
        ax_tps.plot(xs, [p[2] for p in points], label=label, **style)
    dtypes = "/".join(sorted({r.summary.get("peak_dtype", "bf16") for r in ok}))
    for ax, title in ((ax_mfu, f"MFU (%) against the {dtypes} peak"), (ax_tps, "tokens/s per GPU")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank per step (local batch x seq)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_tps.legend()
    path = out / "mfu_vs_tokens.png"
    plots.save(fig, path, report.provenance(runs, report.run_labels(runs), kernels))
    plt.close(fig)
    return path


def write_report(args, results, ok_dirs, failed, plots_dir: Path, commands: list[str]) -> None:
    report_md, _ = report.build_report(ok_dirs, plots_dir, args.warmup_steps,
                                       title=f"{args.name}: {len(results)} runs (commands at the end)",
                                       kernels=args.kernels)
    runs = [report.load_run(folder / "metrics.jsonl") for folder in ok_dirs]
    sweep_plot = plot_sweep(results, plots_dir, runs, args.kernels)
    extra = [f"![{sweep_plot.stem}]({sweep_plot.name})"] if sweep_plot else []
    if failed:
        extra += ["", "## Failed runs", ""] + [f"- {r.spec.name}: {r.error}" for r in failed]
    extra += ["", "Made by:", ""] + [f"    {c}" for c in commands]
    with open(report_md, "a") as f:
        f.write("\n".join(extra) + "\n")


def parse_args(argv: list[str]) -> argparse.Namespace:
    argv, overrides = split_overrides(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", help="recipe for a backends x batch x seq sweep")
    p.add_argument("--backends", nargs="+", default=["nccl", "nvshmem", "deepep"])
    p.add_argument("--batch", nargs="+", type=int, help="local batch sizes (default: the recipe's)")
    p.add_argument("--seq", nargs="+", type=int, help="sequence lengths (default: the recipe's)")
    p.add_argument("--runs", nargs="+", help="instead of a sweep: RECIPE.toml:BACKEND ...")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=report.DEFAULT_WARMUP_STEPS,
                   help="first steps left out of the medians")
    p.add_argument("--out", type=Path, default=REPO / "results" / "h200x2")
    p.add_argument("--name", default="mfu_sweep", help="results file OUT/NAME.json, plots in OUT/NAME/")
    p.add_argument("--timeout", type=int, default=1200, help="seconds before a run counts as hung")
    p.add_argument("--instrument-cost", action="store_true",
                   help="run each configuration also with MOE_COMM_INSTRUMENT=0 and report the slowdown")
    p.add_argument("--no-wandb", dest="wandb", action="store_false", help="no offline W&B runs")
    p.add_argument("--launcher", default=f"{shlex.quote(sys.executable)} -m moe_comm train",
                   help="command that takes RECIPE [overrides] and trains (default: this python -m moe_comm train)")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs already in OUT/NAME.json and do only the missing ones")
    p.add_argument("--retry-failed", action="store_true", help="with --resume: run failed ones again")
    p.add_argument("--budget-s", type=float, default=0,
                   help="start no run that would likely end past this many seconds (e.g. 540 under a "
                        "10-minute limit); the rest is left for --resume")
    p.add_argument("--kernels", default=None,
                   help="the commit whose csrc/ the runs are built from; the report and every plot name it")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild the table and plots from OUT/NAME.json and its runs")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    args.overrides = overrides
    if args.wandb and importlib.util.find_spec("wandb") is None:
        print("[mfu_sweep] wandb is not importable: runs log JSONL only (--metrics.no-enable-wandb)")
        args.wandb = False
    args.out = args.out if args.out.is_absolute() else (Path.cwd() / args.out)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = shlex.join(["python", "experiments/mfu_sweep.py", *argv])
    specs = [] if args.report_only else plan(args)
    if args.dry_run:
        for spec in specs:
            print(shlex.join(train_command(args, spec, args.out / "runs" / args.name / spec.name)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    results, commands = load_previous(args) if (args.resume or args.report_only) else ([], [])
    if not args.report_only:
        run_all(args, specs, results, commands, command)
    results_path = args.out / f"{args.name}.json"

    plots_dir = args.out / args.name
    ok_dirs = [args.out / r.dump_folder for r in results if r.status == "ok" and r.spec.instrumented]
    failed = [r for r in results if r.status != "ok"]
    if ok_dirs:
        try:
            write_report(args, results, ok_dirs, failed, plots_dir, commands)
        except ImportError as e:  # e.g. no matplotlib on the GPU image: plots later, elsewhere
            print(f"[mfu_sweep] no plots ({e}); make them with: python experiments/mfu_sweep.py "
                  f"--out {args.out} --name {args.name} --report-only")
    print(f"\n[mfu_sweep] {len(results) - len(failed)} ok, {len(failed)} failed"
          + "".join(f"\n  failed: {r.spec.name}: {r.error}" for r in failed))
    for row in instrument_cost(results):
        shape = "".join(f" {k[0]}{row[k]}" for k in ("local_batch_size", "seq_len") if row[k] is not None)
        print(f"  instrumentation cost {Path(row['recipe']).stem} {row['backend']}{shape}: "
              f"{row['slowdown_pct']:+.2f}% tokens/s (median tokens/s, instrumented vs MOE_COMM_INSTRUMENT=0)")
    print(f"[mfu_sweep] results: {results_path}; plots and table: {plots_dir}/")
    if commands:
        print("[mfu_sweep] for results/README.md:\n    " + "\n    ".join(commands))
    return 0 if ok_dirs else 1


if __name__ == "__main__":
    sys.exit(main())
