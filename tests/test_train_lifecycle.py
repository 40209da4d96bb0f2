"""`python -m moe_comm train` through a run's life on CPU (recipes/debug_cpu.toml, 2 ranks):
it can always resume (the last save is a full checkpoint; a truncated newest checkpoint is
skipped, naming the file), SIGTERM stops every rank, and a rank that hangs is the one named.

One finished run (4 steps, a checkpoint every 2) serves the checkpoint tests."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from moe_comm import checkpoints

REPO = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, "-m", "moe_comm", "train", "recipes/debug_cpu.toml", "--metrics.no-enable_wandb"]


def train(dump: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([*TRAIN, "--job.dump_folder", str(dump), *overrides], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    proc.console = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    return proc


def steps(console: str) -> list[int]:
    """The steps the console's step lines report (moe_comm.metrics.step_line: `step N/TOTAL ...`)."""
    return sorted({int(s) for s in re.findall(r"step +(\d+)/\d+ ", console)})


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("finished") / "run"
    proc = train(dump, "--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "4")
    assert proc.returncode == 0, proc.console[-4000:]
    return dump


def test_the_last_save_can_resume_the_next_run(finished_run):
    """TorchTitan's default last save is model-only, which the next run in the folder cannot load
    ("Missing key in checkpoint state_dict: dataloader.dp_rank_0"); ours resumes."""
    newest = checkpoints.inspect(finished_run / "checkpoint")[0]
    assert newest.step == 4 and newest.usable, newest.problem
    proc = train(finished_run, "--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "6")
    assert proc.returncode == 0, proc.console[-4000:]
    assert f"Loading the checkpoint from {finished_run}/checkpoint/step-4" in proc.console
    assert steps(proc.console) == [5, 6]


def test_a_truncated_checkpoint_is_named_and_skipped(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    newest = max(checkpoints.inspect(run / "checkpoint"), key=lambda c: c.step)
    shard = sorted(newest.path.glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    proc = train(run, "--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", str(newest.step + 1))
    assert proc.returncode == 0, proc.console[-4000:]
    assert f"skipping {newest.path.name}: {shard} is truncated" in proc.console
    previous = newest.step - 2
    assert f"resuming from step-{previous}, the newest usable checkpoint" in proc.console
    assert f"Loading the checkpoint from {run}/checkpoint/step-{previous}" in proc.console
    assert steps(proc.console) == list(range(previous + 1, newest.step + 2))

    # Nothing usable left: stop before any rank starts, naming the folder to remove.
    for c in checkpoints.inspect(run / "checkpoint"):
        for shard in c.path.glob("*.distcp"):
            with open(shard, "r+b") as f:
                f.truncate(10)
    proc = train(run, "--checkpoint.enable", "--training.steps", "20", timeout=120)
    assert proc.returncode == 2 and "torch.distributed.run" not in proc.console
    assert f"no checkpoint in {run}/checkpoint can resume training" in proc.console
    assert f"remove {run}/checkpoint" in proc.console


def _ranks(marker: str) -> dict[int, int]:
    """{rank: pid} of the training processes started with MOE_TEST_MARKER=marker."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item)
        except (OSError, ValueError):
            continue
        if env.get("MOE_TEST_MARKER") == marker and "RANK" in env and "LOCAL_RANK" in env:
            found[int(env["RANK"])] = int(entry.name)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


class LongRun:
    """A long CPU run started in the background; every process it made is killed at the end."""

    def __init__(self, tmp_path: Path, *overrides: str):
        self.marker = uuid.uuid4().hex
        self.log = tmp_path / "train.log"
        env = dict(os.environ, MOE_TEST_MARKER=self.marker)
        self.out = open(self.log, "w")
        self.proc = subprocess.Popen([*TRAIN, "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "1000",
                                      *overrides], cwd=REPO, env=env, stdout=self.out, stderr=subprocess.STDOUT)
        self.seen: dict[int, int] = {}

    def console(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text())

    def wait_for_step(self, step: int, timeout: float = 240) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"train exited with {self.proc.returncode}:\n{self.console()[-4000:]}")
            if steps(self.console()) and steps(self.console())[-1] >= step:
                self.seen = _ranks(self.marker)
                assert sorted(self.seen) == [0, 1], self.seen
                return self.seen
            time.sleep(0.5)
        raise AssertionError(f"no step {step} within {timeout} s:\n{self.console()[-4000:]}")

    def close(self) -> None:
        for pid in [*self.seen.values(), *_ranks(self.marker).values()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.out.close()


@pytest.fixture
def long_run(tmp_path):
    runs = []
    yield lambda *overrides: runs.append(LongRun(tmp_path, *overrides)) or runs[-1]
    for run in runs:
        run.close()


def test_sigterm_stops_torchrun_and_every_rank(long_run):
    """What Slurm sends on preemption and at the time limit; before, the launcher exited alone
    and the ranks trained on."""
    run = long_run()
    ranks = run.wait_for_step(2)
    run.proc.send_signal(signal.SIGTERM)
    rc = run.proc.wait(timeout=90)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in ranks.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [r for r, pid in ranks.items() if _alive(pid)], "ranks outlived the launcher"
    assert rc == 128 + signal.SIGTERM and "moe_comm: stopped by SIGTERM" in run.console()


def test_a_hung_rank_is_the_one_named(long_run):
    """Rank 1 stops (SIGSTOP); rank 0 times out in its next collective and is what torchrun
    reports as the root cause. The launcher names rank 1."""
    run = long_run("--comm.train_timeout_seconds", "10")
    ranks = run.wait_for_step(2)
    os.kill(ranks[1], signal.SIGSTOP)
    rc = run.proc.wait(timeout=180)
    console = run.console()
    assert rc != 0
    named = re.findall(r"moe_comm: rank (\d+) \(pid (\d+) on \S+\) stopped answering", console)
    assert named == [("1", str(ranks[1]))], console[-4000:]
    assert not [r for r, pid in ranks.items() if _alive(pid)], "ranks outlived the launcher"
