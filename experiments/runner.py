"""Runs of `python -m moe_comm train`, one per RunSpec, for the experiment scripts that train
(mfu_sweep.py, fp8_dispatch_training.py, memory_check.py): each run's command, its own dump folder
(OUT/runs/NAME/<run>/, with train.log and metrics.jsonl), its steady-state summary
(moe_comm.report), and OUT/NAME.json rewritten after every run.

Every run gets NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
(experiments/device_env.py: the rule of the lent H200 machines the runs are made on). A run that
fails (OOM, timeout, crash) is recorded with its error and the tail of its log, and the next one
goes on. `args` is the calling script's: launcher, steps, out, name, timeout, warmup_steps, wandb,
overrides, budget_s and retry_failed.
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moe_comm import report  # noqa: E402
from experiments.device_env import DEVICE_ENV as RUN_ENV  # noqa: E402 - the lent machines' NVLink-multicast-off rule

ERROR_TAIL_LINES = 40
# Patterns that name a failure better than the exit code does, first match wins.
_FAILURE_KINDS = (
    ("recipe", re.compile(r"^recipe error:", re.MULTILINE)),
    ("oom", re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED")),
    ("capacity", re.compile(r"recv_capacity_factor|max_tokens_per_rank")),
    ("missing_dependency", re.compile(r"No module named|ModuleNotFoundError|pip install")),
    ("nccl", re.compile(r"NCCL error|ncclInternalError|ncclUnhandledCudaError")),
)


@dataclass
class RunSpec:
    recipe: str
    backend: str
    local_batch_size: int | None = None  # None: the recipe's own
    seq_len: int | None = None
    instrumented: bool = True
    dispatch_dtype: str | None = None  # None: the recipe's own [moe_comm] dispatch_dtype
    overrides: list[str] = field(default_factory=list)  # this run's own TorchTitan overrides
    # tells apart runs that are otherwise the same: what the overrides change (e.g. "acfull"),
    # or a repeat
    tag: str = ""

    @property
    def name(self) -> str:
        parts = [Path(self.recipe).stem, self.backend]
        if self.local_batch_size is not None:
            parts.append(f"b{self.local_batch_size}")
        if self.seq_len is not None:
            parts.append(f"s{self.seq_len}")
        if self.dispatch_dtype is not None:
            parts.append(self.dispatch_dtype)
        if not self.instrumented:
            parts.append("noinst")
        if self.tag:
            parts.append(self.tag)
        return "-".join(parts)


@dataclass
class RunResult:
    spec: RunSpec
    status: str  # "ok" or "failed"
    command: str
    dump_folder: str  # relative to OUT, so results/ stays valid wherever it is copied
    wall_s: float | None  # None: read back from an earlier invocation (emulated_link --report-only)
    returncode: int | None = None
    error: str = ""  # oom, timeout, capacity, missing_dependency, nccl, exit code N, no metrics
    error_tail: str = ""
    summary: dict[str, Any] = field(default_factory=dict)


def train_command(args: argparse.Namespace, spec: RunSpec, dump_folder: Path) -> list[str]:
    cmd = shlex.split(args.launcher) + [spec.recipe, "--moe_comm.backend", spec.backend,
                                        "--training.steps", str(args.steps),
                                        "--metrics.log_freq", "1",
                                        "--job.dump_folder", str(dump_folder)]
    if spec.local_batch_size is not None:
        cmd += ["--training.local_batch_size", str(spec.local_batch_size)]
    if spec.seq_len is not None:
        cmd += ["--training.seq_len", str(spec.seq_len)]
    if spec.dispatch_dtype is not None:
        cmd += ["--moe_comm.dispatch_dtype", spec.dispatch_dtype]
    # offline W&B runs where wandb is importable (it is not in the GPU image unless carried)
    cmd += ["--metrics.enable_wandb" if args.wandb else "--metrics.no-enable-wandb"]
    return cmd + list(spec.overrides) + list(args.overrides)


def _failure_kind(log_text: str, returncode: int) -> str:
    for kind, pattern in _FAILURE_KINDS:
        if pattern.search(log_text):
            return kind
    return f"exit code {returncode}"


def run_one(args: argparse.Namespace, spec: RunSpec) -> RunResult:
    dump_folder = args.out / "runs" / args.name / spec.name
    dump_folder.mkdir(parents=True, exist_ok=True)
    log_path = dump_folder / "train.log"
    cmd = train_command(args, spec, dump_folder)
    env = {**os.environ, **RUN_ENV, "MOE_COMM_INSTRUMENT": "1" if spec.instrumented else "0"}
    env.setdefault("WANDB_RUN_NAME", "-".join(spec.name.split("-")[1:]))
    env.setdefault("WANDB_RUN_GROUP", Path(spec.recipe).stem)
    print(f"[mfu_sweep] {spec.name}: {shlex.join(cmd)}", flush=True)
    start = time.monotonic()
    returncode: int | None = None
    with open(log_path, "w") as log:
        try:
            returncode = subprocess.run(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                        timeout=args.timeout, start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            returncode = None
    wall_s = time.monotonic() - start
    log_text = log_path.read_text(errors="replace")
    tail = "\n".join(log_text.splitlines()[-ERROR_TAIL_LINES:])
    result = RunResult(spec, "failed", shlex.join(cmd), str(dump_folder.relative_to(args.out)),
                       wall_s, returncode)
    if returncode is None:
        result.error, result.error_tail = f"timeout after {args.timeout}s", tail
    elif returncode != 0:
        result.error, result.error_tail = _failure_kind(log_text, returncode), tail
    elif not (dump_folder / "metrics.jsonl").is_file():
        result.error, result.error_tail = "no metrics.jsonl (did the run log a step?)", tail
    else:
        result.status = "ok"
        run = report.load_run(dump_folder / "metrics.jsonl")
        result.summary = report.summarize_run(run, args.warmup_steps)
        result.summary["tokens_per_rank"] = run.static.get("local_batch_size", 0) * run.static.get("seq_len", 0)
        result.summary["seq_len"] = run.static.get("seq_len", 0)
    print(f"[mfu_sweep] {spec.name}: {result.status} {result.error} in {wall_s:.0f}s"
          + (f", {result.summary.get('tps') or 0:,.0f} tok/s/GPU, MFU {result.summary.get('mfu')}"
             if result.status == "ok" else ""), flush=True)
    return result


def instrument_cost(results: list[RunResult]) -> list[dict[str, Any]]:
    """tokens/s with and without instrumentation, per configuration that ran both ways."""
    by_key = {}
    for r in results:
        if r.status == "ok":
            key = (r.spec.recipe, r.spec.backend, r.spec.local_batch_size, r.spec.seq_len)
            by_key.setdefault(key, {})[r.spec.instrumented] = r.summary["tps"]
    rows = []
    for (recipe, backend, batch, seq), tps in by_key.items():
        if True in tps and False in tps and tps[False]:
            rows.append({
                "recipe": recipe, "backend": backend, "local_batch_size": batch, "seq_len": seq,
                "tps_instrumented": tps[True], "tps_bare": tps[False],
                "slowdown_pct": 100 * (tps[False] - tps[True]) / tps[False],
            })
    return rows


def load_previous(args: argparse.Namespace) -> tuple[list[RunResult], list[str]]:
    """Runs recorded by an earlier invocation (--resume): kept, and not run again unless they
    failed and --retry-failed is given."""
    path = args.out / f"{args.name}.json"
    if not path.is_file():
        return [], []
    payload = json.loads(path.read_text())
    results = []
    for run in payload["runs"]:
        run = {k: v for k, v in run.items() if k != "name"}
        result = RunResult(**{**run, "spec": RunSpec(**run["spec"])})
        if result.status == "ok" or not args.retry_failed:
            results.append(result)
    return results, list(payload.get("commands", []))


def write_results(args: argparse.Namespace, results: list[RunResult], commands: list[str]) -> Path:
    path = args.out / f"{args.name}.json"
    payload = {
        "commands": commands,
        "env": RUN_ENV,
        "steps": args.steps,
        "warmup_steps_excluded": args.warmup_steps,
        "runs": [{**asdict(r), "name": r.spec.name} for r in results],
        "instrument_cost": instrument_cost(results),
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def run_all(args, specs: list[RunSpec], results: list[RunResult], commands: list[str], command: str) -> None:
    """Run the specs not yet in `results`, rewriting OUT/NAME.json after each one."""
    commands.append(command)
    done = {r.spec.name for r in results}
    todo = [s for s in specs if s.name not in done]
    print(f"[mfu_sweep] {len(todo)} runs to do" + (f", {len(done)} kept from before" if done else ""))
    write_results(args, results, commands)
    start = time.monotonic()
    walls: list[float] = []
    for i, spec in enumerate(todo):
        elapsed = time.monotonic() - start
        if args.budget_s and walls and elapsed + statistics.mean(walls) > args.budget_s:
            print(f"[mfu_sweep] time budget {args.budget_s}s reached with {len(todo) - i} runs left: "
                  f"run the same command with --resume to continue")
            break
        result = run_one(args, spec)
        walls.append(result.wall_s)
        results.append(result)
        write_results(args, results, commands)


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this script's arguments, the TorchTitan overrides for every run: what follows `--`)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]
