"""End to end on CPU: the README's main job (`python -m moe_comm train recipes/debug_cpu.toml`,
2 ranks, EP=2, gloo; conftest's shared run) writes the comm breakdown to its step line, its
JSONL and an offline W&B run, and prints the `wandb sync` command."""

import glob
import json
import re
from pathlib import Path

from moe_comm.metrics import keys
from test_console import STEP_LINE_RE

NEW_KEYS = (
    keys.DISPATCH_MS, keys.COMBINE_MS, keys.DISPATCH_FWD_MS, keys.DISPATCH_BWD_MS,
    keys.COMBINE_FWD_MS, keys.COMBINE_BWD_MS, keys.COMM_MS, keys.STEP_MS, keys.COMM_EXPOSED_PCT,
    keys.IMBALANCE_RANK, keys.IMBALANCE_EXPERT, keys.SENT_GB, keys.COMM_BW,
)
STEPS = 5  # recipes/debug_cpu.toml


def test_cpu_default_recipe_logs_comm_breakdown(default_run):
    console, dump = default_run.console, default_run.dump

    # console: one line per step, with the comm breakdown (tests/test_console.py pins its fields)
    steps = [STEP_LINE_RE.match(line.split(" - INFO - ", 1)[1]) for line in console.splitlines()
             if " - INFO - step " in line]
    assert len(steps) == STEPS and all(steps), console[-4000:]
    assert all(float(m["dispatch"]) > 0 and float(m["combine"]) > 0 and m["mfu"] == "n/a" for m in steps)

    # JSONL: one object per step with TorchTitan's and our keys
    lines = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    for line in lines:
        for key in NEW_KEYS + (keys.TPS, keys.TFLOPS, keys.LOSS, keys.MEM_RESERVED):
            assert isinstance(line[key], (int, float)), key
        assert line[keys.BACKEND] == "nccl" and line[keys.RECIPE] == "debug_cpu"
        assert line[keys.EP_SIZE] == 2 and line[keys.SENDS_PER] == "expert"
        assert line[keys.MFU] is None  # CPU: no peak, so no MFU rather than a wrong one
        assert line[keys.SENT_GB] > 0 and line[keys.IMBALANCE_EXPERT] >= 1.0
        assert 0 < line[keys.COMM_EXPOSED_PCT] < 100

    # offline W&B run, and the command that uploads it
    sync = re.search(r"wandb sync (\S+)", console)
    assert sync, console[-4000:]
    run_dir = Path(sync.group(1))
    assert run_dir.name.startswith("offline-run-") and str(run_dir).startswith(str(dump))
    # protobuf records; keys, name and group are plain strings inside (small run: one block)
    run_bytes = Path(glob.glob(str(run_dir / "run-*.wandb"))[0]).read_bytes()
    for needle in NEW_KEYS + (keys.MFU, "debug_cpu", "recv_capacity_factor"):
        assert needle.encode() in run_bytes, needle
