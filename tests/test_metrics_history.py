"""One row per step in metrics.jsonl across reruns, resumes and takeovers (moe_comm.metrics.history):
the rule at a run's start, `report` reading by the same rule, W&B's run id, and the processor
applying it before its first row. Before: the README's main job run twice read steps 1-5 twice,
and a taken-over run read 1,2,3,4,4,5..10."""

import json
import os

import pytest

from moe_comm.metrics import history, keys, naming


def _write(path, steps, tag, extra_lines=()):
    with open(path, "a") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "tag": tag, keys.STEP_MS: 100.0}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_rerun_without_a_checkpoint_starts_a_fresh_file_keeping_the_old_beside_it(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    _write(jsonl, range(1, 6), "first")
    start = history.begin(jsonl, 0)
    assert jsonl.read_text() == "" and start.moved == 5 and start.kept == 0
    assert start.moved_to.parent == tmp_path and start.moved_to.name.startswith("metrics.superseded-")
    assert [r["step"] for r in _rows(start.moved_to)] == [1, 2, 3, 4, 5]
    assert "steps 1-5 of an earlier start (5 line(s)) moved from" in start.message(str(jsonl))
    _write(jsonl, range(1, 6), "second")
    assert [(r["step"], r["tag"]) for r in _rows(jsonl)] == [(s, "second") for s in range(1, 6)]


def test_a_resume_keeps_the_steps_up_to_its_checkpoint_and_moves_the_rest(tmp_path):
    """A run killed after logging step 4 whose last checkpoint is step 3 (a stale claim taken
    over): the next start resumes after step 3; step 4's row, and a line cut by the kill, move."""
    jsonl = tmp_path / "metrics.jsonl"
    _write(jsonl, range(1, 5), "first", extra_lines=['{"step": 5, "tag": "fir'])
    start = history.begin(jsonl, 3)
    assert (start.kept, start.moved) == (3, 2) and start.steps_moved == [4]
    assert "step 4 of an earlier start (2 line(s))" in start.message(str(jsonl))
    _write(jsonl, range(4, 11), "second")
    assert [r["step"] for r in _rows(jsonl)] == list(range(1, 11))
    assert [r["tag"] for r in _rows(jsonl)][3:] == ["second"] * 7
    assert history.begin(jsonl, 10).moved == 0  # nothing after the checkpoint: nothing moves
    assert not history.begin(tmp_path / "none.jsonl", 0).moved  # no file yet


def test_report_reads_a_file_from_before_the_rule_by_the_same_rule(tmp_path):
    """A legacy file: steps 1-5, then a rerun that stopped at 3: the newest start's rows only
    (keeping the last row of each step would have mixed in the first run's 4 and 5)."""
    from moe_comm import report

    jsonl = tmp_path / "metrics.jsonl"
    _write(jsonl, range(1, 6), "first")
    _write(jsonl, range(1, 4), "second")
    run = report.load_run(jsonl)
    assert [(r["step"], r["tag"]) for r in run.records] == [(1, "second"), (2, "second"), (3, "second")]


def test_a_start_that_supersedes_logged_steps_gets_its_own_wandb_run(monkeypatch):
    """W&B drops a step it already has: under Slurm a requeue that supersedes logged steps logs to
    a W&B run of its own (the restart's), one that supersedes nothing continues the job's."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "soperator")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    job = naming.wandb_run_id("name")
    assert naming.wandb_run_id("name", superseded=True) == job + "-r2"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert naming.wandb_run_id("name", superseded=True) is None  # outside Slurm every start is a new W&B run


@pytest.fixture
def processor_in(tmp_path, caplog):
    """Builds the processor as TorchTitan does (one rank, no process group) into tmp_path/dump."""
    import logging

    import moe_comm.titan  # noqa: F401  the CPU adaptations
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    from moe_comm.metrics import build_metrics_processor

    caplog.set_level(logging.INFO)

    def build(*extra):
        job_config = ConfigManager().parse_args([
            "--job.custom_config_module", "moe_comm.config", "--job.dump_folder", str(tmp_path / "dump"),
            "--metrics.no-enable_wandb", "--training.steps", "5", *extra])
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
        return build_metrics_processor(job_config, dims)

    return build


def test_the_processor_applies_the_rule_before_its_first_row(processor_in, tmp_path, caplog):
    from moe_comm import console

    dump = tmp_path / "dump"
    dump.mkdir()
    _write(dump / "metrics.jsonl", range(1, 6), "first")
    processor = processor_in()
    processor.close()
    assert (dump / "metrics.jsonl").read_text() == ""
    assert len(list(dump.glob("metrics.superseded-*.jsonl"))) == 1
    shown = [r.getMessage() for r in caplog.records if getattr(r, console.CONSOLE, False)]
    assert any(m.startswith("moe_comm: steps 1-5 of an earlier start") for m in shown), shown
