"""One row per step in DUMP/metrics.jsonl, whatever restarted the run.

The rule. A run starts from a known step: its checkpoint's when it resumes one (the one `train`
chose, moe_comm.checkpoints), else 0. The rows of metrics.jsonl after that step were written by
an earlier start whose later steps are now trained again (a requeue or a resume goes back to
its checkpoint; a run without a checkpoint starts over), so before the run writes its first row
they move, whole and in order, to metrics.superseded-{date}.jsonl beside it, with any line that
is not a record (a run killed mid-write). metrics.jsonl keeps the rows up to the start step and
gains the new ones: one row per step, the newest. `report` reads metrics.jsonl alone and, for
a file written before this rule, applies the same one while reading (`newest_rows`).

W&B cannot take back a step it has logged (later rows for it are dropped), so a start that
superseded logged steps logs to a W&B run of its own, in the same group under the same name
(moe_comm.metrics.naming), while a requeue that supersedes nothing continues its W&B run.
"""

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

SUPERSEDED_PREFIX = "metrics.superseded-"
# The steady state: every figure summed up over a run (the footer's s/step, `report`'s medians)
# is over the steps after the first WARMUP_STEPS (start-up, compilation, the allocator's growth),
# or the last step alone when there is none, and says which.
WARMUP_STEPS = 2


@dataclass
class Start:
    """What a start did to metrics.jsonl."""

    step: int  # the step the run starts after (0: from scratch)
    kept: int = 0  # rows up to that step, left in place
    moved: int = 0  # rows (and unreadable lines) moved aside
    moved_to: Path | None = None
    steps_moved: list[int] = field(default_factory=list)

    def message(self, jsonl: str) -> str:
        """One console line about the rows moved ("" when none were)."""
        if not self.moved:
            return ""
        steps = sorted(set(self.steps_moved))
        span = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else (f"step {steps[0]}" if steps else "lines")
        after = f"this run resumes after step {self.step}" if self.step else "this run starts from step 0"
        return (f"{span} of an earlier start ({self.moved} line(s)) moved from {jsonl} to {self.moved_to} "
                f"({after}): one row per step, the newest")


def start_step(job_config) -> int:
    """The step a run starts after: the checkpoint TorchTitan will load (as `train` chose it:
    --checkpoint.load_step when the newest cannot resume), or 0."""
    ckpt = job_config.checkpoint
    if not ckpt.enable:
        return 0
    from moe_comm import checkpoints
    from moe_comm.errors import RecipeError

    try:
        resume = checkpoints.resume_step(Path(job_config.job.dump_folder) / ckpt.folder, ckpt.load_step)
    except RecipeError:  # `train` refused this folder already; nothing here resumes
        return 0
    return resume.step or 0


def newest_rows(lines: list[str]) -> list[dict]:
    """The rows of the newest start for each step, in step order. A step that does not rise
    above the previous row's marks a new start from before it: the earlier rows from that step
    on are superseded."""
    return [row for row, _ in _newest(lines)]


def _newest(lines: list[str]) -> list[tuple[dict, int]]:
    """(row, line index) of `newest_rows`; lines that are not records are left out."""
    kept: list[tuple[dict, int]] = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
            row["step"] = int(row["step"])
        except (ValueError, KeyError, TypeError):
            continue
        while kept and kept[-1][0]["step"] >= row["step"]:
            kept.pop()
        kept.append((row, i))
    return kept


def begin(jsonl: str | os.PathLike, step: int) -> Start:
    """Apply the rule to `jsonl` for a run starting after `step` (see the module doc)."""
    path = Path(jsonl)
    start = Start(step)
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return start
    keep = {i for row, i in _newest(lines) if row["step"] <= step}
    moved = [line for i, line in enumerate(lines) if i not in keep]
    start.kept = len(keep)
    if not moved:
        return start
    start.moved = len(moved)
    for line in moved:
        try:
            start.steps_moved.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            pass
    start.moved_to = path.with_name(f"{SUPERSEDED_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl")
    start.moved_to.write_text("".join(line + "\n" for line in moved))
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text("".join(lines[i] + "\n" for i in sorted(keep)))
    os.replace(tmp, path)  # a crash in between leaves the old file or the new, never half of one
    return start


def steady_steps(steps: list[int], warmup: int = WARMUP_STEPS) -> list[int]:
    """The steps a run's steady-state figures are taken over (see WARMUP_STEPS)."""
    return [s for s in steps if s > warmup] or list(steps[-1:])


def window_text(steady: list[int], warmup: int = WARMUP_STEPS) -> str:
    """'steps 3-5 (after a 2-step warm-up)', or what stands in when no step came after it."""
    if not steady:
        return "no step"
    if steady[0] <= warmup:
        return f"step {steady[-1]} alone (no step after the {warmup}-step warm-up)"
    span = f"steps {steady[0]}-{steady[-1]}" if len(steady) > 1 else f"step {steady[0]}"
    return f"{span} (after a {warmup}-step warm-up)"
