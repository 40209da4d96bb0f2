"""One rank of `python -m moe_comm train`'s training, forked from tests/ranks.py's fork server
instead of started by torchrun: what `python -m moe_comm.trainer` runs (TorchTitan's
main(Trainer)'s steps, with the arguments the launcher gives torchrun's ranks, in the environment
it gives them), through tests/ranks.py's train_here (why not main() itself: it says).

For the shared runs whose tests read only what the ranks wrote (tests/test_train_equality.py's
losses, tests/test_pipeline_logs.py's rank logs and metrics): a torchrun
start costs ~25 CPU-seconds on a 2-core machine before the first step (the launcher's imports,
torchrun's, and each rank's import of TorchTitan), which the fork server pays once per session.
The launcher itself (its checks, claim, relay and footer) is tested through the runs that still
start it (tests/conftest.py)."""

import os
from pathlib import Path

import ranks

REPO = Path(__file__).resolve().parents[1]


def run_rank(rank: int, world: int, port: int, argv: list[str], log_dir: str, nice: int = 0) -> None:
    """Rank `rank` of `world`, as torchrun starts `-m moe_comm.trainer ARGV` from the repository
    root, at niceness `nice`; its stdout and stderr to LOG_DIR/rank{R}.log (not to the test
    session's output)."""
    os.nice(nice)
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(log_dir) / f"rank{rank}.log", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    for var in [v for v in os.environ if v.startswith("WANDB_")]:
        del os.environ[var]
    os.environ.update(WANDB_MODE="offline", HF_DATASETS_OFFLINE="1")  # as the launcher sets them for c4_test
    ranks.torchrun_env(rank, world, port)
    os.chdir(REPO)
    from torchtitan.train import Trainer

    from moe_comm import console

    console.hold_early_lines()
    ranks.train_here(Trainer, argv)
