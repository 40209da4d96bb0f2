"""FP8 dispatch's effect on training: the same recipe, seed and data trained with
`[moe_comm] dispatch_dtype = "bf16"` and `"fp8"`; loss and grad-norm curves side by side and the
final loss compared (issue 25, item 4). The same comparison serves any runs that differ in
backend, dispatch dtype, overlap, expert dtype or combine's backward dtype
(`--runs BACKEND:DTYPE[:FIELD=VALUE...]`): the chunked overlap against none
(results/h200x1/overlap_training), the backends at EP 4 (experiments/h200x4_runs.py), FP8 experts
and FP8 combine backward against bf16 (issues 35 and 37), with each run's tokens/s beside its loss.

A --runs entry is BACKEND:DTYPE (DTYPE: [moe_comm] dispatch_dtype) and then, each optional,
  overlap=none|chunked            [moe_comm] overlap (a bare third field means the same: nvshmem:bf16:chunked)
  expert_dtype=bf16|fp8           [moe_comm] expert_dtype
  combine_grad_dtype=bf16|fp8     [moe_comm] combine_grad_dtype
  target=PCT                      this run's final-loss target against the reference (default --target-pct)
e.g. the one-GPU recipe's FP8 set, in one call (about 2 minutes a run on one H200):
    python experiments/fp8_dispatch_training.py --recipe recipes/deepseek_v3_671b_h200x1.toml --steps 300 \\
        --name fp8_experts_training --runs nvshmem:bf16 nvshmem:fp8:expert_dtype=fp8 \\
        nvshmem:bf16:combine_grad_dtype=fp8:target=0.5 nccl:bf16

On one H200 (the one-GPU recipe, real text staged by assets/make_real.py):
    python experiments/fp8_dispatch_training.py --recipe recipes/deepseek_v3_671b_h200x1.toml \\
        --steps 300 --out results/h200x1 --budget-s 540
Then, wherever matplotlib is (the raw metrics.jsonl of both runs come back in OUT/runs/NAME/):
    python experiments/fp8_dispatch_training.py --out results/h200x1 --report-only \\
        --md results/fp8_dispatch_accuracy.md
CPU smoke path (debug_cpu, nccl, both runs bf16: the same seed must give the same curve):
    python experiments/fp8_dispatch_training.py --recipe recipes/debug_cpu.toml --backend nccl \\
        --dtypes bf16 bf16 --dataset-path ./assets/tiny/c4_tiny --tokenizer ./assets/tiny \\
        --steps 8 --last 4 --out /tmp/fp8_smoke --no-wandb   # 2 x ~70 s on 2 cores

Each run is one `python -m moe_comm train` through experiments/runner.py (its own
dump folder with train.log and metrics.jsonl, the lent machines' NVLink-multicast-off
environment, failures recorded with their log tail, OUT/NAME.json rewritten after every run,
`--budget-s` and `--resume` for a 10-minute command limit). Every run gets `--debug.seed SEED`
and the same data (`[training] dataset = "c4_test"` from --dataset-path, the tokenizer from
--tokenizer), so the runs differ only in dispatch_dtype; extra TorchTitan overrides for all runs
follow `--`. `--dtypes bf16 fp8 bf16` adds a second bf16 run: the run-to-run spread of bf16
itself (GPU kernels are not bitwise deterministic), against which FP8's difference reads.

The comparison (OUT/NAME/comparison.json): the first run is the reference; for every other run,
the mean loss (and grad norm) of the last --last steps, its difference relative to the
reference's, and whether that is within --target-pct (1%); plus the largest per-step loss
difference. OUT/NAME/curves.png plots loss, grad norm and the per-step loss difference;
OUT/NAME/section.md is the results section, which --md also splices into a markdown file
between markers (replacing an earlier version of it).
"""

import argparse
import importlib.util
import json
import os
import shlex
import statistics
import sys
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments import runner  # noqa: E402
from moe_comm import plots, report  # noqa: E402
from moe_comm.backends.base import OVERLAP_CHUNKS  # noqa: E402
from moe_comm.metrics import keys  # noqa: E402

NAME = "fp8_dispatch_training"
REAL_DATA = "./assets/real/nltk_en"
REAL_TOKENIZER = "./assets/real"
MANIFEST = "MANIFEST.json"  # assets/make_real.py's record of what it staged


def section_markers(name: str) -> tuple[str, str]:
    """The markers around a results section in a markdown file: one pair per --name, so several
    comparisons (FP8 dispatch, FP8 experts) share a file without replacing each other."""
    return (f"<!-- {name}: begin (written by experiments/{NAME}.py; edits here are replaced) -->",
            f"<!-- {name}: end -->")
# The reference keeps its backend's colour; the others follow in this order.
OTHER_COLORS = ("#ff7f0e", "#7f7f7f", "#2ca02c", "#9467bd")


class SetupError(Exception):
    """Something the runs would trip over, said before any starts, with the fix."""


# ---- plan -------------------------------------------------------------------------------------

# The [moe_comm] fields a --runs entry may set for its run alone: their values and run-name tags.
RUN_FIELDS = {
    "overlap": (tuple(OVERLAP_CHUNKS), "overlap{}"),
    "expert_dtype": (("bf16", "fp8"), "experts-{}"),
    "combine_grad_dtype": (("bf16", "fp8"), "cgrad-{}"),
}


def parse_entry(entry: str) -> tuple[str, str, dict[str, str], float | None]:
    """BACKEND:DTYPE[:FIELD=VALUE...] -> (backend, dispatch dtype, fields, target %)."""
    backend, _, rest = entry.partition(":")
    dtype, *items = rest.split(":") if rest else ("",)
    fields: dict[str, str] = {}
    target = None
    problem = "" if backend and dtype in ("bf16", "fp8") else "BACKEND:DTYPE first, DTYPE bf16 or fp8"
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:  # BACKEND:DTYPE:OVERLAP, as before the fields
            key, value = "overlap", item
        if key == "target":
            try:
                target = float(value)
            except ValueError:
                problem = f"target={value} is not a number"
        elif key not in RUN_FIELDS or value not in RUN_FIELDS[key][0] or key in fields:
            choices = "; ".join(f"{k}={'|'.join(v[0])}" for k, v in RUN_FIELDS.items())
            problem = f"{item!r} is not one of {choices} (each once), or target=PCT"
        else:
            fields[key] = value
    if problem:
        raise SetupError(f"--runs {entry!r}: {problem}; e.g. nvshmem:fp8, nccl:bf16, nvshmem:bf16:chunked, "
                         f"nvshmem:fp8:expert_dtype=fp8, nvshmem:bf16:combine_grad_dtype=fp8:target=0.5 "
                         f"(overlap one of {', '.join(OVERLAP_CHUNKS)})")
    return backend, dtype, fields, target


def plan(args: argparse.Namespace) -> list[runner.RunSpec]:
    """One run per --runs entry (parse_entry; default --backend with each --dtypes entry); an entry
    given again is a repeat, tagged so its folder differs. Its fields set `[moe_comm]` for that run
    alone, so one invocation compares e.g. FP8 experts' curve with bf16's (the recipe's own value
    where a field is left out). A run's own target, if given, lands in args.targets."""
    entries = args.runs or [f"{args.backend}:{dtype}" for dtype in args.dtypes]
    specs, seen = [], {}
    args.targets = {}
    for entry in entries:
        backend, dtype, fields, target = parse_entry(entry)
        seen[entry] = seen.get(entry, 0) + 1
        tags = [RUN_FIELDS[k][1].format(v) for k, v in fields.items()]
        tags += [f"repeat{seen[entry]}"] if seen[entry] > 1 else []
        overrides = [word for k, v in fields.items() for word in (f"--moe_comm.{k}", v)]
        spec = runner.RunSpec(args.recipe, backend, args.batch, args.seq, dispatch_dtype=dtype,
                                 overrides=overrides, tag="-".join(tags))
        specs.append(spec)
        if target is not None:
            args.targets[spec.name] = target
    return specs


def data_overrides(args: argparse.Namespace) -> list[str]:
    return ["--debug.seed", str(args.seed), "--training.dataset", "c4_test",
            "--training.dataset_path", args.dataset_path, "--model.hf_assets_path", args.tokenizer]


def _manifest(dataset_path: str) -> dict | None:
    path = REPO / dataset_path / ".." / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def check_data(args: argparse.Namespace) -> dict[str, Any]:
    """The staged data is there (and is what assets/make_real.py pinned, when it made it); how
    many tokens the runs read against how many there are."""
    folder, tokenizer = REPO / args.dataset_path, REPO / args.tokenizer
    build = "python assets/make_real.py --nltk-data PATH (a clone of github.com/nltk/nltk_data)"
    if not folder.is_dir() or not any(folder.iterdir()):
        raise SetupError(f"--dataset-path {args.dataset_path}: no data there; "
                         + (f"build it with {build}" if args.dataset_path == REAL_DATA else "stage it first"))
    if not (tokenizer / "tokenizer.json").is_file():
        raise SetupError(f"--tokenizer {args.tokenizer}: no tokenizer.json there"
                         + (f"; build it with {build}" if args.tokenizer == REAL_TOKENIZER else ""))
    manifest = _manifest(args.dataset_path)
    if manifest is not None:
        sys.path.insert(0, str(REPO / "assets"))
        import make_real

        problems = make_real.check(folder.parent)
        if problems:
            raise SetupError(f"{folder.parent} does not match its manifest: {'; '.join(problems)}; rebuild: {build}")
    if not (REPO / args.recipe).is_file():
        raise SetupError(f"--recipe {args.recipe}: no such recipe (paths are relative to the repository root)")
    with open(REPO / args.recipe, "rb") as f:
        training = tomllib.load(f).get("training", {})
    batch = args.batch or training.get("local_batch_size", 8)
    seq = args.seq or training.get("seq_len", 2048)
    needed = args.steps * batch * (seq + 1)  # TorchTitan's loader cuts windows of seq + 1 tokens
    data = {"dataset_path": args.dataset_path, "tokenizer": args.tokenizer, "seed": args.seed,
            "local_batch_size": batch, "seq_len": seq, "tokens_read": needed}
    if manifest is not None:
        data.update(tokens_staged=manifest["tokens"], passes=needed / manifest["tokens"],
                    documents=manifest["documents"], source=manifest["source"],
                    tokenizer_vocab_size=manifest["tokenizer_vocab_size"])
    return data


# ---- comparison -------------------------------------------------------------------------------

def curve(run: report.Run) -> dict[str, list]:
    """Per logged step: loss and grad norm (None where a step logged none, e.g. a NaN)."""
    return {"step": [r["step"] for r in run.records],
            "loss": [r.get(keys.LOSS) for r in run.records],
            "grad_norm": [r.get(keys.GRAD_NORM) for r in run.records]}


def _tail_mean(values: list, last: int) -> float | None:
    tail = values[-last:]
    if len(tail) < last or any(v is None for v in tail):
        return None
    return statistics.fmean(tail)


def _rel_pct(value: float | None, ref: float | None) -> float | None:
    return None if value is None or not ref else 100 * (value - ref) / ref


def compare(ref: dict[str, list], other: dict[str, list], last: int, target_pct: float) -> dict[str, Any]:
    """`other` against the reference over the steps both logged: the means of the last `last`
    steps, their relative difference, and the per-step loss difference."""
    common = sorted(set(ref["step"]) & set(other["step"]))
    pick = lambda c, key: [c[key][c["step"].index(s)] for s in common]  # noqa: E731
    ref_loss, loss = pick(ref, "loss"), pick(other, "loss")
    ref_gn, gn = pick(ref, "grad_norm"), pick(other, "grad_norm")
    final_ref, final = _tail_mean(ref_loss, last), _tail_mean(loss, last)
    diffs = [b - a for a, b in zip(ref_loss, loss) if a is not None and b is not None]
    rel = _rel_pct(final, final_ref)
    out = {
        "steps_compared": len(common),
        "last_step": common[-1] if common else None,
        "final_loss_ref": final_ref,
        "final_loss": final,
        "final_loss_rel_pct": rel,
        "target_pct": target_pct,
        "within_target": None if rel is None else abs(rel) <= target_pct,
        "final_grad_norm_ref": _tail_mean(ref_gn, last),
        "final_grad_norm": _tail_mean(gn, last),
        "max_abs_loss_diff": max((abs(d) for d in diffs), default=None),
        "max_abs_loss_diff_step": common[max(range(len(diffs)), key=lambda i: abs(diffs[i]))] if diffs else None,
        "mean_loss_diff": statistics.fmean(diffs) if diffs else None,
    }
    out["final_grad_norm_rel_pct"] = _rel_pct(out["final_grad_norm"], out["final_grad_norm_ref"])
    if len(common) < last:
        out["note"] = f"only {len(common)} common steps, fewer than --last {last}: no final comparison"
    elif final is None or final_ref is None:
        out["note"] = f"a loss of the last {last} steps is missing (NaN or not logged)"
    return out


def _is_nccl_bf16(spec: runner.RunSpec) -> bool:
    """TorchTitan's own path in bf16 (no FP8 anything): what tokens/s is held against."""
    return spec.backend == "nccl" and spec.dispatch_dtype in (None, "bf16") and not spec.overrides


def comparison(results: list[runner.RunResult], out: Path, last: int, target_pct: float,
               data: dict[str, Any], targets: dict[str, float] | None = None) -> dict[str, Any]:
    """Each run against the first: final loss and grad norm (within the run's own target, else
    target_pct), and tokens/s (steady state, the runner's summary) against the reference's and
    against TorchTitan's bf16 path (an nccl:bf16 run) where one ran."""
    targets = targets or {}
    ok = [r for r in results if r.status == "ok"]
    runs = {r.spec.name: report.load_run(out / r.dump_folder / keys.JSONL_NAME) for r in ok}
    curves = {name: curve(run) for name, run in runs.items()}
    reference = results[0].spec.name if results else None
    tps = {r.spec.name: r.summary.get("tps") for r in ok}
    nccl = next((r.spec.name for r in ok if _is_nccl_bf16(r.spec)), None)
    payload: dict[str, Any] = {
        "reference": reference,
        "last_steps": last,
        "target_pct": target_pct,
        "nccl_bf16": nccl,
        "data": data,
        "runs": {r.spec.name: {"dispatch_dtype": r.spec.dispatch_dtype, "overrides": list(r.spec.overrides),
                               "status": r.status, "error": r.error,
                               "wall_s": r.wall_s, "steps_logged": len(curves[r.spec.name]["step"])
                               if r.spec.name in curves else 0,
                               "final_loss": _tail_mean(curves[r.spec.name]["loss"], last)
                               if r.spec.name in curves else None,
                               "final_grad_norm": _tail_mean(curves[r.spec.name]["grad_norm"], last)
                               if r.spec.name in curves else None,
                               "tps": tps.get(r.spec.name),
                               "tps_vs_reference": _ratio(tps.get(r.spec.name), tps.get(reference)),
                               "tps_vs_nccl_bf16": _ratio(tps.get(r.spec.name), tps.get(nccl))}
                 for r in results},
        "against_reference": {},
    }
    if reference in curves:
        for name, c in curves.items():
            if name != reference:
                payload["against_reference"][name] = compare(curves[reference], c, last,
                                                             targets.get(name, target_pct))
    payload["curves"] = curves
    return payload


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value and base else None


# ---- outputs ----------------------------------------------------------------------------------

def _label(spec: dict) -> str:
    return f"{spec['backend']} {spec.get('dispatch_dtype') or 'recipe dtype'}" + (f" ({spec['tag']})" if spec.get("tag") else "")


def plot(payload: dict[str, Any], results: list[runner.RunResult], out: Path, path: Path,
         kernels: str | None = None) -> Path | None:
    """Loss, grad norm and loss minus the reference's, per step, side by side."""
    ok = [r for r in results if r.status == "ok"]
    if not ok:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves, reference = payload["curves"], payload["reference"]
    runs = [report.load_run(out / r.dump_folder / keys.JSONL_NAME) for r in ok]
    fig, (ax_loss, ax_gn, ax_diff) = plt.subplots(1, 3, figsize=(15, 4.2))
    others = iter(OTHER_COLORS)
    for r in ok:
        c = curves[r.spec.name]
        is_ref = r.spec.name == reference
        color = plots.backend_color(r.spec.backend) if is_ref else next(others)
        lw = 2.2 if is_ref else 1  # under the others, so that identical curves still show both
        label = _label({"backend": r.spec.backend, "dispatch_dtype": r.spec.dispatch_dtype, "tag": r.spec.tag})
        nan = float("nan")
        ax_loss.plot(c["step"], [v if v is not None else nan for v in c["loss"]], color=color, lw=lw, label=label)
        ax_gn.plot(c["step"], [v if v is not None else nan for v in c["grad_norm"]], color=color, lw=lw, label=label)
        if r.spec.name != reference and reference in curves:
            ref = dict(zip(curves[reference]["step"], curves[reference]["loss"]))
            steps = [s for s, v in zip(c["step"], c["loss"]) if v is not None and ref.get(s) is not None]
            diff = [v - ref[s] for s, v in zip(c["step"], c["loss"]) if v is not None and ref.get(s) is not None]
            ax_diff.plot(steps, diff, color=color, lw=0.6, alpha=0.5)
            window = payload["last_steps"]
            smooth = [statistics.fmean(diff[max(0, i - window + 1):i + 1]) for i in range(len(diff))]
            ax_diff.plot(steps, smooth, color=color, lw=1.6, label=f"{label}, {window}-step mean")
    ref_final = (payload["runs"].get(reference) or {}).get("final_loss")
    if ref_final:
        band = ref_final * payload["target_pct"] / 100
        ax_diff.axhline(band, color="0.4", ls=":", lw=1,
                        label=f"±{payload['target_pct']:g}% of the reference's final loss")
        ax_diff.axhline(-band, color="0.4", ls=":", lw=1)
    ax_diff.axhline(0, color="0.6", lw=0.8)
    ax_loss.set_title("loss")
    ax_gn.set_title("grad norm (before clipping)")
    ax_diff.set_title("loss minus the reference's, per step")
    for ax in (ax_loss, ax_gn, ax_diff):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_loss.legend()
    if ax_diff.get_legend_handles_labels()[0]:
        ax_diff.legend(loc="lower right", fontsize=8)
    d = payload["data"]
    footer = report.provenance(runs, report.run_labels(runs), kernels) + [
        f"data: {d['dataset_path']} (tokenizer {d['tokenizer']}), seed {d['seed']}, local batch "
        f"{d['local_batch_size']} x seq {d['seq_len']}; final = mean of the last {payload['last_steps']} steps"
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    plots.save(fig, path, footer)
    plt.close(fig)
    return path


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


VARIED_FIELD_NAMES = {"backend": "`[moe_comm] backend`", "dispatch": "`[moe_comm] dispatch_dtype`",
                      "overlap": "`[moe_comm] overlap`", "expert_dtype": "`[moe_comm] expert_dtype`",
                      "combine_grad_dtype": "`[moe_comm] combine_grad_dtype`"}


def run_field(spec: runner.RunSpec, field_name: str) -> str:
    """What a run set for one of VARIED_FIELD_NAMES ("recipe's" where it left the recipe's own)."""
    if field_name == "backend":
        return spec.backend
    if field_name == "dispatch":
        return spec.dispatch_dtype or "recipe's"
    o, flag = spec.overrides, f"--moe_comm.{field_name}"
    return o[o.index(flag) + 1] if flag in o else "recipe's"


def varied_fields(results: list[runner.RunResult]) -> list[str]:
    """The fields the runs differ in, in VARIED_FIELD_NAMES's order."""
    return [f for f in VARIED_FIELD_NAMES if len({run_field(r.spec, f) for r in results}) > 1]


def section(payload: dict[str, Any], results: list[runner.RunResult], out: Path, commands: list[str],
            plot_path: str | None, kernels: str | None = None, name: str = NAME) -> str:
    """The results section, in the words of results/fp8_dispatch_accuracy.md."""
    d, last, target = payload["data"], payload["last_steps"], payload["target_pct"]
    ref = payload["reference"]
    runs = payload["runs"]
    ok = [r for r in results if r.status == "ok"]
    device = date = "not run"
    if ok:
        first = report.load_run(out / ok[0].dump_folder / keys.JSONL_NAME)
        device, date = first.hardware, first.date
    varied = varied_fields(results)
    title = ("Training with FP8 dispatch: loss and grad norm against bf16" if varied == ["dispatch"]
             else f"Training: loss and grad norm, runs differing in {' and '.join(varied) or 'nothing (repeats)'}")
    extra = [f for f in varied if f != "dispatch"]  # columns beside dispatch
    begin, end = section_markers(name)
    lines = [begin, "", f"## {title}", ""]
    if "source" in d:  # staged by assets/make_real.py
        data = (f"real English text, `{d['dataset_path']}`: {d['source']}, {d['tokens_staged']:,} tokens staged, "
                f"{d['passes']:.2f} passes (assets/make_real.py says what and why: c4 is on the Hugging Face "
                f"hub, which the machines could not reach); tokenizer `{d['tokenizer']}`, a byte-level BPE of "
                f"{d['tokenizer_vocab_size']:,} entries (the model's vocabulary is larger; its upper ids go unused)")
    else:
        data = f"`{d['dataset_path']}`, tokenizer `{d['tokenizer']}`"
    lines += [
        f"{len(results)} runs of `{results[0].spec.recipe if results else '?'}` on {device} ({date}; kernels: "
        f"{report.kernels_text(kernels)}), "
        f"identical but for {' and '.join(VARIED_FIELD_NAMES[f] for f in varied) or 'nothing'}: seed {d['seed']}, "
        f"local batch {d['local_batch_size']} x "
        f"seq {d['seq_len']}, {d['tokens_read']:,} tokens read per data-parallel rank per run. Data: {data}. "
        "tok/s: tokens per second per GPU over the steps after the warm-up (median).",
        "",
        f"| run | {''.join(f + ' | ' for f in extra)}dispatch | steps | loss, mean of last {last} | vs {ref} | grad norm, "
        f"mean of last {last} | vs {ref} | largest per-step loss difference | tok/s | vs {ref} |",
        "| --- | " + "--- | " * len(extra) + "--- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        info = runs[r.spec.name]
        cells = "".join(f"{run_field(r.spec, f)} | " for f in extra)
        if r.status != "ok":
            lines.append(f"| {r.spec.name} | {cells}{r.spec.dispatch_dtype} | failed: {r.error} | | | | | | | |")
            continue
        vs = payload["against_reference"].get(r.spec.name)
        lines.append(
            f"| {r.spec.name} | {cells}{r.spec.dispatch_dtype} | {info['steps_logged']} | {_fmt(info['final_loss'], '.4f')} | "
            + (f"{_fmt(vs['final_loss_rel_pct'], '+.2f')}% |" if vs else "reference |")
            + f" {_fmt(info['final_grad_norm'], '.3f')} | "
            + (f"{_fmt(vs['final_grad_norm_rel_pct'], '+.1f')}% |" if vs else "reference |")
            + (f" {_fmt(vs['max_abs_loss_diff'], '.4f')} (step {vs['max_abs_loss_diff_step']}) |" if vs else " |")
            + f" {_fmt(info.get('tps'), ',.0f')} | "
            + (f"{_fmt(info.get('tps_vs_reference'), '.3f')}x |" if vs else "reference |")
        )
    lines.append("")
    for name, vs in payload["against_reference"].items():
        goal = vs.get("target_pct", target)
        if vs.get("note"):
            verdict = f"no verdict ({vs['note']})"
        else:
            verdict = ("within" if vs["within_target"] else "**outside**") + f" the {goal:g}% target"
        lines.append(f"- {name}: final loss {_fmt(vs['final_loss_rel_pct'], '+.3f')}% against {ref}, {verdict}.")
    nccl = payload.get("nccl_bf16")
    if nccl:
        for name, info in runs.items():
            if name != nccl and info.get("tps_vs_nccl_bf16"):
                lines.append(f"- {name}: {_fmt(info['tps'], ',.0f')} tok/s, {info['tps_vs_nccl_bf16']:.3f}x {nccl}'s "
                             f"{_fmt(runs[nccl]['tps'], ',.0f')}.")
    if not payload["against_reference"]:
        lines.append("- No comparison: fewer than two runs finished.")
    if plot_path:
        lines += ["", f"![loss and grad norm: {title}]({plot_path})"]
    lines += ["", "Made by:", ""] + [f"    {c}" for c in commands] + ["", end]
    return "\n".join(lines) + "\n"


def splice(md_path: Path, text: str, name: str = NAME) -> None:
    """Put `text` into md_path between --name's markers, replacing what was there, or at the end."""
    begin, end = section_markers(name)
    old = md_path.read_text() if md_path.is_file() else ""
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + text.rstrip("\n") + rest.split(end, 1)[1]
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text
    md_path.write_text(new)


def write_outputs(args: argparse.Namespace, results: list[runner.RunResult], commands: list[str],
                  data: dict[str, Any]) -> dict[str, Any]:
    folder = args.out / args.name
    folder.mkdir(parents=True, exist_ok=True)
    payload = comparison(results, args.out, args.last, args.target_pct, data, args.targets)
    (folder / "comparison.json").write_text(json.dumps(payload, indent=2) + "\n")
    plot_path = None
    try:
        plot_path = plot(payload, results, args.out, folder / "curves.png", args.kernels)
    except ImportError as e:  # no matplotlib on the GPU image: --report-only makes it elsewhere
        print(f"[{NAME}] no plot ({e}); make it with: python experiments/{NAME}.py --out {args.out} "
              f"--name {args.name} --report-only")
    md_ref = None
    if plot_path is not None:
        base = args.md.parent if args.md else folder
        md_ref = os.path.relpath(plot_path.resolve(), base.resolve())
    text = section(payload, results, args.out, commands, md_ref, args.kernels, args.name)
    (folder / "section.md").write_text(text)
    if args.md:
        splice(args.md, text, args.name)
    return payload


# ---- main -------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    argv, overrides = runner.split_overrides(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", help="the recipe both runs train (e.g. recipes/deepseek_v3_671b_h200x1.toml)")
    p.add_argument("--backend", default="nvshmem", help="[moe_comm] backend of every run")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"],
                   help="dispatch_dtype of each run, the first is the reference; repeat one for a control run")
    p.add_argument("--runs", nargs="+", metavar="BACKEND:DTYPE[:FIELD=VALUE...]",
                   help="the runs, the first the reference (e.g. nvshmem:bf16 nvshmem:fp8 nccl:bf16, "
                   "nvshmem:bf16:none nvshmem:bf16:chunked, nvshmem:fp8:expert_dtype=fp8, "
                   "nvshmem:bf16:combine_grad_dtype=fp8:target=0.5; FIELD: overlap, expert_dtype, "
                   "combine_grad_dtype, target); default: --backend with each --dtypes entry")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, help="local batch size (default: the recipe's)")
    p.add_argument("--seq", type=int, help="sequence length (default: the recipe's)")
    p.add_argument("--seed", type=int, default=0, help="--debug.seed of every run")
    p.add_argument("--dataset-path", default=REAL_DATA, help="staged c4-format folder ([training] dataset_path)")
    p.add_argument("--tokenizer", default=REAL_TOKENIZER, help="tokenizer folder ([model] hf_assets_path)")
    p.add_argument("--last", type=int, default=20, help="the final loss is the mean of this many last steps")
    p.add_argument("--target-pct", type=float, default=1.0, help="the final loss must be within this %% of the reference's")
    p.add_argument("--out", type=Path, default=REPO / "results" / "h200x1")
    p.add_argument("--name", default=NAME, help="results OUT/NAME.json, raw runs OUT/runs/NAME/, report OUT/NAME/")
    p.add_argument("--md", type=Path, help="also splice the results section into this markdown file")
    p.add_argument("--timeout", type=int, default=600, help="seconds before a run counts as hung")
    p.add_argument("--budget-s", type=float, default=0, help="start no run likely to end past this (then --resume)")
    p.add_argument("--resume", action="store_true", help="keep the runs in OUT/NAME.json, do the missing ones")
    p.add_argument("--retry-failed", action="store_true", help="with --resume: run failed ones again")
    p.add_argument("--no-wandb", dest="wandb", action="store_false", help="no offline W&B runs")
    p.add_argument("--launcher", default=f"{shlex.quote(sys.executable)} -m moe_comm train",
                   help="command that takes RECIPE [overrides] and trains")
    p.add_argument("--kernels", default=None,
                   help="the commit whose csrc/ the runs are built from; the plot and the section name it")
    p.add_argument("--report-only", action="store_true", help="run nothing: rebuild the report from OUT/NAME.json")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    if not args.report_only and not args.recipe:
        p.error("give --recipe (or --report-only to rebuild the report of earlier runs)")
    if args.wandb and importlib.util.find_spec("wandb") is None:
        print(f"[{NAME}] wandb is not importable: runs log JSONL only (--metrics.no-enable-wandb)")
        args.wandb = False
    args.out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    args.warmup_steps = report.DEFAULT_WARMUP_STEPS  # what the runner's per-run summary leaves out
    args.user_overrides = overrides
    args.overrides = data_overrides(args) + overrides
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = shlex.join(["python", f"experiments/{NAME}.py", *argv])
    results_path = args.out / f"{args.name}.json"
    if args.report_only:
        if not results_path.is_file():
            print(f"[{NAME}] {results_path} does not exist: nothing to report", file=sys.stderr)
            return 2
        saved = json.loads(results_path.read_text())
        args.resume, args.retry_failed = True, False
        results, commands = runner.load_previous(args)
        data = saved.get("data") or {}
        args.targets = saved.get("targets") or {}
    else:
        try:
            specs = plan(args)
            data = check_data(args)
        except SetupError as e:
            print(f"[{NAME}] {e}", file=sys.stderr)
            return 2
        if args.dry_run:
            for spec in specs:
                print(shlex.join(runner.train_command(args, spec, args.out / "runs" / args.name / spec.name)))
            return 0
        if data.get("passes", 0) > 1:
            print(f"[{NAME}] the runs read {data['tokens_read']:,} tokens of {data['tokens_staged']:,} staged: "
                  f"the data repeats ({data['passes']:.2f} passes)")
        args.out.mkdir(parents=True, exist_ok=True)
        results, commands = runner.load_previous(args) if args.resume else ([], [])
        runner.run_all(args, specs, results, commands, command)
        saved = json.loads(results_path.read_text())
        saved["data"] = data
        if args.resume:  # runs kept from an earlier call keep their targets
            args.targets = {**(saved.get("targets") or {}), **args.targets}
        saved["targets"] = args.targets
        results_path.write_text(json.dumps(saved, indent=2) + "\n")
    payload = write_outputs(args, results, commands, data)
    for name, vs in payload["against_reference"].items():
        print(f"[{NAME}] {name}: final loss {_fmt(vs['final_loss'], '.4f')} vs {_fmt(vs['final_loss_ref'], '.4f')} "
              f"({_fmt(vs['final_loss_rel_pct'], '+.3f')}%, target {vs['target_pct']:g}%: "
              f"{ {True: 'met', False: 'missed', None: 'no verdict'}[vs['within_target']] })")
    failed = [r for r in results if r.status != "ok"]
    for r in failed:
        print(f"[{NAME}] failed: {r.spec.name}: {r.error}")
    print(f"[{NAME}] raw runs: {args.out / 'runs' / args.name}/; comparison, plot and section: {args.out / args.name}/")
    return 0 if results and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
