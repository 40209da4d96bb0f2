"""Memory, measured: short trainings of a one-GPU 671B-shaped recipe at several activation-
checkpointing modes and local batch sizes, their peak memory against the estimate `check` prints.

    python experiments/memory_check.py                       # on one H200: 4 runs x 10 steps, ~4 min
    python experiments/memory_check.py --estimate-only       # anywhere: the estimates alone
    python experiments/memory_check.py --report-only         # the table again, from OUT/NAME.json

Each configuration is AC_MODE:LOCAL_BATCH (default none:1 none:2 selective:2 full:2; "selective"
is TorchTitan's op-level SAC, --activation_checkpoint.selective_ac_option op, the mode the
estimate models). Every run goes through `python -m moe_comm train` by experiments/runner.py's
run_one (the lent machines' environment, its own dump folder with train.log and metrics.jsonl,
a failure recorded with its log tail while the others go on). Measured: the maximum over the
run's steps of TorchTitan's per-step peaks, memory/max_active(GiB) (the caching allocator's
peak of active bytes: what torch.cuda.max_memory_allocated reports, plus blocks freed on the
host whose stream work is still queued) and memory/max_reserved(GiB); TorchTitan resets the
peaks at every logged step. Estimated: moe_comm.predict.scale_model.memory on the recipe with the
same overrides, as `python -m moe_comm check` computes it. OUT/NAME.json holds both per run,
the command, and the error (issue 24's target: within +-8% of the measured peak in use).
The backend defaults to nccl: at EP 1 it is TorchTitan's own local path and needs no kernel
build; the nvshmem backend's peak was the same at world 1 (results/h200x1/README.md, run 12). The runs stay in the
archive (OUT, results/h200x1 by default); the scale model is checked against them through rows
of results/model_inputs/scale_model_validation.json, each with its value and the run's
metrics.jsonl it was read from (tests/test_model_inputs.py checks the two agree).
"""

import argparse
import datetime
import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments import runner  # noqa: E402
from moe_comm import recipe  # noqa: E402
from moe_comm.predict import estimate, scale_model  # noqa: E402
from moe_comm.metrics import keys  # noqa: E402

DEFAULT_RECIPE = "recipes/deepseek_v3_671b_h200x1.toml"
DEFAULT_CONFIGS = ["none:1", "none:2", "selective:2", "full:2"]
AC_MODES = ("none", "selective", "full")
TARGET_PCT = 8.0


def parse_config(text: str) -> tuple[str, int]:
    mode, sep, batch = text.partition(":")
    if not sep or mode not in AC_MODES or not batch.isdigit() or int(batch) < 1:
        raise SystemExit(f"--configs takes AC_MODE:LOCAL_BATCH with AC_MODE one of {AC_MODES}, got {text!r} "
                         "(e.g. full:2)")
    return mode, int(batch)


def config_overrides(mode: str) -> list[str]:
    ov = ["--activation_checkpoint.mode", mode]
    if mode == "selective":
        ov += ["--activation_checkpoint.selective_ac_option", "op"]
    return ov


def estimated(recipe_path: str, mode: str, batch: int, gpu: str, backend: str) -> dict:
    """The estimate for the recipe with this run's overrides, term by term (GiB)."""
    r = recipe.load(recipe_path, config_overrides(mode) + ["--training.local_batch_size", str(batch)],
                    device="cuda", gpu=gpu, check_paths=False)
    # the run's backend: what its comm-free recompute keeps is in the estimate
    mem = scale_model.memory(scale_model.workload_from_recipe(r), backend)
    G = estimate.GiB
    terms = {k: v / G for k, v in asdict(mem).items()}
    return {"in_use_gib": mem.total / G, "reserved_gib": mem.reserved / G, "peak_at": mem.peak_at,
            "forward_end_gib": mem.forward_end / G, "backward_end_gib": mem.backward_end / G, "terms_gib": terms}


def measured(jsonl: Path) -> dict:
    """The run's peaks: the maximum over steps of TorchTitan's per-step memory figures."""
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    if not rows or keys.MEM_ACTIVE not in rows[-1]:
        raise ValueError(f"{jsonl}: no {keys.MEM_ACTIVE!r} in its steps")
    peak = max(rows, key=lambda r: r[keys.MEM_ACTIVE])
    return {"in_use_gib": peak[keys.MEM_ACTIVE], "reserved_gib": max(r[keys.MEM_RESERVED] for r in rows),
            "peak_step": peak["step"], "steps": len(rows),
            "alloc_retries": max(r.get("memory/num_alloc_retries", 0) for r in rows)}


def error_pct(est: float, meas: float) -> float:
    return 100.0 * (est / meas - 1.0)


def table(doc: dict) -> str:
    lines = [f"Recipe `{doc['recipe']}`, backend {doc['backend']}, {doc['steps']} steps per run; {doc['date'][:10]}.",
             f"Command: `{doc['command']}`", "",
             "| AC | local batch | in use, measured GiB | estimate GiB | error | reserved, measured GiB | "
             "estimate GiB | error | estimate peaks at | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in doc["rows"]:
        e, m = row["estimate"], row.get("measured")
        if m is None:
            lines.append(f"| {row['ac']} | {row['local_batch']} | - | {e['in_use_gib']:.1f} | - | - | "
                         f"{e['reserved_gib']:.1f} | - | {e['peak_at']} | {row['status']}: {row.get('error', '')} |")
            continue
        ok = "within" if abs(row["error_in_use_pct"]) <= TARGET_PCT else "OUTSIDE"
        lines.append(f"| {row['ac']} | {row['local_batch']} | {m['in_use_gib']:.1f} | {e['in_use_gib']:.1f} | "
                     f"{row['error_in_use_pct']:+.1f}% | {m['reserved_gib']:.1f} | {e['reserved_gib']:.1f} | "
                     f"{row['error_reserved_pct']:+.1f}% | {e['peak_at']} | ok ({ok} +-{TARGET_PCT:g}%) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=DEFAULT_RECIPE)
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="AC_MODE:LOCAL_BATCH ...")
    p.add_argument("--backend", default="nccl")
    p.add_argument("--gpu", default="H200", help="the GPU the estimate's fit verdict names")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", type=Path, default=REPO / "results" / "h200x1")
    p.add_argument("--name", default="memory_check", help="OUT/NAME.json; runs in OUT/runs/NAME/")
    p.add_argument("--timeout", type=int, default=300, help="seconds before a run counts as hung")
    p.add_argument("--budget-s", type=float, default=230.0,
                   help="start no run that would likely end past this many seconds (default 230)")
    p.add_argument("--launcher", default=f"{shlex.quote(sys.executable)} -m moe_comm train",
                   help="command that takes RECIPE [overrides] and trains")
    p.add_argument("--estimate-only", action="store_true", help="print the estimates, run nothing")
    p.add_argument("--report-only", action="store_true", help="print the table of OUT/NAME.json, run nothing")
    args = p.parse_args(argv)
    args.out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    path = args.out / f"{args.name}.json"
    if args.report_only:
        print(table(json.loads(path.read_text())))
        return 0
    configs = [parse_config(c) for c in args.configs]
    try:
        estimates = [estimated(args.recipe, mode, batch, args.gpu, args.backend) for mode, batch in configs]
    except recipe.RecipeError as e:
        return recipe.main_error(e)
    if args.estimate_only:
        for (mode, batch), e in zip(configs, estimates):
            print(f"AC {mode:<9} local batch {batch}: {e['in_use_gib']:6.1f} GiB in use ({e['peak_at']}), "
                  f"{e['reserved_gib']:6.1f} reserved")
        return 0

    # what runner.run_one reads from its own arguments
    sweep = argparse.Namespace(out=args.out, name=args.name, launcher=args.launcher, steps=args.steps, wandb=False,
                               timeout=args.timeout, warmup_steps=1, overrides=[])
    doc = {"command": shlex.join(["python", "experiments/memory_check.py", *argv]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "recipe": args.recipe,
           "backend": args.backend, "steps": args.steps, "target_pct": TARGET_PCT,
           "measured_fields": [keys.MEM_ACTIVE, keys.MEM_RESERVED], "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    start, walls = time.monotonic(), []
    for (mode, batch), est in zip(configs, estimates):
        row = {"ac": mode, "local_batch": batch, "estimate": est}
        elapsed = time.monotonic() - start
        if walls and elapsed + max(walls) > args.budget_s:
            row.update(status="not run", error=f"time budget: {elapsed:.0f} s spent, a run takes ~{max(walls):.0f} s")
        else:
            spec = runner.RunSpec(args.recipe, args.backend, local_batch_size=batch,
                                     overrides=config_overrides(mode), tag=f"ac{mode}")
            result = runner.run_one(sweep, spec)
            walls.append(result.wall_s)
            row["run"] = {"name": spec.name, "command": result.command, "dump_folder": result.dump_folder,
                          "wall_s": result.wall_s}
            if result.status != "ok":
                row.update(status="failed", error=result.error, error_tail=result.error_tail)
            else:
                m = measured(args.out / result.dump_folder / keys.JSONL_NAME)
                row.update(status="ok", measured=m, error_in_use_pct=error_pct(est["in_use_gib"], m["in_use_gib"]),
                           error_reserved_pct=error_pct(est["reserved_gib"], m["reserved_gib"]))
        doc["rows"].append(row)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"[memory_check] AC {mode} b{batch}: {row['status']}"
              + (f", in use {row['measured']['in_use_gib']:.1f} GiB against {est['in_use_gib']:.1f} estimated "
                 f"({row['error_in_use_pct']:+.1f}%)" if row["status"] == "ok" else f" ({row.get('error')})"),
              flush=True)
    print(table(doc))
    print(f"[memory_check] wrote {path}")
    return 0 if any(r["status"] == "ok" for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
