"""experiments/memory_check.py with a stand-in launcher: each configuration's overrides reach the
run, the measured peak is the maximum over steps of TorchTitan's memory fields, the error is
against the estimate `check` computes for the same overrides, a failed run is recorded while the
others go on, and the report rebuilds the table from the JSON."""

import json
import sys
import textwrap
from pathlib import Path

from moe_comm import recipe
from moe_comm.predict import estimate, scale_model
from in_process import run_script
from moe_comm.metrics import keys

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "memory_check.py"
RECIPE = "recipes/deepseek_v3_671b_h200x1.toml"

# Stands in for `python -m moe_comm train`: peaks grow with the batch, fall with AC, and step 3
# is the largest; full AC at batch 4 dies like an OOM.
FAKE_TRAIN = textwrap.dedent(
    """
    import json, os, sys
    args = sys.argv[1:]
    opt = lambda name: args[args.index(name) + 1]
    mode, batch = opt("--activation_checkpoint.mode"), int(opt("--training.local_batch_size"))
    if mode == "selective":
        assert opt("--activation_checkpoint.selective_ac_option") == "op"
    if mode == "full" and batch == 4:
        print("torch.OutOfMemoryError: CUDA out of memory.")
        sys.exit(1)
    base = {{"none": 80.0, "selective": 70.0, "full": 60.0}}[mode] + 10 * batch
    with open(os.path.join(opt("--job.dump_folder"), "metrics.jsonl"), "w") as f:
        for step in range(1, int(opt("--training.steps")) + 1):
            bump = 1.5 if step == 3 else 0.0
            f.write(json.dumps({{"step": step, "{active}": base + bump, "{reserved}": base + 5 + bump / 3,
                                "{tps}": 1.0}}) + "\\n")
    """
)


def _estimate(mode: str, batch: int) -> estimate.MemoryEstimate:
    ov = ["--activation_checkpoint.mode", mode, "--training.local_batch_size", str(batch)]
    r = recipe.load(str(REPO / RECIPE), ov, device="cuda", gpu="H200", check_paths=False)
    return scale_model.memory(scale_model.workload_from_recipe(r), "nccl")  # the runs' backend


def test_runs_compare_measured_peaks_with_the_estimate(tmp_path):
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN.format(active=keys.MEM_ACTIVE, reserved=keys.MEM_RESERVED, tps=keys.TPS))
    out = tmp_path / "results"
    proc = run_script(SCRIPT, "--recipe", RECIPE, "--steps", "4", "--configs", "none:1", "selective:2", "full:4",
                      "full:2", "--out", str(out), "--launcher", f"{sys.executable} {fake}", cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "memory_check.json").read_text())
    rows = {(r["ac"], r["local_batch"]): r for r in doc["rows"]}
    assert list(rows) == [("none", 1), ("selective", 2), ("full", 4), ("full", 2)]
    assert rows[("full", 4)]["status"] == "failed" and rows[("full", 4)]["error"] == "oom"
    for (mode, batch), row in rows.items():
        est = _estimate(mode, batch)
        assert abs(row["estimate"]["in_use_gib"] - est.total / estimate.GiB) < 1e-9
        if row["status"] != "ok":
            continue
        base = {"none": 80.0, "selective": 70.0, "full": 60.0}[mode] + 10 * batch
        m = row["measured"]
        assert (m["in_use_gib"], m["peak_step"], m["steps"]) == (base + 1.5, 3, 4)
        assert abs(m["reserved_gib"] - (base + 5.5)) < 1e-9
        assert abs(row["error_in_use_pct"] - 100 * (est.total / estimate.GiB / (base + 1.5) - 1)) < 1e-9
        assert "--activation_checkpoint.mode " + mode in row["run"]["command"]
    assert "| selective | 2 |" in proc.stdout and "| full | 4 | - |" in proc.stdout

    again = run_script(SCRIPT, "--out", str(out), "--report-only", cwd=REPO)
    assert again.returncode == 0 and "| none | 1 |" in again.stdout


def test_estimate_only_and_bad_config():
    proc = run_script(SCRIPT, "--estimate-only", cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    first = _estimate("none", 1).total / estimate.GiB
    assert f"AC none      local batch 1: {first:6.1f} GiB in use" in proc.stdout
    assert len(proc.stdout.strip().splitlines()) == 4
    bad = run_script(SCRIPT, "--estimate-only", "--configs", "partial:2", cwd=REPO)
    assert bad.returncode != 0 and "AC_MODE:LOCAL_BATCH" in bad.stderr
