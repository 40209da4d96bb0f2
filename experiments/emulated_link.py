"""How much of a network's time the MoE overlaps hide, measured on ONE GPU over an EMULATED link
(issue 37 item 4), beside the scale model's prediction for the same inputs.

    python experiments/emulated_link.py --out OUT [--variants none chunked] [--baseline] \\
        [--gbps 43 | --per-call-us DISPATCH COMBINE] [-- TorchTitan overrides for every run]

1. The link: each dispatch and combine of the one-GPU recipe (`--recipe`, EP 1) holds its
   `num_sms` SMs for the time the flagship rank's transfer takes on the network
   (moe_comm.kernels.emulated_link, set through MOE_COMM_EMULATED_LINK by this script). The
   per-call time is the flagship recipe's (`--flagship`) network bytes per dispatch and per
   combine, as the scale model counts them from its routing (moe_comm.predict.scale_model's
   transfers: per-node dedup rows x row bytes), at the model's network rate or `--gbps`; or
   given directly with `--per-call-us`. It is the time of a full call (every token of the
   rank); a chunk of the chunked overlap holds half.
2. The runs: the one-GPU recipe trained with the nvshmem backend, once per `--variants` entry
   (`none` and `chunked` set `[moe_comm] overlap`; `NAME=--section.field=value,...` is any other
   variant, e.g. the comm-free recompute of issue 37 item 1 once it is on main), over the
   emulated link; with `--baseline`, each again without it. Measured, medians of the steps after
   the warm-up: step time, MoE comm time, and the exposed MoE comm (the time the compute stream
   spent in or waited for dispatch and combine: moe_comm.metrics).
3. The prediction: the scale model's step for the same recipe and variant with each transfer's
   network time set to the emulated hold (`model_prediction`, the one place this script calls
   moe_comm.predict for it). Target: the model's exposed MoE comm within 15% of the measured.

OUT/emulated_link.json and OUT/emulated_link.md hold the results, every figure labelled as over
an emulated link; the raw runs are in OUT/runs/emulated_link/. `--report-only` reads those runs
again, without training (on any machine: the predictions are the model's, on CPU).
"""

import argparse
import importlib.util
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments import runner  # noqa: E402
from moe_comm import report  # noqa: E402
from moe_comm.kernels import emulated_link  # noqa: E402
from moe_comm.kernels.emulated_link import EmulatedLink  # noqa: E402
from moe_comm.metrics import keys  # noqa: E402

NAME = "emulated_link"
TARGET_PCT = 15.0
OVERLAPS = ("none", "chunked")


# ---- the scale model (moe_comm.predict: only here) ---------------------------------------------

def flagship_transfers(flagship: str, gpu: str) -> dict[str, dict[str, float]]:
    """The flagship rank's network bytes and time per dispatch-like and combine-like transfer, as
    the scale model counts them for our backend (FP8 dispatch where the recipe sends it)."""
    from moe_comm.predict import calibration, scale_model

    cal = calibration.calibrate()
    w, cluster = scale_model.workload_from_spec({"recipe": flagship, "overrides": [], "gpu": gpu}, cal)
    r = _recipe(flagship, [])
    dtype = r.config.moe_comm.dispatch_dtype
    backend = scale_model.backend_class("nvshmem").label(dtype)
    comm = scale_model.layer_comm("nvshmem", w, cluster, cal, dtype)
    by_kind = {t.kind: t for t in comm.transfers if t.forward}  # dispatch, combine (backwards move the same rows)
    return {kind: {"network_bytes": t.network_bytes, "network_us": t.network_us, "tokens": w.tokens_per_call,
                   "network_gbps": cluster.network_gbps, "backend": backend}
            for kind, t in by_kind.items()}


def model_prediction(recipe: str, overrides: list[str], link: EmulatedLink,
                     env: dict[str, str] | None = None) -> dict[str, float]:
    """The scale model's step for `recipe` with `overrides` on one H200, each transfer's network
    time set to the link's hold for it (the layout and fixed costs stay the model's own). `env`:
    the run's benchmark switches the model must know of (MOE_COMM_RECOMPUTE_COMM=1: the recompute
    sends again, as TorchTitan's own checkpointing does)."""
    from unittest import mock

    from moe_comm.predict import calibration, scale_model
    from moe_comm.titan.recompute import RECOMPUTE_COMM_ENV

    cal = calibration.calibrate()
    spec = {"recipe": recipe, "overrides": overrides, "gpu": "H200",
            "recompute_comm": (env or {}).get(RECOMPUTE_COMM_ENV) == "1"}
    w, cluster = scale_model.workload_from_spec(spec, cal)
    real_layer_comm = scale_model.layer_comm

    def over_the_link(backend, w, cluster, cal, *args, **kwargs):
        comm = real_layer_comm(backend, w, cluster, cal, *args, **kwargs)
        for t in comm.transfers:  # a full call's hold; the model halves it per chunk itself
            t.network_us = link.hold_ns(t.kind, w.tokens_per_call) / 1e3
        return comm

    with mock.patch.object(scale_model, "layer_comm", over_the_link):
        p = scale_model.predict("nvshmem", w, cluster, cal)
    return {"step_ms": p.step_ms, "moe_comm_exposed_ms": p.terms_ms["moe comm"], "moe_comm_ms": p.moe_comm_ms,
            "comm_sm_contention_ms": p.terms_ms["comm SM contention"], "overlap": w.overlap, "ac_mode": w.ac_mode}


def _recipe(path: str, overrides: list[str]):
    from moe_comm import recipe

    return recipe.load(str(REPO / path), overrides, device="cuda", check_paths=False)


# ---- the runs ----------------------------------------------------------------------------------

def variant_overrides(text: str) -> tuple[str, list[str], dict[str, str]]:
    """(name, TorchTitan overrides, environment) of a --variants entry: `none`, `chunked`, or
    NAME=ITEM[,ITEM...] with each ITEM a TorchTitan override `--section.field=value` or an
    environment setting `VAR=value` (a benchmark switch such as MOE_COMM_RECOMPUTE_COMM=1)."""
    if text in OVERLAPS:
        return text, ["--moe_comm.overlap", text], {}
    name, eq, rest = text.partition("=")
    if not eq or not name:
        raise SystemExit(f"--variants {text!r}: use none, chunked or NAME=--section.field=value|VAR=value[,...]")
    overrides, env = [], {}
    for pair in rest.split(","):
        key, eq, value = pair.partition("=")
        if key.startswith("--") and eq:
            overrides += [key, value]
        elif eq and key.isidentifier() and key.isupper():
            env[key] = value
        else:
            raise SystemExit(f"--variants {text!r}: {pair!r} is neither --section.field=value nor VAR=value")
    return name, overrides, env


def measured(run_dir: Path, warmup: int) -> dict[str, float | None]:
    """Medians over the steps after `warmup` of one run's metrics.jsonl."""
    run = report.load_run(run_dir / keys.JSONL_NAME)
    steady = [r for r in run.records if r["step"] > warmup] or run.records[-1:]

    def med(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    return {"step_ms": med(keys.STEP_MS), "moe_comm_ms": med(keys.COMM_MS),
            "moe_comm_exposed_ms": med(keys.COMM_EXPOSED_MS), "tokens_per_s": med(keys.TPS),
            "emulated_link": run.static.get(keys.EMULATED_LINK), "steps": len(steady)}


def _pct(model: float | None, meas: float | None) -> float | None:
    return None if model is None or not meas else 100 * (model - meas) / meas


def ran_before(args: argparse.Namespace, spec: runner.RunSpec) -> runner.RunResult:
    """--report-only: the run an earlier invocation left in its dump folder (its command from the
    launcher's first line of train.log), read as run_one reads a run it has just made."""
    folder = args.out / "runs" / args.name / spec.name
    log = folder / "train.log"
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    command = next((line[2:] for line in lines if line.startswith("+ ")), "")
    result = runner.RunResult(spec, "failed", command, str(folder.relative_to(args.out)), wall_s=None)
    if (folder / keys.JSONL_NAME).is_file():
        result.status = "ok"
    else:
        result.error = f"--report-only: no {keys.JSONL_NAME} in {folder}"
    return result


def run_all(args: argparse.Namespace, link: EmulatedLink) -> list[dict[str, Any]]:
    rows = []
    for text in args.variants:
        name, overrides, env = variant_overrides(text)
        for over_link in (True, False) if args.baseline else (True,):
            tag = f"{name}-{'emulatedlink' if over_link else 'nolink'}"
            spec = runner.RunSpec(args.recipe, "nvshmem", overrides=overrides, tag=tag)
            saved = dict(os.environ)
            os.environ.update(env)
            if over_link:
                os.environ[emulated_link.ENV] = link.source
            else:
                os.environ.pop(emulated_link.ENV, None)
            try:
                result = ran_before(args, spec) if args.report_only else runner.run_one(args, spec)
            finally:
                os.environ.clear()
                os.environ.update(saved)
            row: dict[str, Any] = {"variant": name, "overrides": overrides, "env": env, "emulated_link": over_link,
                                   "status": result.status, "error": result.error, "run": result.dump_folder,
                                   "command": result.command, "wall_s": result.wall_s}
            if result.status == "ok":
                row["measured"] = measured(args.out / result.dump_folder, args.warmup_steps)
                if over_link and row["measured"]["emulated_link"] is None:
                    row["status"], row["error"] = "failed", "the run's metrics do not say emulated_link: not emulated"
            rows.append(row)
    return rows


def predict_rows(args: argparse.Namespace, rows: list[dict], link: EmulatedLink) -> None:
    for row in rows:
        if row["emulated_link"] and row["status"] == "ok":
            row["predicted"] = model_prediction(args.recipe, row["overrides"], link, row["env"])
            m, p = row["measured"], row["predicted"]
            row["exposed_error_pct"] = _pct(p["moe_comm_exposed_ms"], m["moe_comm_exposed_ms"])
            row["step_error_pct"] = _pct(p["step_ms"], m["step_ms"])
            row["within_target"] = None if row["exposed_error_pct"] is None else abs(row["exposed_error_pct"]) <= TARGET_PCT


def _f(v: Any, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def markdown(payload: dict) -> str:
    link = payload["link"]
    lines = [f"# MoE overlap over an EMULATED network link, one GPU ({payload['date']})", "",
             f"Not a network: every dispatch and combine of `{payload['recipe']}` (EP 1, nvshmem) held its "
             f"{payload['num_sms']} SMs for {link['dispatch_us_per_call']:.0f} us (dispatch-like) and "
             f"{link['combine_us_per_call']:.0f} us (combine-like) per full call of {link['tokens_per_full_call']} "
             f"tokens: {payload['link_source']}. Predictions are the scale model's, for the same recipe with each "
             f"transfer's network time set to that hold. Target: predicted exposed MoE comm within {TARGET_PCT:g}% "
             "of the measured.", "",
             "| variant | link | step ms measured | step ms predicted | MoE comm ms | exposed ms measured | "
             "exposed ms predicted | exposed error | within target |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in payload["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {'emulated' if r['emulated_link'] else 'none'} | failed: {r['error']} | | | | | | |")
            continue
        m, p = r["measured"], r.get("predicted", {})
        lines.append(
            f"| {r['variant']} | {'emulated' if r['emulated_link'] else 'none'} | {_f(m['step_ms'])} | {_f(p.get('step_ms'))} | "
            f"{_f(m['moe_comm_ms'])} | {_f(m['moe_comm_exposed_ms'])} | {_f(p.get('moe_comm_exposed_ms'))} | "
            f"{_f(r.get('exposed_error_pct'), '+.1f')}% | {r.get('within_target', 'n/a')} |")
    lines += ["", "Made by:", "", f"    {payload['command']}", ""]
    if payload.get("runs_command"):
        lines += ["from the runs made (on one H200) by:", "", f"    {payload['runs_command']}", ""]
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    argv, overrides = runner.split_overrides(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/deepseek_v3_671b_h200x1.toml", help="the one-GPU recipe trained")
    p.add_argument("--flagship", default="recipes/deepseek_v3_671b_b200.toml", help="whose per-call network time")
    p.add_argument("--flagship-gpu", default="B200")
    p.add_argument("--gbps", type=float, help="the link's rate (default: the scale model's network rate)")
    p.add_argument("--per-call-us", type=float, nargs=2, metavar=("DISPATCH", "COMBINE"),
                   help="the hold per full call, instead of the flagship's bytes")
    p.add_argument("--variants", nargs="+", default=list(OVERLAPS))
    p.add_argument("--baseline", action="store_true", help="each variant also without the link")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", default=NAME)
    p.add_argument("--timeout", type=int, default=420, help="seconds before a run counts as hung")
    p.add_argument("--no-wandb", dest="wandb", action="store_false")
    p.add_argument("--launcher", default=f"{shlex.quote(sys.executable)} -m moe_comm train")
    p.add_argument("--dry-run", action="store_true", help="print the link and the commands, run nothing")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: read the runs an earlier invocation left in OUT/runs/NAME and write the "
                        "table again (the same --variants, --baseline and link)")
    args = p.parse_args(argv)
    if args.wandb and importlib.util.find_spec("wandb") is None:
        args.wandb = False
    args.out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    args.warmup_steps = 5  # start-up, the first captures, the allocator settling
    args.overrides = overrides
    return args


def the_link(args: argparse.Namespace) -> tuple[EmulatedLink, str, dict]:
    """The per-call hold, how it was chosen, and the flagship's transfers it came from."""
    r = _recipe(args.recipe, args.overrides)
    tokens = r.config.training.local_batch_size * r.config.training.seq_len
    if args.per_call_us:
        d, c = args.per_call_us
        return (emulated_link.parse(f"dispatch_us={d:.3f},combine_us={c:.3f},tokens={tokens}"),
                "given with --per-call-us", {})
    transfers = flagship_transfers(args.flagship, args.flagship_gpu)
    gbps = args.gbps or transfers["dispatch"]["network_gbps"]
    setting = (f"dispatch_bytes={transfers['dispatch']['network_bytes']:.0f},"
               f"combine_bytes={transfers['combine']['network_bytes']:.0f},gbps={gbps:g},tokens={tokens}")
    how = (f"the network bytes of one dispatch ({transfers['dispatch']['network_bytes'] / 1e6:.1f} MB) and one combine "
           f"({transfers['combine']['network_bytes'] / 1e6:.1f} MB) of the flagship rank ({args.flagship}, "
           f"{transfers['dispatch']['tokens']} tokens per call, backend {transfers['dispatch']['backend']}, as the "
           f"scale model counts them) at {gbps:g} GB/s")
    return emulated_link.parse(setting), how, transfers


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    link, how, transfers = the_link(args)
    print(f"[{NAME}] {link.label()} ({how})", flush=True)
    if args.dry_run:
        for text in args.variants:
            name, overrides, env = variant_overrides(text)
            spec = runner.RunSpec(args.recipe, "nvshmem", overrides=overrides, tag=name)
            print(" ".join(f"{k}={v}" for k, v in env.items()) + f" {emulated_link.ENV}={link.source} "
                  + shlex.join(runner.train_command(args, spec, args.out / "runs" / args.name / spec.name)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run_all(args, link)
    predict_rows(args, rows, link)
    r = _recipe(args.recipe, args.overrides)
    payload = {"emulated": True, "what": "MoE overlap over an EMULATED network link on one GPU (no network)",
               "date": time.strftime("%Y-%m-%d %H:%M"), "recipe": args.recipe, "num_sms": r.config.moe_comm.num_sms,
               "link": link.describe(), "link_source": how, "flagship_transfers": transfers,
               "target_pct": TARGET_PCT, "rows": rows, "command": shlex.join(["python", f"experiments/{NAME}.py", *argv]),
               "runs_command": (shlex.join(["python", f"experiments/{NAME}.py", *[a for a in argv if a != "--report-only"]])
                                if args.report_only else None)}
    (args.out / f"{NAME}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (args.out / f"{NAME}.md").write_text(markdown(payload))
    print((args.out / f"{NAME}.md").read_text())
    return 0 if all(row["status"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
