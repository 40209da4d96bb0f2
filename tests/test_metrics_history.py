"""One row per step in metrics.jsonl across reruns, resumes and takeovers (moe_comm.metrics.history):
the rule at a run's start, `report` reading by the same rule, W&B's run id, and the processor
applying it before its first row. Before: the README's main job run twice read steps 1-5 twice,
and a taken-over run read 1,2,3,4,4,5..10."""

import json

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
        processor = build_metrics_processor(job_config, dims)
        processor.num_flops_per_token = 1_000_000
        return processor

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


# ---- figures that agree: the footer's and report's window (issue 32 item 7) -------------------

def test_the_steady_window_is_one_rule_and_says_itself():
    assert history.steady_steps([1, 2, 3, 4, 5]) == [3, 4, 5]
    assert history.window_text([3, 4, 5]) == "steps 3-5 (after a 2-step warm-up)"
    assert history.steady_steps([1]) == [1]  # nothing after the warm-up: the last step alone
    assert history.window_text([1]) == "step 1 alone (no step after the 2-step warm-up)"
    assert history.steady_steps([501, 502]) == [501, 502]  # a resumed run's steps are past the warm-up


def test_footer_and_report_give_the_same_ms_per_step_over_the_same_steps(processor_in, tmp_path, caplog):
    """Five steps of 2, 2, 1, 1, 1 tenths of a second: both say 0.1 s over steps 3-5 (the footer
    said "after the first", report "after the first 2": different medians of one run)."""
    import re
    import time

    from moe_comm import console, report

    processor = processor_in()
    for step, seconds in enumerate((0.4, 0.4, 0.1, 0.1, 0.2), start=1):
        processor.ntokens_since_last_log += 6
        processor.data_loading_times.append(0.0)
        time.sleep(seconds)
        processor.log(step, 1.0, 1.0, 0.5)
    processor.close()
    footer = [r.getMessage() for r in caplog.records if getattr(r, console.CONSOLE, False)][-1]
    m = re.search(r"median (\d+\.\d+) s/step over steps 3-5 \(after a 2-step warm-up\)$", footer)
    assert m, footer
    summary = report.summarize_run(report.load_run(tmp_path / "dump" / "metrics.jsonl"))
    assert summary["steps_summarized"] == [3, 4, 5]
    assert abs(summary["step_ms"] / 1e3 - float(m.group(1))) < 0.006


def test_a_one_step_run_does_not_claim_a_median_after_the_first(processor_in, caplog):
    from moe_comm import console

    processor = processor_in("--training.steps", "1")
    processor.ntokens_since_last_log += 6
    processor.data_loading_times.append(0.0)
    processor.log(1, 1.0, 1.0, 0.5)
    processor.close()
    footer = [r.getMessage() for r in caplog.records if getattr(r, console.CONSOLE, False)][-1]
    assert "after the first" not in footer and "median" not in footer
    assert footer.endswith("s/step: step 1 alone (no step after the 2-step warm-up)"), footer


def test_report_says_n_a_where_the_step_line_does_on_cpu(tmp_path):
    """A CPU run: TFLOPS, MFU and memory are n/a on the step line; report printed 0.0."""
    from moe_comm import report
    from moe_comm.metrics.processor import JsonlLogger

    jsonl = JsonlLogger(str(tmp_path / "metrics.jsonl"), {keys.DEVICE: "CPU", keys.BACKEND: "nccl"})
    for step in range(1, 5):
        jsonl.log({keys.TPS: 50.0, keys.TFLOPS: 0.002, keys.MFU: float("nan"), keys.MEM_RESERVED: 0.0,
                   keys.STEP_MS: 100.0, keys.LOSS: 5.0}, step)
    jsonl.close()
    s = report.summarize_run(report.load_run(tmp_path / "metrics.jsonl"))
    assert (s["tflops"], s["mfu"], s["mem_reserved_gib"]) == (None, None, None)
    row = report.markdown_table([{**s, "vs_nccl": None}]).splitlines()[2].split(" | ")
    assert row[5:7] == ["n/a", "n/a"] and row[-3] == "n/a" and row[-1] == "3-4 |", row
