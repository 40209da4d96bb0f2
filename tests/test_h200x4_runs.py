"""experiments/h200x4_runs.py and experiments/run_h200x4.sh, issue 27's set for four H200s, on
CPU: every run's command is one fp8_dispatch_training accepts, with the layout's overrides and
its own backend and overlap; the model predicts every run (the recorded predictions cover the
set); the shell script parses and inserts its resume flags before the TorchTitan overrides."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments import h200x4_runs  # noqa: E402
from in_process import run_script  # noqa: E402


def test_every_group_is_a_command_fp8_dispatch_training_takes(tmp_path):
    for g in h200x4_runs.GROUPS:
        cmd = g.command(str(tmp_path / "out"))
        split = cmd.index("--")
        argv = cmd[2:split] + ["--dataset-path", "./assets/tiny/c4_tiny", "--tokenizer", "./assets/tiny",
                               "--dry-run"] + cmd[split:]
        proc = run_script(REPO / "experiments" / "fp8_dispatch_training.py", *argv, cwd=REPO)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == len(g.runs)
        for entry, line in zip(g.runs, lines):
            backend, dtype, overlap = entry.split(":")
            words = shlex.split(line)
            assert words[words.index("--moe_comm.backend") + 1] == backend
            assert words[words.index("--moe_comm.dispatch_dtype") + 1] == dtype
            assert words[words.index("--moe_comm.overlap") + 1] == overlap
            assert " ".join(g.layout) in line and "--profiling.enable_profiling" in line


def test_the_set_covers_issue_27():
    names = {g.name for g in h200x4_runs.GROUPS}
    assert {"pp2_1f1b_m2", "pp2_1f1b_m4", "pp2_interleaved1f1b_m2", "pp2_interleaved1f1b_m4"} <= names
    ep4 = next(g for g in h200x4_runs.GROUPS if g.name == "ep4")
    assert {r.split(":")[0] for r in ep4.runs} == {"nccl", "nvshmem", "deepep"} and "nvshmem:fp8:none" in ep4.runs
    for g in h200x4_runs.GROUPS:
        if g.name.startswith("pp2"):
            assert {r.split(":")[2] for r in g.runs} == {"none", "chunked"}


def test_every_run_is_predicted_and_the_record_covers_the_set(tmp_path):
    doc = h200x4_runs.predict(tmp_path / "p.json")
    runs = [(g.name, r) for g in h200x4_runs.GROUPS for r in g.runs]
    assert [(row["group"], row["run"]) for row in doc["rows"]] == runs
    for row in doc["rows"]:
        assert row["step_ms"] > 0 and row["tokens_per_s_per_gpu"] > 0
        assert (row["bubble_ms"] > 0) == row["group"].startswith("pp2")
        assert (row["moe_comm_hidden_ms"] > 0) == row["run"].endswith(":chunked")
    recorded = json.loads((REPO / "results" / "h200x4" / "predictions.json").read_text())
    assert [(row["group"], row["run"]) for row in recorded["rows"]] == runs
    assert "PREDICTIONS" in recorded["what"] and recorded["recipe"] == h200x4_runs.RECIPE


def test_the_device_script_parses_and_resumes_before_the_overrides():
    script = REPO / "experiments" / "run_h200x4.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert '"${line/ -- / --resume --budget-s $left -- }"' in text
    line, left = h200x4_runs.GROUPS[1].command("OUT"), 100
    joined = shlex.join(line)
    inserted = subprocess.run(["bash", "-c", f'line={shlex.quote(joined)}; left={left}; echo "${{line/ -- / --resume '
                               f'--budget-s $left -- }}"'], capture_output=True, text=True).stdout.split()
    assert inserted.index("--resume") < inserted.index("--") < inserted.index("--parallelism.pipeline_parallel_degree")
