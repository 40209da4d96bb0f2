"""Shared CPU training runs for the whole suite.

A torchrun start costs 15-30 s on a 2-core machine (imports, model set-up, gloo, TorchTitan's
2 s sleep at the end) before its first step, so a run that several test files look at is made
once per session here, and a test that needs a run of its own says why in its docstring.

- `train(dump, *overrides)`: `python -m moe_comm train recipes/debug_cpu.toml` into `dump`, as
  a user runs it from the repository root; the result has `.console` (stdout + stderr without
  colour codes) and `.dump`.
- `train_each({name: (dump, overrides)})`: several `train` runs, two at a time.
- `shared_runs[name]`: the runs of SHARED_RUNS, made once per session (two at a time);
  `default_run` is shared_runs["default"], the README's main job exactly as a user runs it (5
  steps, EP 2 over gloo, W&B offline, output to a pipe). Read them, never train into their
  folders again: copy one first (`shutil.copytree(run.dump, ...)`) to resume or extend it.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/debug_cpu.toml"


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the settings a user's shell may carry that change a run's
    output (W&B credentials and modes, thread counts, HF offline mode)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    for var in ("OMP_NUM_THREADS", "HF_DATASETS_OFFLINE"):
        env.pop(var, None)
    env.update(extra)
    return env


def train(dump: Path, *overrides: str, env: dict[str, str] | None = None, timeout: float = 600,
          recipe: str = RECIPE) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "moe_comm", "train", recipe, "--job.dump_folder", str(dump), *overrides],
                          cwd=REPO, env=env or clean_env(WANDB_MODE="offline"), capture_output=True, text=True,
                          timeout=timeout)
    proc.console = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    proc.dump = Path(dump)
    return proc


def train_each(runs: dict[str, tuple[Path, tuple[str, ...]]], at_once: int = 2) -> dict[str, subprocess.CompletedProcess]:
    """`train` for each {name: (dump, overrides)}, `at_once` of them side by side: a run leaves
    a core idle for seconds (the launcher's checks, TorchTitan's 2 s sleep at the end), which
    the other one uses."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=at_once) as pool:
        futures = {name: pool.submit(train, dump, *overrides) for name, (dump, overrides) in runs.items()}
        return {name: future.result() for name, future in futures.items()}


# The runs several test files read, started two at a time the first time any of them is asked
# for: {name: overrides of `train`}. Add a run here, or better reuse one, for a new CPU test.
SHARED_RUNS = {
    # the README's main job as a user runs it (5 steps, EP 2, W&B offline)
    "default": (),
    # pipeline parallelism: 4 ranks, PP 2 x FSDP 2, EP 2 in each stage, every rank's output
    "pp2": ("--nproc-per-node", "4", "--log-rank", "all", "--parallelism.pipeline_parallel_degree", "2",
            "--training.steps", "2", "--lr_scheduler.warmup_steps", "1", "--metrics.no-enable-wandb"),
    # 4 steps with a checkpoint every 2: copy it to resume, extend or break it
    "checkpointed": ("--metrics.no-enable_wandb", "--checkpoint.enable", "--checkpoint.interval", "2",
                     "--training.steps", "4"),
}


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("shared_runs")
    procs = train_each({name: (tmp / name, overrides) for name, overrides in SHARED_RUNS.items()})
    for name, proc in procs.items():
        assert proc.returncode == 0, f"shared run {name!r} failed:\n{proc.console[-6000:]}"
    return procs


@pytest.fixture(scope="session")
def default_run(shared_runs) -> subprocess.CompletedProcess:
    """`python -m moe_comm train recipes/debug_cpu.toml` (the README's main job), W&B offline."""
    return shared_runs["default"]
