"""The learning-rate schedule a dump folder's checkpoints were trained with, so that a resume
that changes it says so at start-up.

TorchTitan rebuilds its warmup-stable-decay schedule from the recipe at every start and only
restores the scheduler's step count from the checkpoint. So extending `--training.steps` on a
finished run joins two schedules: the first one has decayed to its end, the new one is in its
stable phase at the same step, and the learning rate jumps back up without a word. `train`
records the schedule beside the checkpoints (SCHEDULE_FILE) and, resuming from step N, compares
the learning rate both schedules give at step N + 1; a difference is a warning with both values.
The factors are TorchTitan's own (components/lr_scheduler.py, built on a dummy optimizer).
"""

import dataclasses
import json
import logging
from pathlib import Path

SCHEDULE_FILE = "lr_schedule.json"


def _fields(config) -> dict:
    return {"training.steps": config.training.steps, **{
        f"lr_scheduler.{k}": v for k, v in dataclasses.asdict(config.lr_scheduler).items()}}


def lr_at(fields: dict, lr: float, step: int) -> float:
    """The learning rate TorchTitan's scheduler gives at training step `step` (1-based)."""
    import torch
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.config.job_config import LRScheduler

    config = LRScheduler(**{k.split(".", 1)[1]: v for k, v in fields.items() if k.startswith("lr_scheduler.")})
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    logging.disable(logging.WARNING)  # its "warmup exceeds total steps" notes belong to the run
    try:
        schedulers = build_lr_schedulers([optimizer], config, fields["training.steps"])
    finally:
        logging.disable(logging.NOTSET)
    # LambdaLR's factor for the step-th optimizer step (the scheduler steps after each one)
    return lr * schedulers.schedulers[0].lr_lambdas[0](step - 1)


def changed(folder: Path, config, resumed_step: int) -> str:
    """A warning when resuming `resumed_step` under another schedule than the one recorded in
    `folder` ("" when it is the same, or nothing was recorded)."""
    path = folder / SCHEDULE_FILE
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    now = _fields(config)
    if before == now:
        return ""
    lr = config.optimizer.lr
    step = resumed_step + 1
    old, new = lr_at(before, lr, step), lr_at(now, lr, step)
    if abs(old - new) <= 1e-12 * max(abs(old), abs(new), 1e-30):
        return ""
    diff = ", ".join(f"{k} {before.get(k)!r} -> {v!r}" for k, v in now.items() if before.get(k) != v)
    return (
        f"resuming step-{resumed_step} under another learning-rate schedule ({diff}): TorchTitan rebuilds the "
        f"schedule from the recipe, so step {step} trains at lr {new:.3g} where the checkpoint's schedule gives "
        f"{old:.3g}: two schedules joined in one run. To train one schedule, start it in a fresh "
        "--job.dump_folder"
    )


def record(folder: Path, config) -> None:
    """Write the schedule this run trains with (atomically: every node of a job writes it)."""
    import os

    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{SCHEDULE_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(_fields(config), indent=1) + "\n")
    os.replace(tmp, folder / SCHEDULE_FILE)
